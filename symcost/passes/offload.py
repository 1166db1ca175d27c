"""FSDP2's CPU offload (``--offload``) on one rank: the bytes it keeps on the host and the bytes
it moves between host and device per step, read off the traced rank (docs/parallel.md §0.2); and
activation offload (``--offload-activations``, ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
around the forward: :func:`activation_summary`, docs/memory.md "Activation offload").

The traced rank runs ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` with its two
copies recorded as ops (:mod:`symcost.frontends.offload`): ``symcost.h2d`` (a parameter shard to
the device before each all-gather of its unit, ``FSDPParam.all_gather_inputs``) and
``symcost.d2h`` (a reduced gradient shard to the host, ``foreach_reduce``). The device's peak is
:class:`~symcost.passes.memory.MemoryModel`'s (the model states on the host: ``MemoryModel.host``).
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.frontends.layout import layout_of
from symcost.frontends.offload import D2H, H2D, SAVE_D2H, SAVE_H2D
from symcost.graph.ops import PHASES
from symcost.graph.rules import nbytes

#: the two directions, by op name (``str(op.overloadpacket)``)
DIRECTIONS = {"h2d": H2D, "d2h": D2H}
#: activation offload's two directions (symcost.frontends.offload.save_on_host)
SAVE_DIRECTIONS = {"h2d": SAVE_H2D, "d2h": SAVE_D2H}


def _copied(an, name: str, phase: str) -> sympy.Expr:
    if phase not in (*PHASES, "train"):
        raise SymcostError(f"unknown phase {phase!r}; accepted: forward, backward, train")
    phases = PHASES if phase == "train" else (phase,)
    return sympy.expand(sympy.Add(*[op.repeat * nbytes(op.in_shapes[0], op.in_dtypes[0]) for op in an.ops
                                    if op.name.rpartition(".")[0] == name and op.phase in phases]))


def activation_bytes(an, kind: str, phase: str = "train") -> sympy.Expr:
    """Bytes activation offload copies per step, ``kind`` ``"d2h"`` (every tensor autograd saves,
    packed to the host in the forward: numel × element size of each save, parameters and repeated
    saves of one tensor included, as ``save_on_cpu``'s ``pack_to_cpu`` copies them) or ``"h2d"``
    (each packed tensor copied back when its backward node unpacks it), during ``phase``; a
    polynomial in the symbols: Σ over the traced copy ops of repeat × bytes. 0 without
    ``--offload-activations``.

    Raises:
        SymcostError: an unknown kind or phase.
    """
    if kind not in SAVE_DIRECTIONS:
        raise SymcostError(f"unknown transfer {kind!r}; accepted: {', '.join(SAVE_DIRECTIONS)}")
    return _copied(an, SAVE_DIRECTIONS[kind], phase)


def activation_summary(an, sizes: Mapping[str, int] | None = None, device=None) -> dict[str, Any]:
    """Activation offload of a trace with ``--offload-activations`` (any layout: one rank):
    ``host`` (bytes of pinned host memory the packed tensors hold at the end of the forward, the
    host's peak for them: all packed in the forward, none freed before the backward; =
    :func:`activation_bytes` d2h forward), ``d2h`` and ``h2d`` ({forward, backward, train}), each a
    formula; with ``sizes``, ``values`` (the same in bytes); with ``device`` too, ``seconds``
    {forward, backward} (each phase's copies over the device's host link, :func:`host_link`,
    FSDP2 offload's copies of that phase included), ``host_link`` and ``host_bandwidth``. The
    device peak is :class:`~symcost.passes.memory.MemoryModel`'s: the recording's schedule holds
    no packed tensor and each unpacked copy while its backward node runs.

    Raises:
        SymcostError: ``an`` was not traced with ``--offload-activations``; a ``device`` without
            a host link figure.
    """
    if not layout_of(an).offload_activations:
        raise SymcostError("this trace has no activation offload; trace with --offload-activations")
    out: dict[str, Any] = {"host": {"total": activation_bytes(an, "d2h", "forward")}}
    for kind in SAVE_DIRECTIONS:
        out[kind] = {ph: activation_bytes(an, kind, ph) for ph in (*PHASES, "train")}
    if sizes is not None:
        env = an.bind(**sizes)
        out["values"] = {k: {p: sympy.sympify(v).xreplace(env) for p, v in d.items()} for k, d in out.items()}
        if device is not None:
            name, bw = host_link(device)
            out.update(seconds=transfer_seconds(an, device, env), host_link=name, host_bandwidth=bw)
    return out


def transfer_bytes(an, kind: str, phase: str = "train") -> sympy.Expr:
    """Bytes one rank copies per step between host and device, ``kind`` ``"h2d"`` (parameter
    shards before the all-gathers: each unit's shard bytes, in the sharded parameters' dtype,
    once per all-gather of the unit: twice per step for a block under ``reshard_after_forward``,
    once for the root) or ``"d2h"`` (the reduced gradient shards, in the parameters' dtype, once
    per step), during ``phase`` (forward, backward, train), a polynomial in the symbols and
    ``DP``: Σ over the traced copy ops of repeat × the bytes of the tensor copied
    (numel × element size). 0 for a trace without ``--offload``.

    Raises:
        SymcostError: an unknown kind or phase.
    """
    if kind not in DIRECTIONS:
        raise SymcostError(f"unknown transfer {kind!r}; accepted: {', '.join(DIRECTIONS)}")
    if phase not in (*PHASES, "train"):
        raise SymcostError(f"unknown phase {phase!r}; accepted: forward, backward, train")
    phases = PHASES if phase == "train" else (phase,)
    name = DIRECTIONS[kind]
    return sympy.expand(sympy.Add(*[op.repeat * nbytes(op.in_shapes[0], op.in_dtypes[0]) for op in an.ops
                                    if op.name.rpartition(".")[0] == name and op.phase in phases]))


def host_link(device) -> tuple[str, float]:
    """``(name, bytes/s per direction)`` of ``device``'s host link (``host_link``,
    ``host_bandwidth`` of its ``interconnect`` table in devices.toml, with their source).

    Raises:
        SymcostError: the device lists no host link figure.
    """
    ic = getattr(device, "interconnect", None) or {}
    if not ic.get("host_bandwidth"):
        raise SymcostError(f"{device.key} lists no host link (host_bandwidth in its [{device.key}.interconnect] "
                           "table); add one with --devices-file to price --offload's copies")
    return ic.get("host_link", "host link"), float(ic["host_bandwidth"])


def summary(an, mm, sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The offload part of ``report --dp N --shard fsdp --offload``: ``host`` (the rank's model
    states on the host, bytes by part: ``params``, ``grads``, ``optimizer``, ``master_weights``,
    and ``total``; from ``mm``, a :class:`~symcost.passes.memory.MemoryModel` of ``an``),
    ``h2d`` and ``d2h`` ({forward, backward, train}: :func:`transfer_bytes`), each a formula;
    with ``sizes``, ``values``: the same in bytes.

    Raises:
        SymcostError: ``an`` was not traced with ``--offload``.
    """
    if not layout_of(an).offload:
        raise SymcostError("this trace has no CPU offload; trace with --dp N --shard fsdp --offload")
    host = {k: sympy.expand(sympy.sympify(v)) for k, v in mm.host.items()}
    host["total"] = sympy.expand(sympy.Add(*host.values()))
    out: dict[str, Any] = {"host": host}
    for kind in DIRECTIONS:
        out[kind] = {ph: transfer_bytes(an, kind, ph) for ph in (*PHASES, "train")}
    if sizes is not None:
        env = an.bind(**sizes)
        out["values"] = {k: {p: sympy.sympify(v).xreplace(env) for p, v in d.items()} for k, d in out.items()}
    return out


def transfer_seconds(an, device, env: Mapping) -> dict[str, float]:
    """Seconds of each phase's host<->device copies on ``device``'s host link (:func:`host_link`,
    per direction), at the bound sizes ``env`` (``Analysis.bind``): the larger direction's bytes
    (FSDP2 offload's, :func:`transfer_bytes`, plus activation offload's, :func:`activation_bytes`)
    over the link's per-direction bandwidth (PCIe is full duplex: a phase's H2D and D2H copies
    can run at once), a lower bound as the roofline's times are (shared/conventions.md, Time)."""
    _, bw = host_link(device)
    return {ph: max(float(sympy.sympify(transfer_bytes(an, k, ph) + activation_bytes(an, k, ph)).xreplace(env))
                    for k in DIRECTIONS) / bw
            for ph in PHASES}

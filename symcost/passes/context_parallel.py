"""What one context-parallel rank exchanges (``report --cp N``; docs/parallel.md §15): the bytes
of the ring's collectives over the CP group, by kind and phase, from the traced graph's
collective nodes (:meth:`symcost.graph.analysis.Analysis.comm_bytes`), and the tokens the rank
holds.

Per rank and per attention layer, with PyTorch's ring attention (Liu et al. 2023;
``torch.distributed.tensor.experimental._context_parallel._attention``), x = the bytes of the
rank's keys and values (2·B·K·(S/CP)·D elements of the attention's dtype):

* forward, ``set_rotate_method("allgather")``: one all-gather of the rank's K/V, (CP-1)·x sent
  (nccl-tests' ring: (n-1)/n of the gathered CP·x); ``"alltoall"``: CP-1 passes to the next rank
  (``permute_tensor``), x each;
* backward: the forward's K/V rotation once more, and CP passes of the dK/dV accumulators (fp32
  under ``convert_to_f32``, PyTorch's default: 2·x at 16-bit) by all-to-all, whatever the method.

These are what the traced graph's collective nodes hold; the formulas come from the trace (CP is
pinned at the request: :func:`symcost.frontends.context_parallel.context_parallel`).
"""
from __future__ import annotations

from typing import Mapping

import sympy

from symcost.frontends.layout import layout_of
from symcost.graph.ops import PHASES
from symcost.graph.totals import comm_group

#: the collective kinds the ring runs
KINDS = ("all_gather", "all_to_all")


def summary(an, sizes: Mapping[str, int] | None = None) -> dict:
    """``{"cp", "rotate", "shard", "comm": {kind: {phase: bytes formula}, "total": formula},
    "params_rank", "values"}`` (``shard``: the data-parallel strategy FSDP2 runs over dp_shard × cp,
    or None): the bytes one CP rank sends (= receives) per step over the CP group, by kind
    (all-gather, all-to-all) and phase; ``params_rank`` the parameter elements the rank holds
    (``Analysis.params_shard``: every parameter under CP alone, FSDP2's dim-0 shard over the DP·CP
    ranks with ``--dp N --shard fsdp``); ``values`` the same at ``sizes`` (None without sizes).

    Raises:
        ValueError: ``an`` was not traced under ``--cp``.
    """
    layout = layout_of(an)
    if not layout.cp:
        raise ValueError("not a context-parallel trace")
    comm = {k: {ph: an.comm_bytes(k, ph, group="CP") for ph in PHASES} for k in KINDS}
    total = sympy.Add(*[v for d in comm.values() for v in d.values()])
    out = {"cp": an.pinned.get("CP", sympy.Symbol("CP")), "rotate": layout.cp_rotate, "shard": layout.shard,
           "comm": comm, "total": total, "params_rank": an.params_shard, "values": None}
    if sizes:
        env = an.bind(**{k: v for k, v in sizes.items() if k in an.symbols})
        out["values"] = {"comm": {k: {ph: sympy.sympify(v).xreplace(env) for ph, v in d.items()}
                                  for k, d in comm.items()},
                         "total": sympy.sympify(total).xreplace(env),
                         "params_rank": sympy.sympify(an.params_shard).xreplace(env)}
    return out


def ring_seconds(blocks, kv: float, dkv: float | None = None, allgather: bool = False) -> float:
    """Seconds one ring-attention call takes, as PyTorch schedules it (torch 2.13,
    torch/distributed/tensor/experimental/_context_parallel/_attention.py), two streams: the
    kernels in program order, and the CP group's collectives one after another (one process group:
    one communication stream, NCCL runs its collectives in issue order).

    ``_templated_ring_attention`` (forward, ``dkv`` None), step i of CP: wait for the K/V of step i
    (``rotater.next_buffer()``, i > 0), issue the K/V for step i + 1 (``exchange_buffers``,
    i < CP - 1), run block i. ``_AllToAllRotater`` sends one pass per step (``kv`` seconds each);
    ``_AllGatherRotater`` (``allgather``) gathers all K/V once, at step 0 (``kv`` seconds for the
    whole all-gather), waited at step 1. ``_templated_ring_attention_backward`` (``dkv`` given): the
    same K/V rotation, then after block i's gradients it waits for the dK/dV accumulators passed at
    step i - 1 and passes its own (``dkv_rotater``, all-to-all, ``dkv`` seconds each, every step); the
    last pass is waited after the loop.

    Args:
        blocks: seconds of each step's attention kernel (CP of them), in ring order.
        kv: seconds of one K/V pass (all-to-all) or of the one all-gather.
        dkv: seconds of one dK/dV pass (backward), or None (forward).
        allgather: the all-gather rotation.

    Returns:
        Seconds from the call's start until its outputs are ready (>= sum(blocks)).
    """
    n = len(blocks)
    t = comm = 0.0  # the kernel stream's clock, the time the communication stream is free
    kv_ready = dkv_ready = 0.0
    for i, c in enumerate(blocks):
        if i > 0:
            t = max(t, kv_ready)  # next_buffer(): wait for step i's K/V
        if i < n - 1 and (not allgather or i == 0):
            comm = kv_ready = max(t, comm) + kv  # exchange_buffers(): issued now, runs after what is queued
        t += c
        if dkv is not None:
            if i > 0:
                t = max(t, dkv_ready)  # the accumulators of step i - 1
            comm = dkv_ready = max(t, comm) + dkv
    if dkv is not None:
        t = max(t, dkv_ready)
    return t


def _ring_calls(an, env, seconds) -> list[dict]:
    """The ring-attention calls of each phase, from the op graph in program order: a call is CP
    attention kernels (``SymOp.attention``) and the CP group's collectives issued among them;
    ``{"phase", "repeat", "blocks": [seconds per execution], "bytes": {kind: bytes}}``."""
    cp = int(an.pinned["CP"])
    kv_passes = 1 if layout_of(an).cp_rotate == "allgather" else cp - 1
    passes = {"forward": kv_passes, "backward": kv_passes + cp}  # collectives per call
    calls, cur = [], None
    for op in an.ops:
        if op.phase not in ("forward", "backward"):
            continue
        is_comm = op.comm is not None and op.comm[0] in KINDS and comm_group(an, op) == "CP"
        if not (op.attention or is_comm):
            continue
        done = cur is not None and len(cur["blocks"]) == cp and (op.attention or cur["passes"] == passes[cur["phase"]])
        if cur is None or cur["phase"] != op.phase or done:
            cur = {"phase": op.phase, "repeat": int(sympy.sympify(op.repeat).xreplace(env)), "blocks": [],
                   "bytes": {k: 0 for k in KINDS}, "passes": 0}
            calls.append(cur)
        if op.attention:
            rep = sympy.sympify(op.repeat).xreplace(env)
            cur["blocks"].append(seconds[op.index] / float(rep) if rep else 0.0)
        else:
            cur["bytes"][op.comm[0]] += int(sympy.sympify(op.comm[2]).xreplace(env))
            cur["passes"] += 1
    return calls


def ring_link(an, device, env, nodes: int | None = None, devices_per_node: int | None = None):
    """``(link name, byte/s one direction, inside one node)`` of the CP group's ring on ``device``.
    The mesh is torchtitan's (``pp, dp_replicate, dp_shard, cp, tp``, innermost last), so a CP group
    is CP ranks TP apart: CP·TP consecutive ranks, inside a node's scale-up link where CP·TP divides
    the node's devices, else the per-device network (docs/parallel.md §15).

    Raises:
        SymcostError: a device without an interconnect; a ring over nodes on a device without a
            network figure; a cluster that cannot hold the CP ranks.
    """
    from symcost.errors import SymcostError
    from symcost.tracing.fit import SYMS

    ic = device.interconnect
    if not ic.get("link_bandwidth"):
        raise SymcostError(f"{device.key} lists no interconnect; add an [{device.key}.interconnect] table "
                           "(link_bandwidth, devices_per_node, network_bandwidth) with --devices-file")
    cp = int(an.pinned["CP"])
    tp = int(env.get(SYMS["TP"], an.pinned.get("TP", 1))) if layout_of(an).tp else 1
    span = cp * tp
    per_node = devices_per_node or ic.get("devices_per_node") or span
    if nodes is not None and nodes * per_node < cp:
        raise SymcostError(f"{nodes} node(s) of {per_node} devices do not hold CP = {cp} ranks")
    inside = span <= per_node and per_node % span == 0
    if not inside and not ic.get("network_bandwidth"):
        raise SymcostError(f"{device.key} lists no network_bandwidth for a ring over nodes")
    link, bw = ((ic.get("link", "link"), ic["link_bandwidth"]) if inside
                else (ic.get("network", "network"), ic["network_bandwidth"]))
    return link, bw, inside


def ring_exposure(an, env, seconds: Mapping[int, float], bw: float, latency: float = 0.0) -> dict:
    """The ring's exchange of one CP rank's step, per phase, as PyTorch schedules it
    (:func:`ring_seconds` per ring-attention call of the graph, :func:`_ring_calls`).

    Args:
        an: a ``--cp`` trace (CP pinned).
        env: bound symbol values (``an.bind``).
        seconds: ``{op index: seconds of the op, its repeats included}`` (the roofline's nodes for
            the bound, the performance model's for the prediction): the attention blocks' times.
        bw: the CP link's bytes per second, one direction.
        latency: seconds added to every pass (the α of an α–β collective: CP - 1 steps of the
            efficiency's ``collective_latency`` per pass; 0 for the bound).

    Returns:
        ``{"ring": {forward, backward}`` (the exchange's seconds in all, unhidden), ``"exposed"``
        {forward, backward} (what the schedule does not hide behind the call's blocks), ``"bytes"``
        {forward, backward} (per rank), ``"passes"`` (collectives issued)}.
    """
    cp = int(an.pinned["CP"])
    allgather = layout_of(an).cp_rotate == "allgather"
    ring = {"forward": 0.0, "backward": 0.0}
    exposed = {"forward": 0.0, "backward": 0.0}
    nbytes = {"forward": 0, "backward": 0}
    passes = 0
    kv_of_forward = None
    for call in _ring_calls(an, env, seconds):
        ph, b = call["phase"], call["bytes"]
        total = sum(b.values())
        if ph == "forward":
            kv_bytes = total
            kv_of_forward = kv_bytes
            dkv = None
        else:
            kv_bytes = kv_of_forward if kv_of_forward is not None else 0
            dkv = (total - kv_bytes) / cp / bw + latency
        kv = (kv_bytes / bw if allgather else kv_bytes / max(cp - 1, 1) / bw) + latency
        took = ring_seconds(call["blocks"], kv, dkv, allgather)
        exposed[ph] += call["repeat"] * (took - sum(call["blocks"]))
        n = call["passes"]
        ring[ph] += call["repeat"] * (total / bw + n * latency)
        nbytes[ph] += call["repeat"] * total
        passes += call["repeat"] * n
    return {"ring": ring, "exposed": exposed, "bytes": nbytes, "passes": passes}


def step_time(an, device, sizes: Mapping[str, int] | None = None, nodes: int | None = None,
              devices_per_node: int | None = None, fused: bool = True) -> dict:
    """One context-parallel rank's step time on ``device`` (``report --cp N --gpu``): the roofline's
    compute of every op (:func:`symcost.passes.roofline.roofline`) plus, per ring-attention call,
    the exchange its schedule does not hide behind the call's attention kernels
    (:func:`ring_seconds`, :func:`ring_exposure`); docs/parallel.md §15.

    The collectives are the graph's own CP-group nodes, bytes per rank (the forward's K/V: one
    all-gather or CP - 1 passes; the backward's K/V the same, the rest of its all-to-all bytes the
    CP dK/dV passes), over the link of the CP group (:func:`ring_link`). The blocks are the
    roofline's seconds of each attention kernel. Under FSDP2 (``--dp``) the step is
    :func:`symcost.passes.parallel.step_time`'s, which adds this ring to FSDP2's collectives.

    Args:
        an: a ``--cp`` trace (alone; CP pinned).
        device: a :class:`~symcost.hardware.devices.Device` with an ``interconnect`` table.
        sizes: symbol values.
        nodes, devices_per_node: the cluster (default: the device's ``devices_per_node``).
        fused: the roofline's fused bytes.

    Returns:
        ``compute`` {forward, backward}, ``ring`` {forward, backward} (the exchange's seconds in
        all, unhidden), ``exposed`` {forward, backward}, ``bytes`` {forward, backward} (the ring's,
        per rank), ``link``, ``link_bandwidth`` (byte/s, one direction), ``inside`` (the CP group
        within one node), ``cp``, ``rotate``,
        ``step_seconds``, ``exposed_comm_seconds``, ``mfu``, ``precision``, ``peak_flops``.

    Raises:
        SymcostError: not a context-parallel trace, a device without an interconnect, a cluster
            that cannot hold the CP ranks.
    """
    from symcost.errors import SymcostError
    from symcost.passes.roofline import roofline

    layout = layout_of(an)
    if not layout.cp or "CP" not in an.pinned:
        raise SymcostError("the ring's step time needs a context-parallel trace (--cp N)")
    env = an.bind(**{k: v for k, v in (sizes or {}).items() if k in an.symbols})
    link, bw, inside = ring_link(an, device, env, nodes, devices_per_node)
    r = roofline(an, device, {str(k): v for k, v in env.items()}, fused=fused, with_formulas=False)
    seconds = {n["index"]: n["seconds"] for n in r["nodes"]}
    compute = {ph: r["per_phase"].get(ph, {}).get("seconds", 0.0) for ph in ("forward", "backward")}
    got = ring_exposure(an, env, seconds, bw)
    step = sum(compute.values()) + sum(got["exposed"].values())
    peak, key = device.peak_for(r["precision"])
    return {"compute": compute, "ring": got["ring"], "exposed": got["exposed"], "bytes": got["bytes"], "link": link,
            "link_bandwidth": bw, "inside": inside, "cp": int(an.pinned["CP"]), "rotate": layout.cp_rotate,
            "step_seconds": step, "exposed_comm_seconds": step - sum(compute.values()),
            "mfu": r["model_flops"] / (step * peak) if step else 0.0, "precision": key, "peak_flops": peak,
            "source": device.interconnect.get("source", "")}

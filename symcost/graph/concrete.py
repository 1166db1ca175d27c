"""The costs of one recording at its concrete sizes, by the same cost rules the symbolic graph
uses (:mod:`symcost.graph.rules`): each recorded op's cost, and a recording's totals, the oracle
``trace`` checks its fitted formulas against (:func:`symcost.graph.build.trace`, fresh
recordings that took no part in the fit) and the tests compare with.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from symcost._lazy import LazyModule
from symcost.frontends.layout import group_size
from symcost.graph.ops import COMM_KINDS, PHASES
from symcost.graph.totals import trace_group

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import OpCall, Recording

rules = LazyModule("symcost.graph.rules")


def tree_flatten(*args, **kwargs):
    from torch.utils._pytree import tree_flatten as _f

    return _f(*args, **kwargs)


def tree_unflatten(*args, **kwargs):
    from torch.utils._pytree import tree_unflatten as _f

    return _f(*args, **kwargs)


def op_view(op: OpCall, in_shapes, out_shapes, ints) -> rules.OpView:
    """The cost rules' view of recorded op ``op`` with its input and output shapes given
    (concrete, or the fitted sympy shapes) and its integer arguments ``ints``: its arguments
    rebuilt from the recorded tree, tensors standing as their shapes."""
    from symcost.tracing.record import IntRef, TensorRef

    flat, spec = tree_flatten(op.args_tree, is_leaf=lambda x: isinstance(x, (TensorRef, IntRef)))
    vals = []
    for a in flat:
        if isinstance(a, TensorRef):
            vals.append(tuple(in_shapes[a.index]))
        elif isinstance(a, IntRef):
            vals.append(ints[a.index])
        else:
            vals.append(a)
    args, kwargs = tree_unflatten(vals, spec)
    return rules.OpView(
        op.op, op.name, in_shapes, [t.dtype for t in op.inputs], out_shapes,
        [t.dtype for t in op.outputs], tuple(args), dict(kwargs),
    )


def attention_flags(v: rules.OpView) -> tuple[bool, bool] | None:
    """``(is_causal, masked)`` of a fused attention call (its schema's ``is_causal``, or the raw
    memory-efficient kernel's ``custom_mask_type`` != 0; masked: an ``attn_mask``, ``attn_bias``
    or ``bias`` tensor given), None for an op without a causal argument. What PyTorch's CUDA SDPA
    dispatcher chooses a kernel by (symcost.hardware.attention)."""
    try:
        names = {a.name for a in v.op._schema.arguments}
    except AttributeError:
        return None
    if "is_causal" in names:
        causal = bool(rules._arg(v, "is_causal", False))
    elif "custom_mask_type" in names:
        causal = bool(rules._arg(v, "custom_mask_type", 0))
    else:
        return None
    masked = any(isinstance(rules._arg(v, n), tuple) for n in ("attn_mask", "attn_bias", "bias") if n in names)
    return causal, masked


def concrete_cost(op: OpCall) -> rules.Cost:
    """Cost of a recorded op at its concrete sizes (:func:`recomputed` for an op of activation
    checkpointing's recomputation)."""
    c = rules.cost(op_view(op, [t.shape for t in op.inputs], [t.shape for t in op.outputs], op.ints))
    return recomputed(c) if getattr(op, "recompute", False) else c


def recomputed(c: rules.Cost) -> rules.Cost:
    """The cost of an op that activation checkpointing runs again in the backward: its matmul
    FLOPs are hardware FLOPs only (shared/conventions.md: model FLOPs, MFU and 6·N·P do not count
    recomputation; HFU does), bytes and all-FLOPs as executed."""
    return dataclasses.replace(c, flops=0, flops_hw=c.flops_hw)


def concrete_totals(rec: Recording) -> dict[str, int]:
    """Totals of one concrete recording by the same rules: the oracle for the symbolic fit."""
    out = {f"{k}.{p}": 0 for k in ("flops", "flops_hw", "flops_all", "bytes", "transcendentals") for p in PHASES}
    for op in rec.ops:
        c = concrete_cost(op)
        out[f"flops.{op.phase}"] += int(c.flops)
        out[f"flops_hw.{op.phase}"] += int(c.flops_hw)
        out[f"flops_all.{op.phase}"] += int(c.flops_all)
        out[f"bytes.{op.phase}"] += int(c.bytes)
        out[f"transcendentals.{op.phase}"] += int(c.transcendental_total)
    out["params"] = sum(rules.numel(s) for s, _ in rec.params.values())
    out["saved"] = sum(s.nbytes for s in rec.saved)
    if rec.step != "train":
        out["kv"] = sum(rec.kv_layers)
    if rec.parallel is not None or any(op.group == "CP" for op in rec.ops):
        # bytes of every collective (ring, per rank), by kind (context parallelism alone: the ring's)
        for k in COMM_KINDS:
            out[f"comm.{k}"] = 0
        cp = rec.parallel is not None and any(op.group == "CP" for op in rec.ops)  # (FSDP2 over dp_shard × cp)
        # (expert parallelism under FSDP2: the dense parameters' group is dp_shard × ep)
        ep = rec.parallel not in (None, "ep") and any(op.group == "EP" for op in rec.ops)
        tp = ep and any(op.group == "TP" for op in rec.ops)  # (and over the TP ranks: DP·EP/TP, §14.9)
        for op in rec.ops:
            if rules.classify(op.op) == "comm":
                v = op_view(op, [t.shape for t in op.inputs], [t.shape for t in op.outputs], op.ints)
                # (a wait names no group; without a data- or tensor-parallel label the ring's is CP)
                n = group_size(op.group or (trace_group(rec) if rec.parallel is not None else "CP"),
                               rec.values.__getitem__, rec.replicate, cp=cp, ep=ep, tp=tp)
                kind, _, per_rank = rules.comm_volume(v, n)
                if kind in COMM_KINDS:  # (not a wait)
                    out[f"comm.{kind}"] += per_rank
        if rec.parallel is not None:
            out["shards"] = sum(rules.numel(s) for s in rec.param_shards.values())
    return out

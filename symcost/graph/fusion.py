"""Fused traffic: the bytes a compiled step moves once element-wise chains are fused.

An op's bytes in :mod:`symcost.graph.rules` are its inputs read plus its outputs written, each once
(the unfused lower bound of eager PyTorch). ``torch.compile`` (inductor) fuses chains of
pointwise ops, reductions and data movement into one kernel that keeps the intermediates in
registers: only what enters a fused region from outside is read, and only what leaves it (or is
the step's result) is written. Matmul-class ops stay their own (extern) kernels.

The estimate here (a pass: takes an :class:`~symcost.graph.analysis.Analysis`, returns plain data):

1. every op of the probe recording the fit used is a node of a ``networkx.Graph``; a fusible
   op (families pointwise, reduction, special, move, alloc of :mod:`symcost.graph.rules`) is joined
   to the fusible op that produced one of its inputs (through views, which move nothing), in the
   same phase (forward and backward are separate compiled graphs, as AOTAutograd makes them);
2. each connected component is one fused region (what inductor would keep in registers if it
   fused every connected element-wise chain: an optimistic estimate);
3. a fusible op is charged the inputs it reads from outside its region (each outside tensor once
   per region, to the first op that reads it) and the outputs it writes that are read outside
   its region or by nothing recorded (the step's results, gradients, tensors the next block
   reads); a matmul-class or unsupported op keeps its unfused bytes.

So, per op, ``fused_bytes <= bytes``, and the sum over a region is the region's fused traffic.
The check is inductor's own count of the bytes its scheduled kernels read and write
(``torch._inductor.graph.GraphLowering.count_bytes``, see :func:`symcost.validation.validate.inductor_bytes`
and tests/test_roofline_fusion.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy

from symcost._lazy import LazyModule
from symcost.graph.opsets import PARTIAL_WRITES, dtype_names, nbytes, partial_write_bytes

# the probe recordings' path needs the cost rules (torch); a cached analysis' stored estimate and
# ``written_bytes`` do not, so ``roofline``, ``mfu`` and ``time`` on a cached analysis import no torch
rules = LazyModule("symcost.graph.rules")
nx = LazyModule("networkx")

FUSIBLE = ("pointwise", "reduction", "special", "move", "alloc")


@dataclass
class FusionEstimate:
    """Fused traffic per op of an Analysis.

    Attributes:
        node_bytes: op index (``SymOp.index``) -> fused bytes of one execution (sympy).
        node_written: op index -> the part of ``node_bytes`` that is written.
        region_of: op index -> region id (fusible ops only).
        regions: region id -> op indices of the folded graph in it (execution order).
        exact: False when the Analysis had no probe recordings: node_bytes are then unfused.
        charged: op index -> (input positions read, output positions written) in its fused bytes,
            for the fusible ops (an op missing here is charged all its inputs and outputs, as
            unfused); None when not known (an older cached estimate).
    """

    node_bytes: dict[int, Any]
    node_written: dict[int, Any]
    region_of: dict[int, int]
    regions: dict[int, list[int]]
    exact: bool = True  # False: no recordings to fuse over, node_bytes are the unfused bytes
    charged: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None

    def total(self, an, phase: str = "train") -> sympy.Expr:
        """Fused bytes of ``phase`` (forward|backward|train) with repeats folded in, a polynomial."""
        phases = ("forward", "backward") if phase == "train" else (phase,)
        return sympy.expand(sympy.Add(*[
            op.repeat * self.node_bytes[op.index] for op in an.ops if op.phase in phases]))


def written_bytes(op) -> Any:
    """Bytes an op writes in the unfused count of :mod:`symcost.graph.rules`: its outputs (0 for an op
    that moves nothing: views, allocations)."""
    if op.cost.bytes == 0:
        return sympy.Integer(0)
    if op.name.rsplit(".", 1)[0] in PARTIAL_WRITES:
        return sympy.expand(partial_write_bytes(op)[1])
    return sympy.expand(sum((nbytes(s, d) for s, d in zip(op.out_shapes, dtype_names(op.out_dtypes))),
                            sympy.Integer(0)))


def estimate(an) -> FusionEstimate:
    """The fused-bytes estimate of every op of ``an`` (see the module docstring).

    Args:
        an: an :class:`~symcost.graph.analysis.Analysis` (needs its probe recordings).

    Returns:
        A :class:`FusionEstimate`; ``node_bytes[i] <= bytes of op i`` for every i. An Analysis
        without its probe recordings (e.g. rebuilt from saved data) gets the unfused bytes and
        ``exact = False``.
    """
    stored = getattr(an, "__dict__", {}).get("_stored_fusion")  # kept with a cached analysis
    if stored is not None and not getattr(an, "recordings", None):
        parsed = an.__dict__.get("_fusion_parsed")  # parsed once per analysis (plan calls this per layout)
        if parsed is not None:
            return parsed
        from symcost.tracing.fit import parse_formula as P

        an.__dict__["_fusion_parsed"] = FusionEstimate(node_bytes={int(i): P(v) for i, v in stored["node_bytes"]},
                              node_written={int(i): P(v) for i, v in stored["node_written"]},
                              region_of={int(i): int(r) for i, r in stored["region_of"]},
                              regions={int(r): list(ids) for r, ids in stored["regions"]},
                              exact=bool(stored["exact"]),
                              charged={int(i): (tuple(a), tuple(b)) for i, a, b in stored["charged"]}
                              if "charged" in stored else None)
        return an.__dict__["_fusion_parsed"]
    if not getattr(an, "recordings", None):
        return FusionEstimate(node_bytes={op.index: op.cost.bytes for op in an.ops},
                              node_written={op.index: written_bytes(op) for op in an.ops},
                              region_of={}, regions={}, exact=False, charged={})
    memo = getattr(an, "__dict__", {}).get("_fusion_estimate")  # (once per analysis: every roofline, predict asks)
    if memo is not None and memo[0] is an.ops and memo[1] is an.recordings:
        return memo[2]
    fe = _estimate(an)
    if hasattr(an, "__dict__"):
        an.__dict__["_fusion_estimate"] = (an.ops, an.recordings, fe)
    return fe


def _estimate(an) -> FusionEstimate:
    """:func:`estimate` from ``an``'s probe recordings (computed; ``estimate`` keeps it per analysis)."""
    ref = an.recordings[0]
    kept = {op.index: op for op in an.ops}
    families = [rules.classify(op.op) for op in ref.ops]
    value_of: dict[int, tuple[int, int]] = {}  # tensor id -> (producing op, output position)
    reads: list[list[tuple[int, tuple[int, int] | None, int]]] = []  # per op: (position, value, tid)
    consumers: dict[tuple[int, int], set[int]] = {}
    g = nx.Graph()
    for i, op in enumerate(ref.ops):
        fam = families[i]
        if fam == "view":
            base = value_of.get(op.inputs[0].tid) if op.inputs else None
            for t in op.outputs:
                if base is not None:
                    value_of[t.tid] = base
                else:
                    value_of.pop(t.tid, None)
            reads.append([])
            continue
        mine = []
        for k, t in enumerate(op.inputs):
            v = value_of.get(t.tid)
            mine.append((k, v, t.tid))
            if v is not None:
                consumers.setdefault(v, set()).add(i)
        reads.append(mine)
        if fam in FUSIBLE:
            g.add_node(i)
            for _, v, _ in mine:
                if v is not None and families[v[0]] in FUSIBLE and ref.ops[v[0]].phase == op.phase:
                    g.add_edge(i, v[0])
        for k, t in enumerate(op.outputs):
            value_of[t.tid] = (i, k)

    region_of: dict[int, int] = {}
    for rid, comp in enumerate(nx.connected_components(g)):
        for i in comp:
            region_of[i] = rid

    node_bytes: dict[int, Any] = {}
    node_written: dict[int, Any] = {}
    charged_io: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    charged: set[tuple[int, Any]] = set()  # (region, outside tensor) already read in that region
    for i, op in enumerate(ref.ops):
        sop = kept.get(i)
        if sop is None:
            continue
        fam = families[i]
        if fam not in FUSIBLE or op.name.rsplit(".", 1)[0] in PARTIAL_WRITES:  # its own kernel
            node_bytes[i] = sop.cost.bytes
            node_written[i] = written_bytes(sop)
            continue
        if fam == "alloc" or sop.cost.bytes == 0:
            node_bytes[i] = node_written[i] = sympy.Integer(0)
            charged_io[i] = ((), ())
            continue
        rid = region_of[i]
        total = sympy.Integer(0)
        ins, outs = [], []
        skip_first = str(op.op.overloadpacket) in rules.OVERWRITE_OPS | rules.LIKE_RANDOM_OPS
        unread = rules.UNREAD_INPUTS.get(str(op.op.overloadpacket), ())  # (sizes only: a pooling backward's self)
        for k, v, tid in reads[i]:
            if (skip_first and k == 0) or k in unread:
                continue
            if v is not None and region_of.get(v[0]) == rid:
                continue
            key = (rid, v if v is not None else ("leaf", tid))
            if key in charged:
                continue
            charged.add(key)
            ins.append(k)
            total += nbytes(sop.in_shapes[k], sop.in_dtypes[k])
        written = sympy.Integer(0)
        for k in range(len(op.outputs)):
            users = consumers.get((i, k), set())
            if users and all(region_of.get(u) == rid for u in users):
                continue
            outs.append(k)
            written += nbytes(sop.out_shapes[k], sop.out_dtypes[k])
        charged_io[i] = (tuple(ins), tuple(outs))
        node_bytes[i] = sympy.expand(total + written)
        node_written[i] = sympy.expand(written)
    regions: dict[int, list[int]] = {}
    for i in sorted(region_of):
        if i in kept:
            regions.setdefault(region_of[i], []).append(i)
    return FusionEstimate(node_bytes=node_bytes, node_written=node_written, region_of={i: r for i, r in region_of.items() if i in kept},
                          regions=regions, charged=charged_io)

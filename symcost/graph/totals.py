"""Totals of the op graph: FLOPs (model, hardware and all), bytes, transcendentals per phase, and the parameter
counts (all, matmul operands, active per token for a mixture of experts), as polynomials in the
symbols. :class:`Totals` is mixed into :class:`~symcost.graph.analysis.Analysis`.

Model FLOPs follow ``torch.utils.flop_counter`` (matmul-class ops only), the same for every
attention kernel; hardware FLOPs add what a kernel repeats (a fused attention backward's
recomputed scores); all-FLOPs add the per-element counts of :mod:`symcost.graph.rules`
(docs/conventions.md).
"""
from __future__ import annotations

import functools

import sympy

from symcost._memo import method_cache
from symcost.errors import SymcostError
from symcost.graph.ops import COMM_KINDS, P2P_KINDS, PHASES


class Totals:
    """Sums over ``self.ops`` (each op times its ``repeat``) and over ``self.param_shapes``."""

    def _sum(self, attr: str, phase: str) -> sympy.Expr:
        phases = PHASES if phase == "train" else (phase,)
        if phase not in ("forward", "backward", "train"):
            raise SymcostError(f"unknown phase {phase!r}; accepted: forward, backward, train")
        pre = self._formula(f"{attr}.{phase}")
        if pre is not None:  # read back with the analysis (from_dict)
            return pre
        return sympy.expand(
            sympy.Add(*[op.repeat * getattr(op.cost, attr) for op in self.ops if op.phase in phases])
        )

    @method_cache
    def flops(self, phase: str = "train", kind: str = "model") -> sympy.Expr:
        """Total FLOPs of ``phase`` (forward|backward|train) as a polynomial in the symbols.

        ``kind="model"``: matmul-class FLOPs with FlopCounterMode's formulas (torch/utils/
        flop_counter.py), the same for every attention kernel: a fused attention backward counts
        the four gradient products eager attention's autograd runs (what MFU, 6·N·P and ``time``
        use); ``kind="hardware"``: the matmul FLOPs the kernels really run, a fused attention
        backward's recomputed scores Q·Kᵀ included (FlopCounterMode's count op for op; HFU);
        ``kind="all"``: hardware FLOPs plus the per-element counts of :mod:`symcost.graph.rules`.

        Raises:
            SymcostError: unknown phase or kind.
        """
        attr = {"model": "flops", "hardware": "flops_hw", "all": "flops_all"}.get(kind)
        if attr is None:
            raise SymcostError(f"unknown FLOP kind {kind!r}; accepted: model, hardware, all")
        return self._sum(attr, phase)

    @method_cache
    def transcendentals(self, phase: str = "train") -> sympy.Expr:
        """Transcendental function evaluations (exp, log, erf, tanh, sin, sqrt, all together)
        of ``phase``, a polynomial: XLA's ``transcendentals`` count (:func:`symcost.graph.rules.transcendentals`)."""
        return self._sum("transcendental_total", phase)

    @method_cache
    def bytes(self, phase: str = "train") -> sympy.Expr:
        """Bytes read + written by all ops of ``phase`` (unfused lower bound), a polynomial."""
        return self._sum("bytes", phase)

    @method_cache
    def comm_bytes(self, kind: str = "total", phase: str = "train", group: str | None = None) -> sympy.Expr:
        """Bytes one rank sends (= receives) in the step's collectives of ``kind``
        (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, pipeline ``send``/``recv`` or ``total``) during
        ``phase``, ring algorithm (:func:`symcost.graph.rules.comm_volume`); 0 without data
        parallelism. ``group``: only the collectives over that mesh dimension's group (``"DP"`` or
        ``"TP"``: on the 2-D mesh of ``--dp`` with ``--tp``, the two links; under HSDP ``"DP"`` is
        the ``dp_shard`` group and ``"DP_replicate"`` the ``dp_replicate`` one); None: all. A
        polynomial in the symbols, ``DP`` and ``TP``."""
        if kind != "total" and kind not in COMM_KINDS + P2P_KINDS:
            raise SymcostError(f"unknown collective {kind!r}; accepted: {', '.join(COMM_KINDS + P2P_KINDS)}, total")
        phases = PHASES if phase == "train" else (phase,)
        return sympy.expand(sympy.Add(*[
            op.repeat * op.comm[2] for op in self.ops
            if op.comm is not None and op.phase in phases and (kind == "total" or op.comm[0] == kind)
            and (group is None or comm_group(self, op) == group)]))

    @functools.cached_property
    def params_shard(self) -> sympy.Expr:
        """Parameter elements one rank holds (its shards; all of them without sharding)."""
        shards = getattr(self, "param_shards", None) or {}
        if not shards:
            return self.params
        return sympy.expand(sympy.Add(*[rep * sympy.Mul(*sh) for sh, _, rep in shards.values()]))

    def _param_total(self, names) -> sympy.Expr:
        return sympy.expand(sympy.Add(*[
            rep * sympy.Mul(*shape) for n, (shape, _, rep) in self.param_shapes.items() if n in names
        ]))

    @functools.cached_property
    def params(self) -> sympy.Expr:
        """Parameter count (tied parameters once), a polynomial in the symbols."""
        return self._param_total(set(self.param_shapes))

    @functools.cached_property
    def params_frozen(self) -> sympy.Expr:
        """Elements of the parameters with ``requires_grad=False`` (``frozen``), a polynomial; 0
        where every parameter trains. They hold no gradient, optimizer state or master copy
        (torch.optim skips a parameter whose ``grad`` is None); ``params - params_frozen`` do."""
        return self._param_total(set(getattr(self, "frozen", ()) or ()))

    @functools.cached_property
    def params_shard_frozen(self) -> sympy.Expr:
        """Elements of the frozen parameters (``params_frozen``) one rank holds: their shards
        (``param_shards``), or all of them without sharding."""
        frozen = set(getattr(self, "frozen", ()) or ())
        shards = getattr(self, "param_shards", None) or {}
        if not shards or not frozen:
            return self.params_frozen
        return sympy.expand(sympy.Add(*[rep * sympy.Mul(*sh) for n, (sh, _, rep) in shards.items() if n in frozen]))

    @functools.cached_property
    def param_tensors_trained(self) -> sympy.Expr:
        """Parameter tensors that require grad (each folded one times its repeat), a polynomial:
        the tensors torch.optim keeps state for (Adam's 0-d ``step`` counter each)."""
        frozen = set(getattr(self, "frozen", ()) or ())
        return sympy.expand(sympy.Add(*[rep for n, (_, _, rep) in self.param_shapes.items() if n not in frozen]))

    @functools.cached_property
    def params_matmul(self) -> sympy.Expr:
        """P of 6·N·P: parameters used as a matmul operand in the forward (tied weights once)."""
        return self._param_total(self.matmul_params)

    @functools.cached_property
    def params_active(self) -> sympy.Expr:
        """Parameters one token uses (:func:`params_active`): ``params`` with each stack of E
        routed experts counted R/E; equal to ``params`` for a dense model."""
        return params_active(self)

    @functools.cached_property
    def params_active_matmul(self) -> sympy.Expr:
        """P_active of 6·N·P_active: ``params_matmul`` with routed expert stacks counted R/E
        (:func:`params_active_matmul`); equal to ``params_matmul`` for a dense model."""
        return params_active_matmul(self)

    @functools.cached_property
    def kv_bytes(self) -> sympy.Expr:
        """Bytes of the KV cache after an inference step (every layer, all B sequences, the
        storages the cache holds: T + S tokens, or a sliding window's), a polynomial; 0 for a
        training step. From the traced cache's storages (``kv_layers``)."""
        return sympy.expand(sympy.Add(*[rep * nb for _, nb, rep in getattr(self, "kv_layers", [])]))

    @functools.cached_property
    def attention_flops(self) -> sympy.Expr:
        """Model FLOPs (train) of matmul-class ops with no parameter operand (attention)."""
        return sympy.expand(sympy.Add(*[
            op.repeat * op.cost.flops for op in self.ops if op.attention
        ]))


def is_e(an, local: bool = False):
    """``is_e(size) -> bool``: whether a traced size is E: the symbol E or, where the trace pinned
    E (a regime no other E runs), its pinned value, so that pinning E cannot hide the experts.
    ``local``: also E/EP, the experts one expert-parallel rank holds (its ops see only those,
    docs/parallel.md §14), and E itself where the trace tied E to EP (one expert per rank)."""
    import sympy

    from symcost.tracing.fit import SYMS

    pinned = getattr(an, "pinned", None) or {}
    targets = {SYMS["E"]}
    if pinned.get("E") is not None:
        targets.add(sympy.Integer(pinned["E"]))
    ties = {**(getattr(getattr(an, "spec", None), "tied", None) or {}), **(getattr(an, "regime_ties", None) or {})}
    if ties.get("E") == "EP":  # (E = EP at the request: the formulas say EP)
        targets.add(SYMS["EP"])
    if local:
        ep = SYMS["EP"] if "EP" in (getattr(an, "symbols", None) or {}) else pinned.get("EP")
        if ep is not None:
            targets |= {sympy.sympify(t) / ep for t in list(targets)}
    return lambda size: sympy.sympify(size) in targets


def is_routed(an, name: str) -> bool:
    """Whether parameter ``name`` of an Analysis is a stack of E experts' weights.

    From the traced graph: its first dimension is E (:func:`is_e`: the symbol, or its value where
    E is pinned), and in the forward it reaches (through views and casts) an op that applies it
    expert by expert: one whose output's first dimension is E too (the batched expert matmul
    over the ``[E, C, ·]`` buffer of the padded dispatch, or an expert bias added to it), a
    grouped GEMM taking it as its ``[E, in, out]`` weight (``aten._grouped_mm``: transformers'
    ``grouped_mm`` experts), or a gather of its rows per routed slot (``aten.index`` /
    ``index_select`` with the stack as the source: that code's expert biases,
    ``bias[expert_ids]``). The router's weight ``[E, M]`` is none of these: its matmul's output
    is ``[N, E]``.
    """
    from symcost.graph.opsets import same_tensor

    e = is_e(an)
    shape = an.param_shapes[name][0]
    if not shape or not e(shape[0]):
        return False
    e = is_e(an, local=True)  # (an expert-parallel rank's ops see its E/EP experts)
    g = an.graph
    node = f"param:{name}"
    if node not in g:
        return False
    frontier, seen = list(g.successors(node)), set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        d = g.nodes[n]
        if d.get("phase") != "forward":
            continue
        if same_tensor(d):
            frontier.extend(g.successors(n))
            continue
        outs = d.get("out_shapes") or []
        if outs and outs[0] and e(outs[0][0]):
            return True
        if _per_expert(d, e):
            return True
    return False


#: ops that apply an ``[E, ...]`` stack expert by expert without an ``[E, ...]`` output:
#: op name prefix -> the input position that holds the stack
_PER_EXPERT_OPS = {"aten._grouped_mm": 1, "aten.index.Tensor": 0, "aten.index_select": 0}


def _per_expert(d, e) -> bool:
    """Whether the forward op with graph data ``d``, reached from an ``[E, ...]`` stack through
    views, reads it per expert: an op of :data:`_PER_EXPERT_OPS` whose input at the stack's
    position has E rows (the ``[N·R, in]`` tokens of a grouped GEMM have none)."""
    name = str(d.get("op") or "")
    for prefix, pos in _PER_EXPERT_OPS.items():
        if name.startswith(prefix):
            ins = d.get("in_shapes") or []
            return len(ins) > pos and bool(ins[pos]) and e(ins[pos][0])
    return False


def _active_share(an):
    """R/E, each symbol replaced by its value where the trace pinned it."""
    from symcost.tracing.fit import SYMS

    pinned = getattr(an, "pinned", None) or {}
    r = sympy.Integer(pinned["R"]) if "R" in pinned else SYMS["R"]
    e = sympy.Integer(pinned["E"]) if "E" in pinned else SYMS["E"]
    ties = {**(getattr(getattr(an, "spec", None), "tied", None) or {}), **(getattr(an, "regime_ties", None) or {})}
    if "E" not in pinned and ties.get("E") == "EP":  # (E = EP at the request of an --ep trace: E is EP)
        e = SYMS["EP"]
    return r / e


def params_active(an):
    """Parameters one token uses: all, with each stack of E routed experts counted R/E.

    ``an.params`` with every :func:`is_routed` parameter scaled by R/E (shared weights, shared
    experts, the router, embeddings and norms count fully). A polynomial in the symbols.
    """
    from symcost.graph.opsets import numel

    routed = {n for n in an.param_shapes if is_routed(an, n)}
    if not routed:
        return an.params
    scale = _active_share(an)

    total = sympy.Add(*[
        rep * numel(shape) * (scale if n in routed else 1)
        for n, (shape, _, rep) in an.param_shapes.items()
    ])
    return sympy.expand(total)


def params_active_matmul(an):
    """P_active of 6·N·P_active: matmul-operand parameters, routed expert stacks counted R/E."""
    from symcost.graph.opsets import numel

    routed = {n for n in an.matmul_params if is_routed(an, n)}
    if not routed:
        return an.params_matmul
    scale = _active_share(an)
    return sympy.expand(sympy.Add(*[
        rep * numel(shape) * (scale if n in routed else 1)
        for n, (shape, _, rep) in an.param_shapes.items() if n in an.matmul_params
    ]))


def trace_group(trace) -> str:
    """The symbol of the one process group a 1-D mesh's collectives run over, for a
    ``Recording`` or an ``Analysis``: ``TP`` for tensor (and sequence) parallelism, ``EP`` for
    expert parallelism alone, else ``DP``
    (on the 2-D mesh each collective names its own: ``OpCall.group``, ``SymOp.comm[3]``)."""
    parallel = getattr(trace, "parallel", None) or ""
    return "TP" if parallel.startswith("tp") else ("EP" if parallel == "ep" else "DP")


def comm_group(an, op) -> str:
    """The mesh symbol (``"DP"`` or ``"TP"``) of the process group a collective of ``an`` runs
    over: its own (``SymOp.comm[3]``), else the trace's one group (:func:`trace_group`; an
    analysis cached before collectives named theirs)."""
    if op.comm is not None and len(op.comm) > 3 and op.comm[3]:
        return op.comm[3]
    return trace_group(an)

"""Activation checkpointing: the √L law from the traced graph, the exact optimum, apply, predict.

The pass takes an :class:`~symcost.graph.analysis.Analysis` and returns plain data. Its pieces:

* :func:`block_costs` — per block of the L repeated blocks, from the trace: ``a`` the bytes
  autograd saves inside the block (``memory_model(an).activations_per_layer``; the special end
  block's own share where the trace has one), ``x`` the bytes of the block's input that a
  checkpoint keeps (the output of the previous block: the last forward op's output in the graph)
  and ``f`` the block's forward model FLOPs (recomputed once per checkpointed block).
* :func:`law` — the symbolic trade-off for a checkpoint every k blocks (Chen et al. 2016,
  "Training Deep Nets with Sublinear Memory Cost", Sec. 4.1): activation memory
  ``M(k) = (L/k)·x + k·a`` (the kept segment inputs plus one segment's activations while it is
  recomputed), stationary point ``k* = sqrt(L·x/a)`` (``L/k* = sqrt(L·a/x)`` segments) and
  ``M(k*) = 2·sqrt(L·a·x)``, found with sympy; the same law one level down over the chain of the
  block's ops (interval in ops); the trade-off table over k.
* :func:`optimal_segments` — exact dynamic programming over the (possibly non-uniform) block
  sequence, Chen et al.'s segment DP with Griewank & Walther's ordering insight (revolve: later
  segments are shorter because more checkpoints are live when they are recomputed): (a) the
  least activation peak, (b) the least recompute FLOPs under an activation budget.
* :class:`Plan` — which blocks are checkpointed in which segments; :meth:`Plan.apply` wraps
  them in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` in place (parameter
  names unchanged).
* :func:`exact` — the applied plan traced by symcost itself (the recording sees the recomputed
  forward and what is really kept), so the memory pass gives the step's peak exactly and the
  FLOPs include the recomputation exactly as ``FlopCounterMode`` counts them.
* :func:`analyse` — all of it for ``symcost checkpoint`` (JSON contract ``checkpoint.*``).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS

KINDS = ("none", "every-layer", "sqrt", "optimal")


# --------------------------------------------------------------------------------------------
# per-block costs from the trace
# --------------------------------------------------------------------------------------------


@dataclass
class BlockCosts:
    """What one block costs, from the trace (sympy polynomials; bytes and FLOPs).

    ``generic`` is the block that stands for the repeated ones; ``special`` the end block that
    runs other ops (``"first"``/``"last"``, or None) with its own ``(a, x, f)``.
    """

    a: sympy.Expr  # bytes saved for backward inside one generic block
    x: sympy.Expr  # bytes of the block's input (= the previous block's output) a checkpoint keeps
    f: sympy.Expr  # forward model FLOPs of one generic block
    n_ops: int  # forward ops of the generic block (the chain length one level down)
    special: str | None = None
    special_costs: tuple | None = None  # (a, x, f) of the special end block
    container: str = ""
    outside: sympy.Expr = sympy.Integer(0)  # activations saved outside the blocks

    def sequence(self, L: int, env: Mapping) -> tuple[list[int], list[int], list[int]]:
        """Per-block ``(a, x, f)`` integers for ``L`` blocks at the sizes ``env``."""
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        g = (ev(self.a), ev(self.x), ev(self.f))
        seq = [g] * L
        if self.special and L >= 1:
            s = tuple(ev(v) for v in self.special_costs)
            seq[0 if self.special == "first" else L - 1] = s
        return [t[0] for t in seq], [t[1] for t in seq], [t[2] for t in seq]


def _special(an) -> str | None:
    c = an.layer_container
    pre = f"{c}." if c else ""
    _, r0, _ = an.role(f"{pre}0")
    _, r1, _ = an.role(f"{pre}1")
    if r0 == 1 and r1 != 1:
        return "first"
    if r1 == 1 and r0 != 1:
        return "last"
    return None


def block_costs(an) -> BlockCosts:
    """The per-block ``a``, ``x``, ``f`` of a traced model (see :class:`BlockCosts`).

    ``a`` is the trace's saved bytes of a block (``saved_tensors_hooks``, docs/memory.md), ``x``
    the bytes of the output of the block's last forward op (the tensor the next block takes and
    a checkpoint keeps), ``f`` the block's forward model FLOPs (FlopCounterMode's convention).

    Raises:
        SymcostError: the model has no repeated blocks (L is not a symbol), or its first blocks
            are of another kind than the rest (``ModelSpec.lead_blocks``: DeepSeek-V3's dense
            blocks), which the per-block costs here do not describe.
    """
    from symcost.graph import rules

    if "L" not in an.symbols or an.layer_container is None:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")
    lead = getattr(an.spec, "lead_blocks", 0) or 0
    if lead:
        raise SymcostError(
            f"{an.model}: its first {lead} blocks are of another kind than the rest "
            f"({an.spec.extra.get('lead_blocks_note', 'leading blocks')}); checkpoint planning folds one kind "
            "of block (and one special end block), so it does not plan this model yet")
    L = SYMS["L"]
    special = _special(an)
    groups: dict[str, dict] = {}
    for op in an.ops:
        if op.layer is None or op.phase != "forward":
            continue
        key = "generic" if sympy.sympify(op.repeat).has(L) else "special"
        g = groups.setdefault(key, {"f": sympy.Integer(0), "last": None, "n": 0})
        g["f"] += op.cost.flops
        g["n"] += 1
        if op.out_shapes:
            g["last"] = op
    saved = {"generic": sympy.Integer(0), "special": sympy.Integer(0), "outside": sympy.Integer(0)}
    c = an.layer_container
    pre = f"{c}." if c else ""
    for module, nb, _dtype, rep in an.saved:
        if sympy.sympify(rep).has(L):
            saved["generic"] += nb
        elif module.startswith(pre) and module[len(pre):].split(".", 1)[0] in ("0", "{L-1}") and special:
            saved["special"] += nb
        else:
            saved["outside"] += rep * nb

    def out_bytes(op):
        return rules.nbytes(op.out_shapes[0], op.out_dtypes[0]) if op is not None else sympy.Integer(0)

    gen = groups.get("generic")
    if gen is None:
        raise SymcostError(f"{an.model}: no forward ops in the repeated blocks")
    sc = None
    if special and "special" in groups:
        sg = groups["special"]
        sc = (sympy.expand(saved["special"]), sympy.expand(out_bytes(sg["last"])), sympy.expand(sg["f"]))
    return BlockCosts(a=sympy.expand(saved["generic"]), x=sympy.expand(out_bytes(gen["last"])),
                      f=sympy.expand(gen["f"]), n_ops=gen["n"], special=special if sc else None,
                      special_costs=sc, container=c, outside=sympy.expand(saved["outside"]))


# --------------------------------------------------------------------------------------------
# the symbolic law
# --------------------------------------------------------------------------------------------


def law(bc: BlockCosts) -> dict:
    """The √L law of a uniform chain of L blocks checkpointed every k blocks (Chen et al. 2016,
    Sec. 4.1), from the traced ``a``, ``x`` (bytes) and ``f`` (FLOPs).

    Returns a dict of sympy expressions: ``memory`` M(k) = (L/k)·x + k·a (bytes; kept inputs of
    the L/k segments plus one segment's activations during its recomputation), ``k_star`` the
    stationary point sqrt(L·x/a) of dM/dk = 0 (sympy.solve), ``segments_star`` = L/k* =
    sqrt(L·a/x), ``memory_star`` = M(k*) = 2·sqrt(L·a·x), ``recompute`` L·f (one extra forward
    of the blocks, for any k < L), and the same one level down (``op_*``): the chain of the
    L·m forward ops of the blocks (m ops per block, the residual stream x between them, a/m
    bytes saved per op on average) checkpointed every j ops: M(j) = (L·m/j)·x + j·a/m,
    j* = m·sqrt(L·x/a), M(j*) = 2·sqrt(L·a·x) again, now reachable where k* < 1 (docs/checkpoint.md).
    """
    L, k, j = SYMS["L"], sympy.Symbol("k", positive=True), sympy.Symbol("j", positive=True)
    a, x, f = bc.a, bc.x, bc.f
    M = L / k * x + k * a
    ks = [s for s in sympy.solve(sympy.diff(M, k), k) if s.is_positive is not False]
    k_star = sympy.simplify(ks[0]) if ks else sympy.Integer(1)
    m = sympy.Integer(max(bc.n_ops, 1))
    Mop = L * m / j * x + j * a / m
    js = [s for s in sympy.solve(sympy.diff(Mop, j), j) if s.is_positive is not False]
    j_star = sympy.simplify(js[0]) if js else sympy.Integer(1)
    return {
        "k": k, "a": a, "x": x, "f": f, "memory": M, "k_star": k_star,
        "segments_star": sympy.simplify(L / k_star),
        "memory_star": sympy.simplify(M.subs(k, k_star)),
        "recompute": sympy.expand(L * f),
        "j": j, "ops_per_block": m, "op_memory": Mop, "op_j_star": j_star,
        "op_memory_star": sympy.simplify(Mop.subs(j, j_star)),
    }


def integer_k(law_: dict, env: Mapping, L: int, head: int = 0) -> int:
    """The best integer interval near k*: the integer neighbours of the stationary point (and
    1, L), the one with the least activation peak (:func:`plan_cost`) with ⌈L/k⌉ segments."""
    ks = float(law_["k_star"].xreplace({**env, SYMS["L"]: L}))
    cands = {1, L, max(1, math.floor(ks)), min(L, max(1, math.ceil(ks)))}
    a = int(law_["a"].xreplace(env))
    x = int(law_["x"].xreplace(env))
    return min(sorted(cands), key=lambda k: (plan_cost(uniform_segments(L, k), [a] * L, [x] * L, [0] * L,
                                                       head)[0], k))


# --------------------------------------------------------------------------------------------
# plans and the exact optimum
# --------------------------------------------------------------------------------------------


def uniform_segments(L: int, k: int) -> list[tuple[int, int]]:
    """Checkpointed segments ``[start, end)`` of k blocks each, the last one shorter."""
    return [(s, min(s + k, L)) for s in range(0, L, k)]


def sequential_default(L: int, segments: int) -> list[tuple[int, int]]:
    """The split of ``torch.utils.checkpoint.checkpoint_sequential(functions, segments, input)``
    (torch/utils/checkpoint.py): ``segment_size = len(functions) // segments``, every segment of
    that size but the last, which takes the rest and is *not* checkpointed (it runs plainly).

    Returned as the checkpointed segments only (the last, plain one left out).
    """
    size = max(1, L // segments)
    out, end = [], -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        out.append((start, end + 1))
    return out


def plan_cost(segments: Sequence[tuple[int, int]], a: Sequence[int], x: Sequence[int],
              f: Sequence[int], head: int = 0, fr: Sequence[int] | None = None) -> tuple[int, int]:
    """(activation peak in bytes, recompute FLOPs) of checkpointing ``segments`` of a block chain.

    The model (Chen et al. 2016, Sec. 4; the order of the backward as in Griewank & Walther's
    revolve): blocks outside a segment keep their activations ``a_i``; a checkpointed segment
    keeps only its input ``x_start`` during the forward; in the backward, segment s is
    recomputed while everything kept before it is live: peak = max(kept at the end of the
    forward + ``head``, max over segments of kept-before-s + x_s + Σ a over s). ``head`` is
    what the step holds at the end of the forward besides the blocks' activations (the model's
    output, the loss and its first gradients: from the memory pass of the plain trace).
    Recompute = Σ f over checkpointed blocks (each recomputed once), except that the last block
    of a segment costs ``fr`` (default ``f``): a non-reentrant checkpoint stops recomputing as
    soon as every tensor the backward needs is back (``torch.utils.checkpoint``'s early stop,
    on by default), so the ops after the segment's last saved tensor never rerun.
    """
    fr = f if fr is None else fr
    segs = sorted(segments)
    starts = {s: e for s, e in segs}
    kept = peak = rec = 0
    i = 0
    while i < len(a):
        if i in starts:
            e = starts[i]
            peak = max(peak, kept + x[i] + sum(a[i:e]))
            kept += x[i]
            rec += sum(f[i:e - 1]) + fr[e - 1]
            i = e
        else:
            kept += a[i]
            i += 1
    return max(peak, kept + head), rec


def optimal_segments(a: Sequence[int], x: Sequence[int], f: Sequence[int],
                     budget: int | None = None, head: int = 0, fr: Sequence[int] | None = None) -> tuple[list[tuple[int, int]], int, int]:
    """Exact optimum over every segmentation of the block chain, by dynamic programming.

    Without ``budget``: the least activation peak (:func:`plan_cost` with ``head``), ties to the least
    recompute. With ``budget`` (bytes): the least recompute FLOPs whose peak is ≤ budget.
    States after each block are the Pareto front of (kept bytes, running peak, recompute);
    transitions keep block i, or checkpoint a segment [i, j) (Chen et al. 2016, Sec. 4.2's DP,
    here over non-uniform blocks and with the order-dependent peak of revolve).

    Returns ``(segments, peak, recompute)``.

    Raises:
        SymcostError: no segmentation fits ``budget``.
    """
    n = len(a)
    fr = f if fr is None else fr
    pa = [0]
    pf = [0]
    for i in range(n):
        pa.append(pa[-1] + a[i])
        pf.append(pf[-1] + f[i])
    # front[i]: dict (kept, peak) -> (recompute, back-pointer)
    fronts: list[dict] = [dict() for _ in range(n + 1)]
    fronts[0][(0, 0)] = (0, None)

    def add(i, key, rec, back):
        if budget is not None and (key[1] > budget or (i == n and key[0] + head > budget)):
            return
        cur = fronts[i].get(key)
        if cur is None or rec < cur[0]:
            fronts[i][key] = (rec, back)

    for i in range(n):
        front = _pareto3(fronts[i])
        fronts[i] = front
        for (kept, pk), (rec, _) in front.items():
            add(i + 1, (kept + a[i], pk), rec, (i, kept, pk, None))
            for j in range(i + 1, n + 1):
                new_pk = max(pk, kept + x[i] + pa[j] - pa[i])
                if budget is not None and new_pk > budget:
                    break
                add(j, (kept + x[i], new_pk), rec + pf[j - 1] - pf[i] + fr[j - 1], (i, kept, pk, j))
    end = fronts[n]
    if not end:
        raise SymcostError(f"no checkpoint plan keeps the activations under {budget} bytes "
                           f"(the least possible is {optimal_segments(a, x, f, head=head, fr=fr)[1]} bytes)")
    top = lambda kk: max(kk[0] + head, kk[1])  # noqa: E731
    if budget is None:
        key = min(end, key=lambda kk: (top(kk), end[kk][0]))
    else:
        key = min(end, key=lambda kk: (end[kk][0], top(kk)))
    rec = end[key][0]
    segs = []
    i, k = n, key
    while i > 0:
        _, back = fronts[i][k]
        s, kept, pk, j = back
        if j is not None:
            segs.append((s, j))
        i, k = s, (kept, pk)
    return sorted(segs), top(key), rec


def _pareto3(front: dict) -> dict:
    """Drop states another state beats in kept bytes, peak and recompute at once."""
    items = sorted(front.items(), key=lambda t: (t[0][0], t[0][1], t[1][0]))
    out: dict = {}
    best: list[tuple[int, int]] = []  # (peak, rec) of kept states with smaller or equal kept
    for (kept, pk), val in items:
        rec = val[0]
        if any(p <= pk and r <= rec for p, r in best):
            continue
        best.append((pk, rec))
        out[(kept, pk)] = val
    return out


@dataclass
class Plan:
    """Which blocks of ``container`` are checkpointed, in which segments ``[start, end)``.

    ``kind``: how it was chosen (``none``, ``every-layer``, ``sqrt``, ``optimal``,
    ``budget``, ``memory``, ``sequential``). ``interval`` is the segment length when all
    segments have one (else None).
    """

    container: str
    L: int
    segments: list[tuple[int, int]]
    kind: str = "optimal"

    @property
    def interval(self) -> int | None:
        lens = [e - s for s, e in self.segments]
        if not lens:
            return None
        return lens[0] if len(set(lens[:-1])) <= 1 and lens[-1] <= lens[0] else None

    def modules(self) -> list[str]:
        """The checkpointed segments as module paths (``layers.0-layers.2``)."""
        pre = f"{self.container}." if self.container else ""
        return [f"{pre}{s}" if e - s == 1 else f"{pre}{s}..{pre}{e - 1}" for s, e in self.segments]

    def apply(self, model, _traced: bool = False):
        """Checkpoint the plan's segments of ``model`` in place and return it.

        Each segment's first block runs the whole segment inside
        ``torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)``
        (non-reentrant: correct also when the block input needs no grad, and kwargs pass
        through); the segment's other blocks return the segment's output when the parent model
        calls them. Parameter names, hooks and the module tree stay as they are.

        Raises:
            SymcostError: the model's block container does not hold ``L`` blocks.
        """
        from torch.utils.checkpoint import checkpoint

        blocks = list(model.get_submodule(self.container)) if self.container else list(model)
        if len(blocks) != self.L:
            raise SymcostError(f"the plan is for {self.L} blocks in {self.container!r}, "
                               f"the model has {len(blocks)}")
        for s, e in self.segments:
            seg = blocks[s:e]
            state = {"inside": False, "out": None}
            origs = [b.forward for b in seg]

            def run(*args, _seg=seg, _state=state, **kwargs):
                _state["inside"] = True
                try:
                    out = None
                    for b in _seg:
                        out = b(*args, **kwargs)
                        args = (out if not isinstance(out, (tuple, list)) else out[0],) + tuple(args[1:])
                    return out
                finally:
                    _state["inside"] = False

            def make(i, _orig, _state=state, _n=len(seg), _run=run):
                def forward(*args, **kwargs):
                    if _state["inside"]:
                        return _orig(*args, **kwargs)
                    if i == 0:
                        out = (traced_checkpoint if _traced else checkpoint)(
                            _run, *args, use_reentrant=False, **kwargs)
                        if _n > 1:
                            _state["out"] = out
                        return out
                    out = _state["out"]
                    if i == _n - 1:
                        _state["out"] = None
                    return out
                return forward

            for i, b in enumerate(seg):
                b.forward = make(i, origs[i])
        return model


@dataclass
class Chain:
    """The block chain at concrete sizes: per-block ``a``, ``x`` (bytes), ``f`` (FLOPs) and
    ``head`` (bytes live at the end of the forward besides the blocks' activations)."""

    a: list[int]
    x: list[int]
    f: list[int]
    head: int
    costs: BlockCosts
    fr: list[int] | None = None  # recompute of a block that ends its segment (early stop)

    def cost(self, segments) -> tuple[int, int]:
        """(activation peak bytes, recompute FLOPs) of ``segments`` (:func:`plan_cost`)."""
        return plan_cost(segments, self.a, self.x, self.f, self.head, self.fr)

    def optimal(self, budget: int | None = None):
        """:func:`optimal_segments` on this chain."""
        return optimal_segments(self.a, self.x, self.f, budget, self.head, self.fr)


def chain(an, L: int, env: Mapping, optimizer: str = "adamw", impl: str = "foreach") -> Chain:
    """The :class:`Chain` of ``an``'s blocks at ``L`` and sizes ``env`` (symbol -> int).

    ``x`` is the block input plus the RNG state a checkpoint stashes (:func:`rng_state_bytes`).
    ``head`` is the largest live set of the plain step that is not the optimizer step
    (``memory_model(an).peak_terms()``, docs/memory.md) less the blocks' activations: the
    model's output, the loss, its first gradients and what is saved outside the blocks.
    """
    from symcost.passes.memory import memory_model

    bc = block_costs(an)
    a, x, f = bc.sequence(L, env)
    x = [v + rng_state_bytes() for v in x]  # a checkpoint keeps its input and the RNG state
    mm = memory_model(an, an.precision, optimizer, impl)
    terms = [int(e.xreplace(env)) for e, min_L, where in mm.peak_terms()
             if min_L <= L and not where.startswith("optimizer step")]
    head = max(0, max(terms, default=0) - sum(a))
    fr = list(f)
    g, sp = recompute_last(an)
    if g is not None:
        fr = [int(g.xreplace(env))] * L
        if bc.special:
            fr[0 if bc.special == "first" else L - 1] = int(sp.xreplace(env))
    return Chain(a, x, f, head, bc, fr)


def recompute_last(an) -> tuple[sympy.Expr | None, sympy.Expr | None]:
    """Recompute FLOPs of a block checkpointed on its own (generic, special end block), from the
    step traced with every block checkpointed (:func:`uniform_spec` with k = 1): its train FLOPs
    less the plain step's, per block. Less than the block's forward where ops after its last
    saved tensor are skipped by the checkpoint's early stop."""
    L = SYMS["L"]
    sub = _uniform_trace(an, 1)
    diff = sympy.expand(sub.flops("train") - an.flops("train"))
    g = diff.coeff(L, 1)
    if g.has(L):
        return None, None
    return sympy.expand(g), sympy.expand(diff.subs(L, 1))


def _uniform_trace(an, k: int):
    from symcost.graph.build import trace

    key = (id(an.spec), an.precision, "uniform", k)
    sub = _TRACES.get(key)
    if sub is None:
        spec = uniform_spec(an.spec, an.layer_container or "", k)
        sub = trace(spec, sizes={s: 1 for s, v in an.pinned.items()}, precision=an.precision)
        _TRACES[key] = sub
    return sub


def make_plan(an, kind: str, L: int, env: Mapping | None = None, budget: int | None = None,
              ch: Chain | None = None) -> Plan:
    """A :class:`Plan` of ``kind`` for ``L`` blocks at sizes ``env`` (symbol -> int).

    ``none``; ``every-layer`` (each block its own segment, Hugging Face's
    ``gradient_checkpointing_enable``); ``sqrt`` (uniform segments of the best integer k next to
    the law's k* = sqrt(L·x/a), :func:`integer_k`); ``sqrt-L`` (segments of ⌈√L⌉ blocks, the
    textbook choice); ``optimal`` (DP, least peak); ``budget`` (DP, least recompute with
    activation peak ≤ ``budget`` bytes); ``sequential`` (``checkpoint_sequential``'s default split
    with ⌈√L⌉ segments).

    Raises:
        SymcostError: unknown kind.
    """
    c = an.layer_container or ""
    if kind == "none":
        return Plan(c, L, [], kind)
    if kind == "every-layer":
        return Plan(c, L, uniform_segments(L, 1), kind)
    if kind == "sqrt-L":
        return Plan(c, L, uniform_segments(L, max(1, math.ceil(math.sqrt(L)))), kind)
    if kind == "sequential":
        return Plan(c, L, sequential_default(L, max(1, math.ceil(math.sqrt(L)))), kind)
    env = dict(env or {})
    ch = ch or chain(an, L, env)
    if kind == "sqrt":
        return Plan(c, L, uniform_segments(L, integer_k(law(ch.costs), env, L, ch.head)), kind)
    if kind == "optimal":
        return Plan(c, L, ch.optimal()[0], kind)
    if kind == "budget":
        return Plan(c, L, ch.optimal(budget)[0], kind)
    raise SymcostError(f"unknown checkpoint plan {kind!r}; accepted: {', '.join(KINDS)}")


# --------------------------------------------------------------------------------------------
# the exact prediction: trace the applied plan
# --------------------------------------------------------------------------------------------


_RNG_BYTES: list[int] = []


def rng_state_bytes() -> int:
    """Bytes of the CPU generator's state, ``torch.get_rng_state()`` (5056 for mt19937): what a
    checkpoint with ``preserve_rng_state=True`` (the default) stashes per call
    (torch/utils/checkpoint.py, ``_get_device_module``/``get_rng_state`` in the frame)."""
    if not _RNG_BYTES:
        import torch

        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            _RNG_BYTES.append(torch.get_rng_state().nbytes)
    return _RNG_BYTES[0]


def traced_checkpoint(fn, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` as symcost traces it: the same call, given one more
    (ignored) input, a placeholder storage of :func:`rng_state_bytes`, which the checkpoint's
    frame keeps exactly as long as it keeps its RNG state (its inputs and the state live in the
    same frame). The RNG state is a CPU tensor made outside the dispatcher, so a recording would
    not see it otherwise."""
    import torch
    from torch.utils.checkpoint import checkpoint

    hold = torch.empty(rng_state_bytes(), dtype=torch.uint8)

    def run(_hold, *a, **k):
        return fn(*a, **k)

    return checkpoint(run, hold, *args, **kwargs)


def uniform_spec(spec, container: str, k: int):
    """A :class:`~symcost.frontends.spec.ModelSpec` of ``spec`` with every k consecutive blocks grouped into
    one checkpointed segment (non-reentrant), its ``L`` counting segments: traced by symcost it
    folds over the segments, so the memory pass gives the step's peak for any number of segments
    as a formula (L blocks = k·L' when k divides L)."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Segment(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def _run(self, *args, **kwargs):
            out = None
            for b in self.blocks:
                out = b(*args, **kwargs)
                args = (out if not isinstance(out, (tuple, list)) else out[0],) + tuple(args[1:])
            return out

        def forward(self, *args, **kwargs):
            return traced_checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def build(values):
        model = spec.build(dict(values, L=values["L"] * k))
        blocks = list(model.get_submodule(container)) if container else list(model)
        segs = nn.ModuleList(Segment(blocks[i:i + k]) for i in range(0, len(blocks), k))
        parent, _, attr = container.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, segs)
        return model

    return dataclasses.replace(
        spec, name=f"{spec.name} [checkpoint every {k}]", build=build,
        defaults=dict(spec.defaults), layers=container,
        check=(lambda v: spec.check(dict(v, L=v.get("L", 1) * k))) if spec.check else None)


def pinned_spec(spec, plan: Plan, config: Mapping[str, int]):
    """``spec`` at the plan's ``L`` and the given config sizes (only B and S stay symbols) with
    ``plan.apply`` on every model built: any plan, traced exactly at those sizes."""
    L = plan.L
    config = {k: v for k, v in config.items() if k not in ("B", "S")}
    fixed = dict(config, L=L)

    def build(values):
        return plan.apply(spec.build({**values, **fixed}), _traced=True)

    def make_inputs(values, device):
        return spec.make_inputs({**values, **fixed}, device)

    return dataclasses.replace(
        spec, name=f"{spec.name} [{plan.kind} checkpoint, L={L}]", symbols=(), tied={},
        defaults={k: v for k, v in spec.defaults.items() if k in ("B", "S")}, build=build,
        make_inputs=make_inputs, layers=None, constraints=(),
        check=lambda v: spec.check({**v, **fixed}))


def peak_model(an, ch: "Chain", L: int, sizes: Mapping[str, int], optimizer: str = "adamw",
               impl: str = "foreach"):
    """``segments -> peak bytes`` by the segment model: static memory + the largest of the end of
    the forward (kept bytes + ``head``), the segments' recomputation peak (:func:`plan_cost`)
    plus the residual the model leaves at the traced every-layer plan (gradients of segment
    outputs, parameter gradients allocated so far), and the plain trace's optimizer-step live set
    (the same under any plan)."""
    from symcost.passes.memory import memory_model

    sizes = {k: v for k, v in sizes.items() if k != "L"}
    env = an.bind(**sizes, L=L)
    every = Plan(ch.costs.container, L, uniform_segments(L, 1), "every-layer")
    ev = exact(an, every, sizes, optimizer, impl)
    base = memory_model(an, an.precision, optimizer, impl)
    static = int(base.static.xreplace(env))
    resid = ev["peak"] - static - ch.cost(every.segments)[0]
    opt = max((int(e.xreplace(env)) for e, m, w in base.peak_terms()
               if m <= L and w.startswith("optimizer step")), default=0)

    def peak(segments):
        inside = {i for s, e in segments for i in range(s, e)}
        end = sum(a for i, a in enumerate(ch.a) if i not in inside) + sum(ch.x[s] for s, _ in segments) + ch.head
        seg = plan_cost(segments, ch.a, ch.x, ch.f, -end, ch.fr)[0] if segments else 0
        return static + max(end, seg + resid, opt)

    return peak


_TRACES: dict = {}


def is_uniform(plan: Plan) -> bool:
    """Segments of k blocks, k dividing L, covering every block (traced folded over L/k)."""
    k = plan.interval
    return k is not None and plan.L % k == 0 and plan.segments == uniform_segments(plan.L, k)


def exact(an, plan: Plan, sizes: Mapping[str, int], optimizer: str = "adamw",
          impl: str = "foreach", trace_any: bool = False) -> dict:
    """The plan's predicted peak and FLOPs: ``{"peak", "peak_source", "train_flops", "seconds",
    "memory_model", "analysis", "L_arg"}`` (bytes, FLOPs) at ``sizes``.

    ``peak_source`` ``"traced"``: the applied plan's step traced by symcost — no checkpointing
    (the plain trace), a uniform plan (segments of k, k dividing L: traced once per k with L
    the number of segments, formulas in all symbols), or with ``trace_any`` any plan (traced at
    its L and config sizes, B and S symbols; slow for deep models). The recording sees the
    checkpoints' recomputed forward and what they keep; the memory pass
    (:func:`symcost.passes.memory.memory_model`) gives the steady-state peak.

    ``"model"`` (other plans without ``trace_any``): static memory + the larger of the segment
    model's activation peak (:func:`plan_cost`) plus the residual that model leaves at the
    traced every-layer plan, and the optimizer step's live set of the plain trace. The FLOPs are
    exact either way (per-block forward and early-stopped recompute from the traces).
    """
    from symcost.graph.build import trace
    from symcost.passes.memory import memory_model

    t0 = time.perf_counter()
    sizes = {k: v for k, v in sizes.items() if k != "L"}
    mm = None
    if not plan.segments:
        sub, L_arg = an, {"L": plan.L}
    elif is_uniform(plan):
        sub, L_arg = _uniform_trace(an, plan.interval), {"L": plan.L // plan.interval}
    elif trace_any:
        config = {str(k): int(v) for k, v in an.bind(**sizes, L=plan.L).items()}
        key = (id(an.spec), an.precision, tuple(plan.segments), tuple(sorted(config.items())))
        sub = _TRACES.get(key)
        if sub is None:
            sub = trace(pinned_spec(an.spec, plan, config), sizes={s: 1 for s in an.pinned},
                        precision=an.precision, n_random=3)
            _TRACES[key] = sub
        L_arg = {}
        sizes = {k: v for k, v in sizes.items() if k in ("B", "S")}
    else:
        env = an.bind(**sizes, L=plan.L)
        ch = chain(an, plan.L, env, optimizer, impl)
        return {
            "peak": peak_model(an, ch, plan.L, sizes, optimizer, impl)(plan.segments), "peak_source": "model",
            "train_flops": int(an.flops("train").xreplace(env)) + ch.cost(plan.segments)[1],
            "seconds": time.perf_counter() - t0, "memory_model": None, "analysis": None, "L_arg": None,
        }
    mm = memory_model(sub, an.precision, optimizer, impl)
    at = {**sizes, **L_arg}
    env = sub.bind(**at)
    return {
        "peak": mm.peak(**at), "peak_source": "traced",
        "train_flops": int(sub.flops("train").xreplace(env)),
        "seconds": time.perf_counter() - t0,
        "memory_model": mm, "analysis": sub, "L_arg": L_arg,
    }


# --------------------------------------------------------------------------------------------
# the whole pass
# --------------------------------------------------------------------------------------------


def analyse(an, sizes: Mapping[str, int] | None = None, memory: int | None = None,
            budget: float | None = None, kind: str = "optimal", optimizer: str = "adamw",
            impl: str = "foreach", exact_peak: bool = True, table: bool = True) -> dict:
    """The checkpoint plan of a traced model at ``sizes`` (plain data; JSON keys of
    ``symcost checkpoint``).

    ``memory`` (bytes): the least recompute whose exactly traced step peak fits. ``budget``
    (0..1): the least recompute whose activation peak is at most that fraction of the
    activations without checkpointing (as torch.compile's ``activation_memory_budget``).
    Otherwise ``kind`` (default ``optimal``: the least activation peak). ``table=False`` leaves
    the trade-off table out (it solves the DP once per budget row).

    Returns ``{"plan", "interval", "segments", "activations", "peak", "recompute_flops",
    "train_flops", "tradeoff", "law", ...}``: bytes, FLOPs; ``law`` formula strings. ``peak``
    is the steady-state step's peak of the applied plan traced by symcost (:func:`exact`);
    ``activations`` the plan's activation peak by the segment model (:func:`plan_cost`).

    Raises:
        SymcostError: no repeated blocks; bad sizes; a budget outside (0, 1]; a cap no plan
            meets (the message gives the least peak).
    """
    from symcost.passes.memory import memory_model

    t0 = time.perf_counter()
    sizes = dict(sizes or {})
    env = an.bind(**sizes)
    if SYMS["L"] not in env or an.layer_container is None:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")
    L = int(env[SYMS["L"]])
    ch = chain(an, L, env, optimizer, impl)
    lw = law(ch.costs)
    base_train = int(an.flops("train").xreplace(env))
    plain_act = ch.cost([])[0]
    if budget is not None:
        if not (0 < budget <= 1):
            raise SymcostError(f"--budget is a fraction of the activations without checkpointing, "
                               f"in (0, 1]; got {budget}")
        cap_act = int(budget * plain_act)
        least = ch.optimal()[1]
        if cap_act < least:
            raise SymcostError(f"--budget {budget} asks for activations <= {cap_act} bytes; the least any "
                               f"plan reaches is {least} bytes ({least / plain_act:.3f} of {plain_act})")
        plan = Plan(ch.costs.container, L, ch.optimal(cap_act)[0], "budget")
    elif memory is not None:
        plan = _fit_memory(an, ch, L, sizes, memory, optimizer, impl)
    else:
        plan = make_plan(an, kind, L, env, ch=ch)
    t_solve = time.perf_counter() - t0
    act, rec = ch.cost(plan.segments)
    out: dict[str, Any] = {
        "model": an.model, "L": L, "kind": plan.kind,
        "plan": plan.modules(), "interval": plan.interval, "segments": [list(s) for s in plan.segments],
        "n_segments": len(plan.segments),
        "activations": act, "activations_none": plain_act,
        "recompute_flops": rec, "train_flops": base_train + rec, "train_flops_none": base_train,
        "solve_seconds": t_solve,
    }
    mm = memory_model(an, an.precision, optimizer, impl)
    out["peak_none"] = mm.peak(**sizes)
    out["peak"] = None
    if exact_peak:
        ex = exact(an, plan, sizes, optimizer, impl)
        out["peak"] = ex["peak"]
        out["peak_source"] = ex["peak_source"]
        out["train_flops_traced"] = ex["train_flops"]
        out["trace_seconds"] = ex["seconds"]
    out["tradeoff"] = tradeoff(ch, L, peak_model(an, ch, L, sizes, optimizer, impl)) if table else []
    out["op_tradeoff"] = []
    if table:  # one level down: which tensors inside a block to keep (symcost.passes.checkpoint_ops)
        from symcost.passes import checkpoint_ops

        try:
            out["op_tradeoff"] = checkpoint_ops.tradeoff(an, env)
        except SymcostError:
            pass
    out["law"] = {k: str(v) for k, v in lw.items() if k not in ("k", "j")}
    out["k_star"] = float(lw["k_star"].xreplace(env))
    out["k_best"] = integer_k(lw, env, L, ch.head)
    out["block"] = {"a": ch.a[-1], "x": ch.x[-1] - rng_state_bytes(), "rng_state": rng_state_bytes(),
                    "f": ch.f[-1], "f_last": ch.fr[-1], "ops": ch.costs.n_ops, "head": ch.head}
    out["plan_object"] = plan
    return out


def _fit_memory(an, ch: Chain, L, sizes, cap, optimizer, impl) -> Plan:
    """The least-recompute plan whose traced step peak is <= ``cap``: the DP under an activation
    budget, the budget taken from the cap less what is not activations (the exact peak of the
    least-peak plan less its activation peak), checked by tracing the plan and tightened by the
    overshoot if it does not fit (at most four rounds; else the least-peak plan)."""
    best_segs, best_act, _ = ch.optimal()
    best = Plan(ch.costs.container, L, best_segs, "memory")
    pk = exact(an, best, sizes, optimizer, impl)["peak"]
    if pk > cap:
        raise SymcostError(f"no checkpoint plan fits under {cap} bytes: the least peak of a step is "
                           f"{pk} bytes ({pk / 2**30:.3f} GiB)")
    budget = cap - (pk - best_act)
    for _ in range(4):
        if budget >= ch.cost([])[0]:
            from symcost.passes.memory import memory_model

            none_pk = memory_model(an, an.precision, optimizer, impl).peak(**sizes)
            if none_pk <= cap:
                return Plan(ch.costs.container, L, [], "memory")
        segs = ch.optimal(max(budget, best_act))[0]
        plan = Plan(ch.costs.container, L, segs, "memory")
        got = exact(an, plan, sizes, optimizer, impl)["peak"]
        if got <= cap:
            return plan
        budget -= got - cap
    return best


def tradeoff(ch: Chain, L: int, peak=None) -> list[dict]:
    """The trade-off table: no checkpointing, every interval k = 1..L (⌈L/k⌉ segments), then
    activation budgets 0.9, 0.8, ... of the activations without checkpointing (the DP's least
    recompute within each): activation peak and ``peak`` (bytes; ``peak(segments)``, e.g.
    :func:`peak_model`) and recompute FLOPs."""
    def row(segs, **key):
        act, rec = ch.cost(segs)
        return {**key, "segments": len(segs), "activations": act,
                "peak": peak(segs) if peak else None, "recompute_flops": rec}

    rows = [row([], k=None)]
    for k in range(1, L + 1):
        rows.append(row(uniform_segments(L, k), k=k))
    plain = ch.cost([])[0]
    least = ch.optimal()[1]
    for tenth in range(9, 0, -1):
        cap = plain * tenth // 10
        if cap < least:
            break
        rows.append(row(ch.optimal(cap)[0], budget=tenth / 10))
    return rows


def plan_memory(an, kind: str, sizes: Mapping[str, int], optimizer: str = "adamw",
                impl: str = "foreach", at: Mapping[str, int] | None = None):
    """``(plan, memory model, sizes for it)`` of the step checkpointed by ``kind`` (one of
    :data:`KINDS`): the plan chosen at ``at`` (default: ``sizes`` with B = 1 where B is free),
    traced by symcost (:func:`exact`), so the memory model's ``peak``/``solve``/
    ``plan_accumulation`` are those of the checkpointed step. The returned sizes replace L by
    the number of segments of a uniform plan's trace, or drop it for a plan traced at its L.

    Raises:
        SymcostError: unknown kind, no repeated blocks, bad sizes.
    """
    from symcost.passes.memory import memory_model

    if kind not in KINDS:
        raise SymcostError(f"unknown checkpoint plan {kind!r}; accepted: {', '.join(KINDS)}")
    sizes = dict(sizes)
    if kind == "none":
        return None, memory_model(an, an.precision, optimizer, impl), sizes
    at = dict(at if at is not None else sizes)
    if "B" in an.symbols and "B" not in at:
        at["B"] = 1
    if "S" in an.symbols and "S" not in at:
        at["S"] = an.spec.defaults.get("S", 1)
    env = an.bind(**at)
    if SYMS["L"] not in env or an.layer_container is None:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")
    L = int(env[SYMS["L"]])
    plan = make_plan(an, kind, L, env, ch=chain(an, L, env, optimizer, impl))
    ex = exact(an, plan, at, optimizer, impl, trace_any=True)
    out_sizes = {k: v for k, v in sizes.items() if k != "L" and k in ex["analysis"].symbols}
    out_sizes.update(ex["L_arg"])
    return plan, ex["memory_model"], out_sizes

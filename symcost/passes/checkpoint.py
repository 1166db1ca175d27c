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
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import sympy

from symcost.errors import SymcostError
from symcost.frontends.checkpointing import rng_state_bytes, traced_checkpoint  # noqa: F401  (re-exported)
from symcost.frontends.checkpointing import without_cache as _without_cache
from symcost.passes.checkpoint_dp import Costs
from symcost.tracing.fit import SYMS
from symcost.tracing.poly import terms_expr

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
    """Which end block of the L = 2 fold stands apart (``"first"``, ``"last"``, None): from the
    trace's fold, or, for an analysis read from the trace cache (no fold at hand), from its
    schedule's units and the ops block 0 runs once."""
    c = an.layer_container
    pre = f"{c}." if c else ""
    if getattr(an, "role", None) is None:
        if an.schedule is not None and any(u.label == "forward, last block" for u in an.schedule.units):
            return "last"
        L = SYMS["L"]
        once = any(op.layer is not None and op.phase == "forward" and not sympy.sympify(op.repeat).has(L)
                   for op in an.ops)
        return "first" if once else None
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
    """(activation peak in bytes, recompute FLOPs) of checkpointing ``segments`` of a block chain
    in the segment model (:meth:`symcost.passes.checkpoint_dp.Costs.segment_model`).

    The model (Chen et al. 2016, Sec. 4; the order of the backward as in Griewank & Walther's
    revolve): blocks outside a segment keep their activations ``a_i``; a checkpointed segment
    keeps only its input ``x_start`` during the forward; in the backward, segment s is
    recomputed while everything kept before it is live: peak = max(kept at the end of the
    forward + ``head``, max over segments of kept-before-s + x_s + Σ a over s). ``head`` is
    what the step holds at the end of the forward besides the blocks' activations.
    Recompute = Σ f over checkpointed blocks (each recomputed once), except that the last block
    of a segment costs ``fr`` (default ``f``): a non-reentrant checkpoint stops recomputing as
    soon as every tensor the backward needs is back (``torch.utils.checkpoint``'s early stop,
    on by default), so the ops after the segment's last saved tensor never rerun.
    """
    from symcost.passes.checkpoint_dp import Costs

    return Costs.segment_model(a, x, f, head, fr).cost(segments)


def optimal_segments(a: Sequence[int], x: Sequence[int], f: Sequence[int],
                     budget: int | None = None, head: int = 0,
                     fr: Sequence[int] | None = None) -> tuple[list[tuple[int, int]], int, int]:
    """The exact optimum of the segment model (:func:`plan_cost`) over every segmentation:
    without ``budget`` the least activation peak (ties: least recompute), with ``budget``
    (bytes) the least recompute within it (ties: least peak); the search is
    :meth:`symcost.passes.checkpoint_dp.Costs.optimal`. Returns ``(segments, peak, recompute)``.

    Raises:
        SymcostError: no segmentation fits ``budget``.
    """
    from symcost.passes.checkpoint_dp import Costs

    return Costs.segment_model(a, x, f, head, fr).optimal(budget)


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
        calls them. Parameter names, hooks and the module tree stay as they are, and the new
        forwards hold the blocks by weak reference: the applied model makes no reference cycle
        (dropped, it is freed at once, as the original, not whenever Python's cyclic garbage
        collector runs).

        As Hugging Face's gradient checkpointing does (``transformers``' ``GradientCheckpointingLayer``
        and ``merge_with_config_defaults``), a segment is checkpointed only when its first block
        is in training mode and gradients are enabled (otherwise it runs as is, for generation),
        and then runs without a key/value cache: a ``use_cache`` keyword becomes False and a
        cache keyword (``cache``, ``past_key_values``, ``past_key_value``, ``layer_past``) None,
        since the recomputation would write the cache a second time (a doubled sequence length:
        wrong attention, or a shape error with eager attention). A model whose config keeps
        ``use_cache=True`` (a ``transformers`` model as loaded) and whose ``forward`` takes
        ``use_cache`` gets a forward pre-hook that passes ``use_cache=False`` in training with
        gradients enabled, so it builds and returns no cache, as Hugging Face's model does.

        Raises:
            SymcostError: the model's block container does not hold ``L`` blocks.
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        blocks = list(model.get_submodule(self.container)) if self.container else list(model)
        if len(blocks) != self.L:
            raise SymcostError(f"the plan is for {self.L} blocks in {self.container!r}, "
                               f"the model has {len(blocks)}")
        for s, e in self.segments:
            # the blocks by weak reference only: a block's forward that held its block (or the
            # segment's blocks) would make every block a reference cycle, kept with its parameters
            # and gradients after the model is dropped until the cyclic garbage collector runs
            seg = [weakref.ref(b) for b in blocks[s:e]]
            state = {"inside": False, "out": None}
            origs = [b.__dict__.get("forward") for b in blocks[s:e]]  # an instance's own forward, if any

            def run(*args, _seg=seg, _state=state, **kwargs):
                _state["inside"] = True
                try:
                    out = None
                    for ref in _seg:
                        out = ref()(*args, **kwargs)
                        args = (out if not isinstance(out, (tuple, list)) else out[0],) + tuple(args[1:])
                    return out
                finally:
                    _state["inside"] = False

            def make(i, _own, _me, _state=state, _n=len(seg), _run=run, _first=seg[0]):
                def forward(*args, **kwargs):
                    if _state["inside"]:
                        if _own is not None:
                            return _own(*args, **kwargs)
                        me = _me()
                        return type(me).forward(me, *args, **kwargs)
                    if i == 0:
                        if not (_first().training and torch.is_grad_enabled()):
                            out = _run(*args, **kwargs)  # nothing to replay: as is, cache included
                        else:
                            out = (traced_checkpoint if _traced else checkpoint)(
                                _run, *args, use_reentrant=False, **_without_cache(kwargs))
                        if _n > 1:
                            _state["out"] = out
                        return out
                    out = _state["out"]
                    if i == _n - 1:
                        _state["out"] = None
                    return out
                return forward

            for i, b in enumerate(blocks[s:e]):
                b.forward = make(i, origs[i], seg[i])
        if self.segments:
            _no_cache_in_training(model)
        return model


#: keywords by which ``transformers`` layers take a key/value cache (names differ by version/model)
def _no_cache_in_training(model) -> None:
    """A forward pre-hook on ``model`` passing ``use_cache=False`` in training with gradients
    enabled, where its config asks for a cache and its ``forward`` takes ``use_cache`` (what a
    ``transformers`` model does under gradient checkpointing). Installed once per model."""
    import inspect

    import torch

    cfg = getattr(model, "config", None)
    if not getattr(cfg, "use_cache", False) or getattr(model, "_symcost_no_cache_hook", False):
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if "use_cache" not in params:
        return

    def hook(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
            kwargs = dict(kwargs, use_cache=False)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._symcost_no_cache_hook = True


# --------------------------------------------------------------------------------------------
# the step's peak under any plan: the traced schedules composed block by block
# --------------------------------------------------------------------------------------------

_FWD = {"first": "forward, first block", "block": "forward, block", "last": "forward, last block"}
_BWD = {"first": "backward, first block", "block": "backward, block", "last": "backward, last block"}
_PRE, _END, _POST = "forward, before the blocks", "end of forward / start of backward", "backward, after the blocks"


def _shared_inputs(mmP, mmC, x_bytes) -> tuple[set[int], set[int]]:
    """Storages made before the blocks that the blocks share, by the positions of their
    allocations (the part before the blocks is the same in both traces; else none are told
    apart): ``(held, once)``.

    ``held``: freed at the end of the forward of the plain step (nothing saved them; e.g. a
    causal mask every block takes) but in the backward of the every-layer step (each checkpoint
    keeps its inputs for the recomputation; the last one goes with the first segment's backward).
    ``once``: saved by every block (rotary tables) or kept by every checkpoint, freed with the
    backward of the first block in both. The folded schedule frees such a storage in every pass of
    a block's backward unit (the reference trace has one pass), which a composition of passes must
    not: both are left out of the units and freed once, where the plan frees them. A block's
    input is not one of them (each block's backward frees its own; the first block's comes
    from before the blocks): told apart by its size, ``x_bytes`` (a polynomial in the symbols).
    """
    def frees(mm):
        units = {lab: ids for ids, _r, _m, lab in mm.units}
        pre = units[_PRE]
        unit_of = {k: lab for lab, ids in units.items() for k in ids}
        ev = mm.schedule.events
        return pre, {ev[k].alloc: unit_of[k] for k in range(len(ev)) if ev[k].alloc in pre and ev[k].alloc != k}

    preP, fP = frees(mmP)
    preC, fC = frees(mmC)
    evP, evC = mmP.schedule.events, mmC.schedule.events
    if not (len(preP) == len(preC) and all((evP[a].op, evP[a].bytes) == (evC[b].op, evC[b].bytes)
                                           for a, b in zip(preP, preC))):
        return set(), set()
    blocks = set(_BWD.values())
    held = {a for a, u in fP.items() if u == _END and fC.get(a) in blocks}
    x = sympy.expand(x_bytes)
    once = {a for a, u in fP.items() if u in blocks and fC.get(a) in blocks
            and sympy.expand(terms_expr(mmP.schedule.gens, evP[a].bytes) - x) != 0}
    return held, once


def _unit_values(mm, env: Mapping, accumulate: bool = False, shared: frozenset = frozenset(),
                 once: frozenset = frozenset()) -> dict:
    """Per unit of ``mm``'s folded schedule (docs/memory.md), one pass at ``env``:
    ``(delta, peak, where)``: the bytes the pass leaves allocated, the highest live set at one
    of its allocations relative to its start (None without allocations) and the op there.
    ``accumulate``: a gradient-accumulation micro-step (a new gradient is a transient, added in
    place), as :class:`~symcost.passes.memory.MemoryModel` reads it.

    The end of the forward is split where the forward ends: ``{"pre": (...), "post": (...),
    "free": {role: bytes}}``. ``free`` is what each block held only during the forward and
    that is freed there, by the role of the block (``first``, ``block``, ``last``): storages
    its forward allocated and the end of the forward frees, once per block (autocast's cache
    of weight casts, emptied when the forward leaves autocast); they are left out of ``pre`` and
    freed between ``pre`` and ``post`` (the composition frees each block's own).

    ``shared``, ``once``: allocations (:func:`_shared_inputs`) whose frees are left out of every
    unit; ``out["shared"]``, ``out["once"]`` are their sizes (the composition frees them where the
    plan does)."""
    from symcost.passes.memory.live import _peval

    vals = mm._values(env)
    Li = mm.gens.index("L") if "L" in mm.gens else None
    vals1 = None if Li is None else tuple(v + 1 if q == Li else v for q, v in enumerate(vals))
    unit_of, role_of = {}, {}
    for ids, rep, _min_L, label in mm.units:
        for k in ids:
            unit_of[k] = label
    for role, label in _FWD.items():
        role_of[label] = role
    out = {}
    for ids, rep, _min_L, label in mm.units:
        parts = []  # (delta, peak, where) of each part
        lev, top, where = 0, None, ""
        free: dict[str, int] = {}
        for k in ids:
            ev = mm.schedule.events[k]
            p = int(_peval(mm._evpolys[k], vals))
            if (ev.alloc in shared or ev.alloc in once) and ev.alloc != k:
                continue  # freed where the plan frees it
            if label == _END and parts == [] and ev.phase != "forward":
                parts.append((lev, top, where))  # the forward ends here
                lev, top, where = 0, None, ""
            if label == _END and not parts and p < 0 and role_of.get(unit_of.get(ev.alloc)):
                role = role_of[unit_of[ev.alloc]]
                per = p
                if vals1 is not None and unit_of[ev.alloc] == _FWD["block"]:  # freed once for its L - 1 passes
                    per = int(_peval(mm._evpolys[k], vals1)) - p
                    if per == 0:
                        per = None  # the last pass's storage only: an ordinary event
                if per is not None:
                    free[role] = free.get(role, 0) - per
                    continue
            if mm.grad_transient(accumulate) and k in mm.grad_events:
                if top is None or lev + p > top:
                    top, where = lev + p, mm._label(k, label)
                continue
            lev += p
            if ev.alloc == k and (top is None or lev > top):
                top, where = lev, mm._label(k, label)
        if label == _END:
            parts.append((lev, top, where))
            if len(parts) == 1:
                parts.append((0, None, ""))
            out[label] = {"pre": parts[0], "post": parts[1], "free": free}
        else:
            out[label] = (lev, top, where)
    out["shared"] = sum(int(_peval(mm._evpolys[a], vals)) for a in shared)
    out["once"] = sum(int(_peval(mm._evpolys[a], vals)) for a in once)
    return out


@dataclass
class StepSchedule:
    """The steady-state step's storage schedule at concrete sizes, per block, under any plan.

    Built from two traces of the same model (docs/checkpoint.md, "Predicting the peak"): the
    plain step (``plain``) and the step with every block checkpointed on its own (``ckpt``),
    each cut by the memory pass into units (before the blocks, one block's forward, the end of
    the forward, one block's backward, after the blocks) with, at these sizes, the bytes a unit
    leaves allocated (``delta``) and its highest live set (``peak``). A plan's step is these
    units in the order PyTorch runs them:

    * forward: a plain block is the plain trace's unit; a checkpointed block the checkpointed
      trace's (its input and RNG state stay, nothing is saved), except that inside a segment
      only the first block stashes an RNG state and a block's output is dropped once the next
      block has run (it is not the segment's output);
    * backward: a plain block is the plain trace's unit; a segment ``[s, e)`` reruns its blocks
      ``s .. e-2`` in full (the plain trace's forward units: they save what the backward needs
      and their outputs feed the next block), then its last block as the checkpointed trace's
      backward unit (its early-stopped recomputation and backward), then the backward of
      ``e-2 .. s`` as the plain trace's units;

    and then the optimizer step's temporaries (memory pass) on top of what the backward leaves.
    Uniform plans composed this way equal the traced uniform plans to the byte (tests).
    ``static`` (bytes) is live all step; ``base`` is where the dynamic part starts (the
    gradients, for an accumulation micro-step).
    """

    plain: dict
    ckpt: dict
    L: int
    out_bytes: list[int]  # the output of each block (the next block's input)
    rng: int
    static: int
    base: int
    opt: int  # the optimizer step's largest temporary
    opt_where: str
    shared: int = 0  # inputs the blocks share, held by the checkpoints (:func:`_shared_inputs`)
    once: int = 0  # inputs the blocks share, held until the first block's backward

    def role(self, i: int) -> str:
        if _FWD["last"] in self.plain:
            return "last" if i == self.L - 1 else "block"
        return "first" if i == 0 else "block"

    def simulate(self, segments: Sequence[tuple[int, int]]) -> tuple[int, str]:
        """``(peak, where)``: the step's peak in bytes (static included) with ``segments``
        checkpointed, and the unit and op where it is reached."""
        P, C, L = self.plain, self.ckpt, self.L
        seg_of = {i: (s, e) for s, e in segments for i in range(s, e)}
        st = {"lev": self.base, "top": None, "where": ""}

        def run(u, shift=0, adj=0, what=""):
            d, p, where = u
            if p is not None and (st["top"] is None or st["lev"] + p + shift > st["top"]):
                st["top"], st["where"] = st["lev"] + p + shift, (what + where)
            st["lev"] += d + adj

        run(P[_PRE])
        pending = 0
        for i in range(L):
            r = self.role(i)
            if i not in seg_of:
                run(P[_FWD[r]])
            else:
                s, e = seg_of[i]
                first = i == s
                run(C[_FWD[r]], 0 if first else -self.rng, 0 if first else -self.rng)
            st["lev"] -= pending
            pending = self.out_bytes[i] if i in seg_of and i != seg_of[i][1] - 1 else 0
        end = (C if L - 1 in seg_of else P)[_END]
        run(end["pre"])
        st["lev"] -= sum(((C if i in seg_of else P)[_END]["free"].get(self.role(i), 0)) for i in range(L))
        if not segments:  # nothing holds the inputs the blocks shared
            st["lev"] -= self.shared
        run(end["post"])
        first_seg = min(segments)[0] if segments else None
        i = L - 1
        while i >= 0:
            if i not in seg_of:
                run(P[_BWD[self.role(i)]])
                i -= 1
                continue
            s, e = seg_of[i]
            for t in range(s, e - 1):
                run(P[_FWD[self.role(t)]], what=f"recomputing block {t}: ")
            run(C[_BWD[self.role(e - 1)]], what=f"segment [{s}, {e}): ")
            for t in range(e - 2, s - 1, -1):
                run(P[_BWD[self.role(t)]], what=f"segment [{s}, {e}): ")
            if s == first_seg:  # the last checkpoint that held the shared inputs is gone
                st["lev"] -= self.shared
            i = s - 1
        st["lev"] -= self.once  # the first block's backward is done: nothing holds them
        run((C if 0 in seg_of else P)[_POST])
        top, where = st["top"], st["where"]
        if top is None or st["lev"] + self.opt > top:
            top, where = st["lev"] + self.opt, self.opt_where
        return self.static + top, where

    def costs(self) -> tuple[Costs, int]:
        """The step model as :class:`~symcost.passes.checkpoint_dp.Costs` tables for the exact
        search (dynamic bytes: the static part left out), and the most any plan's table peak can
        exceed its :meth:`simulate` peak (bytes).

        Walking the forward, ``K`` is what the blocks so far keep for the backward and ``D`` what
        they hold only until the forward ends (autocast's weight casts of checkpointed blocks);
        every live set of :meth:`simulate` is ``K`` (in the backward) or ``K + D`` (in the
        forward) at the start of the item (plain block or segment) it falls in plus an offset of
        that item alone, except for one term: in the backward, the bytes the later blocks left
        for good (their parameter gradients: a block's forward and backward deltas less what the
        end of the forward freed) depend on how those blocks run, which a search from the first
        block does not know yet. The tables take the larger of the ways a block can run (plain;
        alone in a segment; first, inside or last in a longer one), and likewise for the end of
        the forward, the units after the blocks and the optimizer step, so a plan's table peak is
        never below its step peak and exceeds it by at most the returned bound: the search's
        optimum is within that of the best plan's step peak. (The ways differ by a few small
        tensors; the bound is 0 where they do not.)
        """
        P, C, L, rng, xo = self.plain, self.ckpt, self.L, self.rng, self.out_bytes
        R = [self.role(i) for i in range(L)]
        pF = [P[_FWD[r]] for r in R]
        cF = [C[_FWD[r]] for r in R]
        pB = [P[_BWD[r]] for r in R]
        cB = [C[_BWD[r]] for r in R]
        dP = [P[_END]["free"].get(r, 0) for r in R]
        dC = [C[_END]["free"].get(r, 0) for r in R]
        NEG = -(2**62)
        pk = lambda u: NEG if u[1] is None else u[1]  # noqa: E731 - a unit without allocations
        # what a block leaves for good, by how it runs (later blocks always form whole items, so a
        # segment's one RNG state, stashed by its first block and dropped with its last, is put on
        # neither)
        nets = [(pF[i][0] - dP[i] + pB[i][0],  # plain
                 cF[i][0] - dC[i] + cB[i][0],  # alone in a segment, or last of a longer one
                 cF[i][0] - dC[i] - rng - xo[i] + pF[i][0] + pB[i][0])  # first or inside (rerun in full)
                for i in range(L)]
        gap = sum(max(t) - min(t) for t in nets)
        G = [0] * (L + 1)  # what blocks i .. L-1 leave for good, taken high
        for i in range(L - 1, -1, -1):
            G[i] = G[i + 1] + max(nets[i])
        # the inputs the blocks share stay allocated in the backward until the first segment's
        # backward ends (without segments the end of the forward frees them): taken as held
        # throughout the backward
        ends = {m: (U[_END]["pre"][0] + U[_END]["post"][0]) for m, U in (("p", P), ("c", C))}
        end_hi = max(ends.values())
        gap += end_hi - min(ends.values())
        post_d = max(P[_POST][0], C[_POST][0])
        post_p = max(pk(P[_POST]), pk(C[_POST]))
        gap += (post_d - min(P[_POST][0], C[_POST][0])) + max(0, post_p - min(pk(P[_POST]), pk(C[_POST])))
        gap += self.shared
        c0 = self.base + P[_PRE][0]
        floor = max(self.base + pk(P[_PRE]), c0 + end_hi + G[0] - self.once + post_p,
                    c0 + end_hi + G[0] - self.once + post_d + self.opt)
        kp = [pF[i][0] - dP[i] for i in range(L)]
        cp, cpf = [], []
        for i in range(L):
            f_terms = [c0 + pk(pF[i])]  # the block's forward, on K + D
            if i == L - 1:
                e = P[_END]
                f_terms.append(c0 + pF[i][0] + pk(e["pre"]))
                b_terms = [c0 + kp[i] + e["pre"][0] + pk(e["post"]), c0 + kp[i] + ends["p"] + pk(pB[i])]
            else:
                b_terms = [c0 + kp[i] + end_hi + G[i + 1] + pk(pB[i])]
            cp.append(max(b_terms))
            cpf.append(max(f_terms))
        n1 = L + 1
        ks = [[0] * n1 for _ in range(n1)]
        ds = [[0] * n1 for _ in range(n1)]
        W: list = [[None] * n1 for _ in range(n1)]
        Wf: list = [[None] * n1 for _ in range(n1)]
        for s in range(L):
            f_before, pend, top_f, dsum = 0, 0, NEG, 0  # the segment's forward so far (on K + D)
            rec_sum, rec_top = 0, NEG  # the full recomputation of its inner blocks
            bwd_top = NEG  # the backward of its inner blocks, relative to after the last block's
            for e in range(s + 1, L + 1):
                t = e - 1  # the segment's last block
                shift = 0 if t == s else -rng
                top_f = max(top_f, f_before + pk(cF[t]) + shift)
                after = f_before + cF[t][0] + shift - pend  # on K + D
                dsum += dC[t]
                k_seg = after - dsum
                ks[s][e], ds[s][e] = k_seg, dsum
                f_terms = [c0 + top_f]
                if e == L:
                    en = C[_END]
                    f_terms.append(c0 + after + pk(en["pre"]))
                    lev = c0 + k_seg + ends["c"]
                    b_terms = [c0 + k_seg + en["pre"][0] + pk(en["post"])]
                else:
                    lev = c0 + k_seg + end_hi + G[e]  # where the backward reaches the segment
                    b_terms = []
                b_terms += [lev + rec_top, lev + rec_sum + pk(cB[t]), lev + rec_sum + cB[t][0] + bwd_top]
                W[s][e], Wf[s][e] = max(b_terms), max(f_terms)
                # for the longer segments, t is an inner block: rerun in full, then its backward
                rec_top = max(rec_top, rec_sum + pk(pF[t]))
                rec_sum += pF[t][0]
                bwd_top = max(bwd_top + pB[t][0], pk(pB[t])) if bwd_top > NEG else pk(pB[t])
                f_before, pend = after, xo[t]
        rec = [[0] * n1 for _ in range(n1)]  # the caller's (FLOPs)
        flat = not any(dP) and not any(dC)
        return Costs(kp, cp, ks, W, rec, floor, None if flat else list(dP), cpf, None if flat else ds, Wf), gap


@dataclass
class Chain:
    """The block chain at concrete sizes.

    The segment model (:func:`plan_cost`): per-block ``a``, ``x`` (bytes), ``f``, ``fr``
    (FLOPs) and ``head`` (bytes live at the end of the forward besides the blocks'
    activations). The step model: ``schedule`` (:class:`StepSchedule`), the step's peak under
    any plan composed from the traced schedules.
    """

    a: list[int]
    x: list[int]
    f: list[int]
    head: int
    costs: BlockCosts
    fr: list[int] | None = None  # recompute of a block that ends its segment (early stop)
    schedule: "StepSchedule | None" = None

    def cost(self, segments) -> tuple[int, int]:
        """(activation peak bytes, recompute FLOPs) of ``segments`` (:func:`plan_cost`)."""
        return self.seg.cost(segments)

    def optimal(self, budget: int | None = None):
        """The segment model's optimum (:func:`optimal_segments`): ``(segments, activation peak,
        recompute)``; with ``budget`` (bytes of activations) the least recompute within it."""
        return self.seg.optimal(budget)

    @property
    def seg(self) -> Costs:
        """The segment model as search tables (cached)."""
        c = self.__dict__.get("_seg")
        if c is None:
            c = self.__dict__["_seg"] = Costs.segment_model(self.a, self.x, self.f, self.head, self.fr)
        return c

    @property
    def step(self) -> tuple[Costs, int]:
        """The step model as search tables (dynamic bytes, static left out) and the bound on how
        far their peak can exceed the composed schedule's (:meth:`StepSchedule.costs`)."""
        c = self.__dict__.get("_step")
        if c is None:
            if self.schedule is None:
                raise SymcostError("this chain has no step schedule")
            tables, gap = self.schedule.costs()
            tables.rec = self.seg.rec
            c = self.__dict__["_step"] = (tables, gap)
        return c

    def peak(self, segments) -> int:
        """The step's peak in bytes with ``segments`` checkpointed (:meth:`StepSchedule.simulate`)."""
        return self.schedule.simulate(segments)[0]

    def step_optimal(self, cap: int | None = None) -> tuple[list[tuple[int, int]], int, int]:
        """The step model's optimum: without ``cap`` the least peak (ties: least recompute); with
        ``cap`` (bytes, the whole step) the least recompute whose peak fits. Returns
        ``(segments, peak, recompute)`` with the composed schedule's peak (:meth:`peak`).

        The search runs on tables whose peak exceeds a plan's composed peak by at most the bound
        ``g`` of :meth:`StepSchedule.costs`. Every plan that fits ``cap`` has a table peak within
        ``cap + g``, so the least recompute there, when its composed peak fits, is the least
        recompute of all plans that fit (exact). Otherwise the least recompute whose table peak
        fits ``cap`` (it surely fits), else the least-peak plan when it fits: those are within the
        bound of the optimum. Without ``cap`` the least table peak, within ``g`` of the least
        composed peak (``optimality_gap`` in :func:`recommend`).

        Raises:
            SymcostError: no plan found fits ``cap`` (the message gives the least peak found).
        """
        tables, gap = self.step
        static = self.schedule.static
        if cap is None:
            segs, _, rec = tables.optimal()
            return segs, self.peak(segs), rec
        for budget in dict.fromkeys((cap - static + gap, cap - static)):
            try:
                segs, _, rec = tables.optimal(budget)
            except SymcostError:
                continue
            pk = self.peak(segs)
            if pk <= cap:
                return segs, pk, rec
        segs, pk, rec = self.step_optimal()
        if pk <= cap:
            return segs, pk, rec
        raise SymcostError(f"no checkpoint plan fits under {cap} bytes: the least peak of a step is "
                           f"{pk} bytes ({pk / 2**30:.3f} GiB)")


_CACHE: dict = {}  # per analysis (by id): block costs, law, every-layer trace, recompute


def _cached(an, what: str, make):
    key = (id(an), what)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not an:
        hit = _CACHE[key] = (an, make())
    return hit[1]


def chain(an, L: int, env: Mapping, optimizer: str = "adamw", impl: str = "foreach",
          accumulate: bool = False) -> Chain:
    """The :class:`Chain` of ``an``'s blocks at ``L`` and sizes ``env`` (symbol -> int).

    ``x`` is the block input plus the RNG state a checkpoint stashes (:func:`rng_state_bytes`).
    ``head`` is the largest live set of the plain step that is not the optimizer step
    (``memory_model(an).peak_terms()``, docs/memory.md) less the blocks' activations: the
    model's output, the loss, its first gradients and what is saved outside the blocks. The
    step schedule needs the every-layer trace (:func:`every_layer`). ``accumulate``: the step is
    a gradient-accumulation micro-step (gradients live from its start).

    Raises:
        SymcostError: no repeated blocks; a schedule without a formula; bad sizes.
    """
    from symcost.passes.memory import memory_model

    bc = _cached(an, "block_costs", lambda: block_costs(an))
    env = {SYMS[str(k)] if not isinstance(k, sympy.Symbol) else k: v for k, v in env.items()}
    env[SYMS["L"]] = L
    a, x, f = bc.sequence(L, env)
    rng = rng_state_bytes()
    xo = list(x)
    x = [v + rng for v in x]  # a checkpoint keeps its input and the RNG state
    mmP = memory_model(an, an.precision, optimizer, impl)
    terms = [int(e.xreplace(env)) for e, min_L, where in mmP.peak_terms()
             if min_L <= L and not where.startswith("optimizer step")]
    head = max(0, max(terms, default=0) - sum(a))
    request = {str(k): int(v) for k, v in env.items()}
    sub = every_layer(an, request)
    fr = list(f)
    g, sp = _cached(sub, "recompute_last", lambda: recompute_last(an, sub))
    if g is not None:
        fr = [int(g.xreplace(env))] * L
        if bc.special:
            fr[0 if bc.special == "first" else L - 1] = int(sp.xreplace(env))
    mmC = memory_model(sub, an.precision, optimizer, impl)
    try:
        envC = {SYMS[s]: int(env[SYMS[s]]) for s in sub.symbols}
        vals = mmP._values(env)
    except KeyError as e:
        raise SymcostError(f"{an.model}: size {e} missing for the checkpointed step") from None
    from symcost.passes.memory.live import _peval

    tr = [(int(_peval(p, vals)), what) for p, what in mmP._optimizer_transients()] or [(0, "")]
    opt, opt_what = max(tr)
    held, once = _cached(sub, "shared", lambda: _shared_inputs(mmP, mmC, bc.x))
    held, once = frozenset(held), frozenset(once)
    plain = _unit_values(mmP, env, accumulate, held, once)
    sched = StepSchedule(
        plain=plain, ckpt=_unit_values(mmC, envC, accumulate, held, once), L=L,
        out_bytes=xo, rng=rng, static=int(mmP.static.xreplace(env)),
        base=int(mmP.grads.xreplace(env)) if accumulate and not mmP.policy.grad_buffer else 0, opt=opt,
        opt_where=f"optimizer step ({opt_what})", shared=plain.pop("shared"), once=plain.pop("once"))
    sched.ckpt.pop("shared")
    sched.ckpt.pop("once")
    if set(sched.plain) != set(sched.ckpt):
        raise SymcostError(f"{an.model}: the plain and the checkpointed step's schedules do not fold alike")
    return Chain(a, x, f, head, bc, fr, sched)


def recompute_last(an, sub=None) -> tuple[sympy.Expr | None, sympy.Expr | None]:
    """Recompute FLOPs of a block checkpointed on its own (generic, special end block), from the
    step traced with every block checkpointed (:func:`every_layer`): its train FLOPs less the
    plain step's, per block. Less than the block's forward where ops after its last saved tensor
    are skipped by the checkpoint's early stop. ``sub``: the every-layer trace to use (default:
    :func:`every_layer`'s first)."""
    L = SYMS["L"]
    sub = sub if sub is not None else every_layer(an)
    diff = sympy.expand(sub.flops("train") - an.flops("train"))
    g = diff.coeff(L, 1)
    if g.has(L):
        return None, None
    return sympy.expand(g), sympy.expand(diff.subs(L, 1))


def use_every_layer(an, sub) -> None:
    """Use ``sub`` as ``an``'s every-layer trace (:func:`every_layer`) in ``sub``'s regime, e.g. one
    read from the trace cache (``symcost checkpoint`` keeps it there), so that ``an`` itself may be
    a cached analysis that cannot build the model."""
    _every_layer_traces(an).append(sub)


def use_model(an, resolve) -> None:
    """Give ``an``, read from the trace cache (data only: it cannot build its model), a way to
    build it: ``resolve()`` -> the model's live :class:`~symcost.frontends.models.ModelSpec`, used
    where a checkpointed step must be traced in a regime no given trace holds (a solver asking
    for B = 1, say)."""
    _CACHE[(id(an), "resolve_model")] = (an, resolve)


def _every_layer_traces(an) -> list:
    return _cached(an, "every_layer", list)


def _holds(sub, sizes: Mapping[str, int]) -> bool:
    """Whether the every-layer trace ``sub`` holds at ``sizes``: the same regime facts (symbols set
    to 1, equal config symbols: shared/conventions.md, "Regimes") and its pinned sizes equal."""
    from symcost.frontends.spec import request_facts

    values = {s: int(v) for s, v in sizes.items()}
    if any(s in values and values[s] != v for s, v in sub.pinned.items() if s != "L"):
        return False
    facts, spec = getattr(sub, "request_facts", None), getattr(sub, "spec", None)
    if not facts or spec is None or not sub.recordings:  # from the trace cache: given for this request
        return True
    req = {s: v for s, v in values.items() if s in spec.all_symbols}
    return request_facts(spec.values(req, inputs=False), spec.all_symbols) == facts


def every_layer(an, sizes: Mapping[str, int] | None = None):
    """The analysis of ``an``'s step with every block checkpointed on its own (:func:`uniform_spec`
    with k = 1, non-reentrant, RNG states included) in the regime of ``sizes`` (symbol -> int; sizes
    of 1 and equal config symbols choose it, as for any trace): one given by
    :func:`use_every_layer` or traced earlier in that regime, or traced now (needs the live model).
    Without ``sizes``, the first one at hand (or one traced in ``an``'s own regime).

    Raises:
        SymcostError: ``an`` was read from the trace cache and no every-layer trace was given.
    """
    subs = _every_layer_traces(an)
    for sub in subs:
        if sizes is None or _holds(sub, sizes):
            return sub
    sub = _uniform_trace(an, 1)  # in an's own regime, where that holds at these sizes
    if sizes is not None and not _holds(sub, sizes):
        sub = _uniform_trace(an, 1, sizes)  # the regime of the sizes (B = 1 there, say)
    subs.append(sub)
    return sub


def _uniform_trace(an, k: int, sizes: Mapping[str, int] | None = None):
    """``an``'s step with every k blocks checkpointed (:func:`uniform_spec`), traced (once: kept
    per analysis, k and request) at ``sizes`` (symbol -> int; L left out for k > 1, there it
    counts segments), by default in ``an``'s own regime: at the sizes ``an`` was requested at
    (``an.request_sizes``), so the two traces tie and pin the same symbols (K = H or not, a pinned
    ALiBi head count) and their difference is the recomputation alone. ``an``'s pinned values are
    kept in any case."""
    from symcost.graph.build import trace

    if sizes is None:
        req = {s: int(v) for s, v in (getattr(an, "request_sizes", None) or {}).items()
               if s != "L" or s in an.pinned}
    else:
        req = {s: int(v) for s, v in sizes.items() if s != "L"}
    req.update({s: int(v) for s, v in an.pinned.items()})
    if k > 1 and "L" in req and "L" not in an.pinned:
        req.pop("L")
    key = (id(an.spec), an.precision, "uniform", k, tuple(sorted(req.items())))
    hit = _TRACES.get(key)
    if hit is None or hit[0] is not an.spec:
        base = an.spec
        given = _CACHE.get((id(an), "resolve_model"))
        if not an.recordings and given is not None and given[0] is an:  # a cached analysis: built again (use_model)
            base = _cached(an, "live_spec", given[1])
        spec = uniform_spec(base, an.layer_container or "", k)
        req = {s: v for s, v in req.items() if s in spec.all_symbols}
        hit = _TRACES[key] = (an.spec, trace(spec, sizes=req, precision=an.precision))
    return hit[1]


#: traces of checkpointed steps, by (model spec, precision, "uniform", k, request)
_TRACES: dict = {}


def law_of(an) -> dict:
    """:func:`law` of ``an``'s block costs (cached per analysis)."""
    return _cached(an, "law", lambda: law(_cached(an, "block_costs", lambda: block_costs(an))))


def make_plan(an, kind: str, L: int, env: Mapping | None = None, budget: int | None = None,
              ch: Chain | None = None) -> Plan:
    """A :class:`Plan` of ``kind`` for ``L`` blocks at sizes ``env`` (symbol -> int).

    ``none``; ``every-layer`` (each block its own segment, Hugging Face's
    ``gradient_checkpointing_enable``); ``sqrt`` (uniform segments of the best integer k next to
    the law's k* = sqrt(L·x/a), :func:`integer_k`); ``sqrt-L`` (segments of ⌈√L⌉ blocks, the
    textbook choice); ``optimal`` (the exact search on the step model: the least peak of the
    step, :meth:`Chain.step_optimal`); ``budget`` (the segment model's least recompute with
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
        return Plan(c, L, uniform_segments(L, integer_k(law_of(an), env, L, ch.head)), kind)
    if kind == "optimal":
        return Plan(c, L, ch.step_optimal()[0], kind)
    if kind == "budget":
        return Plan(c, L, ch.optimal(budget)[0], kind)
    raise SymcostError(f"unknown checkpoint plan {kind!r}; accepted: {', '.join(KINDS)}")


# --------------------------------------------------------------------------------------------
# the exact prediction: trace the applied plan
# --------------------------------------------------------------------------------------------


def uniform_spec(spec, container: str, k: int):
    """A :class:`~symcost.frontends.spec.ModelSpec` of ``spec`` with every k consecutive blocks grouped into
    one checkpointed segment (non-reentrant), its ``L`` counting segments: traced by symcost it
    folds over the segments, so the memory pass gives the step's peak for any number of segments
    as a formula (L blocks = k·L' when k divides L)."""
    from torch import nn

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
            return traced_checkpoint(self._run, *args, use_reentrant=False, **_without_cache(kwargs))

    def build(values):
        model = spec.build(dict(values, L=values["L"] * k))
        blocks = list(model.get_submodule(container)) if container else list(model)
        segs = nn.ModuleList(Segment(blocks[i:i + k]) for i in range(0, len(blocks), k))
        parent, _, attr = container.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, segs)
        return model

    check = spec.check if k == 1 or not spec.check else (lambda v: spec.check(dict(v, L=v.get("L", 1) * k)))
    return dataclasses.replace(
        spec, name=f"{spec.name} [checkpoint every {k}]", build=build,
        defaults=dict(spec.defaults), layers=container, check=check)




def is_uniform(plan: Plan) -> bool:
    """Segments of k blocks, k dividing L, covering every block."""
    k = plan.interval
    return k is not None and plan.L % k == 0 and plan.segments == uniform_segments(plan.L, k)


def exact(an, plan: Plan, sizes: Mapping[str, int], optimizer: str = "adamw",
          impl: str = "foreach", ch: Chain | None = None) -> dict:
    """The plan's predicted step: ``{"peak", "peak_source", "where", "train_flops", "seconds"}``
    (bytes, FLOPs) at ``sizes``.

    ``peak``: the steady-state step's peak with the plan applied, the traced schedules of the
    plain and the every-layer step composed block by block (:class:`StepSchedule`; it sees the
    recomputed forward, what each checkpoint keeps, the RNG states, the gradients the later
    blocks already hold, the end of the forward and the optimizer step), ``where`` the unit and
    op where it is reached. ``train_flops``: the plain step's model FLOPs plus the recompute
    (per-block forward and early-stopped last block, from the traces), FlopCounterMode's count
    of the applied step.
    """
    t0 = time.perf_counter()
    sizes = {k: v for k, v in sizes.items() if k != "L"}
    env = an.bind(**sizes, L=plan.L)
    ch = ch or chain(an, plan.L, env, optimizer, impl)
    peak, where = ch.schedule.simulate(plan.segments)
    return {"peak": peak, "peak_source": "schedule", "where": where,
            "train_flops": int(an.flops("train").xreplace(env)) + ch.cost(plan.segments)[1],
            "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------------
# the whole pass
# --------------------------------------------------------------------------------------------


def analyse(an, sizes: Mapping[str, int] | None = None, memory: int | None = None,
            budget: float | None = None, kind: str = "optimal", optimizer: str = "adamw",
            impl: str = "foreach", exact_peak: bool = True, table: bool = True) -> dict:
    """The checkpoint plan of a traced model at ``sizes`` (plain data; JSON keys of
    ``symcost checkpoint``).

    ``memory`` (bytes): the least recompute whose step peak fits (the exact search on the step
    model, :meth:`Chain.step_optimal`). ``budget`` (0..1): the least recompute whose activation
    peak (segment model) is at most that fraction of the activations without checkpointing (as
    torch.compile's ``activation_memory_budget``). Otherwise ``kind`` (default ``optimal``: the
    least step peak). ``table=False`` leaves the trade-off tables out.

    Returns ``{"plan", "interval", "segments", "activations", "peak", "recompute_flops",
    "train_flops", "tradeoff", "law", "optimality_gap", ...}``: bytes, FLOPs; ``law`` formula
    strings. ``peak`` is the step's peak with the plan applied (:func:`exact`); ``activations``
    the plan's activation peak by the segment model (:func:`plan_cost`); ``optimality_gap`` the
    bound (bytes) on how far the search's least peak can be above the best plan's
    (:meth:`StepSchedule.costs`).

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
    lw = law_of(an)
    base_train = int(an.flops("train").xreplace(env))
    plain_act = ch.cost([])[0]
    c = ch.costs.container
    if budget is not None:
        if not (0 < budget <= 1):
            raise SymcostError(f"--budget is a fraction of the activations without checkpointing, "
                               f"in (0, 1]; got {budget}")
        cap_act = int(budget * plain_act)
        least = ch.optimal()[1]
        if cap_act < least:
            raise SymcostError(f"--budget {budget} asks for activations <= {cap_act} bytes; the least any "
                               f"plan reaches is {least} bytes ({least / plain_act:.3f} of {plain_act})")
        plan = Plan(c, L, ch.optimal(cap_act)[0], "budget")
    elif memory is not None:
        plan = Plan(c, L, ch.step_optimal(memory)[0], "memory")
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
        "solve_seconds": t_solve, "optimality_gap": ch.step[1],
    }
    mm = memory_model(an, an.precision, optimizer, impl)
    out["peak_none"] = mm.peak(**sizes)
    out["peak"] = None
    if exact_peak:
        ex = exact(an, plan, sizes, optimizer, impl, ch=ch)
        out["peak"] = ex["peak"]
        out["peak_source"] = ex["peak_source"]
        out["peak_where"] = ex["where"]
    out["tradeoff"] = tradeoff(ch, L) if table else []
    out["op_tradeoff"] = []
    if table:  # one level down: which tensors inside a block to keep (symcost.passes.checkpoint_ops)
        from symcost.passes import checkpoint_ops

        try:
            out["op_tradeoff"] = checkpoint_ops.tradeoff(an, env)
        except SymcostError:
            pass
    out["law"] = {k: str(v) for k, v in lw.items() if k not in ("k", "j")}
    out["k_star"] = float(lw["k_star"].xreplace({**env, SYMS["L"]: L}))
    out["k_best"] = integer_k(lw, env, L, ch.head)
    out["block"] = {"a": ch.a[-1], "x": ch.x[-1] - rng_state_bytes(), "rng_state": rng_state_bytes(),
                    "f": ch.f[-1], "f_last": ch.fr[-1], "ops": ch.costs.n_ops, "head": ch.head}
    out["plan_object"] = plan
    return out


def tradeoff(ch: Chain, L: int) -> list[dict]:
    """The trade-off table: no checkpointing, every interval k = 1..L (⌈L/k⌉ segments), then
    activation budgets 0.9, 0.8, ... of the activations without checkpointing (the segment
    model's least recompute within each): activation peak (segment model), ``peak`` (the step's,
    :meth:`Chain.peak`; bytes) and recompute FLOPs."""
    def row(segs, **key):
        act, rec = ch.cost(segs)
        return {**key, "segments": len(segs), "activations": act,
                "peak": ch.peak(segs) if ch.schedule is not None else None, "recompute_flops": rec}

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


# --------------------------------------------------------------------------------------------
# max-batch with checkpointing
# --------------------------------------------------------------------------------------------


class CheckpointedMemory:
    """The memory of a step checkpointed by the plan ``kind`` chosen at every size, with the
    :class:`~symcost.passes.memory.MemoryModel` interface ``max-batch`` uses (``peak``,
    ``peak_where``, ``components``, ``solve``, ``plan_accumulation``, ``no_fit_reason``).

    At each size the plan is made (``optimal``: the least step peak at that size, so the largest
    batch is that of the best plan there) and its peak is the composed schedule's
    (:func:`exact`). ``solve`` searches the integer size (the least peak over plans grows with
    B and S: each plan's does) and checks M(value) <= cap < M(value + 1) exactly.
    """

    def __init__(self, an, kind: str, mm, optimizer: str = "adamw", impl: str = "foreach"):
        self.an, self.kind, self.plain = an, kind, mm
        self.policy, self.opt, self.impl, self.device = mm.policy, mm.opt, mm.impl, mm.device
        self.gens, self._syms = mm.gens, mm._syms
        self.static, self.grads = mm.static, mm.grads
        self._optimizer, self._impl = optimizer, impl
        self._memo: dict = {}

    def bytes_per_param(self) -> int:
        return self.plain.bytes_per_param()

    def _env(self, sizes):
        return self.plain._env(sizes)

    def full_values(self, sizes):
        return self.plain.full_values(sizes)

    def at(self, accumulate: bool = False, **sizes: int) -> tuple[Plan, Chain]:
        """The plan of ``kind`` at ``sizes`` and its chain."""
        key = (accumulate, tuple(sorted(sizes.items())))
        hit = self._memo.get(key)
        if hit is None:
            env = self.an.bind(**sizes)
            L = int(env[SYMS["L"]])
            ch = chain(self.an, L, env, self._optimizer, self.impl, accumulate)
            if self.kind == "optimal":
                plan = Plan(ch.costs.container, L, ch.step_optimal()[0], "optimal")
            else:
                plan = make_plan(self.an, self.kind, L, env, ch=ch)
            hit = self._memo[key] = (plan, ch)
        return hit

    def plan(self, **sizes: int) -> Plan:
        """The plan used at ``sizes``."""
        return self.at(**sizes)[0]

    def peak(self, accumulate: bool = False, **sizes: int) -> int:
        plan, ch = self.at(accumulate, **sizes)
        return ch.peak(plan.segments)

    def peak_where(self, **sizes: int) -> str:
        plan, ch = self.at(**sizes)
        return ch.schedule.simulate(plan.segments)[1]

    def peak_parts(self, accumulate: bool = False, **sizes: int) -> dict[str, Any]:
        """What the checkpointed step's peak at ``sizes`` is made of, in bytes, adding up to
        :meth:`peak`: the static parts of :meth:`MemoryModel.peak_parts` (``params``,
        ``optimizer``, ``master_weights``, ``buffers``, ``inputs``), and the live set where the
        peak is reached as one part, ``checkpointed`` (gradients so far, kept block inputs and
        RNG states, a segment's recomputed activations, temporaries: the composed schedule,
        :class:`StepSchedule`, does not split it further); the plain step's live parts are 0.
        Also ``peak`` and ``where``."""
        plan, ch = self.at(accumulate, **sizes)
        peak, where = ch.schedule.simulate(plan.segments)
        out: dict[str, Any] = {k: v for k, v in self.plain.peak_parts(accumulate, **sizes).items()
                               if k in ("params", "optimizer", "master_weights", "grad_buffer", "buffers",
                                        "inputs")}
        out.update(dict.fromkeys(self.plain.LIVE_PARTS, 0))
        out["checkpointed"] = int(peak) - sum(out.values())
        out["peak"], out["where"] = int(peak), where
        return out

    def components(self, **sizes: int) -> dict[str, int]:
        """As :meth:`MemoryModel.components`, with the checkpointed step's ``peak`` and, as
        ``activations``, the plan's activation peak (segment model)."""
        out = self.plain.components(**sizes)
        plan, ch = self.at(**sizes)
        out["activations"] = ch.cost(plan.segments)[0]
        out["peak"] = ch.peak(plan.segments)
        out.pop("activations_per_layer", None)
        return out

    def dominant(self, **sizes: int) -> tuple[str, int]:
        from symcost.passes.memory.solve import Solver

        return Solver.dominant(self, **sizes)

    def no_fit_reason(self, sol, **sizes: int):
        from symcost.passes.memory.solve import Solver

        return Solver.no_fit_reason(self, sol, **sizes)

    def plan_accumulation(self, global_batch: int, devices: int, cap, **sizes: int):
        from symcost.passes.memory.solve import Solver

        return Solver.plan_accumulation(self, global_batch, devices, cap, **sizes)

    def solve(self, cap, var: str = "B", accumulate: bool = False, **sizes: int):
        """Largest integer ``var`` (B or S) whose checkpointed step fits under ``cap``: doubling
        then bisection on the exact integer peak (the model's own limits respected, as
        :meth:`MemoryModel.solve`).

        Raises:
            SymcostError: ``var`` not a symbol, or set in ``sizes``; a peak that does not grow.
        """
        from symcost.passes.memory import parse_memory
        from symcost.passes.memory.results import Solution

        t0 = time.perf_counter()
        cap = parse_memory(cap)
        if var not in self.gens:
            raise SymcostError(f"cannot solve for {var!r}: not a symbol of {self.an.model} "
                               f"(symbols: {', '.join(self.gens)})")
        sizes = dict(sizes)
        if var in sizes:
            raise SymcostError(f"--set {var}=... conflicts with solving for {var}")
        env = self._env({**sizes, var: 1})
        fixed = {str(s): int(env[s]) for s in self._syms if str(s) != var}
        check = self.an.spec.check

        def valid(x):
            return check(self.full_values({**fixed, var: x})) is None

        def M(x):
            return self.peak(accumulate, **fixed, **{var: x})

        limited_by = None
        if not valid(1) or M(1) > cap:
            value = 0
        else:
            lo, hi = 1, 2
            while valid(hi) and M(hi) <= cap:
                lo, hi = hi, hi * 2
                if hi > 2**40:
                    raise SymcostError(f"the peak memory of {self.an.model} does not grow with {var}; "
                                       f"no largest {var}")
            while hi - lo > 1:  # M(lo) <= cap and valid(lo); hi is not both
                mid = (lo + hi) // 2
                if valid(mid) and M(mid) <= cap:
                    lo = mid
                else:
                    hi = mid
            value = lo
            if not valid(value + 1):
                why = check(self.full_values({**fixed, var: value + 1}))
                limited_by = f"{why}; the model allows no larger {var}"
        sol = Solution(var=var, value=value, cap=cap, memory_at=M(value) if value >= 1 else None,
                       memory_next=M(value + 1) if valid(value + 1) or value == 0 else None,
                       sizes={**dict(getattr(self.an, "pinned", {}) or {}), **fixed}, bound=None,
                       inequality=(f"peak of the step checkpointed by the {self.kind} plan at each {var} "
                                   f"<= {cap} (doubling and bisection on {var})"),
                       limited_by=limited_by)
        sol.checked = (value == 0 or sol.memory_at <= cap) and (
            limited_by is not None or sol.memory_next is None or sol.memory_next > cap)
        if value == 0:
            sol.dominant = self.dominant(**fixed, **{var: 1})
        sol.seconds = time.perf_counter() - t0
        return sol


def plan_memory(an, kind: str, sizes: Mapping[str, int], optimizer: str = "adamw",
                impl: str = "foreach", device: str = "cuda"):
    """``(memory model, sizes)`` of the step checkpointed by ``kind`` (one of :data:`KINDS`):
    the plain :class:`~symcost.passes.memory.MemoryModel` for ``none``, else a
    :class:`CheckpointedMemory` whose plan is chosen at every size it is asked.

    Raises:
        SymcostError: unknown kind, no repeated blocks, bad sizes.
    """
    from symcost.passes.memory import memory_model

    if kind not in KINDS:
        raise SymcostError(f"unknown checkpoint plan {kind!r}; accepted: {', '.join(KINDS)}")
    mm = memory_model(an, an.precision, optimizer, impl, device)
    if kind == "none":
        return mm, dict(sizes)
    if "L" not in an.symbols or an.layer_container is None:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")
    return CheckpointedMemory(an, kind, mm, optimizer, mm.impl), dict(sizes)

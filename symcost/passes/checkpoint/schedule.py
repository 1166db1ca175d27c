"""The step's peak under any checkpoint plan: the traced schedules of the plain and the
every-layer step composed block by block (:class:`StepSchedule`), the block chain the plan
search runs on (:class:`Chain`, :func:`chain`), plans by kind (:func:`make_plan`) and the
plan's predicted step (:func:`exact`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import sympy

from symcost.errors import SymcostError
from symcost.frontends.checkpointing import rng_state_bytes
from symcost.passes.checkpoint_dp import Costs
from symcost.tracing.fit import SYMS
from symcost.tracing.poly import terms_expr
from symcost.passes.checkpoint.segments import sequential_default, uniform_segments
from symcost.passes.checkpoint.costs import BlockCosts, block_costs, integer_k, law
from symcost.passes.checkpoint.plans import KINDS, Plan
from symcost.passes.checkpoint.traces import _cached, every_layer, recompute_last


_FWD = {"first": "forward, first block", "block": "forward, block", "last": "forward, last block"}
_BWD = {"first": "backward, first block", "block": "backward, block", "last": "backward, last block"}
_PRE, _END, _POST = "forward, before the blocks", "end of forward / start of backward", "backward, after the blocks"
#: a fold of three probe blocks (a data-parallel rank's step: FSDP2's first and last units differ from the
#: middle one) ends with the first block's backward and what follows in one unit (tracing/schedule.py)
_BWD_FIRST_AFTER = "backward, first block and after"


def _split_first_after(units: dict) -> dict:
    """``units`` (:func:`_unit_values`) with a fold of three probe blocks read as the others:
    its ``backward, first block and after`` unit is the first block's backward, followed by an
    empty unit after the blocks (it is run right after the first block's backward, from the same
    trace, so the composed step is the same)."""
    if _BWD_FIRST_AFTER in units:
        units = dict(units)
        units[_BWD["first"]] = units.pop(_BWD_FIRST_AFTER)
        units.setdefault(_POST, (0, None, ""))
    return units


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
    blocks = set(_BWD.values()) | {_BWD_FIRST_AFTER}
    held = {a for a, u in fP.items() if u == _END and fC.get(a) in blocks}
    x = sympy.expand(x_bytes)
    once = {a for a, u in fP.items() if u in blocks and fC.get(a) in blocks
            and sympy.expand(terms_expr(mmP.schedule.gens, evP[a].bytes, tuple(getattr(mmP.schedule, "inverses", None) or ())) - x) != 0}
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
    its forward allocated and the end of the forward frees, once per block, after the forward's last
    allocation (autocast's cache of weight casts, emptied when the forward leaves autocast; not
    FSDP2's reshard of the last block, which comes before the loss); they are left out of ``pre`` and
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
        fwd = [k for k in ids if mm.schedule.events[k].phase == "forward"] if label == _END else []
        last_alloc = max((k for k in fwd if mm.schedule.events[k].alloc == k), default=-1)
        for k in ids:
            ev = mm.schedule.events[k]
            p = int(_peval(mm._evpolys[k], vals))
            if (ev.alloc in shared or ev.alloc in once) and ev.alloc != k:
                continue  # freed where the plan frees it
            if label == _END and parts == [] and ev.phase != "forward":
                parts.append((lev, top, where))  # the forward ends here
                lev, top, where = 0, None, ""
            if label == _END and not parts and p < 0 and k > last_alloc and role_of.get(unit_of.get(ev.alloc)):
                # (after the forward's last allocation: a free before it is an ordinary event of the
                # trace the end is taken from, e.g. FSDP2's reshard of the last block after its forward)
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
        """The kind of block ``i``: ``first``, ``last`` (where the fold keeps one apart: a data-parallel
        rank's fold keeps both) or ``block``."""
        if i == self.L - 1 and _FWD["last"] in self.plain:
            return "last"
        return "first" if i == 0 and _FWD["first"] in self.plain else "block"

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


def chain(an, L: int, env: Mapping, optimizer: str = "adamw", impl: str = "foreach",
          accumulate: bool = False, sub=None) -> Chain:
    """The :class:`Chain` of ``an``'s blocks at ``L`` and sizes ``env`` (symbol -> int).

    ``x`` is the block input plus the RNG state a checkpoint stashes (:func:`rng_state_bytes`).
    ``head`` is the largest live set of the plain step that is not the optimizer step
    (``memory_model(an).peak_terms()``, docs/memory.md) less the blocks' activations: the
    model's output, the loss, its first gradients and what is saved outside the blocks. The
    step schedule needs the every-layer trace (:func:`every_layer`), or ``sub``, the step with every
    block checkpointed traced otherwise (a data-parallel rank's ``--ac full`` step: torchtitan's
    checkpoints, which stash no RNG state, so the schedule's ``rng`` is 0 then). ``accumulate``: the
    step is a gradient-accumulation micro-step (gradients live from its start).

    Raises:
        SymcostError: no repeated blocks; a schedule without a formula; bad sizes.
    """
    from symcost.passes.memory import memory_model

    bc = _cached(an, "block_costs", lambda: block_costs(an))
    env = {SYMS[str(k)] if not isinstance(k, sympy.Symbol) else k: v for k, v in env.items()}
    env[SYMS["L"]] = L
    a, x, f = bc.sequence(L, env)
    rng = rng_state_bytes() if sub is None else 0
    xo = list(x)
    x = [v + rng for v in x]  # a checkpoint keeps its input and the RNG state
    mmP = memory_model(an, an.precision, optimizer, impl)
    terms = [int(e.xreplace(env)) for e, min_L, where in mmP.peak_terms()
             if min_L <= L and not where.startswith("optimizer step")]
    head = max(0, max(terms, default=0) - sum(a))
    request = {str(k): int(v) for k, v in env.items()}
    sub = every_layer(an, request) if sub is None else sub
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
    plain = _split_first_after(_unit_values(mmP, env, accumulate, held, once))
    sched = StepSchedule(
        plain=plain, ckpt=_split_first_after(_unit_values(mmC, envC, accumulate, held, once)), L=L,
        out_bytes=xo, rng=rng, static=int(mmP.static.xreplace(env)),
        base=int(mmP.grads.xreplace(env)) if accumulate and not mmP.policy.grad_buffer else 0, opt=opt,
        opt_where=f"optimizer step ({opt_what})", shared=plain.pop("shared"), once=plain.pop("once"))
    sched.ckpt.pop("shared")
    sched.ckpt.pop("once")
    if set(sched.plain) != set(sched.ckpt):
        raise SymcostError(f"{an.model}: the plain and the checkpointed step's schedules do not fold alike")
    return Chain(a, x, f, head, bc, fr, sched)


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

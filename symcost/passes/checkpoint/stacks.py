"""Checkpoint plans of a model with several stacks of blocks (an encoder-decoder's encoder and
decoder, each folded under its own length symbol: docs/tracing.md §4, "Several stacks").

A plan says, per stack, which blocks run under their own non-reentrant checkpoint (PyTorch's
``checkpoint_wrapper`` on a subset of each stack's blocks; as ``--ac full`` wraps every block:
:func:`symcost.frontends.checkpointing.checkpoint_blocks`, ``preserve_rng_state=False``, torchtitan's
default). The step runs the encoder's forward, the decoder's forward (every decoder block reads the
encoder's output, which stays live), the decoder's backward, the encoder's backward; its peak is
the highest live set over those phases, so the stacks interact: the encoder's saved activations
are live through the whole decoder.

* :func:`stack_costs` — per stack and kind of block (``generic``, the special ``first``/``last``
  one), from the traces: ``a`` the bytes autograd saves in the block (``Analysis.saved``), ``x``
  the block's output (the next block's input, what a checkpoint keeps), ``f`` its forward model
  FLOPs and ``r`` the FLOPs its checkpoint reruns (the step with every block checkpointed, its
  hardware FLOPs less the plain step's, by block; PyTorch's early stop included).
* :func:`stack_law` — Chen et al.'s √L law per stack in the stack's own length symbol X:
  M(k) = (X/k)·x + k·a, k* = √(X·x/a).
* :class:`StackSchedule` — the step's peak under any plan: the storage schedules of the plain
  step and of the step with every block checkpointed (``--ac full``), both folded per stack into
  the same units (``tracing/stacks.py`` ``stack_units``), composed pass by pass: a checkpointed
  block's passes (forward, and the backward with its recomputation) come from the checkpointed
  trace, a plain block's from the plain one, a unit between the blocks from the trace of the
  block run just before it.
* :func:`analyse_stacks` — the plan (least peak, least recompute under a cap, or a named kind) and
  its predictions for ``symcost checkpoint``.

The search: within a stack the blocks are alike but for at most its two end blocks, and of alike
blocks the earliest ones are checkpointed (a plain block before a checkpointed one holds its
activations through that block's recomputation; swapped, it does not: Chen et al. 2016's
observation for uniform chains, docs/checkpoint.md), so a stack's plans are: the first n of its
generic blocks checkpointed, each special end block in or out. The search runs every combination
over the stacks (Π (n_X + 1)·2^special plans, each composed exactly); tests check it against every
subset of blocks at small depths.
"""
from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS

_LABEL = re.compile(r"^(forward|backward), (.+): (first block|block|last block)$")
_ROLE = {"first block": "first", "block": "generic", "last block": "last"}
PLANS = ("optimal", "none", "every-layer")


# --------------------------------------------------------------------------------------------
# per-block costs and the law, per stack
# --------------------------------------------------------------------------------------------


def _role_of(module: str, c: str, sym: str) -> str | None:
    """``generic``, ``first``, ``last`` of a folded module path in stack ``c``, else None."""
    pre = f"{c}." if c else ""
    if not (module == c or module.startswith(pre)):
        return None
    key = module[len(pre):].split(".", 1)[0]
    if key == "{i}":
        return "generic"
    if key == "0":
        return "first"
    if key == "{" + f"{sym}-1" + "}":
        return "last"
    return None


def stack_costs(an, ck=None) -> dict[str, dict[str, dict[str, sympy.Expr]]]:
    """``{container: {role: {"a", "x", "f", "r", "n"}}}`` per stack of ``an`` (``an.stacks``) and
    kind of block (``generic``; ``first``/``last`` where that end block stands apart): ``a`` the
    bytes saved for backward inside one block (``Analysis.saved``, saved_tensors_hooks' count),
    ``x`` the bytes of the block's output (its last forward op's first output: the next block's
    input, which a checkpoint keeps), ``f`` its forward model FLOPs (FlopCounterMode's
    convention), ``r`` the FLOPs a checkpoint of it reruns (``ck``'s hardware FLOPs of the block
    less ``an``'s: the step with every block checkpointed; None without ``ck``), ``n`` the
    repeat of that kind (sympy, in the stack's symbol). Per block: totals divided by the repeat.

    Raises:
        SymcostError: ``an`` has no several stacks.
    """
    from symcost.graph import rules

    stacks = dict(getattr(an, "stacks", None) or {})
    if not stacks:
        raise SymcostError(f"{an.model} has no several stacks of blocks")

    def groups(a):
        out: dict = {}
        for op in a.ops:
            for c, sym in stacks.items():
                role = _role_of(op.module, c, sym)
                if role is None:
                    continue
                g = out.setdefault((c, role), {"f": 0, "hw": 0, "last": None, "rep": op.repeat, "ops": 0})
                g["hw"] += sympy.sympify(op.repeat) * op.cost.flops_hw
                if op.phase == "forward":
                    g["f"] += op.cost.flops
                    g["ops"] += 1
                    if op.out_shapes:
                        g["last"] = op
                break
        return out

    gP = groups(an)
    gC = groups(ck) if ck is not None else {}
    saved: dict = {}
    for module, nb, _dtype, rep in an.saved:
        for c, sym in stacks.items():
            role = _role_of(module, c, sym)
            if role is not None:
                saved[(c, role)] = saved.get((c, role), 0) + nb
                break
    out: dict = {}
    for (c, role), g in gP.items():
        rep = sympy.sympify(g["rep"])
        last = g["last"]
        x = rules.nbytes(last.out_shapes[0], last.out_dtypes[0]) if last is not None else sympy.Integer(0)
        r = None
        if (c, role) in gC:
            r = sympy.cancel((gC[(c, role)]["hw"] - g["hw"]) / rep)
        out.setdefault(c, {})[role] = {"a": sympy.expand(saved.get((c, role), 0)), "x": sympy.expand(x),
                                       "f": sympy.expand(g["f"]), "r": None if r is None else sympy.expand(r),
                                       "n": rep, "ops": g["ops"]}
    return out


def stack_law(costs: Mapping[str, dict], sym: str) -> dict[str, sympy.Expr]:
    """Chen et al. 2016's law (Sec. 4.1) for one stack of X blocks (X = ``sym``) from its generic
    block's ``a``, ``x`` (bytes) and ``f`` (FLOPs): M(k) = (X/k)·x + k·a, k* = √(X·x/a) (sympy
    solves dM/dk = 0), X/k* segments, M(k*) = 2·√(X·a·x), recompute X·f. Sympy expressions."""
    X, k = SYMS[sym], sympy.Symbol("k", positive=True)
    g = costs["generic"]
    a, x, f = g["a"], g["x"], g["f"]
    M = X / k * x + k * a
    ks = [s for s in sympy.solve(sympy.diff(M, k), k) if s.is_positive is not False]
    k_star = sympy.simplify(ks[0]) if ks else sympy.Integer(1)
    return {"a": a, "x": x, "f": f, "memory": M, "k_star": k_star, "segments_star": sympy.simplify(X / k_star),
            "memory_star": sympy.simplify(M.subs(k, k_star)), "recompute": sympy.expand(X * f)}


# --------------------------------------------------------------------------------------------
# the step's peak under a plan
# --------------------------------------------------------------------------------------------


def _pass_kind(j: int, n: int) -> str:
    return "single" if n == 1 else "first" if j == 0 else "last" if j == n - 1 else "mid"


def _free_events(mm) -> dict[int, int]:
    """Allocation event -> its free event in ``mm``'s schedule (a storage freed in the step)."""
    ev = mm.schedule.events
    return {ev[k].alloc: k for k in range(len(ev)) if ev[k].alloc != k}


def _unit_index(mm) -> list[int]:
    out = [0] * len(mm.schedule.events)
    for ui, (ids, _r, _m, _l) in enumerate(mm.units):
        for k in ids:
            out[k] = ui
    return out


@dataclass(frozen=True)
class _Held:
    """A storage whose free moves with the plan: made once (outside a stack's blocks, by one of
    its end blocks, or the stack's output), then taken by the stack's blocks from ``ckpt_block``
    on as a checkpoint's input (each checkpoint keeps its inputs until its backward) and, in the
    plain step, saved by the blocks from ``plain_block`` on (None: by no block, the plain step
    frees it elsewhere, outside the blocks or in the forward after its last use: a decoder's
    causal mask, T5's position bias, in bf16-mixed the encoder's output, of which the plain
    decoder blocks save only casts). It is freed after the backward of
    the stack's earliest block that holds it (a stack's backward runs its blocks last to first);
    with none, where the plain step frees it. ``kP``/``kC``: its free event in the
    plain/checkpointed schedule, ``exactP``/``exactC`` whether that event falls in that block's
    pass alone there (else it is left out and the bytes freed after the pass); ``nbytes``: its
    size at the schedule's sizes."""

    stack: str
    ckpt_block: int
    plain_block: int | None
    kP: int
    kC: int
    nbytes: int
    exactP: bool = True
    exactC: bool = True

    def freed_after(self, chosen: set[int], n: int) -> int | None:
        """The block whose backward frees it under a plan (``chosen``: the stack's checkpointed
        blocks of ``n``), or None (no block holds it)."""
        cand = [b for b in chosen if b >= self.ckpt_block]
        if self.plain_block is not None:
            cand += [b for b in range(self.plain_block, n) if b not in chosen][:1]
        return min(cand) if cand else None


def _block_of(mm, uo: list[int], k: int, lengths: Mapping[str, int],
              roles: Mapping[str, set]) -> tuple[str, str, int, bool] | None:
    """``(direction, container, block, exact)`` of the pass of free event ``k`` of a storage made
    once, in ``mm``'s folded schedule, or None (outside the blocks; or a storage of each pass: made
    in the same stack's repeated units). ``exact``: the event falls in that pass alone (its unit
    runs once, or it carries ``ScheduleEvent.once``); an event of a repeated unit without it is
    the probe block's, the unit's first block forward (tracing/stacks.py ``stack_units``), and
    the schedule repeats it each pass. ``uo``: each event's unit (:func:`_unit_index`)."""
    label = mm.units[uo[k]][3]
    m = _LABEL.match(label)
    if m is None or m.group(2) not in lengths:
        return None
    direction, c, role = m.group(1), m.group(2), _ROLE[m.group(3)]
    n = lengths[c]
    if role != "generic":
        return direction, c, 0 if role == "first" else n - 1, True
    lo = 1 if "first" in roles.get(c, ()) else 0
    hi = n - 1 if "last" in roles.get(c, ()) else n
    once = mm.schedule.events[k].once
    if hi - lo == 1:
        return direction, c, lo, True
    if not once:
        made = _LABEL.match(mm.units[uo[mm.schedule.events[k].alloc]][3])
        if made is not None and made.group(2) == c and made.group(3) == "block":
            return None  # each pass's own storage
        return direction, c, lo, False
    # the unit's passes run lo..hi-1 forward, hi-1..lo backward
    early = once == "first"
    return direction, c, (lo if early else hi - 1) if direction == "forward" else (hi - 1 if early else lo), True


def _held(mmP, mmC, lengths: Mapping[str, int], roles: Mapping[str, set], env) -> list[_Held]:
    """The storages whose free moves with checkpointing (:class:`_Held`): freed once in each step,
    matched by the unit, op, module and size of their allocation (where one storage of each step
    has them), the checkpointed step freeing them in the backward of a stack's block and the
    plain one elsewhere (outside the blocks, in the forward of a later block of that stack, or
    in the backward of another block of that stack)."""
    from symcost.passes.memory.live import _peval

    uP, uC = _unit_index(mmP), _unit_index(mmC)
    evP, evC = mmP.schedule.events, mmC.schedule.events

    def frees(mm, ev, uo):
        """sig -> [(free event, its block or None outside the blocks)], frees of each pass's own
        storages left out"""
        out: dict = {}
        for k in range(len(ev)):
            a = ev[k].alloc
            if a == k:
                continue
            at = _block_of(mm, uo, k, lengths, roles)
            if at is None and _LABEL.match(mm.units[uo[k]][3]) is not None:
                continue
            sig = (uo[a], ev[a].op, ev[a].module, tuple(map(tuple, ev[a].bytes)), ev[a].once)
            out.setdefault(sig, []).append((k, at))
        return out

    fP, fC = frees(mmP, evP, uP), frees(mmC, evC, uC)
    vals = mmP._values(env)
    out = []
    for sig, ks in fP.items():
        kc = fC.get(sig, [])
        if len(ks) != 1 or len(kc) != 1:
            continue
        (kp, before), (kc, where) = ks[0], kc[0]
        if (uP[kp], evP[kp].once) == (uC[kc], evC[kc].once):
            continue  # freed alike
        if where is None or where[0] != "backward":
            continue
        c = where[1]
        if before is None:
            plain_block, exactP = None, True
        elif before[0] == "backward" and before[1] == c:
            plain_block, exactP = before[2], before[3]
        elif before[0] == "forward" and before[1] == c and before[2] >= where[2] and before[3]:
            plain_block, exactP = None, True  # freed after its last use (BART's causal mask): no plain block saves it
        else:
            continue
        out.append(_Held(c, where[2], plain_block, kp, kc, -int(_peval(mmP._evpolys[kp], vals)), exactP, where[3]))
    return out


def _end_unit(mm) -> int | None:
    """The unit outside the blocks where the forward ends (its events change from the forward
    phase to the backward), or None."""
    ev = mm.schedule.events
    for ui, (ids, _r, _m, label) in enumerate(mm.units):
        if _LABEL.match(label) or not len(ids):
            continue
        phases = [ev[k].phase == "forward" for k in ids]
        if phases[0] and not all(phases):
            return ui
    return None


def _passes(mm, env, skip: set[int], accumulate: bool = False, ordinary: frozenset = frozenset()) -> list[dict]:
    """Per unit of ``mm``'s folded schedule at ``env``: ``{kind: (delta, peak, where)}`` for each
    kind of pass (``first``, ``mid``, ``last``, ``single`` where the unit has one-pass events,
    ``MemorySchedule.events``' ``once``; else one kind for all), the bytes a pass leaves allocated,
    its highest live set at an allocation relative to its start (None without one) and the op
    there. Events in ``skip`` are left out (frees the composition does itself).

    The unit where the forward ends (:func:`_end_unit`) is split there: ``{"pre": (...), "post":
    (...), "free": {unit: bytes per pass}}``; ``free`` is what each block's forward held only
    until the forward ends (autocast's cache of weight casts, emptied when the forward leaves
    autocast, after the forward's last allocation: a free before it, the loss not computed yet, is
    an ordinary event; a checkpointed block holds its casts, a plain one saves them), by the forward unit
    of the block, per pass; the composition frees each block's own between ``pre`` and ``post``.
    Events in ``ordinary`` stay ordinary events there (the plain step's frees of held storages,
    :class:`_Held`: the composition keeps them or moves them per storage, not per block)."""
    from symcost.passes.memory.live import _peval
    from symcost.passes.memory.model import _in_pass

    vals = mm._values(env)
    end = _end_unit(mm)
    unit_of = _unit_index(mm)
    fwd_units = {ui: u for ui, u in enumerate(mm.units) if (m := _LABEL.match(u[3])) and m.group(1) == "forward"}
    out = []
    for ui, (ids, rep, _min_L, label) in enumerate(mm.units):
        once = mm._once(ids, rep)
        kinds = ("first", "mid", "last", "single") if once else ("first",)
        per = {}
        for kind in kinds:
            lev, top, where = 0, None, ""
            parts, free = [], {}
            # (a free before the forward's last allocation is an ordinary event, not a holding the
            # forward's end frees: passes/checkpoint/schedule.py _unit_values)
            last_alloc = max((k for k in ids if mm.schedule.events[k].alloc == k
                              and mm.schedule.events[k].phase == "forward"), default=-1) if ui == end else -1
            for k in ids:
                if k in skip or not _in_pass(once.get(k, ""), kind):
                    continue
                ev = mm.schedule.events[k]
                p = int(_peval(mm._evpolys[k], vals))
                if ui == end and not parts and ev.phase != "forward":
                    parts.append((lev, top, where))  # the forward ends here
                    lev, top, where = 0, None, ""
                if (ui == end and not parts and p < 0 and k > last_alloc and unit_of[ev.alloc] in fwd_units
                        and k not in ordinary):
                    au = unit_of[ev.alloc]
                    arep = mm.units[au][1]
                    n = int(_peval(arep, vals))
                    one = p
                    if n > 1:  # one event for the unit's passes: per pass, the growth with one pass more
                        sym = mm.unit_syms[au]
                        vals1 = mm._values({**env, SYMS[sym]: int(env[SYMS[sym]]) + 1})
                        one = int(_peval(mm._evpolys[k], vals1)) - p
                    if one != 0:  # (0: the last pass's storage only, e.g. the stack's output: an ordinary event)
                        free[au] = free.get(au, 0) - one
                        p -= n * one if n > 1 else one
                        if p == 0:
                            continue
                if mm.grad_transient(accumulate) and k in mm.grad_events:
                    if top is None or lev + p > top:
                        top, where = lev + p, mm._label(k, label)
                    continue
                lev += p
                if ev.alloc == k and (top is None or lev > top):
                    top, where = lev, mm._label(k, label)
            if ui == end:
                parts.append((lev, top, where))
                per[kind] = {"pre": parts[0], "post": parts[1] if len(parts) > 1 else (0, None, ""), "free": free}
            else:
                per[kind] = (lev, top, where)
        if not once:
            per = {k: per["first"] for k in ("first", "mid", "last", "single")}
        out.append(per)
    return out


@dataclass
class StackSchedule:
    """The steady-state step at concrete sizes under any per-stack plan (bytes).

    ``units``: per unit of the folded schedule, ``(container or None, direction, blocks)`` with
    ``blocks`` the block index of each pass, in the order the passes run (a stack's backward runs
    its blocks last to first). ``held``: the storages whose free moves with the plan
    (:class:`_Held`); ``passes(trace, skip)``: :func:`_passes` of the plain (``"plain"``) or
    checkpointed (``"ckpt"``) trace without the free events ``skip`` (memoized). ``static`` is live
    all step; ``opt`` the optimizer step's largest temporary."""

    units: list[tuple]
    passes: object  # (trace, frozenset of skipped events) -> list[dict]
    lengths: dict[str, int]
    static: int
    opt: int
    opt_where: str
    held: list = field(default_factory=list)
    end_level: int | None = None  # what every plan's step leaves allocated (checked: a plan does not change it)

    def simulate(self, plan: Mapping[str, Sequence[int]]) -> tuple[int, str]:
        """``(peak, where)``: the step's peak in bytes (static included) with the blocks of
        ``plan`` (container -> checkpointed block indices) checkpointed, and where it is
        reached (unit and op).

        Raises:
            SymcostError: the composed step leaves other bytes than another plan's (the two
                traced schedules do not compose on this model)."""
        chosen = {c: set(v) for c, v in plan.items()}
        lev, top, where = 0, None, ""
        skipP, skipC, after = set(), set(), {}
        for h in self.held:  # each held storage: its trace's own free event where it falls there, else after a pass
            b = h.freed_after(chosen.get(h.stack, set()), self.lengths[h.stack])
            if b is None:  # no block holds it: the plain step's free
                skipC.add(h.kC)
                continue
            skipP.add(h.kP)
            skipC.add(h.kC)
            if b == h.plain_block and h.exactP and b not in chosen.get(h.stack, ()):
                skipP.discard(h.kP)
            elif b == h.ckpt_block and h.exactC and b in chosen.get(h.stack, ()):
                skipC.discard(h.kC)
            else:
                after[(h.stack, b)] = after.get((h.stack, b), 0) + h.nbytes
        plain, ckpt = self.passes("plain", frozenset(skipP)), self.passes("ckpt", frozenset(skipC))
        prev = plain
        for ui, (c, direction, blocks) in enumerate(self.units):
            if c is None and isinstance(prev[ui]["first"], dict):  # the forward ends in this unit
                end = prev[ui]["first"]
                runs = [(end["pre"], None)]
                freed = 0
                for fu, (fc, _d, fblocks) in enumerate(self.units):
                    if fc is not None and _d == "forward":
                        for b in fblocks:
                            src = ckpt if b in chosen.get(fc, ()) else plain
                            freed += src[ui]["first"]["free"].get(fu, 0)
                runs.append(((-freed, None, ""), None))
                runs.append((end["post"], None))
            elif c is None:
                runs = [(prev[ui]["first"], None)]
            else:
                runs = []
                for j, b in enumerate(blocks):
                    src = ckpt if b in chosen.get(c, ()) else plain
                    runs.append((src[ui][_pass_kind(j, len(blocks))], b))
                    prev = src
            for (d, p, w), b in runs:
                if p is not None and (top is None or lev + p > top):
                    top, where = lev + p, w
                lev += d
                if c is not None and direction == "backward":
                    lev -= after.get((c, b), 0)  # the last block that kept a held storage is done
        if self.end_level is None:
            self.end_level = lev
        elif lev != self.end_level:  # what the step leaves (its gradients) does not depend on the plan
            raise SymcostError(f"the composed step of the plan {dict(plan)} leaves {lev} bytes, another plan "
                               f"{self.end_level}: the two traced schedules do not compose on this model")
        if top is None or lev + self.opt > top:
            top, where = lev + self.opt, self.opt_where
        return self.static + top, where


def stack_schedule(an, ck, env: Mapping, optimizer: str = "adamw", impl: str = "foreach",
                   accumulate: bool = False) -> StackSchedule:
    """The :class:`StackSchedule` of ``an`` (the plain step) and ``ck`` (the step with every block
    of every stack checkpointed, ``--ac full``) at ``env`` (symbol -> int, every stack's length).
    ``accumulate``: a gradient-accumulation micro-step (the gradients live from the start, each
    new one a transient added in place, as :func:`symcost.passes.checkpoint.schedule.chain`).

    Raises:
        SymcostError: the two schedules do not fold into the same units; a size missing.
    """
    from symcost.passes.memory import memory_model
    from symcost.passes.memory.live import _peval

    if dict(getattr(ck, "stacks", None) or {}) != dict(an.stacks):
        why = "; ".join(f"{k}: {v}" for k, v in (getattr(ck, "pin_reasons", None) or {}).items())
        raise SymcostError(f"{an.model}: the step with every block checkpointed (--ac full) does not fold its stacks "
                           f"{', '.join(an.stacks)} ({why or 'traced unfolded'}), so the plan per stack, composed "
                           "from the two folded steps, cannot be made; report MODEL --ac full gives that step")
    mmP = memory_model(an, an.precision, optimizer, impl)
    mmC = memory_model(ck, an.precision, optimizer, impl)
    if [u[3] for u in mmP.units] != [u[3] for u in mmC.units]:
        raise SymcostError(f"{an.model}: the plain and the checkpointed step's schedules do not fold alike "
                           f"({[u[3] for u in mmP.units]} vs {[u[3] for u in mmC.units]})")
    stacks = dict(an.stacks)
    try:
        lengths = {c: int(env[SYMS[s]]) for c, s in stacks.items()}
    except KeyError as e:
        raise SymcostError(f"{an.model}: size {e} missing for the checkpoint plan") from None
    vals = mmP._values(env)
    roles: dict = {}
    for _ids, _r, _m, label in mmP.units:
        m = _LABEL.match(label)
        if m:
            roles.setdefault(m.group(2), set()).add(_ROLE[m.group(3)])
    held = _held(mmP, mmC, lengths, roles, env)
    memo: dict = {}

    def passes(trace: str, skip: frozenset) -> list[dict]:
        if (trace, skip) not in memo:
            plain = trace == "plain"
            memo[(trace, skip)] = _passes(mmP if plain else mmC, env, set(skip), accumulate,
                                          ordinary=frozenset(h.kP if plain else h.kC for h in held))
        return memo[(trace, skip)]

    units = []
    for _ids, rep, _m, label in mmP.units:
        m = _LABEL.match(label)
        if not m:
            units.append((None, None, ()))
            continue
        direction, c, role = m.group(1), m.group(2), _ROLE[m.group(3)]
        n = lengths[c]
        if role == "first":
            blocks = [0]
        elif role == "last":
            blocks = [n - 1]
        else:
            lo = 1 if "first" in roles[c] else 0
            hi = n - 1 if "last" in roles[c] else n
            blocks = list(range(lo, hi))
            if direction == "backward":
                blocks.reverse()
        if len(blocks) != int(_peval(rep, vals)):
            raise SymcostError(f"{an.model}: unit {label!r} runs {int(_peval(rep, vals))} passes for "
                               f"{len(blocks)} blocks of {c}")
        units.append((c, direction, blocks))
    tr = [(int(_peval(p, vals)), what) for p, what in mmP._optimizer_transients()] or [(0, "")]
    opt, opt_what = max(tr)
    base = int(sympy.sympify(mmP.grads).xreplace(env)) if accumulate and not mmP.policy.grad_buffer else 0
    return StackSchedule(units, passes, lengths, int(sympy.sympify(mmP.static).xreplace(env)) + base, opt,
                         f"optimizer step ({opt_what})", held)


# --------------------------------------------------------------------------------------------
# plans, the search, the pass
# --------------------------------------------------------------------------------------------


@dataclass
class StackPlan:
    """Which blocks of each stack run under their own checkpoint: ``blocks`` container -> sorted
    block indices; ``lengths`` container -> blocks in the stack."""

    blocks: dict[str, list[int]]
    lengths: dict[str, int]
    kind: str = "optimal"

    def modules(self) -> list[str]:
        """The checkpointed blocks' module paths (``encoder.0``, ...)."""
        return [f"{c}.{i}" if c else str(i) for c in self.lengths for i in self.blocks.get(c, [])]

    def apply(self, model) -> None:
        """Checkpoint the plan's blocks of ``model`` in place, each under its own non-reentrant
        ``torch.utils.checkpoint`` (``preserve_rng_state=False``), as ``--ac full`` does for every
        block (:func:`symcost.frontends.checkpointing.checkpoint_modules`; module names unchanged)."""
        from symcost.frontends.checkpointing import checkpoint_modules

        for c, idx in self.blocks.items():
            kids = list(model.get_submodule(c).children())
            checkpoint_modules([kids[i] for i in idx], "full")


def _family(c: str, n: int, roles: set[str]) -> list[tuple[int, ...]]:
    """A stack's candidate plans: each special end block in or out, the first k generic blocks."""
    lo = 1 if "first" in roles else 0
    hi = n - 1 if "last" in roles else n
    specials = ([0] if lo else []) + ([n - 1] if hi < n else [])
    out = []
    for pick in itertools.product((False, True), repeat=len(specials)):
        sp = [b for b, on in zip(specials, pick) if on]
        for k in range(hi - lo + 1):
            out.append(tuple(sorted(sp + list(range(lo, lo + k)))))
    return out


def _recompute(costs, plan: Mapping[str, Sequence[int]], lengths, env) -> int:
    total = 0
    for c, idx in plan.items():
        n = lengths[c]
        for b in idx:
            role = "first" if b == 0 and "first" in costs[c] else "last" if b == n - 1 and "last" in costs[c] else "generic"
            total += int(sympy.sympify(costs[c][role]["r"]).xreplace(env))
    return total


def search(sched: StackSchedule, costs, env, roles, cap: int | None = None) -> tuple[dict, int, int]:
    """The least peak (ties: least recompute), or with ``cap`` (bytes) the least recompute whose
    peak fits (ties: least peak), over every combination of the stacks' candidate plans
    (:func:`_family`). Returns ``(plan, peak, recompute)``.

    Raises:
        SymcostError: no plan fits ``cap`` (the message gives the least peak)."""
    cs = list(sched.lengths)
    fams = [_family(c, sched.lengths[c], roles[c]) for c in cs]
    best = None
    least = None
    for combo in itertools.product(*fams):
        plan = dict(zip(cs, combo))
        pk = sched.simulate(plan)[0]
        rec = _recompute(costs, plan, sched.lengths, env)
        if least is None or (pk, rec) < least[:2]:
            least = (pk, rec, plan)
        if cap is not None and pk > cap:
            continue
        key = (rec, pk) if cap is not None else (pk, rec)
        if best is None or key < best[0]:
            best = (key, plan)
    if best is None:
        raise SymcostError(f"no checkpoint plan fits under {cap} bytes: the least peak of a step is {least[0]} "
                           f"bytes ({least[0] / 2**30:.3f} GiB)")
    plan = best[1]
    return plan, sched.simulate(plan)[0], _recompute(costs, plan, sched.lengths, env)


def analyse_stacks(an, ck, sizes: Mapping[str, int] | None = None, memory: int | None = None,
                   kind: str = "optimal", optimizer: str = "adamw", impl: str = "foreach") -> dict:
    """The checkpoint plan of a model with several stacks at ``sizes`` (plain data; the JSON keys
    of ``symcost checkpoint`` on such a model, docs/checkpoint.md "Several stacks").

    ``an``: the plain step; ``ck``: the step with every block of every stack checkpointed
    (``Layout(ac="full")``). ``memory`` (bytes): the least recompute whose step peak fits;
    otherwise ``kind``: ``optimal`` (the least peak, ties the least recompute), ``none``,
    ``every-layer`` (every block of every stack). (The law's uniform plans, segments of k
    blocks, are not planned here: each checkpoint holds one block.)

    Returns ``{"stacks": {container: {"symbol", "L", "blocks", "n_checkpointed", "block", "law",
    "k_star"}}, "plan", "peak", "peak_where", "peak_none", "peak_every_layer", "recompute_flops",
    "train_flops", "train_flops_none", "tradeoff", ...}`` (bytes, FLOPs; law formulas as strings).

    Raises:
        SymcostError: ``--budget`` is not planned here; an unknown kind; a cap no plan meets.
    """
    if kind not in PLANS:
        raise SymcostError(f"--plan {kind} is not planned on a model of several stacks (each checkpoint holds one "
                           f"block there); accepted: {', '.join(PLANS)}, or --memory CAP")
    t0 = time.perf_counter()
    sizes = dict(sizes or {})
    env = an.bind(**sizes)
    costs = stack_costs(an, ck)
    sched = stack_schedule(an, ck, env, optimizer, impl)
    roles = {c: set(v) - {"generic"} for c, v in costs.items()}
    lengths = sched.lengths
    laws = {c: stack_law(costs[c], an.stacks[c]) for c in lengths}
    if memory is not None:
        plan, _, _ = search(sched, costs, env, roles, memory)
        kind = "memory"
    elif kind == "optimal":
        plan, _, _ = search(sched, costs, env, roles)
    elif kind == "none":
        plan = {c: () for c in lengths}
    else:
        plan = {c: tuple(range(n)) for c, n in lengths.items()}
    t_solve = time.perf_counter() - t0
    peak, where = sched.simulate(plan)
    rec = _recompute(costs, plan, lengths, env)
    from symcost.passes.memory import memory_model

    # the composition against each trace's own step: checkpointing no block (the plain step) and
    # every block (the checkpointed one); 0 where they agree (fp32 on the tests' models)
    gap = max(abs(sched.simulate({c: () for c in lengths})[0] - memory_model(an, an.precision, optimizer, impl).peak(**sizes)),
              abs(sched.simulate({c: tuple(range(n)) for c, n in lengths.items()})[0]
                  - memory_model(ck, an.precision, optimizer, impl).peak(**sizes)))
    base = int(an.flops("train").xreplace(env))

    def row(p, **key):
        return {**key, "checkpointed": {c: len(v) for c, v in p.items()}, "peak": sched.simulate(p)[0],
                "recompute_flops": _recompute(costs, p, lengths, env)}

    trade = [row({c: () for c in lengths}, what="none")]
    for c in lengths:  # one stack at a time, its first n blocks
        for n in range(1, lengths[c] + 1):
            trade.append(row({**{d: () for d in lengths}, c: tuple(range(n))}, what=c))
    trade.append(row({c: tuple(range(n)) for c, n in lengths.items()}, what="every-layer"))
    out = {
        "model": an.model, "kind": kind, "several_stacks": True,
        "plan": StackPlan({c: sorted(v) for c, v in plan.items()}, lengths, kind).modules(),
        "blocks": {c: sorted(v) for c, v in plan.items()},
        "peak": peak, "peak_where": where, "peak_source": "schedule",
        "peak_none": sched.simulate({c: () for c in lengths})[0],
        "peak_every_layer": sched.simulate({c: tuple(range(n)) for c, n in lengths.items()})[0],
        "recompute_flops": rec, "train_flops": base + rec, "train_flops_none": base,
        "solve_seconds": time.perf_counter() - t0 if memory is None and kind == "optimal" else t_solve,
        "tradeoff": trade, "optimality_gap": 0, "composition_gap": gap,
        "stacks": {},
    }
    for c, n in lengths.items():
        sym = an.stacks[c]
        g = costs[c]["generic"]
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        lw = laws[c]
        out["stacks"][c] = {
            "symbol": sym, "L": n, "blocks": sorted(plan[c]), "n_checkpointed": len(plan[c]),
            "block": {"a": ev(g["a"]), "x": ev(g["x"]), "f": ev(g["f"]), "r": ev(g["r"]) if g["r"] is not None else None,
                      "ops": g["ops"]},
            "special": {r: {k: ev(v) for k, v in costs[c][r].items() if k in ("a", "x", "f", "r") and v is not None}
                        for r in costs[c] if r != "generic"},
            "law": {k: str(v) for k, v in lw.items()},
            "k_star": float(lw["k_star"].xreplace(env)),
        }
    out["plan_object"] = StackPlan({c: sorted(v) for c, v in plan.items()}, lengths, kind)
    return out

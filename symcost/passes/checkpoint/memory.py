"""``max-batch`` with checkpointing: the memory of a step checkpointed by a plan kind chosen at
every size, with the MemoryModel interface."""

from __future__ import annotations

import time
from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS
from symcost.passes.checkpoint.plans import KINDS, Plan
from symcost.passes.checkpoint.schedule import Chain, chain, make_plan


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

    def _simulate(self, accumulate: bool = False, **sizes: int) -> tuple[int, str]:
        """``(peak, where)`` of the step checkpointed by the plan at ``sizes`` (bytes)."""
        plan, ch = self.at(accumulate, **sizes)
        return ch.schedule.simulate(plan.segments)

    def peak(self, accumulate: bool = False, **sizes: int) -> int:
        plan, ch = self.at(accumulate, **sizes)
        return ch.peak(plan.segments)

    def peak_where(self, **sizes: int) -> str:
        return self._simulate(**sizes)[1]

    def peak_parts(self, accumulate: bool = False, **sizes: int) -> dict[str, Any]:
        """What the checkpointed step's peak at ``sizes`` is made of, in bytes, adding up to
        :meth:`peak`: the static parts of :meth:`MemoryModel.peak_parts` (``params``,
        ``optimizer``, ``master_weights``, ``buffers``, ``inputs``), and the live set where the
        peak is reached as one part, ``checkpointed`` (gradients so far, kept block inputs and
        RNG states, a segment's recomputed activations, temporaries: the composed schedule,
        :class:`StepSchedule`, does not split it further); the plain step's live parts are 0.
        Also ``peak`` and ``where``."""
        peak, where = self._simulate(accumulate, **sizes)
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
        out["activations"] = self._activations(out["activations"], **sizes)
        out["peak"] = self.peak(**sizes)
        out.pop("activations_per_layer", None)
        return out

    def _activations(self, plain: int, **sizes: int) -> int:
        """The plan's activation peak in the segment model (:func:`plan_cost`; ``plain``: the
        plain step's saved bytes, unused here)."""
        plan, ch = self.at(**sizes)
        return ch.cost(plan.segments)[0]

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
                       limited_by=limited_by, next_value=value + 1)
        sol.checked = (value == 0 or sol.memory_at <= cap) and (
            limited_by is not None or sol.memory_next is None or sol.memory_next > cap)
        if value == 0:
            sol.dominant = self.dominant(**fixed, **{var: 1})
        sol.seconds = time.perf_counter() - t0
        return sol


class StackCheckpointedMemory(CheckpointedMemory):
    """:class:`CheckpointedMemory` of a model with several stacks of blocks (``an.stacks``: an
    encoder-decoder's encoder and decoder, each under its own length symbol): at each size the
    plan per stack (:class:`~symcost.passes.checkpoint.stacks.StackPlan`, which blocks of each
    stack run under their own checkpoint) of ``kind`` — ``optimal``: the least step peak there
    (ties: the least recompute) over every combination of the stacks' candidate plans
    (:func:`~symcost.passes.checkpoint.stacks.search`), ``none``, ``every-layer`` (every block of
    every stack) — and its peak, the per-stack composition of the plain step ``an`` and the step
    ``ck`` with every block checkpointed (``--ac full``;
    :class:`~symcost.passes.checkpoint.stacks.StackSchedule`, docs/checkpoint.md "Several
    stacks"). ``solve`` is :meth:`CheckpointedMemory.solve` (the least peak over plans grows with
    B and S, as each plan's does).

    Raises:
        SymcostError: a kind planned over one chain only (``sqrt``: segments of several blocks);
            the two steps do not fold their stacks alike (:func:`stack_schedule`).
    """

    def __init__(self, an, ck, kind: str, mm, optimizer: str = "adamw", impl: str = "foreach"):
        from symcost.passes.checkpoint.stacks import PLANS, stack_costs

        if kind not in PLANS:
            raise SymcostError(f"--checkpoint {kind} is not planned on a model of several stacks ({an.model}: "
                               f"{', '.join(an.stacks)}; each checkpoint holds one block there); accepted: "
                               f"{', '.join(p for p in PLANS if p != 'none')}")
        super().__init__(an, kind, mm, optimizer, impl)
        self.ck = ck
        self.costs = stack_costs(an, ck)
        self.roles = {c: set(v) - {"generic"} for c, v in self.costs.items()}

    def at(self, accumulate: bool = False, **sizes: int):
        """``(StackPlan, StackSchedule, env)`` of ``kind`` at ``sizes``."""
        from symcost.passes.checkpoint.stacks import StackPlan, search, stack_schedule

        key = (accumulate, tuple(sorted(sizes.items())))
        hit = self._memo.get(key)
        if hit is None:
            env = self.an.bind(**sizes)
            sched = stack_schedule(self.an, self.ck, env, self._optimizer, self.impl, accumulate)
            lengths = sched.lengths
            if self.kind == "optimal":
                blocks = search(sched, self.costs, env, self.roles)[0]
            elif self.kind == "none":
                blocks = {c: () for c in lengths}
            else:
                blocks = {c: tuple(range(n)) for c, n in lengths.items()}
            plan = StackPlan({c: sorted(v) for c, v in blocks.items()}, dict(lengths), self.kind)
            hit = self._memo[key] = (plan, sched, env)
        return hit

    def _simulate(self, accumulate: bool = False, **sizes: int) -> tuple[int, str]:
        plan, sched, _ = self.at(accumulate, **sizes)
        return sched.simulate(plan.blocks)

    def peak(self, accumulate: bool = False, **sizes: int) -> int:
        return self._simulate(accumulate, **sizes)[0]

    def recompute(self, **sizes: int) -> int:
        """FLOPs the plan at ``sizes`` reruns (each checkpointed block's ``r``, :func:`stack_costs`)."""
        from symcost.passes.checkpoint.stacks import _recompute

        plan, sched, env = self.at(**sizes)
        return _recompute(self.costs, plan.blocks, sched.lengths, env)

    def _activations(self, plain: int, **sizes: int) -> int:
        """Saved for backward at the end of the forward under the plan: the plain step's saved
        bytes ``plain`` less, per checkpointed block, what it saves (``a``) plus what its
        checkpoint keeps (``x``, the block's input: the previous block's output), by kind of block
        (:func:`stack_costs`)."""
        plan, sched, env = self.at(**sizes)
        out = plain
        for c, idx in plan.blocks.items():
            n, cc = sched.lengths[c], self.costs[c]
            for b in idx:
                role = "first" if b == 0 and "first" in cc else "last" if b == n - 1 and "last" in cc else "generic"
                out += int(sympy.sympify(cc[role]["x"] - cc[role]["a"]).xreplace(env))
        return out


class RankCheckpointedMemory(CheckpointedMemory):
    """:class:`CheckpointedMemory` of one data-parallel rank (``an.parallel``: a ``--dp N --shard
    ...`` trace, any strategy): at each size the plan of ``kind`` over the rank's step, each
    chosen block under its own checkpoint as torchtitan's ``--ac full`` wraps a block (before the
    data-parallel engine; non-reentrant, ``preserve_rng_state=False``: no RNG state stashed), and
    its peak the composition (:class:`~symcost.passes.checkpoint.schedule.StepSchedule`) of the
    rank's plain step ``an`` and its step ``ck`` with every block checkpointed (``Layout(shard=...,
    ac="full")``), both folded over L with FSDP2's or DDP's collectives, unsharded parameters and
    gradient buffers in their blocks' units, and the rank's model states static
    (:class:`~symcost.passes.memory.MemoryModel` of each trace).

    Kinds: ``none``; ``every-layer`` (every block); ``optimal`` (the least composed step peak,
    ties the least recompute, over the plans that checkpoint the first n of the blocks alike
    (the middle ones) and each special end block (the first and the last: FSDP2's root and last
    units differ) in or out — of alike blocks the earliest are checkpointed: a plain block before
    a checkpointed one holds its activations through that one's recomputation, swapped it does
    not; tests/test_checkpoint_dp.py checks it against every subset). Segments of several blocks
    (``sqrt``) are not planned here: a block inside a segment is recomputed through its data-parallel
    unit's hooks, which one checkpoint per block never runs.

    Raises:
        SymcostError: a kind other than these three.
    """

    KINDS = ("none", "every-layer", "optimal")

    def __init__(self, an, ck, kind: str, mm, optimizer: str = "adamw", impl: str = "foreach"):
        if kind not in self.KINDS:
            raise SymcostError(f"--checkpoint {kind} is not planned on a data-parallel rank (segments of several "
                               f"blocks; each checkpoint holds one block there, as --ac full); accepted: "
                               f"{', '.join(k for k in self.KINDS if k != 'none')}")
        super().__init__(an, kind, mm, optimizer, impl)
        self.ck = ck

    def candidates(self, L: int, roles) -> list[list[int]]:
        """The block sets ``optimal`` compares (see the class): ``roles[i]`` the kind of block ``i``."""
        mid = [i for i in range(L) if roles[i] == "block"]
        ends = [i for i in range(L) if roles[i] != "block"]
        out = []
        for n in range(len(mid) + 1):
            for mask in range(2 ** len(ends)):
                out.append(sorted(mid[:n] + [e for j, e in enumerate(ends) if mask >> j & 1]))
        return out

    def at(self, accumulate: bool = False, **sizes: int) -> tuple[Plan, Chain]:
        """The plan of ``kind`` at ``sizes`` and its chain (the rank's plain step and ``ck``)."""
        key = (accumulate, tuple(sorted(sizes.items())))
        hit = self._memo.get(key)
        if hit is None:
            env = self.an.bind(**sizes)
            L = int(env[SYMS["L"]])
            ch = chain(self.an, L, env, self._optimizer, self.impl, accumulate, sub=self.ck)
            if self.kind == "none":
                blocks = []
            elif self.kind == "every-layer":
                blocks = list(range(L))
            else:
                sched, fr = ch.schedule, ch.fr or ch.f
                roles = [sched.role(i) for i in range(L)]
                blocks = min(self.candidates(L, roles),
                             key=lambda bs: (sched.simulate([(i, i + 1) for i in bs])[0], sum(fr[i] for i in bs)))
            plan = Plan(self.an.layer_container or "", L, [(i, i + 1) for i in blocks], self.kind)
            hit = self._memo[key] = (plan, ch)
        return hit


def plan_memory(an, kind: str, sizes: Mapping[str, int], optimizer: str = "adamw",
                impl: str = "foreach", device: str = "cuda", ck=None):
    """``(memory model, sizes)`` of the step checkpointed by ``kind`` (one of :data:`KINDS`):
    the plain :class:`~symcost.passes.memory.MemoryModel` for ``none``, else a
    :class:`CheckpointedMemory` whose plan is chosen at every size it is asked; for a model of
    several stacks (``an.stacks``) a :class:`StackCheckpointedMemory`, planned per stack from
    ``ck``, the step with every block of every stack checkpointed (``Layout(ac="full")``); for a
    data-parallel rank (``an.parallel``, one block list) a :class:`RankCheckpointedMemory` from
    ``ck``, the rank's step with every block checkpointed (``Layout(shard=..., ac="full")``).

    Raises:
        SymcostError: unknown kind, no repeated blocks, several stacks without ``ck`` or with a
            kind planned over one chain only, bad sizes.
    """
    from symcost.passes.memory import memory_model

    if kind not in KINDS:
        raise SymcostError(f"unknown checkpoint plan {kind!r}; accepted: {', '.join(KINDS)}")
    mm = memory_model(an, an.precision, optimizer, impl, device)
    if kind == "none":
        return mm, dict(sizes)
    if getattr(an, "parallel", None) is not None:
        if (ck is None or getattr(an, "stacks", None) or an.parallel.startswith("tp") or an.parallel == "ep"
                or getattr(an, "tensor_parallel", None)):
            raise SymcostError(f"{an.model}: checkpoint plans on a {an.parallel} rank are planned for one block list "
                               "under --dp, from the rank's step with every block checkpointed (ck)")
        from symcost.passes.checkpoint_ops import require_block_list

        require_block_list(an)
        return RankCheckpointedMemory(an, ck, kind, mm, optimizer, mm.impl), dict(sizes)
    if getattr(an, "stacks", None):
        if ck is None:
            raise SymcostError(f"{an.model} has several stacks of blocks; their plan needs the step with every block "
                               "of every stack checkpointed (ck)")
        return StackCheckpointedMemory(an, ck, kind, mm, optimizer, mm.impl), dict(sizes)
    from symcost.passes.checkpoint_ops import require_block_list

    require_block_list(an)
    return CheckpointedMemory(an, kind, mm, optimizer, mm.impl), dict(sizes)

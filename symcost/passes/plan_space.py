"""The search space of ``symcost plan`` (docs/parallel.md, "13. Planning a layout"): one
parallel layout (:class:`Layout`: dp·tp·pp·cp devices, ep borrowed, micro-batch, micro-batches,
sharding, schedule, checkpointing), every layout of N devices (:func:`enumerate_layouts`), and
PyTorch's interleaved 1F1B as the plan composes it (:func:`interleaved_accepts`,
:func:`interleaved_schedule`). :mod:`symcost.passes.plan` prices and ranks them."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from symcost.errors import SymcostError

#: hsdp: FSDP2 over the 2-D mesh (dp_replicate R, dp_shard dp/R), every R with 1 < R < dp
#: (R = 1 is fsdp; R = dp, a shard group of one rank, is DDP's states): docs/parallel.md §0.1
SHARDS = ("ddp", "zero1", "fsdp", "hsdp")
#: none; full (every block of the stage); optimal: the fewest whole blocks checkpointed for the
#: layout to fit the memory cap (blocks are alike: each checkpointed block trades a - x bytes per
#: micro-batch in flight for one recomputed block forward, so the fewest that fit is the fastest
#: fitting block plan; :meth:`Planner.evaluate`); selective: torchtitan's op-level policy
#: (``--ac selective``), which the screen bounds only (full's memory, none's time) and the
#: composed trace prices (:mod:`symcost.passes.plan_traced`)
CHECKPOINTS = ("none", "full", "optimal", "selective")
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
OVERLAP = {
    "backward": "TP collectives and pipeline transfers on the critical path; data-parallel gradient "
                "collectives hidden under the last micro-batch's backward (FSDP: each micro-batch's "
                "all-gathers and reduce-scatter under that micro-batch's compute)",
    "none": "nothing hidden: every collective adds to the step",
}


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Layout:
    """One parallel layout: ``dp·tp·pp`` devices, micro-batch ``b``, ``m`` micro-batches per step
    (global batch = dp·b·m sequences), a sharding of the data-parallel states, a pipeline
    schedule (``virtual`` stages per rank), activation checkpointing; ``replicate``: HSDP's
    replicate degree R (``shard="hsdp"``: dp = R × dp/R, the states sharded over the dp/R ranks
    of ``dp_shard``), 1 otherwise."""

    dp: int
    tp: int
    pp: int
    b: int
    m: int
    shard: str
    checkpoint: str
    schedule: str = "1f1b"
    virtual: int = 1
    replicate: int = 1
    values: dict = field(default_factory=dict)
    #: expert-parallel ranks (borrowed from dp·cp·tp, torchtitan's etp = 1) and context-parallel
    #: ranks (a factor of the devices: dp·tp·pp·cp of them); docs/parallel.md §13.6
    ep: int = 1
    cp: int = 1

    def key(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.b, self.m, self.shard, self.checkpoint, self.schedule, self.virtual,
                self.replicate, self.ep, self.cp)

    @property
    def shard_degree(self) -> int:
        """The ranks the data-parallel states are sharded over: dp/R under HSDP, else dp."""
        return self.dp // self.replicate


def enumerate_layouts(devices: int, global_batch: int, L: int, H: int, *, shards=SHARDS, checkpoints=CHECKPOINTS,
                      schedules=("1f1b",), micro_batches=None, max_tp: int | None = None, K: int | None = None,
                      virtual: int = 2, tp_ok=None, E: int | None = None, cps=(1,), eps=None) -> list[Layout]:
    """Every layout of ``devices`` devices: dp·tp·pp·cp = devices (``cps``: the context-parallel
    sizes to try, :func:`symcost.passes.plan_dims.cp_options`), and for ``E`` routed experts every
    expert-parallel size :func:`symcost.passes.plan_dims.ep_options` allows (torchtitan's rule; the
    data-sharding ranks it borrows from are dp, or dp/R under HSDP; ``eps``: only those sizes, 1
    always), tp divides H (and K) with at least
    2 heads per rank (one head per rank is a regime of its own, not probed: docs/parallel.md §11), pp divides L
    (uniform stages; interleaved: L/(pp·v) whole), dp divides ``global_batch``, b·m =
    global_batch/dp with b in ``micro_batches`` (default: every divisor), each shard (``hsdp``:
    each replicate degree R dividing dp with 1 < R < dp) and checkpoint; pipelines of one rank take no schedule (plain gradient accumulation); PyTorch's
    1F1B needs m ≥ pp and its interleaved schedule m a multiple of its rounds
    (:func:`interleaved_accepts`). ``tp_ok(tp)``: whether the
    model's tensor-parallel plan accepts ``tp`` (every dimension it shards divisible), if given.

    Raises:
        SymcostError: ``devices``, ``global_batch`` not positive integers.
    """
    if devices < 1 or global_batch < 1:
        raise SymcostError("--devices and --global-batch must be positive integers")
    from symcost.passes.plan_dims import ep_options

    out = []
    for tp, cp in ((t, c) for t in divisors(devices) for c in cps if devices % (t * c) == 0):
        if H % tp or (tp > 1 and H // tp < 2) or (K and K % tp) or (max_tp and tp > max_tp):
            continue
        if tp > 1 and tp_ok is not None and not tp_ok(tp):
            continue
        for pp in divisors(devices // (tp * cp)):
            if L % pp:
                continue
            dp = devices // (tp * pp * cp)
            if global_batch % dp:
                continue
            per = global_batch // dp
            for b in divisors(per):
                if micro_batches and b not in micro_batches:
                    continue
                m = per // b
                for sched in (schedules if pp > 1 else ("none",)):
                    v = virtual if sched == "interleaved-1f1b" else 1
                    if sched == "1f1b" and m < pp:
                        continue
                    if sched == "interleaved-1f1b" and (L % (pp * v) or not interleaved_accepts(pp, m)):
                        continue
                    for shard in (shards if dp * cp > 1 else ("ddp",)):
                        for r in ([k for k in divisors(dp) if 1 < k < dp] if shard == "hsdp" else (1,)):
                            for ep in (e for e in ep_options(E, dp // r, cp, tp) if eps is None or e == 1 or e in eps):
                                for ck in checkpoints:
                                    out.append(Layout(dp, tp, pp, b, m, shard, ck, sched, v, r, ep=ep, cp=cp))
    return out


def interleaved_accepts(pp: int, m: int) -> bool:
    """Whether PyTorch's ``ScheduleInterleaved1F1B`` runs ``m`` micro-batches on ``pp`` ranks:
    rounds = max(1, m // pp) and m a multiple of the rounds (torch/distributed/pipelining/
    schedules.py, the "flex_pp" rule of torch ≥ 2.5; e.g. pp 4 takes m = 3, 6, 10 but not 9).
    tests/test_plan.py checks it against the schedule's own constructor."""
    return m % max(1, m // pp) == 0


@functools.lru_cache(maxsize=None)
def interleaved_schedule(pp: int, m: int, v: int) -> tuple[float, float]:
    """``(in_flight, bubble)`` of PyTorch's interleaved 1F1B with ``pp`` ranks, ``m`` micro-batches
    and ``v`` stages per rank: the most model chunks any rank holds, in stages' worth (/v), and
    idle / busy time, both read off the schedule's action lists on a dependency clock
    (:func:`symcost.frontends.pipeline.simulate`). Where m is a multiple of pp they are
    Korthikanti et al. 2022 §4.2.3's min(v·pp + pp − 1, v·m)/v and Narayanan et al. 2021 §2.2's
    (pp − 1)/(v·m); PyTorch's flex rounds (m = 6 on pp = 4: one round of 6) hold more and idle
    longer than those formulas say. Where pp divides m the formulas are returned without
    building the schedule (tests/test_pipeline_parallel.py and tests/test_plan.py check them
    against its action lists), which keeps a plan over pp = 64 and m in the hundreds fast.

    Raises:
        SymcostError: PyTorch refuses the schedule."""
    from symcost.frontends.pipeline import schedule_order, simulate

    if m % pp == 0:
        return min(v * pp + pp - 1, v * m) / v, (pp - 1) / (v * m)
    sim = simulate(schedule_order("interleaved-1f1b", pp, m, v))
    return max(sim["in_flight"].values()) / v, sim["bubble"]

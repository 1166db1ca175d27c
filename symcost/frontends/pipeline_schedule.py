"""The schedules of a pipeline of ``PP`` ranks: PyTorch's own (``torch.distributed.pipelining``)
action lists per rank, read from the schedule objects built on a fake process group
(:func:`schedule_order`), and their simulation over per-stage forward and backward times
(:func:`simulate`; docs/parallel.md, "Pipeline parallelism"). Split from
:mod:`symcost.frontends.pipeline` (the stage modules), which re-exports these names.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

from typing import Any, Mapping

from symcost.errors import SymcostError
from symcost.frontends.parallel import destroy_world

#: --schedule -> (torch.distributed.pipelining class, virtual stages per rank allowed, source)
SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "Huang et al. 2019 (GPipe): all forwards, then all backwards"),
    "1f1b": ("Schedule1F1B", False, "Narayanan et al. 2021 (PTD-P) §2.2.1: PipeDream-Flush's one-forward-"
                                    "one-backward"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", True, "Narayanan et al. 2021 (PTD-P) §2.2.2: "
                                                          "interleaved 1F1B over v model chunks per rank"),
}


def check_schedule(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> str:
    """``schedule`` if the pipeline is one PyTorch can run, else one clear line.

    Raises:
        SymcostError: an unknown schedule, PP < 2, fewer than 1 micro-batch, virtual stages on a
            schedule with one stage per rank, or fewer than 2 virtual stages for interleaved 1F1B.
    """
    if schedule not in SCHEDULES:
        raise SymcostError(f"unknown --schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}")
    if pp < 2:
        raise SymcostError(f"--pp {pp}: a pipeline has at least 2 stages")
    if microbatches < 1:
        raise SymcostError(f"--microbatches {microbatches}: at least 1")
    multi = SCHEDULES[schedule][1]
    if not multi and virtual != 1:
        raise SymcostError(f"--virtual-stages {virtual}: {schedule} runs one stage per rank; use interleaved-1f1b")
    if multi and virtual < 2:
        raise SymcostError(f"--virtual-stages {virtual}: interleaved-1f1b needs at least 2 stages per rank")
    return schedule


def _fake_pg(world: int):
    """The default process group as PyTorch's fake backend of ``world`` ranks (rank 0), reusing
    one of at least that size."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and (dist.get_backend() != "fake" or dist.get_world_size() < world):
        destroy_world()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return dist.group.WORLD


_ORDERS: dict = {}


def schedule_order(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> dict[int, list]:
    """PyTorch's action list of each rank: ``{rank: [(kind, stage, microbatch), ...]}`` in the
    order the rank runs them, ``kind`` ``"F"`` (forward), ``"B"`` (full backward), ``"I"``/``"W"``
    (input / weight backward); idle slots and communication actions are dropped.

    Read from ``torch.distributed.pipelining``'s schedule object (``pipeline_order``, the IR
    its runtime executes), built for ``pp`` ranks with ``virtual`` stages each on a fake process
    group (stage ``s`` on rank ``s mod pp``, as ``ScheduleInterleaved1F1B`` places them).

    Raises:
        SymcostError: the configuration is invalid (:func:`check_schedule`) or PyTorch refuses it
            (its message, one line, e.g. interleaved 1F1B's micro-batch count rule).
    """
    check_schedule(schedule, pp, microbatches, virtual)
    key = (schedule, pp, microbatches, virtual)
    if key in _ORDERS:
        return _ORDERS[key]
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining import PipelineStage

    cls = getattr(S, SCHEDULES[schedule][0])
    if not SCHEDULES[schedule][1]:
        try:
            order = {r: _executed(cls, r, pp, microbatches) for r in range(pp)}
        except (ValueError, RuntimeError, AssertionError) as e:
            raise SymcostError(f"torch.distributed.pipelining refuses {schedule} with PP={pp}, "
                               f"{microbatches} micro-batches: {str(e).strip().splitlines()[0]}") from e
        _ORDERS[key] = order
        return order
    group = _fake_pg(pp)
    sub = dist.new_group(list(range(pp)), backend="fake") if dist.get_world_size() != pp else group
    n = pp * virtual
    try:
        stages = [PipelineStage(torch.nn.Identity(), s, n, torch.device("cpu"), group=sub)
                  for s in range(0, n, pp)]  # rank 0's stages
        sched = cls(stages, microbatches, loss_fn=lambda out, target: out.sum())
    except (ValueError, RuntimeError, AssertionError) as e:
        raise SymcostError(f"torch.distributed.pipelining refuses {schedule} with PP={pp}, "
                           f"{microbatches} micro-batches, {virtual} stage(s) per rank: "
                           f"{str(e).strip().splitlines()[0]}") from e
    # the IR _PipelineScheduleRuntime executes (its communication actions added to it)
    order = {}
    for rank, acts in sched.pipeline_order.items():
        order[rank] = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in acts
                       if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
    _ORDERS[key] = order
    return order


def _executed(cls, rank: int, pp: int, microbatches: int) -> list:
    """The actions a one-stage-per-rank schedule (``ScheduleGPipe``, ``Schedule1F1B``) really runs
    on ``rank``: its ``step`` run on a fake process group of ``pp`` ranks under FakeTensorMode with
    a one-parameter stage, each ``forward_one_chunk`` / ``backward_one_chunk`` logged. (Their
    ``pipeline_order`` is a drawing aid that ``step`` does not execute: in torch 2.13 the last
    rank's 1F1B list starts at micro-batch 1.)"""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import InferenceMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        destroy_world()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    log: list = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            stage = PipelineStage(torch.nn.Linear(1, 1), rank, pp, torch.device("cpu"),
                                  input_args=(torch.empty(1, 1),),
                                  output_args=(torch.empty(1, 1, requires_grad=True),))
            fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

            def forward_one_chunk(i, *a, **k):
                log.append(("F", rank, i))
                return fwd(i, *a, **k)

            def backward_one_chunk(i, *a, **k):
                log.append(("B", rank, i))
                return bwd(i, *a, **k)

            stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
            sched = cls(stage, microbatches, loss_fn=lambda out, target: out.sum())

            def warmup(stages, has_backward, p2p_done):  # the shape vote reads tensor values
                for st in stages:
                    st._inference_mode = InferenceMode.STATIC
            sched._warmup_p2p = warmup
            x = torch.empty(microbatches, 1)
            if rank == 0:
                sched.step(x)
            elif rank == pp - 1:
                sched.step(target=x)
            else:
                sched.step()
    finally:
        destroy_world()
    return log


def simulate(order: Mapping[int, list], t_f: float | Mapping[int, float] = 1.0, t_b: float | Mapping[int, float] = 2.0,
             t_w: float = 0.0) -> dict[str, Any]:
    """Run the per-rank action lists on a dependency clock: a rank runs its actions in order;
    F of (stage s, micro-batch i) starts after F of (s-1, i) ended, B (or I) of (s, i) after B/I of
    (s+1, i) and after F of (s, i); W after I. Communication takes no time (its bytes are counted
    apart). ``t_f``, ``t_b`` are one stage's forward and backward time per micro-batch (PTD-P's
    t_f and t_b; the backward's ``I`` takes ``t_b - t_w`` and ``W`` takes ``t_w``), seconds or any
    unit; either may be a mapping stage -> time (stages of unequal cost: the first holds the
    embedding, the last the head and loss).

    Returns:
        ``makespan``, per rank ``busy``, ``idle`` and ``finish`` (when its last action ends) time, ``bubble`` (the largest idle / busy
        over ranks: PTD-P's t_pb / t_id), and ``in_flight``: per rank the most micro-batch-stages
        whose forward has run and whose backward has not (the activations held at once).

    Raises:
        SymcostError: the lists deadlock (an action waits on one that never runs).
    """
    def per(t, s):
        return t[s] if isinstance(t, Mapping) else t

    def dur(kind, s):
        return {"F": per(t_f, s), "B": per(t_b, s), "I": per(t_b, s) - t_w, "W": t_w}[kind]

    done: dict[tuple, float] = {}
    pos = {r: 0 for r in order}
    clock = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    n_stages = 1 + max((s for acts in order.values() for _, s, _ in acts), default=0)

    def ready(kind, s, i):
        if kind == "F":
            return [("F", s - 1, i)] if s > 0 else []
        if kind in ("B", "I"):
            deps = [("F", s, i)]
            if s < n_stages - 1:
                deps.append(("Bx", s + 1, i))
            return deps
        return [("I", s, i)]

    total = sum(len(a) for a in order.values())
    progressed = 0
    while progressed < total:
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                kind, s, i = acts[pos[r]]
                deps = ready(kind, s, i)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                end = start + dur(kind, s)
                clock[r] = end
                busy[r] += dur(kind, s)
                done[(kind, s, i)] = end
                if kind in ("B", "I"):
                    done[("Bx", s, i)] = end
                pos[r] += 1
                progressed += 1
                moved = True
        if not moved:
            raise SymcostError("the pipeline schedule deadlocks (an action waits on one that never runs)")
    makespan = max(clock.values())
    in_flight = {}
    for r, acts in order.items():
        live = top = 0
        for kind, _, _ in acts:
            live += kind == "F"
            live -= kind in ("B", "I")
            top = max(top, live)
        in_flight[r] = top
    idle = {r: makespan - busy[r] for r in order}
    return {"makespan": makespan, "busy": busy, "idle": idle, "in_flight": in_flight, "finish": dict(clock),
            "bubble": max(idle[r] / busy[r] for r in order if busy[r])}

"""One optimizer step of K accumulated micro-batches, composed as the data-parallel engine runs them.

A rank's traced step is one micro-batch with its collectives and the optimizer step. Under gradient
accumulation the engines differ in how often they reduce the gradients:

- a replicating engine (``--shard ddp`` / ``zero1``: PyTorch's DDP and ``replicate``, Megatron-LM's
  DDP and distributed optimizer) reduces once per optimizer step: Megatron's
  ``forward_backward_no_pipelining`` runs the first K-1 micro-batches inside ``no_sync_func()`` and
  the last outside it ("want to synchronize gradients"; megatron/core/pipeline_parallel/schedules.py
  at d98e8a6), its buckets' reduce-scatter / all-reduce overlapped with that last backward; PyTorch's
  DDP skips the reducer under ``no_sync()`` (torch/nn/parallel/distributed.py);
- FSDP2 (``--shard fsdp`` / ``zero2`` / ``zero3`` / ``hsdp``, ``fully_shard``) as torchtitan runs it
  reduce-scatters (and all-gathers) every micro-batch: its ``Trainer.train_step`` calls
  ``forward_backward_step`` once per micro-batch with no ``set_requires_gradient_sync(False)``
  (torchtitan/trainer.py at b5bcd76);
- the optimizer step runs once per optimizer step in both.

So with ``micro`` the seconds of a micro-batch without the reduction and the optimizer (its compute
and its exposed collectives: TP, EP, CP) and ``last`` the traced step's (the reduction under the
``overlap`` rule, the optimizer in its backward):

- replicating: (K-1) · micro + last;
- fully_shard: (K-1) · (last without the optimizer) + last.

Nothing here traces or prices: it composes :func:`symcost.passes.performance.predict_dp`'s and
:func:`symcost.passes.parallel.step_time`'s per-phase seconds.
"""
from __future__ import annotations

from typing import Any, Mapping

from symcost.errors import SymcostError

def overlapped(compute: Mapping[str, float], comm: Mapping[str, float], overlap: str) -> float:
    """Seconds of a step whose phases' compute and communication (``{"forward", "backward"}``,
    seconds each) overlap as ``overlap`` says: ``"none"`` (their sum), ``"backward"`` (the
    backward's communication hidden under the backward's compute, as DDP's buckets and FSDP2's
    reduce-scatters run: forward + max(backward compute, backward comm)) or anything else (full
    overlap: the larger of all compute and all communication)."""
    if overlap == "none":
        return sum(compute.values()) + sum(comm.values())
    if overlap == "backward":
        return compute["forward"] + comm["forward"] + max(compute["backward"], comm["backward"])
    return max(sum(compute.values()), sum(comm.values()))


#: the engines that reduce once per optimizer step (the others every micro-batch)
ONCE_PER_STEP = ("ddp", "zero1")


def reductions_per_step(shard: str | None, K: int) -> int:
    """How many times the data-parallel engine of ``--shard shard`` reduces the gradients in one
    optimizer step of ``K`` micro-batches: 1 for DDP / Megatron (``ddp``, ``zero1``), K for FSDP2
    (torchtitan's loop), 0 without a data-parallel engine (``shard`` None)."""
    if shard is None:
        return 0
    return 1 if shard in ONCE_PER_STEP else K


def accumulated(step: Mapping[str, Any], K: int, shard: str | None, overlap: str, optimizer: float = 0.0) -> dict[str, Any]:
    """Seconds of one optimizer step of ``K`` micro-batches on one rank.

    Args:
        step: one micro-batch's per-phase seconds: ``compute`` {forward, backward} (the optimizer
            step inside the backward's, as :func:`~symcost.passes.performance.predict_dp` puts it),
            ``comm`` {forward, backward} (the data-parallel groups', under ``overlap``), ``exposed``
            {forward, backward} (TP, EP, CP: on the critical path every micro-batch).
        K: micro-batches per optimizer step (>= 1).
        shard: the ``--shard`` strategy (None: no data-parallel engine).
        overlap: ``none``, ``backward`` or ``full`` (:func:`symcost.passes.parallel.overlapped`).
        optimizer: the optimizer step's seconds inside ``compute["backward"]`` (0 for the bound).
            ``step["iteration_seconds"]`` (Megatron-LM's per-iteration work after the backward,
            :mod:`symcost.passes.megatron_iteration`), where present, also runs once per step.

    Returns:
        ``{"step_seconds", "micro_batches" (K), "reductions" (per optimizer step), "micro_seconds"
        (each of the first K-1 micro-batches), "last_seconds" (the last, with the reduction where the
        engine reduces once, and the optimizer step), "once_per_step" (bool)}``.

    Raises:
        SymcostError: K not a positive integer.
    """
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise SymcostError(f"micro-batches per step must be a positive integer, got {K!r}")
    phases = ("forward", "backward")
    compute = {ph: float(step["compute"][ph]) for ph in phases}
    comm = {ph: float(step["comm"][ph]) for ph in phases}
    exposed = sum(float(step["exposed"][ph]) for ph in phases)
    last = overlapped(compute, comm, overlap) + exposed
    once_work = optimizer + float(step.get("iteration_seconds", 0.0))  # (once per optimizer step)
    bare = {"forward": compute["forward"], "backward": compute["backward"] - once_work}
    once = shard is None or shard in ONCE_PER_STEP
    micro = (sum(bare.values()) if once else overlapped(bare, comm, overlap)) + exposed
    return {"step_seconds": (K - 1) * micro + last, "micro_batches": K, "reductions": reductions_per_step(shard, K),
            "micro_seconds": micro, "last_seconds": last, "once_per_step": once}

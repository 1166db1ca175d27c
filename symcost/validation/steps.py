"""Validate the performance model on whole training steps timed on this machine.

Each case is one model at one size and precision (:data:`STEP_CASES`): the eager training step as
a user writes it — ``zero_grad(set_to_none=True)``, the forward and loss (under
``torch.autocast("cpu", bfloat16)`` for ``bf16-mixed``), ``backward()`` and
``torch.optim.AdamW(foreach=True).step()``; a ``compiled`` case runs the forward and loss under
``torch.compile`` (predicted with fused bytes and a launch per fused kernel) — timed on this CPU (the median of at least
:data:`MIN_RUNS` steps after two warm-up steps), against :func:`symcost.passes.performance.predict`
of the traced step on a calibrated device (its ``efficiency`` table measured by ``symcost
calibrate`` on microbenchmarks only: none of these steps is among them).

Check: every case within ``tolerance`` (15%, issue 29) of its measured median. On a shared
machine other processes take the CPU while a step runs and its single thread waits for a core:
wall time then measures the machine's load, not the step. Each case's steps are therefore timed
in wall time and in this process's CPU time (``time.process_time``; with the calibration's one
torch thread the step's work runs on the calling thread), with the share of the CPU others used
meanwhile (:class:`symcost.hardware.calibrate.Contention`): the wall-time median counts where
that share stayed at most :data:`MAX_OTHER_SHARE`, else the CPU-time median (the row's
``basis`` says which). A case outside the tolerance is timed again, up to ``attempts`` rounds
(a calm round's wall time is kept over a busy one's CPU time).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from symcost.hardware.devices import Device

#: (model, sizes, precision[, mode]) of the validation: built-in models, fp32 and bf16-mixed, eager
#: (the default) or compiled, at widths and lengths that the calibration's GEMM sweep does not run
STEP_CASES: tuple[tuple[str, dict, str], ...] = (
    ("mlp", {"B": 8, "S": 128, "D": 768, "L": 4}, "fp32"),
    ("mlp", {"B": 16, "S": 64, "D": 640, "L": 6}, "bf16-mixed"),
    ("cs336-lm", {"B": 4, "S": 128, "H": 8, "D": 64, "L": 2, "V": 2048, "F": 1344}, "fp32"),
    ("cs336-lm", {"B": 4, "S": 128, "H": 8, "D": 64, "L": 2, "V": 2048, "F": 1344}, "bf16-mixed"),
    ("cs336-lm", {"B": 2, "S": 256, "H": 6, "D": 64, "L": 3, "V": 3000, "F": 1000}, "fp32"),
    ("gpt2", {"B": 2, "S": 128, "H": 4, "D": 64, "L": 2, "V": 4096}, "fp32"),
    ("gpt2", {"B": 4, "S": 96, "H": 6, "D": 64, "L": 2, "V": 5000}, "bf16-mixed"),
    ("megatron-gpt", {"B": 2, "S": 128, "H": 8, "D": 48, "L": 2, "V": 4000}, "fp32"),
    ("megatron-gpt", {"B": 2, "S": 128, "H": 8, "D": 48, "L": 2, "V": 4000}, "bf16-mixed"),
    ("mlp", {"B": 4, "S": 200, "D": 1000, "L": 3}, "fp32"),
    ("gpt2", {"B": 1, "S": 256, "H": 8, "D": 40, "L": 3, "V": 6000}, "fp32"),
    # compiled steps: the forward and loss under torch.compile (inductor), backward and AdamW eager
    ("mlp", {"B": 8, "S": 96, "D": 896, "L": 3}, "fp32", "compiled"),
    ("gpt2", {"B": 2, "S": 160, "H": 4, "D": 64, "L": 2, "V": 4096}, "fp32", "compiled"),
    ("gpt2", {"B": 4, "S": 96, "H": 6, "D": 64, "L": 2, "V": 5000}, "bf16-mixed", "compiled"),
)
#: the subset the timing test and ``validate --steps --quick`` run (under a minute): the smaller
#: steps, fp32 and bf16-mixed (the bf16 einsum language models, 20% slow, are the full table's:
#: docs/performance-model.md, "Known gaps")
QUICK_CASES = tuple(STEP_CASES[i] for i in (0, 1, 5, 6))
MIN_RUNS = 7
MIN_SECONDS = 1.0
#: a step timed while other processes used more than this share of the CPU is judged on its CPU
#: time (this process's, ``time.process_time``), not its wall time (:func:`validate_steps`)
MAX_OTHER_SHARE = 0.25


def eager_step(model: str, sizes: Mapping[str, int], precision: str = "fp32", mode: str = "eager",
               ddp: bool = False) -> Callable[[], None]:
    """One training step of a built-in model on this CPU (see the module docstring); ``mode``
    ``compiled``: the forward and loss under ``torch.compile`` (compiled on the first call);
    ``ddp``: the model under ``DistributedDataParallel`` (the default process group, its default
    25 MiB buckets; the gradients' all-reduce runs inside ``backward()``)."""
    import torch

    from symcost.frontends.models import resolve
    from symcost.frontends.precision import precision_context

    spec = resolve(model)
    values = {**spec.defaults, **sizes}
    values.update({a: values[b] for a, b in spec.tied.items()})
    torch.manual_seed(0)
    m = spec.build(values)
    dtype, ctx = precision_context(precision)
    m = m.to(dtype)
    if ddp:
        m = torch.nn.parallel.DistributedDataParallel(m)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, foreach=True)

    def fwd(*a, **kw):
        with ctx():
            return spec.loss(m(*a, **kw), (a, kw))

    run = torch.compile(fwd, dynamic=False) if mode == "compiled" else fwd

    def step():
        opt.zero_grad(set_to_none=True)
        run(*args, **kwargs).backward()
        opt.step()

    return step


def time_step(step: Callable[[], None], min_runs: int = MIN_RUNS, min_seconds: float = MIN_SECONDS) -> dict:
    """``{"median", "min", "cpu_median", "runs", "other_cpu_share"}`` of ``step`` after two
    warm-up calls, at least ``min_runs`` calls and ``min_seconds`` of them: the wall time's median
    and minimum, this process's CPU time per step (median; ``time.process_time``), seconds, and the
    share of the machine's CPU other processes used meanwhile (None: unknown)."""
    from symcost.hardware.calibrate import Contention

    step()
    step()
    ts: list[float] = []
    cs: list[float] = []
    c = Contention()
    t0 = time.perf_counter()
    with c:
        while len(ts) < min_runs or time.perf_counter() - t0 < min_seconds:
            p, t = time.process_time(), time.perf_counter()
            step()
            ts.append(time.perf_counter() - t)
            cs.append(time.process_time() - p)
    return {"median": statistics.median(ts), "min": min(ts), "cpu_median": statistics.median(cs), "runs": len(ts),
            "other_cpu_share": c.share}


@dataclass
class StepValidation:
    """Result of :func:`validate_steps`: the device, one row per case, failures, contention."""

    device: Device
    rows: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    tolerance: float = 0.15
    contention: float | None = None
    threads: int | None = None

    def to_json(self) -> dict:
        return {"device": self.device.to_json(), "steps": self.rows, "failures": self.failures,
                "ok": not self.failures, "tolerance": self.tolerance, "contention": self.contention,
                "threads": self.threads}


def _label(model, sizes, precision, mode="eager"):
    return f"{model} {precision}{' compiled' if mode == 'compiled' else ''} " + " ".join(f"{k}={v}" for k, v in sizes.items())


def validate_steps(device: Device, cases=STEP_CASES, tolerance: float = 0.15, attempts: int = 2,
                   threads: int | None = None, log: Callable[[str], None] | None = None) -> StepValidation:
    """Predict and time every case (see the module docstring).

    Args:
        device: a calibrated device with an ``efficiency`` table (``symcost calibrate --out``).
        cases: ``(model, sizes, precision)`` or ``(model, sizes, precision, mode)``, mode ``eager``
            (the default) or ``compiled``.
        tolerance: the largest |predicted / measured - 1| that passes.
        attempts: rounds of timing a failing case again.
        threads: torch threads to run with (default: the calibration's, ``measured.threads``).

    Returns:
        A :class:`StepValidation`; each row: case, model, sizes, precision, predicted, bound,
        measured (median seconds), measured_min, runs, error (predicted / measured - 1), terms.

    Raises:
        SymcostError: a device without an ``efficiency`` table; a model symcost cannot build.
    """
    import torch

    from symcost.errors import SymcostError
    from symcost.graph.build import trace
    from symcost.hardware.calibrate import Contention, steady_allocator
    from symcost.passes.performance import predict

    if device.efficiency is None:
        raise SymcostError(f"{device.key} has no efficiency table: validate --steps needs a device file written by "
                           "symcost calibrate --out FILE (it measures them)")
    log = log or (lambda s: None)
    threads = threads or int(device.measured.get("threads") or torch.get_num_threads())
    torch.set_num_threads(threads)
    steady_allocator()
    prepared = []
    for model, sizes, precision, *rest in cases:
        mode = rest[0] if rest else "eager"
        an = trace(model, sizes=dict(sizes), precision=precision)
        p = predict(an, device, sizes, mode=mode)
        step = eager_step(model, sizes, precision, mode)
        if mode == "compiled":
            step()  # compile now, not while timing
        prepared.append((_label(model, sizes, precision, mode), model, sizes, precision, p, step))
    best: dict[str, dict] = {}
    contention = Contention()
    v = StepValidation(device, tolerance=tolerance, threads=threads)
    todo = list(range(len(prepared)))
    for attempt in range(max(1, attempts)):
        for i in todo:
            label, model, sizes, precision, p, step = prepared[i]
            with contention:
                t = time_step(step)
            t["basis"] = "wall" if t["other_cpu_share"] is not None and t["other_cpu_share"] <= MAX_OTHER_SHARE \
                else "cpu"
            t["value"] = t["median"] if t["basis"] == "wall" else t["cpu_median"]
            old = best.get(label)
            # a calm round's wall time beats a busy round's CPU time; else the faster of the two
            if old is None or (t["basis"], -t["value"]) > (old["basis"], -old["value"]):
                best[label] = t
        rows = []
        for label, model, sizes, precision, p, _ in prepared:
            t = best[label]
            rows.append({"case": label, "model": model, "sizes": dict(sizes), "precision": precision, "mode": p["mode"],
                         "predicted": p["step_seconds"], "bound": p["bound_seconds"], "measured": t["value"],
                         "basis": t["basis"], "wall_median": t["median"], "wall_min": t["min"],
                         "cpu_median": t["cpu_median"], "other_cpu_share": t["other_cpu_share"], "runs": t["runs"],
                         "error": p["step_seconds"] / t["value"] - 1, "terms": p["terms"], "ops": p["ops"]})
        failures = [f"{r['case']}: predicted {r['predicted'] * 1e3:.1f} ms vs measured median {r['measured'] * 1e3:.1f} "
                    f"ms ({r['basis']} time; {100 * r['error']:+.0f}%, beyond {100 * tolerance:.0f}%)" for r in rows
                    if abs(r["error"]) > tolerance]
        v = StepValidation(device, rows, failures, tolerance, contention.share, threads)
        for r in rows:
            log(f"[round {attempt + 1}] {r['case']}: predicted {r['predicted'] * 1e3:.1f} ms, measured "
                f"{r['measured'] * 1e3:.1f} ms ({r['basis']}; {100 * r['error']:+.1f}%), bound {r['bound'] * 1e3:.1f} ms")
        if not failures:
            break
        todo = [i for i, c in enumerate(prepared) if any(f.startswith(c[0] + ":") for f in failures)]
    return v


#: (model, sizes, precision) of the 2-rank gloo data-parallel validation (:func:`validate_dp_steps`)
DP_CASES: tuple[tuple[str, dict, str], ...] = (
    ("mlp", {"B": 8, "S": 64, "D": 512, "L": 3}, "fp32"),
    ("gpt2", {"B": 2, "S": 96, "H": 4, "D": 64, "L": 2, "V": 4096}, "fp32"),
)


def _dp_worker(rank: int, world: int, store: str, model: str, sizes: dict, precision: str, min_runs: int,
               queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        step = eager_step(model, sizes, precision, ddp=True)
        queue.put((rank, time_step(step, min_runs=min_runs)))
    finally:
        dist.destroy_process_group()


def time_dp_step(model: str, sizes: Mapping[str, int], precision: str = "fp32", ranks: int = 2,
                 min_runs: int = MIN_RUNS) -> dict:
    """Time the DDP training step of a built-in model on ``ranks`` gloo processes of this host (one
    torch thread each, a file-store rendezvous; :func:`eager_step` with ``ddp``, :func:`time_step`
    in every rank). Returns rank 0's timing (its wall-time ``median`` counts: a rank's step waits
    for the all-reduce, which its CPU time leaves out) with ``"ranks": [each rank's timing]``."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    fd, store = tempfile.mkstemp(prefix="symcost-gloo-")
    os.close(fd)
    os.unlink(store)
    try:
        mp.start_processes(_dp_worker, args=(ranks, store, model, dict(sizes), precision, min_runs, q),
                           nprocs=ranks, start_method="spawn")
        got = dict(q.get() for _ in range(ranks))
    finally:
        if os.path.exists(store):
            os.unlink(store)
    return {**got[0], "ranks": [got[r] for r in range(ranks)]}


def gloo_device(device: Device, ranks: int = 2) -> tuple[Device, dict]:
    """``device`` with the gloo all-reduce of this host measured on its microbenchmark
    (:func:`symcost.hardware.calibrate_perf.collective_alpha_beta`): ``interconnect`` {link "gloo
    (one host)", ``link_bandwidth`` beta, ``devices_per_node`` ranks} and the efficiency's
    ``collective_latency`` alpha; and the fit itself. Nothing of a training step is measured."""
    import dataclasses

    from symcost.hardware.calibrate_perf import collective_alpha_beta
    from symcost.passes.performance import efficiency_of

    fit = collective_alpha_beta(ranks)
    eff = dataclasses.replace(efficiency_of(device), collective_latency=fit["alpha"])
    ic = {"link": "gloo (one host, loopback)", "link_bandwidth": fit["beta"], "devices_per_node": ranks,
          "source": f"symcost.hardware.calibrate_perf.collective_alpha_beta: {ranks}-rank gloo all-reduce, "
                    f"{len(fit['seconds'])} sizes"}
    return dataclasses.replace(device, interconnect=ic, efficiency=eff), fit


def validate_dp_steps(device: Device, cases=DP_CASES, ranks: int = 2, tolerance: float = 0.25,
                      overlap: str = "backward", log: Callable[[str], None] | None = None) -> StepValidation:
    """Issue 29's data-parallel line on this CPU: each case's DDP step on ``ranks`` gloo processes
    (:func:`time_dp_step`, wall-time median of rank 0) against
    :func:`symcost.passes.performance.predict_dp` of the traced DDP rank (``--dp ranks --shard
    ddp``: compute by the calibrated efficiency table, the all-reduce by the alpha-beta of
    :func:`gloo_device`'s microbenchmark, DDP's ``overlap`` with the backward). Failures: beyond
    ``tolerance`` (25%). Rows as :func:`validate_steps`'s, plus ``comm`` and ``alpha_beta``.

    Raises:
        SymcostError: a device without an ``efficiency`` table.
    """
    from symcost.errors import SymcostError
    from symcost.frontends.layout import Layout
    from symcost.graph.build import trace
    from symcost.passes.performance import predict_dp

    if device.efficiency is None:
        raise SymcostError(f"{device.key} has no efficiency table: calibrate it first (symcost calibrate --out FILE)")
    log = log or (lambda s: None)
    dev, fit = gloo_device(device, ranks)
    log(f"gloo all-reduce ({ranks} ranks): alpha {fit['alpha'] * 1e6:.1f} us, beta {fit['beta'] / 1e9:.2f} GB/s "
        f"(fit rms {100 * fit['rms_rel_error']:.0f}%)")
    rows = []
    for model, sizes, precision in cases:
        full = {**sizes, "DP": ranks}
        an = trace(model, sizes=full, precision=precision, layout=Layout(shard="ddp"))
        p = predict_dp(an, dev, full, overlap=overlap)
        t = time_dp_step(model, sizes, precision, ranks)
        rows.append({"case": "DDP x%d " % ranks + _label(model, sizes, precision), "model": model, "sizes": dict(sizes),
                     "precision": precision, "mode": "eager", "predicted": p["step_seconds"],
                     "bound": p["bound_seconds"], "measured": t["median"], "basis": "wall", "wall_median": t["median"],
                     "wall_min": t["min"], "cpu_median": t["cpu_median"], "other_cpu_share": t["other_cpu_share"],
                     "runs": t["runs"], "error": p["step_seconds"] / t["median"] - 1, "compute": p["compute"],
                     "comm": p["comm"], "alpha_beta": {k: fit[k] for k in ("alpha", "beta", "rms_rel_error")}})
        r = rows[-1]
        log(f"{r['case']}: predicted {r['predicted'] * 1e3:.1f} ms, measured {r['measured'] * 1e3:.1f} ms "
            f"({100 * r['error']:+.1f}%), others' CPU share {t['other_cpu_share']}")
    failures = [f"{r['case']}: predicted {r['predicted'] * 1e3:.1f} ms vs measured median {r['measured'] * 1e3:.1f} ms "
                f"({100 * r['error']:+.0f}%, beyond {100 * tolerance:.0f}%)" for r in rows if abs(r["error"]) > tolerance]
    return StepValidation(dev, rows, failures, tolerance, None, 1)

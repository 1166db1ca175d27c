"""Calibrate this machine: peak matmul FLOP/s and memory bandwidth, measured with compiled kernels.

Every kernel is compiled with ``torch.compile`` (inductor) and timed with
``torch.utils.benchmark.Timer.blocked_autorange``; a kernel's time is the fastest block mean
(the least disturbed by other processes on a shared machine). Peaks are the best over several
kernels:

- peak FLOP/s per precision: large square matmuls, 2·n³ FLOPs each
  (``torch.utils.flop_counter``'s mm formula); on a CPU over the time left after the BLAS's
  packing of the [k, n] operand (read and written once at ``pack_bandwidth``), which the
  roofline adds back for every GEMM on such a device;
- pack_bandwidth (a CPU): the packing pass's own rate, from a skinny GEMM (:data:`PACK_GEMM`)
  less its multiply, at most the streaming rate (the pass gathers panels from rows a page
  apart: on a VM it can run at half the streaming rate, docs/roofline.md);
- bandwidth: large element-wise kernels (scale, add), a full reduction (sum) and a
  matrix-vector product (the BLAS's gemv, [2048, n] x [n, 1]), bytes as symcost counts them
  (inputs read + outputs written, docs/conventions.md), on tensors several times the last-level
  cache. The reduction and the matrix-vector product only read: the best rate of the four is
  the streaming-read ``bandwidth`` (the BLAS's gemv prefetches and on some CPUs streams faster
  than a compiled reduction; a bound below what a kernel reaches would not be a bound). On a CPU a written byte costs more (the cache line is first read:
  write-allocate), so the time the write-heavy kernels take beyond reading their inputs gives a
  ``write_bandwidth`` (entered only where it is at least 5% below the read figure); the
  roofline then times read bytes at ``bandwidth`` and written bytes at ``write_bandwidth``.

- transcendental rate per function class (exp, log, erf, tanh, sin, sqrt): a kernel that
  evaluates the function k times per element it reads (``sum_i f(x·(1 + i/100))``) on a tensor
  that stays in cache, timed at two k; the extra evaluations over the extra time is the rate
  (evaluations/s; each carries a multiply and an add, so the rate is slightly low, and an op's
  predicted time slightly high rather than low). On a CPU these are vectorised polynomial
  approximations (SLEEF, in ATen's ``Vectorized``), several FMA pipeline passes per element: an
  exponential costs tens of times a multiply, an erf or tanh more, so a softmax or a GELU is
  bound by them rather than by memory.

**A busy machine.** Other processes that take CPU while a kernel is timed make it slow, and a
rate measured then is nonsense (0.6 GFLOP/s bf16 on a machine that does 60). Each kernel is
therefore timed :data:`REPEATS` times (:func:`measure_rate`), while the share of the machine's CPU
time that other processes used is read from ``/proc/stat`` (:class:`Contention`; where that file
is missing, the 1-minute load average beyond this process's threads, ``os.getloadavg``). A round
is *contended* (:func:`assess`) when the repeats' times spread by more than :data:`MAX_SPREAD`
(slowest over fastest, minus 1) or others used more than :data:`MAX_OTHER_SHARE` of the CPU. A
contended kernel is timed again, up to :data:`RETRIES` more rounds; its time is the fastest seen
(a busy moment can only slow a kernel). If it is still contended, the entry says so: its
``quality`` is ``{"contended": true, "reasons": [...], "kernels": [...], ...}``, the command prints
a warning, and ``symcost validate`` refuses such a file (``--accept-contended`` checks against it
anyway, with a warning).

The result is a device entry (:func:`symcost.hardware.devices.write_file` writes it as JSON) that every
``--devices-file`` option accepts.
"""
from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable, Sequence

from symcost.errors import SymcostError


def measure(fn: Callable, *args, min_run_time: float = 0.3, warmup: int = 1) -> dict:
    """Time ``fn(*args)`` (already compiled or not) with ``torch.utils.benchmark``.

    Returns:
        ``{"min": s, "median": s, "runs": n}``: the fastest and median block mean in seconds
        (``Measurement.times``), over blocks of ``blocked_autorange(min_run_time)``.
    """
    import statistics

    import torch
    from torch.utils import benchmark

    for _ in range(warmup):
        fn(*args)
    sync = torch.cuda.synchronize if any(getattr(a, "is_cuda", False) for a in args) else (lambda: None)
    sync()
    timer = benchmark.Timer(stmt="fn(*args); sync()", globals={"fn": fn, "args": args, "sync": sync})
    m = timer.blocked_autorange(min_run_time=min_run_time)
    times = list(m.times)
    return {"min": min(times), "median": statistics.median(times), "runs": m.number_per_run * len(times)}


#: times each kernel is timed per round (its rate is the fastest; their spread tells a busy machine)
REPEATS = 3
#: a round whose slowest repeat exceeds its fastest by more than this is contended
MAX_SPREAD = 0.25
#: a round during which other processes used more than this share of the machine's CPU is contended
MAX_OTHER_SHARE = 0.25
#: rounds a contended kernel is timed again before the entry is marked contended
RETRIES = 2


def cpu_times() -> tuple[float, float, float] | None:
    """(machine busy CPU-seconds, machine total CPU-seconds, this process's CPU-seconds), from
    /proc/stat and os.times(); None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    t = os.times()
    return (sum(vals[:8]) - idle) / tick, sum(vals[:8]) / tick, t.user + t.system


class Contention:
    """The share of the machine's CPU time that other processes used inside its ``with`` blocks
    (0: the machine was ours; 0.75: others held three quarters of it), from :func:`cpu_times`;
    ``share`` is None where /proc/stat is missing."""

    def __init__(self):
        self.busy = self.total = self.own = 0.0
        self.known = True

    def __enter__(self):
        self._start = cpu_times()
        return self

    def __exit__(self, *exc):
        end = cpu_times()
        if self._start is None or end is None:
            self.known = False
            return
        self.busy += end[0] - self._start[0]
        self.total += end[1] - self._start[1]
        self.own += end[2] - self._start[2]

    @property
    def share(self) -> float | None:
        if not self.known or self.total <= 0:
            return None
        return max(0.0, min(1.0, (self.busy - self.own) / self.total))


def load_beyond_own(threads: int) -> float | None:
    """The 1-minute load average beyond this process's ``threads``, as a share of the CPUs
    (``os.getloadavg``; None where there is none): the fallback of :class:`Contention`."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    cpus = os.cpu_count() or 1
    return max(0.0, (load - threads) / cpus)


def assess(times: list[float], other_share: float | None) -> list[str]:
    """Why a round of repeated timings of one kernel is contended (empty: it is not).

    Args:
        times: the repeats' times in seconds (each the fastest block mean of one :func:`measure`).
        other_share: the share of the machine's CPU other processes used meanwhile (None: unknown).

    Returns:
        One phrase per reason: the spread above :data:`MAX_SPREAD`, the share above
        :data:`MAX_OTHER_SHARE`.
    """
    why = []
    if times and min(times) > 0:
        spread = max(times) / min(times) - 1
        if spread > MAX_SPREAD:
            why.append(f"repeated timings spread by {100 * spread:.0f}% (> {100 * MAX_SPREAD:.0f}%)")
    if other_share is not None and other_share > MAX_OTHER_SHARE:
        why.append(f"other processes used {100 * other_share:.0f}% of the CPU (> {100 * MAX_OTHER_SHARE:.0f}%)")
    return why


def measure_rate(fn: Callable, *args, min_run_time: float = 0.3, repeats: int = REPEATS, retries: int = RETRIES,
                 cpu_bound: bool = True, log: Callable[[str], None] | None = None, label: str = "") -> dict:
    """Time ``fn(*args)`` :data:`REPEATS` times a round (:func:`measure`, ``min_run_time`` split
    among them), judge the round (:func:`assess`) and, while it is contended, time it again, up to
    ``retries`` more rounds.

    Args:
        cpu_bound: judge other processes' CPU share too (a CPU kernel; a GPU's is judged by the
            spread alone).

    Returns:
        ``{"min", "median"}`` (seconds: the fastest repeat over all rounds, the median of the
        last round), ``"rounds"``, ``"spread"`` (of the last round), ``"other_cpu_share"`` (of
        the last round; None: unknown), ``"contended"`` (the last round was) and ``"reasons"``.
    """
    log = log or (lambda s: None)
    best = None
    for rnd in range(1 + max(0, retries)):
        times, medians = [], []
        c = Contention()
        with c:
            for _ in range(max(1, repeats)):
                t = measure(fn, *args, min_run_time=min_run_time / max(1, repeats))
                times.append(t["min"])
                medians.append(t["median"])
        share = c.share if c.known else load_beyond_own(_threads())
        reasons = assess(times, share if cpu_bound else None)
        best = min(times) if best is None else min(best, min(times))
        out = {"min": best, "median": sorted(medians)[len(medians) // 2], "rounds": rnd + 1,
               "spread": max(times) / min(times) - 1 if min(times) > 0 else 0.0,
               "other_cpu_share": share if cpu_bound else None, "contended": bool(reasons), "reasons": reasons}
        if not reasons:
            return out
        if rnd < retries:
            log(f"{label or 'kernel'}: contended ({'; '.join(reasons)}), timing it again")
    return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def quality(kernels: list[dict]) -> dict[str, Any]:
    """The calibration's ``quality`` from its kernels' :func:`measure_rate` results: contended
    when any kernel stayed contended after its retries (``kernels`` names them, ``reasons`` says
    why), with the worst spread and others' CPU share seen, the load average and CPU count."""
    bad = [k for k in kernels if k.get("contended")]
    shares = [k["other_cpu_share"] for k in kernels if k.get("other_cpu_share") is not None]
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    reasons = sorted({r for k in bad for r in k.get("reasons", [])})
    return {"contended": bool(bad), "kernels": [k["kernel"] for k in bad], "reasons": reasons,
            "max_spread": max((k.get("spread", 0.0) for k in kernels), default=0.0),
            "max_other_cpu_share": max(shares) if shares else None,
            "retried": sum(1 for k in kernels if k.get("rounds", 1) > 1),
            "loadavg": load, "cpus": os.cpu_count(),
            "criteria": f"spread of {REPEATS} repeats <= {100 * MAX_SPREAD:.0f}%, others' CPU share <= "
                        f"{100 * MAX_OTHER_SHARE:.0f}%, after up to {RETRIES} retries"}


def steady_allocator() -> bool:
    """Keep freed large blocks in the process heap (glibc ``mallopt``: mmap and trim thresholds at
    1 GiB), so a kernel's output allocation reuses memory as a training loop's caching allocator
    would, instead of mapping and faulting in fresh pages on every call (which costs more than a
    64 MiB copy). Returns False where glibc is not there (the timing then includes page faults)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 1 << 30)) and bool(libc.mallopt(-1, 1 << 31))  # M_MMAP_/M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` with inductor (dynamic shapes off: one kernel per size)."""
    import torch

    return torch.compile(fn, dynamic=False)


def _device(name: str):
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SymcostError("cuda: no CUDA device is available here (torch.cuda.is_available() is False); use cpu")
        return torch.device("cuda")
    raise SymcostError(f"calibrate --device takes cpu or cuda, got {name!r}")


#: function class -> the torch function timed for it (inputs in [0.5, 1.6): every one is defined)
TRANSCENDENTAL_KERNELS = {"exp": "exp", "log": "log", "erf": "erf", "tanh": "tanh", "sin": "sin", "sqrt": "rsqrt"}


def transcendental_rates(dev, quick: bool = False, min_run_time: float = 0.3, kernels: list | None = None,
                         log: Callable[[str], None] | None = None) -> dict[str, float]:
    """Evaluations per second of each transcendental class on ``dev`` (a ``torch.device``).

    For each class, ``sum_{i<k} f(x * (1 + i/100))`` is compiled for two k (1 and 9; 1 and 5
    with ``quick``) over a tensor that stays in cache (2^20 fp32 on a CPU, 2^26 on a GPU), so
    memory time is the same for both; rate = (k2 - k1) · numel / (t2 - t1).

    Returns:
        ``{class: evaluations/s}`` for the classes of :data:`TRANSCENDENTAL_KERNELS`; each
        kernel measured is appended to ``kernels`` (when given).
    """
    import torch

    log = log or (lambda s: None)
    n = 1 << (26 if dev.type == "cuda" else 20)
    x = torch.rand(n, device=dev) + 0.5
    ks = (1, 5) if quick else (1, 9)
    rates = {}
    cpu = dev.type != "cuda"
    for cls, name in TRANSCENDENTAL_KERNELS.items():
        f = getattr(torch, name)
        ts, runs = [], []
        for k in ks:
            def g(a, f=f, k=k):
                out = f(a)
                for i in range(1, k):
                    out = out + f(a * (1 + 0.01 * i))
                return out
            torch._dynamo.reset()  # one compiled kernel per (class, k): stay below dynamo's recompile limit
            runs.append(measure_rate(compiled(g), x, min_run_time=min_run_time, cpu_bound=cpu, log=log,
                                     label=f"{name} x{k}"))
            ts.append(runs[-1]["min"])
        extra = (ks[1] - ks[0]) * n
        dt = ts[1] - ts[0]
        rate = extra / dt if dt > 0 else extra / ts[1]
        rates[cls] = rate
        if kernels is not None:
            kernels.append({"kernel": f"{name} x{ks[1]} - x{ks[0]} on {n} fp32", "transcendentals": extra,
                            "seconds": dt, "transcendental_per_s": rate, **_judged(runs)})
        log(f"{name} ({cls}): {rate / 1e9:.2f} G/s")
    return rates


#: the GEMM ``(m, k, n)`` whose packing pass ``calibrate`` times on a CPU: few rows, so the
#: multiply is a tenth of its time; its [k, n] operand (32 MiB fp32) beyond a core's caches, rows
#: 8 KiB apart; of a shape the validation sweep does not run
PACK_GEMM = (8, 4096, 2048)


def calibrate(device: str = "cpu", quick: bool = False, min_run_time: float = 0.3,
              log: Callable[[str], None] | None = None,
              gemms: Sequence[tuple[int, int, int]] = (), efficiency: bool = False) -> dict[str, Any]:
    """Measure this machine's peak matmul FLOP/s and memory bandwidth.

    Args:
        device: ``cpu`` or ``cuda``.
        quick: smaller kernels (a CI-sized calibration, a few seconds after compiling).
        min_run_time: seconds each kernel is timed for.
        log: called with a line per kernel measured.
        gemms: more fp32 GEMM shapes ``(m, k, n)`` ([m, k] x [k, n]) whose rates count towards the
            fp32 peak besides the square ones: a CPU BLAS's rate depends on the shape (cache
            blocking), and a bound checked against a workload must use a peak no lower than the
            rate its own GEMMs reach (``symcost validate`` passes its training steps' shapes).

    Returns:
        A device entry: ``name``, ``fp32`` (and ``bf16`` where measured) peak FLOP/s,
        ``bandwidth`` (byte/s), ``write_bandwidth`` (where lower), ``pack_bandwidth`` (a CPU:
        byte/s read plus written of a BLAS packing a GEMM's [k, n] operand, from the GEMM
        :data:`PACK_GEMM` less its multiply; every GEMM's peak is taken net of its packing at
        that rate), ``transcendentals``
        (evaluations/s per class, :func:`transcendental_rates`), ``source`` ("measured by symcost calibrate"), ``date``, and
        ``measured``: every kernel with its FLOPs, bytes, seconds and rate, and how it was judged
        (``rounds``, ``spread``, ``other_cpu_share``, ``contended``); ``quality``
        (:func:`quality`): whether the machine stayed busy while it was measured.

    Raises:
        SymcostError: an unknown or unavailable device.
    """
    import torch

    dev = _device(device)
    log = log or (lambda s: None)
    steady_allocator()
    kernels: list[dict] = []
    gpu = dev.type == "cuda"
    mm_sizes = (4096, 8192) if gpu else ((512, 1024) if quick else (512, 1024, 2048))
    precisions = {"fp32": torch.float32, "bf16": torch.bfloat16} if (gpu or not quick) else {"fp32": torch.float32}
    if gpu:
        precisions["fp16"] = torch.float16
    numel = 1 << 28 if gpu else 1 << 24  # 1 GiB on a GPU (far beyond its L2), 64 MiB on a CPU
    x = torch.randn(numel, device=dev)
    y = torch.randn(numel, device=dev)
    item = x.element_size()
    rows = 2048 if not gpu else 1 << 14
    mat, vec = x.view(rows, numel // rows), torch.randn(numel // rows, 1, device=dev)
    streams = [  # (name, kernel, args, bytes read, bytes written)
        ("sum (reduction)", compiled(lambda a: a.sum()), (x,), numel * item, item),
        ("scale (x*2)", compiled(lambda a: a * 2.0), (x,), numel * item, numel * item),
        ("add (x+y)", compiled(lambda a, b: a + b), (x, y), 2 * numel * item, numel * item),
        # the BLAS's matrix-vector product streams its matrix with its own prefetching, on a CPU
        # often faster than a compiled reduction: a read rate too ([rows, n] x [n, 1], aten.mm)
        ("matrix-vector", compiled(lambda a, v: a @ v), (mat, vec), (numel + numel // rows) * item, rows * item),
    ]
    write_heavy = ("scale (x*2)", "add (x+y)")
    times = {}
    for name, fn, args, rd, wr in streams:
        t = measure_rate(fn, *args, min_run_time=min_run_time, cpu_bound=not gpu, log=log, label=name)
        times[name] = (t["min"], rd, wr)
        rate = (rd + wr) / t["min"]
        kernels.append({"kernel": f"{name} {numel} fp32", "flops": 2 * numel if name == "matrix-vector" else numel,
                        "bytes": rd + wr, "written": wr,
                        "seconds": t["min"], "median": t["median"], "byte_per_s": rate, **_judged([t])})
        log(f"{name} on {numel * item / 2**20:.0f} MiB: {rate / 1e9:.2f} GB/s")
    bw = max((rd + wr) / t for t, rd, wr in times.values())
    # written bytes: what the write-heavy kernels take beyond reading their inputs at ``bw``
    wbw = max((wr / (t - rd / bw) if t > rd / bw else bw) for name, (t, rd, wr) in times.items() if name in write_heavy)
    wbw = min(wbw, bw)
    wbw_used = wbw if wbw < 0.95 * bw else bw  # the entry keeps a write bandwidth only below 95%
    peak: dict[str, float] = {}
    mm = compiled(lambda a, b: a @ b)
    timed = []  # (m, k, n, precision key, itemsize, label, timing)

    def gemm(m: int, k: int, n: int, key: str, dt, label: str) -> None:
        """Time [m, k] x [k, n] (its rate is counted once the packing rate is known)."""
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, n, device=dev, dtype=dt)
        t = measure_rate(mm, a, b, min_run_time=min_run_time, cpu_bound=not gpu, log=log, label=label)
        timed.append((m, k, n, key, dt.itemsize, label, t))

    for key, dt in precisions.items():
        for n in mm_sizes:
            gemm(n, n, n, key, dt, f"matmul {n}x{n} {key}")
    for m, k, n in gemms:
        gemm(m, k, n, "fp32", torch.float32, f"matmul [{m},{k}]x[{k},{n}] fp32")
    stream_pack = 2 / (1 / bw + 1 / wbw_used)  # read at bw, written at the write bandwidth
    pack_bw = None
    if not gpu:
        # the packing pass's own rate: a GEMM with a few rows (its multiply a tenth of its time)
        # and a [k, n] operand beyond the caches, rows 8 KiB apart
        pm, pk_, pn = PACK_GEMM
        a = torch.randn(pm, pk_, device=dev)
        b = torch.randn(pk_, pn, device=dev)
        label = f"packing: matmul [{pm},{pk_}]x[{pk_},{pn}] fp32"
        pack_mm = compiled(lambda a, b: a @ b)  # (a code object of its own: dynamo recompiles a
        # function for each new shape up to 8 times, then runs it eagerly with a warning)
        t_pack = measure_rate(pack_mm, a, b, min_run_time=min_run_time, cpu_bound=True, log=log, label=label)

    def net_rate(m: int, k: int, n: int, item: int, t: dict, pack_rate: float | None) -> float:
        """A GEMM's FLOP/s over its time less its packing pass at ``pack_rate`` (on a CPU the BLAS
        packs b before multiplying, a pass that does not overlap the multiply: docs/roofline.md)."""
        pack = 0.0 if gpu else 2 * k * n * item / pack_rate
        return 2 * m * k * n / (t["min"] - pack if t["min"] > 2 * pack else t["min"])

    def rates_with(pack_rate: float | None) -> dict[str, float]:
        """The peak of each precision: the best :func:`net_rate` of its GEMMs."""
        out: dict[str, float] = {}
        for m, k, n, key, item, label, t in timed:
            out[key] = max(out.get(key, 0.0), net_rate(m, k, n, item, t, pack_rate))
        return out

    peak = rates_with(stream_pack)
    if not gpu:
        flops = 2 * pm * pk_ * pn
        t_mul = flops / peak["fp32"]
        # at most the streaming rate (b in a cache would pack faster than memory allows)
        nb = pk_ * pn * b.element_size()  # the operand packed: read once, written once
        pack_bw = min(stream_pack, 2 * nb / (t_pack["min"] - t_mul)) if t_pack["min"] > 2 * t_mul else stream_pack
        kernels.append({"kernel": label, "flops": flops, "bytes": 2 * nb, "written": nb,
                        "seconds": t_pack["min"], "median": t_pack["median"], "byte_per_s": pack_bw,
                        **_judged([t_pack])})
        log(f"{label}: packing at {pack_bw / 1e9:.2f} GB/s (read + written; streaming {stream_pack / 1e9:.2f})")
        peak = rates_with(pack_bw)
    for m, k, n, key, item, label, t in timed:
        rate = net_rate(m, k, n, item, t, pack_bw)
        kernels.append({"kernel": label, "flops": 2 * m * k * n, "bytes": (m * k + k * n + m * n) * item,
                        "seconds": t["min"], "median": t["median"], "flop_per_s": rate, **_judged([t])})
        log(f"{label}: {rate / 1e9:.1f} GFLOP/s")
    rates = transcendental_rates(dev, quick=quick, min_run_time=min_run_time, kernels=kernels, log=log)
    name = torch.cuda.get_device_name(dev) if gpu else (platform.processor() or platform.machine() or "cpu")
    log(f"read bandwidth {bw / 1e9:.2f} GB/s, write bandwidth {wbw / 1e9:.2f} GB/s")
    q = quality(kernels)
    if q["contended"]:
        log(f"WARNING: this machine stayed busy while {len(q['kernels'])} kernel(s) were timed "
            f"({'; '.join(q['reasons'])}): the rates may be far too low; calibrate again when it is idle")
    entry = {
        "name": f"{name} ({torch.get_num_threads()} threads, measured)" if not gpu else f"{name} (measured)",
        **peak,
        "bandwidth": bw,
        **({"write_bandwidth": wbw} if wbw < 0.95 * bw else {}),
        "transcendentals": rates,
        # a CPU core runs an op's dependent passes one after the other (docs/roofline.md)
        **({"serial_passes": True, "pack_bandwidth": pack_bw} if not gpu else {}),
        "source": "measured by symcost calibrate (torch.compile + torch.utils.benchmark)",
        "date": time.strftime("%Y-%m-%d"),
        "measured": {"kernels": kernels, "torch": torch.__version__, "threads": torch.get_num_threads()},
        "quality": q,
    }
    if efficiency:
        from symcost.hardware.calibrate_perf import efficiency as measure_efficiency

        entry["efficiency"] = measure_efficiency(entry, dev, quick=quick, min_run_time=min_run_time, log=log)
    return entry


def _judged(runs: list[dict]) -> dict:
    """A kernel's verdict over its :func:`measure_rate` results (a difference of two timings for
    a transcendental rate: contended when either was)."""
    shares = [r["other_cpu_share"] for r in runs if r.get("other_cpu_share") is not None]
    return {"rounds": max(r["rounds"] for r in runs), "spread": max(r["spread"] for r in runs),
            "other_cpu_share": max(shares) if shares else None,
            "contended": any(r["contended"] for r in runs),
            "reasons": sorted({x for r in runs for x in r["reasons"]})}

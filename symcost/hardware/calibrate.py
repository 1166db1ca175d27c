"""Calibrate this machine: peak matmul FLOP/s and memory bandwidth, measured with compiled kernels.

Every kernel is compiled with ``torch.compile`` (inductor) and timed with
``torch.utils.benchmark.Timer.blocked_autorange``; a kernel's time is the fastest block mean
(the least disturbed by other processes on a shared machine). Peaks are the best over several
kernels:

- peak FLOP/s per precision: large square matmuls, 2·n³ FLOPs each
  (``torch.utils.flop_counter``'s mm formula); on a CPU over the time left after the BLAS's
  packing of the [k, n] operand (read and written once at the measured bandwidths), which the
  roofline adds back for every GEMM on such a device;
- bandwidth: large element-wise kernels (scale, add) and a full reduction (sum), bytes as
  symcost counts them (inputs read + outputs written, docs/conventions.md), on tensors several
  times the last-level cache. The reduction only reads: the best rate of the three is the
  streaming-read ``bandwidth``. On a CPU a written byte costs more (the cache line is first read:
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

The result is a device entry (:func:`symcost.hardware.devices.write_file` writes it as JSON) that every
``--devices-file`` option accepts.
"""
from __future__ import annotations

import platform
import time
from typing import Any, Callable

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
    for cls, name in TRANSCENDENTAL_KERNELS.items():
        f = getattr(torch, name)
        ts = []
        for k in ks:
            def g(a, f=f, k=k):
                out = f(a)
                for i in range(1, k):
                    out = out + f(a * (1 + 0.01 * i))
                return out
            torch._dynamo.reset()  # one compiled kernel per (class, k): stay below dynamo's recompile limit
            ts.append(measure(compiled(g), x, min_run_time=min_run_time)["min"])
        extra = (ks[1] - ks[0]) * n
        dt = ts[1] - ts[0]
        rate = extra / dt if dt > 0 else extra / ts[1]
        rates[cls] = rate
        if kernels is not None:
            kernels.append({"kernel": f"{name} x{ks[1]} - x{ks[0]} on {n} fp32", "transcendentals": extra,
                            "seconds": dt, "transcendental_per_s": rate})
        log(f"{name} ({cls}): {rate / 1e9:.2f} G/s")
    return rates


def calibrate(device: str = "cpu", quick: bool = False, min_run_time: float = 0.3,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this machine's peak matmul FLOP/s and memory bandwidth.

    Args:
        device: ``cpu`` or ``cuda``.
        quick: smaller kernels (a CI-sized calibration, a few seconds after compiling).
        min_run_time: seconds each kernel is timed for.
        log: called with a line per kernel measured.

    Returns:
        A device entry: ``name``, ``fp32`` (and ``bf16`` where measured) peak FLOP/s,
        ``bandwidth`` (byte/s), ``write_bandwidth`` (where lower), ``transcendentals``
        (evaluations/s per class, :func:`transcendental_rates`), ``source`` ("measured by symcost calibrate"), ``date``, and
        ``measured``: every kernel with its FLOPs, bytes, seconds and rate.

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
    streams = [  # (name, kernel, args, bytes read, bytes written)
        ("sum (reduction)", compiled(lambda a: a.sum()), (x,), numel * item, item),
        ("scale (x*2)", compiled(lambda a: a * 2.0), (x,), numel * item, numel * item),
        ("add (x+y)", compiled(lambda a, b: a + b), (x, y), 2 * numel * item, numel * item),
    ]
    times = {}
    for name, fn, args, rd, wr in streams:
        t = measure(fn, *args, min_run_time=min_run_time)
        times[name] = (t["min"], rd, wr)
        rate = (rd + wr) / t["min"]
        kernels.append({"kernel": f"{name} {numel} fp32", "flops": numel, "bytes": rd + wr, "written": wr,
                        "seconds": t["min"], "median": t["median"], "byte_per_s": rate})
        log(f"{name} on {numel * item / 2**20:.0f} MiB: {rate / 1e9:.2f} GB/s")
    bw = max((rd + wr) / t for t, rd, wr in times.values())
    # written bytes: what the write-heavy kernels take beyond reading their inputs at ``bw``
    wbw = max((wr / (t - rd / bw) if t > rd / bw else bw) for t, rd, wr in times.values() if wr > item)
    wbw = min(wbw, bw)
    wbw_used = wbw if wbw < 0.95 * bw else bw  # the entry keeps a write bandwidth only below 95%
    peak: dict[str, float] = {}
    mm = compiled(lambda a, b: a @ b)
    for key, dt in precisions.items():
        for n in mm_sizes:
            a = torch.randn(n, n, device=dev, dtype=dt)
            b = torch.randn(n, n, device=dev, dtype=dt)
            t = measure(mm, a, b, min_run_time=min_run_time)
            flops = 2 * n ** 3
            # on a CPU the BLAS packs b (read and written once) before multiplying, a pass that
            # does not overlap the multiply (docs/roofline.md): the peak is the multiply's rate
            pack = 0.0 if gpu else n * n * dt.itemsize * (1 / bw + 1 / wbw_used)
            rate = flops / (t["min"] - pack if t["min"] > 2 * pack else t["min"])
            kernels.append({"kernel": f"matmul {n}x{n} {key}", "flops": flops, "bytes": 3 * n * n * dt.itemsize,
                            "seconds": t["min"], "median": t["median"], "flop_per_s": rate})
            log(f"matmul {n}x{n} {key}: {rate / 1e9:.1f} GFLOP/s")
            peak[key] = max(peak.get(key, 0.0), rate)
    rates = transcendental_rates(dev, quick=quick, min_run_time=min_run_time, kernels=kernels, log=log)
    name = torch.cuda.get_device_name(dev) if gpu else (platform.processor() or platform.machine() or "cpu")
    log(f"read bandwidth {bw / 1e9:.2f} GB/s, write bandwidth {wbw / 1e9:.2f} GB/s")
    return {
        "name": f"{name} ({torch.get_num_threads()} threads, measured)" if not gpu else f"{name} (measured)",
        **peak,
        "bandwidth": bw,
        **({"write_bandwidth": wbw} if wbw < 0.95 * bw else {}),
        "transcendentals": rates,
        # a CPU core runs an op's dependent passes one after the other (docs/roofline.md)
        **({"serial_passes": True} if not gpu else {}),
        "source": "measured by symcost calibrate (torch.compile + torch.utils.benchmark)",
        "date": time.strftime("%Y-%m-%d"),
        "measured": {"kernels": kernels, "torch": torch.__version__, "threads": torch.get_num_threads()},
    }

"""Measure a device's efficiency parameters (:mod:`symcost.hardware.efficiency`) on microbenchmarks.

Only microbenchmarks, never a model's training step (the steps ``symcost validate --steps``
checks are not among them):

- **GEMM sweep** (:data:`GEMM_SWEEP`, eager ``torch.mm`` per precision): each shape's time less its
  launch and (CPU) packing pass, against the peak; ``gemm_max`` (per precision) and
  ``gemm_half`` minimise the squared log error of :meth:`Efficiency.gemm` over the sweep (a grid
  over ``gemm_half``, ``gemm_max`` the geometric mean of the ratios at each);
- **bandwidth**: eager ``add`` on 64 MiB operands (a CPU: beyond the last-level cache) over the
  device's calibrated bandwidth: ``memory``;
- **copies**: a transposing copy's rate (:func:`copy_rate`): ``copy_bandwidth``;
- **launch overhead**: an eager chain of tiny ops with autograd (forward and backward), its time
  over the aten ops it dispatches (counted by a dispatch mode): ``launch_eager``; a compiled
  one-kernel function's call: ``launch_compiled``;
- **host work of an eager step** (:func:`host_per_op`): a tiny ``nn.Module`` transformer stack's
  forward, and its forward and backward, over the aten ops of each phase: ``host_forward``,
  ``host_backward`` (Python, module calls, dispatch, autograd; on a GPU the launches too);
- **kernel boundaries** (:func:`kernel_gap`, a GPU): back-to-back tiny kernels queued behind a sleep
  on the stream, CUDA events around them: ``kernel_gap`` (a CPU: 0, its kernels run inside the op);
- **optimizer**: ``torch.optim.AdamW(foreach=True).step()`` over many small and over a few large
  synthetic tensors: two equations in ``optimizer_per_tensor`` and ``optimizer_per_byte``.

Each time is the median CPU time per call over timed blocks (:func:`cpu_time`; on a CPU device
the kernels run on one thread: ``symcost calibrate --threads 1``).
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable

#: GEMM shapes (m, k, n) of the sweep: square, skinny, short-k and wide, 32 to 2048; none is a
#: training step's (the validation's models are built at other widths)
GEMM_SWEEP = ((32, 1024, 1024), (64, 512, 2048), (128, 128, 128), (192, 768, 192), (256, 256, 256),
              (256, 2048, 64), (384, 96, 1536), (512, 512, 512), (768, 3072, 96), (1024, 1024, 1024),
              (1536, 256, 1536), (2048, 32, 2048), (1024, 4096, 256), (2048, 2048, 2048))
QUICK_SWEEP = ((64, 512, 2048), (128, 128, 128), (256, 2048, 64), (512, 512, 512), (1024, 1024, 1024))
#: a GPU's sweep: sizes where launch overhead no longer dominates, across wave counts of 100-150 SMs
GPU_SWEEP = ((256, 4096, 4096), (1024, 1024, 1024), (2048, 8192, 2048), (4096, 4096, 4096), (4096, 512, 4096),
             (8192, 8192, 8192), (1664, 4096, 1664), (8192, 128, 8192), (384, 12288, 3072), (16384, 2048, 1024))


def cpu_time(fn: Callable, *args, min_run_time: float = 0.3, min_runs: int = 5) -> dict:
    """``{"median", "wall_median", "runs"}``: seconds of CPU time this process spends per call of
    ``fn(*args)`` (``time.process_time``), and its wall time, medians over timed blocks after one
    warm-up call. A block is as many calls as take about 10 ms, so a tiny op is timed in bulk.

    CPU time, not wall time: on a machine shared with other processes a single-threaded kernel
    waits for a core, which wall time counts and CPU time does not (docs/performance-model.md,
    "Timing on a shared machine"). With one torch thread the kernel runs on the calling thread.
    """
    import time

    fn(*args)
    t0 = time.perf_counter()
    fn(*args)
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(0.01 / once))
    cpu, wall = [], []
    start = time.perf_counter()
    while len(cpu) < min_runs or time.perf_counter() - start < min_run_time:
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(inner):
            fn(*args)
        cpu.append((time.process_time() - c0) / inner)
        wall.append((time.perf_counter() - w0) / inner)
    return {"median": statistics.median(cpu), "wall_median": statistics.median(wall), "runs": len(cpu) * inner}


#: set by :func:`efficiency` for a GPU: time wall clock with a synchronize after each call (a GPU
#: kernel's time is not this process's CPU time)
_GPU = {"on": False}


def _median(fn: Callable, *args, min_run_time: float) -> float:
    if _GPU["on"]:
        import torch

        def synced(*a):
            fn(*a)
            torch.cuda.synchronize()

        return cpu_time(synced, *args, min_run_time=min_run_time)["wall_median"]
    return cpu_time(fn, *args, min_run_time=min_run_time)["median"]


def launch_eager(dev, min_run_time: float = 0.3) -> dict:
    """Seconds per aten op of an eager step: a chain of 64 tiny ops (mul, add, view) on an
    8-element tensor that needs its gradient, forward and backward, timed and divided by the aten
    ops it runs (a TorchDispatchMode counts them, as the trace counts a step's ops)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(8, device=dev, requires_grad=True)

    def chain():
        y = x
        for _ in range(16):
            y = (y * 1.0001 + 0.001).view(2, 4).view(8)
        y.sum().backward()

    count = [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            count[0] += 1
            return func(*a, **(kw or {}))

    with _Count():
        chain()
    t = _median(chain, min_run_time=min_run_time)
    return {"seconds": t, "ops": count[0], "per_op": t / count[0]}


#: the host microbenchmark's stack (:func:`host_per_op`): blocks, width, batch, length; tiny, so the
#: kernels' own work is negligible next to the host's, and no model the validation times
HOST_STACK = {"blocks": 6, "width": 8, "batch": 2, "length": 4}


def _host_stack(dev):
    """A tiny pre-norm transformer stack of ``nn.Module`` blocks (LayerNorm, Linear, split, head
    views and transposes, causal SDPA, dropout, GELU, residuals) and its input: the module calls,
    dispatch and autograd of an eager step, on tensors too small for their kernels to matter."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, -1)
            q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.drop(self.o(a.transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))

    c = HOST_STACK
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[Block(c["width"]) for _ in range(c["blocks"])]).to(dev)
    return m, torch.randn(c["batch"], c["length"], c["width"], device=dev)


def host_per_op(dev, min_run_time: float = 0.3) -> dict:
    """Host seconds per aten op of an eager step's forward and of its backward: the forward (and
    a mean-square loss) of :func:`_host_stack`, then forward and ``backward()``, timed in this
    process's CPU time (:func:`cpu_time`; a GPU's kernels run elsewhere, so on ``cuda`` this is
    the host's time alone, launches included), each phase's time over the aten ops a
    TorchDispatchMode counts in it (the ops a trace records). The kernels of tensors this small
    are a negligible part on a CPU. Returns ``{"host_forward", "host_backward", "ops": {forward,
    backward}, "seconds": {forward, forward_backward}}``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    m, x = _host_stack(dev)
    count = {"forward": 0, "backward": 0}

    class _Count(TorchDispatchMode):
        def __init__(self, phase):
            super().__init__()
            self.phase = phase

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            count[self.phase] += 1
            return func(*a, **(kw or {}))

    def fwd():
        return m(x).square().mean()

    def fwd_bwd():
        for p in m.parameters():
            p.grad = None
        fwd().backward()

    with _Count("forward"):
        loss = fwd()
    with _Count("backward"):
        loss.backward()
    timer = (lambda f: cpu_time(f, min_run_time=min_run_time)["median"])
    tf, tfb = timer(fwd), timer(fwd_bwd)
    return {"host_forward": tf / count["forward"], "host_backward": max(0.0, tfb - tf) / count["backward"],
            "ops": dict(count), "seconds": {"forward": tf, "forward_backward": tfb}}


def launch_compiled(dev, min_run_time: float = 0.3) -> float:
    """Seconds of one call of a compiled one-kernel function on a tiny tensor (its launch and the
    compiled graph's guards)."""
    import torch

    x = torch.randn(8, device=dev)
    f = torch.compile(lambda a: a * 2.0 + 1.0, dynamic=False)
    f(x)
    return _median(f, x, min_run_time=min_run_time)


def kernel_gap(dev, kernels: int = 2000, rounds: int = 5) -> dict:
    """Device seconds per kernel of back-to-back tiny kernels (docs/performance-model.md, "Kernel
    boundaries on the device"): ``kernels`` in-place adds on a 1-element tensor queued on the
    stream behind ``torch.cuda._sleep`` (so the host has queued them all before the device reaches
    the first: the host's launch time is not in the measure), timed with CUDA events recorded after
    the sleep and after the last kernel; the median over ``rounds`` per kernel is ``kernel_gap``
    (the kernel's own work, 4 bytes, is nanoseconds: the rest is the kernel boundary the model
    adds per eager kernel). The same chain captured in a CUDA graph and replayed the same way gives
    ``graph`` (reported, not used: symcost has no CUDA-graph mode). Returns ``{"kernel_gap",
    "graph", "kernels", "stream_rounds", "graph_rounds"}`` (seconds); on a CPU (whose kernels run
    inside the op: no device-side boundary) ``kernel_gap`` 0.0 and nothing timed.

    Raises:
        SymcostError: the host did not queue the kernels within the longest sleep tried.
    """
    import time

    import torch

    from symcost.errors import SymcostError

    if dev.type != "cuda":
        return {"kernel_gap": 0.0, "graph": None, "kernels": 0, "stream_rounds": [], "graph_rounds": []}
    x = torch.zeros(1, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def chain():
        for _ in range(kernels):
            x.add_(1.0)

    def sleep_seconds(cycles: int) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    chain()
    torch.cuda.synchronize()
    per_cycle = sleep_seconds(1 << 24) / (1 << 24)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # (warm-up on the capturing stream)
        with torch.cuda.graph(g, stream=side):
            chain()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def timed(run, hold: float) -> float:
        for _ in range(4):  # a sleep long enough that the host has queued everything before it ends
            torch.cuda._sleep(max(1, int(hold / per_cycle)))
            t0 = time.perf_counter()
            start.record()
            run()
            end.record()
            queued = time.perf_counter() - t0
            end.synchronize()
            if queued < 0.5 * hold:
                return start.elapsed_time(end) / 1e3 / kernels
            hold *= 4
        raise SymcostError(f"kernel_gap: the host took {queued:.3f} s to queue {kernels} kernels, longer than "
                           f"the device's sleep of {hold / 4:.3f} s: the device-side time cannot be isolated")

    stream = [timed(chain, 0.05) for _ in range(rounds)]
    graph = [timed(g.replay, 0.01) for _ in range(rounds)]
    return {"kernel_gap": statistics.median(stream), "graph": statistics.median(graph), "kernels": kernels,
            "stream_rounds": stream, "graph_rounds": graph}


def gemm_sweep(dev, precisions: dict, shapes=GEMM_SWEEP, min_run_time: float = 0.2,
               log: Callable[[str], None] | None = None) -> list[dict]:
    """Eager ``torch.mm`` of every shape at every precision: ``[{m, k, n, precision, seconds}]``."""
    import torch

    log = log or (lambda s: None)
    out = []
    for key, dt in precisions.items():
        for m, k, n in shapes:
            a = torch.randn(m, k, device=dev, dtype=dt)
            b = torch.randn(k, n, device=dev, dtype=dt)
            t = _median(torch.mm, a, b, min_run_time=min_run_time)
            out.append({"m": m, "k": k, "n": n, "precision": key, "seconds": t, "itemsize": dt.itemsize})
            log(f"eager mm [{m},{k}]x[{k},{n}] {key}: {2 * m * k * n / t / 1e9:.1f} GFLOP/s")
    return out


def fit_gemm(sweep: list[dict], peak: dict[str, float], launch: float, pack: Callable[[dict], float],
             units: int = 1, tile: tuple[int, int] = (1, 1)) -> dict:
    """``gemm_max`` per precision and ``gemm_half`` from a sweep: the measured efficiency of each
    GEMM is 2mkn / ((seconds - launch - pack(row)) · peak); the model's
    (:meth:`Efficiency.gemm`) at a ``gemm_half`` of the grid 1..1024 (log-spaced) and ``gemm_max``
    the geometric mean of measured / modelled-without-it; the grid point of least squared log
    error wins. Returns ``{"gemm_max", "gemm_half", "rms_log_error", "rows"}``."""
    from symcost.hardware.efficiency import Efficiency

    rows = []
    for r in sweep:
        t = r["seconds"] - launch - pack(r)
        if t <= 0:
            t = r["seconds"]
        rows.append({**r, "measured_efficiency": 2 * r["m"] * r["k"] * r["n"] / (t * peak[r["precision"]])})
    best = None
    for i in range(41):
        h = 2 ** (i / 4)
        e0 = Efficiency(compute_units=units, tile=tile, gemm_max={}, gemm_half=h)
        gm, err = {}, 0.0
        for key in sorted({r["precision"] for r in rows}):
            rs = [r for r in rows if r["precision"] == key]
            logs = [math.log(r["measured_efficiency"] / (e0.gemm(r["m"], r["n"], r["k"], 1, key) / 0.8)) for r in rs]
            gm[key] = min(1.0, math.exp(statistics.fmean(logs)))
            err += sum((x - math.log(gm[key])) ** 2 for x in logs)
        rms = math.sqrt(err / len(rows))
        if best is None or rms < best["rms_log_error"]:
            best = {"gemm_max": gm, "gemm_half": h, "rms_log_error": rms}
    e = Efficiency(compute_units=units, tile=tile, gemm_max=best["gemm_max"], gemm_half=best["gemm_half"])
    for r in rows:
        r["model_efficiency"] = e.gemm(r["m"], r["n"], r["k"], 1, r["precision"])
    best["rows"] = rows
    return best


def optimizer_costs(dev, min_run_time: float = 0.3) -> dict:
    """``optimizer_per_tensor`` and ``optimizer_per_byte`` of ``AdamW(foreach=True).step()``:
    timed over 256 tensors of 256 fp32 elements (the per-tensor cost) and over 4 tensors of
    2^21 elements (32 MiB: the per-byte cost), solved as two linear equations."""
    import torch

    def case(n_tensors, numel):
        ps = [torch.nn.Parameter(torch.randn(numel, device=dev)) for _ in range(n_tensors)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4, foreach=True)
        opt.step()
        return _median(opt.step, min_run_time=min_run_time), n_tensors, n_tensors * numel * 4

    t1, n1, b1 = case(256, 256)
    t2, n2, b2 = case(4, 1 << 21)
    per_byte = max(0.0, (t2 - t1 * n2 / n1) / (b2 - b1 * n2 / n1))
    per_tensor = max(0.0, (t1 - per_byte * b1) / n1)
    return {"optimizer_per_tensor": per_tensor, "optimizer_per_byte": per_byte,
            "cases": [{"tensors": n1, "bytes": b1, "seconds": t1}, {"tensors": n2, "bytes": b2, "seconds": t2}]}


def memory_fraction(dev, bandwidth: float, write_bandwidth: float | None, min_run_time: float = 0.3) -> dict:
    """Eager ``a + b`` on 2^24-element fp32 operands (64 MiB each; 2^28, 1 GiB, on a GPU): its time against the
    device's memory time for its bytes (read at ``bandwidth``, written at ``write_bandwidth``)."""
    import torch

    n = 1 << (28 if dev.type == "cuda" else 24)  # 1 GiB on a GPU (beyond its L2), 64 MiB on a CPU
    a, b = torch.randn(n, device=dev), torch.randn(n, device=dev)
    out = torch.empty_like(a)
    t = _median(lambda: torch.add(a, b, out=out), min_run_time=min_run_time)
    ideal = 2 * n * 4 / bandwidth + n * 4 / (write_bandwidth or bandwidth)
    return {"seconds": t, "ideal": ideal, "memory": min(1.0, ideal / t)}


def copy_rate(dev, min_run_time: float = 0.3) -> dict:
    """byte/s (read + written) of a transposing copy, ``m.t().contiguous()`` of a [1024, 512]
    fp32 matrix (2 MiB): the layout change a training step's ``copy_``/``clone`` ops make (a
    permuted activation made contiguous, a gradient written into a transposed weight's layout)."""
    import torch

    m = torch.randn(1024, 512, device=dev)
    t = _median(lambda: m.t().contiguous(), min_run_time=min_run_time)
    return {"seconds": t, "bytes": 2 * m.numel() * 4, "copy_bandwidth": 2 * m.numel() * 4 / t}


def efficiency(entry: dict, dev, quick: bool = False, min_run_time: float = 0.3,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``efficiency`` table of a calibrated device entry (:func:`symcost.hardware.calibrate.calibrate`'s
    result: its peaks, bandwidths and packing rate), measured on this machine.

    Returns:
        The table (:mod:`symcost.hardware.efficiency`'s keys, ``source``, and ``fit``: the sweep's
        rows with measured and modelled efficiency, the launch, bandwidth and optimizer cases).
    """
    import torch

    log = log or (lambda s: None)
    gpu = dev.type == "cuda"
    _GPU["on"] = gpu
    try:
        return _efficiency(entry, dev, gpu, quick, min_run_time, log)
    finally:
        _GPU["on"] = False


def _efficiency(entry: dict, dev, gpu: bool, quick: bool, min_run_time: float, log: Callable[[str], None]) -> dict:
    import torch

    launch = launch_eager(dev, min_run_time)
    log(f"eager launch: {launch['per_op'] * 1e6:.2f} us per aten op ({launch['ops']} ops)")
    host = host_per_op(dev, min_run_time)
    log(f"eager host work: {host['host_forward'] * 1e6:.2f} us per forward aten op, "
        f"{host['host_backward'] * 1e6:.2f} us per backward aten op ({host['ops']})")
    lc = launch_compiled(dev, min_run_time)
    log(f"compiled call: {lc * 1e6:.2f} us")
    gap = kernel_gap(dev)
    if gpu:
        log(f"kernel boundary: {gap['kernel_gap'] * 1e6:.2f} us per back-to-back kernel on the stream, "
            f"{gap['graph'] * 1e6:.2f} us in a CUDA graph")
    mem = memory_fraction(dev, entry["bandwidth"], entry.get("write_bandwidth"), min_run_time)
    log(f"eager add: {100 * mem['memory']:.0f}% of the calibrated bandwidth")
    cp = copy_rate(dev, min_run_time)
    log(f"transposing copy: {cp['copy_bandwidth'] / 1e9:.1f} GB/s")
    precisions = {k: getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[k])
                  for k in ("fp32", "bf16", "fp16") if k in entry and (gpu or k != "fp16")}
    shapes = GPU_SWEEP[::2] if gpu and quick else GPU_SWEEP if gpu else QUICK_SWEEP if quick else GEMM_SWEEP
    sweep = gemm_sweep(dev, precisions, shapes, min_run_time=min_run_time / 2, log=log)

    def pack(r):  # the sweep times whole GEMMs, a CPU BLAS's packing pass included: the
        return 0.0  # efficiency covers it (the performance model adds no packing term)

    cc = None
    if gpu:
        units = torch.cuda.get_device_properties(dev).multi_processor_count
        tile = (128, 128)
        cc = "%d.%d" % torch.cuda.get_device_capability(dev)  # its attention kernels (hardware/attention.py)
    else:
        units, tile = 1, (1, 1)  # one thread's BLAS: no waves to quantise (threads: docs/performance-model.md)
    for key in precisions:  # a GEMM of the sweep faster than the calibrated peak raises it (a busy moment
        # can only slow a kernel: the best rate seen is the better estimate of the peak)
        best = max(2 * r["m"] * r["k"] * r["n"] / r["seconds"] for r in sweep if r["precision"] == key)
        if best > entry[key]:
            log(f"eager GEMMs ran at {best / 1e9:.1f} GFLOP/s {key}, above the calibrated {entry[key] / 1e9:.1f}: "
                "the peak is raised to it")
            entry[key] = best
    g = fit_gemm(sweep, {k: entry[k] for k in precisions}, launch["per_op"], pack, units, tile)
    log(f"GEMM fit: gemm_max {', '.join(f'{k} {v:.3f}' for k, v in g['gemm_max'].items())}, "
        f"gemm_half {g['gemm_half']:.1f}, rms log error {g['rms_log_error']:.3f}")
    opt = optimizer_costs(dev, min_run_time)
    log(f"AdamW foreach: {opt['optimizer_per_tensor'] * 1e6:.1f} us per tensor, "
        f"{opt['optimizer_per_byte'] * 1e12:.1f} ps per byte")
    return {
        **({"compute_capability": cc} if cc else {}),
        "compute_units": units, "tile": list(tile), "gemm_max": g["gemm_max"], "gemm_half": g["gemm_half"],
        "memory": mem["memory"], "copy_bandwidth": cp["copy_bandwidth"], "launch_eager": launch["per_op"], "launch_compiled": lc,
        "host_forward": host["host_forward"], "host_backward": host["host_backward"],
        # (a GPU: its host time per op includes the launch, and the host runs ahead of the stream)
        **({"host_launch": 0.0, "host_async": True} if gpu else {}),
        "optimizer_per_tensor": opt["optimizer_per_tensor"], "optimizer_per_byte": opt["optimizer_per_byte"],
        "kernel_gap": gap["kernel_gap"],
        "source": f"measured by symcost calibrate (microbenchmarks: eager GEMM sweep, add, op chain, AdamW; "
                  f"{torch.get_num_threads()} threads; collective_latency not measured: default)",
        "fit": {"gemm_rows": g["rows"], "gemm_rms_log_error": g["rms_log_error"], "launch": launch,
                "memory": mem, "copy": cp, "optimizer": opt["cases"], "host": host, "kernel_gap": gap},
    }


def measured_device(quick: bool = True, min_run_time: float = 0.2, log: Callable[[str], None] | None = None) -> dict:
    """A CPU device entry from these microbenchmarks alone (no compiled kernels: seconds, where
    :func:`symcost.hardware.calibrate.calibrate` compiles for minutes on a busy machine): the
    read bandwidth of an eager ``a + b`` on 64 MiB operands (bytes read + written over its CPU
    time), the peaks the GEMM sweep's best rates (:func:`efficiency` raises them from 1 FLOP/s),
    and the ``efficiency`` table. What the timing test validates steps against."""
    import torch

    dev = torch.device("cpu")
    n = 1 << 24
    a, b = torch.randn(n), torch.randn(n)
    out = torch.empty_like(a)
    t = _median(lambda: torch.add(a, b, out=out), min_run_time=min_run_time)
    entry = {"name": f"this CPU ({torch.get_num_threads()} threads, microbenchmarks)", "fp32": 1.0, "bf16": 1.0,
             "bandwidth": 3 * n * 4 / t, "source": "symcost.hardware.calibrate_perf.measured_device",
             "measured": {"threads": torch.get_num_threads(), "torch": torch.__version__}}
    entry["efficiency"] = efficiency(entry, dev, quick=quick, min_run_time=min_run_time, log=log)
    return entry


#: message sizes (bytes, fp32 buffers) of the all-reduce microbenchmark: 4 KiB to 8 MiB
ALLREDUCE_SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 21, 1 << 23)


def fit_alpha_beta(points: dict[int, float], ranks: int) -> dict:
    """``{"alpha", "beta", "rms_rel_error"}`` of a ring all-reduce from ``{bytes: seconds}``: the
    least-squares line t = a + b·B, read through the alpha-beta model (Hockney 1994; Thakur,
    Rabenseifner & Gropp 2005, Table 1) t = 2(n-1)·alpha + 2(n-1)/n · B / beta, so alpha =
    a / (2(n-1)) seconds per step and beta = 2(n-1) / (n·b) byte/s per direction (what
    :meth:`symcost.hardware.efficiency.Efficiency.collective_seconds` prices with).

    Raises:
        SymcostError: fewer than two sizes, fewer than two ranks, or a non-increasing time.
    """
    from symcost.errors import SymcostError

    n = int(ranks)
    if n < 2 or len(points) < 2:
        raise SymcostError("an alpha-beta fit needs two ranks or more and two message sizes or more")
    xs, ys = zip(*sorted(points.items()))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = max(0.0, my - b * mx)
    if b <= 0:
        raise SymcostError(f"all-reduce times do not grow with the message size ({dict(points)}): no bandwidth to fit")
    rms = math.sqrt(statistics.fmean(((a + b * x) / y - 1) ** 2 for x, y in zip(xs, ys)))
    return {"alpha": a / (2 * (n - 1)), "beta": 2 * (n - 1) / (n * b), "rms_rel_error": rms}


def _allreduce_worker(rank: int, world: int, store: str, sizes, reps: int, queue) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        out = {}
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            for _ in range(3):
                dist.all_reduce(t)
            ts = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                ts.append(time.perf_counter() - t0)
            out[nbytes] = statistics.median(ts)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def collective_alpha_beta(ranks: int = 2, sizes=ALLREDUCE_SIZES, reps: int = 15) -> dict:
    """Measure a gloo all-reduce on this machine: ``ranks`` processes (one torch thread each) on
    one host, rendezvous through a file store, each size all-reduced ``reps`` times after three
    warm-up calls and a barrier before each (wall time, rank 0's median per size); then
    :func:`fit_alpha_beta`. Returns ``{"alpha", "beta", "rms_rel_error", "seconds": {bytes: s},
    "ranks", "backend": "gloo"}``. A microbenchmark of the collective alone: the data-parallel
    steps validated with it never run here (docs/performance-model.md)."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    fd, store = tempfile.mkstemp(prefix="symcost-gloo-")
    os.close(fd)
    os.unlink(store)
    try:
        mp.start_processes(_allreduce_worker, args=(ranks, store, tuple(sizes), reps, q), nprocs=ranks,
                           start_method="spawn")
        seconds = q.get()
    finally:
        if os.path.exists(store):
            os.unlink(store)
    return {**fit_alpha_beta(seconds, ranks), "seconds": seconds, "ranks": ranks, "backend": "gloo"}

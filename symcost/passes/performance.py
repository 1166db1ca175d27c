"""The performance model: a training step's predicted time, beside the roofline's lower bound.

Takes an :class:`~symcost.graph.analysis.Analysis`, a :class:`~symcost.hardware.devices.Device`
(its peaks, bandwidths and its ``efficiency`` table, :mod:`symcost.hardware.efficiency`) and
sizes; returns plain data. Each traced op, times its repeat, costs (docs/performance-model.md):

- a GEMM (``aten.mm``, ``addmm``, ``bmm``, ``baddbmm``: ``[b] [m, k] x [k, n]``): FLOPs / (peak ·
  :meth:`Efficiency.gemm`\\ (m, n, k, b)), the shape's efficiency (wave and tile quantisation,
  small dimensions), at least its memory time at the achievable bandwidth (a CPU BLAS's packing
  pass is part of the efficiency the calibration's eager GEMM sweep measures, not a term of its own);
- a fused attention kernel on a CUDA GPU (the efficiency's ``compute_capability`` set): the kernel
  PyTorch's SDPA dispatcher picks there (flash, memory-efficient or math:
  :func:`symcost.hardware.attention.sdpa_backend`, from the op's dtype, head dims, lengths, causal
  flag and mask) at its published rate by phase, head dim, causal mask and length
  (:func:`symcost.hardware.attention.attention_efficiency`: FlashAttention-2 on H100 from the
  FlashAttention-3 paper, scaled to the FlashAttention-2 paper's A100 figure), the causal kernel
  computing only the unmasked score pairs; the math path its matmuls at the GEMM efficiency plus
  the score matrix's passes through memory;
- another op with model FLOPs (convolution, fused attention off a CUDA GPU): FLOPs / (peak · gemm_max);
- a layout copy (``copy_``, ``clone``, ``contiguous``) of an eager step: its bytes at
  ``copy_bandwidth`` (a transposing copy's measured rate);
- any other op: the roofline's time of the op (:meth:`Device.op_seconds`: all FLOPs at the peak,
  special functions at their rate) with its bytes at ``memory`` x the bandwidth;
- the host's work, eager: per traced aten op of a phase (views included: each is dispatched, and
  autograd records it) :meth:`Efficiency.host_per_op` (``host_forward``/``host_backward``, else
  ``launch_eager``), plus ``host_launch`` per op that runs a kernel on a device the host launches
  kernels on; compiled: ``launch_compiled`` per kernel (the ops that move bytes after fusion,
  :mod:`symcost.graph.fusion`: an estimate of inductor's kernels), added;
- the device's time at each kernel boundary of an eager step: ``kernel_gap`` per op that runs a
  kernel (moves bytes or does FLOPs), added to its phase's device seconds — a kernel launched on a
  stream starts only after the previous one has finished and its launch has been processed, even
  when the host has queued it long before (Hazy Research, "Look Ma, No Bubbles!", 2025: 2.1 us per
  kernel on an H100, 1.3 us under CUDA graphs); 0 where the device has no figure. A compiled step
  keeps ``launch_compiled`` per kernel instead (one figure for the kernel's launch, host and device);
- the optimizer step (AdamW, foreach): ``optimizer_per_tensor`` x parameter tensors (host) +
  ``optimizer_per_byte`` x parameter bytes (the analysis does not trace it; measured on its own
  microbenchmark).

How host and device time combine (:func:`host_stretches`, docs/performance-model.md, "Host
overhead"): on a device without ``host_async`` (a CPU: one thread dispatches and computes) the step
is the sum of every term; on an asynchronous device (a GPU's stream) the host issues the forward
and the backward ahead of the device with no synchronisation between them, so the two phases are
one queue — the forward ends at max(host_f, device_f), the backward at max(that + device_b,
host_f + host_b) — and the optimizer step is a stretch of its own, max(per-tensor host time,
per-byte device time). The ``launch`` term is the host time the device does not hide. Nothing
here prints; the roofline pass is not changed by it.
"""
from __future__ import annotations

from typing import Any, Mapping

from symcost.graph.opsets import ROW_NORMALISING, dtype_names, itemsize, numel
from symcost.hardware import attention as attn
from symcost.hardware.devices import Device, dtype_key
from symcost.hardware.efficiency import Efficiency, default_efficiency
from symcost.passes.roofline import _num, op_precision, roofline, training_precision

#: ops that copy a tensor into another layout: timed at the efficiency's ``copy_bandwidth``
COPIES = {"aten.copy_", "aten.clone", "aten.contiguous"}
#: GEMM packets -> (index of the [.., m, k] operand, index of the [.., k, n] operand)
GEMMS = {"aten.mm": (0, 1), "aten.addmm": (1, 2), "aten.bmm": (0, 1), "aten.baddbmm": (1, 2)}
MODES = ("eager", "compiled")
#: fused attention kernels -> (phase, index of q, layout): BHSD (SDPA's ops) or BSHD (the raw kernels)
ATTENTION = {
    **{f"aten._scaled_dot_product_{k}": ("forward", 0, "bhsd")
       for k in ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention")},
    **{f"aten._scaled_dot_product_{k}_backward": ("backward", 1, "bhsd")
       for k in ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention")},
    "aten._flash_attention_forward": ("forward", 0, "bshd"), "aten._efficient_attention_forward": ("forward", 0, "bshd"),
    "aten._flash_attention_backward": ("backward", 1, "bshd"), "aten._efficient_attention_backward": ("backward", 1, "bshd"),
}
#: the figures a calibration measures: a prediction is "calibrated" when none of them is a default
MEASURED = {"gemm_max", "memory", "launch_eager"}


def efficiency_of(device: Device) -> Efficiency:
    """The device's efficiency table, or the labelled defaults where it has none."""
    return device.efficiency if device.efficiency is not None else default_efficiency(device)


def gemm_dims(op, env) -> tuple[int, int, int, int] | None:
    """``(m, n, k, batch)`` of a GEMM op at ``env`` (None for any other op)."""
    packet = op.name.rsplit(".", 1)[0] if op.name.count(".") >= 2 else op.name
    idx = GEMMS.get(packet)
    if idx is None or len(op.in_shapes) <= max(idx):
        return None
    a, b = op.in_shapes[idx[0]], op.in_shapes[idx[1]]
    if len(a) < 2 or len(b) < 2:
        return None
    m, k, n = _num(a[-2], env), _num(a[-1], env), _num(b[-1], env)
    batch = 1
    for d in a[:-2]:
        batch *= _num(d, env)
    return m, n, k, batch


def attention_seconds(op, env, device: Device, eff: Efficiency, precision: str) -> tuple[float, str] | None:
    """Seconds of one fused attention kernel ``op`` on a CUDA GPU and the backend that runs it
    (``"flash"``, ``"efficient"``, ``"math"``), None where the op is no fused attention kernel or
    the device has no ``compute_capability``.

    - flash / efficient: the kernel's FLOPs (:func:`symcost.hardware.attention.kernel_flops`, the
      recomputed scores included backward) times the fraction of score pairs a causal mask leaves
      (:func:`~symcost.hardware.attention.causal_fraction`), over ``attention_efficiency`` x the
      device's peak at ``precision``;
    - math (the explicit matmuls and softmax the dispatcher falls back to): Q·Kᵀ and P·V forward
      (backward the four gradient matmuls, no recomputation) at :meth:`Efficiency.gemm`, plus the
      [B, H, S_q, S_k] scores through memory: written, read and written by the softmax, read by
      P·V (4 passes) forward, 6 passes backward, at ``memory`` x the bandwidth.

    ``env``: the symbol values; shapes BHSD (SDPA's ops) or BSHD (the raw kernels).
    """
    packet = op.name.rsplit(".", 1)[0] if op.name.count(".") >= 2 else op.name
    spec = ATTENTION.get(packet)
    cc = eff.compute_capability
    if spec is None or cc is None or len(op.in_shapes) < spec[1] + 3:
        return None
    phase, qi, layout = spec
    q, k, v = (tuple(_num(d, env) for d in op.in_shapes[qi + j]) for j in range(3))
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return None
    if layout == "bshd":
        q, k, v = ((t[0], t[2], t[1], t[3]) for t in (q, k, v))
    b, h, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    causal, masked = getattr(op, "attn_flags", None) or (False, False)
    name = dtype_names(op.in_dtypes)[qi]
    dtype = dtype_key(name) or precision
    backend = attn.sdpa_backend(cc, dtype, d_qk, d_v, s_q, s_k, causal, masked)
    peak, _ = device.peak_for(dtype)
    if backend != "math":
        frac = attn.attention_efficiency(cc, phase, d_qk, causal, s_k)
        F = attn.kernel_flops(phase, b * h, s_q, s_k, d_qk, d_v) * attn.causal_fraction(s_q, s_k, causal)
        return F / (peak * frac), backend
    bh = b * h
    mms = ([(s_q, s_k, d_qk), (s_q, d_v, s_k)] if phase == "forward" else
           [(s_q, s_k, d_v), (s_k, d_v, s_q), (s_q, d_qk, s_k), (s_k, d_qk, s_q)])
    t = sum(2 * bh * m * n * kk / (peak * eff.gemm(m, n, kk, bh, dtype)) for m, n, kk in mms)
    scores = bh * s_q * s_k * itemsize(name)
    passes = 4 if phase == "forward" else 6
    return t + passes * scores / (device.bandwidth * eff.memory), backend


def host_stretches(host: Mapping[str, float], device: Mapping[str, float], opt_host: float = 0.0,
                   opt_device: float = 0.0, asynchronous: bool = False) -> dict[str, Any]:
    """How an eager step's host work and device work combine, per phase (docs/performance-model.md,
    "Host overhead").

    Args:
        host: ``{"forward", "backward"}`` seconds of host work (Python, dispatch, autograd, launches).
        device: ``{"forward", "backward"}`` seconds of the phases' kernels on the device.
        opt_host, opt_device: the optimizer step's host and device seconds.
        asynchronous: the host issues ops ahead of the device (a GPU stream; PyTorch's CUDA ops
            return before their kernel ran: Horace He, "Making Deep Learning Go Brrrr From First
            Principles", 2022, "Overhead").

    Returns:
        ``{"phase_overhead": {forward, backward}, "optimizer", "step"}``: seconds each phase takes
        beyond its device seconds; the optimizer step's seconds; the step's seconds.

        - synchronous (a CPU: one thread dispatches and runs each kernel): the sum, so
          phase_overhead = host and optimizer = opt_host + opt_device;
        - asynchronous: forward and backward are one stretch (no synchronisation between them in
          an eager step: ``loss.backward()`` queues behind the forward's kernels), a queue whose
          device cannot run an op before the host issued it: the forward ends at
          e_f = max(host_f, device_f), the backward at max(e_f + device_b, host_f + host_b); the
          optimizer step a stretch of its own after the synchronisations that precede it (a
          gradient-norm or loss ``.item()``): max(opt_host, opt_device). The first kernel's
          launch latency is not counted; the gaps between back-to-back kernels on the device are
          the caller's part of ``device`` (:func:`predict` adds ``kernel_gap`` per kernel).
    """
    hf, hb = float(host.get("forward", 0.0)), float(host.get("backward", 0.0))
    df, db = float(device.get("forward", 0.0)), float(device.get("backward", 0.0))
    if not asynchronous:
        over = {"forward": hf, "backward": hb}
        opt = opt_host + opt_device
    else:
        end_f = max(hf, df)
        end_b = max(end_f + db, hf + hb)
        over = {"forward": end_f - df, "backward": end_b - end_f - db}
        opt = max(opt_host, opt_device)
    return {"phase_overhead": over, "optimizer": opt, "step": df + db + sum(over.values()) + opt}


def predict(an, device: Device, sizes: Mapping[str, int] | None = None, mode: str = "eager",
            optimizer: bool = True) -> dict[str, Any]:
    """Predicted seconds of one training step of ``an`` at ``sizes`` on ``device``.

    Args:
        an: the Analysis (a training step).
        device: peaks (FLOP/s), bandwidths (byte/s) and ``efficiency``.
        sizes: symbol values (others at the model's defaults).
        mode: ``eager`` (unfused bytes, a launch per aten op) or ``compiled`` (fused bytes, a launch
            per fused kernel).
        optimizer: add the AdamW (foreach) step over the model's parameters.

    Returns:
        ``{"mode", "step_seconds" (predicted), "bound_seconds" (the roofline's, same bytes),
        "terms": {"gemm", "attention", "other_compute", "memory", "launch", "kernel_gap", "optimizer"}
        (seconds; ``launch``: the host time the device leaves exposed, all of it on a CPU;
        ``kernel_gap``: the device's time at the eager step's kernel boundaries),
        "ops", "launches", "params_tensors", "params_bytes", "host" and "device" {forward,
        backward, optimizer} (seconds of host work and of the device: its kernels and kernel
        boundaries), "kernels" {forward, backward} (an eager step's ops that run a kernel, repeats
        counted; 0 compiled), "kernel_gaps" {forward, backward} (their boundaries' seconds),
        "phase_overhead" {forward, backward} (what each phase takes beyond its ops' kernel
        seconds, the ``nodes``: its kernel boundaries and the exposed host time), "host_async",
        "precision", "model_flops",
        "mfu_predicted", "mfu_ceiling", "efficiency" (the table used), "calibrated" (False: one
        of :data:`MEASURED` is a default, not measured), "defaulted" (the figures taken
        from the defaults), "nodes": [{index, op, phase, repeat, seconds,
        efficiency (GEMMs), kind, kernel (fused attention on a
        CUDA GPU: flash, efficient or math)}]}``.

    Raises:
        SymcostError: bad sizes, an unknown mode, a device without a figure.
    """
    from symcost.errors import SymcostError
    from symcost.graph import fusion

    if mode not in MODES:
        raise SymcostError(f"unknown performance mode {mode!r}; accepted: {', '.join(MODES)}")
    eff = efficiency_of(device)
    env = an.bind(**(sizes or {}))
    fused = mode == "compiled"
    fe = fusion.estimate(an)
    train_key = training_precision(an, env)
    frac = eff.memory
    terms = {"gemm": 0.0, "attention": 0.0, "other_compute": 0.0, "memory": 0.0, "launch": 0.0, "optimizer": 0.0}
    nodes = []
    n_ops = n_launch = 0
    for op in an.ops:
        rep = _num(op.repeat, env)
        n_ops += rep
        Bx = _num(fe.node_bytes[op.index] if fused else op.cost.bytes, env)
        Wx = _num(fe.node_written[op.index] if fused else fusion.written_bytes(op), env)
        if not fused or Bx:
            n_launch += rep
        if op.cost.bytes == 0 and op.cost.flops_all == 0:
            continue
        key = op_precision(op, train_key)
        peak, _ = device.peak_for(key)
        F = _num(op.cost.flops_all, env)
        Fm = _num(op.cost.flops, env)
        read, written = (Bx - Wx) / frac, Wx / frac
        dims = gemm_dims(op, env) if Fm else None
        e = backend = None
        if dims is not None:
            m, n, k, b = dims
            e = eff.gemm(m, n, k, b, key)
            t_mem = device.memory_seconds(read, written)
            t_in = F / (peak * e)
            t, kind = max(t_mem, t_in), ("gemm" if t_in >= t_mem else "memory")
        elif Fm and (ka := attention_seconds(op, env, device, eff, key)) is not None:
            t_a, backend = ka
            t_mem = device.memory_seconds(read, written)
            t, kind = max(t_a, t_mem), ("attention" if t_a >= t_mem else "memory")
        elif Fm:
            t_c = F / (peak * eff.gemm_max_for(key))
            t_mem = device.memory_seconds(read, written)
            t, kind = max(t_c, t_mem), ("other_compute" if t_c >= t_mem else "memory")
        elif eff.copy_bandwidth and op.name.rsplit(".", 1)[0] in COPIES and not fused:
            t, kind = Bx / eff.copy_bandwidth, "memory"
        else:
            T = {c: _num(x, env) for c, x in op.cost.transcendentals.items()}
            t, res = device.op_seconds(F / peak, read, written, device.transcendental_seconds(T),
                                       op.name.rsplit(".", 1)[0] in ROW_NORMALISING)
            kind = "memory" if res == "memory" else "other_compute"
        terms[kind] += rep * t
        nodes.append({"index": op.index, "op": op.name, "phase": op.phase, "repeat": rep, "seconds": rep * t,
                      "kind": kind, **({"efficiency": e} if e is not None else {}),
                      **({"kernel": backend} if backend is not None else {})})
    kernels = {"forward": 0.0, "backward": 0.0}  # the device's seconds per phase
    for node in nodes:
        kernels["forward" if node["phase"] == "forward" else "backward"] += node["seconds"]
    host = {"forward": 0.0, "backward": 0.0}
    per_phase = {"forward": 0, "backward": 0}
    n_kernels = {"forward": 0, "backward": 0}  # ops that run a kernel (move bytes or do FLOPs; views do not)
    for op in an.ops:
        ph = "forward" if op.phase == "forward" else "backward"
        rep = _num(op.repeat, env)
        per_phase[ph] += rep
        if not fused:
            kernel = bool(op.cost.bytes != 0 or op.cost.flops_all != 0)
            n_kernels[ph] += rep if kernel else 0
            host[ph] += rep * (eff.host_per_op(ph) + (float(eff.host_launch or 0.0) if kernel else 0.0))
    if fused:  # a launch per fused kernel, spread over each phase's ops
        host = {ph: n_launch * eff.launch_compiled * k / max(1, n_ops) for ph, k in per_phase.items()}
    # each kernel boundary of an eager step on the device (kernel_gap: docs/performance-model.md,
    # "Kernel boundaries on the device"); a compiled step's launch_compiled per kernel stands for it
    gaps = {ph: n_kernels[ph] * float(eff.kernel_gap or 0.0) for ph in n_kernels}
    device_phase = {ph: kernels[ph] + gaps[ph] for ph in kernels}
    tensors = pbytes = 0
    frozen = getattr(an, "frozen", None) or set()
    for name, (shape, dtype, rep) in an.param_shapes.items():
        if name in frozen:  # (requires_grad=False: no gradient, torch.optim does not step it)
            continue
        r = _num(rep, env)
        tensors += r
        pbytes += r * _num(numel(shape), env) * itemsize(dtype_names([dtype])[0])
    opt_host = eff.optimizer_per_tensor * tensors if optimizer else 0.0
    opt_device = eff.optimizer_per_byte * pbytes if optimizer else 0.0
    stretch = host_stretches(host, device_phase, opt_host, opt_device, eff.host_async and not fused)
    terms["launch"] = sum(stretch["phase_overhead"].values())
    terms["kernel_gap"] = sum(gaps.values())
    terms["optimizer"] = stretch["optimizer"]
    # what each phase takes beyond its ops' kernel seconds: its kernel boundaries and exposed host time
    overhead = {ph: gaps[ph] + stretch["phase_overhead"][ph] for ph in gaps}
    step = sum(terms.values())
    rl = roofline(an, device, sizes, fused=fused, with_formulas=False)
    peak_train, _ = device.peak_for(train_key)
    model_flops = rl["model_flops"]
    return {"mode": mode, "step_seconds": step, "bound_seconds": rl["step_seconds"], "terms": terms,
            "ops": n_ops, "launches": n_launch, "params_tensors": tensors, "params_bytes": pbytes,
            "host": {**host, "optimizer": opt_host}, "device": {**device_phase, "optimizer": opt_device},
            "kernels": dict(n_kernels), "kernel_gaps": gaps,
            "phase_overhead": overhead, "host_async": bool(eff.host_async and not fused),
            "optimizer": "adamw-foreach" if optimizer else None, "precision": train_key,
            "model_flops": model_flops, "mfu_predicted": model_flops / (step * peak_train) if step else 0.0,
            "mfu_ceiling": rl["mfu_ceiling"], "efficiency": eff.to_json(), "calibrated": not (set(eff.defaulted) & MEASURED),
            "defaulted": list(eff.defaulted),
            "nodes": nodes}


def predict_dp(an, device: Device, sizes: Mapping[str, int] | None = None, overlap: str = "backward",
               nodes: int | None = None, devices_per_node: int | None = None, mode: str = "eager",
               megatron_args: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Predicted step of one data-parallel rank: the performance model's compute per phase
    (:func:`predict`; each phase's exposed host time, and the optimizer step with the backward) and the
    communication of :func:`symcost.passes.parallel.step_time`, each process group's bytes per rank
    over its link's bandwidth (FSDP2's padding included) plus alpha: every traced collective's
    latency steps (ring: 2(n-1) for an all-reduce, n-1 for the others, n the ranks of the group it
    runs over: DP·CP or DP·EP for FSDP2's, TP, EP, DP for the experts' FSDP2 group) times the
    efficiency's ``collective_latency`` (Hockney's alpha-beta, :meth:`Efficiency.collective_seconds`);
    the data-parallel groups under the same ``overlap`` rule as the bound, the TP and EP groups'
    on the critical path, and the CP ring's passes (each its bytes / bandwidth + (CP-1) alphas)
    overlapped with the performance model's attention blocks as PyTorch schedules the ring
    (:func:`symcost.passes.context_parallel.ring_exposure`; docs/parallel.md §15). Under
    Megatron-LM's engine (``megatron-*`` with ``--shard ddp|zero1``) the data-parallel groups'
    collectives are its buckets' (``step_time``'s ``buckets``,
    :func:`symcost.passes.megatron_buckets.engine`: one all-reduce, or reduce-scatter and
    all-gather, per bucket, α per ring step of each), not the trace's one per gradient, and
    with ``zero1`` (its distributed optimizer) the optimizer step runs over the busiest rank's
    shard (:func:`~symcost.passes.megatron_buckets.optimizer_shard`: its parameter tensors and
    bytes) instead of every parameter; and Megatron-LM's per-iteration work
    (:mod:`symcost.passes.megatron_iteration`: the gradient norm and clipping, the NaN checks, the
    main-parameter copies, the statistics' all-reduces and syncs, the logging the flags turn on)
    is added, the loss checks to the forward, the rest to the backward once per optimizer step.
    ``megatron_args``: the run's Megatron-LM flags (a command-line string,
    :func:`symcost.passes.megatron_iteration.parse_args`, or a dict of its keys); None: Megatron's
    defaults. Among them ``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend
    deepep|hybridep`` (or ``--moe-enable-deepep``) prices the EP group's exchanges as DeepEP's /
    HybridEP's route (``step_time``'s ``dispatcher``, :mod:`symcost.passes.hybrid_ep`); the
    traced all-to-alls' α are kept.

    Returns:
        ``{"step_seconds", "bound_seconds" (step_time's), "compute" {forward, backward},
        "comm" {forward, backward} (the overlapped groups'), "exposed" {forward, backward} (the
        critical path's: TP, EP, the ring's unhidden part), "latency_seconds", "collectives",
        "exposed_comm_seconds", "mfu_predicted", "optimizer_seconds" (the optimizer step inside
        ``compute["backward"]``), "iteration_seconds" (Megatron's per-iteration work inside it, once
        per optimizer step; 0 for another engine), "megatron_iteration" (Megatron's engine only:
        :func:`~symcost.passes.megatron_iteration.price`'s totals, the flags, each item's seconds),
        "calibrated", "defaulted", "overlap"}``.

    Raises:
        SymcostError: what :func:`predict` and :func:`symcost.passes.parallel.step_time` raise.
    """
    from symcost.graph.rules import COMM_OPS
    from symcost.graph.totals import comm_group
    from symcost.passes.parallel import OVERLAPPED_GROUPS, group_sizes, overlapped, step_time

    from symcost.passes.megatron_buckets import GROUPS

    from symcost.passes import megatron_iteration as mi
    from symcost.passes.hybrid_ep import backend_of

    flags = mi.parse_args(megatron_args) if not isinstance(megatron_args, Mapping) else {**mi.DEFAULTS, **megatron_args}
    # (--moe-token-dispatcher-type flex: DeepEP's / HybridEP's exchanges over the EP group, passes/hybrid_ep.py)
    bound = step_time(an, device, sizes, overlap, nodes, devices_per_node, fused=mode == "compiled",
                      dispatcher=backend_of(flags) if megatron_args is not None else None)
    buckets = bound.get("buckets")
    p = predict(an, device, sizes, mode=mode)
    eff = efficiency_of(device)
    env = an.bind(**(sizes or {}))
    ranks = group_sizes(an, env)
    compute = dict(p["phase_overhead"])  # each phase's kernel boundaries and the host time the device does not hide
    for node in p["nodes"]:
        compute["backward" if node["phase"] != "forward" else "forward"] += node["seconds"]
    latency: dict[str, dict[str, float]] = {}
    count = 0
    for op in an.ops:
        ph = "forward" if op.phase == "forward" else "backward"
        packet = op.name.rsplit(".", 1)[0] if op.name.count(".") >= 2 else op.name
        kind = COMM_OPS.get(packet, (None,))[0]
        if kind in (None, "wait"):
            continue
        rep = _num(op.repeat, env)
        count += rep
        g = comm_group(an, op)
        if g == "CP":  # (the ring's passes: their alphas in its schedule below)
            continue
        if buckets and g in GROUPS:  # (Megatron's engine: its buckets' collectives below, not the trace's)
            count -= rep
            continue
        n = ranks.get(g, ranks["DP"])
        steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1) if kind != "send" and kind != "recv" else 1
        latency.setdefault(g, {"forward": 0.0, "backward": 0.0})[ph] += rep * steps * eff.collective_latency
    optimizer = p["terms"]["optimizer"]
    if buckets:  # Megatron's buckets (passes/megatron_buckets.py): one collective per bucket, α per ring step
        count += buckets["collectives"]
        for g, by_phase in buckets["latency_steps"].items():
            for ph, n_steps in by_phase.items():
                latency.setdefault(g, {"forward": 0.0, "backward": 0.0})[ph] += n_steps * eff.collective_latency
        if "optimizer_shard" in buckets:  # the distributed optimizer steps over the rank's shard
            sh = buckets["optimizer_shard"]
            optimizer = host_stretches({}, {}, eff.optimizer_per_tensor * sh["tensors"],
                                       eff.optimizer_per_byte * sh["param_bytes"], p["host_async"])["optimizer"]
    compute["backward"] += optimizer
    iteration = None
    if buckets:  # Megatron-LM's per-iteration work beside the traced step (passes/megatron_iteration.py)
        iteration = mi.price(mi.work(an, env, ranks, buckets, flags), device, 1, flags)
        compute["forward"] += iteration["per_micro_batch"]  # (the loss checks, at each micro-batch's loss)
        # (the main-gradient adds each micro-batch, the rest once per optimizer step)
        compute["backward"] += iteration["seconds"] - iteration["per_micro_batch"]
        iteration = {"flags": flags, **{k: v for k, v in iteration.items() if k != "items"},
                     "items": {i["name"]: i["seconds"] for i in iteration["items"]}}
    groups = bound["groups"]
    phases = ("forward", "backward")

    def part(on: bool, ph: str) -> float:
        return sum(d["seconds"][ph] + latency.get(g, {}).get(ph, 0.0) for g, d in groups.items()
                   if (g in OVERLAPPED_GROUPS) == on)

    comm = {ph: part(True, ph) for ph in phases}
    if "transfer" in bound:  # (CPU offload's host copies, with the overlapped communication as in the bound)
        comm = {ph: comm[ph] + bound["transfer"][ph] for ph in phases}
    exposed = {ph: part(False, ph) for ph in phases}
    ring_latency = 0.0
    if "cp" in bound:
        from symcost.passes.context_parallel import ring_exposure

        cp = bound["cp"]
        alpha = (cp["ranks"] - 1) * eff.collective_latency
        ring = ring_exposure(an, env, {n["index"]: n["seconds"] for n in p["nodes"]}, cp["bandwidth"], alpha)
        exposed = {ph: exposed[ph] + ring["exposed"][ph] for ph in phases}
        ring_latency = ring["passes"] * alpha
    step = overlapped(compute, comm, overlap) + sum(exposed.values())
    peak = bound["peak_flops"]
    mf = bound["mfu"] * bound["step_seconds"] * peak  # the rank's model FLOPs
    return {"step_seconds": step, "bound_seconds": bound["step_seconds"], "compute": compute, "comm": comm,
            "exposed": exposed,
            "latency_seconds": sum(sum(d.values()) for d in latency.values()) + ring_latency, "collectives": count,
            "exposed_comm_seconds": step - sum(compute.values()), "mfu_predicted": mf / (step * peak) if step else 0.0,
            "optimizer_seconds": optimizer,
            "iteration_seconds": (iteration["seconds"] - iteration["per_micro_batch"] - iteration["per_micro_batch_backward"]
                                  if iteration else 0.0),
            **({"megatron_iteration": iteration} if iteration is not None else {}),
            "calibrated": p["calibrated"], "defaulted": p["defaulted"], "overlap": overlap, "mode": mode}

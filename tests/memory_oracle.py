"""Independent PyTorch measurements of training memory on real CPU tensors (no symcost code).

Used by the memory tests and benchmarks/bench_max_batch.py as the ground truth:

* :func:`saved_bytes`: what autograd saves in one forward + loss, seen by
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters and buffers excluded, each storage
  once: the sum of ``untyped_storage().nbytes()`` over unique storages);
* :func:`static_bytes`: parameters, gradients, optimizer state and master weights after one real
  ``optimizer.step()``, summed over unique storages;
* :func:`step_peak`: the peak bytes of a steady-state training step (optimizer state already
  allocated, gradients set to None by ``zero_grad``), from the allocator events that
  ``torch.profiler`` records with ``profile_memory=True``, on top of the bytes live before the
  step (parameters, buffers, optimizer state, master weights, inputs).
"""
from __future__ import annotations

import contextlib
import gc

import torch
from torch.utils._pytree import tree_flatten, tree_map

#: precision -> the dtype of the model's weights (``model.to(dtype)``), and the autocast ones
DTYPES = {"fp32": torch.float32, "bf16-true": torch.bfloat16, "fp16-true": torch.float16,
          "bf16-true-fp32-state": torch.bfloat16, "bf16-true-fp32-master": torch.bfloat16}
AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def full_values(spec, sizes):
    """The model's defaults, overridden by ``sizes``, tied symbols following."""
    v = {**spec.defaults, **sizes}
    v.update({a: v[b] for a, b in spec.tied.items()})
    return v


def build(spec, sizes, precision, seed=0):
    """A real CPU model in train mode and its inputs, as ``precision`` runs them.

    Returns ``(model, args, kwargs, autocast context factory)``.
    """
    torch.manual_seed(seed)
    values = full_values(spec, sizes)
    model = spec.build(values)
    model.train()
    dtype = DTYPES.get(precision, torch.float32)
    if dtype != torch.float32:
        model.to(dtype)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    if dtype != torch.float32:
        args, kwargs = tree_map(
            lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, (args, kwargs))
    if precision in AUTOCAST:
        ctx = lambda: torch.autocast("cpu", dtype=AUTOCAST[precision])  # noqa: E731
    else:
        ctx = contextlib.nullcontext
    return model, args, kwargs, ctx


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = st.nbytes()
    return out


def saved_bytes(spec, sizes, precision, with_loss: bool = True) -> int:
    """Bytes autograd saves for backward in one forward + loss (real tensors, train mode);
    ``with_loss=False``: the model's forward alone."""
    model, args, kwargs, ctx = build(spec, sizes, precision)
    static = set(_storages(list(model.parameters()) + list(model.buffers())))
    seen: dict[int, int] = {}
    keep = []

    def pack(t):
        keep.append(t)  # keeps every storage alive, so data pointers stay unique
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in static:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with ctx():
            out = model(*args, **kwargs)
            loss = spec.loss(out, (args, kwargs)) if with_loss else None
    del out, loss
    return sum(seen.values())


class _Wrapped:
    """A real torch optimizer stepping fp32 tensors ``self.fp32`` on behalf of low-precision
    ``self.params`` (whose gradients are set to None by ``zero_grad``)."""

    def __init__(self, params, make, fp32):
        self.params = list(params)
        self.fp32 = fp32
        self.opt = make(self.fp32)

    @property
    def state(self):
        return self.opt.state

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class _Fp32State(_Wrapped):
    """bf16/fp16 weights and gradients with fp32 optimizer state and no master copy (12P with
    Adam): each step runs a real torch optimizer on fp32 temporaries of the weights and their
    gradients, and writes the result back; only its state persists."""

    def __init__(self, params, make):
        params = list(params)
        super().__init__(params, make, [torch.nn.Parameter(torch.empty(0)) for _ in params])

    def step(self):
        for p, s in zip(self.params, self.fp32):
            s.data = p.detach().float()
            s.grad = p.grad.float()
        self.opt.step()
        for p, s in zip(self.params, self.fp32):
            p.data.copy_(s.data)
            s.data = torch.empty(0)
            s.grad = None


class _MasterWeights(_Wrapped):
    """Low-precision weights and gradients, fp32 master weights updated by a real torch optimizer."""

    def __init__(self, params, make):
        params = list(params)
        super().__init__(params, make, [torch.nn.Parameter(p.detach().float().clone()) for p in params])

    def step(self):
        for p, m in zip(self.params, self.fp32):
            m.grad = p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.fp32):
            p.data.copy_(m.data)
            m.grad = None


def make_optimizer(name, params, precision, foreach=None):
    """A real torch optimizer realising ``precision``'s policy (see docs/memory.md)."""
    params = list(params)
    kinds = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=foreach),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=foreach),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=foreach),
        "sgd-nomomentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.0, foreach=foreach),
        "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-3, foreach=foreach),
    }
    make = kinds[name]
    if precision == "bf16-true-fp32-master":
        return _MasterWeights(params, make)
    if precision == "bf16-true-fp32-state":
        return _Fp32State(params, make)
    return make(params)  # fp32, *-true, and *-mixed (autocast: a plain optimizer on fp32 weights)


def static_bytes(spec, sizes, precision, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state and master weights after one real step.

    ``precision`` picks the realisation: fp32 / bf16-true / fp16-true models with a torch
    optimizer; ``*-mixed``: the fp32 model and a torch optimizer, the step under
    ``torch.autocast`` (as Lightning and Accelerate run it); ``bf16-true-fp32-*``: bf16 weights
    and gradients and fp32 optimizer state, through fp32 master weights (``-master``) or fp32
    temporaries (``-state``).
    """
    model, args, kwargs, ctx = build(spec, sizes, precision)
    opt = make_optimizer(optimizer, model.parameters(), precision)
    with ctx():
        out = model(*args, **kwargs)
        loss = spec.loss(out, (args, kwargs))
    loss.backward()
    opt.step()
    params = list(model.parameters())
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    masters = opt.fp32 if isinstance(opt, _MasterWeights) else []
    return {
        "params": sum(_storages(params).values()),
        "grads": sum(_storages([p.grad for p in params if p.grad is not None]).values()),
        "optimizer": sum(_storages(state).values()),
        "master_weights": sum(_storages(masters).values()),
    }


@contextlib.contextmanager
def profiled():
    """``torch.profiler.profile(profile_memory=True)`` (CPU) around a measured window, with no
    garbage collected inside it: the cyclic garbage is collected before the window starts and the
    collector is off until it ends. torch's CPU memory reporter keeps the size of every storage
    allocated while any profile ran, so a storage an earlier profile allocated (an earlier test's
    model kept in a reference cycle) that the collector frees inside this window would be
    reported as a free here: the measured level drops by its size (an earlier measurement's
    gradients once took 552 KB off a 2.6 MB step peak)."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield prof
    finally:
        if enabled:
            gc.enable()


def _levels(prof, ops_prefixes: tuple[str, ...] = ("aten::",)) -> tuple[int, int]:
    """(highest allocator level, highest level at the end of a top-level aten op) over a profile.

    The second leaves out memory a kernel allocates and frees inside one op (e.g. oneDNN's
    packing buffers in CPU bf16 matmuls), which no op-level schedule can see. ``ops_prefixes``:
    the profiler event names that count as ops (a distributed run adds its collectives,
    ``c10d::`` and ``_c10d_functional::``).
    """
    evs = list(prof.profiler.kineto_results.events())
    mem = sorted((e.start_ns(), e.nbytes()) for e in evs if e.name() == "[memory]")
    ops = sorted(((e.start_ns(), e.start_ns() + e.duration_ns(), e.start_thread_id()) for e in evs
                  if e.name().startswith(ops_prefixes)), key=lambda t: (t[0], -t[1]))
    ends, stack = [], {}
    for a, b, th in ops:  # top level: not inside another aten op of its thread
        st = stack.setdefault(th, [])
        while st and st[-1] <= a:
            st.pop()
        if not st:
            ends.append(b)
        st.append(b)
    timeline = sorted([(t, 0, nb) for t, nb in mem] + [(t, 1, 0) for t in ends])
    cur = top = top_ops = 0
    for _, kind, nb in timeline:
        if kind == 0:
            cur += nb
            top = max(top, cur)
        else:
            top_ops = max(top_ops, cur)
    return top, top_ops


def steady_peak(step, opt, tensors, ops_prefixes: tuple[str, ...] = ("aten::",)) -> dict[str, int]:
    """Peak bytes of a steady-state step: ``step()`` once untimed (the optimizer state appears),
    gradients dropped, then ``step()`` under :func:`profiled`. Returns ``{"peak", "peak_ops",
    "baseline"}``: the bytes of ``tensors`` and the optimizer state before the step (DTensors by
    their local shards) plus the highest allocator level above them, the same at the ends of
    top-level ops (``ops_prefixes``, :func:`_levels`), and that baseline."""
    step()
    opt.zero_grad(set_to_none=True)
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in list(tensors) + state]
    baseline = sum(_storages(local).values())
    with profiled() as prof:
        step()
    top, top_ops = _levels(prof, ops_prefixes)
    return {"peak": baseline + top, "peak_ops": baseline + top_ops, "baseline": baseline}


def step_peak(spec, sizes, precision, optimizer="adamw", foreach=True) -> dict[str, int]:
    """Peak bytes of a steady-state training step measured with ``torch.profiler``.

    One warm-up step allocates the optimizer state; the measured step is ``zero_grad``; forward
    and loss (the output dropped before backward); ``backward``; ``step``. Returns
    ``{"peak", "peak_ops", "baseline"}``: the peak (bytes live before the step: parameters,
    buffers, optimizer state, inputs; plus the highest allocator level above them), the same at
    the ends of top-level aten ops (kernel-internal workspaces left out), and the baseline.
    """
    model, args, kwargs, ctx = build(spec, sizes, precision)
    opt = make_optimizer(optimizer, model.parameters(), precision, foreach=foreach)

    def step():
        opt.zero_grad(set_to_none=True)
        with ctx():
            out = model(*args, **kwargs)
            loss = spec.loss(out, (args, kwargs))
        del out
        loss.backward()
        del loss
        opt.step()

    return steady_peak(step, opt, list(model.parameters()) + list(model.buffers()) + tree_flatten((args, kwargs))[0])


def accumulation_peak(spec, sizes, precision, optimizer="adamw", foreach=True) -> dict[str, int]:
    """Peak bytes of the last micro-step of a gradient-accumulation cycle (not the first one):
    gradients and optimizer state live from the start, the new gradients added in place, then
    the optimizer step (``torch.profiler``, as in :func:`step_peak`)."""
    model, args, kwargs, ctx = build(spec, sizes, precision)
    opt = make_optimizer(optimizer, model.parameters(), precision, foreach=foreach)

    def micro_step():
        with ctx():
            out = model(*args, **kwargs)
            loss = spec.loss(out, (args, kwargs)) / 2
        del out
        loss.backward()
        del loss

    micro_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    micro_step()  # the first micro-step of the next optimizer step: gradients allocated
    params = list(model.parameters())
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    baseline = sum(_storages(params + list(model.buffers()) + state + [p.grad for p in params if p.grad is not None]
                             + tree_flatten((args, kwargs))[0]).values())
    with profiled() as prof:
        micro_step()
        opt.step()
    top, top_ops = _levels(prof)
    return {"peak": baseline + top, "peak_ops": baseline + top_ops, "baseline": baseline}


def exact_at(an, spec, v: dict, prepare=None, sdpa_math: bool = False) -> None:
    """Assert symcost's parameters, model FLOPs and saved bytes at sizes ``v`` (fp32) against
    PyTorch's: a meta-device parameter count, FlopCounterMode over one real forward + loss +
    backward, and :func:`saved_bytes`. ``prepare(model)`` changes the real model before it runs
    (e.g. grouped convolutions split, which FlopCounterMode miscounts); ``sdpa_math`` runs SDPA's
    math kernel (FlopCounterMode counts no CPU flash attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from symcost.passes import memory

    got = an.subs(**v)
    values = {**spec.defaults, **v}
    with torch.device("meta"):
        meta = spec.build(values)
    assert got["params"] == sum(p.numel() for p in meta.parameters()), v
    torch.manual_seed(0)
    model = spec.build(values)
    if prepare is not None:
        prepare(model)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    kernel = sdpa_kernel(SDPBackend.MATH) if sdpa_math else contextlib.nullcontext()
    with kernel, FlopCounterMode(display=False) as fc:
        spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
    assert got["flops.train"] == fc.get_total_flops(), v
    assert memory.memory_model(an).components(**v)["activations"] == saved_bytes(spec, v, "fp32"), v

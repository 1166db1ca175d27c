"""One rank of FSDP2 with CPU offload (``CPUOffloadPolicy``), the oracle of tests/test_offload.py:
``python -m torch.distributed.run --standalone --nproc-per-node N offload_rank.py OUT H D L V B S``
(gloo, real bf16 tensors), or in-process on the fake process group (:func:`fake_rank`).

The model (the ``megatron-gpt`` built-in) is wrapped here with PyTorch's own API as torchtitan's
``apply_fsdp`` does with ``training.enable_cpu_offload`` (torchtitan/models/llama3/infra/
parallelize.py): ``fully_shard(block, mesh=..., reshard_after_forward=True,
offload_policy=CPUOffloadPolicy(pin_memory=False))`` per block, then the root with
``reshard_after_forward=False`` (pinning needs an accelerator; it decides only whether the
gradient copy is asynchronous). symcost's wrapping code is not used.

What a rank measures (:func:`measure_offload`, with tests/data/tp_rank.py ``measure``):

* FLOPs, saved bytes, collective bytes, parameter elements (``measure``);
* ``h2d``: the bytes FSDP2 copies to the device before its all-gathers. On this one-device CPU
  run ``.to(self.device)`` is a no-op, so they are counted as what those copies feed: the
  all-gather inputs, each unit's shards (``c10d._allgather_base_``'s input; no mixed precision
  here, so the copied dtype is the gathered one); ``d2h``: the reduce-scatter outputs, the reduced
  gradient shards FSDP2 copies to the host (``c10d._reduce_scatter_base_``'s output);
* ``host``: bytes of the rank's sharded parameters, their gradients and the AdamW state after a
  step, all on the host (``device.type == "cpu"``) as ``CPUOffloadPolicy`` requires.

The device peak (:func:`device_peak`, real runs only). Host and device are one memory on this CPU,
so the run is made to allocate as an accelerator rank would, by code written here from
PyTorch's source (torch/distributed/fsdp/_fully_shard): ``FSDPParam.all_gather_inputs`` of an
offloaded parameter returns a *copy* of the shard (on an accelerator ``.to(device)`` allocates
the device copy the all-gather reads), and in ``foreach_reduce`` the gradient shard's
``.to("cpu")`` copies into a host buffer allocated in the warm-up step (on an accelerator the copy
goes to host memory; the device's reduce-scatter output is then freed). The measured window is
the forward and backward of a steady-state step (the optimizer steps the host tensors after it);
everything the window allocates is then device memory, and what was live before it on the device
is the rank's buffers and input. ``peak_ops`` = those + the highest allocator level at the end of a
top-level op (``torch.profiler``, tests/memory_oracle.py). What it proves: the device's live
storages of the real FSDP2 engine (its all-gather, unshard, reshard, reduce-scatter and free
order, prefetching included), with the copies as an accelerator makes them; what it does not:
that a real accelerator's caching allocator or its streams (the copies are asynchronous with
pinned memory) give the same level, nor the host side's peak.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wrap_offload(model, layers: str, mesh):
    """torchtitan's ``apply_fsdp`` with CPU offload, typed from its source (module docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model.get_submodule(layers).children():
        fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
    return model


def transfer_counts(model, spec, values) -> dict:
    """``{"h2d", "d2h"}`` bytes of one steady-state forward + backward (module docstring), counted
    at dispatch on PyTorch's run: all-gather inputs and reduce-scatter outputs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    got = {"h2d": 0, "d2h": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket)
            if name == "c10d._allgather_base_":  # (output, input, group, ...)
                got["h2d"] += args[1].numel() * args[1].element_size()
            elif name == "c10d._reduce_scatter_base_":  # (output, input, group, ...)
                got["d2h"] += args[0].numel() * args[0].element_size()
            return out

    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    with Count():
        spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
    return got


def host_bytes(model, opt) -> dict:
    """Bytes of the rank's parameter shards, gradient shards and optimizer state (all on the host)."""
    import torch

    def local(t):
        return getattr(t, "_local_tensor", t)

    params = [p for p in model.parameters()]
    assert all(local(p).device.type == "cpu" for p in params)
    state = [local(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {"params": sum(local(p).numel() * local(p).element_size() for p in params),
            "grads": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None),
            "optimizer": sum(t.numel() * t.element_size() for t in state)}


@contextlib.contextmanager
def accelerator_copies(host_buffers: list):
    """The two copies an accelerator rank makes under ``CPUOffloadPolicy`` (module docstring):
    the shard copied before its all-gather, the gradient shard copied into ``host_buffers``
    (allocated on first use, reused in later steps, in call order)."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    from torch.overrides import TorchFunctionMode

    cls = _fsdp_param.FSDPParam
    prop = cls.__dict__["all_gather_inputs"]
    reduce = _fsdp_param_group.foreach_reduce
    calls = [0]

    def all_gather_inputs(self):
        out = prop.fget(self)
        if self.offload_to_cpu and self.sharded_state == _fsdp_param.ShardedState.SHARDED:
            out = [t.clone() for t in out]  # the device copy of the host shard
        return out

    class ToHost(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            dev = kwargs.get("device", args[1] if len(args) > 1 else None)
            if func is torch.Tensor.to and isinstance(dev, torch.device) and dev.type == "cpu":
                k = calls[0]
                calls[0] += 1
                if k == len(host_buffers):
                    host_buffers.append(torch.empty_like(args[0], memory_format=torch.contiguous_format))
                return host_buffers[k].copy_(args[0])
            return func(*args, **kwargs)

    def foreach_reduce(*a, **k):
        with ToHost():
            return reduce(*a, **k)

    cls.all_gather_inputs = property(all_gather_inputs)
    _fsdp_param_group.foreach_reduce = foreach_reduce
    try:
        yield calls
    finally:
        cls.all_gather_inputs = prop
        _fsdp_param_group.foreach_reduce = reduce


def device_peak(model, spec, values) -> dict:
    """The device peak of a steady-state step (module docstring): ``peak``, ``peak_ops``, and
    ``host`` (:func:`host_bytes` after the step)."""
    import torch
    from memory_oracle import _levels, _storages, profiled

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    bufs: list = []
    with accelerator_copies(bufs) as calls:
        def fwd_bwd():
            calls[0] = 0
            opt.zero_grad(set_to_none=True)
            spec.loss(model(*args, **kwargs), (args, kwargs)).backward()

        fwd_bwd()
        opt.step()  # the optimizer state, on the host
        base = sum(_storages(list(model.buffers()) + [t for t in list(args) + list(kwargs.values())
                                                       if isinstance(t, torch.Tensor)]).values())
        with profiled() as prof:
            fwd_bwd()
        opt.step()
    prefixes = ("aten::", "c10d::", "_c10d_functional::")
    top, top_ops = _levels(prof, prefixes)
    return {"peak": base + top, "peak_ops_all_threads": base + top_ops, "peak_ops": base + _main_thread_level(prof, prefixes),
            "device_baseline": base, "host": host_bytes(model, opt)}


def _main_thread_level(prof, prefixes) -> int:
    """The highest level, at the end of a top-level op of the thread that runs the step (the one
    that runs most ops), of the storages that thread allocated: gloo allocates scratch in its own
    threads inside its collectives (ProcessGroupGloo: a flat all-gather output, a clone of a
    reduce-scatter input, one block's parameters in size here) while the step runs on, which NCCL
    does not take from PyTorch's allocator and an accelerator rank would not hold; whether one
    is live at the step's peak varies from run to run and from rank to rank.

    The profiler's memory events carry a size and a thread, no address: a free is matched to an
    outstanding allocation of its size, its own thread's first, else another thread's (a storage
    the step's thread allocated may be freed by a gloo thread and the other way round; counting
    each thread's frees alone left such a storage live for ever: CI, 2026-12-06, seed 2703's rank 1
    measured 199,960 B, about one block's fp32 parameters, over symcost's 2,713,588 B, which this
    machine's runs of that size measure exactly)."""
    import collections

    evs = list(prof.profiler.kineto_results.events())
    ops = [e for e in evs if e.name().startswith(prefixes)]
    main = collections.Counter(e.start_thread_id() for e in ops).most_common(1)[0][0]
    mem = [(e.start_ns(), e.nbytes(), e.start_thread_id()) for e in evs if e.name() == "[memory]"]
    spans = sorted(((e.start_ns(), e.start_ns() + e.duration_ns()) for e in ops if e.start_thread_id() == main),
                   key=lambda t: (t[0], -t[1]))
    ends, open_until = [], 0
    for a, b in spans:  # top level: not inside another op
        if a >= open_until:
            ends.append(b)
            open_until = b
        open_until = max(open_until, b) if a < open_until else b
    live: dict = collections.defaultdict(collections.Counter)  # thread -> outstanding sizes
    cur = top = 0
    for _, kind, nb, tid in sorted([(t, 0, nb, tid) for t, nb, tid in mem] + [(t, 1, 0, None) for t in ends]):
        if kind == 1:
            top = max(top, cur)
        elif nb > 0:
            live[tid][nb] += 1
            cur += nb if tid == main else 0
        elif nb < 0:
            owner = tid if live[tid][-nb] else next((t for t, c in live.items() if c[-nb]), None)
            if owner is not None:
                live[owner][-nb] -= 1
                cur -= -nb if owner == main else 0
    return top


def fake_rank(spec, values: dict):
    """Rank 0 of ``values["DP"]`` on PyTorch's fake process group: ``spec``'s model on the meta
    device in bf16, wrapped by :func:`wrap_offload`. The caller materialises it on the CPU
    (``to_empty``, under its FakeTensorMode)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=values["DP"])
    mesh = init_device_mesh("cpu", (values["DP"],))
    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    return wrap_offload(model, spec.layers, mesh)


def gloo_ranks(out_dir, v: dict, nproc: int = 2) -> list[dict]:
    """``torchrun --standalone --nproc-per-node nproc`` of this script with gloo at sizes ``v``
    (H D L V B S): each rank's JSON (:func:`main`), in rank order."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        os.path.abspath(__file__), str(out_dir)] + [str(v[k]) for k in "HDLVBS"],
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(open(os.path.join(str(out_dir), f"rank{k}.json")).read()) for k in range(nproc)]


def main():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from symcost.frontends.models import resolve
    from tp_rank import measure

    out_dir = sys.argv[1]
    H, D, L, V, B, S = (int(x) for x in sys.argv[2:8])
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    values = {"H": H, "D": D, "L": L, "V": V, "B": B, "S": S, "DP": n}
    spec = resolve("megatron-gpt")
    torch.manual_seed(0)
    model = wrap_offload(spec.build(values).to(torch.bfloat16), spec.layers, init_device_mesh("cpu", (n,)))
    got = device_peak(model, spec, values)  # (first: the step before it is the warm-up of its own)
    got.update(measure(model, spec, values, contextlib.nullcontext))
    got.update(transfer_counts(model, spec, values))
    got["world"] = n
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    from gloo_teardown import finish  # (tests/data: on the path)
    finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)


if __name__ == "__main__":
    main()

"""One rank of a real pipeline step composed with data and tensor parallelism on CPU (gloo), for
tests/test_pipeline_mesh.py:
``torchrun --standalone --nproc-per-node PP*DP*TP pp_mesh_rank.py OUT PP DP TP SHARD SP AC M B S H D L V F [offload] [offload_activations]``
(several runs in one launch: their arguments joined by ``+``, each its own OUT; a run of fewer
ranks than the launch's runs on the first PP·DP·TP ranks while the others skip it;
every run builds its own model, tokens, schedule and counters, and runs of the same mesh shape
share one ``DeviceMesh``: DTensor's sharding cache compares meshes by shape, so a second mesh of
the same shape would get the first one's cached placements, whose collectives name the first
mesh's process groups).

The ranks form torchtitan's mesh ``init_device_mesh("cpu", (PP, DP, TP), ("pp", "dp_shard" |
"dp_replicate", "tp"))`` (dimensions of size 1 left out). Each rank builds the whole
``cs336-lm`` at L blocks, deletes the blocks of the other stages (torchtitan's pipeline_llm;
``symcost.frontends.pipeline.make_stage`` swaps what runs before and after the blocks), then
applies torchtitan's order over its sub-meshes: the Megatron plan over ``tp`` (``SP``: sequence
parallelism too), activation checkpointing of each block (``AC``: ``none``, ``full`` or
``selective``), the data-parallel engine over the dp dimension (``SHARD``: ``fsdp``, ``ddp`` or
``none``) — symcost's :meth:`~symcost.frontends.layout.Layout.parallelize` applies these
PyTorch calls (the plan is the input; what is measured is PyTorch running it). The stage goes
into ``PipelineStage`` over the pp group and ``Schedule1F1B`` runs M micro-batches of B
sequences. A warm-up step runs (PyTorch's shape inference, gradients, buffers), then one
measured step writes ``OUT/rank{r}.json``:

* model FLOPs, each op counted by ``torch.utils.flop_counter``'s own registry on the local
  tensors DTensor computes with (a ``TorchDispatchMode`` that hands DTensor ops to DTensor);
* bytes per rank of every collective seen at dispatch, by mesh dimension and kind, with
  nccl-tests' ring factors (doc/PERFORMANCE.md) and the group's size as PyTorch resolves it
  (``tp_rank._group``), the point-to-point sends and receives by their tensors' bytes;
* the parameters' and buffers' local bytes, the gradients' after the step, and the measured
  step's peak: the highest total of PyTorch's ``MemTracker`` over the measured step (the
  parameters, buffers, what the warm-up left allocated and every storage the step allocates).
  (torch.profiler's allocator level is not used: on this 2-core machine it differs by up to
  20% between two ranks doing the same work, as gloo's threads release a collective's tensors
  late; the storages' lifetimes are the same on every rank.)

With ``offload`` (FSDP2's ``CPUOffloadPolicy`` on every unit: ``Layout(offload=True)``, as
torchtitan's ``training.enable_cpu_offload`` passes it to ``fully_shard``), host and device are
one memory on this CPU, so the run makes the two copies an accelerator rank makes
(tests/data/offload_rank.py ``accelerator_copies``: the shard copied before each all-gather, the
reduced gradient shard copied into a host buffer allocated in the first, untracked step). The
host's storages (the parameter shards, the host gradient buffers, which are the gradients) are
given to the tracker before the measured step and stay the same through it, so the device peak
is the tracker's peak minus them. Also written: the bytes copied each way per step, counted as
what the copies feed (tests/data/offload_rank.py ``transfer_counts``): the DP all-gathers' inputs
(H2D) and the DP reduce-scatters' outputs (D2H).

With ``offload_activations`` the schedule's steps run under the hooks of
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (torch/autograd/graph.py), as an
accelerator rank runs them: ``pack_to_cpu``'s new host tensor of the saved tensor's size and its
copy, made out of the tracker's sight (the dispatch modes off: host memory), and
``unpack_from_cpu``'s ``tensor.to(device)``, here a ``clone`` the tracker sees (the device copy;
on this CPU ``.to`` of a tensor already there would return it). Written: the bytes packed and
unpacked in the measured step and the most bytes the packed tensors held at once (``host``).
"""
import json
import os
import sys
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from tp_rank import _group  # noqa: E402

from symcost.frontends.builtin.cs336_lm import spec as cs336  # noqa: E402
from symcost.frontends.layout import Layout  # noqa: E402
from symcost.frontends.pipeline import make_stage, probe_boundary  # noqa: E402

MESHES: dict = {}


def run(argv: list[str]) -> None:
    """One run: ``OUT PP DP TP SHARD SP AC M B S H D L V F [offload] [offload_activations]`` (the
    module docstring); every model, counter and tracker its own."""
    out_dir = argv[0]
    PP, DP, TP = (int(x) for x in argv[1:4])
    shard, sp, ac = argv[4], argv[5] == "1", argv[6]
    M, B, S, H, D, L, V, Fd = (int(x) for x in argv[7:15])
    offload = "offload" in argv[15:]
    offload_activations = "offload_activations" in argv[15:]
    shard = None if shard == "none" else shard
    layout = Layout(shard=shard, tp=TP > 1, sp=sp, ac=None if ac == "none" else ac, offload=offload)
    dims = [("pp", PP)] + [(d, n) for d, n in ((("dp_shard" if shard == "fsdp" else "dp_replicate"), DP), ("tp", TP))
                           if n > 1]
    if tuple(dims) not in MESHES:  # (one mesh per shape for the whole launch: the module docstring)
        shape, names = tuple(n for _, n in dims), tuple(d for d, _ in dims)
        n = PP * DP * TP
        # (a run on fewer ranks than the launch has: its mesh is the first PP·DP·TP ranks, built
        # by every rank, as a DeviceMesh's process groups are; the other ranks skip the run)
        MESHES[tuple(dims)] = (init_device_mesh("cpu", shape, mesh_dim_names=names) if n == dist.get_world_size()
                               else DeviceMesh("cpu", torch.arange(n).view(shape), mesh_dim_names=names))
    mesh = MESHES[tuple(dims)]
    if mesh.get_coordinate() is None:  # (not one of this run's ranks)
        return
    pp_rank = mesh["pp"].get_local_rank()
    sub = {("TP" if d == "tp" else "DP"): mesh[d] for d, _ in dims[1:]}
    groups = {m.get_group().group_name: k for k, m in {**sub, "PP": mesh["pp"]}.items()}

    spec = cs336()
    values = {"B": B, "S": S, "H": H, "D": D, "L": L, "V": V, "F": Fd}
    with torch.device("meta"):
        meta = spec.build(values)
    pre, post, templates, _ = probe_boundary(meta, "layers", *spec.make_inputs(values, torch.device("meta")))
    torch.manual_seed(0)
    model = spec.build(values)
    per = [L // PP + (1 if s < L % PP else 0) for s in range(PP)]
    lo = sum(per[:pp_rank])
    model.layers = torch.nn.ModuleList(list(model.layers)[lo:lo + per[pp_rank]])  # the other stages' blocks deleted
    part = "first" if pp_rank == 0 else "last" if pp_rank == PP - 1 else "middle"
    make_stage(model, "layers", part, pre, post, templates)
    loss_context = layout.parallelize(model, "layers", sub)

    torch.manual_seed(1)  # every rank the same tokens (a data-parallel group would take other ones; sizes match)
    tokens = torch.randint(0, V, (M * B, S))
    stage = PipelineStage(model, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = Schedule1F1B(stage, M, loss_fn=lambda logits, target: spec.loss(logits, ((target,), {})))


    host_buffers: list = []
    if offload:
        import contextlib

        from offload_rank import accelerator_copies

        _copies = contextlib.ExitStack()  # (kept: the patches stay for the whole run; closed at its end)
        calls = _copies.enter_context(accelerator_copies(host_buffers))


    act = {"d2h": 0, "h2d": 0, "level": 0, "host": 0}


    def _host_free(n):
        act["level"] -= n


    def pack_to_cpu(t):  # save_on_cpu(pin_memory=True)'s, its host tensor out of the tracker's sight
        import weakref

        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
            packed.copy_(t)
        n = packed.numel() * packed.element_size()
        act["d2h"] += n
        act["level"] += n
        act["host"] = max(act["host"], act["level"])
        weakref.finalize(packed, _host_free, n)
        return t.device, packed


    def unpack_from_cpu(packed):  # ``tensor.to(device)``: on an accelerator a new device tensor
        out = packed[1].clone()
        act["h2d"] += out.numel() * out.element_size()
        return out


    def step():
        import contextlib

        if offload:
            calls[0] = 0  # (the host buffers in call order, reused each step)
        with loss_context(), (torch.autograd.graph.saved_tensors_hooks(pack_to_cpu, unpack_from_cpu)
                              if offload_activations else contextlib.nullcontext()):
            if pp_rank == 0:
                sched.step(tokens, return_outputs=False)
            elif pp_rank == PP - 1:
                sched.step(_in0=tokens, target=tokens, return_outputs=False)
            else:
                sched.step(_in0=tokens, return_outputs=False)


    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t


    def nbytes(t):
        t = local(t)
        return t.numel() * t.element_size()


    comm, flops, transfers = {}, [0], {"h2d": 0, "d2h": 0}


    def add(kind, args, size, factor):
        g, n = _group(args, groups)
        comm.setdefault(g or "PP", {}).setdefault(kind, Fraction(0))
        comm[g or "PP"][kind] += factor(n) * size


    ring, twice, once = (lambda n: Fraction(n - 1, n)), (lambda n: Fraction(2 * (n - 1), n)), (lambda n: 1)


    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func.overloadpacket)
            if name == "_c10d_functional.all_gather_into_tensor":
                add("all_gather", args, nbytes(out), ring)
            elif name in ("c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_"):
                add("all_gather", args, nbytes(args[0]) if name.endswith("base_") else sum(map(nbytes, args[0])), ring)
                if name.endswith("base_") and _group(args, groups)[0] == "DP":  # (FSDP2's: its input, the shards)
                    transfers["h2d"] += nbytes(args[1])
            elif name == "_c10d_functional.reduce_scatter_tensor":
                add("reduce_scatter", args, nbytes(args[0]), ring)
            elif name == "c10d._reduce_scatter_base_":
                add("reduce_scatter", args, nbytes(args[1]), ring)
                if _group(args, groups)[0] == "DP":  # (FSDP2's: its output, the reduced gradient shards)
                    transfers["d2h"] += nbytes(args[0])
            elif name == "_c10d_functional.all_reduce":
                add("all_reduce", args, nbytes(args[0]), twice)
            elif name == "c10d.allreduce_":
                add("all_reduce", args, sum(nbytes(t) for t in args[0]), twice)
            elif name in ("c10d.send", "c10d.recv_"):
                add("send" if name == "c10d.send" else "recv", args, sum(nbytes(t) for t in args[0]), once)
            elif func.overloadpacket in flop_registry:
                flops[0] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            return out


    class StepTracker(MemTracker):
        """PyTorch's ``MemTracker`` (torch/distributed/_tools/mem_tracker.py: every storage an op
        allocates, followed by weak reference to its end, ``UntypedStorage.resize_`` included, per
        device, with the parameters and buffers given) without its per-module statistics, which
        refuse a module called more than once per step (the pipeline runs each stage module once
        per micro-batch)."""

        def _pre_fw_hook(self, *args, **kwargs):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook


    cpu = torch.device("cpu")
    step()  # the first step: the schedule's shape inference (autograd.grad of leaves, which the tracker's hooks refuse)
    model.zero_grad(set_to_none=True)
    tracker = StepTracker()
    tracker.track_external(model)
    host = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(t) for t in host_buffers)
    if offload:
        tracker.track_external(*host_buffers)  # (host memory, the same through the step: subtracted below)
    with tracker:
        step()  # warm-up: the engine's buffers, the gradients
        tracker._peak_mem = {d: snap["Total"] for d, snap in tracker.get_tracker_snapshot().items()}
        act.update(d2h=0, h2d=0, host=act["level"])
        with Count():  # (the measured step's FLOPs and collectives too: Count over the tracker)
            step()
    act_step = {k: act[k] for k in ("host", "d2h", "h2d")}
    peak = tracker._peak_mem[cpu] - (host if offload else 0)
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"pp_rank": pp_rank, "peak": peak,
                   "peak_parts": {str(k): v for k, v in tracker._peak_mem_snap.get(cpu, {}).items()}, "grads": grads, "flops": flops[0],
                   "params": sum(nbytes(p) for p in model.parameters()),
                   "buffers": sum(nbytes(b) for b in model.buffers()),
                   "comm": {g: {k: str(v) for k, v in d.items()} for g, d in comm.items()},
                   **({"transfers": transfers, "host_buffers": sum(nbytes(t) for t in host_buffers)} if offload else {}),
                   **({"activation_offload": act_step} if offload_activations else {})},
                  f)
    if offload:
        _copies.close()


def main():
    dist.init_process_group("gloo")
    argv, runs = sys.argv[1:], []
    while "+" in argv:
        runs.append(argv[:argv.index("+")])
        argv = argv[argv.index("+") + 1:]
    for args in runs + [argv]:
        run(args)
    from gloo_teardown import finish  # (tests/data: on the path)
    finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)


if __name__ == "__main__":
    main()

"""One rank of a real data-parallel step on CPU (gloo), for tests/test_parallel.py: run with
``torchrun --standalone --nproc-per-node N dp_rank.py OUT SHARDS D L B S`` (SHARDS: fsdp, zero2 or
ddp, several comma-separated: one launch runs them one after the other).

Each rank builds the ``mlp`` built-in, wraps it (``fully_shard`` per block then the root, as
symcost does, or the classic C++ ``DistributedDataParallel``), runs one training step on real
tensors and writes ``OUT/{shard}-rank{r}.json``: model FLOPs (FlopCounterMode), bytes autograd saved
(saved_tensors_hooks, parameters excluded, storages once), bytes per rank of every collective
(FSDP2: seen at dispatch; DDP: each gradient bucket its comm hook all-reduces), with the ring
factors of nccl-tests (all-gather, reduce-scatter (n-1)/n·size, all-reduce 2(n-1)/n·size).
"""
import json
import os
import sys
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from symcost.frontends.builtin.mlp import MLP

out_dir, shards = sys.argv[1], sys.argv[2].split(",")
D, L, B, S = (int(x) for x in sys.argv[3:7])
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()


def size(t):
    return t.numel() * t.element_size()


def run(shard):
    comm = {"all_gather": Fraction(0), "reduce_scatter": Fraction(0), "all_reduce": Fraction(0)}
    torch.manual_seed(0)
    model = MLP(D, L)

    if shard == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)

        def hook(state, bucket):
            comm["all_reduce"] += Fraction(2 * (n - 1), n) * size(bucket.buffer())
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / n)

        model.register_comm_hook(None, hook)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=shard == "fsdp")
        fully_shard(model, mesh=mesh, reshard_after_forward=False)

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == "c10d._allgather_base_":
                comm["all_gather"] += Fraction(n - 1, n) * size(args[0])
            elif name == "c10d._reduce_scatter_base_":
                comm["reduce_scatter"] += Fraction(n - 1, n) * size(args[1])
            elif name == "c10d.allreduce_" and shard != "ddp":  # (DDP's buckets: counted by the hook)
                comm["all_reduce"] += Fraction(2 * (n - 1), n) * sum(size(t) for t in args[0])
            return func(*args, **(kwargs or {}))

    static = {StorageWeakRef((p.to_local() if hasattr(p, "to_local") else p).untyped_storage()).cdata
              for p in model.parameters()}
    seen, saved = set(), [0]

    def pack(t):
        if isinstance(t, torch.nn.Parameter):
            return t
        key = StorageWeakRef(t.untyped_storage()).cdata
        if key in {StorageWeakRef(getattr(p, "_local_tensor", p).untyped_storage()).cdata for p in model.parameters()}:
            return t  # on a parameter's storage as it is now (a transposed weight): not an activation
        if key not in seen and key not in static:
            seen.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t

    x = torch.randn(B, S, D)
    fc = FlopCounterMode(display=False)
    with fc, Collectives(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).pow(2).mean()
        loss.backward()
    shard_numel = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    with open(os.path.join(out_dir, f"{shard}-rank{rank}.json"), "w") as f:
        json.dump({"flops": fc.get_total_flops(), "saved": saved[0], "shard": shard_numel,
                   "comm": {k: [v.numerator, v.denominator] for k, v in comm.items()}, "world": n}, f)


for shard in shards:
    run(shard)
    dist.barrier()  # every rank done with this engine's collectives before the next (or teardown)
from gloo_teardown import finish  # (tests/data: on the path)
finish()  # every rank past the last barrier before any closes (gloo_teardown.py)

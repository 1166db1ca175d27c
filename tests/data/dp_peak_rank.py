"""Each rank's peak memory in a real data-parallel step on CPU (gloo), for
tests/test_parallel_memory.py: run with
``torchrun --standalone --nproc-per-node N dp_peak_rank.py OUT SHARDS D L B S`` (SHARDS: fsdp, zero2
or ddp, comma-separated: one launch runs them one after the other).

Each rank builds the ``mlp`` built-in (fp32), wraps it as symcost traces it (``fully_shard`` per
block then the root, ``reshard_after_forward`` True for fsdp and False for zero2; ``replicate``
per block then the root for ddp), runs a warm-up step (the optimizer state allocated), then one
steady-state step (``zero_grad(set_to_none=True)``, forward, loss, backward, ``AdamW.step()`` in
its CPU for-loop form) under ``torch.profiler`` with ``profile_memory``, and writes
``OUT/{shard}-rank{r}.json``: the bytes live before the step (the rank's parameter shards, buffers,
optimizer state and input: its storages) and the peak (that plus the highest allocator level the
profiler records, ``tests/memory_oracle._levels``, as the single-device tests measure it).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from memory_oracle import _levels  # noqa: E402

from symcost.frontends.builtin.mlp import MLP  # noqa: E402

out_dir, shards = sys.argv[1], sys.argv[2].split(",")
D, L, B, S = (int(x) for x in sys.argv[3:7])
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()


def storages(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def run(shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(rank)
    model = MLP(D, L)
    mesh = init_device_mesh("cpu", (n,))
    if shard == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in model.layers:
            replicate(block, mesh=mesh)
        replicate(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=shard == "fsdp")
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(B, S, D)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        del loss
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    baseline = storages(list(model.parameters()) + list(model.buffers()) + state + [x])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    top, top_ops = _levels(prof)
    with open(os.path.join(out_dir, f"{shard}-rank{rank}.json"), "w") as f:
        json.dump({"peak": baseline + top, "peak_ops": baseline + top_ops, "baseline": baseline, "world": n}, f)


for shard in shards:
    run(shard)
    dist.barrier()
dist.destroy_process_group()

"""Each rank's peak memory in a real data-parallel step on CPU (gloo), for
tests/test_parallel_memory.py: run with
``torchrun --standalone --nproc-per-node N dp_peak_rank.py OUT SHARDS D L B S [PRECISION]`` (SHARDS:
fsdp, zero2 or ddp, comma-separated: one launch runs them one after the other; PRECISION: fp32, the
default, or bf16-mixed: the step under ``torch.autocast("cpu", dtype=torch.bfloat16)``).

Each rank builds the ``mlp`` built-in (fp32 parameters), wraps it as symcost traces it (``fully_shard`` per
block then the root, ``reshard_after_forward`` True for fsdp and False for zero2; ``replicate``
per block then the root for ddp), runs a warm-up step (the optimizer state allocated), then one
steady-state step (``zero_grad(set_to_none=True)``, forward, loss, backward, ``AdamW.step()`` in
its CPU for-loop form) under ``torch.profiler`` with ``profile_memory``, and writes
``OUT/{shard}-rank{r}.json``: the bytes live before the step (the rank's parameter shards, buffers,
optimizer state and input: its storages) and the peak (that plus the highest allocator level the
profiler records, as tests/memory_oracle.py measures it on one device), and ``peak_ops``: the same
at the ends of top-level ops, aten and c10d (what a kernel allocates and frees inside one op is
left out: oneDNN's workspaces in bf16 matmuls), and ``memtracker``: the peak of the same step run
once more under ``torch.distributed._tools.mem_tracker.MemTracker`` (the storages of the ops
PyTorch dispatches). The profiler also sees the scratch gloo allocates inside its collectives
(a flat output buffer for all-gather, a clone of the input for reduce-scatter; ProcessGroupGloo),
which NCCL does not take from PyTorch's allocator and symcost does not model.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from symcost.frontends.builtin.mlp import MLP

out_dir, shards = sys.argv[1], sys.argv[2].split(",")
D, L, B, S = (int(x) for x in sys.argv[3:7])
MIXED = len(sys.argv) > 7 and sys.argv[7] == "bf16-mixed"
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()


def run(shard):
    from torch.distributed.device_mesh import init_device_mesh

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
        with torch.autocast("cpu", dtype=torch.bfloat16) if MIXED else contextlib.nullcontext():
            loss = model(x).pow(2).mean()
        loss.backward()
        del loss
        opt.step()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from memory_oracle import steady_peak

    m = steady_peak(step, opt, list(model.parameters()) + list(model.buffers()) + [x], ("aten::", "c10d::"))
    # the same step once more under PyTorch's MemTracker: the storages of the ops PyTorch
    # dispatches (not the scratch a backend allocates in C++, e.g. gloo's collective buffers)
    from torch.distributed._tools.mem_tracker import MemTracker

    opt.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(model, opt, x)
    with mt:
        step()
    tracked = max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
    with open(os.path.join(out_dir, f"{shard}-rank{rank}.json"), "w") as f:
        json.dump({**m,
                   "memtracker": tracked, "world": n}, f)


for shard in shards:
    run(shard)
    dist.barrier()
from gloo_teardown import finish  # (tests/data: on the path)
finish()  # every rank past the last barrier before any closes (gloo_teardown.py)

"""One rank of a real FSDP2 step with compiled blocks on CPU (gloo), for tests/test_compile.py:
run with ``torchrun --standalone --nproc-per-node N compile_dp_rank.py OUT H D L V B S``.

Each rank builds the ``megatron-gpt`` built-in (real CPU tensors, fp32), compiles every block
and then shards it as torchtitan's ``parallelize_llama`` does (``apply_compile``:
``torch.compile(block, fullgraph=True)`` with inductor, the compiled module put in the block's
place; then ``fully_shard`` per block and at the root), runs one training step and writes
``OUT/rank{r}.json``: the bytes autograd saved (saved_tensors_hooks, parameters excluded,
storages once).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import symcost

out_dir = sys.argv[1]
H, D, L, V, B, S = (int(x) for x in sys.argv[2:8])
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

spec = symcost.resolve("megatron-gpt")
values = {**spec.defaults, "H": H, "D": D, "L": L, "V": V, "B": B, "S": S}
torch.manual_seed(0)
model = spec.build(values)
model.train()
blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == L][0]
mesh = init_device_mesh("cpu", (n,))
for i in range(len(blocks)):
    blocks[i] = torch.compile(blocks[i], fullgraph=True)
    fully_shard(blocks[i], mesh=mesh, reshard_after_forward=True)
fully_shard(model, mesh=mesh, reshard_after_forward=False)
args, kwargs = spec.make_inputs(values, torch.device("cpu"))

seen, saved, keep = set(), [0], []


def pack(t):
    keep.append(t)
    if isinstance(t, torch.nn.Parameter):
        return t
    key = StorageWeakRef(t.untyped_storage()).cdata
    if key in {StorageWeakRef(getattr(p, "_local_tensor", p).untyped_storage()).cdata for p in model.parameters()}:
        return t  # on a parameter's storage as it is now (FSDP2's unsharded weight): not an activation
    if key not in seen:
        seen.add(key)
        saved[0] += t.untyped_storage().nbytes()
    return t


with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    loss = spec.loss(model(*args, **kwargs), (args, kwargs))
loss.backward()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"saved": saved[0], "world": n}, f)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_teardown import finish  # noqa: E402

finish()  # gloo barrier, every rank past it, teardown, then os._exit(0) (gloo_teardown.py)

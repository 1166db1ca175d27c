"""One rank of a real pipeline-parallel step on CPU (gloo), for tests/test_pipeline_parallel.py:
``torchrun --standalone --nproc-per-node PP pp_rank.py OUT SCHEDULE M B S H D L V F [BLOCKS]``
(``BLOCKS``: the blocks of each stage, comma-separated; default L // PP each, the first L mod PP
stages one more).

Each rank builds the whole ``cs336-lm`` at L blocks, deletes the blocks of the other stages
(torchtitan's pipeline_llm does the same; symcost.frontends.pipeline.make_stage finds what
runs before and after the blocks), wraps its stage module in
``torch.distributed.pipelining.PipelineStage`` and runs ``Schedule1F1B`` / ``ScheduleGPipe``
over M micro-batches of B sequences. One warm-up step (PyTorch's shape inference runs a forward),
then one measured step writes ``OUT/rank{r}.json``: model FLOPs (FlopCounterMode), bytes autograd
saved (saved_tensors_hooks, parameters and buffers excluded, storages once) and the bytes of
every send and receive seen at dispatch.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from symcost.frontends.builtin.cs336_lm import spec as cs336
from symcost.frontends.pipeline import make_stage, probe_boundary

out_dir, schedule = sys.argv[1], sys.argv[2]
M, B, S, H, D, L, V, Fd = (int(x) for x in sys.argv[3:11])
dist.init_process_group("gloo")
rank, pp = dist.get_rank(), dist.get_world_size()
spec = cs336()
values = {"B": B, "S": S, "H": H, "D": D, "L": L, "V": V, "F": Fd}

with torch.device("meta"):
    meta = spec.build(values)
pre, post, templates, x_meta = probe_boundary(meta, "layers", *spec.make_inputs(values, torch.device("meta")))
torch.manual_seed(0)
model = spec.build(values)
per = ([int(x) for x in sys.argv[11].split(",")] if len(sys.argv) > 11
       else [L // pp + (1 if s < L % pp else 0) for s in range(pp)])
assert len(per) == pp and sum(per) == L, (per, pp, L)
lo = sum(per[:rank])
model.layers = torch.nn.ModuleList(list(model.layers)[lo:lo + per[rank]])  # the other stages' blocks deleted
part = "first" if rank == 0 else "last" if rank == pp - 1 else "middle"
make_stage(model, "layers", part, pre, post, templates)

tokens = torch.randint(0, V, (M * B, S))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


stage = PipelineStage(model, rank, pp, torch.device("cpu"))
cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
sched = cls(stage, M, loss_fn=loss_fn)


def step():
    target = tokens.roll(-1, dims=1)
    if rank == 0:
        sched.step(tokens)
    elif rank == pp - 1:
        sched.step(_in0=tokens, target=target)
    else:
        sched.step(_in0=tokens)


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from memory_oracle import _levels  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    step()  # warm-up: PyTorch's stage metadata inference, gradients, receive buffers
evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
warm_level = sum(e.nbytes() for e in evs)  # bytes the first step allocated and still holds
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    step()
top, top_ops = _levels(prof)
grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
p2p = {"send": 0, "recv": 0}


class P2P(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("c10d.send", "c10d.recv_"):
            p2p["send" if name == "c10d.send" else "recv"] += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


static = {StorageWeakRef(t.untyped_storage()).cdata for t in list(model.parameters()) + list(model.buffers())}
seen, saved, refs = set(), [0], []


def pack(t):
    ref = StorageWeakRef(t.untyped_storage())
    key = ref.cdata
    if key not in seen and key not in static:
        refs.append(ref)  # keeps the StorageImpl (not its data): a later storage cannot take its key
        seen.add(key)
        saved[0] += t.untyped_storage().nbytes()
    return t


fc = FlopCounterMode(display=False)
with fc, P2P(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    step()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"top": top, "top_ops": top_ops, "kept": warm_level - grads, "grads": grads,
               "flops": fc.get_total_flops(), "saved": saved[0], "p2p": p2p, "pp": pp,
               "params": sum(p.numel() for p in model.parameters()),
               "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}, f)
from gloo_teardown import finish  # (tests/data: on the path)
finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)

"""One rank of a real pipeline-parallel step of the guide's encoder-decoder on CPU (gloo), for
tests/test_pipeline_stacks.py: ``torchrun --standalone --nproc-per-node PP pp_stacks_rank.py OUT
ENCDEC_PY M B S S_ENC H D V F L_ENC L_DEC``.

Each rank builds the whole model of ``ENCDEC_PY`` (docs/user-guide.md's ``encdec.py``), keeps its
stage written by hand (tests/data/encdec_stage.py: the encoder's and the decoder's blocks cut as
one list, the encoder's output carried), wraps it in ``torch.distributed.pipelining.PipelineStage``
(shapes inferred by PyTorch) and runs ``Schedule1F1B`` over M micro-batches of B sequences. One
warm-up step, then a measured step (torch.profiler's allocator level) and one more under
FlopCounterMode and a dispatch mode counting every send and receive writes ``OUT/rank{r}.json``.
"""
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(__file__))
from encdec_stage import Stage  # noqa: E402

out_dir, path = sys.argv[1], sys.argv[2]
M, B, S, S_enc, H, D, V, Fd, L_enc, L_dec = (int(x) for x in sys.argv[3:13])
dist.init_process_group("gloo")
rank, pp = dist.get_rank(), dist.get_world_size()
load = importlib.util.spec_from_file_location("encdec", path)
mod = importlib.util.module_from_spec(load)
load.loader.exec_module(mod)
spec = mod.spec()
values = {"B": B, "S": S, "S_enc": S_enc, "H": H, "D": D, "V": V, "F": Fd, "L_enc": L_enc, "L_dec": L_dec}
torch.manual_seed(0)
model = Stage(spec.build(values), L_enc, L_dec, pp, rank)
src = torch.randint(0, V, (M * B, S_enc))
tgt = torch.randint(0, V, (M * B, S))


def loss_fn(logits, target):
    return spec.loss(logits, ((None, target), {}))


stage = PipelineStage(model, rank, pp, torch.device("cpu"))
sched = Schedule1F1B(stage, M, loss_fn=loss_fn)


def step():
    # (the last stage keeps each micro-batch's loss, not its logits: torchtitan's trainer steps the
    # schedule with return_outputs=False, as symcost's run of the schedule does)
    if rank == pp - 1:
        sched.step(src=src, tgt=tgt, target=tgt, return_outputs=False)
    else:
        sched.step(src=src, tgt=tgt, return_outputs=False)


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from memory_oracle import _levels  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    step()  # warm-up: PyTorch's stage metadata inference, gradients, receive buffers
evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
warm_level = sum(e.nbytes() for e in evs)
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


fc = FlopCounterMode(display=False)
with fc, P2P():
    step()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"top": top, "top_ops": top_ops, "kept": warm_level - grads, "grads": grads,
               "flops": fc.get_total_flops(), "p2p": p2p, "pp": pp,
               "params": sum(p.numel() for p in model.parameters())}, f)
from gloo_teardown import finish  # noqa: E402  (tests/data: on the path)
finish()

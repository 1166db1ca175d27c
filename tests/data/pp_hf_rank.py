"""One rank of a real pipeline-parallel step of a transformers model on CPU (gloo), for
tests/test_pipeline_parallel.py: ``torchrun --standalone --nproc-per-node PP pp_hf_rank.py OUT M B S
L HIDDEN HEADS KV FFN V``.

Each rank builds the whole ``hf:llama`` at those sizes (fp32, eager ``sdpa``), deletes the blocks
of the other stages (as torchtitan's pipeline splits a model; symcost.frontends.pipeline.make_stage
finds what runs before and after the blocks), gives every stage the micro-batch's keyword inputs
(``input_ids``, ``labels``) and lets the last one return the model's own loss, wraps it in
``torch.distributed.pipelining.PipelineStage`` and runs ``Schedule1F1B`` over M micro-batches of
B sequences (``return_outputs=False``). A warm-up step, then one measured step writes
``OUT/rank{r}.json``: the bytes live after the warm-up besides the gradients (``kept``), the
gradients, the highest allocator level of the step above its start (``top``, torch.profiler, as
tests/data/pp_rank.py measures it) and the parameters.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from symcost.frontends.models import resolve
from symcost.frontends.pipeline import make_stage, probe_spec

out_dir = sys.argv[1]
M, B, S, L, HID, HEADS, KV, FFN, V = (int(x) for x in sys.argv[2:11])
dist.init_process_group("gloo")
rank, pp = dist.get_rank(), dist.get_world_size()
spec = resolve("hf:llama", {"num_hidden_layers": str(L), "hidden_size": str(HID), "num_attention_heads": str(HEADS),
                            "num_key_value_heads": str(KV), "intermediate_size": str(FFN), "vocab_size": str(V)})
values = spec.values({"B": B, "S": S})
# (what runs before and after the blocks, found on fake tensors: transformers reads values on meta)
pre, post, templates, _, _ = probe_spec(spec, values, "model.layers", "fp32")
torch.manual_seed(0)
model = spec.build(values)
per = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]
lo = sum(per[:rank])
model.model.layers = torch.nn.ModuleList(list(model.model.layers)[lo:lo + per[rank]])
model.config.num_hidden_layers = per[rank]
last = rank == pp - 1
make_stage(model, "model.layers", "first" if rank == 0 else "last" if last else "middle", pre, post, templates)
if last:
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k).loss

tokens = torch.randint(0, V, (M * B, S))
stage = PipelineStage(model, rank, pp, torch.device("cpu"))
sched = Schedule1F1B(stage, M, loss_fn=lambda out, target: out)


def step():
    if last:
        sched.step(input_ids=tokens, labels=tokens, target=tokens, return_outputs=False)
    else:
        sched.step(input_ids=tokens, labels=tokens)


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
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"top": top, "top_ops": top_ops, "kept": warm_level - grads, "grads": grads, "pp": pp,
               "params": sum(p.numel() for p in model.parameters())}, f)
from gloo_teardown import finish  # (tests/data: on the path)
finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)

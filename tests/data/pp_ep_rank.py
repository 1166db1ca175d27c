"""One rank of a real pipeline step whose stages are expert-parallel, on CPU (gloo), for
tests/test_pipeline_ep.py:
``torchrun --standalone --nproc-per-node PP*EP*DP pp_ep_rank.py OUT PP EP M H D L V F E R B S [DP]``.

The ranks form the mesh ``init_device_mesh("cpu", (PP, EP), ("pp", "ep"))``: the pipeline
outermost, an EP group EP consecutive ranks (torchtitan's ``ParallelDims``: EP borrowed from the
data-parallel ranks inside each pipeline stage's mesh). Each rank builds the built-in ``moe`` at L
blocks (fp32), deletes the blocks of the other stages (torchtitan's ``pipeline_llm``;
``symcost.frontends.pipeline.make_stage`` swaps what runs before and after the blocks), then
shards its stage's experts over its ``ep`` group with ``symcost.frontends.expert_parallel.apply``
(the layout is the input: ``Shard(0)`` DTensor experts, the all-to-all dispatch and combine; what
is measured is PyTorch running it), as torchtitan's ``parallelize_*`` runs ``apply_moe_ep_tp`` on
each stage module after the split. The stage goes into ``PipelineStage`` over the pp group and
``Schedule1F1B`` runs M micro-batches of B sequences, every router forced to the balanced
assignment (tests/data/ep_rank.py ``balanced_router``); the EP ranks of a stage take their own
tokens (the pipeline ranks of one EP coordinate the same ones: they are one data-parallel
replica's pipeline). With DP, the mesh is ``(pp, dp_shard, ep)`` and each stage module is then
wrapped by FSDP2 as torchtitan's ``apply_fsdp`` wraps it under EP (tests/data/ep_rank.py
``fsdp_as_torchtitan``: the experts over ``dp_shard``, each block and the stage's root over the
flattened ``dp_shard × ep``), and every data-parallel rank takes its own tokens. After a warm-up
step, one measured step writes ``OUT/rank{r}.json``:

* model FLOPs, each op counted by ``torch.utils.flop_counter``'s own registry on the local
  tensors DTensor computes with (a ``TorchDispatchMode`` that hands DTensor ops to DTensor);
* bytes autograd saved over the step (``saved_tensors_hooks``; parameters and buffers excluded,
  each storage once);
* bytes per rank of every all-to-all, (n-1)/n of its input (nccl-tests doc/PERFORMANCE.md, n the
  size of its process group as PyTorch resolves it), by group, and the point-to-point sends and
  receives by their tensors' bytes; FSDP2's all-gathers (n-1)/n of their output and
  reduce-scatters (n-1)/n of their input, by group; any other collective counted apart;
* the parameter elements the rank holds (DTensor local shards) and the whole stage's.
"""
import json
import os
import sys
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from ep_rank import _group_label, _group_size, balanced_router, fsdp_as_torchtitan  # noqa: E402

from symcost.frontends.builtin.cs336_lm import lm_loss  # noqa: E402
from symcost.frontends.builtin.moe import MoELM  # noqa: E402
from symcost.frontends.expert_parallel import apply  # noqa: E402
from symcost.frontends.pipeline import make_stage, probe_boundary  # noqa: E402

out_dir = sys.argv[1]
PP, EP, M = (int(x) for x in sys.argv[2:5])
v = dict(zip("HDLVFERBS", (int(x) for x in sys.argv[5:14])))
DP = int(sys.argv[14]) if len(sys.argv) > 14 else 1
dist.init_process_group("gloo")
if DP > 1:
    mesh = init_device_mesh("cpu", (PP, DP, EP), mesh_dim_names=("pp", "dp_shard", "ep"))
else:
    mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
pp_rank, ep_rank = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
dp_rank = mesh["dp_shard"].get_local_rank() if DP > 1 else 0
groups = {mesh["ep"].get_group().group_name: "EP", mesh["pp"].get_group().group_name: "PP"}


def build(device=None):
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"])


meta = build("meta")
tokens_meta = torch.randint(0, v["V"], (v["B"], v["S"]), device="meta")
pre, post, templates, _ = probe_boundary(meta, "layers", (tokens_meta,), {})
L = v["L"]
per = [L // PP + (1 if s < L % PP else 0) for s in range(PP)]
lo = sum(per[:pp_rank])
model = build()
model.layers = torch.nn.ModuleList(list(model.layers)[lo:lo + per[pp_rank]])  # the other stages' blocks deleted
part = "first" if pp_rank == 0 else "last" if pp_rank == PP - 1 else "middle"
make_stage(model, "layers", part, pre, post, templates)
whole = sum(p.numel() for p in model.parameters())
apply(model, mesh["ep"])  # torchtitan's apply_moe_ep_tp on the stage module, after the split
if DP > 1:  # torchtitan's apply_fsdp under EP, on the stage module
    flat = fsdp_as_torchtitan(model, mesh)
    groups.update({mesh["dp_shard"].get_group().group_name: "DP_expert", flat.get_group().group_name: "DP"})

torch.manual_seed(100 + dp_rank * EP + ep_rank)  # each data-parallel rank its own tokens, a pipeline the same
tokens = torch.randint(0, v["V"], (M * v["B"], v["S"]))
stage = PipelineStage(model, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
sched = Schedule1F1B(stage, M, loss_fn=lambda logits, target: lm_loss(logits, ((target,), {})))


def step():
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


comm, flops = {}, [0]


def add(label, kind, n):
    comm.setdefault(label, {}).setdefault(kind, Fraction(0))
    comm[label][kind] += n


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if name == "_c10d_functional.all_to_all_single":  # (input, out_splits, in_splits, group)
            n = _group_size(args)
            add(_group_label(args, groups), "all_to_all", Fraction(n - 1, n) * nbytes(args[0]))
        elif name in ("c10d._allgather_base_", "c10d._reduce_scatter_base_"):  # FSDP2's (output, input, group, ...)
            n = _group_size(args)
            kind, t = ("all_gather", args[0]) if "allgather" in name else ("reduce_scatter", args[1])
            add(_group_label(args, groups), kind, Fraction(n - 1, n) * nbytes(t))
        elif name in ("c10d.send", "c10d.recv_"):
            add(_group_label(args, groups), "send" if name == "c10d.send" else "recv", sum(map(nbytes, args[0])))
        elif name.startswith(("_c10d_functional.", "c10d.")) and not name.endswith(("wait_tensor",
                                                                                      "_wrap_tensor_autograd")):
            add("other", name, 1)  # (any other collective: there should be none)
        elif func.overloadpacket in flop_registry:
            flops[0] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


static = {StorageWeakRef(local(t).untyped_storage()).cdata for t in list(model.parameters()) + list(model.buffers())}
seen, saved, refs = set(), [0], []


def pack(t):
    ref = StorageWeakRef(local(t).untyped_storage())
    if ref.cdata not in seen and ref.cdata not in static:
        refs.append(ref)  # (keeps the StorageImpl: a later storage cannot take its key)
        seen.add(ref.cdata)
        saved[0] += local(t).untyped_storage().nbytes()
    return t


with balanced_router():
    step()  # warm-up: the schedule's shape inference, the gradients
    model.zero_grad(set_to_none=True)
    with Count(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"pp_rank": pp_rank, "ep_rank": ep_rank, "flops": flops[0], "saved": saved[0],
               "shard": sum(local(p).numel() for p in model.parameters()), "whole": whole,
               "comm": {g: {k: str(x) for k, x in d.items()} for g, d in comm.items()}}, f)
from gloo_teardown import finish  # (tests/data: on the path)
finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)

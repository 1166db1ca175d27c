"""One rank of a real pipeline step composed with context parallelism on CPU (gloo), for
tests/test_context_parallel_pp.py:
``torchrun --standalone --nproc-per-node PP*CP pp_cp_rank.py OUT PP CP M ROTATE H K D L V F B S``.

The ranks form torchtitan's mesh ``init_device_mesh("cpu", (PP, CP), ("pp", "cp"))`` (pp
outermost). Each rank builds the whole ``hf:llama`` at those sizes (fp32, ``sdpa`` attention,
the same weights on every rank), deletes the blocks of the other stages (torchtitan's
``pipeline_llm``; ``symcost.frontends.pipeline.make_stage`` swaps what runs before and after
the blocks, probed at the rank's S/CP tokens), gives every stage the micro-batch's keyword
inputs (``input_ids``, ``labels``: the same tensor) and lets the last one return the model's own
loss, wraps it in ``PipelineStage`` over the pp group and runs ``Schedule1F1B`` over M
micro-batches of B sequences (``return_outputs=False``), as torchtitan's trainer does under CP:
the step's tokens sharded over the cp mesh before the schedule (here PyTorch's
``context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1], no_restore_buffers=...)``: the
round-robin load-balanced S/CP tokens of every sequence, ``F.scaled_dot_product_attention``
patched for the whole step, ``set_rotate_method(ROTATE)``; torchtitan's
``prepare_context_parallel_input`` shards each micro-batch the same way) and the schedule's
step inside it; ``symcost.frontends.context_parallel.cpu_ring()`` registers the CPU's fused
kernel with PyTorch's ring code (tests/data/cp_rank.py). A warm-up step, then measured steps
write ``OUT/rank{r}.json``:

* model FLOPs (``torch.utils.flop_counter``'s registry on the local tensors, the CPU's fused
  attention by ``cp_rank.cpu_flash``);
* bytes autograd saved for backward in the step (``saved_tensors_hooks``, each storage once,
  parameters excluded: all micro-batches'; a weak reference to each saved storage keeps its
  address from being reused by a later micro-batch's);
* bytes of every collective per group and kind (``CP``'s all-gather and all-to-all as
  ``cp_rank.measure`` types them; ``PP``'s sends and receives by their tensors' bytes);
* the parameters' elements and bytes, buffers, gradients after the step, and the step's peak
  (PyTorch's ``MemTracker`` over the measured step, as tests/data/pp_mesh_rank.py measures it);
* ``ring_error``: the ring's causal attention against one device's (``cp_rank.ring_matches``).
"""
import json
import os
import sys
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, os.path.dirname(__file__))
from cp_rank import cp_step, cpu_flash, ring_matches, spec_and_values  # noqa: E402

from symcost.frontends.pipeline import make_stage, probe_spec  # noqa: E402

out_dir = sys.argv[1]
PP, CP, M = (int(x) for x in sys.argv[2:5])
rotate = sys.argv[5]
v = dict(zip("HKDLVFBS", (int(x) for x in sys.argv[6:14])))
dist.init_process_group("gloo")
world = init_device_mesh("cpu", (PP, CP), mesh_dim_names=("pp", "cp"))
cp_mesh, pp_group = world["cp"], world["pp"].get_group()
pp_rank, cp_rank = world["pp"].get_local_rank(), cp_mesh.get_local_rank()
groups = {cp_mesh.get_group().group_name: "CP", pp_group.group_name: "PP"}
err = ring_matches(cp_mesh, v, rotate)

spec, values = spec_and_values(v)
# what runs before and after the blocks, at the rank's S/CP tokens (found on fake tensors)
pre, post, templates, _, _ = probe_spec(spec, dict(values, S=v["S"] // CP), "model.layers", "fp32")
torch.manual_seed(0)
model = spec.build(values)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
L = v["L"]
per = [L // PP + (1 if s < L % PP else 0) for s in range(PP)]
lo = sum(per[:pp_rank])
model.model.layers = torch.nn.ModuleList(list(model.model.layers)[lo:lo + per[pp_rank]])
model.config.num_hidden_layers = per[pp_rank]
last = pp_rank == PP - 1
make_stage(model, "model.layers", "first" if pp_rank == 0 else "last" if last else "middle", pre, post, templates)
if last:
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k).loss

torch.manual_seed(1)  # (the same tokens on every rank)
tokens = torch.randint(0, v["V"], (M * v["B"], v["S"]))
stage = PipelineStage(model, pp_rank, PP, torch.device("cpu"), group=pp_group)
sched = Schedule1F1B(stage, M, loss_fn=lambda out, target: out)
ring = cp_step(cp_mesh, rotate)


def step():
    with ring():
        if last:
            sched.step(input_ids=tokens, labels=tokens, target=tokens, return_outputs=False)
        else:
            sched.step(input_ids=tokens, labels=tokens, return_outputs=False)


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def nbytes(t):
    t = local(t)
    return t.numel() * t.element_size()


comm, flops = {}, [0]


def add(group, kind, amount):
    g = groups[group.group_name if hasattr(group, "group_name") else group]
    comm.setdefault(g, {}).setdefault(kind, Fraction(0))
    comm[g][kind] += amount


def pg_of(args):
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a)
    return _resolve_process_group(next(a for a in reversed(args) if isinstance(a, str)))


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if name == "_c10d_functional.all_gather_into_tensor":
            pg = pg_of(args)
            add(pg, "all_gather", Fraction(pg.size() - 1, pg.size()) * nbytes(out))
        elif name == "_c10d_functional.all_to_all_single":  # (input, out_splits, in_splits, group)
            pg = pg_of(args)
            x, splits, me = args[0], list(args[2]), dist.get_rank(pg)
            row = x.numel() // x.shape[0] * x.element_size()
            add(pg, "all_to_all", sum(s for j, s in enumerate(splits) if j != me) * row if splits
                else Fraction(pg.size() - 1, pg.size()) * nbytes(x))
        elif name in ("c10d.send", "c10d.recv_"):
            add(pg_of(args), "send" if name == "c10d.send" else "recv", sum(nbytes(t) for t in args[0]))
        elif name == "aten._scaled_dot_product_flash_attention_for_cpu":
            flops[0] += cpu_flash(args[0].shape, args[1].shape, args[2].shape)
        elif name == "aten._scaled_dot_product_flash_attention_for_cpu_backward":
            flops[0] += 2 * cpu_flash(args[1].shape, args[2].shape, args[3].shape)
        elif func.overloadpacket in flop_registry:
            flops[0] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


static = {StorageWeakRef(local(p).untyped_storage()).cdata for p in list(model.parameters()) + list(model.buffers())}
seen, saved, refs = set(), [0], []


def pack(t):
    st = local(t).untyped_storage()
    ref = StorageWeakRef(st)
    # (the weak reference keeps the StorageImpl, not its data: a micro-batch's storage freed by its
    # backward is not taken for a later one's allocated at the same address)
    refs.append(ref)
    if ref.cdata not in seen and ref.cdata not in static:
        seen.add(ref.cdata)
        saved[0] += st.nbytes()
    return t


class StepTracker(MemTracker):
    """``MemTracker`` without its per-module statistics, which refuse a module called more than
    once per step (tests/data/pp_mesh_rank.py)."""

    def _pre_fw_hook(self, *args, **kwargs):
        pass

    _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook


cpu = torch.device("cpu")
with context_parallel(cp_mesh, buffers=[tokens], buffer_seq_dims=[1], no_restore_buffers={tokens}):
    shard_tokens = tokens.shape[1]
    step()  # the first step: the schedule's shape inference
    model.zero_grad(set_to_none=True)
    tracker = StepTracker()
    tracker.track_external(model)
    with tracker:
        step()  # warm-up: the engine's buffers, the gradients
        tracker._peak_mem = {d: snap["Total"] for d, snap in tracker.get_tracker_snapshot().items()}
        step()
    peak = tracker._peak_mem[cpu]
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    with Count(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"pp_rank": pp_rank, "cp_rank": cp_rank, "peak": peak, "grads": grads, "flops": flops[0],
               "saved": saved[0], "tokens": shard_tokens, "ring_error": err,
               "params": sum(local(p).numel() for p in model.parameters()),
               "params_bytes": sum(nbytes(p) for p in model.parameters()),
               "buffers": sum(nbytes(b) for b in model.buffers()),
               "comm": {g: {k: str(x) for k, x in d.items()} for g, d in comm.items()}}, f)
from gloo_teardown import finish  # noqa: E402

finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)

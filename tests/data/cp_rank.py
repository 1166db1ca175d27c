"""One rank of a context-parallel training step (tests/test_context_parallel.py), on real tensors
with gloo, or in-process on the fake process group: the oracle of symcost's per-rank numbers.

``python -m torch.distributed.run --standalone --nproc-per-node N cp_rank.py OUT ROTATE H K D L V F B S [DP] [tp=TP]``
(several runs on the same ranks: their arguments separated by ``+``; without DP the N ranks are
the cp group; with DP the mesh is torchtitan's ``(dp_shard DP, cp N/DP)`` and ``fully_shard``
runs per block and the root over the flattened ``dp_shard_cp``; with ``tp=TP``
the mesh is torchtitan's ``(cp N/TP, tp TP)``, the model's tensor-parallel plan applied over ``tp``
by transformers' own code first (:func:`tensor_parallel`), then ``context_parallel`` over ``cp``,
as torchtitan's ``parallelize_llama`` applies TP and its train context CP; with both, the mesh
``(dp_shard DP, cp, tp TP)``, the plan over ``tp``, then ``fully_shard`` over ``dp_shard_cp``) builds a small
``transformers`` Llama (sdpa attention; ``hf:llama`` with those sizes, fp32) with
the same weights on every rank, and runs it as a user of PyTorch's context parallelism does:

* ``context_parallel(mesh, buffers=[input_ids], buffer_seq_dims=[1], no_restore_buffers=...)``
  (``torch.distributed.tensor.experimental``) over the 1-D ``cp`` mesh: the rank's load-balanced
  S/CP tokens (the ids are also the labels, as in symcost's hf inputs), ``F.scaled_dot_product_
  attention`` patched; ``set_rotate_method(ROTATE)``;
* inside it ``symcost.frontends.context_parallel.cpu_ring()``: PyTorch 2.13's CP rules and
  handler cover CUDA's fused kernels only, this registers the CPU's fused kernel with the same
  ring code (the module's docstring); :func:`ring_matches` checks on each rank that the ring's
  output, gathered back (``context_parallel_unshard``), equals one device's causal SDPA.

:func:`measure` is what each rank measures (after a warm-up step: DTensor's shape propagation):

* model FLOPs, each op's count by ``torch.utils.flop_counter``'s registry, on the local tensors
  (a ``TorchDispatchMode`` that hands DTensor ops to DTensor, as ``CommDebugMode`` does), and the
  CPU's fused attention, which the registry lacks, by :func:`cpu_flash`;
* bytes autograd saved for backward (``saved_tensors_hooks``; a DTensor's local tensor;
  parameters and buffers excluded; each storage once);
* bytes each rank sends per collective kind, typed here: all-gather (n-1)/n of its output
  (nccl-tests' doc/PERFORMANCE.md, ring), all-to-all the input elements its split sizes send to
  other ranks (``all_to_all_single``'s ``input_split_sizes`` less the rank's own; (n-1)/n of the
  input where no splits are given);
* the step's peak (zero_grad, forward, loss, backward, AdamW step in its for-loop form) by
  PyTorch's ``MemTracker`` (a steady-state step, after the warm-up).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from fractions import Fraction

SIZES = "HKDLVFBS"


def config(v: dict) -> dict:
    """The ``hf:llama`` config overrides of sizes ``v``."""
    return {"num_hidden_layers": str(v["L"]), "hidden_size": str(v["H"] * v["D"]),
            "num_attention_heads": str(v["H"]), "num_key_value_heads": str(v["K"]),
            "intermediate_size": str(v["F"]), "vocab_size": str(v["V"]), "head_dim": str(v["D"])}


def spec_and_values(v: dict):
    from symcost.frontends.models import resolve

    spec = resolve("hf:llama", config=config(v))
    values = dict(spec.defaults)
    values.update({k: v[k] for k in SIZES})
    return spec, values


def _group_size_rank(args):
    import torch.distributed as dist
    from gloo_groups import process_group

    pg = process_group(args)
    return pg.size(), dist.get_rank(pg), pg.group_name


def cpu_flash(q, k, v) -> int:
    """Model FLOPs of the CPU flash-attention kernel, which FlopCounterMode's registry leaves out
    (docs/conventions.md): Q·Kᵀ and P·V, 2·B·H·S_q·S_k·(D + D_v) (torch's ``sdpa_flop_count``
    written out; it asserts as many key as query heads, grouped-query attention has fewer). Its
    backward's four gradient products are twice that."""
    b, h, s_q, d = q
    return 2 * b * h * s_q * k[2] * (d + v[3])


def measure(model, spec, args, kwargs, optimizer, step_context, groups=None) -> dict:
    """FLOPs, saved bytes, collective bytes per kind and MemTracker's peak of one rank's step
    (module docstring). ``step_context()``: the context each step runs in (CP's). ``groups``:
    ``{process group name: label}`` where the rank has more than the CP group (FSDP2's
    ``dp_shard × cp``): collective bytes are then keyed ``"LABEL.kind"``, FSDP2's all-gathers
    (n-1)/n of their output and reduce-scatters (n-1)/n of their input included."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    comm = {"all_gather": Fraction(0), "all_to_all": Fraction(0)} if not groups else {
        f"{g}.{k}": Fraction(0) for g in sorted(set(groups.values()))
        for k in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")}
    flops = [0]

    def add(kind, args, nbytes):
        n, rank, name = _group_size_rank(args)
        comm[f"{groups[name]}.{kind}" if groups else kind] += nbytes(n, rank)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func.overloadpacket)
            if name == "_c10d_functional.all_gather_into_tensor":
                add("all_gather", args, lambda n, r: Fraction(n - 1, n) * out.numel() * out.element_size())
            elif name == "c10d._allgather_base_":  # FSDP2's (output, input, group, ...)
                add("all_gather", args, lambda n, r: Fraction(n - 1, n) * args[0].numel() * args[0].element_size())
            elif name == "_c10d_functional.all_reduce":  # (input, op, group): ring, 2(n-1)/n of the input
                add("all_reduce", args, lambda n, r: Fraction(2 * (n - 1), n) * args[0].numel() * args[0].element_size())
            elif name == "c10d._reduce_scatter_base_":  # (output, input, group, ...)
                add("reduce_scatter", args, lambda n, r: Fraction(n - 1, n) * args[1].numel() * args[1].element_size())
            elif name == "_c10d_functional.all_to_all_single":  # (input, out_splits, in_splits, group)
                x, splits = args[0], list(args[2])
                row = x.numel() // x.shape[0] * x.element_size()
                add("all_to_all", args, lambda n, r: sum(s for j, s in enumerate(splits) if j != r) * row if splits
                    else Fraction(n - 1, n) * x.numel() * x.element_size())
            elif name == "aten._scaled_dot_product_flash_attention_for_cpu":
                flops[0] += cpu_flash(args[0].shape, args[1].shape, args[2].shape)
            elif name == "aten._scaled_dot_product_flash_attention_for_cpu_backward":
                flops[0] += 2 * cpu_flash(args[1].shape, args[2].shape, args[3].shape)
            elif func.overloadpacket in flop_registry:
                flops[0] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            return out

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    static = {StorageWeakRef(local(p).untyped_storage()).cdata for p in list(model.parameters()) + list(model.buffers())}
    seen, saved = set(), [0]

    def pack(t):
        if isinstance(t, torch.nn.Parameter):  # (FSDP2's unsharded parameters, between all-gather and reshard)
            return t
        st = local(t).untyped_storage()
        if StorageWeakRef(st).cdata in {StorageWeakRef(local(p).untyped_storage()).cdata for p in model.parameters()}:
            return t  # (a view of a parameter as it is now: FSDP2's unsharded one)
        key = StorageWeakRef(st).cdata
        if key not in seen and key not in static:
            seen.add(key)
            saved[0] += st.nbytes()
        return t

    def step():
        optimizer.zero_grad(set_to_none=True)
        with step_context():
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
            loss.backward()
        del loss
        optimizer.step()

    step()  # warm-up: DTensor's shape propagation, the optimizer state
    optimizer.zero_grad(set_to_none=True)
    with Count(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with step_context():
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
            loss.backward()
        del loss
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(model, optimizer, *[t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)])
    with mt:
        step()
    peak = max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
    return {"flops": flops[0], "saved": saved[0], "comm": {k: str(c) for k, c in comm.items()}, "peak": peak,
            "shard": sum(local(p).numel() for p in model.parameters())}


def cp_step(mesh, rotate: str):
    """The context a CP step runs in on this CPU: ``set_rotate_method(rotate)``, and the CPU's
    fused kernel under PyTorch's CP dispatcher (``cpu_ring``). The caller has entered
    ``context_parallel(mesh, ...)`` (the dispatcher itself)."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from symcost.frontends.context_parallel import cpu_ring

    set_rotate_method(rotate)
    return cpu_ring


def tensor_parallel(model, mesh) -> None:
    """``model``'s tensor-parallel plan applied over the 1-D ``tp`` ``mesh`` by transformers' own
    code, as ``from_pretrained(..., tp_plan="auto")`` applies it (``_resolve_parallel_plans``, then
    ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``), not symcost's: q, k, v
    and gate/up column-parallel (each rank H/TP query and K/TP key/value heads), o and down
    row-parallel, the head's logits gathered."""
    import warnings

    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=mesh.size()))
    model._mesh_manager = None
    with warnings.catch_warnings():  # (rules for modules this config leaves out: skipped, as transformers does)
        warnings.filterwarnings("ignore", message=r"Parallelize plan key .* could not be resolved", category=UserWarning)
        apply_tensor_parallelism(model, mesh, tp_plan)


def ring_matches(mesh, v: dict, rotate: str) -> float:
    """The largest difference between the ring's causal attention (this rank's shard, gathered
    back by ``context_parallel_unshard``) and one device's ``F.scaled_dot_product_attention``,
    on random q, k, v of [B, H, S, D] (the same on every rank)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

    from symcost.frontends.context_parallel import cpu_ring

    set_rotate_method(rotate)
    g = torch.Generator().manual_seed(7)
    q, k, v_ = (torch.randn(v["B"], v["H"], v["S"], v["D"], generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v_, is_causal=True)
    qs, ks, vs = q.clone(), k.clone(), v_.clone()
    with context_parallel(mesh, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers={qs, ks, vs}), cpu_ring():
        got = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        full = context_parallel_unshard(mesh, [got], [2])[0]
    return float((full - want).abs().max())


def main():
    """Each run of the command line (``OUT ROTATE H K D L V F B S [DP] [tp=TP]``; several runs
    separated by ``+``, all on the one process group) in turn."""
    import torch.distributed as dist

    argv, runs = sys.argv[1:], []
    while "+" in argv:
        runs.append(argv[:argv.index("+")])
        argv = argv[argv.index("+") + 1:]
    dist.init_process_group("gloo")
    for args in runs + [argv]:
        run(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gloo_teardown import finish

    finish()


def run(argv: list[str]) -> None:
    """One run (``OUT ROTATE H K D L V F B S [DP] [tp=TP]``): its own meshes, model and tokens;
    each rank's measurement to ``OUT/rank{r}.json``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    out_dir, rotate = argv[0], argv[1]
    v = dict(zip(SIZES, (int(x) for x in argv[2:2 + len(SIZES)])))
    tp = dp = None
    for extra in argv[2 + len(SIZES):]:
        if extra.startswith("tp="):
            tp = int(extra[3:])
        else:
            dp = int(extra)
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = None
    if tp and dp:  # torchtitan's mesh (dp_shard, cp, tp), FSDP2 over the flattened dp_shard_cp
        world = init_device_mesh("cpu", (dp, n // (dp * tp), tp), mesh_dim_names=("dp_shard", "cp", "tp"))
        mesh, flat = world["cp"], world["dp_shard", "cp"]._flatten("dp_shard_cp")
        groups = {flat.get_group().group_name: "DP", mesh.get_group().group_name: "CP",
                  world["tp"].get_group().group_name: "TP"}
    elif tp:  # torchtitan's mesh order: cp outside tp (a TP group is TP consecutive ranks)
        world = init_device_mesh("cpu", (n // tp, tp), mesh_dim_names=("cp", "tp"))
        mesh = world["cp"]
        groups = {world[d].get_group().group_name: d.upper() for d in ("cp", "tp")}
    elif dp:  # torchtitan's mesh: (dp_shard, cp), FSDP2 over the flattened dp_shard_cp
        world = init_device_mesh("cpu", (dp, n // dp), mesh_dim_names=("dp_shard", "cp"))
        mesh, flat = world["cp"], world["dp_shard", "cp"]._flatten("dp_shard_cp")
        groups = {flat.get_group().group_name: "DP", mesh.get_group().group_name: "CP"}
    else:
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    err = ring_matches(mesh, v, rotate)
    spec, values = spec_and_values(v)
    torch.manual_seed(0)
    model = spec.build(values)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if tp:  # the plan first, then the train context's CP (torchtitan's parallelize_llama, train_context)
        tensor_parallel(model, world["tp"])
    if dp:  # fully_shard per block, then the root (torchtitan's apply_fsdp)
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block, mesh=flat, reshard_after_forward=True)
        fully_shard(model, mesh=flat, reshard_after_forward=False)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))  # (the same ids on every rank: seeded)
    ids = kwargs["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
        got = measure(model, spec, args, kwargs, opt, cp_step(mesh, rotate), groups)
        tokens = ids.shape[1]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({**got, "ring_error": err, "tokens": tokens, "world": n}, f)


def gloo_ranks(out_dir, v: dict, rotate: str, nproc: int = 2, dp: int | None = None,
               tp: int | None = None) -> list[dict]:
    """``torchrun --standalone --nproc-per-node nproc`` of this script with gloo on this CPU at
    sizes ``v`` (with ``dp``: the mesh (dp_shard dp, cp nproc/dp), FSDP2 over both; with ``tp``:
    the mesh (cp nproc/tp, tp), transformers' TP plan over tp): each rank's measurement, in rank
    order."""
    return gloo_runs(out_dir, nproc, (v, rotate, dp, tp))[0]


def gloo_runs(out_dir, nproc: int, *runs: tuple) -> list[list[dict]]:
    """Several runs of :func:`gloo_ranks` (each ``(v, rotate, dp, tp)``) on the same ``nproc``
    gloo ranks in one launch (the ranks start and join the process group once; each run its own
    meshes, model and tokens, in its own directory under ``out_dir``): per run, each rank's
    measurement, in rank order."""
    import pathlib
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
               OMP_NUM_THREADS="1")
    args, dirs = [], []
    for i, (v, rotate, dp, tp) in enumerate(runs):
        d = pathlib.Path(out_dir) / str(i)
        d.mkdir()
        dirs.append(d)
        args += (["+"] if i else []) + [str(d), rotate] + [str(v[k]) for k in SIZES] \
            + ([str(dp)] if dp else []) + ([f"tp={tp}"] if tp else [])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        os.path.abspath(__file__), *args], env=env, capture_output=True, text=True,
                       timeout=400 * len(runs))
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines()
                                        if any(w in line for w in ("Error", "error", "rank", "terminate", "what()")))[-4000:]
    out = [[json.loads((d / f"rank{k}.json").read_text()) for k in range(nproc)] for d in dirs]
    assert all(got["world"] == nproc for ranks in out for got in ranks)
    return out


if __name__ == "__main__":
    main()

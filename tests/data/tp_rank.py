"""One rank of a tensor-parallel training step (tests/test_tensor_parallel.py), on real tensors,
or on fake ones on the fake process group: the oracle of symcost's per-rank numbers.

``python -m torch.distributed.run --standalone --nproc-per-node N tp_rank.py OUT SP H D L V B S [DP SHARD]``
(several runs on the same ranks: their arguments separated by ``+``)
(SP: 0 or 1) builds the ``megatron-gpt`` built-in on each rank, parallelises it with the
Megatron plan through ``torch.distributed.tensor.parallel.parallelize_module``
(``symcost.frontends.tensor_parallel.apply``: the plan is the input; what is measured is PyTorch
running it), runs one training step with gloo and writes ``OUT/rank{r}.json``. With ``DP SHARD``
the ranks form the 2-D mesh ``init_device_mesh("cpu", (DP, N/DP), mesh_dim_names=("dp", "tp"))``:
the plan over ``tp``, then the data-parallel engine (``fully_shard`` or ``replicate`` per block
and the root, ``symcost.frontends.parallel.wrap``) over ``dp``; collective bytes are reported per
group (``DP.all_gather``, ``TP.all_reduce``, ...), each with its own group's size. With
``R hsdp:SHARD`` (SHARD fsdp or zero2) there is no TP: the N ranks form HSDP's mesh
``(dp_replicate R, dp_shard N/R)`` and the engine is ``fully_shard`` over it (:func:`hsdp_mesh`).

:func:`measure` is what each rank measures, also used in-process on the fake group:

* model FLOPs: each op's count by ``torch.utils.flop_counter``'s own registry, on the local
  tensors DTensor computes with (a ``TorchDispatchMode`` that hands DTensor ops to DTensor, as
  ``CommDebugMode`` does, so it sees the local ops and the collectives they run);
* bytes autograd saved for backward (``saved_tensors_hooks``; a DTensor's local shard; parameters
  and buffers excluded; each storage once);
* bytes per rank of every collective seen at dispatch, with nccl-tests' ring factors typed here
  (doc/PERFORMANCE.md): all-gather (n-1)/n·output, reduce-scatter (n-1)/n·input, all-reduce
  2(n-1)/n·input, n the size of the collective's process group as PyTorch resolves it (the
  functional collectives' group name, c10d's ProcessGroup object);
* parameter elements the rank holds (DTensor local shards).

A warm-up step runs first, unmeasured: DTensor runs each op once more on global-shape fake tensors
to propagate shapes the first time it meets an op signature (cached afterwards); those are no
ops of the rank.
"""
from __future__ import annotations

import json
import os
import sys
from fractions import Fraction


def _group(args, groups):
    """``(mesh dimension name or None, size)`` of a collective's process group, as PyTorch
    resolves it."""
    from gloo_groups import process_group

    pg = process_group(args)
    return (groups or {}).get(pg.group_name), pg.size()


def measure(model, spec, values, loss_context, dtype=None, groups=None) -> dict:
    """``groups``: ``{process group name: "DP" | "TP"}`` on the 2-D mesh (collective bytes then
    keyed ``"DP.all_gather"``, ...); None on the 1-D tensor-parallel mesh."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    comm = {(f"{g}.{k}" if groups else k): Fraction(0) for g in sorted(set((groups or {"": ""}).values()))
            for k in kinds}
    flops = [0]

    def size(t):  # (torchao's float8 tensor, FP8 training: its fp8 data is what moves)
        t = _float8_data(t)
        return t.numel() * t.element_size()

    def add(kind, args, nbytes, factor):
        g, n = _group(args, groups)
        comm[f"{g}.{kind}" if groups else kind] += factor(n) * nbytes

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func.overloadpacket)
            ring, twice = (lambda n: Fraction(n - 1, n)), (lambda n: Fraction(2 * (n - 1), n))
            if name == "_c10d_functional.all_gather_into_tensor":
                add("all_gather", args, size(out), ring)
            elif name == "c10d._allgather_base_":  # FSDP2's (output, input, group, ...)
                add("all_gather", args, size(args[0]), ring)
            elif name == "_c10d_functional.reduce_scatter_tensor":
                add("reduce_scatter", args, size(args[0]), ring)
            elif name == "c10d._reduce_scatter_base_":  # (output, input, group, ...)
                add("reduce_scatter", args, size(args[1]), ring)
            elif name == "_c10d_functional.all_reduce":
                add("all_reduce", args, size(args[0]), twice)
            elif name == "c10d.allreduce_":  # ([tensors], group, ...)
                add("all_reduce", args, sum(size(t) for t in args[0]), twice)
            elif func.overloadpacket in flop_registry:
                flops[0] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            return out

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    # parameters and buffers are no activations (conventions: "What counts as a byte")
    static = {StorageWeakRef(local(p).untyped_storage()).cdata
              for p in list(model.parameters()) + list(model.buffers())}
    seen, saved = set(), [0]

    def pack(t):
        if isinstance(t, torch.nn.Parameter):  # (FSDP2's unsharded parameters, between all-gather and reshard)
            return t
        lt = local(t)
        st = _float8_data(lt).untyped_storage()
        key = StorageWeakRef(st).cdata
        # a tensor on a parameter's storage as it is now (the transposed weight an mm backward
        # keeps, FSDP2's unsharded or mixed-precision parameter): a parameter, not an activation
        # (shared/conventions.md); a DTensor's _local_tensor, as to_local() would add autograd edges
        if key in {StorageWeakRef(getattr(p, "_local_tensor", p).untyped_storage()).cdata for p in model.parameters()}:
            return t
        if key not in seen and key not in static:
            seen.add(key)
            # a float8 tensor (FP8 training) holds its fp8 data and its scale
            saved[0] += st.nbytes() + (lt._scale.untyped_storage().nbytes() if lt is not _float8_data(lt) else 0)
        return t

    args, kwargs = spec.make_inputs(values, torch.device("cpu"))

    def step():
        with loss_context():
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
            loss.backward()

    step()  # warm-up: DTensor's shape propagation (and FSDP2's lazy initialisation)
    model.zero_grad(set_to_none=True)
    with Count(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return {"flops": flops[0], "saved": saved[0], "comm": {k: str(v) for k, v in comm.items()},
            "shard": sum(local(p).numel() for p in model.parameters())}


def _float8_data(t):
    """torchao's ``Float8TrainingTensor`` (FP8 training, tests/test_fp8.py) as its fp8 data (a
    wrapper subclass: its own storage is none of the bytes it holds); any other tensor as itself."""
    return t._data if type(t).__name__ == "Float8TrainingTensor" else t


def fake_rank_model(spec, values: dict, sp: bool):
    """Rank 0 of ``values["TP"]`` on the fake process group: ``spec``'s model built on the meta
    device in bf16 and parallelised with symcost's plan (``frontends.tensor_parallel.apply``).
    Returns ``(model, loss_context)``; the caller materialises it (``to_empty``) under its
    FakeTensorMode."""
    import torch

    from symcost.frontends.parallel import fake_group
    from symcost.frontends.tensor_parallel import apply
    from symcost.tracing.record import find_layer_container

    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    layers = spec.layers if spec.layers is not None else find_layer_container(spec, model, values)
    return model, apply(model, layers, fake_group(values["TP"]), sp)


def transformers_rank_model(spec, values: dict):
    """Rank 0 of ``values["TP"]`` on the fake process group, parallelised by transformers' own
    code as ``from_pretrained(..., tp_plan="auto")`` does (not symcost's): ``spec``'s model
    built on the meta device in bf16, its plans resolved by
    ``_resolve_parallel_plans(DistributedConfig(tp_size=TP))`` and applied by
    ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``. The caller
    materialises it (``to_empty``) under its FakeTensorMode; the loss needs no context
    (transformers' head gathers the logits)."""
    import torch
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from symcost.frontends.parallel import fake_group

    mesh = fake_group(values["TP"])
    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=values["TP"]))
    model._mesh_manager = None
    import warnings

    with warnings.catch_warnings():  # (rules for modules this config leaves out: skipped, as transformers does)
        warnings.filterwarnings("ignore", message=r"Parallelize plan key .* could not be resolved", category=UserWarning)
        return apply_tensor_parallelism(model, mesh, tp_plan)


def fake_mesh_rank(spec, values: dict, sp: bool, shard: str):
    """Rank 0 of the 2-D mesh ``(values["DP"], values["TP"])`` on the fake process group, built
    here with PyTorch's ``init_device_mesh`` (mesh_dim_names ``dp``, ``tp``): ``spec``'s model
    on the meta device in bf16, symcost's plan over ``tp``, then ``shard``'s engine per block and
    the root over ``dp`` (``frontends.parallel.wrap``). Returns ``(model, loss_context,
    groups)``, ``groups`` as :func:`measure` takes it; the caller materialises the model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from symcost.frontends.parallel import wrap
    from symcost.frontends.tensor_parallel import apply
    from symcost.tracing.record import find_layer_container

    world = values["DP"] * values["TP"]
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (values["DP"], values["TP"]), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    layers = spec.layers if spec.layers is not None else find_layer_container(spec, model, values)
    ctx = apply(model, layers, mesh["tp"], sp)
    wrap(model, layers, shard, mesh["dp"])
    return model, ctx, {mesh[k].get_group().group_name: k.upper() for k in ("dp", "tp")}


def torchtitan_sp_rank_model(spec, values: dict):
    """Rank 0 of ``values["TP"]`` on the fake process group, a transformers Llama-family model
    (q/k/v/o, gate/up/down, input_layernorm, post_attention_layernorm) under tensor and sequence
    parallelism with torchtitan's plan for transformers models, typed here from its source
    (torchtitan/experiments/transformers_modeling_backend/parallelize.py, ``apply_non_moe_tp``:
    the vocabulary-parallel embedding reduce-scattered over the sequence, SequenceParallel norms,
    ``PrepareModuleInput`` all-gathers before the attention, by keyword, and the MLP, row-parallel
    o/down reduce-scattering, the column-parallel head on the gathered sequence with sharded
    logits, the loss under ``loss_parallel``), applied with ``parallelize_module``. One change,
    as symcost runs it: the residual stream stays a DTensor (``use_local_output=False`` on the
    embedding, o and down), because transformers' own forward reads the sequence length from
    the hidden states (torchtitan's backend runs a forward of its own). The query and key/value
    head counts are divided by TP as torchtitan's ``apply_tp`` does. Returns ``(model,
    loss_context)``; the caller materialises it."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    from symcost.frontends.parallel import fake_group

    mesh = fake_group(values["TP"])
    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
        for a in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(block.self_attn, a, None), int):
                setattr(block.self_attn, a, getattr(block.self_attn, a) // values["TP"])
    parallelize_module(model, mesh, plan)
    return model, loss_parallel


def check_rank(an, v: dict, got: dict, what) -> None:
    """symcost's rank (``an`` at sizes ``v``) against one rank's measurement ``got``
    (:func:`measure`, collectives keyed ``GROUP.kind``): model FLOPs, saved bytes, collective
    bytes of each group and kind, parameter elements."""
    env = an.bind(**v)
    assert int(an.flops("train").subs(env)) == got["flops"], what
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], what
    assert got["comm"], what
    for key, want in got["comm"].items():
        g, kind = key.split(".")
        assert Fraction(str(an.comm_bytes(kind, group=g).subs(env))) == Fraction(want), (key, what)
    assert int(an.params_shard.subs(env)) == got["shard"], what


def gloo_ranks(out_dir, v: dict, dp_args: list, nproc: int = 4) -> list[dict]:
    """``torchrun --standalone --nproc-per-node nproc`` of this script with gloo on this CPU at
    sizes ``v`` (H D L V B S) and ``dp_args`` (``[DP, SHARD]``, or ``[R, "hsdp:fsdp"]``): each
    rank's measurement (:func:`main`), in rank order."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        os.path.abspath(__file__), str(out_dir), "0"] + [str(v[k]) for k in "HDLVBS"]
                       + [str(a) for a in dp_args], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines()
                                        if any(w in line for w in ("Error", "error", "rank", "terminate", "what()", "enforce")))[-4000:]
    out = [json.loads(open(os.path.join(str(out_dir), f"rank{k}.json")).read()) for k in range(nproc)]
    assert all(got["world"] == nproc for got in out)
    return out


def hsdp_mesh(world: int, replicate: int):
    """PyTorch's HSDP mesh of ``world`` ranks: ``init_device_mesh("cpu", (R, world/R),
    mesh_dim_names=("dp_replicate", "dp_shard"))`` (torchtitan's names), and ``groups`` as
    :func:`measure` takes it (``dp_shard``'s collectives "DP", ``dp_replicate``'s
    "DP_replicate")."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    return mesh, {mesh["dp_shard"].get_group().group_name: "DP",
                  mesh["dp_replicate"].get_group().group_name: "DP_replicate"}


def fake_hsdp_rank(spec, values: dict, replicate: int, shard: str = "fsdp"):
    """Rank 0 of HSDP (``values["DP"]`` ranks, ``replicate`` R of them replicating) on the fake
    process group: ``spec``'s model on the meta device in bf16, ``fully_shard`` per block and the
    root over PyTorch's 2-D mesh (:func:`hsdp_mesh`). Returns ``(model, loss_context, groups)``."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from symcost.frontends.parallel import wrap

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=values["DP"])
    mesh, groups = hsdp_mesh(values["DP"], replicate)
    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    wrap(model, spec.layers, shard, mesh)
    return model, contextlib.nullcontext, groups


def fake_peak(spec, values: dict, sp: bool, foreach: bool = False) -> int:
    """Peak bytes of rank 0 of ``values["TP"]`` ranks in a steady-state training step (forward and
    loss under ``loss_parallel``, backward, AdamW step, ``zero_grad(set_to_none=True)``), bf16
    model, on PyTorch's fake process group under ``FakeTensorMode``, measured by PyTorch's own
    ``torch.distributed._tools.mem_tracker.MemTracker`` (weak references on every storage of
    every op it dispatches, DTensors by their local tensors). An untracked warm-up step runs
    first: the optimizer state exists from then on.

    DTensor's sharding propagation runs an op once more on fake tensors of the *global* shapes
    the first time it meets the op's signature (``ShardingPropagator.
    _propagate_tensor_meta_non_cached``, in the active fake mode); some signatures (the
    ``loss_parallel`` backward's) miss its cache again in the second step. On a real run those
    are fake tensors and take no memory, so here that function runs with the dispatch modes
    off (a fresh ``FakeTensorMode`` of its own), out of the tracker's sight."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    model, loss_context = fake_rank_model(spec, values, sp)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)

        def step():
            args, kwargs = spec.make_inputs(values, torch.device("cpu"))
            with loss_context():
                loss = spec.loss(model(*args, **kwargs), (args, kwargs))
                loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        mt = MemTracker()
        mt.track_external(model, opt)
        orig = ShardingPropagator._propagate_tensor_meta_non_cached

        def unseen(self, op_schema):
            with _disable_current_modes():
                return orig(self, op_schema)

        ShardingPropagator._propagate_tensor_meta_non_cached = unseen
        try:
            with mt:
                step()
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = orig
        return max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())


def real_peak(model, spec, values, loss_context) -> dict:
    """The rank's peak memory of a steady-state training step on real tensors, measured with
    ``torch.profiler`` (``profile_memory``) as tests/memory_oracle.py does on one device: an
    AdamW (for-loop, as on CPU) warm-up step allocates the optimizer state; then the bytes live
    before the step (the rank's parameter shards, buffers, optimizer state, inputs: their
    storages) plus the highest allocator level of one step (``zero_grad(set_to_none=True)``,
    forward and loss under ``loss_parallel``, backward, ``step``): ``peak``; ``peak_ops``: the same
    at the ends of top-level ops (aten and the collectives: what a kernel allocates and frees
    inside one op, oneDNN's bf16 workspaces, is left out); ``baseline``."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from memory_oracle import steady_peak

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))

    def step():
        opt.zero_grad(set_to_none=True)
        with loss_context():
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
            loss.backward()
        del loss
        opt.step()

    return steady_peak(step, opt, list(model.parameters()) + list(model.buffers())
                       + [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)],
                       ("aten::", "c10d::", "_c10d_functional::"))


def main():
    """Each run of the command line (``OUT SP H D L V B S [DP SHARD]``; several runs separated by
    ``+``, all on the one process group) in turn."""
    import torch.distributed as dist

    argv, runs = sys.argv[1:], []
    while "+" in argv:
        runs.append(argv[:argv.index("+")])
        argv = argv[argv.index("+") + 1:]
    dist.init_process_group("gloo")
    for args in runs + [argv]:
        run(args)
    from gloo_teardown import finish  # (tests/data: on the path)
    finish()  # gloo barrier, then every rank past it, then teardown (gloo_teardown.py)


#: one ``DeviceMesh`` per shape and names for the whole launch: DTensor's sharding cache compares
#: meshes by shape and names, not by process group (tests/data/ep_rank.py)
MESHES: dict = {}


def _mesh(shape: tuple, mesh_dim_names: tuple | None = None):
    """``init_device_mesh("cpu", shape, mesh_dim_names=...)``, once per shape and names."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, mesh_dim_names)
    if key not in MESHES:
        MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=mesh_dim_names)
    return MESHES[key]


def run(argv: list[str]) -> None:
    """One run (``OUT SP H D L V B S [DP SHARD]``): its own model and measurement, each rank's
    to ``OUT/rank{r}.json``."""
    import torch
    import torch.distributed as dist

    from symcost.frontends.models import resolve
    from symcost.frontends.tensor_parallel import apply

    out_dir, sp = argv[0], argv[1] == "1"
    H, D, L, V, B, S = (int(x) for x in argv[2:8])
    dp, shard = (int(argv[8]), argv[9]) if len(argv) > 9 else (None, None)
    rank, n = dist.get_rank(), dist.get_world_size()
    if shard is not None and shard.startswith("hsdp:"):  # HSDP: DP = n ranks, R = dp replicating, no TP
        import contextlib

        from symcost.frontends.parallel import wrap

        values = {"H": H, "D": D, "L": L, "V": V, "B": B, "S": S, "DP": n}
        spec = resolve("megatron-gpt")
        torch.manual_seed(0)
        model = spec.build(values).to(torch.bfloat16)
        mesh, groups = hsdp_mesh(n, dp)
        wrap(model, spec.layers, shard.split(":")[1], mesh)
        got = measure(model, spec, values, contextlib.nullcontext, groups=groups)
        got.update(real_peak(model, spec, values, contextlib.nullcontext))
        got["world"] = n
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(got, f)
        return
    tp = n // dp if dp else n
    values = {"H": H, "D": D, "L": L, "V": V, "B": B, "S": S, "TP": tp, **({"DP": dp} if dp else {})}
    spec = resolve("megatron-gpt")
    torch.manual_seed(0)
    model = spec.build(values).to(torch.bfloat16)
    groups = None
    if dp:
        from symcost.frontends.parallel import wrap

        mesh = _mesh((dp, tp), mesh_dim_names=("dp", "tp"))
        loss_context = apply(model, spec.layers, mesh["tp"], sp)
        wrap(model, spec.layers, shard, mesh["dp"])
        groups = {mesh[k].get_group().group_name: k.upper() for k in ("dp", "tp")}
    else:
        loss_context = apply(model, spec.layers, _mesh((n,)), sp)
    got = measure(model, spec, values, loss_context, groups=groups)
    got.update(real_peak(model, spec, values, loss_context))
    got["world"] = n
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()

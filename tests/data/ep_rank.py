"""One rank of an expert-parallel training step (tests/test_expert_parallel.py), on real tensors
over gloo, or rank 0 on the fake process group: the oracle of symcost's per-rank numbers.

``python -m torch.distributed.run --standalone --nproc-per-node N ep_rank.py OUT H D L V F E R B S [DP] [tp=M [etp]] [own] [hf]``
(several such runs in one launch: their arguments joined by ``+``)
builds the built-in ``moe`` model on each rank (fp32, each rank its own tokens), shards its
experts over the N ranks (N/DP with DP) with ``symcost.frontends.expert_parallel.apply`` (the layout
is the input: DTensor ``Shard(0)`` experts, the all-to-all dispatch and combine; what is measured is
PyTorch running it), forces every router to the balanced assignment (token n's k-th choice is
expert (n·R + k) mod E), runs a warm-up step and one measured step (forward, loss, backward,
AdamW in its for-loop form) and writes ``OUT/rank{r}.json``. With DP, the mesh is
``(dp_shard, ep) = (DP, N/DP)`` and FSDP2 is applied here as torchtitan's ``apply_fsdp`` applies it
under EP (:func:`fsdp_as_torchtitan`), and the collective bytes are kept per process group.
With ``tp=M``: EP × TP (:func:`ep_tp`), N ranks, TP groups of M consecutive ones (each group its own
tokens), the EP group all N; with ``etp`` too, expert-tensor parallelism (etp = tp: the mesh
``(ep, tp)`` = (N/M, M), the experts over both, each EP group the ranks of one TP coordinate,
docs/parallel.md §14.10). With ``own``: the model's own routers (not forced to the balanced
assignment; the built-in ``moe``'s fixed capacities keep every shape).

:func:`measure` is what each rank measures, also used in-process on the fake group:

* model FLOPs: each op's count by ``torch.utils.flop_counter``'s own registry, on the local
  tensors (a ``TorchDispatchMode`` that hands DTensor ops to DTensor, as ``CommDebugMode`` does);
  ``aten._grouped_mm`` (transformers' experts), which the registry lacks, by
  :func:`grouped_mm_flops`;
* bytes autograd saved for backward (``saved_tensors_hooks``; parameters and buffers excluded;
  each storage once);
* bytes per rank of every all-to-all seen at dispatch: (n-1)/n of its input, n the size of its
  process group as PyTorch resolves it (nccl-tests doc/PERFORMANCE.md, typed here), and of any
  other collective (there should be none);
* parameter elements the rank holds (DTensor local shards);
* with ``peak``: the rank's peak of the measured step by ``torch.distributed._tools.mem_tracker.
  MemTracker`` (the storages of the ops PyTorch dispatches).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from fractions import Fraction


@contextlib.contextmanager
def balanced_router():
    """``torch.topk`` over a router's ``[N, E]`` probabilities forced to the balanced assignment
    (token n's k-th choice expert (n·R + k) mod E, the probabilities at those indices: gradients
    still reach the router); every other ``topk`` unchanged."""
    import torch

    orig = torch.topk

    def topk(x, k, dim=-1, largest=True, sorted=True):
        if x.dim() == 2 and dim in (-1, 1) and x.shape[-1] >= k:
            n, e = x.shape
            idx = (torch.arange(n * k, device=x.device) % e).view(n, k)
            return torch.return_types.topk((x.gather(-1, idx), idx))
        return orig(x, k, dim=dim, largest=largest, sorted=sorted)

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = orig


def _group_size(args) -> int:
    from gloo_groups import process_group

    return process_group(args).size()


def grouped_mm_flops(a, b) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``, the sum of its groups' GEMMs, 2·m·k·n each,
    whatever the offsets: ``[M, K] x [G, K, N]`` (rows split) 2·M·K·N; ``[K, M] x [M, N]`` (the
    weight gradient: contraction split) 2·K·M·N; ``[G, m, K] x [K, N]`` (columns split) 2·m·K·N."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    raise AssertionError(f"grouped mm of {a} x {b}")


def build(values: dict, mesh, seed: int = 0):
    """The built-in ``moe`` model at ``values`` (fp32, real tensors), its experts sharded over
    ``mesh`` by symcost's expert-parallel layout."""
    import torch

    from symcost.frontends.builtin.moe import MoELM
    from symcost.frontends.expert_parallel import apply

    torch.manual_seed(seed)
    v = values
    model = MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"])
    apply(model, mesh)
    return model


def fsdp_as_torchtitan(model, mesh):
    """FSDP2 over an expert-parallel ``model`` on the 2-D ``mesh`` ``(dp_shard, ep)``, as
    torchtitan's ``apply_fsdp`` does under EP (torchtitan/models/*/parallelize.py, written out here,
    not symcost's wrapping): each ``moe.experts`` module ``fully_shard`` over ``dp_shard`` (the ranks
    holding the same experts; ``Shard(1)`` of the local experts where dp_shard·ep > E, else
    ``Shard(0)``), then each block and the root over the flattened ``dp_shard × ep`` mesh, which
    it returns."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    flat = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    for block in model.layers:
        experts = block.moe.experts
        placement = None
        if mesh["dp_shard"].size() * mesh["ep"].size() > experts.num_experts:
            def placement(p):
                return Shard(1)
        fully_shard(experts, mesh=mesh["dp_shard"], shard_placement_fn=placement)
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat, reshard_after_forward=False)
    return flat


def _group_label(args, groups):
    from gloo_groups import process_group

    return groups[process_group(args).group_name]


def measure(model, tokens, peak: bool = False, spec=None, groups=None, loss_context=None, balanced: bool = True) -> dict:
    """One training step's FLOPs, saved bytes, collective bytes per rank and parameter elements
    (module docstring), after a warm-up step; the router balanced. ``tokens`` ``[B, S]``; ``spec``:
    a transformers model's :class:`~symcost.frontends.spec.ModelSpec` (its inputs and loss; the
    built-in ``moe``'s without). ``groups``: ``{process group name: label}`` under FSDP2: the
    bytes are then also kept per label and kind (``by_group``), FSDP2's all-gathers (n-1)/n of their
    output, reduce-scatters (n-1)/n of their input, all-reduces 2(n-1)/n of their input (nccl-tests'
    bus bandwidth, typed here). ``loss_context``: the context the loss and its backward run in
    (``loss_parallel`` under TP); ``balanced=False``: the model's own routers."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    from symcost.frontends.builtin.cs336_lm import lm_loss

    comm = {"all_to_all": Fraction(0), "other": Fraction(0)}
    by_group: dict = {}
    flops = [0]

    def add(label, kind, nbytes):
        by_group.setdefault(label, {}).setdefault(kind, Fraction(0))
        by_group[label][kind] += nbytes

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func.overloadpacket)
            if name == "_c10d_functional.all_to_all_single":  # (input, out_splits, in_splits, group)
                n = _group_size(args)
                comm["all_to_all"] += Fraction(n - 1, n) * args[0].numel() * args[0].element_size()
                if groups:
                    add(_group_label(args, groups), "all_to_all", Fraction(n - 1, n) * args[0].numel() * args[0].element_size())
            elif groups and name in ("c10d._allgather_base_", "c10d._reduce_scatter_base_"):  # FSDP2's (output, input, group, ...)
                n = _group_size(args)
                kind, t = ("all_gather", args[0]) if "allgather" in name else ("reduce_scatter", args[1])
                comm[kind] = comm.get(kind, Fraction(0)) + Fraction(n - 1, n) * t.numel() * t.element_size()
                add(_group_label(args, groups), kind, Fraction(n - 1, n) * t.numel() * t.element_size())
            elif groups and name in ("_c10d_functional.all_reduce", "c10d.allreduce_"):  # (input or [inputs], ...)
                n = _group_size(args)
                ts = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                nbytes = sum(Fraction(2 * (n - 1), n) * t.numel() * t.element_size() for t in ts)
                comm["all_reduce"] = comm.get("all_reduce", Fraction(0)) + nbytes
                add(_group_label(args, groups), "all_reduce", nbytes)
            elif name.startswith(("_c10d_functional.", "c10d.")) and not name.endswith(("wait_tensor", "_wrap_tensor_autograd")):
                comm["other"] += 1  # (any other collective: there should be none)
            elif name == "aten._grouped_mm":  # (not in flop_counter's registry: typed here)
                flops[0] += grouped_mm_flops(args[0].shape, args[1].shape)
            elif func.overloadpacket in flop_registry:
                flops[0] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            return out

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    # parameters and buffers (the RoPE tables) are no activations (conventions: "What counts as a byte")
    params = {StorageWeakRef(local(p).untyped_storage()).cdata
              for p in list(model.parameters()) + list(model.buffers())}
    seen, saved = set(), [0]

    def pack(t):
        if isinstance(t, torch.nn.Parameter):  # (FSDP2's unsharded parameters, between all-gather and reshard)
            return t
        st = local(t).untyped_storage()
        if groups and StorageWeakRef(st).cdata in {StorageWeakRef(local(p).untyped_storage()).cdata
                                                   for p in model.parameters()}:
            return t  # (a view of a parameter as it is now: FSDP2's unsharded one)
        key = StorageWeakRef(st).cdata
        if key not in seen and key not in params:
            seen.add(key)
            saved[0] += st.nbytes()
        return t

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    args, kwargs = ((tokens,), {})
    loss_fn = lm_loss
    if spec is not None:  # (transformers: input_ids and labels, its own loss, as symcost's hf specs)
        args, kwargs = (), {"input_ids": tokens, "labels": tokens}
        loss_fn = spec.loss

    def loss_of():
        with (loss_context or contextlib.nullcontext)():
            return loss_fn(model(*args, **kwargs), (args, kwargs))

    def backward(loss):
        with (loss_context or contextlib.nullcontext)():
            loss.backward()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of()
        backward(loss)
        del loss
        opt.step()

    with balanced_router() if balanced else contextlib.nullcontext():
        step()  # warm-up: the optimizer state, DTensor's shape propagation
        opt.zero_grad(set_to_none=True)
        with Count(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of()
            backward(loss)
            del loss
        out = {"flops": flops[0], "saved": saved[0], "comm": {k: str(v) for k, v in comm.items()},
               "shard": sum(local(p).numel() for p in model.parameters()),
               # (AdamW's state after the warm-up step: moments of the local shards, a 0-d step each)
               "optimizer_state": sum(local(t).numel() * t.element_size() for st in opt.state.values()
                                      for t in st.values()),
               "by_group": {g: {k: str(v) for k, v in d.items()} for g, d in by_group.items()}}
        if peak:
            from torch.distributed._tools.mem_tracker import MemTracker

            opt.zero_grad(set_to_none=True)
            mt = MemTracker()
            mt.track_external(model, opt, tokens)
            with mt:
                step()
            out["memtracker"] = max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
    return out


#: a tiny DeepSeek-V3 (MLA, shared expert, a dense first layer, sigmoid router with its bias):
#: ``ep_rank.py ... tp=M hf`` runs it instead of the built-in ``moe``
TINY_DSV3 = {"hidden_size": "64", "n_routed_experts": "8", "num_experts_per_tok": "2", "num_hidden_layers": "3",
             "moe_intermediate_size": "32", "intermediate_size": "96", "num_attention_heads": "4",
             "num_key_value_heads": "4", "vocab_size": "128", "first_k_dense_replace": "1", "n_shared_experts": "1",
             "q_lora_rank": "32", "kv_lora_rank": "16", "qk_rope_head_dim": "8", "qk_nope_head_dim": "16",
             "v_head_dim": "16", "n_group": "1", "topk_group": "1"}


def tiny_dsv3():
    """The :class:`ModelSpec` of :data:`TINY_DSV3` (transformers' eager attention)."""
    import symcost

    return symcost.resolve("hf:deepseek_v3", TINY_DSV3, "eager")


def ep_tp(v: dict, mesh, tokens, spec=None, etp: bool = False) -> tuple:
    """EP × TP (``tp=M``): the built-in ``moe`` at ``v`` laid out by symcost's layout over the
    mesh ``(ep_rest, tp)`` (the EP group its flattening, docs/parallel.md §14.8; with ``etp`` the
    mesh ``(ep, tp)``, the experts over both, §14.10), checked against
    the same model on one device first (same seed, the TP group's ``tokens``, the routers
    balanced): the loss and the router's gradient (all-reduced over TP) equal. Returns ``(model,
    loss context, {group name: label}, {check: max abs difference})``."""
    import torch

    from symcost.frontends.builtin.cs336_lm import lm_loss
    from symcost.frontends.builtin.moe import MoELM
    from symcost.frontends.layout import Layout

    def make():
        torch.manual_seed(0)
        if spec is not None:
            return spec.build(v)
        return MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"])

    def loss_of(m):
        if spec is not None:
            return spec.loss(m(input_ids=tokens, labels=tokens), ((), {"input_ids": tokens, "labels": tokens}))
        return lm_loss(m(tokens), ((tokens,), {}))

    flat = mesh["ep"] if etp else mesh["ep_rest", "tp"]._flatten("ep")
    model, ref = make(), make()
    layers = "model.layers" if spec is not None else "layers"
    meshes = {"TP": mesh["tp"], "EP": flat, **({"EP_TP": mesh} if etp else {})}
    loss_context = Layout(ep=True, tp=True, etp=etp).parallelize(model, layers, meshes)
    checks = {}
    with balanced_router():
        want = loss_of(ref)
        want.backward()
        with loss_context():
            got = loss_of(model)
            got.backward()
    checks["loss"] = abs(float(got.detach().full_tensor() if hasattr(got, "full_tensor") else got.detach())
                         - float(want.detach()))
    router = "model.layers.2.mlp.gate.weight" if spec is not None else "layers.0.moe.router.weight"
    g, g_ref = model.get_parameter(router).grad, ref.get_parameter(router).grad
    checks["router_grad"] = float((g - g_ref).abs().max())
    if spec is not None:  # (the shared expert, split over TP: this rank's rows of its up projection)
        name = "model.layers.2.mlp.shared_experts.up_proj.weight"
        g, g_ref = model.get_parameter(name).grad, ref.get_parameter(name).grad
        rows = g.to_local() if hasattr(g, "to_local") else g
        r, n = mesh["tp"].get_local_rank(), rows.shape[0]
        checks["shared_grad"] = float((rows - g_ref[r * n:(r + 1) * n]).abs().max())
    model.zero_grad(set_to_none=True)
    groups = {mesh["tp"].get_group().group_name: "TP", flat.get_group().group_name: "EP"}
    return model, loss_context, groups, checks


def main():
    """Each run of the command line (several runs: their arguments joined by ``+``, each its own
    OUT, as one launch: the ranks start and join the process group once) in turn."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    argv, runs = sys.argv[1:], []
    while "+" in argv:
        runs.append(argv[:argv.index("+")])
        argv = argv[argv.index("+") + 1:]
    for args in runs + [argv]:
        run(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gloo_teardown import finish

    finish()


#: one ``DeviceMesh`` per shape and names for the whole launch: DTensor's sharding cache compares
#: meshes by shape and names, not by process group, so a second mesh of the same shape would get
#: the first one's cached placements, whose collectives name the first mesh's groups
MESHES: dict = {}


def _mesh(shape: tuple, mesh_dim_names: tuple):
    """``init_device_mesh("cpu", shape, mesh_dim_names=...)``, once per shape and names."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, mesh_dim_names)
    if key not in MESHES:
        MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=mesh_dim_names)
    return MESHES[key]


def run(argv: list[str]) -> None:
    """One run: ``OUT H D L V F E R B S [DP] [tp=M [etp]] [own] [hf]`` (the module's docstring),
    every mesh, model, seed and token of its own."""
    import torch
    import torch.distributed as dist

    out_dir = argv[0]
    v = dict(zip("HDLVFERBS", (int(x) for x in argv[1:10])))
    extra = argv[10:]
    dp = next((int(x) for x in extra if x.isdigit()), None)
    tp = next((int(x[3:]) for x in extra if x.startswith("tp=")), None)
    balanced = "own" not in extra  # ("own": the model's own routers)
    rank, n = dist.get_rank(), dist.get_world_size()
    groups, loss_context, checks = None, None, {}
    spec = None
    if "hf" in extra:  # (the tiny DeepSeek-V3 at its config's sizes, B and S from the command line)
        spec = tiny_dsv3()
        v = {**spec.values({}, inputs=False), "B": v["B"], "S": v["S"]}
    if tp is not None:
        etp = "etp" in extra
        mesh = _mesh((n // tp, tp), mesh_dim_names=("ep" if etp else "ep_rest", "tp"))
        torch.manual_seed(100 + rank // tp)  # each TP group its own tokens
        tokens = torch.randint(0, v["V"], (v["B"], v["S"]))
        model, loss_context, groups, checks = ep_tp(v, mesh, tokens, spec, etp)
    elif dp is None:
        mesh = _mesh((n,), mesh_dim_names=("ep",))
        model = build(v, mesh["ep"])
    else:
        mesh = _mesh((dp, n // dp), mesh_dim_names=("dp_shard", "ep"))
        model = build(v, mesh["ep"])
        flat = fsdp_as_torchtitan(model, mesh)
        groups = {mesh["ep"].get_group().group_name: "EP", mesh["dp_shard"].get_group().group_name: "DP_expert",
                  flat.get_group().group_name: "DP"}
    if tp is None:
        torch.manual_seed(100 + rank)  # each rank its own tokens
        tokens = torch.randint(0, v["V"], (v["B"], v["S"]))
    got = measure(model, tokens, peak=spec is None, groups=groups, loss_context=loss_context, balanced=balanced,
                  spec=spec)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({**got, "world": n, "checks": checks}, f)


if __name__ == "__main__":
    main()

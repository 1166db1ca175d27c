"""Selective activation checkpointing under expert parallelism and FSDP2 (issue 29, TM1's recipe:
torchtitan's DeepSeek-V3 16B with EP 8 on 8 GPUs, ``--ep 8 --dp 1 --shard fsdp --ac selective``).

PyTorch 2.13's selective checkpointing replays each op by its invocation index, and FSDP2's hooks
open ``record_function`` regions a different number of times in the recomputation than in the
forward where a ``fully_shard`` unit (the experts) sits inside a checkpointed block: symcost's trace
failed with "profiler._record_function_enter_new ... encountered during backward but not found in
storage" (torchtitan issue #3427; symcost/frontends/checkpointing.py ``_without_profiler_ops``).

Oracles: PyTorch's own selective checkpointing (``create_selective_checkpoint_contexts``) where
the annotations agree, the same function without checkpointing, and PyTorch running torchtitan's
recipe (its op policy, ``checkpoint_wrapper``, FSDP2 written out as torchtitan's ``apply_fsdp``
applies it under EP) on the fake process group with the profiler ops added to
``torch.utils.checkpoint.SAC_IGNORED_OPS`` (the fix proposed in PyTorch, pytorch/pytorch PR #185178),
measured by tests/data/ep_rank.py ``measure`` (FLOPs by flop_counter's registry, saved_tensors_hooks,
collective bytes per process group), with SDPA run as ``--torch-device cuda`` records it
(``device_kernels("cuda")``: MLA's attention as CUDA's memory-efficient kernel, checked on its own
in tests/test_device_kernels.py).
"""
from __future__ import annotations

import os
import random
import sys
from fractions import Fraction

import pytest

import symcost

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))


def _annotated(grow: bool = True):
    """A block that opens one ``record_function`` region in its forward and (``grow``) one more in
    its recomputation, as FSDP2's nested unit does under checkpointing (else one each time)."""
    import torch

    calls = []

    def fn(x, w):
        calls.append(1)
        for _ in range(len(calls) if grow else 1):
            with torch.profiler.record_function("annotation"):
                pass
        h = torch.relu(x @ w)
        return (h @ w).sin() @ w

    return fn


def test_selective_context_replays_past_profiler_annotations():
    """symcost's op-level selective context (``op_sac_context``) runs a block whose recomputation
    opens more ``record_function`` regions than its forward, where PyTorch's own context raises
    its replay error; its loss and gradients equal the block's without checkpointing, and the
    tensors it saves for backward equal PyTorch's own selective checkpointing with the same policy
    on the same block without the extra annotation (random sizes)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from symcost.frontends.checkpointing import OP_SAC_SAVE, op_sac_context

    rng = random.Random(2929)
    n, m = rng.randint(3, 9), rng.randint(2, 7)
    x0, w0 = torch.randn(n, m, dtype=torch.float64), torch.randn(m, m, dtype=torch.float64)

    def run(fn, context_fn=None):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            out = fn(x, w) if context_fn is None else checkpoint(fn, x, w, use_reentrant=False,
                                                                 context_fn=context_fn)
        out.sum().backward()
        return out.detach(), x.grad, w.grad, saved

    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):  # (torchtitan's op policy, as symcost's)
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            count[mode] += 1
        keep = str(func) in OP_SAC_SAVE and not (func == torch.ops.aten.mm.default and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    with pytest.raises(RuntimeError, match="_record_function_enter"):
        run(_annotated(), lambda: create_selective_checkpoint_contexts(policy))
    plain = run(_annotated())
    got = run(_annotated(), op_sac_context)
    for a, b in zip(got[:3], plain[:3]):
        torch.testing.assert_close(a, b)
    count.update(forward=0, recompute=0)
    # (the same block with one annotation each time: PyTorch's own context replays it)
    want = run(_annotated(grow=False), lambda: create_selective_checkpoint_contexts(policy))
    assert got[3] == want[3] and len(got[3]) >= 2, (got[3], want[3])


def _fsdp_as_torchtitan_hf(model, mesh):
    """FSDP2 over a transformers MoE model laid out by EP, as torchtitan's ``apply_fsdp`` does under
    EP (torchtitan/models/deepseek_v3/infra/parallelize.py, written out here): each decoder layer's
    experts module ``fully_shard`` over ``dp_shard`` (``Shard(0)`` of the local experts), then each
    layer and the root over the flattened ``dp_shard × ep`` mesh, which it returns."""
    from torch.distributed.fsdp import fully_shard

    flat = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    for block in model.model.layers:
        experts = getattr(block.mlp, "experts", None)
        if experts is not None:
            fully_shard(experts, mesh=mesh["dp_shard"])
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat, reshard_after_forward=False)
    return flat


@pytest.mark.heavy
def test_ep_fsdp_dp1_selective_ac_deepseek_v3_against_pytorch(monkeypatch):
    """``--ep 2 --dp 1 --shard fsdp --ac selective`` on a tiny DeepSeek-V3 (tests/data/ep_rank.py
    ``TINY_DSV3``: MLA, a dense first layer, a shared expert; transformers' SDPA attention, which
    ``--torch-device cuda`` (the default) records as CUDA's memory-efficient kernel for MLA's
    unequal head dims, and the oracle runs so too, under ``device_kernels("cuda")``: TM1's path): the
    trace that failed in PyTorch's replay now fits, and at random B, S (the widths and EP pinned at
    the request) rank 0's hardware FLOPs (the recomputation included), model FLOPs, saved bytes,
    parameter elements and each group's bytes (EP all-to-all, DP all-gather and reduce-scatter) equal
    PyTorch running torchtitan's recipe on the fake group (module docstring), and (at the first
    draw) its model FLOPs equal the same step's without checkpointing with eager attention (model
    FLOPs do not depend on the attention kernel; FlopCounterMode counts a fused backward's
    recomputed scores, hardware FLOPs).
    ~35 s of CPU."""
    import torch
    import torch.utils.checkpoint as tcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.device_mesh import DeviceMesh

    from ep_rank import TINY_DSV3, measure
    from symcost.frontends.expert_parallel import apply
    from symcost.frontends.layout import Layout
    from symcost.frontends.parallel import fake_world
    from symcost.tracing.device_kernels import device_kernels
    from test_layout import _torchtitan_context

    spec = symcost.resolve("hf:deepseek_v3", TINY_DSV3, "sdpa")
    # (the plain step's model FLOPs: eager attention's matmuls, which FlopCounterMode counts as model
    # FLOPs; its count of a fused attention backward includes the recomputed scores: hardware FLOPs)
    eager = symcost.resolve("hf:deepseek_v3", TINY_DSV3, "eager")
    sizes = {"DP": 1, "EP": 2, "B": 2, "S": 16}
    pins = {s: "the test's widths" for s in ("H", "D", "V", "F", "K", "E", "R", "L", "EP")}
    an = symcost.trace(spec, layout=Layout(ep=True, shard="fsdp", ac="selective"), sizes=sizes, precision="fp32",
                       _pins=pins)
    assert {"B", "S"} <= set(an.symbols), (an.symbols, an.pinned)
    # PyTorch's proposed fix, in the oracle: record_function's ops outside SAC's replay
    prof = {getattr(getattr(torch.ops.profiler, n), o) for n in ("_record_function_enter_new",
                                                                  "_record_function_exit")
            for o in getattr(torch.ops.profiler, n).overloads()}
    monkeypatch.setattr(tcp, "SAC_IGNORED_OPS", set(tcp.SAC_IGNORED_OPS) | prof)
    rng = random.Random(2930)
    checked_plain = False
    for _ in range(2):
        v = {"DP": 1, "EP": 2, "B": rng.randint(1, 3), "S": 8 * rng.randint(1, 3)}
        values = {**spec.values(v), **v}
        got = {}
        for ac in (True, False) if not checked_plain else (True,):  # (the plain step once)
            fake_world(2 * v["EP"])
            mesh = DeviceMesh("cpu", torch.arange(v["EP"]).reshape(1, v["EP"]), mesh_dim_names=("dp_shard", "ep"))
            torch.manual_seed(0)
            model = (spec if ac else eager).build(values)
            apply(model, mesh["ep"])
            if ac:
                for name, block in list(model.model.layers.named_children()):
                    model.model.layers.register_module(name, checkpoint_wrapper(
                        block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False,
                        context_fn=_torchtitan_context))
            flat = _fsdp_as_torchtitan_hf(model, mesh)
            groups = {mesh["ep"].get_group().group_name: "EP", mesh["dp_shard"].get_group().group_name: "DP_expert",
                      flat.get_group().group_name: "DP"}
            tokens = torch.randint(0, int(TINY_DSV3["vocab_size"]), (v["B"], v["S"]))
            with device_kernels("cuda" if ac else None):
                got[ac] = measure(model, tokens, spec=spec if ac else eager, groups=groups)
        env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
        assert int(an.flops("train", "hardware").subs(env)) == got[True]["flops"], v
        if not checked_plain:
            assert int(an.flops("train").subs(env)) == got[False]["flops"] < got[True]["flops"], v
            checked_plain = True
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got[True]["saved"], v
        assert int(an.params_shard.subs(env)) == got[True]["shard"], v
        for g in ("DP", "DP_expert", "EP"):
            for k in ("all_gather", "reduce_scatter", "all_to_all"):
                want = Fraction(str(an.comm_bytes(k, group=g).subs(env)))
                assert want == Fraction(got[True]["by_group"].get(g, {}).get(k, "0")), (v, g, k)
        assert Fraction(got[True]["by_group"]["EP"]["all_to_all"]) > 0
    assert any("efficient_attention" in op.name for op in an.ops), "MLA's attention: CUDA's kernel"

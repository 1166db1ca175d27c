"""transformers' MoE experts run as Megatron-Core runs its MoE layer under ``--precision megatron-*``
(symcost/frontends/megatron_moe.py; issue 29, BR1).

Oracles, none of them symcost's formulas:

* values: transformers' own Qwen3-MoE block (its eager per-expert loop) on real CPU tensors, fp64:
  the Megatron-style block's output and every gradient (tokens, router, experts) equal it;
* FLOPs: ``FlopCounterMode`` of transformers' eager block at random sizes (the grouped GEMMs,
  counted group by group with ``torch.mm``, are the per-expert GEMMs);
* saved bytes: ``saved_tensors_hooks`` of the Megatron-style block against what Megatron-Core's
  code keeps (its ``WeightedSwiGLUFunction`` saves its input and the probs, the grouped GEMMs their
  inputs, the permutation its index: fusions/fused_bias_swiglu.py, moe_utils.py), and below
  transformers' grouped_mm block's;
* the traced rank under ``--ep`` (heavy): PyTorch running the same step on the fake process group
  (tests/data/ep_rank.py ``measure``: flop_counter's registry, saved_tensors_hooks, each
  all-to-all's bytes per rank).
"""
from __future__ import annotations

import copy
import os
import random
import sys
from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from symcost.frontends import megatron_moe, moe
from symcost.tracing import grouped_mm as gmm


def _blocks(rng: random.Random, dtype=torch.float64):
    """A random small Qwen3-MoE sparse block with symcost's experts implementation (transformers'
    code) and its Megatron-marked copy (same weights)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe.register_hf()
    e = rng.randint(3, 9)
    cfg = Qwen3MoeConfig(hidden_size=rng.choice((8, 12, 16, 24)), moe_intermediate_size=rng.choice((4, 8, 12)),
                         num_experts=e, num_experts_per_tok=rng.randint(1, min(3, e)),
                         norm_topk_prob=rng.random() < 0.5)
    cfg._experts_implementation = moe.HF_IMPLEMENTATION
    torch.manual_seed(rng.randint(0, 1000))
    ref = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    meg = megatron_moe.mark(copy.deepcopy(ref))
    return cfg, ref, meg


def test_megatron_block_equals_transformers_block():
    """Output and gradients (tokens, router weight, stacked experts) of the Megatron-style block ==
    transformers' eager experts loop, at random sizes (routing by the block's own router:
    unbalanced, some experts empty), fp64 on CPU; the experts ran Megatron's code (argsort)."""
    rng = random.Random(2929)
    for _ in range(3):
        cfg, ref, meg = _blocks(rng)
        ref.experts.config._experts_implementation = "eager"  # (transformers' own per-expert loop)
        object.__setattr__(ref.experts, moe.ROUTING_ATTR, moe.BALANCED)
        x = torch.randn(rng.randint(1, 3), rng.randint(2, 9), cfg.hidden_size, dtype=torch.float64)
        g = torch.randn_like(x)
        outs = []
        for blk in (ref, meg):
            xi = x.clone().requires_grad_()
            with gmm.kernels():
                y = blk(xi)
                y.backward(g)
            outs.append((y.detach(), xi.grad, {n: p.grad for n, p in blk.named_parameters()}))
        torch.testing.assert_close(outs[1][0], outs[0][0])
        torch.testing.assert_close(outs[1][1], outs[0][1])
        for n, want in outs[0][2].items():
            torch.testing.assert_close(outs[1][2][n], want, msg=n)
    seen = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with gmm.kernels(), Ops():
        meg(x)
    assert "aten.sort" in seen and "aten.index_add_" in seen and "aten._grouped_mm" in seen


def _saved_bytes(blk, x) -> int:
    """saved_tensors_hooks: the bytes of the storages autograd keeps in one forward of ``blk``,
    its parameters excluded (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in blk.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), gmm.kernels():
        blk(x)
    return sum(seen.values())


class _ByGroups(torch.utils._python_dispatch.TorchDispatchMode):
    """``aten._grouped_mm`` done group by group with ``torch.mm`` (symcost.tracing.grouped_mm's
    fallback), so that a ``FlopCounterMode`` beneath counts its GEMMs (its registry has none for
    ``_grouped_mm``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is gmm.GROUPED_MM:
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            return gmm._by_groups(args[0], args[1], offs, None)
        return func(*args, **kwargs)


def test_megatron_block_flops_and_saved_bytes():
    """At random sizes (fp32): the Megatron-style block's FlopCounterMode (forward, backward; its
    grouped GEMMs group by group) == transformers' eager loop's; its saved bytes (saved_tensors_hooks)
    are what Megatron-Core's code keeps — fc1's input [N·R, M], the weighted SwiGLU's input [N·R, 2F]
    and probs [N·R], fc2's input [N·R, F], the permutation's index [N·R] (int64), the probs' gather
    index (a slice of the argsort of the [E·N] routing map, int64), the grouped GEMMs' offsets [E]
    (int32) — beside the router's own (its softmax and top-k, as in transformers' block), and fewer
    than transformers' grouped_mm block keeps."""
    rng = random.Random(2930)
    for _ in range(3):
        cfg, ref, meg = _blocks(rng, torch.float32)
        b, s = rng.randint(1, 3), rng.randint(2, 9)
        x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
        ref.experts.config._experts_implementation = "eager"
        flops = []
        for blk in (ref, meg):
            object.__setattr__(blk.experts, moe.ROUTING_ATTR, moe.BALANCED)
            with FlopCounterMode(display=False) as f, _ByGroups():
                y = blk(x)
            with FlopCounterMode(display=False) as bw, _ByGroups():
                y.sum().backward()
            flops.append((f.get_total_flops(), bw.get_total_flops()))
        assert flops[1] == flops[0] and flops[0][0] > 0, flops
        n, r, m, ff, e = b * s, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        ref.experts.config._experts_implementation = "grouped_mm"
        ref_saved = _saved_bytes(ref, x.detach())
        got = _saved_bytes(meg, x.detach())
        router = _saved_bytes(meg.gate, x.detach().view(-1, m))
        want = 4 * n * r * (m + 2 * ff + 1 + ff) + 8 * n * r + 8 * e * n + 4 * e + router
        assert got == want, (got, want)
        assert got < ref_saved, (got, ref_saved)


@pytest.mark.heavy
def test_megatron_ep_rank_against_pytorch_on_the_fake_group():
    """A tiny Qwen3-MoE under ``--ep`` and ``--precision megatron-fp32`` (its own loss): EP a symbol;
    at random sizes the rank's FLOPs, saved bytes, all-to-all bytes (tokens and probs, forward and
    backward) and parameter elements equal PyTorch running the same Megatron-style step on the fake
    group (rank 0, real tensors, routers balanced), one count all-gather per MoE layer (its bytes
    by hand); its FLOPs
    equal transformers' EP step's (tests/test_expert_parallel.py), its saved bytes fewer."""
    import symcost
    from torch.distributed.device_mesh import init_device_mesh

    from symcost.frontends.expert_parallel import apply
    from symcost.frontends.layout import Layout
    from symcost.frontends.megatron import for_run
    from symcost.frontends.parallel import fake_world

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
    from ep_rank import measure  # noqa: E402
    from test_expert_parallel import QWEN

    base = symcost.resolve("hf:qwen3_moe", QWEN, "eager")
    spec = for_run(base, "megatron-fp32", loss="model")
    assert spec.extra["moe_code"] == megatron_moe.MEGATRON
    an = symcost.trace(spec, layout=Layout(ep=True), sizes={"EP": 2, "B": 2, "S": 16}, precision="megatron-fp32")
    assert "EP" in an.symbols and not an.pinned and not an.unsupported, (an.pinned, an.unsupported)
    rng = random.Random(2931)
    for ep, e in ((2, 8), rng.choice(((4, 8), (2, 16)))):
        v = {**base.values({}, inputs=False), "EP": ep, "E": e, "R": 2, "B": rng.randint(2, 3),
             "S": 8 * rng.randint(1, 2), "F": 8 * rng.randint(2, 5), "L": rng.randint(1, 2), "V": rng.randint(64, 160)}
        got = {}
        for name, s in (("megatron", spec), ("transformers", base)):
            fake_world(ep)
            torch.manual_seed(0)
            model = s.build(v)
            apply(model, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))["ep"])
            got[name] = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), spec=s)
        env = an.bind(**v)
        m = got["megatron"]
        assert int(an.flops("train").subs(env)) == m["flops"] == got["transformers"]["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == m["saved"] < got["transformers"]["saved"], v
        a2a = Fraction(str(an.comm_bytes("all_to_all").subs(env)))
        assert a2a == Fraction(m["comm"]["all_to_all"]) > Fraction(got["transformers"]["comm"]["all_to_all"]), v
        # the counts' all-gather ([E] int64 over the EP group, once per MoE layer; ep_rank counts it
        # as one "other" collective): (EP-1)/EP of its [EP·E] output (nccl-tests' all-gather)
        assert int(Fraction(m["comm"]["other"])) == v["L"], v
        assert an.comm_bytes("all_gather").subs(env) == v["L"] * (ep - 1) * e * 8, v
        assert int(an.params_shard.subs(env)) == m["shard"], v

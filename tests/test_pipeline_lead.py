"""Pipeline stages of a model whose first blocks are of another kind (``ModelSpec.lead_blocks``:
DeepSeek-V3's ``first_k_dense_replace`` dense blocks) where those blocks reach past the first stage
(DeepSeek-V3 at L = 8 over 8 stages: stages 1 and 2 hold dense blocks 1 and 2; they were built and
priced as MoE stages, 301,154,304 parameters each instead of 299,319,296 under ``--ep 64 --tp 2``).

Oracles, none of symcost's stage code: transformers' DeepSeek-V3 built on the meta device and cut
by hand into the stages' layers (the embedding on the first stage, the final norm and head on the
last), its parameters counted; one stage's step run by PyTorch on the stage cut by hand
(``FlopCounterMode``, ``saved_tensors_hooks``: tests/test_pipeline_parallel.py
``_oracle_hf_stage``). Sizes drawn at random (seeded).
"""
from __future__ import annotations

import random
import re

import pytest

pytestmark = pytest.mark.hf  # (transformers' DeepSeek-V3)

SEED = 1508

#: a tiny DeepSeek-V3: MLA, a shared expert, 8 routed experts (top-2); ``first_k_dense_replace`` set per test
TINY = {"hidden_size": "32", "n_routed_experts": "8", "num_experts_per_tok": "2", "moe_intermediate_size": "16",
        "intermediate_size": "48", "num_attention_heads": "2", "num_key_value_heads": "2", "vocab_size": "64",
        "n_shared_experts": "1", "q_lora_rank": "16", "kv_lora_rank": "8", "qk_rope_head_dim": "4",
        "qk_nope_head_dim": "8", "v_head_dim": "8", "n_group": "1", "topk_group": "1"}


def _split(L: int, pp: int) -> list[int]:
    """torchtitan's even split: the first L mod pp stages one block more."""
    return [L // pp + (1 if s < L % pp else 0) for s in range(pp)]


def _meta_counts(lead: int, L: int, pp: int) -> list[int]:
    """Parameter elements of each of the ``pp`` stages of transformers' DeepSeek-V3 (:data:`TINY`,
    ``first_k_dense_replace = lead``, L layers) built on the meta device, cut by the layer index."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3 import DeepseekV3Config

    cfg = DeepseekV3Config(**{k: int(v) for k, v in TINY.items()}, first_k_dense_replace=lead, num_hidden_layers=L)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    start = [sum(_split(L, pp)[:s]) for s in range(pp)]
    want = [0] * pp
    for name, p in model.named_parameters():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        stage = (max(s for s in range(pp) if start[s] <= int(m.group(1))) if m else
                 0 if "embed_tokens" in name else pp - 1)
        want[stage] += p.numel()
    return want


def _spec(lead: int):
    import symcost

    return symcost.resolve("hf:deepseek_v3", {**TINY, "first_k_dense_replace": str(lead)}, "eager")


def test_stage_modules_hold_the_leading_blocks_before_them():
    """At random lead (2 or 3), PP (2..4) and L with fewer blocks in the first stage than leading
    blocks (so later stages hold some: the case that was wrong), and at DeepSeek-V3's L = 8 over 8
    stages: each stage module as the pipeline builds it (``stage_spec`` with ``stage_kind``'s
    leading blocks before it, on the meta device) holds the parameters of the model's stage cut
    by hand, and the stage kinds name the stages that hold leading blocks. ~5 s."""
    import torch

    from symcost.frontends.pipeline import part_of, stage_kind, stage_spec

    rng = random.Random(SEED)
    lead = rng.choice((2, 3))
    pp = rng.randint(2, 4)
    L = rng.choice([x for x in range(pp, 3 * pp + 1) if _split(x, pp)[0] < lead] or [pp])
    for lead, pp, L in ((lead, pp, L), (3, 8, 8)):
        spec = _spec(lead)
        values = spec.values({"B": 2, "S": 8, "L": L})
        blocks, probes, got, kinds = _split(L, pp), {}, [], []
        for s in range(pp):
            kind, before = stage_kind(s, blocks, lead)
            kinds.append(kind)
            stage = stage_spec(spec, part_of(s, pp), "model.layers", p2p=False, probes=probes, before=before)
            with torch.device("meta"):
                got.append(sum(p.numel() for p in stage.build(dict(values, L=blocks[s])).parameters()))
        assert got == _meta_counts(lead, L, pp), (lead, pp, L, kinds)
        start = [sum(blocks[:s]) for s in range(pp)]
        assert kinds == [part_of(s, pp) if s == 0 or start[s] >= lead else f"{part_of(s, pp)}:lead{lead - start[s]}"
                         for s in range(pp)], kinds


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)`` (transformers' experts; ``torch.utils.flop_counter``
    has no formula for it, so FlopCounterMode counts 0): its groups' GEMMs, 2·m·k·n each, summed
    whatever the offsets: ``[M, K] x [G, K, N]`` 2·M·K·N, ``[K, M] x [M, N]`` (the weight gradient)
    2·K·M·N, ``[G, m, K] x [K, N]`` 2·m·K·N."""
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[-1]
    return 2 * a[1] * a[2] * b[1]


@pytest.mark.heavy
def test_report_pp_stage_holding_leading_blocks_vs_pytorch(monkeypatch):
    """``report --pp 2`` of the tiny DeepSeek-V3 with 3 dense blocks at L = 4 (stages of 2 and 2:
    the last stage holds dense block 2 and MoE block 3; it was traced as two MoE blocks): each
    rank's parameter elements equal the meta count of its stage (:func:`_meta_counts`), and the
    last stage's trace (kind ``last:lead1``) gives, at the request and at random B, S of its
    regime, the FLOPs (FlopCounterMode) and saved bytes (saved_tensors_hooks) of PyTorch running
    that stage cut by hand from transformers' model with symcost's balanced routing installed
    (``spec.build``; ``aten._grouped_mm`` counted by :func:`_grouped_mm_flops`), and its boundary
    bytes. ~40 CPU-s (two stage kinds traced; 68 s wall cold on the loaded 2-core machine,
    2026-12-05)."""
    import torch
    from test_pipeline_parallel import _check_stage
    from torch.utils import flop_counter

    from symcost.passes.pipeline import summary, trace_stages

    lead, pp, L = 3, 2, 4
    spec = _spec(lead)
    request = {"B": 2, "S": 16, "L": L}
    r = summary(spec, pp, "gpipe", 1, precision="fp32", sizes=request, peak=False)
    assert [row["params"] for row in r["ranks"]] == _meta_counts(lead, L, pp)
    _, ans = trace_stages(spec, pp, 1, "fp32", request)
    assert sorted(ans) == ["first", "last:lead1"], sorted(ans)
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten._grouped_mm,
                        flop_counter.shape_wrapper(_grouped_mm_flops))
    rng = random.Random(SEED)
    for values in (request, {"B": rng.randint(2, 3), "S": 8 * rng.randint(1, 3), "L": L}):
        _check_stage(spec, ans["last:lead1"], dict(spec.values(values)), pp, pp - 1, "fp32")

"""MoE layers traced with the experts code the model runs (issue 31, items 2 and 4).

Under the default ``balanced`` routing a transformers MoE model is traced with transformers' own
default experts implementation, ``grouped_mm`` (``grouped_mm_experts_forward``: slots sorted by
expert, ``torch._grouped_mm`` over ``[N·R, in] × [E, in, out]``), not symcost's padded dispatch;
the routing model decides only the offsets, never a shape (symcost/frontends/moe.py, docs/moe.md).

Oracles (no symcost formula involved):

* the GEMM FLOPs of ``aten._grouped_mm``: ``FlopCounterMode`` around the same products done group
  by group with ``torch.mm`` (``torch.utils.flop_counter`` has no formula for ``_grouped_mm``);
  its output layout: PyTorch's own CPU kernel;
* activations: ``saved_tensors_hooks`` on a real CPU forward of the model with its experts set
  to transformers' ``grouped_mm`` by transformers' API (``set_experts_implementation``), the
  router forced to the balanced assignment, and again with the router left alone (its own,
  unbalanced routing: the same bytes, since the shapes do not depend on it);
* FLOPs: ``FlopCounterMode`` of one real step with transformers' ``eager`` experts loop (one
  ``mm`` per expert hit, the balanced router forced), whose per-expert GEMMs the grouped GEMMs
  must equal;
* ``serve``: the KV bytes of gpt-oss-20b's published config by hand (layers alternating a
  128-token sliding window and full attention; 8 key/value heads of 64, bf16), cut to its first 4
  of 24 layers.
"""
from __future__ import annotations

import json
import random

import pytest
import sympy
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import run_cli
import memory_oracle as oracle
from symcost.graph import rules
from symcost.passes.memory import memory_model
from symcost.passes.moe import slots_per_expert
from symcost.tracing import grouped_mm as gmm
from symcost.tracing.fit import SYMS
from test_moe import balanced_router, step_flops

#: the issue's tiny Qwen3-MoE: E 8, top-2, hidden 64, L 2 (fp32, B 2, S 64)
QWEN = {"hidden_size": "64", "num_experts": "8", "num_experts_per_tok": "2", "num_hidden_layers": "2",
        "moe_intermediate_size": "32", "num_attention_heads": "4", "num_key_value_heads": "2",
        "vocab_size": "128"}
ISSUE_SIZES = {"B": 2, "S": 64}
GPT_OSS_20B = "tests/data/configs/gpt-oss-20b.json"


def test_grouped_mm_flops_and_layout_equal_its_groups():
    """The rule's FLOPs == FlopCounterMode of the same products as one ``torch.mm`` per group, in
    all three grouped forms a step runs (experts forward: rows split; weight gradient: the
    contraction split; 3-D × 2-D), at random sizes and random group splits; the output's layout
    (rows padded to 16 bytes) == PyTorch's kernel's, and its values the per-group products."""
    rng = random.Random("grouped-mm")
    for _ in range(4):
        g, k, n = rng.randint(2, 6), 4 * rng.randint(1, 5), rng.randint(3, 21)
        cuts = sorted(rng.randint(0, 40) for _ in range(g - 1))
        bounds = [0, *cuts, rng.randint(max(cuts) if cuts else 0, 48)]
        offs = torch.tensor(bounds[1:], dtype=torch.int32)
        rows = bounds[-1]
        # the weights as the experts store them, [G, out, in], transposed (transformers' _grouped_linear)
        x, w = torch.randn(rows, k), torch.randn(g, n, k).transpose(1, 2)
        with FlopCounterMode(display=False) as fc:
            want = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
        assert rules.grouped_mm_flops((rows, k), (g, k, n), (rows, n)) == fc.get_total_flops()
        out = gmm.run(gmm.GROUPED_MM, (x, w, offs), {})
        torch.testing.assert_close(out, want)
        # PyTorch's kernel takes these operands (16-byte rows: k is a multiple of 4) and pads its
        # output rows to 16 bytes where n is not
        assert out.stride() == torch._grouped_mm(x, w, offs).stride()
        # weight gradient: [k, rows] (contraction split) x [rows, n] -> [G, k, n]
        go = torch.randn(rows, n)
        with FlopCounterMode(display=False) as fc:
            for s, e in zip(bounds, bounds[1:]):
                x.t()[:, s:e] @ go[s:e]
        assert rules.grouped_mm_flops((k, rows), (rows, n), (g, k, n)) == fc.get_total_flops()
        # 3-D x 2-D: [G, m, k] x [k, N_total] (columns split)
        a3 = torch.randn(g, 5, k)
        b2 = torch.randn(k, rows)
        with FlopCounterMode(display=False) as fc:
            for i, (s, e) in enumerate(zip(bounds, bounds[1:])):
                a3[i] @ b2[:, s:e]
        assert rules.grouped_mm_flops((g, 5, k), (k, rows), (5, rows)) == fc.get_total_flops()


def _issue_trace(traced):
    return traced("hf:qwen3_moe", "fp32", "eager", tuple(QWEN.items()))


def _real_grouped(spec, values):
    """The real CPU model at ``values`` with transformers' own ``grouped_mm`` experts."""
    torch.manual_seed(0)
    model = spec.build(oracle.full_values(spec, values)).train()
    model.set_experts_implementation("grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    return model


def _saved(spec, values, model) -> int:
    """saved_tensors_hooks: bytes autograd keeps in one forward + loss (tests/memory_oracle.py)."""
    static = set(oracle._storages(list(model.parameters()) + list(model.buffers())))
    seen: dict[int, int] = {}
    keep = []

    def pack(t):
        keep.append(t)
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in static:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    full = oracle.full_values(spec, values)
    args, kwargs = spec.make_inputs(full, torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
        spec.loss(out, (args, kwargs))
    return sum(seen.values())


def _eager_flops(spec, values) -> dict[str, int]:
    """FlopCounterMode of a real step with transformers' ``eager`` experts loop, balanced router."""
    torch.manual_seed(0)
    full = oracle.full_values(spec, values)
    model = spec.build(full).train()
    model.set_experts_implementation("eager")
    f, b = step_flops(spec, model, full)
    return {"flops.forward": f, "flops.backward": b}


def _draws(an, n: int) -> list[dict[str, int]]:
    """The issue's sizes, then ``n`` random ones in the trace's regime (F and D keep their residue
    mod 8: PyTorch's grouped kernel takes 16-byte rows only), E dividing nothing in particular."""
    out = [dict(ISSUE_SIZES)]
    rng = random.Random("moe-experts-code")
    while len(out) < n + 1:
        v = {"B": rng.randint(2, 3), "S": rng.randint(3, 17), "H": rng.choice((2, 4, 6)), "D": rng.choice((8, 16)),
             "L": rng.randint(1, 3), "V": rng.randint(17, 90), "F": rng.choice((8, 16, 24)),
             "E": rng.randint(3, 9), "R": rng.randint(1, 3)}
        v["K"] = rng.choice([k for k in (1, 2, 3) if v["H"] % k == 0 and k < v["H"]])
        v = {s: v[s] for s in an.symbols}
        if an.spec.check(oracle.full_values(an.spec, v)) or any(
                s in v and v[s] % m != r for s, (m, r) in an.residues.items()):
            continue
        out.append(v)
    return out


@pytest.mark.heavy
def test_tiny_qwen3_moe_saved_bytes_and_flops_are_the_model_code(traced):
    """The issue's Qwen3-MoE and two random draws: activations == saved_tensors_hooks of the real
    model with transformers' grouped_mm experts (balanced router forced, and its own routing);
    FLOPs == FlopCounterMode of transformers' eager experts loop; nothing pinned, the slots per
    expert B·S·R/E."""
    an = _issue_trace(traced)
    assert not an.pinned, an.pin_reasons
    assert "grouped_mm" in an.spec.extra["experts_code"]
    assert not an.unsupported, an.unsupported
    B, S, R, E = (SYMS[s] for s in "BSRE")
    assert sympy.simplify(slots_per_expert(an) - B * S * R / E) == 0
    mm = memory_model(an, "fp32")
    for v in _draws(an, 2):
        model = _real_grouped(an.spec, v)
        with balanced_router():
            forced = _saved(an.spec, v, model)
        own = _saved(an.spec, v, model)
        assert forced == own, (v, forced, own)  # the routing decides no shape
        assert mm.components(**v)["activations"] == forced, v
        got = an.subs(**v)
        want = _eager_flops(an.spec, v)
        for key, w in want.items():
            assert got[key] == w, (v, key, got[key], w)


@pytest.mark.heavy
def test_capacity_routing_keeps_the_padded_dispatch(traced):
    """``capacity=c`` is no code a model runs: it stays symcost's padded dispatch ([E, C, M]
    buffers), its saved bytes those of that dispatch run for real (memory_oracle.saved_bytes of the
    spec's build), and its probes keep c·B·S·R/E whole."""
    import symcost
    from symcost.frontends import moe

    spec = moe.with_routing(symcost.resolve("hf:qwen3_moe", QWEN, "eager"), "capacity=2")
    assert "padded dispatch" in spec.extra["experts_code"]
    assert spec.probe_check({"B": 1, "S": 1, "R": 2, "E": 8}) is not None
    an = symcost.trace(spec, precision="fp32", sizes=ISSUE_SIZES)
    v = _draws(an, 1)[0]
    with balanced_router():
        want = oracle.saved_bytes(an.spec, v, "fp32")
    assert memory_model(an, "fp32").components(**v)["activations"] == want
    balanced = _issue_trace(traced)
    assert memory_model(an, "fp32").components(**v)["activations"] > \
        memory_model(balanced, "fp32").components(**v)["activations"]


@pytest.mark.heavy
def test_serve_tiny_qwen3_moe_at_context_65(capsys):
    """serve answers the tiny Qwen3-MoE at context 65 (refused before: E ∤ c·B·S·R at S = 1)."""
    config = [f"{k}={v}" for k, v in QWEN.items()]
    code, out, err = run_cli(capsys, "serve", "hf:qwen3_moe", "--config", *config, "--context", "65",
                             "--device", "h100-sxm", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["max_batch"] >= 1 and r["seconds_per_token"] > 0
    # 2 layers x keys and values x 2 key/value heads x head_dim 16 (64 / 4) x 65 tokens x 2 bytes (bf16)
    assert r["kv"]["per_sequence"] == 2 * 2 * 2 * 16 * 65 * 2


@pytest.mark.heavy
def test_serve_gpt_oss_20b_at_context_8192(capsys, tmp_path):
    """serve answers gpt-oss-20b's published config at context 8192 (refused before: "no probe
    sizes for B, H, V, F, K, E, R, T stay in the regime"): a batch and a time per token, and the
    KV cache of each sliding-window layer holds W = 128 tokens, of each full layer 8192.

    Sized for the suite: the published config cut to its first 2 of 24 layers (1 sliding, 1 full,
    in the published order; every width, the 32 experts, top-4 and the window as published):
    the refusal was the probes' regime (E | c·B·S·R), not the depth (the 4-layer and the 2-layer
    configs are refused with the same message at 2d5023f^, the commit before the fix), and the
    traces record every layer of the config's list, each kind's cache formula from its own layer
    (the command alone: 24 layers 73 CPU-s, 4 layers 29, 2026-12-05; 4 layers 45, 2 layers 30,
    2026-12-06; loaded machine)."""
    cfg = json.load(open(GPT_OSS_20B))
    assert cfg["layer_types"].count("sliding_attention") == 12 and cfg["sliding_window"] == 128
    cfg = dict(cfg, num_hidden_layers=2, layer_types=cfg["layer_types"][:2])
    path = tmp_path / "gpt-oss-20b-2-layers.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run_cli(capsys, "serve", str(path), "--context", "8192", "--device", "h100-sxm", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["max_batch"] >= 1 and r["seconds_per_token"] > 0 and r["tokens_per_second"] > 0
    kinds = cfg["layer_types"]
    w, kv_heads, head_dim = cfg["sliding_window"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_token_layer = 2 * kv_heads * head_dim * 2  # keys and values, bf16
    want = sum(per_token_layer * (min(w, 8192) if k == "sliding_attention" else 8192) for k in kinds)
    assert kinds.count("sliding_attention") == kinds.count("full_attention") == 1
    assert r["kv"]["per_sequence"] == want
    assert r["kv"]["total"] == r["max_batch"] * want


def test_time_and_mfu_say_why_an_moe_step_uses_the_fp32_peak(capsys):
    """Under ``bf16-mixed`` transformers' grouped_mm experts run in fp32 (``torch._grouped_mm`` has
    no autocast kernel): ``time`` and ``mfu`` divide by the fp32 peak and say why, in one note
    naming the op. Oracle: the dtype PyTorch's own step runs ``aten._grouped_mm`` in under
    ``torch.autocast(bf16)`` on CPU (a dispatch mode on the real forward), at random sizes where the
    experts carry most of the FLOPs; a dense model under the same flag gets no note."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = random.Random("moe-precision-note")
    hidden, inter, E = 16 * rng.randint(2, 3), 32 * rng.randint(4, 6), rng.choice((4, 8))
    cfg = {"num_hidden_layers": 2, "hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
           "moe_intermediate_size": inter, "intermediate_size": inter, "num_experts": E,
           "num_experts_per_tok": 2, "vocab_size": 64}
    seen = set()

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "grouped_mm" in str(func):
                seen.update(str(a.dtype) for a in args[:2] if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **cfg))
    with torch.autocast("cpu", dtype=torch.bfloat16), Dtypes():
        model(input_ids=torch.randint(0, 64, (2, 16)))
    assert seen == {"torch.float32"}, seen  # what PyTorch runs: the expert GEMMs in fp32
    args = ["--config", *[f"{k}={v}" for k, v in cfg.items()], "--set", "B=2", "S=16",
            "--precision", "bf16-mixed", "--device", "h100", "--devices", "8", "--json"]
    code, out, err = run_cli(capsys, "time", "hf:qwen3_moe", *args, "--tokens", "1e9", "--mfu", "0.0005")
    assert code == 0, err
    r = json.loads(out)
    assert r["precision"] == "fp32" and "aten._grouped_mm" in r["precision_note"], r.get("precision_note")
    code, out, err = run_cli(capsys, "mfu", "hf:qwen3_moe", *args, "--tokens-per-second", "1000")
    assert code == 0, err
    assert "grouped_mm" in json.loads(out)["precision_note"]
    code, out, err = run_cli(capsys, "time", "hf:llama", "--config", "num_hidden_layers=2", "hidden_size=32",
                             "num_attention_heads=4", "num_key_value_heads=2", "intermediate_size=64",
                             "vocab_size=64", "--set", "B=2", "S=16", "--precision", "bf16-mixed", "--device",
                             "h100", "--devices", "8", "--json", "--tokens", "1e9", "--mfu", "0.0005")
    assert code == 0, err
    r = json.loads(out)
    assert r["precision"] == "bf16" and "precision_note" not in r

"""Model FLOPs do not depend on the attention kernel (issue 14, item 2), and what ``mfu``/``time``
say they counted (items 4 and 5).

Model FLOPs (``flops.*``: MFU, 6·N·P, ``time --mfu``) are the same for ``--attention sdpa`` and
``eager`` on every architecture; the fused backward's recomputed scores are hardware FLOPs
(``flops_hw.*``, HFU). Oracles: FlopCounterMode of a real eager step (which counts each matmul
autograd runs), and a hand count of the fused backward's extra product, 2·B·H·S²·D per kernel
call (``torch.utils.flop_counter.sdpa_backward_flop_count``'s first term). Recordings are on fake
tensors, so sizes are drawn at random up to S = 2048 at no cost.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import run_cli
from memory_oracle import full_values
from symcost.frontends import hf
from symcost.graph.build import concrete_totals
from symcost.passes import roofline as rl
from symcost.tracing.record import record

ARCHS = ["llama", "mistral", "qwen2", "gemma", "phi3", "opt", "gpt2", "gpt_neox"]


def _sizes(spec, rng, s_max, gqa):
    h = rng.choice((2, 4, 8))
    v = {"B": rng.randint(1, 3), "S": rng.randint(3, s_max), "H": h, "D": rng.choice((4, 8, 16)),
         "L": rng.randint(1, 3), "V": rng.randint(17, 300), "F": rng.randint(8, 96), "M": rng.choice((24, 40)),
         "K": rng.choice([k for k in (1, 2) if h % k == 0 and k < h]) if gqa else h}
    return full_values(spec, {s: x for s, x in v.items() if s in spec.symbols or s in ("B", "S")})


@pytest.mark.hf
@pytest.mark.parametrize("arch", ARCHS)
def test_model_flops_do_not_depend_on_the_attention_kernel(arch):
    """sdpa and eager steps of one architecture at random sizes (grouped-query and multi-head):
    equal model FLOPs, equal to FlopCounterMode of the real eager step (at the small size);
    hardware FLOPs of sdpa exceed them by exactly 2·B·H·S²·D per fused backward."""
    rng = random.Random(f"kernel-free:{arch}")
    specs = {a: hf.spec(arch, attention=a) for a in ("sdpa", "eager")}
    for s_max, gqa in ((40, True), (2048, False)):
        v = _sizes(specs["eager"], rng, s_max, gqa and "K" in specs["eager"].symbols)
        rec = {a: record(spec, v, "fp32") for a, spec in specs.items()}
        tot = {a: concrete_totals(r) for a, r in rec.items()}
        for ph in ("forward", "backward"):
            assert tot["sdpa"][f"flops.{ph}"] == tot["eager"][f"flops.{ph}"], (arch, v, ph)
            assert tot["eager"][f"flops_hw.{ph}"] == tot["eager"][f"flops.{ph}"]
        fused = sum("attention" in o.name and "backward" in o.name for o in rec["sdpa"].ops)
        assert fused in (0, v["L"])  # (SDPA with dropout decomposes into explicit matmuls on the CPU)
        extra = fused * 2 * v["B"] * v["H"] * v["S"] ** 2 * v["D"]
        assert tot["sdpa"]["flops_hw.backward"] - tot["sdpa"]["flops.backward"] == extra
        if s_max == 40:  # the independent oracle: FlopCounterMode of the real eager step
            torch.manual_seed(0)
            model = specs["eager"].build(v)
            args, kwargs = specs["eager"].make_inputs(v, torch.device("cpu"))
            with FlopCounterMode(display=False) as fc:
                specs["eager"].loss(model(*args, **kwargs), (args, kwargs)).backward()
            assert fc.get_total_flops() == tot["sdpa"]["flops.forward"] + tot["sdpa"]["flops.backward"]


def _json(capsys, *args):
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.hf
@pytest.mark.heavy
def test_mfu_6NP_and_time_identical_for_sdpa_and_eager(capsys):
    """Through the CLI: MFU, the 6·N·P form and `time` are the same for both kernels; HFU is
    reported apart (sdpa's above its MFU by the recomputed scores, eager's equal to it)."""
    sets = ["--set", "B=2", "S=512", "H=4", "D=16", "L=2", "V=256", "F=128", "K=2", "--precision", "fp32",
            "--device", "h100"]
    mfu, tim = {}, {}
    for a in ("sdpa", "eager"):
        mfu[a] = _json(capsys, "mfu", "hf:llama", *sets, "--attention", a, "--tokens-per-second", "2e6", "--json")
        tim[a] = _json(capsys, "time", "hf:llama", *sets, "--attention", a, "--tokens", "1e9", "--mfu", "0.01",
                       "--json")
    for k in ("mfu", "flops.per_token", "flops.per_token_6P", "flops.train_step"):
        assert mfu["sdpa"][k] == mfu["eager"][k], k
    for k in ("compute.total", "compute.6NP", "time.seconds", "time.days", "time.6NP.days", "flops.per_token"):
        assert tim["sdpa"][k] == tim["eager"][k], k
    B, S, H, D, L = 2, 512, 4, 16, 2
    assert mfu["sdpa"]["flops.train_step_hardware"] - mfu["sdpa"]["flops.train_step"] == 2 * B * H * S**2 * D * L
    assert mfu["sdpa"]["hfu"] > mfu["sdpa"]["mfu"] and mfu["eager"]["hfu"] == mfu["eager"]["mfu"]
    assert tim["sdpa"]["hfu"] > tim["sdpa"]["mfu"] == 0.01 and tim["sdpa"]["utilization_given"] == "mfu"
    # eval's JSON: model FLOPs equal, hardware FLOPs apart
    ev = {a: _json(capsys, "eval", "hf:llama", *sets[:-2], "--attention", a, "--json") for a in ("sdpa", "eager")}
    assert ev["sdpa"]["flops"] == ev["eager"]["flops"]
    assert ev["sdpa"]["flops_hw"]["train"] - ev["eager"]["flops_hw"]["train"] == 2 * B * H * S**2 * D * L


# -- `time`: --mfu or --hfu, fractions, the sizes it used -------------------------------------------


@pytest.mark.parametrize("text,want", [("0.45", 0.45), ("45%", 0.45), ("140/312", 140 / 312),
                                       ("140e12/312e12", 140 / 312), (" 1 ", 1.0)])
def test_utilization_fractions(text, want):
    assert rl.parse_fraction(text, "--mfu") == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("args,needle", [
    (["--mfu", "abc"], "--mfu takes a fraction of peak such as 0.45, 45% or 140/312, got 'abc'"),
    (["--mfu", "140/0"], "--mfu takes a fraction"),
    (["--hfu", "3/2"], "--hfu must lie in (0, 1]"),
    (["--mfu", "0"], "--mfu must lie in (0, 1]"),
    (["--mfu", "0.4", "--hfu", "0.5"], "exactly one of --mfu"),
    ([], "exactly one of --mfu"),
])
def test_time_bad_utilization_is_one_line(capsys, args, needle):
    code, out, err = run_cli(capsys, "time", "gpt2", "--tokens", "1e9", "--device", "h100", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_time_prints_the_sizes_and_parameters_it_used(capsys, traced):
    """`time` (and `mfu`) name every size they counted, which ones are the model's defaults, and
    the parameter count, in text; --mfu 140/312 is accepted and equals its decimal."""
    an = traced("gpt2", "fp32")
    sz = {"B": 8, "S": 64, "H": 4, "D": 16}
    code, out, err = run_cli(capsys, "time", "gpt2", "--set", "B=8", "S=64", "H=4", "D=16", "--precision", "fp32",
                             "--tokens", "1e9", "--device", "h100", "--mfu", "140/312")
    assert code == 0, err
    assert max(len(x) for x in out.splitlines()) <= 100
    lines = out.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("sizes:"))
    defaults = an.spec.defaults
    assert lines[i] == f"sizes: B=8 S=64 H=4 D=16 L={defaults['L']} V={defaults['V']}"
    assert lines[i + 1].strip() == "(L V: the model's defaults; B S H D: --set)"
    full = int(an.params.xreplace(an.bind(**{**sz, "L": defaults["L"], "V": defaults["V"]})))
    assert lines[i + 2].startswith(f"parameters: {full:,} (")
    assert "MFU 0.4487 (44.9%) (given), HFU 0.4487 (44.9%) (derived)" in out  # 140/312
    a = _json(capsys, "time", "gpt2", "--set", "B=8", "S=64", "H=4", "D=16", "--precision", "fp32", "--tokens", "1e9",
              "--device", "h100", "--mfu", "140/312", "--json")
    b = _json(capsys, "time", "gpt2", "--set", "B=8", "S=64", "H=4", "D=16", "--precision", "fp32", "--tokens", "1e9",
              "--device", "h100", "--mfu", str(140 / 312), "--json")
    assert a["time.seconds"] == b["time.seconds"] and a["sizes"]["L"] == defaults["L"] and a["params"] == full
    code, out, err = run_cli(capsys, "mfu", "gpt2", "--set", "B=8", "S=64", "H=4", "D=16", "--precision", "fp32",
                             "--tokens-per-second", "1e6", "--device", "h100")
    assert code == 0, err
    assert f"parameters: {full:,}" in out and "MFU:" in out and "HFU:" in out


def test_time_hfu_is_mfu_times_model_over_hardware(capsys):
    """--hfu u: time = hardware FLOPs / (devices·peak·u); the MFU it implies is u·model/hardware,
    and the same time comes from --mfu at that MFU."""
    base = ["time", "gpt2", "--set", "B=8", "S=64", "H=4", "D=16", "L=2", "--precision", "fp32", "--tokens", "1e9",
            "--device", "h100", "--recompute", "selective"]
    h = _json(capsys, *base, "--hfu", "0.3", "--json")
    assert h["utilization_given"] == "hfu" and h["hfu"] == 0.3
    ratio = h["flops.train_step_hardware"] / h["flops.train_step"]
    assert ratio > 1  # selective recomputation of the explicit Q·Kᵀ
    assert h["mfu"] == pytest.approx(0.3 / ratio)
    assert h["time.seconds"] == pytest.approx(float(h["compute.hardware"]) / (h["peak_flops"] * 0.3))
    m = _json(capsys, *base, "--mfu", repr(h["mfu"]), "--json")
    assert m["time.seconds"] == pytest.approx(h["time.seconds"], rel=1e-12)


@pytest.mark.heavy
def test_readme_time_example_says_what_it_computes(capsys):
    """The README's `symcost time` line runs as written and prints the sizes it used (GPT-3
    175B's, set with --set), the parameter count (about 175 B) and the days."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("symcost time "))
    args = line.split("#")[0].split()[1:]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    sizes = next(x for x in out.splitlines() if x.startswith("sizes:"))
    assert "H=96 D=128 L=96" in sizes
    params = int(re.search(r"^parameters: ([\d,]+)", out, re.M).group(1).replace(",", ""))
    assert params == pytest.approx(175e9, rel=0.01)
    assert re.search(r"exact: .* days", out)

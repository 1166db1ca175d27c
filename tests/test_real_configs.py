"""Real published configs (issue 6, item 3): ``symcost`` reads a transformers ``config.json``.

Thirteen dense configs in ``tests/data/configs/`` are written out from the values their model cards
publish (the seven mixture-of-experts configs beside them are checked by
tests/test_moe_real_configs.py, whose FLOP oracle runs transformers' own experts code). For each: the parameter count equals ``sum(p.numel())`` of the model built from that
file on the meta device, model FLOPs (forward, backward, train) at two sizes equal
``torch.utils.flop_counter.FlopCounterMode`` run on fake tensors at the file's full width (eager
attention, small B, S and L: fake tensors allocate nothing), and ``symcost report`` runs on it.
How long each takes cold is benchmarks/bench_real_configs.py's business, not a timed test.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import symcost

HERE = os.path.dirname(__file__)

def _routed_experts(path: str) -> bool:
    """Whether a config file has routed experts (a mixture of experts), read from the file."""
    import json

    with open(path) as f:
        c = json.load(f)
    return any(isinstance(c.get(k), int) and c[k] >= 2 for k in ("num_local_experts", "num_experts", "n_routed_experts"))


ALL_CONFIGS = sorted(glob.glob(os.path.join(HERE, "data", "configs", "*.json")))
CONFIGS = [p for p in ALL_CONFIGS if not _routed_experts(p)]
MOE_CONFIGS = [p for p in ALL_CONFIGS if _routed_experts(p)]
# (B, S, L) of the two FLOP checks: the regime of B, S > 1 (traced with the first)
SIZES = ({"B": 2, "S": 16, "L": 2}, {"B": 3, "S": 24, "L": 3})


def fake_flops(spec, values: dict[str, int], experts: str | None = None) -> dict[str, int]:
    """FlopCounterMode's forward (forward + the model's loss) and backward totals for the model
    ``spec`` builds at ``values``, run on fake CPU tensors (no memory: full-width configs fit).
    ``experts``: a transformers experts implementation to set first (an MoE's ``batched_mm``:
    every routed slot through its expert, FLOPs independent of the routing)."""
    with torch.device("meta"):
        model = spec.build(values)
    model.train()
    if experts is not None:
        model.set_experts_implementation(experts)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        ids = torch.randint(0, values["V"], (values["B"], values["S"]))
        with FlopCounterMode(display=False) as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    f, b = fwd.get_total_flops(), bwd.get_total_flops()
    return {"flops.forward": f, "flops.backward": b, "flops.train": f + b}


def test_thirteen_configs_present():
    """Thirteen dense configs here (Llama-3-70B for the composed-layout command of issue 27); the seven MoE ones (DeepSeek-V2-Lite, DeepSeek-V3, Qwen3-30B-A3B,
    OLMoE-1B-7B, Mixtral-8x7B, gpt-oss-20b/120b) in tests/test_moe_real_configs.py."""
    assert len(CONFIGS) == 13
    assert [os.path.basename(p)[:-5] for p in MOE_CONFIGS] == [
        "deepseek-v2-lite", "deepseek-v3", "gpt-oss-120b", "gpt-oss-20b", "mixtral-8x7b", "olmoe-1b-7b",
        "qwen3-30b-a3b"]


@pytest.mark.heavy
@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p)[:-5] for p in CONFIGS])
def test_real_config(path, capsys):
    an = symcost.trace(path, sizes=SIZES[0], precision="fp32", attention="eager", use_cache=False)
    spec = an.spec
    full = dict(spec.defaults)
    full.update({a: full[b] for a, b in spec.tied.items()})
    with torch.device("meta"):
        model = spec.build(full)
    assert an.subs()["params"] == sum(p.numel() for p in model.parameters())
    for sizes in SIZES:
        values = {**full, **sizes}
        got = an.subs(**sizes)
        want = fake_flops(spec, values)
        assert want["flops.forward"] > 0
        assert {k: got[k] for k in want} == want, (path, sizes)
    # the report renders (what `symcost report CONFIG --set B=2 S=16` prints, on this trace)
    from symcost.render import report as rep

    sizes = {k: v for k, v in SIZES[0].items() if k != "L"}
    rep.render(an, sizes, memory=rep.memory_section(an, sizes, "80GiB", "fp32", "adamw"))
    out = capsys.readouterr().out
    assert "6·N·P" in out and os.path.basename(path) in out


def test_hub_name_not_in_cache_is_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-m", "symcost.cli", "eval", "hf:nosuch-org/nosuch-model"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "local Hugging Face cache" in lines[0] and "never downloads" in lines[0]


def test_hub_name_from_local_cache(tmp_path):
    """``hf:ORG/NAME`` reads the config.json a local Hugging Face cache holds (no network)."""
    repo = tmp_path / "models--acme--tiny-llama"
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    with open(os.path.join(HERE, "data", "configs", "llama-3-8b.json")) as f:
        (snap / "config.json").write_text(f.read())
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    code = ("import symcost; s = symcost.resolve('hf:acme/tiny-llama'); "
            "print(s.name, s.defaults['H'], s.defaults['K'], s.defaults['V'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["hf:acme/tiny-llama", "32", "8", "128256"]


def test_bad_config_file_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 8}')
    res = subprocess.run([sys.executable, "-m", "symcost.cli", "eval", str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "model_type" in res.stderr and len(res.stderr.strip().splitlines()) == 1

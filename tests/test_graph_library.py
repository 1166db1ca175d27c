"""The graph library (``graphs/``, :mod:`symcost.graph.library`): what it holds, that a request it
serves answers as a fresh trace does and is labelled, that another size of a family is served only
where the formulas hold there, and that the committed graphs agree with PyTorch's own measurement
(FlopCounterMode, saved_tensors_hooks, a meta-device parameter count) and with a fresh trace.

Regenerate the library with ``symcost graphs build`` (one graph: ``--only NAME``)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import sympy
import torch

from conftest import run_cli
from symcost import parse_formula

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = ROOT / "graphs"
REGENERATE = "symcost graphs build"


@pytest.fixture(autouse=True)
def _library_on(monkeypatch):
    """The checkout's graphs/ (conftest turns the library off for every other test)."""
    monkeypatch.delenv("SYMCOST_GRAPHS_DIR", raising=False)


def _index() -> dict:
    return {e["name"]: e for e in json.loads((GRAPHS / "index.json").read_text())["graphs"]}


def _analysis(name: str):
    from symcost.graph.analysis import Analysis

    return json.loads((GRAPHS / f"{name}.json").read_text())


def test_library_holds_the_catalogue_with_pages():
    """Every graph of the catalogue is in the index with its JSON and its Markdown page (formulas
    and their LaTeX), at least 20 of them, and the index page names the versions traced with."""
    from symcost.graph.library import CATALOGUE

    idx = _index()
    assert len(idx) >= 20
    missing = sorted(set(CATALOGUE) - set(idx))
    assert not missing, f"graphs/ lacks {missing}: run `{REGENERATE}`"
    md_index = (GRAPHS / "index.md").read_text()
    for name, e in idx.items():
        data = _analysis(name)
        assert data["name"] == name and data["analysis"]["totals"]["flops.train"]
        page = (GRAPHS / f"{name}.md").read_text()
        train = parse_formula(data["analysis"]["totals"]["flops.train"])
        assert "$$" in page and sympy.latex(train) in page, name
        assert f"[{name}]({name}.md)" in md_index and e["traced_with"]["torch"] in md_index


@pytest.mark.heavy
@pytest.mark.parametrize("config", ["gemma-2b", "qwen3-4b"])
def test_served_from_the_library_equals_a_fresh_trace(config, cache_dir, capsys):
    """With an empty trace cache a real config at --set B=1 S=8192 is answered from the graph
    library, labelled, with the numbers of a fresh trace (--no-cache); nothing is traced."""
    path = f"tests/data/configs/{config}.json"
    args = ("--set", "B=1", "S=8192")
    code, out, err = run_cli(capsys, "report", str(ROOT / path), *args)
    assert code == 0, err
    assert "from the graph library (traced with torch" in " ".join(out.split())
    code, lib, err = run_cli(capsys, "eval", str(ROOT / path), *args, "--json")
    assert code == 0, err
    assert not any(cache_dir.iterdir())  # served, not traced
    code, fresh, err = run_cli(capsys, "eval", str(ROOT / path), *args, "--json", "--no-cache")
    assert code == 0, err
    assert json.loads(lib) == json.loads(fresh)


@pytest.mark.heavy
def test_another_size_of_the_family_is_checked_and_measured(cache_dir, capsys):
    """Llama-3-70B's config is served from the Llama-3-8B graph (another H and F: checked on the
    meta device and by one recording there, labelled with the sizes traced at); its parameters are
    the meta-device count of the 70B model and its FLOPs FlopCounterMode's on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from symcost.frontends.models import resolve

    path = str(ROOT / "tests/data/configs/llama-3-70b.json")
    sizes = {"B": 1, "S": 40, "L": 2}
    sets = ("--set",) + tuple(f"{k}={v}" for k, v in sizes.items())
    code, out, err = run_cli(capsys, "report", path, *sets)
    assert code == 0, err
    assert "from the graph library" in " ".join(out.split()) and "traced at" in out
    code, js, err = run_cli(capsys, "eval", path, *sets, "--json")
    assert code == 0, err
    got = json.loads(js)
    spec = resolve(path, {}, "eager")  # (model FLOPs do not depend on the attention kernel)
    values = {**spec.defaults, **sizes}
    with torch.device("meta"):
        model = spec.build(values)
    assert got["params"] == sum(p.numel() for p in model.parameters())
    model.train()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        ids = torch.randint(0, values["V"], (values["B"], values["S"]))
        with FlopCounterMode(display=False) as fc:
            model(input_ids=ids, labels=ids).loss.backward()
    assert got["flops"]["train"] == fc.get_total_flops()


def test_a_width_that_steps_is_not_served(monkeypatch):
    """A graph is not served at sizes where a parameter's shape is not its fitted formula's (a
    width that is a step function of a symbol): the library check builds the model there on the
    meta device. A gpt2 graph whose fitted wpe is made a polynomial in D that differs from the
    model's constant 1024 at D=64 (and equals it at D=16) is served at D=16 only."""
    from symcost.frontends.models import resolve
    from symcost.graph import library
    from symcost.graph.analysis import Analysis

    data = _analysis("gpt2")["analysis"]
    shapes = data["param_shapes"]
    key = next(k for k in shapes if k.endswith("wpe.weight") or k == "wpe.weight")
    shapes[key][0][0] = "64*D"  # 1024 at D = 16 only
    an = Analysis.from_dict(data)
    live = resolve("gpt2", {}, None)
    assert library._holds(an, {"B": 2, "S": 32, "D": 16, "H": 4, "L": 2}, live, "bf16-mixed")
    assert not library._holds(an, {"B": 2, "S": 32, "D": 64, "H": 4, "L": 2}, live, "bf16-mixed")


def test_other_versions_are_served_and_said(tmp_path, cache_dir, monkeypatch, capsys):
    """A graph traced with another torch is still served, and the report says which version
    differs; --no-cache traces afresh (no library line)."""
    idx = json.loads((GRAPHS / "index.json").read_text())
    idx["graphs"] = [e for e in idx["graphs"] if e["name"] == "mlp"]
    idx["graphs"][0]["traced_with"]["torch"] = "2.0.0"
    (tmp_path / "lib").mkdir()
    shutil.copy(GRAPHS / "mlp.json", tmp_path / "lib" / "mlp.json")
    data = json.loads((tmp_path / "lib" / "mlp.json").read_text())
    data["traced_with"]["torch"] = "2.0.0"
    (tmp_path / "lib" / "mlp.json").write_text(json.dumps(data))
    (tmp_path / "lib" / "index.json").write_text(json.dumps(idx))
    monkeypatch.setenv("SYMCOST_GRAPHS_DIR", str(tmp_path / "lib"))
    code, out, err = run_cli(capsys, "report", "mlp", "--set", "B=4", "S=64")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "from the graph library (traced with torch 2.0.0" in flat and "what differs from this installation: torch 2.0.0" in flat
    monkeypatch.setenv("SYMCOST_GRAPHS_DIR", "")  # (no library: the trace cache and the tracer)
    code, out, err = run_cli(capsys, "report", "mlp", "--set", "B=4", "S=64", "--no-cache")
    assert code == 0, err
    assert "graph library" not in out and "traced in" in out


def test_graphs_build_refuses_an_unknown_name_in_one_line(capsys):
    """``symcost graphs build --only NAME`` with a name not in the catalogue: one line, exit 2."""
    code, out, err = run_cli(capsys, "graphs", "build", "--only", "no-such-graph")
    assert code == 2 and "no graph 'no-such-graph'" in err and "Traceback" not in err


def _graphs() -> list[str]:
    """Every committed graph (graphs/index.json)."""
    return sorted(_index())


def _is_moe(an) -> bool:
    """An MoE graph (routed experts E, top-R): its FLOPs follow symcost's routing model."""
    return "E" in an.symbols and "R" in an.symbols


def _sizes_in_regime(an, meta, rng, n: int = 2) -> list[dict[str, int]]:
    """``n`` random small sizes for the symbols of ``an`` that its model accepts, in its regime (as
    the trace cache matches one: B = 1 where pinned, else B > 1; K = H, K = 1 or 1 < K < H as traced;
    the sizes' residues, e.g. D and F multiples of 8 for the MoE graphs; L above DeepSeek-V3's dense
    leading blocks), never a probe point of its fit. The first 1000 draws are tiny; after that each
    of D and E may be drawn wider (GPT-J's D >= rotary_dim = 64, DeepSeek-V3's E a multiple of
    n_group = 8 and at least 16)."""
    from symcost.graph.entries import _matches

    probes = {tuple(sorted(p.items())) for p in an.plan.points}
    lead = an.spec.lead_blocks
    out = []
    for i in range(2000):
        wide = lambda: i >= 1000 and rng.random() < 0.5  # noqa: E731
        h = rng.choice((2, 4, 6, 8))
        v = {"B": rng.randint(2, 4), "S": rng.randint(5, 24), "H": h,
             "D": rng.choice((64, 72, 80, 96) if wide() else (4, 6, 8, 12, 16)),
             "L": lead + rng.randint(1, 2) if lead else rng.randint(2, 3), "V": rng.randint(64, 130),
             "F": rng.randint(8, 70), "M": rng.choice((16, 24, 32, 48)),
             "K": rng.choice([k for k in (1, 2, 3, 4) if h % k == 0 and k < h]),
             "E": rng.choice((16, 24, 32) if wide() else (4, 6, 8)), "R": rng.choice((2, 3))}
        for a, b in meta["facts"]["equal"]:  # (K = H where traced so)
            v[a] = v[b] = min(v[a], v[b]) if {a, b} != {"H", "K"} else v["H"]
        v = {s: v[s] for s in an.symbols if s in v}
        full = {**v, **an.pinned, **{a: v[b] for a, b in an.spec.tied.items() if b in v}}
        if tuple(sorted(v.items())) in probes or an.spec.check(full) or not _matches(meta, full, config=False):
            continue
        out.append(v)
        if len(out) == n:
            return out
    raise AssertionError(f"no random sizes in the regime of {an.model}")


@pytest.mark.heavy
@pytest.mark.parametrize("name", _graphs())
def test_committed_graph_matches_pytorch(name):
    """Every committed graph's model FLOPs, saved bytes and parameters at 2 random small sizes of
    its regime (:func:`_sizes_in_regime`: sizes it was not traced at) equal PyTorch's own measurement:

    * parameters: ``sum(p.numel())`` of the model built at those sizes on the meta device;
    * FLOPs of a dense graph: ``FlopCounterMode`` of one real CPU training step (forward + the
      model's loss, ``loss.backward()``; tests/test_flops_exact.py ``measure``), eager attention for
      transformers models (model FLOPs do not depend on the attention kernel);
    * FLOPs of an MoE graph (Mixtral-8x7B and its B = 1 graph, Qwen3-30B-A3B, OLMoE-1B-7B,
      DeepSeek-V3 and its B = 1 graph): ``FlopCounterMode`` of one step on fake tensors with
      transformers' ``batched_mm`` experts implementation, eager attention (the oracle of
      tests/test_moe_real_configs.py, ``fake_flops``): it runs every routed slot through its
      expert's weights (``[N·R, 1, in] x [N·R, in, out]``), so its count is that of any dropless
      routing, symcost's balanced one included, whatever the random router picks. (The graphs'
      own ``grouped_mm`` experts run ``aten._grouped_mm``, which FlopCounterMode counts as 0.)
    * saved bytes: ``saved_tensors_hooks`` over one real CPU forward + loss of the model as the
      library traced it (tests/memory_oracle.py ``saved_bytes``: the graph's attention kernel and
      precision, bf16-mixed autocast; each storage once, parameters and buffers out), run under
      ``device_kernels("cuda")`` (the CLI's default ``--torch-device``, with which the library
      traced every graph): hf-gpt2's dropout then saves CUDA's bool mask (``native_dropout``),
      checked against PyTorch's CUDA dispatch in tests/test_device_kernels.py, where a CPU step
      keeps a bf16 mask; the other graphs keep the same bytes under either device's kernels (no
      dropout, or megatron-gpt's, which calls ``native_dropout`` itself). An MoE graph's step runs its
      ``grouped_mm`` experts with PyTorch's CPU ``_grouped_mm`` kernel on whatever the random
      router picks: the tensors kept for backward are ``[N·R, ·]`` slots and ``[E]`` counts at any
      routing, so their bytes are the balanced routing's."""
    import memory_oracle as mo
    from test_flops_exact import measure
    from test_moe_real_configs import fake_flops

    from symcost.frontends.models import resolve
    from symcost.graph.analysis import Analysis
    from symcost.tracing.device_kernels import device_kernels

    data = _analysis(name)
    an = Analysis.from_dict(data["analysis"])
    model = str(ROOT / data["model"]) if data["model"].endswith(".json") else data["model"]
    hf = model.startswith("hf:") or model.endswith(".json")
    spec = resolve(model, data["config"], data["attention"])
    eager = resolve(model, data["config"], "eager") if hf else spec
    for v in _sizes_in_regime(an, data["meta"], random.Random(f"library {name}")):
        env = an.bind(**v)
        values = {str(k): int(x) for k, x in env.items()}
        full = {**spec.defaults, **values}
        full.update({a: full[b] for a, b in {**spec.tied, **an.spec.tied}.items()})  # (K = H as traced)
        ev = lambda e: int(parse_formula(str(e)).xreplace(env))  # noqa: E731
        saved = ev(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
        with torch.device("meta"):
            params = sum(p.numel() for p in spec.build(full).parameters())
        assert ev(an.params) == params, (name, values)
        flops = fake_flops(eager, full) if _is_moe(an) else measure(eager, full)
        assert ev(an.flops("train")) == flops["flops.train"], (name, values)
        with device_kernels("cuda"):
            assert saved == mo.saved_bytes(spec, full, data["precision"]), (name, values)


def test_committed_graph_has_not_drifted():
    """A fresh trace of the built-in gpt2 (the library's recipe) gives the committed graph's
    formulas: every total, every parameter's shape, the saved tensors. A change to tracing that
    moves a formula fails here until the library is regenerated."""
    from symcost.commands._options import _trace_fresh
    from symcost.graph.library import CATALOGUE, PRECISION

    model, cfg, attention, sizes = CATALOGUE["gpt2"]
    fresh = _trace_fresh(model, cfg, attention, PRECISION, dict(sizes), quiet=True).to_dict()
    old = _analysis("gpt2")["analysis"]
    hint = f"graphs/gpt2.json differs from a fresh trace: regenerate the library with `{REGENERATE}`"

    def same(a, b):
        return a == b or sympy.expand(parse_formula(a) - parse_formula(b)) == 0

    for k, f in fresh["totals"].items():
        assert k in old["totals"] and same(f, old["totals"][k]), f"{hint} ({k}: {old['totals'].get(k)} -> {f})"
    assert fresh["param_shapes"] == old["param_shapes"], hint
    assert json.dumps(fresh["saved"], sort_keys=True) == json.dumps(old["saved"], sort_keys=True), hint


def test_hub_name_in_the_local_cache_is_served(tmp_path, cache_dir):
    """``hf:ORG/NAME`` whose config.json the local Hugging Face cache holds (Llama-3-8B's here) is
    served from the library graph of that config, under the Hub name, without tracing."""
    import os
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--acme--llama-8b"
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    (snap / "config.json").write_text((ROOT / "tests/data/configs/llama-3-8b.json").read_text())
    env = {k: v for k, v in os.environ.items() if k != "SYMCOST_GRAPHS_DIR"}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", SYMCOST_CACHE_DIR=str(cache_dir))
    res = subprocess.run([sys.executable, "-m", "symcost.cli", "report", "hf:acme/llama-8b", "--set", "B=1", "S=4096"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    first = " ".join(res.stdout.split())
    assert first.startswith("symcost report hf:acme/llama-8b") and "from the graph library (traced with torch" in first

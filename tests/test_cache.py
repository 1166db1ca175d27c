"""The trace cache (symcost.graph.cache): entries as data, matched by regime, rebuilt when corrupt.

The oracle for a cached analysis is a fresh trace of the same model: every total, every memory
component, the peak and the largest batch must agree at random sizes (drawn as
conftest.random_sizes draws them, away from the probes). Each test uses its own cache folder.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import sympy

from conftest import random_sizes
from symcost.graph import cache
from symcost.passes import memory
from symcost.graph.analysis import Analysis


def _same(fresh, cached, rng, n=4):
    """Fresh and cached analyses give the same numbers at ``n`` random sizes."""
    assert cached.symbols == fresh.symbols and cached.pinned == fresh.pinned
    assert cached.train_simplified_str() == fresh.train_simplified_str()
    assert cached.params_not_in_P() == fresh.params_not_in_P()
    for q in ("params", "params_matmul", "attention_flops", "flops.train", "bytes.backward"):
        assert sympy.expand(cached.quantity(q) - fresh.quantity(q)) == 0, q
    from symcost.graph import fusion

    ff, fc = fusion.estimate(fresh), fusion.estimate(cached)  # fused bytes need the recordings: kept as data
    assert fc.exact == ff.exact and sympy.expand(fc.total(cached) - ff.total(fresh)) == 0
    mf, mc = memory.memory_model(fresh, None, "adamw"), memory.memory_model(cached, None, "adamw")
    assert sympy.expand(mf.static - mc.static) == 0
    assert [str(t) for t in mf.peak_terms()] == [str(t) for t in mc.peak_terms()]
    for sz in random_sizes(fresh, rng, n=n):
        assert cached.subs(**sz) == fresh.subs(**sz), sz
        assert mc.components(**sz) == mf.components(**sz), sz
        other = {k: v for k, v in sz.items() if k != "B"}
        cap = rng.randint(2**24, 2**34)
        assert mc.solve(cap, "B", **other).value == mf.solve(cap, "B", **other).value, (sz, cap)


@pytest.mark.parametrize("model,precision", [("cs336-lm", "fp32"), ("gpt2", "fp32"), ("mlp", "bf16-mixed"),
                                             pytest.param("hf:llama", "fp32", marks=pytest.mark.hf)])
def test_cached_equals_fresh(traced, cache_dir, model, precision):
    """Written, read back from disk (JSON only), the analysis gives a fresh trace's numbers."""
    fresh = traced(model, precision)
    k = cache.key(model, {}, None, precision)
    path = cache.store(k, {}, fresh)
    assert path is not None and path.exists()
    json.loads(path.read_text())  # plain JSON
    cached = cache.load(k, {})
    assert isinstance(cached, Analysis) and cached is not fresh
    # the memory pass runs on the analysis' data alone: no probe recordings, fitter or fold function
    assert cached.recordings == [] and cached.fitter is None and cached.role is None
    _same(fresh, cached, random.Random(sum(map(ord, model))))
    if model == "hf:llama":  # traced for the config's K = H (multi-head): not the regime of K = 2
        assert fresh.spec.tied.get("K") == "H"
        assert cache.load(k, {"K": 2}) is None  # grouped-query attention: another regime
        assert cache.load(k, {"B": 3, "S": 77, "L": 5}) is not None  # batch, sequence, depth: served
        assert cache.load(k, {"H": 2 * fresh.spec.defaults["H"]}) is None  # a config size: traced again


def test_corrupt_entry_is_rebuilt(cache_dir):
    """A corrupt entry (garbage, truncated JSON, a field missing) is deleted and traced again."""
    calls = []

    def tracer():
        import symcost

        calls.append(1)
        return symcost.trace("mlp", precision="fp32", use_cache=False)

    args = ("mlp", {}, "eager", "fp32", {"B": 3})
    first = cache.cached_trace(*args, tracer)
    assert len(calls) == 1
    again = cache.cached_trace(*args, tracer)
    assert len(calls) == 1 and again.subs(B=3) == first.subs(B=3)  # read from the cache
    (entry,) = [p for p in cache_dir.rglob("*.json") if not p.name.endswith(".meta.json")]
    good = entry.read_text()
    for bad in ("not json at all {", good[: len(good) // 2], json.dumps({**json.loads(good), "ops": None}),
                json.dumps({k: v for k, v in json.loads(good).items() if k != "totals"})):
        entry.write_text(bad)
        n = len(calls)
        rebuilt = cache.cached_trace(*args, tracer)
        assert len(calls) == n + 1, "a corrupt entry must be traced again"
        assert rebuilt.subs(B=3) == first.subs(B=3)
        assert json.loads(entry.read_text())["format"] == Analysis.FORMAT  # written anew
        rebuilt.ops, rebuilt.graph  # noqa: B018 - a fresh trace, nothing lazy left broken


def test_regime_and_key(cache_dir):
    """B = 1 is its own regime (pinned), other sizes share one; precision is part of the key; a
    stale entry (another source digest) is never read."""
    import symcost

    k = cache.key("mlp", {}, "eager", "fp32")
    one = symcost.trace("mlp", sizes={"B": 1}, precision="fp32", use_cache=False)
    assert one.pinned == {"B": 1}
    cache.store(k, {"B": 1}, one)
    assert cache.load(k, {"B": 1}) is not None
    assert cache.load(k, {"B": 4}) is None  # B = 4 is not the B = 1 regime
    many = symcost.trace("mlp", sizes={"B": 4}, precision="fp32", use_cache=False)
    cache.store(k, {"B": 4}, many)
    assert cache.load(k, {"B": 7}).pinned == {} and cache.load(k, {"B": 1}).pinned == {"B": 1}
    assert cache.load(cache.key("mlp", {}, "eager", "bf16-true"), {"B": 4}) is None
    assert cache.key("mlp", {}, "eager", "fp32") != cache.key("gpt2", {}, "eager", "fp32")
    stale = dict(k, symcost_sources="0" * 64)
    assert cache.load(stale, {"B": 4}) is None
    cache.store(stale, {"B": 4}, many)  # as an older symcost would have written it
    assert cache.load(stale, {"B": 4}) is not None
    cache.store(k, {"B": 4}, many)  # caching the same model again deletes the stale entry
    assert cache.load(stale, {"B": 4}) is None and cache.load(k, {"B": 4}) is not None
    assert cache.key("hf:meta-llama/Llama-3-8B", {}, "eager", "fp32") is None  # not keyed: not cached


def test_python_trace_reads_and_writes_the_cache(cache_dir, capsys, monkeypatch):
    """``symcost.trace(name)`` writes the trace cache and reads it back: the second call (another
    batch size, same regime) traces nothing (the speed is benchmarks/'s) and gives a fresh trace's numbers at
    random sizes; the CLI reads the entry the API wrote (no trace); ``use_cache=False`` and a
    ModelSpec neither read nor write; sizes a model refuses are refused from a cached entry too;
    a cached analysis gives the block costs checkpoint plans need and says clearly that
    in_regime (a recording) needs the live trace."""

    import symcost
    from conftest import run_cli
    from symcost.errors import SymcostError
    from symcost.graph import build
    from symcost.passes import checkpoint

    fresh = symcost.trace("gpt2", precision="fp32", sizes={"B": 3})
    assert not fresh.__dict__.get("cached_from") and fresh.recordings
    entries = sorted(cache_dir.rglob("*.json"))
    assert entries, "the first call should have written a cache entry"
    import symcost.graph.build as build_module

    fresh_traces = []
    real_trace = build_module.trace

    def counting_trace(*args, **kwargs):  # (the cached path's fresh() and its retrace: use_cache=False)
        if kwargs.get("use_cache") is False:
            fresh_traces.append(args[:1])
        return real_trace(*args, **kwargs)

    monkeypatch.setattr(build_module, "trace", counting_trace)
    warm = symcost.trace("gpt2", precision="fp32", sizes={"B": 5})
    monkeypatch.setattr(build_module, "trace", real_trace)
    assert warm.__dict__.get("cached_from") and warm is not fresh
    assert fresh_traces == [], "the second call traced the model again instead of reading the cache"
    _same(fresh, warm, random.Random(6))
    with pytest.raises(SymcostError, match="1024 learned positions"):
        symcost.trace("gpt2", precision="fp32", sizes={"S": 2048})  # GPT-2's 1024 positions, as fresh
    env = {k: v for k, v in fresh.bind(B=2, S=48).items()}  # block costs read from the cached data
    assert checkpoint.block_costs(warm).sequence(4, env) == checkpoint.block_costs(fresh).sequence(4, env)
    with pytest.raises(SymcostError, match="use_cache=False"):
        warm.in_regime(B=2)

    def no_trace(*a, **k):
        raise AssertionError("traced although the cache holds this regime")

    monkeypatch.setattr(build, "_trace_regime", no_trace)
    code, out, err = run_cli(capsys, "eval", "gpt2", "--set", "B=7", "S=64", "--precision", "fp32", "--json")
    assert code == 0, err
    assert json.loads(out)["flops"]["train"] == fresh.subs(B=7, S=64)["flops.train"]
    monkeypatch.undo()
    bypass = symcost.trace("mlp", precision="fp32", use_cache=False)
    spec = symcost.resolve("mlp")
    symcost.trace(spec, precision="fp32")
    assert bypass.recordings and sorted(cache_dir.rglob("*.json")) == entries  # nothing written


#: runs ``symcost ARGS`` in a fresh interpreter and prints whether torch was imported, on stderr
_PROBE = ("import sys, runpy; sys.argv = ['symcost'] + sys.argv[1:]\n"
          "try:\n    runpy.run_module('symcost.cli', run_name='__main__')\n"
          "except SystemExit as e:\n    assert not e.code, e.code\n"
          "print('torch' in sys.modules, file=sys.stderr)")


def _cli_in_process(env, *args) -> tuple[str, str]:
    """``symcost ARGS`` in a process of its own: (stdout, "True"/"False": torch imported)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr.strip().splitlines()[-1]


def test_warm_cli_without_torch(cache_dir):
    """The second `symcost eval` reads the entry, prints the same numbers and never imports torch;
    --no-cache traces afresh and writes nothing."""
    env = dict(os.environ, SYMCOST_CACHE_DIR=str(cache_dir))
    cmd = ["eval", "mlp", "--set", "B=3", "D=24", "--precision", "fp32", "--json"]

    def run(*args):
        return _cli_in_process(env, *args)

    cold, cold_torch = run(*cmd)
    warm, warm_torch = run(*cmd)
    assert cold_torch == "True" and warm_torch == "False"
    assert json.loads(warm) == json.loads(cold)
    entries = sorted(cache_dir.rglob("*.json"))
    nocache, torch_used = run(*cmd[:2], "--no-cache", *cmd[2:])
    assert torch_used == "True" and json.loads(nocache) == json.loads(cold)
    assert sorted(cache_dir.rglob("*.json")) == entries


def test_checkpoint_commands_read_the_cache(cache_dir):
    """``checkpoint`` and ``max-batch --checkpoint`` need the plain step and the step with every
    block checkpointed (two analyses, the second cached under the option ``checkpoint``): a run
    after the cache holds both reads them (no entry is added) and answers as a run with an empty
    cache did; caching one never deletes the other."""
    from click.testing import CliRunner

    from symcost.cli import main

    def run(*args):
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 0, (args, r.output, getattr(r, "stderr", ""))
        return json.loads(r.output)

    ck = ("checkpoint", "mlp", "--set", "L=4", "B=2", "S=8", "D=8", "--precision", "fp32", "--json")
    mb = ("max-batch", "mlp", "--set", "L=4", "S=8", "D=8", "--precision", "fp32", "--memory", "1MiB",
          "--checkpoint", "sqrt", "--json")
    before = run(*ck), run(*mb)
    entries = sorted(cache_dir.rglob("*.json"))
    metas = [json.loads(p.read_text())["key"]["options"] for p in cache_dir.rglob("*.meta.json")]
    assert {} in metas and {"checkpoint": "every-layer"} in metas, metas
    run("eval", "mlp", "--set", "L=4", "B=2", "S=8", "D=8", "--precision", "fp32", "--json")  # reads the cache
    after = run(*ck), run(*mb)
    assert sorted(cache_dir.rglob("*.json")) == entries
    for d in before + after:  # timings differ run to run
        for part in (d, d.get("checkpoint", {})):
            for k in [k for k in part if k.endswith("seconds")]:
                part.pop(k)
    assert after[0]["checkpoint"] == before[0]["checkpoint"]
    assert after[1]["max_batch"] == before[1]["max_batch"]


def test_warm_roofline_mfu_time_without_torch(traced, cache_dir, tmp_path):
    """``roofline``, ``mfu`` and ``time`` on a cached analysis never import torch (the fused-bytes
    estimate is kept with the entry, dtypes are read as names) and answer as a fresh trace does:
    the cold and warm ``mfu`` agree to the byte, and the warm roofline's step time (on a CPU-like
    device, so GEMM packing is timed too) equals the roofline pass on a fresh trace."""
    from symcost.hardware import devices as dv
    from symcost.passes import roofline as rl

    env = dict(os.environ, SYMCOST_CACHE_DIR=str(cache_dir))

    def run(*args):
        out, torch_imported = _cli_in_process(env, *args)
        return json.loads(out), torch_imported

    dev_file = tmp_path / "cpu.toml"
    dev_file.write_text('[cpu]\nfp32 = 1e11\nbandwidth = 2e10\nwrite_bandwidth = 1e10\nserial_passes = true\n')
    common = ("mlp", "--set", "B=3", "S=12", "--precision", "fp32", "--json")
    mfu = ("mfu", *common, "--device", "h100", "--tokens-per-second", "2e4")
    cold, torch_cold = run(*mfu)
    warm, torch_warm = run(*mfu)
    assert torch_cold == "True" and torch_warm == "False"
    assert warm == cold
    timed, torch_time = run("time", *common, "--device", "h100", "--tokens", "1e9", "--mfu", "0.4")
    assert torch_time == "False" and timed["time.seconds"] > 0
    roof, torch_roof = run("roofline", *common, "--devices-file", str(dev_file), "--device", "cpu")
    assert torch_roof == "False"
    fresh = rl.roofline(traced("mlp", "fp32"), dv.get_device("cpu", str(dev_file)), {"B": 3, "S": 12})
    assert roof["roofline"]["step_seconds"] == pytest.approx(fresh["step_seconds"], rel=1e-12)
    assert any(n["op"].startswith(("aten.mm", "aten.addmm")) for n in fresh["nodes"])  # GEMMs were packed

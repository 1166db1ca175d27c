"""``symcost serve --kv-dtype`` (a KV cache modelled in another dtype) and ``serve --plot`` (the token
rate against the batch), issue 17.

Oracles, independent of symcost's scaling:

* KV bytes per token by hand from Qwen3-4B's published config: 36 layers × 8 key/value heads ×
  head_dim 128 × 2 (keys and values) × 1 byte (fp8) = 73,728, half the published 147,456 in bf16;
* the serving memory of an fp8 cache = that of the traced bf16 cache less half of the bf16 cache's
  hand-counted bytes (147,456 / 2 per token, every sequence at the full context): the boundary
  M(B) <= cap < M(B + 1) is checked on that, in exact integers;
* the bytes a StaticCache decode step's attention reads from the cache: the storages the real
  cache holds (measured on CPU tensors, as tests/test_inference.py measures them), all of them
  read once by the attention, plus the new token's slice written into them (1 / (T + 1) of them);
* the plot: the file's PNG signature, and the points drawn against ``serve --json``'s numbers.
"""
from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest
import torch
from conftest import run_cli
from test_inference import QWEN3_4B, full_values, random_sizes, run_step, traced_step

from symcost.errors import SymcostError
from symcost.hardware import devices as dv
from symcost.passes import inference

SMALL = ("hf:llama", "--config", "num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4",
         "num_key_value_heads=2", "intermediate_size=128", "vocab_size=256", "--context", "64",
         "--device", "h100", "--no-prefill", "--memory", "64MiB")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.heavy
def test_qwen3_4b_fp8_kv_bytes_and_batch():
    """Qwen3-4B (bf16 trace): fp8 is 73,728 bytes per token, half the published 147,456; the batch
    solved on the fp8 memory model fits by the boundary check on the bf16 model less half the
    hand-counted cache (exact integers), at random caps and contexts, and exceeds the bf16 batch.
    A StaticCache (serve's default, as serving engines hold an fp8 cache): a DynamicCache step also
    holds one layer's old and new tensor during ``torch.cat`` (issue 31 item 3), which moves the
    peak between ops when the cache's dtype changes, so "the bf16 peak less half the cache" is no
    oracle there."""
    an = traced_step(QWEN3_4B, "decode", "static", precision="bf16-true", attention="sdpa")
    kv = inference.kv_dtype(an, "fp8")
    assert (kv.traced, kv.dtype, kv.scale, kv.modelled) == ("bfloat16", "float8_e4m3fn", Fraction(1, 2), True)
    assert {"dtype": "fp8", "modelled": True, "from": "bfloat16"}.items() <= kv.to_json().items()
    assert not inference.kv_dtype(an).modelled and inference.kv_dtype(an, "bf16").scale == 1
    got = inference.kv_cache(an, {"B": 3, "T": 8191}, kv)
    assert got["per_token"] == 73_728 == 36 * 8 * 128 * 2 * 1 == 147_456 // 2
    assert got["per_sequence"] == 73_728 * 8192 and got["total"] == 3 * 73_728 * 8192
    assert inference.kv_cache(an, {"B": 3, "T": 8191}, inference.kv_dtype(an, "fp32"))["per_token"] == 2 * 147_456
    rng = random.Random("serve-kv-fp8")
    for _ in range(3):
        context = rng.choice((rng.randint(2, 512), rng.randint(512, 40_000)))
        mm16 = inference.serving_memory(an)
        cap = mm16.peak(B=2, T=context - 1) + rng.randint(0, 80 * 2**30)  # 2 or more bf16 sequences fit
        _, s16 = inference.max_batch(an, cap, context)
        _, s8 = inference.max_batch(an, cap, context, kv=kv)

        def M8(B, mm16=mm16, context=context):  # the bf16 model less half of the hand-counted bf16 cache
            return mm16.peak(B=B, T=context - 1) - 73_728 * B * context

        B = s8.value
        assert s8.checked and B >= 1, (cap, context)
        assert M8(B) == s8.memory_at <= cap < M8(B + 1) == s8.memory_next, (cap, context, B)
        assert s16.checked and B > s16.value >= 2, (cap, context, B, s16.value)


def test_static_decode_bytes_with_a_modelled_cache():
    """A StaticCache decode step (sdpa, bf16) with the cache modelled in fp8 / fp32: the step's
    bytes change by (scale - 1) × (the cache's storages, which the attention reads once, + the new
    token's slice written into them), the cache measured on the real model at random sizes; the
    aggregate's KV bytes are the measured cache × scale; the time per token bound drops with fp8."""
    an = traced_step("hf:llama", "decode", "static", sizes=(("K", 4),), precision="bf16-true", attention="sdpa")
    assert inference.cache_dtype(an) == "bfloat16"
    dev = dv.get_device("h100")
    fp8, fp32 = inference.kv_dtype(an, "fp8"), inference.kv_dtype(an, "fp32")
    for v in random_sizes(an, random.Random("serve-kv-static"), 2):
        full = full_values(an, v)
        _, kv_measured, _ = run_step(an.spec, full, "decode", "static", dtype=torch.bfloat16, counter=False)
        moved = kv_measured + Fraction(kv_measured, full["T"] + 1)  # read once + the new token written
        base = inference.decode(an, dev, v, with_crossing=False)
        assert base["aggregate"]["kv_bytes"] == kv_measured
        for kv in (fp8, fp32):
            d = inference.decode(an, dev, v, with_crossing=False, kv=kv)
            assert d["aggregate"]["kv_bytes"] == kv_measured * kv.scale, (v, kv.name)
            assert d["roofline"]["bytes"] - base["roofline"]["bytes"] == (kv.scale - 1) * moved, (v, kv.name)
        assert inference.decode(an, dev, v, with_crossing=False, kv=fp8)["seconds_per_token"] < base["seconds_per_token"]
    with pytest.raises(SymcostError, match="unknown --kv-dtype 'fp4'; accepted: fp8, int8"):
        inference.kv_dtype(an, "fp4")


def _json(capsys, *args):
    code, out, err = run_cli(capsys, "serve", *SMALL, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_serve_cli_kv_dtype(capsys):
    """``serve --kv-dtype fp8`` on a small bf16 trace: labelled modelled in JSON and text, half the
    KV bytes per token (by hand: L 2 × K 2 × D 16 × 2 × 1 byte), a larger batch that passes the
    boundary check, the same answer from the trace cache; int8 as fp8; a bad name is one line."""
    from symcost.graph import cache

    bf16 = _json(capsys)
    # the decode step serve traced is in the trace cache and reads back with the cache's reads
    an = cache.load(cache.key("hf:llama", dict(a.split("=") for a in SMALL[2:8]), None, "bf16-true",
                              {"step": "decode", "kv_cache": "static"}), {"T": 63, "S": 1})
    assert an is not None and "cached_from" in an.__dict__ and inference.cache_dtype(an) == "bfloat16"
    fp8 = _json(capsys, "--kv-dtype", "fp8")  # (from the trace cache)
    assert bf16["kv_dtype"] == {"dtype": "bfloat16", "element": "bfloat16", "bytes": 2, "from": "bfloat16",
                                "modelled": False, "scale": 1.0}
    assert {"dtype": "fp8", "modelled": True, "from": "bfloat16", "bytes": 1}.items() <= fp8["kv_dtype"].items()
    assert bf16["kv"]["per_token"] == 2 * 2 * 16 * 2 * 2 and fp8["kv"]["per_token"] == 2 * 2 * 16 * 2 * 1
    m = fp8["memory"]
    assert m["check"] and m["at_max"] <= m["cap"] < m["at_next"] and fp8["max_batch"] > bf16["max_batch"]
    assert m["components"]["kv_cache"] == fp8["max_batch"] * 64 * fp8["kv"]["per_token"]
    assert _json(capsys, "--kv-dtype", "int8")["max_batch"] == fp8["max_batch"]
    code, out, _ = run_cli(capsys, "serve", *SMALL, "--kv-dtype", "fp8")
    assert code == 0 and "modelled" in out and "bfloat16" in out
    code, _, err = run_cli(capsys, "serve", *SMALL, "--kv-dtype", "fp4")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "accepted: fp8, int8, bf16, fp16, fp32" in err


def test_serve_plot(capsys, tmp_path, monkeypatch):
    """``serve --plot FILE.png`` writes a PNG whose last point is serve's own tokens/s and time per
    token at the largest batch; the crossing is a line where it lies in range; a missing folder, a
    path that cannot be written, a missing matplotlib: one line, exit 2."""
    from symcost.render.plots import token_rate_plot

    path = tmp_path / "rate.png"
    code, _, err = run_cli(capsys, "serve", *SMALL, "--kv-dtype", "fp8", "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:8] == PNG
    r = _json(capsys, "--kv-dtype", "fp8")
    # the curve drawn, recomputed on the decode step serve traced (read back from the trace cache):
    # it runs from B = 1 to serve's largest batch and ends on serve's own bounds there
    import symcost

    an = symcost.trace("hf:llama", dict(a.split("=") for a in SMALL[2:8]), None, sizes={"T": 63, "S": 1},
                       precision="bf16-true", step="decode", kv_cache="static")
    curve = inference.token_rate(an, dv.get_device("h100"), 64, r["max_batch"], kv=inference.kv_dtype(an, "fp8"))
    drawn = token_rate_plot(curve, str(tmp_path / "again.png"))
    b, tps, spt = drawn["points"][-1]
    bs = [p[0] for p in drawn["points"]]
    assert bs[0] == 1 and b == r["max_batch"] and 30 <= len(bs) <= 40 and bs == sorted(set(bs))
    assert tps == pytest.approx(r["tokens_per_second"], rel=1e-12) and spt == pytest.approx(r["seconds_per_token"], rel=1e-12)
    rows = [{"batch": b, "tokens_per_second": b / (1e-3 + b * 1e-5), "seconds_per_token": 1e-3 + b * 1e-5,
             "memory_seconds": 1e-3, "compute_seconds": b * 1e-5} for b in (1, 10, 100, 1000)]
    inside = token_rate_plot({"rows": rows, "crossing": {"value": 100.0, "compute_bound": "B >= 100"}},
                             str(tmp_path / "c.png"))
    assert inside["crossing_line"] == 100.0
    never = token_rate_plot({"rows": rows, "crossing": {"value": None, "compute_bound": "never"}}, str(tmp_path / "n.png"))
    assert never["crossing_line"] is None and "never" in never["note"]
    code, _, err = run_cli(capsys, "serve", *SMALL, "--plot", str(tmp_path / "no" / "x.png"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no folder" in err, err
    (tmp_path / "dir.png").mkdir()
    code, _, err = run_cli(capsys, "serve", *SMALL, "--plot", str(tmp_path / "dir.png"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot write" in err, err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    code, _, err = run_cli(capsys, "serve", *SMALL, "--plot", str(tmp_path / "m.png"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "matplotlib" in err, err


def test_dynamic_decode_bytes_with_a_modelled_cache():
    """A DynamicCache decode step (eager attention, grouped-query, fp32) with the cache modelled in
    bf16: the concatenation reads the old cache (T tokens) and writes the new one (T + 1), and each
    of the eager attention's ``repeat_kv`` copies reads the new one expanded to H heads, so the step's
    unfused bytes change by (1/2 - 1) × (old + new + H/K × new), the new cache measured on the real
    model at random sizes and the old one its T / (T + 1) (the same layout, one token fewer); the
    fused bytes by no more than that and not by less than the old cache's read (the concatenation
    reads it from outside any fused region)."""
    from symcost.passes.roofline import roofline

    an = traced_step("hf:llama", "decode", sizes=(("K", 4),))
    assert an.kv_cache == "dynamic" and inference.cache_dtype(an) == "float32"
    dev = dv.get_device("h100")
    bf16 = inference.kv_dtype(an, "bf16")
    assert bf16.scale == Fraction(1, 2) and bf16.modelled
    extra = inference.kv_traffic(an, bf16)
    for v in random_sizes(an, random.Random("serve-kv-dynamic"), 2):
        full = full_values(an, v)
        _, new, _ = run_step(an.spec, full, "decode", "dynamic", counter=False)
        old = Fraction(new * full["T"], full["T"] + 1)
        moved = old + new + Fraction(full["H"], full["K"]) * new

        def total(r, key):
            return sum(n["repeat"] * n[key] for n in r["nodes"])

        base = roofline(an, dev, v, with_formulas=False)
        got = roofline(an, dev, v, with_formulas=False, extra_bytes=extra)
        assert total(got, "bytes") - total(base, "bytes") == -moved / 2, v
        fused = total(got, "fused_bytes") - total(base, "fused_bytes")
        assert -moved / 2 <= fused <= -old / 2, v
        assert inference.decode(an, dev, v, with_crossing=False, kv=bf16)["aggregate"]["kv_bytes"] == new / 2

"""What a user reads about memory (issue 14, item 7): the parts of the peak add up to it, the
report says when the sizes asked for do not fit, and max-batch says what would fit when nothing
does.

Oracles: real CPU training steps of the same model (``torch.profiler``'s peak and the bytes live
before the step, tests/memory_oracle.py), ``saved_tensors_hooks``, PyTorch's own parameter count,
and fresh traces under the other precision policy; sizes drawn at random (seeded) across the
regimes where the peak is the optimizer step and where it is the end of the forward.
"""
from __future__ import annotations

import json
import random
import re

import pytest
from conftest import random_sizes, run_cli
from memory_oracle import saved_bytes, step_peak

import symcost
from symcost.passes import memory

STATIC = ("params", "optimizer", "master_weights", "buffers", "inputs")


def _n_params(spec, sizes) -> int:
    vals = {**spec.defaults, **sizes}
    vals.update({a: vals[b] for a, b in spec.tied.items()})
    return sum(p.numel() for p in spec.build(vals).parameters())


def model_saved_bytes(spec, sizes) -> int:
    """Bytes autograd saves for backward during the model's forward (real tensors, fp32,
    saved_tensors_hooks), the loss's left out: the backward starts with the loss, so all of them
    are still live when it does."""
    return saved_bytes(spec, sizes, "fp32", with_loss=False)


@pytest.mark.heavy
@pytest.mark.parametrize("model", ["cs336-lm", "mlp"])
def test_peak_parts_add_up_and_match_a_real_step(traced, model):
    """``peak_parts``: the static parts and the live set at the peak add up to the peak, which a
    real step measures, and the static parts are what is live before it. Where the peak is the
    optimizer step (AdamW foreach, fp32) the live set is every gradient (4·P) and the sqrt
    temporaries (4·P), P counted by PyTorch; at the end of the forward no gradient exists yet and
    the forward's live tensors hold at least what the model's forward saved (saved_tensors_hooks); inside
    the backward some but not all gradients exist (0 < gradients < 4·P)."""
    an = traced(model, "fp32")
    mm = memory.memory_model(an, None, "adamw", "foreach")
    rng = random.Random(sum(map(ord, model)))
    seen = set()
    draws = random_sizes(an, rng, n=3)
    draws += [{**d, "B": B, **({"S": S} if "S" in d else {})} for d, (B, S) in
              zip(draws[1:], ((rng.randint(40, 56), rng.randint(56, 72)), (rng.randint(10, 14), rng.randint(150, 170))))]
    for sz in draws:
        parts = mm.peak_parts(**sz)
        assert sum(parts[k] for k in STATIC + mm.LIVE_PARTS) == parts["peak"] == mm.peak(**sz), sz
        meas = step_peak(an.spec, sz, "fp32", "adamw", foreach=True)
        assert abs(parts["peak"] - meas["peak"]) <= 1e-3 * meas["peak"], (sz, parts, meas)
        assert sum(parts[k] for k in STATIC) == meas["baseline"], sz  # what is live before the step
        P = _n_params(an.spec, sz)
        where = parts["where"]
        if where.startswith("optimizer step"):
            assert parts["gradients"] == 4 * P and parts["optimizer_step"] == 4 * P, (sz, parts)
            assert parts["forward"] == parts["backward"] == 0
        elif where.startswith("end of forward"):
            assert parts["gradients"] == 0 and parts["optimizer_step"] == 0, (sz, parts)
            assert parts["forward"] >= model_saved_bytes(an.spec, sz), (sz, parts)
        else:
            assert where.startswith("backward") and 0 < parts["gradients"] < 4 * P and parts["forward"] > 0, parts
        seen.add(where.split(" ")[0].rstrip(","))
    if model == "cs336-lm":
        assert seen == {"optimizer", "end", "backward"}, seen  # every regime was drawn


def test_max_batch_table_adds_up_to_the_peak(capsys):
    """The max-batch table's rows (text) sum to its peak row, which is M(B_max) of the check line;
    the JSON's ``peak_parts`` sum to ``memory_at_max``."""
    args = ("max-batch", "mlp", "--precision", "fp32", "--set", "D=64", "L=3", "--memory", "2MiB")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    rows = dict(re.findall(r"│ ([a-z][^│]*?)\s+│\s+([\d,]+) │", out))
    peak = int(rows.pop("peak (the sum)").replace(",", ""))
    assert len(rows) == 9 and sum(int(v.replace(",", "")) for v in rows.values()) == peak
    assert re.search(rf"M\(\d+\) = [\d.]+ \w+ \({peak:,} B\)", out), out
    code, out, err = run_cli(capsys, *args, "--json")
    js = json.loads(out)
    parts = js["peak_parts"]
    assert sum(parts[k] for k in STATIC + memory.MemoryModel.LIVE_PARTS) == parts["peak"] == js["memory_at_max"]


def test_report_says_when_the_sizes_do_not_fit(capsys, traced):
    """A cap below the measured peak of a real step at the requested sizes: the report says it
    does not fit (a line, and ``fits: false`` with the reason in JSON) while the largest B that
    fits stays in ``max_batch``; a cap above it: ``fits: true``. The JSON keys already documented
    are all still there."""
    an = traced("mlp", "fp32")
    rng = random.Random(14)
    for sz in random_sizes(an, rng, n=2):
        sz["B"] = rng.randint(8, 32)
        meas = step_peak(an.spec, sz, "fp32", "adamw", foreach=True)["peak"]
        sets = [f"{k}={v}" for k, v in sz.items()]
        for cap, fits in ((meas - rng.randint(meas // 100, meas // 4), False),
                          (meas + rng.randint(meas // 100, meas), True)):
            code, out, err = run_cli(capsys, "report", "mlp", "--precision", "fp32", "--set", *sets,
                                     "--memory", f"{cap}B", "--json")
            assert code == 0, err
            m = json.loads(out)["memory"]
            assert m["fits"] is fits and (m["fits_reason"] is None) is fits, (sz, cap, m["fits_reason"])
            for k in ("params", "grads", "optimizer", "master_weights", "buffers", "inputs", "activations",
                      "peak", "static", "bytes_per_param", "max_batch", "max_batch_reason", "memory_at_max",
                      "memory_cap", "optimizer_name", "optimizer_impl", "device"):
                assert k in m, k
            if not fits:
                assert f"exceeds the cap {cap:,} bytes" in m["fits_reason"]
                assert m["max_batch"] < sz["B"] and (m["max_batch"] == 0) == (m["max_batch_reason"] is not None)
            code, text, err = run_cli(capsys, "report", "mlp", "--precision", "fp32", "--set", *sets,
                                      "--memory", f"{cap}B")
            flat = re.sub(r"\s+", " ", text)
            assert ("does not fit under" in flat) is not fits, flat[-600:]


def test_nothing_fits_says_what_would(capsys, traced):
    """Not even B = 1 fits: exit 3, and what would, with numbers, checked against independent
    answers: another policy of the same traced dtypes equals a fresh trace under it; a 16-bit
    policy from an fp32 trace is at most the fresh trace's answer; an optimizer with no state
    fits the B a real step measures; no checkpointing plan goes below static + gradients + the
    optimizer's temporaries (the bytes live before a real step + 4·P + 4·P); the least cap is the
    peak at B = 1 of a real step, and max-batch under it fits B = 1."""
    sizes = {"D": 64, "L": 2}
    sets = ("--set", "D=64", "L=2")
    master = memory.memory_model(traced("mlp", "bf16-true-fp32-master"), None, "adamw", "foreach")
    cap = master.peak(B=1, **sizes) - 1
    code, out, err = run_cli(capsys, "max-batch", "mlp", "--precision", "bf16-true-fp32-master", *sets,
                             "--memory", f"{cap}B", "--json")
    assert code == 3, err
    alts = {a["option"]: a for a in json.loads(out)["alternatives"]}
    true16 = memory.memory_model(traced("mlp", "bf16-true"), None, "adamw", "foreach")
    a = alts["--precision bf16-true"]
    assert a["exact"] and a["fits"] and a["max"] == true16.solve(cap, "B", **sizes).value >= 1

    fp32 = memory.memory_model(traced("mlp", "fp32"), None, "adamw", "foreach")
    cap = fp32.peak(B=1, **sizes) - 1
    code, out, err = run_cli(capsys, "max-batch", "mlp", "--precision", "fp32", *sets, "--memory", f"{cap}B", "--json")
    assert code == 3, err
    alts = {a["option"]: a for a in json.loads(out)["alternatives"]}
    a = alts["--precision bf16-true"]
    assert not a["exact"] and 1 <= a["max"] <= true16.solve(cap, "B", **sizes).value
    spec = symcost.resolve("mlp")
    sgd = alts["--optimizer sgd-nomomentum"]
    assert sgd["fits"] and sgd["max"] >= 1
    at = lambda b: step_peak(spec, {**sizes, "B": b}, "fp32", "sgd-nomomentum", foreach=True)["peak"]  # noqa: E731
    assert at(sgd["max"]) <= cap < at(sgd["max"] + 1)
    one = step_peak(spec, {**sizes, "B": 1}, "fp32", "adamw", foreach=True)
    P = _n_params(spec, {**sizes, "B": 1})
    assert alts["--checkpoint optimal"]["floor"] == one["baseline"] + 4 * P + 4 * P
    assert alts["--checkpoint optimal"]["may_fit"] is True
    m1 = alts["--memory"]["min_cap"]
    assert abs(m1 - one["peak"]) <= 1e-3 * one["peak"]
    code, out, err = run_cli(capsys, "max-batch", "mlp", "--precision", "fp32", *sets, "--memory", f"{m1}B", "--json")
    assert code == 0 and json.loads(out)["max_batch"] >= 1, err
    code, text, err = run_cli(capsys, "max-batch", "mlp", "--precision", "fp32", *sets, "--memory", f"{cap}B")
    assert code == 3
    flat = re.sub(r"\s+", " ", text)
    assert "what would fit" in flat and f"--optimizer sgd-nomomentum: fits, largest B = {sgd['max']}" in flat
    assert f"--memory {m1}B or more" in flat  # M(1) < 1 MiB here: the cap to paste, in bytes

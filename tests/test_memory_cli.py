"""``symcost max-batch`` and the memory section of report / formulas / eval (issue 3)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import run_cli
from symcost.cli import main
from symcost.tracing.fit import SYMS, parse_formula


def run(*args):
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.output, r.stderr if hasattr(r, "stderr") else ""


@pytest.mark.parametrize("args,needle", [
    (["max-batch", "mlp", "--memory", "80XB"], "unknown unit"),
    (["max-batch", "mlp", "--memory", "-5GiB"], "must be positive"),
    (["max-batch", "mlp", "--memory", "-1"], "must be positive"),
    (["max-batch", "mlp", "--global-batch", "1000", "--devices", "7"], "not divisible by 7 devices"),
    (["max-batch", "mlp", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["max-batch", "mlp", "--solve", "V"], "cannot solve for 'V': not a symbol of mlp"),  # (a model's own size may be solved)
    (["max-batch", "mlp", "--solve", "B=1"], "--solve takes B, S or a size of the model"),
    (["max-batch", "mlp", "--set", "B=8"], "conflicts with solving for B"),
    (["report", "mlp", "--memory", "80XB"], "unknown unit"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_max_batch_json(traced):
    traced("mlp", "fp32")
    code, out, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "2GiB", "--set", "S=64", "--json")
    assert code == 0, out
    js = json.loads(out)
    for k in ("max_batch", "memory_at_max", "memory_cap"):
        assert isinstance(js[k], int)
    assert js["memory_cap"] == 2 * 2**30
    assert js["memory_at_max"] <= js["memory_cap"] < js["memory_at_next"]
    assert js["check"] is True


def test_max_batch_text_and_b1(traced):
    code, out, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "1MiB")
    assert code == 3  # nothing fits: an answer (exit status 3), not bad input (2)
    assert "does not fit" in out and ("alone is " in out or "alone are " in out)
    code, out, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "80GiB")
    assert code == 0 and "largest B" in out and "check: M(" in out and "✓" in out


def test_max_batch_solve_S_json():
    code, out, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "1GiB", "--solve", "S",
                       "--set", "B=4", "--json")
    assert code == 0, out
    js = json.loads(out)
    assert js["solve"] == "S" and js["max_S"] >= 1 and js["memory_at_max"] <= js["memory_cap"]


def test_accumulation_json():
    code, out, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "256MiB", "--global-batch", "1024",
                       "--devices", "8", "--set", "S=512", "--json")
    assert code == 0, out
    js = json.loads(out)
    assert js["micro_batch"] * js["accumulation_steps"] * 8 == 1024
    assert js["memory_per_device"] <= js["memory_cap"]
    assert js["memory_saved"] == js["memory_without_accumulation"] - js["memory_per_device"]


MEM_KEYS = ("params", "grads", "optimizer", "master_weights", "activations", "peak")


def test_report_json_memory_formulas_and_values():
    code, out, _ = run("formulas", "mlp", "--precision", "fp32", "--json")
    assert code == 0, out
    f = json.loads(out)
    code, out, _ = run("eval", "mlp", "--precision", "fp32", "--set", "B=3", "S=17", "D=24", "L=5", "--json")
    assert code == 0, out
    v = json.loads(out)
    env = {SYMS[k]: x for k, x in {"B": 3, "S": 17, "D": 24, "L": 5}.items()}
    for k in MEM_KEYS:
        assert isinstance(f["memory"][k], str) and isinstance(v["memory"][k], int)
        assert int(parse_formula(f["memory"][k]).xreplace(env)) == v["memory"][k], k
    # the peak's terms: static + the largest valid one
    terms = [int(parse_formula(t["formula"]).xreplace(env)) for t in f["memory"]["peak_terms"] if t["min_L"] <= 5]
    assert int(parse_formula(f["memory"]["static"]).xreplace(env)) + max(terms) == v["memory"]["peak"]
    for k in ("params", "flops", "bytes"):  # the existing keys are still there
        assert k in f and k in v


def test_report_memory_section():
    code, out, _ = run("report", "mlp", "--precision", "bf16-true-fp32-state", "--set", "B=4", "S=64", "--memory", "24GiB")
    assert code == 0, out
    assert "Memory" in out and "= 12 bytes → 12·P" in out and "largest batch under 24.000 GiB" in out
    code, out, _ = run("report", "mlp", "--precision", "bf16-true-fp32-state", "--json")
    js = json.loads(out)
    assert js["memory"]["bytes_per_param"] == 12 and js["memory"]["memory_cap"] == 80 * 2**30
    assert isinstance(js["memory"]["max_batch"], int)


def test_max_batch_checkpoint_line_under_the_title(traced):
    """The plan max-batch applies (--checkpoint) is said under the command's title, not above it."""
    code, out, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "8GiB", "--checkpoint", "every-layer")
    lines = [x for x in out.splitlines() if x.strip()]
    assert code == 0 and lines[0].startswith("symcost max-batch mlp"), out
    assert any(x.strip().startswith("checkpoint every-layer at B = ") for x in lines[1:3]), out


def test_max_batch_checkpoint_after_a_cached_plain_trace(cache_dir):
    """max-batch --checkpoint on a model whose plain trace is already cached (by another command)
    is the same answer as on a fresh trace: the solver's B = 1 regime needs a checkpointed trace no
    cache entry holds, so the model is built again (a cached analysis cannot build it). It failed
    with 'this analysis was read from the trace cache and cannot build the model'."""
    args = ("max-batch", "mlp", "--precision", "fp32", "--memory", "8GiB", "--checkpoint", "every-layer", "--json")
    code, out, _ = run(*args, "--no-cache")
    assert code == 0, out
    fresh = json.loads(out)["max_batch"]
    code, _, _ = run("max-batch", "mlp", "--precision", "fp32", "--memory", "1MiB")  # caches the plain trace
    assert code == 3
    code, out, _ = run(*args)
    assert code == 0, out
    assert json.loads(out)["max_batch"] == fresh


def test_max_batch_says_when_its_trace_came_from_the_cache(capsys, cache_dir):
    """A max-batch answered from the trace cache says so (it printed "traced in 29.8 s" for a run
    of 2.5 s, as if it had traced), as report does; a fresh one does not."""
    args = ("max-batch", "mlp", "--set", "S=16", "D=32", "L=2", "--memory", "1GiB")
    code, first, err = run_cli(capsys, *args)
    assert code == 0, err
    code, again, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "read back from the trace cache" not in " ".join(first.split())
    assert "read back from the trace cache" in " ".join(again.split())

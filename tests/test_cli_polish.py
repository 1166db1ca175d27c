"""User-facing output a newcomer found wanting: tables at 80 and 100 columns, what the memory
section's sums name, the unknown-model error before torch, and why no batch fits.

Oracles: the catalogue file read with ``tomllib`` (not symcost's parser) for the device figures;
the model built by PyTorch (``nn.Module.parameters()``) for P and the number of parameter tensors;
the conventions' hand-worked bytes per parameter (conventions.md, "Memory of a training step")."""
from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import tomllib
from importlib import resources

import pytest
import torch
from rich.console import Console

from conftest import run_cli as cli
from symcost.render import memory as mem
from symcost.units import gib
from symcost.passes import roofline as rl
from symcost.hardware.devices import PRECISIONS, get_device
from symcost.frontends.models import resolve
from symcost.render.report import render_memory, short

WIDTHS = (80, 100)
#: conventions.md: bytes per parameter of weights + gradients + AdamW's two moments, per policy
ADAMW_BYTES = {"fp32": 4 + 4 + 2 * 4, "bf16-mixed": 4 + 4 + 2 * 4, "bf16-true": 2 + 2 + 2 * 2,
               "bf16-true-fp32-state": 2 + 2 + 2 * 4}
_NUM = r"(-|[0-9.]+)"


def _catalogue_toml() -> dict:
    return tomllib.loads(resources.files("symcost.hardware").joinpath("devices.toml").read_text(encoding="utf-8"))


def _user_file(tmp_path):
    """A user's device with every optional field, a key longer than the catalogue's, no memory."""
    p = tmp_path / "lab.toml"
    p.write_text('[lab-gpu-rev-b]\nname = "Lab GPU revision B with a long name"\nbf16 = "312T"\nfp32 = 19.5e12\n'
                 'bandwidth = "1.6TB/s"\nwrite_bandwidth = "1.2TB/s"\naliases = ["labgpu"]\nsource = '
                 '"https://example.org/a/rather/long/path/to/the/datasheet/of/the/lab/gpu/revision-b.pdf"\n'
                 'date = "2025-01"\nnotes = "measured"\n[lab-gpu-rev-b.measured]\nstream = 1.5e12\n',
                 encoding="utf-8")
    return p


def test_devices_text_fits_80_and_100_columns(capsys, monkeypatch, tmp_path):
    """Every line within the width; each device's row whole on one line with its figures, read
    back and compared with the TOML file; names and dates whole; URLs only with --sources."""
    entries = _catalogue_toml()
    user = _user_file(tmp_path)
    entries["lab-gpu-rev-b"] = tomllib.loads(user.read_text())["lab-gpu-rev-b"]
    entries["lab-gpu-rev-b"].update(bf16=312e12, bandwidth=1.6e12)
    row = re.compile(r"^(\S+)" + r"\s+" .join([""] + [_NUM] * (len(PRECISIONS) + 3)) + r"$")
    for width in WIDTHS:
        monkeypatch.setenv("COLUMNS", str(width))
        code, out, err = cli(capsys, "devices", "--devices-file", str(user))
        assert code == 0, err
        lines = out.splitlines()
        assert max(map(len, lines)) <= width, (width, max(lines, key=len))
        rows = {m.group(1): m.groups()[1:] for m in map(row.match, (ln.rstrip() for ln in lines)) if m}
        assert set(rows) == set(entries), (width, sorted(rows))
        for key, e in entries.items():
            *peaks, tbs, gb, ridge = rows[key]
            for p, cell in zip(PRECISIONS, peaks):
                assert (cell == "-") == (p not in e), (key, p)
                if p in e:
                    assert float(cell) == pytest.approx(float(e[p]) / 1e12, rel=1e-4), (key, p)
            assert float(tbs) == pytest.approx(e["bandwidth"] / 1e12, rel=5e-3)
            assert (gb == "-") == ("memory" not in e)
            if "memory" in e:
                assert float(gb) == pytest.approx(e["memory"] / 1e9, rel=5e-4)
            assert float(ridge) == pytest.approx(float(e["bf16"]) / e["bandwidth"], abs=0.5)
            assert any(key in ln and e["name"] in ln and e["date"] in ln for ln in lines), (width, key)
        assert "https://" not in out and "labgpu = lab-gpu-rev-b" in re.sub(r"\s+", " ", out)
    code, out, _ = cli(capsys, "devices", "--devices-file", str(user), "--sources")
    for key, e in entries.items():
        assert f"  {key}: {e['source']}" in out.splitlines()


def test_devices_json_carries_every_field(capsys, tmp_path):
    user = _user_file(tmp_path)
    code, out, err = cli(capsys, "devices", "--devices-file", str(user), "--json")
    assert code == 0, err
    js = json.loads(out)
    entries = _catalogue_toml()
    assert set(js["devices"]) == set(entries) | {"lab-gpu-rev-b"}
    for key, e in entries.items():
        d = js["devices"][key]
        assert d["key"] == key and d["name"] == e["name"] and d["source"] == e["source"] and d["date"] == e["date"]
        assert d["peak_flops"] == {p: float(e[p]) for p in PRECISIONS if p in e}
        assert d["bandwidth"] == float(e["bandwidth"]) and d["memory"] == float(e["memory"])
        assert d["ridge"] == pytest.approx({p: float(e[p]) / e["bandwidth"] for p in PRECISIONS if p in e})
        assert d.get("notes", "") == e.get("notes", "")
    lab = js["devices"]["lab-gpu-rev-b"]
    assert lab["aliases"] == ["labgpu"] and lab["write_bandwidth"] == 1.2e12 and lab["memory"] is None
    assert lab["measured"] == {"stream": 1.5e12} and lab["notes"] == "measured" and lab["source"].endswith(".pdf")
    assert js["aliases"]["h100"] == "h100-sxm"


def _render(fn, width: int) -> str:
    c = Console(width=width, file=io.StringIO(), highlight=False, emoji=False, color_system=None)
    fn(c)
    return c.file.getvalue()


def test_roofline_tables_fit_80_and_100_columns(traced):
    """The roofline text at both widths: no line wider; each top op's numbers whole on the line
    of its phase, in the order of the table (numbers never wrap, only names fold)."""
    from symcost.render.roofline import _BOUND, _PHASE, _fmt_s, render_text

    an = traced("cs336-lm", "fp32")
    dev = get_device("h100")
    sizes = {"B": 3, "S": 48}
    r = rl.roofline(an, dev, sizes, crossing_symbol="B")
    tc = rl.tokens_compute(an, sizes)
    top = sorted(r["nodes"], key=lambda n: -n["seconds"])[:12]
    for width in WIDTHS:
        text = _render(lambda c: render_text(c, an, dev, r, tc, top=12, crossing_symbol="B"), width)
        lines = text.splitlines()
        assert max(map(len, lines)) <= width, (width, max(lines, key=len))
        start = next(i for i, ln in enumerate(lines) if ln.startswith("Top 12 ops"))
        body = [ln for ln in lines[start + 3:] if re.search(r"\s(fwd|bwd|opt)\s", ln)][:12]
        assert len(body) == len(top)
        for n, ln in zip(top, body):
            cells = [_PHASE[n["phase"]], str(n["repeat"]), short(n["flops"], "FLOP"), short(n["fused_bytes"], "B"),
                     _BOUND.get(n["bound"], n["bound"]), _fmt_s(n["seconds"]), f"{100 * n['share']:.1f}%"]
            assert re.search(r"\s+".join(map(re.escape, cells[:4])), ln), (width, cells, ln)
            assert re.search(r"\s+".join(map(re.escape, cells[4:])) + r"$", ln.rstrip()), (width, cells, ln)


def _model_counts(model: str, values: dict) -> tuple[int, int]:
    """(P, parameter tensors) as PyTorch counts them (shared parameters once)."""
    spec = resolve(model)
    with torch.device("meta"):
        m = spec.build(spec.values(values))
    params = list(m.parameters())
    return sum(p.numel() for p in params), len(params)


@pytest.mark.parametrize("model,precision", [("cs336-lm", "fp32"), ("gpt2", "bf16-true")])
def test_memory_section_sums_name_their_parts(traced, model, precision):
    """The report's sums at random sizes: 'parameters + gradients + optimizer state' equals the
    three rows added and bytes-per-parameter × P + 4 bytes × tensors (PyTorch's counts, AdamW
    step counters; gpt2's tied embedding once); the static row is its named parts, gradients left out; the peak row
    builds on that static figure."""
    an = traced(model, precision)
    rng = random.Random(precision)
    sizes = {"B": rng.randint(1, 6), "S": rng.randint(8, 40), "L": rng.randint(1, 4)}
    sec = mem.report_section(an, sizes, "80GiB", precision, "adamw", device="cpu")
    js = sec["json"]
    P, tensors = _model_counts(model, sizes)
    total = ADAMW_BYTES[precision] * P + 4 * tensors
    text = _render(lambda c: render_memory(sec, c, precision), 200)
    m = re.search(r"parameters \+ gradients \+ optimizer state at the sizes above: ([\d,]+) \+ ([\d,]+) \+ "
                  r"([\d,]+) = ([\d,]+) bytes", text)
    assert m, text
    parts = [int(g.replace(",", "")) for g in m.groups()]
    assert parts[:3] == [js["params"], js["grads"], js["optimizer"]] and sum(parts[:3]) == parts[3] == total
    assert f"= {ADAMW_BYTES[precision]} bytes →" in text
    static_parts = js["params"] + js["optimizer"] + js["master_weights"] + js["buffers"] + js["inputs"]
    assert js["static"] == static_parts and js["static"] == total - js["grads"] + js["buffers"] + js["inputs"]
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("static ("))
    assert "no gradients" in row and row.rstrip().endswith(gib(static_parts)), row
    assert js["peak"] >= js["static"] + js["grads"]  # the gradients live at the peak's step too


PROBE = """
import contextlib, io, json, sys
from symcost.cli import main
runs = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code
    runs.append([code, err.getvalue()])
print(json.dumps({"runs": runs, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def test_unknown_model_rejected_before_torch(tmp_path):
    """`symcost report nosuchmodel` (and every model-taking command): one line listing what is
    accepted, exit 2, and neither torch nor transformers imported."""
    missing = str(tmp_path / "nothere.py")
    cmds = [["report", "nosuchmodel"], ["eval", "nosuchmodel", "--set", "B=2"], ["formulas", "nosuchmodel"],
            ["max-batch", "nosuchmodel"], ["checkpoint", "nosuchmodel"],
            ["roofline", "nosuchmodel", "--device", "h100"],
            ["mfu", "nosuchmodel", "--device", "h100", "--tokens-per-second", "1e4"],
            ["time", "nosuchmodel", "--device", "h100", "--tokens", "1e9", "--mfu", "0.5"],
            ["report", f"{missing}:factory"], ["report", str(tmp_path / "none.json")]]
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cmds)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["torch"] is False and out["transformers"] is False
    for cmd, (code, err) in zip(cmds, out["runs"]):
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (cmd, err)
    for code, err in out["runs"][:8]:
        assert err.startswith("symcost: error: unknown model 'nosuchmodel'; accepted: ")
        for name in ("cs336-lm", "gpt2", "mlp", "megatron-gpt", "moe", "hf:MODEL_TYPE", "hf:ORG/NAME",
                     "config.json", "file.py:factory"):
            assert name in err
    assert f"model file {missing!r} not found" in out["runs"][8][1]
    assert "none.json' not found" in out["runs"][9][1]
    with pytest.raises(Exception, match="unknown model 'nosuchmodel'; accepted: cs336-lm"):
        resolve("nosuchmodel")  # the Python API says the same


def test_eval_says_why_no_batch_fits(capsys, traced):
    """A cap below the static memory: max_batch 0 with the reason, the static parts in bytes at
    B = 1 adding up to the figure printed (P from PyTorch's count, AdamW fp32: 4 B weights, 2 × 4 B
    moments, a 4-byte step per tensor); a cap between static and the peak: the peak's reason."""
    sizes = ["B=3", "S=16", "D=48", "L=2"]
    P, tensors = _model_counts("mlp", {"D": 48, "L": 2, "B": 1, "S": 16})
    code, out, err = cli(capsys, "eval", "mlp", "--set", *sizes, "--precision", "fp32", "--memory", "4KiB", "--json")
    assert code == 0, err
    m = json.loads(out)["memory"]
    assert m["max_batch"] == 0
    reason = m["max_batch_reason"]
    assert reason.startswith("the static memory alone exceeds the cap 4,096 bytes"), reason
    nums = dict((k, int(v.replace(",", ""))) for k, v in re.findall(r"(parameters|optimizer state|master weights|"
                                                                     r"buffers|inputs) ([\d,]+)", reason))
    total = int(re.search(r"= ([\d,]+) bytes", reason).group(1).replace(",", ""))
    assert nums["parameters"] == 4 * P and nums["optimizer state"] == 8 * P + 4 * tensors
    assert sum(nums.values()) == total > 4096
    code, out, err = cli(capsys, "eval", "mlp", "--set", *sizes, "--precision", "fp32", "--memory", "4KiB")
    assert code == 0, err
    flat = re.sub(r"\s+", " ", out)
    assert re.search(r"memory\.max_batch 0 \(no batch fits: the static memory alone exceeds", flat), out
    # a cap just above the static memory at B = 1: the peak at B = 1 is what does not fit
    cap = total + 1
    code, out, err = cli(capsys, "eval", "mlp", "--set", *sizes, "--precision", "fp32", "--memory", f"{cap}B", "--json")
    m = json.loads(out)["memory"]
    assert m["max_batch"] == 0 and m["max_batch_reason"].startswith("the peak at B = 1, "), m["max_batch_reason"]
    peak, static, live = (int(x.replace(",", "")) for x in re.search(
        r"B = 1, ([\d,]+) bytes .* static memory ([\d,]+) bytes \+ the largest live set ([\d,]+)",
        m["max_batch_reason"]).groups())
    assert static == total and peak == static + live > cap
    code, out, err = cli(capsys, "eval", "mlp", "--set", *sizes, "--precision", "fp32", "--json")
    assert json.loads(out)["memory"]["max_batch_reason"] is None  # 80GiB: a batch fits
    code, out, err = cli(capsys, "formulas", "mlp", "--precision", "fp32", "--json")
    assert "max_batch_reason" not in json.loads(out)["memory"]


@pytest.mark.parametrize("width", [80, 100])
def test_validate_table_numbers_never_wrap(capsys, monkeypatch, width):
    """The validate table at 80 and 100 columns: no line wider than the terminal, and every
    kernel's predicted and measured milliseconds whole on one line (rows made by hand, the
    measurement itself is tests/test_validate.py's)."""
    from symcost.validation import validate as val

    rng = random.Random(width)
    rows = []
    for i in range(6):
        pred = rng.uniform(1e-3, 3.0)
        meas = pred * rng.uniform(1.0, 1.9)
        rows.append({"family": "f", "kernel": f"gelu(Linear({rng.randint(100, 9999)},{rng.randint(100, 9999)})) on "
                     f"[{rng.randint(100, 9999)},{rng.randint(100, 9999)}] #{i}", "large": True,
                     "flops": rng.randint(1, 10**12), "bytes": rng.randint(1, 10**10), "intensity": rng.uniform(0.01, 500),
                     "bound": rng.choice(("compute", "memory", "transcendental")), "predicted": pred, "measured": meas,
                     "ratio": meas / pred})
    dev = val.device_from_entry({"fp32": 1e11, "bandwidth": 2e10})
    monkeypatch.setattr(val, "validate", lambda *a, **k: val.Validation(dev, rows, [], [], 1, 0.0))
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = cli(capsys, "validate", "--quick")
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    for r in rows:
        want = (f"{r['predicted'] * 1e3:.4g}", f"{r['measured'] * 1e3:.4g}", f"{100 / r['ratio']:.0f}%")
        assert any(all(w in line.split() for w in want) for line in lines), (r, out)

"""The performance model against published GPU training steps (issue 29; docs/validation.md,
"Predicted step time (issue 29)").

``tests/data/published-steps.json`` is what ``benchmarks/published_steps.py`` recorded: each run's
exact symcost command, the published step (derived from the published tokens/s or s/iteration)
and the predicted step and bound the command printed. These tests check that the docs table is
that file (so the table cannot rot), that each published step follows from the published figure
it quotes (an oracle independent of symcost's output), that each error is computed against it,
and (``heavy``) that the CLI prints the recorded prediction today.
"""
from __future__ import annotations

import json
import re
import shlex
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests" / "data" / "published-steps.json").read_text())["runs"]
DOC = (ROOT / "docs" / "validation.md").read_text()


def _section() -> str:
    start = DOC.index("### Predicted step time (issue 29)")
    end = DOC.find("\n## ", start)
    return DOC[start:end if end > 0 else None]


def _sizes(cmd: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b([BS])=(\d+)", cmd)}


def test_every_run_is_recorded_with_its_script_command():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import published_steps as ps
    finally:
        sys.path.pop(0)
    assert [r["id"] for r in DATA] == list(ps.RUNS)
    for r in DATA:
        cmd, published, figure, *k = ps.RUNS[r["id"]]
        K = k[0] if k else 1
        acc = f" --accumulate {K}" if K > 1 else ""  # (one optimizer step of K micro-batches, as the engine runs them)
        assert r["command"] == f"symcost {cmd}{acc} --json" and r["published_seconds"] == published
        assert r["micro_batches"] == K
        # K micro-batches with the reduction and the optimizer step once (DDP/Megatron) or the reduction every
        # micro-batch (FSDP2): at most K times the traced micro-batch's step
        assert r["predicted_seconds"] <= K * r["predicted_micro_seconds"] * (1 + 1e-12)
        assert r["predicted_seconds"] == pytest.approx(r["predicted_micro_seconds"], rel=1e-12) or K > 1


def test_published_steps_follow_from_the_published_figures():
    """tokens/s per GPU (torchtitan's tps and WPS, torchtune's tokens/s on one device): step = B·S /
    rate; s/iteration: the figure itself (docs/validation.md, Conventions)."""
    # Narayanan et al. 2021 (arXiv:2104.04473) Table 1, rows 1-10: hidden, layers, GPUs, batch, TFLOP/s
    # per GPU; F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration (eq. 3), s = 2048, V = 51200
    table1 = {"N1": (2304, 24, 32, 512, 137), "N2": (3072, 30, 64, 512, 138), "N3": (4096, 36, 128, 512, 142),
              "N4": (6144, 40, 256, 1024, 135), "N5": (8192, 48, 512, 1536, 138), "N6": (10240, 60, 1024, 1792, 140),
              "N7": (12288, 80, 1536, 2304, 148), "N8": (16384, 96, 1920, 2160, 155),
              "N9": (20480, 105, 2520, 2520, 163), "N10": (25600, 128, 3072, 3072, 163)}
    for r in DATA:
        fig = r["published"]
        rate = float(fig.split()[0].replace(",", ""))
        if r["id"] in table1:
            h, l, n, G, tf = table1[r["id"]]
            F = 96 * G * 2048 * l * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * l * h))
            assert rate == tf and r["published_seconds"] == pytest.approx(F / (tf * 1e12 * n), rel=1e-4), r["id"]
        elif "s/iteration" in fig:
            assert r["published_seconds"] == rate, r["id"]
        else:
            s = _sizes(r["command"])
            assert r["published_seconds"] == pytest.approx(s["B"] * s["S"] / rate, rel=2e-3), r["id"]


def test_errors_are_against_the_published_step_and_the_docs_table_is_the_record():
    sec = _section()
    errs = []
    for r in DATA:
        e = r["predicted_seconds"] / r["published_seconds"] - 1
        assert r["error"] == pytest.approx(e, rel=1e-9) and r["bound_error"] == pytest.approx(
            r["bound_seconds"] / r["published_seconds"] - 1, rel=1e-9)
        errs.append(abs(e))
        row = next((ln for ln in sec.splitlines() if ln.startswith(f"| {r['id']} |")), None)
        assert row is not None, f"{r['id']} has no row in docs/validation.md"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert f"{r['predicted_seconds']:.4g}" == cells[3] and f"{r['bound_seconds']:.4g}" == cells[2], row
        assert f"{100 * e:+.1f}%" == cells[5], row
        assert f"`{r['command']}`" in sec, r["id"]
    line = (f"{len(DATA)} runs: median |error| {100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%; "
            f"within 15%: {sum(x <= 0.15 for x in errs)}, within 30%: {sum(x <= 0.30 for x in errs)}")
    assert line in " ".join(sec.split()), line


@pytest.mark.heavy
@pytest.mark.hf
def test_the_cli_prints_the_recorded_prediction(capsys):
    """The cheapest recorded command (MG6: a 12 x 512 GPT on 8 H100s), run through the CLI now,
    prints the recorded predicted step and bound."""
    from conftest import run_cli

    r = next(r for r in DATA if r["id"] == "MG6")
    code, out, err = run_cli(capsys, *shlex.split(r["command"])[1:])
    assert code == 0, err
    st = json.loads(out)["parallel"]["step"]
    assert st["predicted"]["step_seconds"] == pytest.approx(r["predicted_micro_seconds"], rel=1e-9)
    assert st["step_seconds"] * r["micro_batches"] == pytest.approx(r["bound_seconds"], rel=1e-9)

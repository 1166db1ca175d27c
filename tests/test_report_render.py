"""``symcost report`` fits the terminal and opens with what it assumed (issue 7, item 2).

Rendered at 80 and 120 columns (rich Console of that width, and the CLI under ``COLUMNS``) for
the default model, ``hf:llama`` and a factory: no line is wider than the terminal, every module
name is printed whole (never broken mid-word), and the first lines name the precision with its
bytes per parameter, the optimizer, the attention implementation, the regime with the pinned
symbols, and the memory cap.
"""
from __future__ import annotations

import re
import textwrap

import pytest
from click.testing import CliRunner

from symcost.passes import memory
from symcost.cli import main
from symcost.render.report import PIPE_WIDTH, memory_section, module_rows, render

FACTORY = textwrap.dedent("""
    from torch import nn

    def build(D: int = 64, L: int = 3):
        return nn.Sequential(*[nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
                               for _ in range(L)])
""")


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    path = tmp_path_factory.mktemp("render") / "seq_model.py"
    path.write_text(FACTORY)
    return f"{path}:build"


def _render(capsys, an, sizes, width) -> list[str]:
    mem = memory_section(an, sizes, "80GiB", an.precision, "adamw")
    capsys.readouterr()
    render(an, sizes, memory=mem, width=width)
    return capsys.readouterr().out.splitlines()


def _check(lines: list[str], width: int, an, sizes) -> None:
    assert lines, "nothing printed"
    too_wide = [ln for ln in lines if len(ln) > width]
    assert not too_wide, f"{len(too_wide)} lines wider than {width}: {too_wide[0]!r}"
    head = "\n".join(lines[:8])
    bpp = memory.memory_model(an, an.precision, "adamw").bytes_per_param()
    assert re.search(rf"precision\s+{re.escape(an.precision)}, {bpp} bytes/param with adamw", head), head
    assert re.search(r"optimizer\s+adamw; memory cap 80\.000 GiB", head), head
    assert re.search(r"attention\s+", head) and re.search(r"regime\s+", head), head
    for s, v in an.pinned.items():
        assert f"{s} = {v} pinned" in head, head
    # every module's own name appears whole, as one word of some line
    words = {w for ln in lines for w in ln.split()}
    for row in module_rows(an):
        last = row["module"].rsplit(".", 1)[-1]
        if last.startswith("(") or last == "{i}":
            continue
        assert any(w == last or w.endswith("." + last) for w in words), f"module name {last!r} broken or missing"


@pytest.mark.parametrize("width", [80, 120])
def test_default_model(capsys, traced, width):
    an = traced("cs336-lm")
    for sizes in ({}, {"B": 4, "S": 512}):
        _check(_render(capsys, an, sizes, width), width, an, sizes)


@pytest.mark.parametrize("width", [80, 120])
def test_hf_llama_pinned_b1(capsys, traced, width):
    an = traced("hf:llama", "fp32", "eager", (), (("B", 1),))
    lines = _render(capsys, an, {"S": 4096}, width)
    _check(lines, width, an, {"S": 4096})
    assert re.search(r"attention\s+eager", "\n".join(lines[:8]))


@pytest.mark.parametrize("width", [80, 120])
def test_factory_named_by_class(capsys, traced, factory, width):
    an = traced(factory)
    lines = _render(capsys, an, {}, width)
    _check(lines, width, an, {})
    text = "\n".join(lines)
    # a factory's modules are indices (0, {i}.0): the table names their classes
    assert re.search(r"\b0 Linear\b", text) and re.search(r"\b1 GELU\b", text), text


def test_sdpa_by_default_and_eager_on_request(capsys, traced):
    """``report hf:llama --set B=1 S=4096``: SDPA (transformers' default) unless --attention eager,
    stated in the header; eager's peak is higher by at least one layer's S×S attention
    probabilities (H·S² elements, which SDPA never materialises)."""
    sdpa = traced("hf:llama", "fp32", None, (), (("B", 1),))
    eager = traced("hf:llama", "fp32", "eager", (), (("B", 1),))
    assert sdpa.spec.extra["attention"] == "sdpa" and eager.spec.extra["attention"] == "eager"
    head = "\n".join(_render(capsys, sdpa, {"S": 4096}, 100)[:8])
    assert re.search(r"attention\s+sdpa \(transformers' default", head), head
    S, H = 4096, sdpa.spec.defaults["H"]
    p_sdpa = memory.memory_model(sdpa, "fp32").peak(S=S)
    p_eager = memory.memory_model(eager, "fp32").peak(S=S)
    assert p_eager - p_sdpa >= H * S * S * 4, (p_sdpa, p_eager)


def test_cli_width_from_columns_and_100_when_piped(monkeypatch):
    """Through the CLI: COLUMNS decides the width; without it, output that is not a terminal is
    100 columns wide (the tables fill it, no line passes it); stderr stays silent."""
    for env, width in (({"COLUMNS": "80"}, 80), ({}, PIPE_WIDTH)):
        monkeypatch.delenv("COLUMNS", raising=False)
        r = CliRunner().invoke(main, ["report", "mlp", "--precision", "fp32", "--set", "B=2"], env=env)
        assert r.exit_code == 0, r.output
        assert r.stderr == ""  # no progress line when stderr is not a terminal
        lens = [len(ln) for ln in r.stdout.splitlines()]
        assert max(lens) == width, (width, max(lens))


@pytest.mark.heavy
def test_config_file_attention_text_and_json_agree_with_the_trace(capsys, attention=None):
    """A config.json model (symcost/frontends/hf.py) is built with transformers' attention (sdpa
    where the class has it, unless --attention): the report's header and its JSON name the same
    implementation, and it is the one the traced step ran (an sdpa op in the graph, or none)."""
    import json
    import os

    import symcost
    from conftest import run_cli

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "llama-3-8b.json")
    sizes = ("H=4", "D=8", "K=2", "V=64", "F=32", "L=2", "B=2", "S=8")
    opt = ("--attention", attention) if attention else ()
    code, out, err = run_cli(capsys, "report", path, "--set", *sizes, "--precision", "fp32", *opt, "--json")
    assert code == 0, err
    js_att = json.loads(out)["attention"]
    code, text, err = run_cli(capsys, "report", path, "--set", *sizes, "--precision", "fp32", *opt)
    assert code == 0, err
    (line,) = [ln for ln in text.splitlines() if ln.startswith("attention")]
    assert line.split()[1] == js_att and "own code" not in line, line
    an = symcost.trace(path, attention=attention, precision="fp32",  # the trace the CLI cached
                       sizes={k: int(v) for k, v in (s.split("=") for s in sizes)})
    ran_sdpa = any("scaled_dot_product" in op.name for op in an.ops)
    assert js_att == ("sdpa" if ran_sdpa else "eager") == "sdpa"  # transformers' default for llama

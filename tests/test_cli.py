"""The ``symcost`` command line (issue 2, "CLI and Python API" and "Bad input").

Bad input: one clear line on stderr naming what was wrong, exit code 2, no traceback (``--debug``
shows it); user strings never reach ``eval``/``sympify``. The JSON contract: its keys, formulas
that ``sympy.sympify`` parses into polynomials over the canonical symbols and that equal
``eval``'s integers. The report prints the ``6·N·P`` form. Graphs round-trip through networkx.

Most commands run in-process (``symcost.cli.main([...])``, output captured); the few that need a
fresh interpreter (no transformers) run as subprocesses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import networkx as nx
import pytest
import sympy

import symcost
from conftest import run_cli as run

CANONICAL = {"B", "S", "H", "D", "L", "V", "F", "K"}
# Parsing needs the canonical names as locals: bare sympy.sympify("B*S") reads S as sympy.S (the
# singleton registry) and N as sympy.N, and fails. Names outside this map stay plain Symbols and
# are caught by the free-symbol checks below.
LOCALS = {name: sympy.Symbol(name) for name in CANONICAL | {"N"}}


def parse(text: str, **kw) -> sympy.Expr:
    return sympy.sympify(text, locals=LOCALS, **kw)




def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Traceback" not in out, err
    line = lines[0]
    assert line.startswith("symcost: error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


# ------------------------------------------------------------------------------------------------
# bad input
@pytest.mark.parametrize("model, needles", [
    ("nosuch", ("'nosuch'", "cs336-lm", "hf:MODEL_TYPE", "file.py:factory")),
    ("hf:nosuch", ("'nosuch'", "llama")),
    ("missing_dir/model.py:factory", ("missing_dir/model.py", "not found")),
])
def test_unknown_model(capsys, model, needles):
    assert_one_line_error(*run(capsys, "eval", model, "--set", "B=2"), *needles)


@pytest.mark.parametrize("pair, needles", [
    ("Q=3", ("unknown symbol 'Q'", "mlp", "B, S, D, L")),  # (any name may be a model's own size)
    ("l-x=3", ("unknown symbol 'l-x'", "B, S, H, D, L, V, F, K")),
    ("PP=4", ("unknown symbol 'PP'", "pipeline stages are --pp N")),
    ("B=0", ("B must be a positive integer", "0")),
    ("B=-3", ("B must be a positive integer", "-3")),
    ("S=1e3", ("S must be a positive integer", "'1e3'")),
    ("B=2.5", ("B must be a positive integer", "'2.5'")),
    ("B=", ("B must be a positive integer",)),
    ("B=__import__('os')", ("B must be a positive integer", "__import__('os')")),
])
def test_bad_set_values(capsys, pair, needles):
    # rejected while parsing, before any trace
    assert_one_line_error(*run(capsys, "eval", "mlp", "--set", pair), *needles)


def test_set_symbol_the_model_lacks(capsys):
    # H is canonical but mlp has no heads: the message names the model's own symbols
    assert_one_line_error(*run(capsys, "eval", "mlp", "--set", "H=4"), "'H'", "mlp", "B, S, D, L")
    # a mesh size names the option that sets it
    assert_one_line_error(*run(capsys, "eval", "mlp", "--set", "DP=8"), "'DP'", "data parallelism is --dp N")


def test_set_without_equals(capsys):
    assert_one_line_error(*run(capsys, "eval", "mlp", "--set", "B"), "SYMBOL=INTEGER", "'B'")


def test_user_strings_are_never_evaluated(capsys, tmp_path):
    canary = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {canary}')"
    assert_one_line_error(*run(capsys, "eval", "mlp", "--set", f"B={payload}"), "B must be a positive integer")
    code, out, err = run(capsys, "eval", "hf:gpt2", "--config", f"n_embd={payload}")
    assert_one_line_error(code, out, err, "n_embd")
    assert not canary.exists()


def test_click_usage_errors_are_one_line(capsys):
    assert_one_line_error(*run(capsys, "report", "mlp", "--attention", "flash"), "--attention", "eager")
    assert_one_line_error(*run(capsys, "eval", "mlp", "--precision", "fp99"), "fp99", "fp32")
    assert_one_line_error(*run(capsys, "eval", "mlp", "--config", "a=1"), "--config", "hf:")


BAD_FACTORIES = """
import torch
from torch import nn

raise_at_import = False

class DataDependent(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # control flow on tensor values
            return y * 2
        return y

def data_dependent(D: int = 8):
    return DataDependent(D)

def raises(D: int = 8):
    raise RuntimeError("kaboom in user code")

def raises_no_args():
    raise ValueError("no spec today")

def not_a_model():
    return 42
"""


@pytest.fixture
def bad_file(tmp_path):
    p = tmp_path / "bad_models.py"
    p.write_text(textwrap.dedent(BAD_FACTORIES))
    return str(p)


def test_factory_that_raises(capsys, bad_file):
    assert_one_line_error(*run(capsys, "eval", f"{bad_file}:raises"), "'raises'", "RuntimeError", "kaboom")
    assert_one_line_error(*run(capsys, "eval", f"{bad_file}:raises_no_args"), "ValueError", "no spec today")
    assert_one_line_error(*run(capsys, "eval", f"{bad_file}:not_a_model"), "ModelSpec")
    assert_one_line_error(*run(capsys, "eval", f"{bad_file}:absent"), "'absent'")


def test_factory_file_that_fails_to_import(capsys, tmp_path):
    p = tmp_path / "broken.py"
    p.write_text("import torch\nraise ImportError('needs a package you do not have')\n")
    assert_one_line_error(*run(capsys, "eval", f"{p}:factory"), "broken.py", "ImportError", "needs a package")


def test_data_dependent_control_flow(capsys, bad_file):
    line = assert_one_line_error(*run(capsys, "eval", f"{bad_file}:data_dependent", "--set", "B=2"),
                                 "control flow")
    assert "tensor values" in line or "data" in line


def test_debug_shows_the_traceback(capsys, bad_file):
    code, out, err = run(capsys, "eval", f"{bad_file}:raises", "--debug")
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "kaboom in user code" in err
    assert err.strip().splitlines()[-1].startswith("symcost: error: ")


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_missing_transformers():
    """transformers is an optional extra: hf: models say how to install it; others still work."""
    hide = "import sys; sys.modules['transformers'] = None; from symcost.cli import main; "
    res = _python(hide + "main(['report', 'hf:llama', '--set', 'B=1', 'S=4096'])")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("symcost: error: ") and "transformers" in lines[0] and "pip install" in lines[0]
    res = _python(hide + "main(['eval', 'mlp', '--set', 'B=2', 'S=3', '--json'])")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"] == "mlp"


def test_error_in_a_real_process_has_no_traceback():
    res = subprocess.run([sys.executable, "-m", "symcost.cli", "eval", "nosuch"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and "Traceback" not in res.stderr


# ------------------------------------------------------------------------------------------------
# the JSON contract
def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


CONTRACT = ["model", "symbols", "params", "params_embedding", "params_nonembedding", "flops.forward",
            "flops.backward", "flops.train", "flops.train_simplified", "flops_all.forward", "flops_all.backward",
            "flops_all.train", "bytes.forward", "bytes.backward", "bytes.train", "attention_flops_count",
            "unsupported_ops"]
QUANTITIES = [k for k in CONTRACT if k not in ("model", "symbols", "unsupported_ops", "attention_flops_count")]


@pytest.fixture(scope="module")
def gpt2_json():
    """``formulas gpt2 --json`` and ``eval gpt2 --set (every symbol) --json``, in fresh processes."""
    sizes = {"B": 3, "S": 17, "H": 5, "D": 6, "L": 7, "V": 101}
    outs = []
    for args in (["formulas", "gpt2"], ["eval", "gpt2", "--set", *[f"{k}={v}" for k, v in sizes.items()]]):
        res = subprocess.run([sys.executable, "-m", "symcost.cli", *args, "--json"], capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout))
    return outs[0], outs[1], sizes


def test_json_contract_keys(gpt2_json):
    formulas, values, sizes = gpt2_json
    for doc in (formulas, values):
        for key in CONTRACT:
            _get(doc, key)  # KeyError names the missing key
        assert doc["model"] == "gpt2"
        assert set(doc["symbols"]) == {"B", "S", "H", "D", "L", "V"}
        assert all(isinstance(s["meaning"], str) and s["meaning"] for s in doc["symbols"].values())
    assert {k: s["value"] for k, s in values["symbols"].items()} == sizes
    assert formulas["attention_flops_count"] == values["attention_flops_count"] == "full"  # the default
    for key in QUANTITIES:
        assert isinstance(_get(formulas, key), str), key
        v = _get(values, key)
        assert isinstance(v, int) and not isinstance(v, bool) and v > 0, (key, v)


def test_json_formulas_parse_and_equal_eval(gpt2_json):
    formulas, values, sizes = gpt2_json
    allowed = set(formulas["symbols"])
    assert allowed <= CANONICAL
    for key in QUANTITIES:
        expr = parse(_get(formulas, key))
        names = {str(s) for s in expr.free_symbols}
        assert names <= allowed, (key, names)
        assert not expr.atoms(sympy.Function) and not expr.atoms(sympy.Float), (key, expr)
        assert expr.is_polynomial(*expr.free_symbols), (key, expr)
        got = expr.subs({LOCALS[k]: v for k, v in sizes.items()})
        assert got == _get(values, key), key
    assert sympy.expand(parse(formulas["flops"]["train_simplified"]) - parse(formulas["flops"]["train"])) == 0
    assert values["flops"]["train"] == values["flops"]["forward"] + values["flops"]["backward"]
    assert values["flops"]["train_simplified"] == values["flops"]["train"]
    # the numbers themselves, by hand: GPT-2's P = 12·L·(HD)² + V·HD and
    # train = 6·B·S·P + 12·L·B·S²·H·D (FlopCounterMode's non-causal convention)
    B, S, H, D, L, V = (sizes[k] for k in "BSHDLV")
    P = 12 * L * (H * D) ** 2 + V * H * D
    assert values["params_matmul"] == P
    assert values["flops"]["train"] == 6 * B * S * P + 12 * L * B * S**2 * H * D


# ------------------------------------------------------------------------------------------------
# the report
@pytest.mark.heavy
def test_report_default_model_prints_6NP_form(capsys):
    code, out, err = run(capsys, "report")
    assert code == 0, err
    assert "cs336-lm" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if "6·N·P" in line)
    body = lines[head:]
    B, S, H, D, L, V, F = (LOCALS[c] for c in "BSHDLVF")
    # cs336-lm by hand: per block q, k, v, output projections 4·(HD)² and SwiGLU w1, w2, w3
    # 3·HD·F; the untied lm_head HD·V (the embedding is a lookup, RMSNorm gains are scales)
    P_hand = 4 * (H * D) ** 2 * L + 3 * H * D * F * L + H * D * V
    p_line = next(x for x in body if x.strip().startswith("P (") or x.strip().startswith("P ="))
    assert sympy.expand(parse(p_line.split("=", 1)[1]) - P_hand) == 0, p_line
    f_line = next(x for x in body if x.strip().startswith("flops.train ="))
    form = parse(f_line.split("=", 1)[1], evaluate=False)
    assert sympy.expand(form - (6 * B * S * P_hand + 12 * L * B * S**2 * H * D)) == 0, f_line
    # printed as 6·B·S·(P) + remainder: one term is 6·B·S times a factor equal to P
    sixnp = [t for t in sympy.Add.make_args(form)
             if {6, B, S} <= set(sympy.Mul.make_args(t))]
    assert len(sixnp) == 1, f_line
    rest = sympy.Mul(*[f for f in sympy.Mul.make_args(sixnp[0]) if f not in (6, B, S)])
    assert sympy.expand(rest - P_hand) == 0, f_line


@pytest.mark.heavy
def test_report_hf_llama_acceptance_command(capsys):
    """The issue's own command: ``symcost report hf:llama --set B=1 S=4096`` (B = 1 is pinned)."""
    code, out, err = run(capsys, "report", "hf:llama", "--set", "B=1", "S=4096")
    assert code == 0, err
    assert "hf:llama" in out and "6·N·P" in out
    # Llama-2-7B shape (default config) at 4096 tokens: 6·N·P alone is ~1.6e14 FLOP
    assert "TFLOP" in out or "PFLOP" in out


def test_report_with_sizes_prints_readable_units(capsys):
    code, out, err = run(capsys, "report", "mlp", "--set", "B=8", "S=1024", "--precision", "fp32")
    assert code == 0, err
    assert "6·N·P" in out
    # mlp at D=1024 (default), L=8: 6·N·P = 6·8192·(8·1024²) ≈ 412 GFLOP — printed in GFLOP/TFLOP
    assert "GFLOP" in out or "TFLOP" in out
    assert "GiB" in out or "MiB" in out


# ------------------------------------------------------------------------------------------------
# graph export
def test_graph_roundtrips_through_networkx(traced, tmp_path):
    an = traced("mlp", "fp32", "eager")
    g = an.graph
    assert isinstance(g, nx.DiGraph) and g.number_of_nodes() > 0 and g.number_of_edges() > 0
    ops = [n for n, d in g.nodes(data=True) if d.get("kind") == "op"]
    assert {g.nodes[n]["phase"] for n in ops} == {"forward", "backward"}
    # model FLOPs of the graph's op nodes (times their repeat) are the analysis' total
    total = sympy.Add(*[g.nodes[n]["repeat"] * g.nodes[n]["flops"] for n in ops])
    assert sympy.expand(total - an.flops("train")) == 0 and total != 0

    an.write(str(tmp_path / "g.graphml"))
    an.write(str(tmp_path / "g.json"))
    back_ml = nx.read_graphml(tmp_path / "g.graphml")
    with open(tmp_path / "g.json") as f:
        back_js = nx.node_link_graph(json.load(f), edges="edges")
    for back in (back_ml, back_js):
        assert isinstance(back, nx.DiGraph)
        assert set(back.nodes) == {str(n) for n in g.nodes}
        assert set(back.edges) == {(str(u), str(v)) for u, v in g.edges}
        for n, d in g.nodes(data=True):
            bd = back.nodes[str(n)]
            assert set(bd) == set(d), n
            if d.get("kind") == "op":
                assert bd["op"] == d["op"] and bd["phase"] == d["phase"] and bd["module"] == d["module"]
                for attr in ("flops", "flops_all", "bytes", "repeat"):
                    assert sympy.expand(parse(bd[attr]) - parse(str(d[attr]))) == 0, (n, attr)
        for u, v, d in g.edges(data=True):
            assert parse(back.edges[str(u), str(v)]["bytes"]) == parse(str(d["bytes"]))
        # networkx algorithms run on the file's graph: a training step's op graph has no cycle
        assert nx.is_directed_acyclic_graph(back)
    with pytest.raises(symcost.SymcostError):
        an.write(str(tmp_path / "g.xyz"))

"""Issue 30, item 1: a model's own sizes are its symbols. docs/user-guide.md's three factory
examples (a CNN, an encoder-decoder, a custom block), run as written there, against independent
oracles at random sizes: FlopCounterMode's FLOPs of the real step, the bytes
saved_tensors_hooks sees on real tensors (tests/memory_oracle.py), a meta-device parameter
count; and the CLI's --set and JSON in the model's own names."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import sympy
import torch

import symcost
from conftest import run_cli
from memory_oracle import exact_at

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = re.compile(r"^<!-- factory example: (\S+) -->\s*\n```python[^\n]*\n(.*?)^```", re.M | re.S)


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict[str, Path]:
    """The guide's factory examples written to files, by name (``cnn.py``, ...)."""
    found = dict(EXAMPLE.findall((ROOT / "docs" / "user-guide.md").read_text()))
    assert set(found) == {"cnn.py", "encdec.py", "lora.py"}, set(found)
    folder = tmp_path_factory.mktemp("factories")
    for name, code in found.items():
        (folder / name).write_text(code)
    return {name: folder / name for name in found}


def _spec(path: Path, factory: str):
    from symcost.frontends.models import resolve

    return resolve(f"{path}:{factory}")


def _check(an, spec, v: dict) -> None:
    """symcost's params, model FLOPs and saved bytes at ``v`` against the oracles."""
    exact_at(an, spec, v)


def test_cnn_own_sizes(examples):
    """C, IMG, NCLS and L are the CNN's symbols (none pinned: IMG probed at multiples of 4, the
    first block, whose input the stem's ReLU already saved, traced apart from the others)."""
    spec = _spec(examples["cnn.py"], "spec")
    an = symcost.trace(f"{examples['cnn.py']}:spec", sizes={"B": 2, "C": 6, "IMG": 16, "L": 2, "NCLS": 5},
                       precision="fp32", torch_device="cpu")
    assert not an.pinned and {"C", "IMG", "NCLS", "L"} <= set(an.symbols), (an.pinned, an.symbols)
    assert an.symbols["IMG"] == "image side (pixels)"
    assert not an.flops("train").has(symcost.SYMS["S"])  # (S is no size of the model)
    # its 6·N·P form: N = B images, no S invented (was 6·B·S·P with -6*B*C**2*L*S ... in the remainder)
    from symcost import parse_formula
    from symcost.render.report import n_per_step

    P, rem, form = an.train_simplified()
    text, total = an.train_simplified_str(), an.flops("train")
    assert sympy.expand(6 * symcost.SYMS["B"] * P + rem - total) == 0, (P, rem)
    assert sympy.expand(parse_formula(text) - total) == 0 and sympy.expand(form.doit() - total) == 0, text
    assert rem.free_symbols | form.free_symbols <= total.free_symbols, (rem, form)
    assert n_per_step(an).startswith("N = B per step, B: images per step"), n_per_step(an)
    rng = random.Random("cnn")
    for _ in range(2):
        v = {"B": rng.randint(2, 4), "C": rng.randint(2, 12), "IMG": 4 * rng.randint(2, 9),
             "L": rng.randint(1, 4), "NCLS": rng.randint(2, 30)}
        _check(an, spec, v)


def test_lora_keyword_factory_own_size(examples):
    """A keyword factory's parameter R_lora (a capital letter, an integer default) is a symbol."""
    spec = _spec(examples["lora.py"], "build")
    assert spec.symbols == ("D", "L", "R_lora")
    an = symcost.trace(f"{examples['lora.py']}:build", sizes={"B": 2, "S": 5, "D": 12, "L": 2, "R_lora": 3},
                       precision="fp32", torch_device="cpu")
    assert not an.pinned and "R_lora" in an.symbols
    rng = random.Random("lora")
    for _ in range(2):
        v = {"B": rng.randint(2, 4), "S": rng.randint(3, 12), "D": rng.randint(4, 40), "L": rng.randint(1, 4),
             "R_lora": rng.randint(2, 9)}
        _check(an, spec, v)


@pytest.mark.heavy
def test_encoder_decoder_own_sizes(examples):
    """S_enc is a symbol; the stacks fold each under its own length, L_enc and L_dec (the
    decoder's last block apart: it adds no gradient of the encoder's output to another's): exact
    at random depths never traced (one of them 1: the folded decoder of one block), the peak
    within 1% of the profiler's."""
    from memory_oracle import step_peak

    from symcost.passes.memory import memory_model

    spec = _spec(examples["encdec.py"], "spec")
    req = {"B": 2, "S": 6, "S_enc": 9, "H": 3, "D": 4, "V": 37, "F": 12, "L_enc": 2, "L_dec": 3}
    an = symcost.trace(f"{examples['encdec.py']}:spec", sizes=req, precision="fp32", torch_device="cpu")
    assert not an.pinned and an.stacks == {"encoder": "L_enc", "decoder": "L_dec"}, an.pinned
    assert {"S_enc", "L_enc", "L_dec"} <= set(an.symbols)
    rng = random.Random("encdec")
    for depths in ((rng.randint(4, 6), rng.randint(4, 6)), (rng.randint(4, 6), 1)):
        v = {"B": rng.randint(2, 3), "S": rng.randint(3, 12), "S_enc": rng.randint(3, 14), "H": rng.randint(2, 4),
             "D": rng.choice((4, 6, 8)), "V": rng.randint(20, 90), "F": rng.randint(8, 40),
             "L_enc": depths[0], "L_dec": depths[1]}
        _check(an, spec, v)
        got, want = memory_model(an).peak(**v), step_peak(spec, v, "fp32")["peak"]
        assert abs(got / want - 1) < 0.01, (got, want, v)
        _six_n_p_per_stack(an, spec, v)
    _six_n_p_per_stack(an, spec, {**v, "S": v["S_enc"] + 1})  # (the two token counts apart)


def _six_n_p_per_stack(an, spec, v: dict) -> None:
    """An encoder-decoder's 6·N·P form counts each weight on the tokens it processes
    (``Conventions.token_groups``; Raffel et al. 2020 §3.2.2): P_enc and P_dec equal the weight
    elements of the nn.Linear modules whose input, in one real forward at ``v`` (forward hooks),
    carries B·S_enc and B·S tokens (the encoder's and each decoder block's ``kv`` on the source
    tokens; the rest of the decoder and the head on the target tokens); the remainder is then
    the attention matmuls' FLOPs exactly (no negative term: 6·B·S·P had put the encoder's weights
    on the target tokens), and the form is the train FLOPs, which ``_check`` compares with
    FlopCounterMode's."""
    from symcost import parse_formula
    from memory_oracle import build

    model, args, kwargs, ctx = build(spec, v, "fp32")
    seen: dict[int, int] = {}

    def hook(m, inputs, out):
        tokens = inputs[0].numel() // m.in_features
        seen[tokens] = seen.get(tokens, 0) + m.weight.numel()

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook)
    with torch.no_grad(), ctx():
        model(*args, **kwargs)
    (enc_names, enc), (dec_names, dec) = an.token_groups()
    env = {s: v[s.name] for s in (enc + dec).free_symbols}
    assert (enc_names, dec_names) == (("B", "S_enc"), ("B", "S"))
    want: dict[int, int] = {}
    for n, P in ((v["B"] * v["S_enc"], enc), (v["B"] * v["S"], dec)):  # (one count where S_enc = S)
        want[n] = want.get(n, 0) + int(P.subs(env))
    assert seen == want, (seen, want, v)
    _, rem, form = an.train_simplified()
    assert sympy.expand(rem - an.attention_flops) == 0, rem
    total = an.flops("train")
    assert sympy.expand(parse_formula(an.train_simplified_str()) - total) == 0 and sympy.expand(form.doit() - total) == 0
    # time, mfu and roofline count the same split (passes.roofline.tokens_compute): 6·N·P of a step
    # = 6·Σ tokens × weights of the hooks, the step's model FLOPs (= FlopCounterMode's, _check)
    # less it the attention FLOPs, a token budget's compute.6NP that per B·S target tokens
    from symcost.passes.roofline import tokens_compute

    tokens = v["B"] * v["S"] * random.Random(str(v)).randint(2, 9)
    tc = tokens_compute(an, v, tokens)
    six = 6 * sum(n * w for n, w in seen.items())
    assert tc["flops.per_token_6P"] * v["B"] * v["S"] == pytest.approx(six, rel=1e-12), (tc, six)
    assert tc["flops.train_step"] - six == int(an.attention_flops.xreplace(an.bind(**v))), (tc, six)
    assert tc["compute.6NP"] == six * tokens // (v["B"] * v["S"])
    assert [(g["tokens"], g["N"]) for g in tc["six_np.groups"]] == [("B·S_enc", v["B"] * v["S_enc"]), ("B·S", v["B"] * v["S"])]


def test_cli_sets_and_prints_own_sizes(examples, capsys, tmp_path, monkeypatch):
    """--set names the model's own sizes; the JSON's symbols carry them with their meanings, the
    parameter count is the meta-device count; a size the constraints refuse, and a name that
    cannot be a symbol, are one line each."""
    from test_cli import assert_one_line_error

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    path = examples["cnn.py"]
    code, out, err = run_cli(capsys, "eval", f"{path}:spec", "--set", "B=2", "C=5", "IMG=12", "L=3", "NCLS=7",
                             "--precision", "fp32", "--json")
    assert code == 0, err
    js = json.loads(out)
    assert js["symbols"]["IMG"] == {"meaning": "image side (pixels)", "value": 12}
    spec = _spec(path, "spec")
    with torch.device("meta"):
        meta = spec.build({**spec.defaults, "C": 5, "IMG": 12, "L": 3, "NCLS": 7})
    assert js["params"] == sum(p.numel() for p in meta.parameters())
    # the report's regime line says the class the formulas hold in (the factory's IMG multiple of 4)
    code, out, err = run_cli(capsys, "report", f"{path}:spec", "--set", "B=2", "C=5", "IMG=12", "L=3", "NCLS=7",
                             "--precision", "fp32")
    assert code == 0, err
    assert "IMG ≡ 0 (mod 4)" in " ".join(out.split()), out[:2000]
    assert_one_line_error(*run_cli(capsys, "eval", f"{path}:spec", "--set", "IMG=30"), "IMG must be a multiple of 4")
    assert_one_line_error(*run_cli(capsys, "eval", f"{path}:spec", "--set", "W=3"), "unknown symbol 'W'", "IMG")
    bad = tmp_path / "bad.py"
    bad.write_text(path.read_text().replace('"NCLS"', '"pi"'))
    assert_one_line_error(*run_cli(capsys, "eval", f"{bad}:spec", "--set", "B=2"), "'pi'", "sympy")
    # a symbol without a default: one line naming it, before any build (was KeyError: 'NCLS' at a probe)
    nodefault = tmp_path / "nodefault.py"
    nodefault.write_text(path.read_text().replace('"L": 4, "NCLS": 100}', '"L": 4}'))
    assert_one_line_error(*run_cli(capsys, "eval", f"{nodefault}:spec", "--set", "B=2"), "NCLS", "default")
    assert symcost.Constraint is __import__("symcost.frontends.spec").frontends.spec.Constraint


def test_symbol_names_refused():
    from symcost.tracing.symbols import name_problem

    assert name_problem("IMG") is None and name_problem("N_state") is None and name_problem("L_enc") is None
    for bad in ("N", "DP", "I", "floor", "2x", "x-y", "lambda"):
        assert name_problem(bad), bad


class TwoStacks(torch.nn.Module):
    """An encoder stack and a decoder stack of L blocks each (both follow L)."""

    def __init__(self, d, n):
        super().__init__()
        self.encoder = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()) for _ in range(n)])
        self.decoder = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                                                 torch.nn.Linear(2 * d, d)) for _ in range(n)])

    def forward(self, x):
        return self.decoder(self.encoder(x) + x)


def test_several_stacks_following_l_fold_each():
    """Two block lists of length L (an encoder-decoder sharing its depth): never refused (it was
    'several containers ... have length L'), and no longer traced unfolded with L pinned: each
    stack folds under L (docs/tracing.md §4, "Several stacks"), exact against the oracles at
    random other sizes and depths, the peak within 1% of the profiler's, also read back from JSON."""
    from memory_oracle import step_peak

    from symcost.passes.memory import memory_model

    spec = symcost.ModelSpec(
        name="two-stacks", symbols=("D", "L"), defaults={"B": 2, "S": 4, "D": 8, "L": 3},
        build=lambda v: TwoStacks(v["D"], v["L"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["D"], device=device),), {}),
        loss=lambda out, inputs: out.pow(2).mean())
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "D": 6, "L": 3}, precision="fp32", torch_device="cpu")
    assert not an.pinned and an.stacks == {"encoder": "L", "decoder": "L"}, (an.pinned, an.stacks)
    rng = random.Random("stacks")
    for L in (1, rng.randint(4, 7)):
        v = {"B": rng.randint(2, 5), "S": rng.randint(2, 12), "D": rng.randint(2, 20), "L": L}
        _check(an, spec, v)
        got, want = memory_model(an).peak(**v), step_peak(spec, v, "fp32")["peak"]
        assert abs(got / want - 1) < 0.01, (got, want, v)
    # the fold of the stacks travels with the analysis as data (the trace cache's JSON)
    from symcost.graph.analysis import Analysis

    back = Analysis.from_dict(json.loads(json.dumps(an.to_dict())))
    assert back.stacks == an.stacks and memory_model(back).peak(**v) == got


def test_factory_imports_a_module_beside_it(tmp_path):
    """A factory file imports its own modules from its folder, as ``python file.py`` would (the
    folder need not be the working directory, nor on PYTHONPATH)."""
    from symcost.frontends.models import resolve

    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "mylayers_beside.py").write_text("import torch\n\ndef make(d):\n    return torch.nn.Linear(d, d)\n")
    (folder / "fac.py").write_text(
        "import torch\nfrom symcost import ModelSpec\nfrom mylayers_beside import make\n\n"
        "def spec():\n"
        "    return ModelSpec(name='x', symbols=('W',), defaults={'B': 2, 'S': 1, 'W': 3},\n"
        "                     build=lambda v: make(v['W']),\n"
        "                     make_inputs=lambda v, device: ((torch.randn(v['B'], v['W'], device=device),), {}),\n"
        "                     loss=lambda out, inputs: out.sum())\n")
    spec = resolve(f"{folder / 'fac.py'}:spec")
    with torch.device("meta"):
        assert sum(p.numel() for p in spec.build({"W": 5}).parameters()) == 5 * 5 + 5


#: A user factory (docs/user-guide.md, "The factory contract") whose sizes need W/G: each of G
#: groups of W/G channels is mapped to W outputs (a [G, W/G, W] weight, one batched matmul over the
#: groups: [G, B*S, W/G] x [G, W/G, W]), the groups' outputs summed; G declared to divide W.
GROUPED = '''
import torch
from torch import nn
from symcost import ModelSpec
from symcost.frontends.spec import Constraint


class Block(nn.Module):
    """x + relu(sum over the G groups of x_g @ w_g), x_g the g-th W/G channels, w_g [W/G, W]."""

    def __init__(self, W, G):
        super().__init__()
        self.groups = G
        self.weight = nn.Parameter(torch.randn(G, W // G, W) / W ** 0.5)

    def forward(self, x):
        b, s, w = x.shape
        parts = x.view(b * s, self.groups, w // self.groups).transpose(0, 1)   # [G, B*S, W/G]
        y = torch.bmm(parts, self.weight).sum(0)                                # [B*S, W]
        return x + torch.relu(y.view(b, s, w))


class Grouped(nn.Module):
    def __init__(self, W, G, L):
        super().__init__()
        self.blocks = nn.ModuleList(Block(W, G) for _ in range(L))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def spec():
    return ModelSpec(
        name="grouped", symbols=("W", "G", "L"), defaults={"B": 2, "S": 4, "W": 64, "G": 4, "L": 2},
        meanings={"W": "width", "G": "groups of W/G channels"},
        constraints=(Constraint("divides", "G", "W", "G must divide W (G groups of W/G channels)"),),
        build=lambda v: Grouped(v["W"], v["G"], v["L"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["W"], device=device),), {}),
        loss=lambda out, inputs: out.pow(2).mean())
'''


def test_own_divisor_symbol_in_denominators(tmp_path):
    """A model's own size that divides another (a factory's G groups, declared by its
    ``Constraint("divides", "G", "W")``) may stand in a denominator as K does: the groups' batched
    matmul [G, B*S, W/G] x [G, W/G, W] is fitted with W/G, so nothing is pinned (the fit allowed
    exponent -1 to the conventions' K, E and the mesh sizes only: W/G pinned W and G); exact at
    random sizes against the oracles."""
    from symcost.frontends.models import resolve
    from symcost.tracing.fit import model_divisors

    path = tmp_path / "grouped.py"
    path.write_text(GROUPED)
    spec = resolve(f"{path}:spec")
    assert model_divisors(spec.constraints) == ("G",)
    an = symcost.trace(spec, sizes={"B": 2, "S": 3, "W": 12, "G": 3, "L": 2}, precision="fp32", torch_device="cpu")
    assert not an.pinned, an.pin_reasons
    B, S, W, G, L = (symcost.SYMS[s] for s in ("B", "S", "W", "G", "L"))
    assert an.params == L * W**2, an.params
    assert any(tuple(sh) == (G, B * S, W / G) for op in an.ops for sh in op.in_shapes), "no [G, B*S, W/G] operand"
    rng = random.Random("grouped")
    for _ in range(2):
        g = rng.randint(2, 4)
        _check(an, spec, {"B": rng.randint(2, 4), "S": rng.randint(2, 6), "W": g * rng.randint(2, 6), "G": g,
                          "L": rng.randint(1, 3)})


def test_stack_depths_served_from_the_trace_cache(examples, capsys, tmp_path, monkeypatch):
    """A trace of the guide's encoder-decoder serves every other depth of its two stacks from the
    trace cache, as L is served (newcomer: each new (L_enc, L_dec) was traced again, and a request
    with L_enc = L_dec, or a length equal to H, was never cached: its equal pairs were keyed, in
    another orientation than the tracer's). The served depths' parameters equal a meta-device
    count and their model FLOPs FlopCounterMode's."""
    from test_flops_exact import measure

    from symcost.commands import _options

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SYMCOST_GRAPHS_DIR", "")
    path = examples["encdec.py"]
    base = ["B=2", "S=8", "S_enc=12", "H=3", "D=8", "V=40", "F=24"]
    code, _, err = run_cli(capsys, "eval", f"{path}:spec", "--set", *base, "L_enc=3", "L_dec=3", "--precision", "fp32")
    assert code == 0, err

    def no_trace(*a, **k):
        raise AssertionError("traced again: the cache did not serve this depth")

    monkeypatch.setattr(_options, "_trace_fresh", no_trace)
    spec = _spec(path, "spec")
    rng = random.Random("stack depths")
    for _ in range(2):
        le, ld = rng.randint(2, 6), rng.randint(2, 6)
        code, out, err = run_cli(capsys, "eval", f"{path}:spec", "--set", *base, f"L_enc={le}", f"L_dec={ld}",
                                 "--precision", "fp32", "--json")
        assert code == 0, err
        js = json.loads(out)
        v = {**spec.defaults, **dict(x.split("=") for x in base), "L_enc": le, "L_dec": ld}
        v = {k: int(x) for k, x in v.items()}
        with torch.device("meta"):
            assert js["params"] == sum(p.numel() for p in spec.build(v).parameters())
        assert js["flops"]["train"] == measure(spec, v)["flops.train"], (le, ld)
    code, out, err = run_cli(capsys, "report", f"{path}:spec", "--set", *base, "L_enc=4", "L_dec=2", "--precision", "fp32")
    assert code == 0 and "blocks folded over L_dec, L_enc" in " ".join(out.split()), err or out[-1500:]

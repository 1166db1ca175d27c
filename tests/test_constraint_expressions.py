"""Issue 30, a size check as data: a :class:`symcost.frontends.spec.Constraint` over an expression
of symbols (``("multiple", "H*D", 2)``: Mamba-2's ``hidden_size * expand == num_heads *
head_dim``), so a spec that checks such a rule keeps its check as data and its traces are cached
(``hf:mamba2``, ``hf:zamba2`` and ``hf:zamba`` checked theirs with code: every call traced again
from cold). Checked against PyTorch: the cached analysis equals the fresh trace and
FlopCounterMode, saved_tensors_hooks and a meta-device count at a size the trace never probed; the
cached analysis refuses a size that breaks the expression, in one line, without the model."""
from __future__ import annotations

import random
import textwrap

import pytest

import symcost
from memory_oracle import exact_at
from symcost.frontends.spec import Constraint, check_constraints

#: a factory whose width is H*D/2 (d_model = H·D/expand as Mamba-2's, expand 2): an odd H*D is
#: refused by the expression constraint, as Mamba2Config refuses it
FACTORY = '''
import torch
import torch.nn.functional as F
from torch import nn
from symcost import ModelSpec
from symcost.frontends.spec import Constraint

VOCAB = 29


class Block(nn.Module):
    def __init__(self, h, d):
        super().__init__()
        self.h, self.d = h, d
        self.up = nn.Linear(h * d // 2, h * d, bias=False)
        self.down = nn.Linear(h * d, h * d // 2, bias=False)

    def forward(self, x):
        y = torch.relu(self.up(x)).view(*x.shape[:-1], self.h, self.d).softmax(-1)
        return x + self.down(y.flatten(-2))


class Net(nn.Module):
    def __init__(self, h, d, n):
        super().__init__()
        if h * d % 2:
            raise ValueError("hidden_size * 2 must equal H * D")  # (as Mamba2Config refuses it)
        self.emb = nn.Embedding(VOCAB, h * d // 2)
        self.layers = nn.ModuleList(Block(h, d) for _ in range(n))
        self.out = nn.Linear(h * d // 2, VOCAB, bias=False)

    def forward(self, t):
        x = self.emb(t)
        for b in self.layers:
            x = b(x)
        return self.out(x)


def spec():
    return ModelSpec(
        name="half-width", symbols=("H", "D", "L"), defaults={"B": 2, "S": 5, "H": 3, "D": 4, "L": 2},
        build=lambda v: Net(v["H"], v["D"], v["L"]),
        make_inputs=lambda v, device: ((torch.randint(0, VOCAB, (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: F.cross_entropy(out.flatten(0, 1), inputs[0][0].flatten()),
        constraints=(Constraint("multiple", "H*D", 2, "H*D must be even (d_model = H*D/2)"),))
'''


def test_expression_constraints_check_as_data():
    """Each kind over expressions: the reason names every symbol's value; missing symbols pass;
    anything but integer arithmetic on names is refused when the constraint is made."""
    mult = Constraint("multiple", "H*D", 4, "H*D must be a multiple of 4")
    assert mult.symbols == ("H", "D")
    assert mult.violated({"H": 3, "D": 6}) == "H*D must be a multiple of 4 (got H=3, D=6)"
    assert mult.violated({"H": 2, "D": 6}) is None and mult.violated({"H": 3}) is None
    assert Constraint("multiple", "3*H*D/2", 3, "w").violated({"H": 1, "D": 3}) == "w (got H=1, D=3)"  # 4.5
    assert Constraint("divides", "K", "2*H", "k").violated({"K": 4, "H": 2}) is None
    assert Constraint("max", "S + T", "P", "p").violated({"S": 3, "T": 5, "P": 7}) == "p (got S=3, T=5, P=7)"
    assert Constraint("min", "D - 2*R", 1, "r").violated({"D": 4, "R": 2}) == "r (got D=4, R=2)"
    assert check_constraints([mult], {"H": 3, "D": 4}) is None
    for bad in ("__import__('os')", "H.real", "f(H)", "H if D else 1", "1.5*H"):
        with pytest.raises(symcost.SymcostError, match="not an integer expression"):
            Constraint("multiple", bad, 2, "x")


def test_state_space_specs_check_as_data():
    """hf:mamba2, hf:zamba2 and hf:zamba check their sizes with constraints alone (data: the trace
    cache keeps them), and those refuse what the configs refuse: the model build on the meta device
    fails exactly where a constraint says so."""
    pytest.importorskip("transformers")
    rng = random.Random("ssm-constraints")
    # (Zamba as its test builds it: transformers builds ZambaForCausalLM only with two hybrid blocks)
    cases = {"hf:mamba2": ({}, ("H", "D"), 3), "hf:zamba2": ({}, ("H", "D"), 3),
             "hf:zamba": ({"n_mamba_heads": "4", "attn_layer_period": "1", "attn_layer_offset": "0"}, ("M",), 4)}
    for name, (config, syms, n_blocks) in cases.items():
        spec = symcost.resolve(name, config=config)
        assert spec.check.__qualname__.startswith("ModelSpec.__post_init__"), name
        assert any(not c.a.isidentifier() for c in spec.constraints), name  # (an expression)
        seen = set()
        small = {k: x for k, x in {"K": 1, "L": n_blocks, "V": 32, "F": 8, "N_state": 2, "R_dt": 2}.items()
                 if k in spec.symbols}
        for _ in range(20):
            v = dict(spec.defaults, **small, **{s: rng.randint(1, 9) for s in syms})
            why = spec.check(v)
            seen.add(why is None)
            try:
                spec.build_meta(v)
                built = True
            except Exception:  # noqa: BLE001 (the config refuses, or the build does)
                built = False
            assert built == (why is None), (name, v, why)
        assert seen == {True, False}, name


def test_expression_constrained_factory_is_cached_and_exact(tmp_path, monkeypatch):
    """A factory with an expression constraint is traced once: the second call is served from the
    trace cache, its formulas are the fresh trace's, and both equal PyTorch at a size never probed
    (another L, an H*D of another class); a size that breaks the expression is refused in one line
    by the cached analysis."""
    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "half_width.py"
    path.write_text(textwrap.dedent(FACTORY))
    model = f"{path}:spec"
    fresh = symcost.trace(model, precision="fp32", torch_device="cpu")
    assert fresh.pinned == {} and not fresh.__dict__.get("cached_from")
    cached = symcost.trace(model, precision="fp32", torch_device="cpu")
    assert cached.__dict__.get("cached_from")
    for ph in ("forward", "backward"):
        assert cached.flops(ph) == fresh.flops(ph)
    probed = {(p["H"] * p["D"] % 4, p["L"]) for p in fresh.plan.points}
    rng = random.Random("half-width")
    while True:
        v = {"B": rng.randint(1, 3), "S": rng.randint(2, 9), "H": rng.randint(2, 7), "D": rng.randint(2, 7),
             "L": rng.randint(3, 5)}
        if v["H"] * v["D"] % 2 == 0 and (v["H"] * v["D"] % 4, v["L"]) not in probed:
            break
    assert cached.subs(**v) == fresh.subs(**v)
    exact_at(fresh, fresh.spec, v)
    with pytest.raises(symcost.SymcostError, match=r"H\*D must be even .*got H=3, D=5"):
        cached.subs(**dict(v, H=3, D=5))

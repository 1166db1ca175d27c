"""Every size a user asks for gets an answer in its own regime (issue 6, item 1 and Acceptance).

For every verified ``hf:`` architecture plus those the issue names, one size tuple is drawn at
random, each symbol independently: K across its regimes (K = 1, 1 < K < H, K = H, spread over the
architectures that have key/value heads), H anything for bloom (ALiBi slopes of a head count that
is not a power of two), D equal to the rotary dimension for gptj. ``symcost eval hf:T --set ...
--json --precision fp32 --attention eager`` must answer, and equal what PyTorch measures on the
real model at those sizes with real CPU tensors and the model's own loss (``labels=input_ids``):
FlopCounterMode's forward / backward / train FLOPs, ``sum(p.numel())``, and the bytes autograd
saves (``saved_tensors_hooks``, each storage once) for ``memory.activations``. The oracles are
those of test_flops_exact.py and memory_oracle.py. A size tuple that PyTorch itself cannot
run (phi rotates an odd number of dimensions at D = 6) is not a request: it is drawn again.
"""
from __future__ import annotations

import json
import random

import pytest

import symcost
import symcost.graph.build
from symcost.frontends import hf
from symcost.cli import main
from test_flops_exact import measure
from memory_oracle import saved_bytes

NAMED = ("phi", "gemma", "gptj")  # named in the "Why" besides the verified ones
ARCHS = tuple(dict.fromkeys(hf.VERIFIED + NAMED))
K_REGIMES = ("1", "mid", "H")


def _has_k(model_type: str) -> bool:
    return "K" in symcost.resolve(f"hf:{model_type}").symbols


def draw(model_type: str, k_regime: str, rng: random.Random) -> tuple[dict[str, int], dict[str, str]]:
    """``(sizes for --set, --config overrides)`` at random, each size drawn on its own."""
    spec = symcost.resolve(f"hf:{model_type}", attention="eager")
    v = {"B": rng.randint(1, 3), "S": rng.randint(3, 14), "H": rng.randint(2, 9),
         "D": rng.choice((4, 6, 8, 10, 12, 14, 16)), "L": rng.randint(1, 3), "V": rng.randint(17, 97),
         "F": rng.randint(8, 40), "M": rng.randint(8, 48)}
    config = {}
    if "K" in spec.symbols:
        if k_regime == "1":
            v["K"] = 1
            if model_type == "olmo2":  # multi-query from the config as well as from --set
                config["num_key_value_heads"] = "1"
        elif k_regime == "H":
            v["K"] = v["H"]
        else:
            v["H"] = rng.choice((4, 6, 8, 9, 10, 12))
            v["K"] = rng.choice([k for k in range(2, v["H"]) if v["H"] % k == 0])
    if model_type == "bloom":  # ALiBi: a head count that is not a power of two
        v["H"] = rng.choice((3, 5, 6, 7, 9, 10, 11, 12))
    if model_type == "gptj":  # D equal to the rotary dimension
        config["rotary_dim"] = str(v["D"])
    return {s: x for s, x in v.items() if s in spec.all_symbols}, config


def cli_eval(capsys, model: str, sizes: dict[str, int], config: dict[str, str]) -> dict:
    # (--torch-device cpu: the oracle measures the step on real CPU tensors, whose dropout keeps
    # its mask in the input's dtype; the default, cuda, traces CUDA's bool mask)
    args = ["eval", model, "--json", "--precision", "fp32", "--attention", "eager", "--torch-device", "cpu",
            "--set", *[f"{k}={x}" for k, x in sizes.items()]]
    if config:
        args += ["--config", *[f"{k}={x}" for k, x in config.items()]]
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code in (0, None), (args, err)
    return json.loads(out)


def _cases():
    with_k = [a for a in ARCHS if _has_k(a)]
    out = []
    for a in ARCHS:
        regime = K_REGIMES[with_k.index(a) % 3] if a in with_k else "-"
        out.append(pytest.param(a, regime, id=f"{a}-K{regime}", marks=pytest.mark.heavy))
    return out


def test_every_k_regime_is_drawn():
    with_k = [a for a in ARCHS if _has_k(a)]
    assert len(with_k) >= 6 and {K_REGIMES[i % 3] for i in range(len(with_k))} == set(K_REGIMES)


def draw_runnable(model_type: str, k_regime: str, rng: random.Random, config: dict | None = None):
    """``(sizes, config, spec, PyTorch's measurement)``: sizes drawn until PyTorch (or the config
    class's own validation) accepts them; sizes it cannot run are no request."""
    for _ in range(20):
        sizes, cfg = draw(model_type, k_regime, rng)
        cfg = {**cfg, **(config or {})}
        spec = symcost.resolve(f"hf:{model_type}", cfg, "eager")
        try:
            want = measure(spec, sizes)  # PyTorch on real CPU tensors
        except (RuntimeError, symcost.SymcostError):
            continue
        want["activations"] = saved_bytes(spec, sizes, "fp32")
        return sizes, cfg, spec, want
    pytest.fail(f"no size tuple of hf:{model_type} that PyTorch runs")


def answered(out: dict) -> dict:
    return {"flops.forward": out["flops"]["forward"], "flops.backward": out["flops"]["backward"],
            "flops.train": out["flops"]["train"], "params": out["params"],
            "activations": out["memory"]["activations"]}


@pytest.mark.parametrize("model_type,k_regime", _cases())
def test_eval_answers_every_regime_exactly(capsys, model_type, k_regime):
    sizes, config, spec, want = draw_runnable(model_type, k_regime, random.Random(f"regimes:{model_type}"))
    out = cli_eval(capsys, f"hf:{model_type}", sizes, config)
    assert answered(out) == want, (model_type, sizes, config, out.get("pinned_symbols"))
    # the sizes asked for are the sizes answered: a symbol is either evaluated or pinned at it
    values = {s: d["value"] for s, d in out["symbols"].items()}
    values.update(out["pinned_symbols"])
    values.update({a: values[b] for a, b in out["tied_symbols"].items() if b in values})
    assert {s: values[s] for s in sizes} == sizes


def test_k_not_dividing_h_is_refused_before_tracing(capsys, monkeypatch):
    """The one refusal left for K: sizes PyTorch rejects (a Constraint), before any recording."""
    import symcost.tracing.record

    def no_recording(*a, **k):
        raise AssertionError("recorded before refusing")

    monkeypatch.setattr(symcost.tracing.record, "record", no_recording)
    monkeypatch.setattr(symcost.graph.build, "record", no_recording)
    code = 0
    try:
        main(["eval", "hf:llama", "--set", "H=6", "K=4"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "K must divide H" in err and "K=4" in err and "H=6" in err


BLOCKS = """
from torch import nn


class Net(nn.Module):
    def __init__(self, D, L):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(D, D), nn.ReLU() if i % 2 == 0 else nn.GELU()) for i in range(L))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def build(D: int = 8, L: int = 4):
    return Net(D, L)
"""


def test_blocks_that_differ_pin_L(tmp_path):
    """Blocks alternating ReLU / GELU do not fold: L is pinned at the request, the rest answers."""
    path = tmp_path / "alternating.py"
    path.write_text(BLOCKS)
    rng = random.Random("regimes:alternating")
    sizes = {"B": rng.randint(2, 4), "S": rng.randint(2, 9), "D": rng.randint(2, 12), "L": rng.randint(3, 6)}
    an = symcost.trace(f"{path}:build", sizes=sizes, precision="fp32", use_cache=False)
    assert an.pinned == {"L": sizes["L"]} and "differ" in an.pin_reasons["L"]
    spec = an.spec
    want = measure(spec, sizes)
    got = an.subs(**sizes)
    assert {k: got[k] for k in want} == want
    assert an.subs(**dict(sizes, D=sizes["D"] + 1))["params"] == sizes["L"] * ((sizes["D"] + 1) ** 2 + sizes["D"] + 1)


@pytest.mark.heavy
def test_in_regime_tells_a_power_of_two_head_count_apart():
    """A bloom trace at a power-of-two H holds for other powers of two, not for H = 12 (ALiBi
    slopes of a head count that is not a power of two run other ops): ``in_regime`` says so."""
    an = symcost.trace("hf:bloom", sizes={"H": 8, "D": 4, "L": 2, "V": 40, "B": 2, "S": 5}, precision="fp32", use_cache=False)
    assert "H" in an.symbols and not an.pinned
    assert an.in_regime(H=4, D=6) and not an.in_regime(H=12)


@pytest.mark.heavy
@pytest.mark.parametrize("model_type,config", [
    ("gemma2", {}),  # sliding-window and global layers alternate (layer_types, period 2)
    ("qwen2", {"use_sliding_window": "true", "max_window_layers": "1", "sliding_window": "3"}),
], ids=["gemma2", "qwen2-window"])
def test_layer_type_patterns_fold(capsys, model_type, config):
    """Per-layer attention patterns change a block's mask, not its ops: L folds, and the
    answer at random sizes is PyTorch's."""
    rng = random.Random(f"patterns:{model_type}")
    sizes, config, spec, want = draw_runnable(model_type, rng.choice(K_REGIMES), rng, config)
    out = cli_eval(capsys, f"hf:{model_type}", sizes, config)
    assert "L" in out["symbols"] and "L" not in out["pinned_symbols"]
    assert answered(out) == want, (model_type, sizes)


# ------------------------------------------------------------------------------------------------
# the probe planner on its own (no model): probes obey the regime predicate it is given
def test_probes_stay_in_the_regime_they_are_given():
    from symcost.tracing.fit import plan_probes

    rng = random.Random("planner:regime")
    H = rng.choice((3, 5, 6, 7, 9, 10, 12))  # a head count that is not a power of two
    in_regime = lambda p: p["H"] & (p["H"] - 1) != 0  # noqa: E731 - the "ALiBi" regime
    plan = plan_probes(("B", "S", "H", "D"), lambda v: None, n_random=6, seed=rng.randint(0, 99),
                       accept=in_regime, request={"B": 2, "S": 9, "H": H, "D": 8})
    assert len(plan.points) >= 5 + 4 and all(in_regime(p) for p in plan.points)
    assert len({p["H"] for p in plan.points}) >= 3


def test_a_symbol_no_probe_can_vary_is_unvariable():
    from symcost.tracing.fit import Unvariable, plan_probes

    D = random.Random("planner:pin").choice((64, 96, 128))
    with pytest.raises(Unvariable) as e:
        plan_probes(("B", "S", "H", "D"), lambda v: "D below the rotary dimension" if v["D"] < D else None,
                    n_random=2, accept=lambda p: p["D"] == D, request={"B": 2, "S": 9, "H": 4, "D": D})
    assert e.value.symbol == "D"


def test_probes_keep_the_request_residue():
    from symcost.tracing.fit import plan_probes

    rng = random.Random("planner:residue")
    D = rng.choice((4, 12, 20, 28, 36))  # D = 4 mod 8: a partial rotary int(D/4) that is odd
    plan = plan_probes(("B", "S", "D"), lambda v: None, n_random=6, moduli={"D": 8},
                       request={"B": 2, "S": 9, "D": D})
    assert all(p["D"] % 8 == 4 for p in plan.points) and len({p["D"] for p in plan.points}) >= 3

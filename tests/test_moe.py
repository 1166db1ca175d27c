"""Mixture-of-experts models (issue 10): routing as an explicit assumption, active parameters,
routed FLOPs and memory, checked against independent oracles.

Oracles (no symcost formula involved):

* FLOPs: ``FlopCounterMode`` around one real CPU training step of the model's *own reference*
  experts code (transformers' ``eager`` loop over the experts that were hit, ``torch.where``
  and ``index_add_``; ``graphs/moe.py``'s ``Experts.reference`` loop), with the router's top-k
  forced to the balanced assignment (token n's k-th slot goes to expert (n·R + k) mod E, so every
  expert gets exactly N·R/E slots);
* activations: the bytes ``saved_tensors_hooks`` sees in a real forward of the traced
  implementation (transformers' ``grouped_mm`` experts for hf: models under balanced routing,
  symcost's static-shaped dispatch for ``moe`` and under ``capacity``) under the same forced
  routing;
* parameters: ``sum(p.numel())`` of the real model; active parameters: counted by hand (the
  architecture's formula, or every parameter of the real model with its ``experts.*`` stacks
  counted R/E);
* Mixtral-8x7B's published shape worked out by hand (about 12.9 B active of 46.7 B parameters);
* capacity factor c: the expert part of every count scales by c, derived by hand (FLOPs, saved
  bytes, the peak against torch.profiler, the roofline step-time bound).
"""
from __future__ import annotations

import contextlib
import functools
import random

import pytest
import sympy
import torch
from torch.utils.flop_counter import FlopCounterMode

import symcost
from symcost.frontends import moe
from symcost.passes.moe import slots_per_expert
from symcost.render import report
from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS
from symcost.passes.memory import memory_model

import memory_oracle as oracle

# model -> (config overrides, heavy)
MODELS = {
    "moe": ((), False),
    "hf:mixtral": ((), False),
    "hf:qwen2_moe": ((), True),  # shared expert with its sigmoid gate, qkv biases
    "hf:olmoe": ((), True),  # q/k norms
    "hf:qwen3_moe": ((), True),  # per-head q/k norms, grouped-query attention
}


def _params(heavy_ok=True):
    return [pytest.param(m, marks=pytest.mark.heavy) if heavy else m for m, (_, heavy) in MODELS.items()]


@functools.lru_cache(maxsize=None)
def _capacity_trace(factor: str):
    spec = moe.with_routing(symcost.resolve("moe"), f"capacity={factor}")
    return symcost.trace(spec, precision="fp32")


def _trace(traced, model):
    config = MODELS[model][0]
    # the same cache key as other test files' traced(model, "fp32", "eager")
    return traced(model, "fp32", "eager", config) if config else traced(model, "fp32", "eager")


@contextlib.contextmanager
def balanced_router():
    """Force every router's top-k (a ``torch.topk`` over ``[N, E]`` probabilities) to the
    balanced assignment: token n's k-th choice is expert (n·R + k) mod E, its weight the router's
    probability of that expert (so gradients still reach the router)."""
    with _routed_by(lambda n, e, k, device: (torch.arange(n * k, device=device) % e).view(n, k)):
        yield


@contextlib.contextmanager
def _routed_by(choose):
    """``torch.topk`` over a router's ``[N, E]`` probabilities replaced: the indices
    ``choose(N, E, k, device)`` (``[N, k]``), the values the probabilities at them (so gradients
    still reach the router); every other ``topk`` unchanged."""
    orig = torch.topk

    def topk(x, k, dim=-1, largest=True, sorted=True):
        if x.dim() == 2 and dim in (-1, 1) and x.shape[-1] >= k:
            idx = choose(*x.shape, k, x.device)
            return torch.return_types.topk((x.gather(-1, idx), idx))
        return orig(x, k, dim=dim, largest=largest, sorted=sorted)

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = orig


def sizes_for(an, rng: random.Random, n: int) -> list[dict[str, int]]:
    """``n`` small random sizes (real models are built at them) with E dividing B·S·R (balanced
    routing then gives every expert a whole number of slots), never a probe of the fit, in the
    trace's residue classes (``an.residues``). B >= 2:
    B = 1 is its own regime (traced with B pinned), not the one of these traces."""
    probes = {tuple(sorted((s, p[s]) for s in an.symbols)) for p in an.plan.points}
    out = []
    while len(out) < n:
        v = {"B": rng.randint(2, 3), "S": rng.randint(3, 12), "H": rng.choice((2, 4, 6)),
             "D": rng.choice((4, 6, 8)), "L": rng.randint(1, 3), "V": rng.randint(17, 80),
             "F": rng.randint(6, 30), "E": rng.randint(2, 9), "R": rng.randint(2, 4)}
        v["K"] = rng.choice([k for k in (2, 3) if v["H"] % k == 0 and k < v["H"]] or [1])
        v = {s: v[s] for s in an.symbols}
        full = {**v, **{a: v[b] for a, b in an.spec.tied.items()}}
        if (v["B"] * v["S"] * v["R"]) % v["E"] or tuple(sorted(v.items())) in probes or an.spec.check(full):
            continue
        if any(s in v and v[s] % m != r for s, (m, r) in an.residues.items()):
            continue  # outside the residue class the trace holds in (hf: the grouped experts' 16-byte rows)
        out.append(v)
    return out


def _build(spec, values, reference: bool):
    values = oracle.full_values(spec, values)
    torch.manual_seed(0)
    model = spec.build(values).train()
    if reference:
        if spec.name.startswith("hf:"):
            model.set_experts_implementation("eager")  # transformers' own loop over the experts
        else:
            for m in model.modules():
                if hasattr(m, "reference"):
                    m.reference = True
    return model, values


def step_flops(spec, model, values) -> tuple[int, int]:
    """FlopCounterMode's (forward + loss, backward) FLOPs of one step of ``model`` on CPU at
    ``values``, the router balanced (:func:`balanced_router`)."""
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    with balanced_router():
        with FlopCounterMode(display=False) as fwd:
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def measure_flops(spec, values) -> dict[str, int]:
    """FlopCounterMode (forward + loss, backward) of the reference experts code, balanced router."""
    model, values = _build(spec, values, reference=True)
    f, b = step_flops(spec, model, values)
    return {"flops.forward": f, "flops.backward": b, "flops.train": f + b,
            "params": sum(p.numel() for p in model.parameters())}


def active_by_names(spec, values) -> sympy.Rational:
    """Active parameters counted on the real model: every parameter once, the stacked expert
    weights (``...experts.*``, one slice per expert) R/E of them."""
    model, values = _build(spec, values, reference=False)
    total = sympy.Integer(0)
    for name, p in model.named_parameters():
        share = sympy.Rational(values["R"], values["E"]) if ".experts." in name else 1
        assert ".experts." not in name or p.shape[0] == values["E"], name
        total += share * p.numel()
    return total


def moe_lm_active(v) -> int:
    """graphs/moe.py by hand: embeddings V·M, per layer two RMSNorm gains 2M, attention 4M²,
    router E·M and R of the E SwiGLU experts 3·F·M each; final norm M, lm_head V·M (M = H·D)."""
    M = v["H"] * v["D"]
    return 2 * v["V"] * M + M + v["L"] * (2 * M + 4 * M * M + v["E"] * M + v["R"] * 3 * v["F"] * M)


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", _params())
def test_flops_params_and_active_equal_the_oracles(traced, model):
    an = _trace(traced, model)
    assert an.spec.extra["routing"] == "balanced"
    for v in sizes_for(an, random.Random(f"moe:{model}"), 2):
        want = measure_flops(an.spec, v)
        got = an.subs(**v)
        for k, w in want.items():
            assert got[k] == w, (model, v, k, got[k], w)
        env = {SYMS[k]: x for k, x in oracle.full_values(an.spec, v).items() if k in SYMS}
        active = an.params_active.subs(env)
        assert active == active_by_names(an.spec, v), (model, v)
        if model == "moe":
            assert active == moe_lm_active(v)
        assert (active < got["params"]) == (v["R"] < v["E"])  # R = E: every expert is active


@pytest.mark.parametrize("model", _params())
def test_activations_equal_saved_bytes(traced, model):
    an = _trace(traced, model)
    mm = memory_model(an, "fp32")
    v = sizes_for(an, random.Random(f"moe-mem:{model}"), 1)[0]
    with balanced_router():
        want = oracle.saved_bytes(an.spec, v, "fp32")
    assert mm.components(**v)["activations"] == want, (model, v)


def test_activations_bf16_mixed(traced):
    """The dispatch under autocast (bf16 matmuls on fp32 token states), graphs/moe.py."""
    an = traced("moe", "bf16-mixed")
    v = sizes_for(an, random.Random("moe-mem-bf16"), 1)[0]
    with balanced_router():
        want = oracle.saved_bytes(an.spec, v, "bf16-mixed")
    assert memory_model(an, "bf16-mixed").components(**v)["activations"] == want, v
    # autocast's bf16 copies of the expert weights do not hide which parameters are routed
    assert an.params_active == _trace(traced, "moe").params_active != an.params


def test_slots_per_expert_from_the_graph(traced):
    an = _trace(traced, "moe")
    B, S, R, E = (SYMS[s] for s in "BSRE")
    assert sympy.simplify(slots_per_expert(an) - B * S * R / E) == 0
    js = report.to_json(an, {"B": 2, "S": 8, "E": 4, "R": 2})
    assert js["moe"]["routing"]["model"] == "balanced" and js["moe"]["slots_per_expert"] == 8
    assert js["params_active"] == an.subs(B=2, S=8, E=4, R=2)["params_active"]
    # a fractional N·R/E is the balanced average; the formulas still answer
    assert report.to_json(an, {"B": 1, "S": 7, "E": 4, "R": 2})["moe"]["slots_per_expert"] == 3.5


def test_mixtral_8x7b_published_shape(traced):
    """Mixtral-8x7B (Jiang et al. 2024, Table 1): hidden 4096, FFN 14336, 32 layers, 32 heads of
    128, 8 key/value heads, 8 experts, top-2, vocabulary 32000; 46.7 B parameters, 12.9 B active.
    hf:mixtral's default config is that shape. One sequence of 1024 tokens: B = 1 is its own
    regime, traced with B pinned (as ``symcost report --set B=1`` does); its probes need E to
    divide S·R."""
    an = traced("hf:mixtral", "fp32", "eager", (), (("B", 1),))
    assert an.pinned == {"B": 1}
    v = dict(H=32, D=128, K=8, L=32, V=32000, F=14336, E=8, R=2, B=1, S=1024)
    assert {k: an.spec.defaults[k] for k in v if k not in ("B", "S")} == {k: x for k, x in v.items() if k not in ("B", "S")}
    M, L, N = v["H"] * v["D"], v["L"], v["B"] * v["S"]
    kv = v["K"] * v["D"]
    # matmul weights one token uses per layer: q, o (M×M), k, v (M×kv), router (E×M), and two
    # of the eight SwiGLU experts (3 matrices F×M each); plus the untied lm_head (V×M)
    per_layer = 2 * M * M + 2 * M * kv + v["E"] * M + v["R"] * 3 * v["F"] * M
    p_matmul = L * per_layer + v["V"] * M
    p_active = p_matmul + v["V"] * M + (2 * L + 1) * M  # + token embeddings + RMSNorm gains
    p_total = p_active + L * (v["E"] - v["R"]) * 3 * v["F"] * M
    assert abs(p_active / 1e9 - 12.9) < 0.05 and abs(p_total / 1e9 - 46.7) < 0.05
    # eager attention, no causal halving: QK^T and AV forward (4·B·H·S²·D), four backward
    # matmuls (8·B·H·S²·D) per layer
    attention = 12 * L * v["B"] * v["H"] * v["S"] ** 2 * v["D"]
    hand = 6 * N * p_matmul + attention
    got = an.subs(**v)
    assert got["flops.train"] == hand
    assert got["params"] == p_total and got["params_active"] == p_active
    assert an.params_active_matmul.subs({SYMS[k]: x for k, x in v.items()}) == p_matmul
    # ≈ 6·N·P_active + attention with P_active ≈ 12.9 B; charging all experts is 3.6× too much
    assert abs(got["flops.train"] / (6 * N * 12.9e9 + attention) - 1) < 0.02
    assert 3.4 < (6 * N * (p_total - v["V"] * M) + attention) / got["flops.train"] < 3.8
    P, rem, _ = an.train_simplified()
    assert sympy.expand(rem.subs({SYMS[k]: x for k, x in v.items()}) - attention) == 0
    # the same count from the trace with B a symbol (B >= 2 regime) at 2 × 512 tokens
    b2 = dict(v, B=2, S=512)
    attention2 = 12 * L * 2 * v["H"] * 512 ** 2 * v["D"]
    assert _trace(traced, "hf:mixtral").subs(**b2)["flops.train"] == 6 * N * p_matmul + attention2


def test_capacity_factor_scales_the_expert_part(traced):
    """Capacity c: every expert buffer holds c·N·R/E slots. Against balanced (c = 1), by hand for
    graphs/moe.py (fp32, SwiGLU experts, M = H·D): per slot and layer the experts' matmuls are
    2·M·F (w1) + 2·M·F (w3) + 2·F·M (w2) forward, twice that backward: 18·F·M; the saved
    activations are the slot's buffer row (M), w1 and w3 outputs, silu(w1·x) and the product fed
    to w2 (4·F), 4 bytes each."""
    base = _trace(traced, "moe")
    cap = _capacity_trace("2")
    assert cap.spec.extra["routing"] == "capacity=2"
    B, S, R, E = (SYMS[s] for s in "BSRE")
    assert sympy.simplify(slots_per_expert(cap) - 2 * B * S * R / E) == 0
    v = dict(B=2, S=12, H=4, D=8, L=3, V=40, F=24, E=4, R=2)
    M, slots = v["H"] * v["D"], v["B"] * v["S"] * v["R"]  # N·R slots at c = 1
    extra_slots = (2 - 1) * slots
    fb, fc = base.subs(**v), cap.subs(**v)
    assert fc["flops.train"] - fb["flops.train"] == extra_slots * 18 * v["F"] * M * v["L"]
    assert fc["params"] == fb["params"] and fc["params_active"] == fb["params_active"]
    assert fc["bytes.train"] > fb["bytes.train"]
    # the step-time lower bound (symcost.passes.roofline, H100 SXM at fp32): where the expert matmuls are
    # compute-bound their time grows by exactly the extra 18·F·M FLOPs per slot and layer over the
    # peak, and the step's bound by at least that
    from symcost.hardware import devices
    from symcost.passes import roofline

    dev = devices.get_device("h100-sxm")
    peak = dev.peak_for("fp32")[0]
    w = dict(B=8, S=512, H=8, D=64, L=2, V=1000, F=1024, E=8, R=2)
    rb, rc = roofline.roofline(base, dev, w), roofline.roofline(cap, dev, w)

    def expert_matmul_seconds(r):
        nodes = [n for n in r["nodes"] if ".experts" in n["module"] and n["model_flops"] > 0]
        assert nodes and all(n["bound"] == "compute" for n in nodes)
        return sum(n["seconds"] for n in nodes)

    grow = (2 - 1) * w["B"] * w["S"] * w["R"] * 18 * w["F"] * w["H"] * w["D"] * w["L"] / peak
    assert expert_matmul_seconds(rc) - expert_matmul_seconds(rb) == pytest.approx(grow, rel=1e-9)
    assert rc["step_seconds"] - rb["step_seconds"] >= grow * (1 - 1e-9)
    mb, mc = memory_model(base, "fp32"), memory_model(cap, "fp32")
    act_b, act_c = mb.components(**v)["activations"], mc.components(**v)["activations"]
    assert act_c - act_b == extra_slots * 4 * (M + 4 * v["F"]) * v["L"]
    with balanced_router():  # the real padded dispatch saves what the capacity formulas say
        assert act_c == oracle.saved_bytes(cap.spec, v, "fp32")
    # the peak: at activation-dominated sizes (the balanced peak lies at the end of the forward,
    # every block's expert activations live) it grows by at least those c·N·R/E-slot activations;
    # both peaks are within the team's 10 % of torch.profiler's peak of a real step
    v = dict(B=8, S=128, H=2, D=8, L=2, V=20, F=32, E=4, R=2)
    M, slots = v["H"] * v["D"], v["B"] * v["S"] * v["R"]
    grow = (2 - 1) * slots * 4 * (M + 4 * v["F"]) * v["L"]
    assert mc.components(**v)["activations"] - mb.components(**v)["activations"] == grow
    assert "forward" in mb.peak_where(**v)
    assert mc.peak(**v) - mb.peak(**v) >= grow > 0
    for an, mm in ((base, mb), (cap, mc)):
        with balanced_router():
            meas = oracle.step_peak(an.spec, v, "fp32")["peak"]
        assert abs(mm.peak(**v) - meas) <= 0.10 * meas, (an.spec.extra["routing"], mm.peak(**v), meas)
    # a compute-bound step-time bound (FLOPs / peak FLOP/s) grows by the same expert FLOPs
    js = report.to_json(cap, v)
    assert js["moe"]["routing"] == {"model": "capacity", "capacity_factor": 2.0,
                                    "description": moe.parse_routing("capacity=2").describe()}
    assert js["moe"]["slots_per_expert"] == 2 * slots // v["E"]


def test_dense_model_active_equals_all(traced):
    an = traced("cs336-lm", "fp32", "eager")
    assert an.params_active == an.params and an.params_active_matmul == an.params_matmul
    assert an.train_simplified()[0] == an.params_matmul
    js = report.to_json(an, None)
    assert js["moe"] is None and js["params_active"] == js["params"]
    with pytest.raises(SymcostError, match="mixture-of-experts"):
        moe.with_routing(an.spec, "capacity=2")


@pytest.mark.parametrize("text, ok", [
    ("balanced", "balanced"), ("capacity=1.25", "capacity=1.25"), ("capacity:2", "capacity=2"),
    ("capacity", "capacity=1.25"), ("capacity=1", "balanced"), ("capacity=0.5", "capacity=0.5"),
    ("capacity=0", None), ("capacity=-1", None), ("capacity=x", None), ("topk", None),
])
def test_parse_routing(text, ok):
    if ok is None:
        with pytest.raises(SymcostError):
            moe.parse_routing(text)
    else:
        assert moe.parse_routing(text).name == ok


def test_cli_routing_errors(capsys):
    from symcost.cli import main as cli_main

    for args, msg in ((["eval", "moe", "--routing", "capacity=0"], "capacity factor must be a positive number"),
                      (["eval", "mlp", "--routing", "capacity=2"], "mixture-of-experts")):
        with pytest.raises(SystemExit) as e:
            cli_main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_cli_routing_reaches_the_trace(capsys, monkeypatch):
    """``--routing`` changes the spec that is traced (checked without tracing: the stub reports
    the spec it was given) and its models' experts modules dispatch under it."""
    import symcost.graph.build
    from symcost.cli import main as cli_main

    def stub(spec, **kw):
        model = spec.build({**spec.defaults, "L": 1, "V": 17, "H": 2, "D": 4, "F": 6})
        routings = {moe.routing_of(m).name for m in model.modules() if hasattr(m, moe.ROUTING_ATTR)}
        raise SymcostError(f"traced {spec.name} routing={spec.extra['routing']} experts={sorted(routings)}")

    monkeypatch.setattr(symcost.graph.build, "trace", stub)
    for args, want in ((["eval", "moe", "--routing", "capacity=1.5"], "routing=capacity=1.5 experts=['capacity=1.5']"),
                       (["eval", "moe"], "routing=balanced experts=['balanced']")):
        with pytest.raises(SystemExit):
            cli_main(args)
        assert want in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# issue 31, item 1: an inference step reads the weights of the experts its tokens hit
@contextlib.contextmanager
def uniform_router(seed: int):
    """Force every router's top-k (a ``torch.topk`` over ``[N, E]`` probabilities) to uniform random
    routing: each token's R experts are the first R of an independent random permutation of the E
    (every set of R distinct experts equally likely), its weights the router's probabilities of them.

    The routers of a randomly initialised model do not route uniformly: a tiny Mixtral built at
    random sizes sends every token of a decode step to the same two experts in most draws, so the
    test states the routing model symcost assumes by forcing it, and measures what the real
    experts code then reads."""
    g = torch.Generator().manual_seed(seed)
    with _routed_by(lambda n, e, k, device: torch.rand(n, e, generator=g).argsort(-1)[:, :k].to(device)):
        yield


class _ExpertReads(torch.overrides.TorchFunctionMode):
    """Records which expert of which stacked expert parameter ``[E, ...]`` the real experts code
    indexes (transformers' ``eager`` loop reads ``gate_up_proj[e]`` and ``down_proj[e]`` for each
    expert e it visits): ``read`` = {(parameter name, e)}."""

    def __init__(self, stacks: dict):
        super().__init__()
        self.stacks = {id(p): n for n, p in stacks.items()}
        self.read: set[tuple[str, int]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and id(args[0]) in self.stacks:
            self.read.add((self.stacks[id(args[0])], int(args[1])))
        return func(*args, **(kwargs or {}))


def measured_expert_reads(spec, values: dict, trials: int, seed: int):
    """Real decode steps (CPU tensors, random weights, DynamicCache of T tokens, transformers'
    ``eager`` experts loop, :func:`uniform_router`): per step and layer, the distinct experts the
    router selected (the ``top_k_index`` each experts module receives) and the bytes of the
    expert weights the loop read (:class:`_ExpertReads`).

    Returns:
        ``(hits, read_bytes, b, dense)``: ``hits`` the distinct experts per (step, layer),
        ``read_bytes`` the expert-weight bytes read per (step, layer), ``b`` the bytes of one
        expert's weights in one layer, ``dense`` the bytes of every other parameter but the token
        embedding table (a lookup reads one row per token).
    """
    from transformers import DynamicCache

    torch.manual_seed(seed)
    model = spec.build(values).eval()
    with torch.no_grad():  # the builder may leave weights uninitialised: random, finite ones
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    model.set_experts_implementation("eager")  # transformers' own loop over the experts hit
    E, B, T, V = values["E"], values["B"], values["T"], values["V"]
    stacks = {n: p for n, p in model.named_parameters() if ".experts." in n}
    assert stacks and all(p.shape[0] == E for p in stacks.values())
    layers = sorted({n.split(".experts.")[0] for n in stacks})
    b = sum(p[0].numel() * p.element_size() for n, p in stacks.items() if n.startswith(layers[0] + "."))
    table = model.get_input_embeddings().weight
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n not in stacks and p is not table)
    selected: list[int] = []
    for m in model.modules():
        if moe._is_hf_experts(m):
            m.register_forward_pre_hook(lambda mod, args: selected.append(int(args[1].unique().numel())) and None)
    hits, read_bytes = [], []
    gen = torch.Generator().manual_seed(seed)
    for t in range(trials):
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), uniform_router(seed * 1000 + t):
            model(input_ids=torch.randint(0, V, (B, T), generator=gen), use_cache=True, past_key_values=cache)
            selected.clear()
            reads = _ExpertReads(stacks)
            with reads:
                model(input_ids=torch.randint(0, V, (B, 1), generator=gen), use_cache=True, past_key_values=cache)
        assert len(selected) == len(layers)
        for i, layer in enumerate(layers):
            mine = {(n, e) for n, e in reads.read if n.startswith(layer + ".")}
            got = sum(stacks[n][e].numel() * stacks[n][e].element_size() for n, e in mine)
            assert got == selected[i] * b  # the loop reads exactly the experts the router hit
            hits.append(selected[i])
            read_bytes.append(got)
    return hits, read_bytes, b, dense


# hf:qwen3_moe runs the same path (its own experts code, the same routed stacks); it passed when
# the test was written and is left out of the suite: 205 s on CI's two cores against its 20 minutes
DECODE_MODELS = [pytest.param("hf:mixtral")]


@pytest.mark.parametrize("model", DECODE_MODELS)
def test_decode_reads_the_experts_hit(model):
    """A decode step of B tokens reads the weights of the distinct experts they hit, per layer
    E·(1 − (1 − R/E)^B) in expectation under uniform routing: symcost's per-layer expert-weight
    bytes (the aggregate's weight bytes less the other parameters', and the per-op roofline's
    bytes less those of the all-E roofline) against the bytes the real experts loop reads, at
    random B, E, R (B·R below and above E). Exactly R experts at B = 1; otherwise the mean of n
    layer-steps within 5 standard errors, the variance at most E·q·(1 − q) (q the chance an expert
    is hit: the hit indicators of the experts are negatively associated, so their sum varies no
    more than independent ones). Never above min(E, B·R). The compute-bound crossing follows."""
    from test_inference import full_values, traced_step  # (test_inference imports this module)

    from symcost.hardware import devices as dv
    from symcost.passes import inference
    from symcost.passes.roofline import roofline

    an = traced_step(model, "decode")
    dev = dv.get_device("h100")
    rng = random.Random(f"decode-hits:{model}")
    cases = [dict(B=1, E=rng.randint(4, 10), R=2)]
    while len(cases) < 4:
        E = rng.randint(4, 12)
        R = rng.randint(2, min(4, E - 1))
        B = rng.randint(2, 7)
        if (B * R < E) == (len(cases) % 2 == 1):  # alternate B·R < E and B·R >= E
            cases.append(dict(B=B, E=E, R=R))
    for case in cases:
        # F a multiple of 8: hf: traces hold in F's residue class mod 8 (the grouped experts' 16-byte rows)
        v = {"H": 4, "D": 8, "L": 2, "V": rng.randint(30, 60), "F": 8 * rng.randint(1, 3), "K": 2, "M": 32,
             "T": rng.randint(2, 9), **case}
        v = {s: x for s, x in v.items() if s in an.symbols}
        full = full_values(an, v)
        E, R, B, L = v["E"], v["R"], v["B"], full["L"]
        trials = 1 if B == 1 else 60
        hits, read, b, dense = measured_expert_reads(an.spec, full, trials, seed=rng.randint(0, 10**6))
        assert max(hits) <= min(E, B * R) and min(hits) >= R, (case, hits)
        # symcost, the aggregate: weight bytes less every parameter that is not a routed expert
        W = float(inference.weight_bytes(an).xreplace(an.bind(**v)))
        agg = (W - dense) / L
        # symcost, per op: the all-E roofline's bytes less the decode roofline's = L·(E·b − its bytes)
        all_e = sum(n["repeat"] * n["fused_bytes"] for n in roofline(an, dev, v, with_formulas=False)["nodes"])
        d = inference.decode(an, dev, v, with_crossing=False)
        per_op = E * b - (all_e - d["roofline"]["bytes"]) / L
        mean = sum(read) / len(read)
        q = 1 - (1 - R / E) ** B
        # 5 standard errors (none at B = 1: every token hits exactly R), + the bytes' integer rounding
        tol = (5 * b * (E * q * (1 - q) / len(read)) ** 0.5 if B > 1 else 0) + 2
        assert agg <= min(E, B * R) * b + 2 and per_op <= min(E, B * R) * b + 2, case
        if B == 1:
            assert set(hits) == {R} and abs(agg - R * b) <= 2 and abs(per_op - R * b) <= 2, (case, agg, per_op)
        assert abs(agg - mean) <= tol and abs(per_op - mean) <= tol, (case, agg / b, per_op / b, mean / b, tol / b)
    # the batch where the aggregate turns compute-bound (short context: the weights dominate)
    v = {"H": 4, "D": 8, "L": 2, "V": 40, "F": 16, "K": 2, "M": 32, "T": 2, "E": 8, "R": 2, "B": 1}
    v = {s: x for s, x in v.items() if s in an.symbols}
    small = dv.Device("test", "test", {"fp32": 2e9}, 1e9)  # ridge 2 FLOP/byte: a crossing at a small B
    c = inference.decode(an, small, v)["crossing"]
    assert c["value"] is not None, c
    lo, hi = int(c["value"]), int(c["value"]) + 1
    below = inference.decode(an, small, {**v, "B": lo}, with_crossing=False)["aggregate"]
    above = inference.decode(an, small, {**v, "B": hi}, with_crossing=False)["aggregate"]
    assert below["bound"] == "memory" and above["bound"] == "compute", (c, below, above)


@pytest.mark.heavy
def test_mixtral_8x7b_decode_reads_the_active_parameters():
    """Mixtral-8x7B (tests/data/configs, bf16) decoding one sequence at context 4096 reads about
    its active parameters per token: the weight bytes are exactly 2 bytes × (every parameter with
    each expert stack counted R/E = 2/8, less the token embedding table, which a lookup reads one
    row of), counted on the model transformers builds from the file on the meta device; the time
    per output token on an H100 (a StaticCache, as ``serve``) is within 3% of (those bytes + the KV
    cache's, 2·K·D·L·4096 elements) / bandwidth. Charging all 8 experts read 3.6× the bytes."""
    import transformers
    from test_inference import traced_step  # (test_inference imports this module)

    from symcost.hardware import devices as dv
    from symcost.passes import inference

    path = "tests/data/configs/mixtral-8x7b.json"
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    E, R = cfg.num_local_experts, cfg.num_experts_per_tok
    table = model.get_input_embeddings().weight
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and p is not table)
    assert experts and all(p.shape[0] == E for n, p in model.named_parameters() if ".experts." in n)
    active_bytes = 2 * (others + experts * R // E)
    assert 3.4 < 2 * (others + experts) / active_bytes < 3.8
    an = traced_step(path, "decode", "static", precision="bf16-true", attention="sdpa")  # serve's defaults
    dev = dv.get_device("h100")
    d = inference.decode(an, dev, {"B": 1, "T": 4095})
    assert d["aggregate"]["weight_bytes"] == active_bytes
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_key_value_heads * head_dim * cfg.num_hidden_layers * 4096 * 2
    assert d["aggregate"]["kv_bytes"] == kv
    assert abs(d["seconds_per_token"] / ((active_bytes + kv) / dev.bandwidth) - 1) < 0.03, d["seconds_per_token"]


def test_capacity_below_one_drops_the_slots_beyond_it(traced):
    """Capacity c = 1/2 (GShard's and Switch Transformer's token dropping: each expert's N·R/E
    balanced slots capped at c·N·R/E): the trace's FLOPs equal FlopCounterMode of a real CPU step
    of the same dispatch (the router balanced, so half of every expert's slots overflow into the
    spare row), its saved bytes ``saved_tensors_hooks``' of that step, at random sizes; and by hand
    the expert part is half the balanced one (c·N·R slots of 18·F·M FLOPs per layer, graphs/moe.py's
    SwiGLU experts in fp32)."""
    cap = _capacity_trace("0.5")
    assert cap.spec.extra["routing"] == "capacity=0.5" and "dropped" in cap.spec.extra["routing_description"]
    B, S, R, E = (SYMS[s] for s in "BSRE")
    assert sympy.simplify(slots_per_expert(cap) - B * S * R / (2 * E)) == 0
    rng = random.Random(2801)
    for _ in range(2):
        e = rng.choice((2, 4))
        v = dict(B=2, S=e * rng.randint(2, 4), H=rng.choice((2, 4)), D=rng.choice((4, 8)), L=rng.randint(1, 2),
                 V=rng.randint(20, 60), F=rng.randint(6, 24), E=e, R=2)
        model, values = _build(cap.spec, v, reference=False)
        f, b = step_flops(cap.spec, model, values)
        got = cap.subs(**v)
        assert (got["flops.forward"], got["flops.train"]) == (f, f + b), v
        with balanced_router():
            assert memory_model(cap, "fp32").components(**v)["activations"] == oracle.saved_bytes(cap.spec, v, "fp32")
        M, slots = v["H"] * v["D"], v["B"] * v["S"] * v["R"]
        base = _trace(traced, "moe").subs(**v)  # (balanced: every slot through its expert)
        assert base["flops.train"] - got["flops.train"] == slots // 2 * 18 * v["F"] * M * v["L"]

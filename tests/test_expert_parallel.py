"""Expert parallelism (issue 28 item 1): ``--ep N`` traces one rank of the built-in ``moe`` with
its experts sharded over N ranks and its tokens dispatched and combined by ``all_to_all_single``
(symcost/frontends/expert_parallel.py), EP a symbol of the formulas.

Oracles, independent of symcost's recorder, rules and fit (tests/data/ep_rank.py ``measure``):
PyTorch running the same expert-parallel step, its routers forced to the balanced assignment,
with FLOPs by ``torch.utils.flop_counter``'s registry, ``saved_tensors_hooks``, the all-to-alls
seen at dispatch with (n-1)/n of their input typed by hand (nccl-tests), the local shards'
elements, and MemTracker's peak: rank 0 on the fake process group at random sizes, and a real
``torchrun`` + gloo run of 2 ranks on this CPU.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import random
import subprocess
import sys
from fractions import Fraction

import pytest

import symcost

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from ep_rank import build, measure  # noqa: E402

PRECISION = "fp32"
#: the traced request (a small model; formulas evaluated at other sizes of its regime)
REQUEST = {"EP": 4, "B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}


@functools.lru_cache(maxsize=None)
def _trace():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("moe"), layout=Layout(ep=True), sizes=REQUEST, precision=PRECISION)


def _draw(rng: random.Random, ep_choices=(2, 4)) -> dict:
    """Random sizes of the traced regime: E a multiple of 8 (the residue the trace keeps: EP of
    2, 4, 8 divides it) with E/EP >= 2 experts per rank, B·S·R a multiple of E (balanced routing
    gives every expert whole slots), R >= 2."""
    ep = rng.choice(ep_choices)
    e = rng.choice((8, 16))
    r = rng.choice((2, 3))
    s = e * rng.randint(1, 2)
    return {"EP": ep, "E": e, "R": r, "B": rng.randint(1, 3), "S": s, "H": 2 * rng.randint(1, 3),
            "D": 4 * rng.randint(1, 3), "L": rng.randint(1, 3), "V": rng.randint(40, 120), "F": 8 * rng.randint(1, 4)}


def _check(an, v: dict, got: dict, what) -> None:
    env = an.bind(**v)
    assert int(an.flops("train").subs(env)) == got["flops"], what
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], what
    assert Fraction(str(an.comm_bytes("all_to_all").subs(env))) == Fraction(got["comm"]["all_to_all"]) > 0, what
    assert Fraction(got["comm"]["other"]) == 0 and an.comm_bytes("total") == an.comm_bytes("all_to_all"), what
    assert int(an.params_shard.subs(env)) == got["shard"], what


def test_ep_is_a_symbol_and_divides_only_the_experts():
    """EP is a symbol (not pinned); the rank holds E/EP of each stacked expert weight and every
    dense parameter whole; the all-to-all bytes per rank are (EP-1)/EP of four N·R·M exchanges
    per layer (dispatch and combine, forward and backward) plus the [E] int64 split-size
    exchange, by hand."""
    import sympy

    from symcost.passes.expert_parallel import expert_params
    from symcost.tracing.fit import SYMS

    an = _trace()
    assert "EP" in an.symbols and not an.pinned, an.pinned
    B, S, H, D, L, E, R, F, EP = (SYMS[k] for k in ("B", "S", "H", "D", "L", "E", "R", "F", "EP"))
    whole, rank = expert_params(an)
    assert sympy.expand(whole - 3 * E * F * H * D * L) == 0
    assert sympy.expand(rank - whole / EP) == 0
    assert sympy.expand(an.params - an.params_shard - whole * (1 - 1 / EP)) == 0
    # a token uses R of the E experts: found from the rank's GEMMs over its E/EP experts
    assert sympy.expand(an.params_active - (an.params - whole + whole * R / E)) == 0
    per_layer = 4 * 4 * B * S * R * H * D + 8 * E  # fp32 token exchanges, int64 counts
    assert sympy.expand(an.comm_bytes("all_to_all") - L * per_layer * (EP - 1) / EP) == 0


def test_ep_rank_against_pytorch_on_the_fake_group():
    """At random sizes (EP 2 or 4, E/EP 2 or 4 experts per rank): the rank's FLOPs, saved bytes,
    all-to-all bytes and parameter elements equal PyTorch's expert-parallel step on the fake
    group (rank 0, real tensors, the routers balanced); ``report --ep``'s optimizer state (two
    fp32 moments of the rank's elements and torch.optim's 0-d step per parameter tensor) equals
    its AdamW state."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from symcost.frontends.parallel import fake_world
    from symcost.passes.expert_parallel import summary

    an = _trace()
    rng = random.Random(28)
    for _ in range(3):
        v = _draw(rng)
        fake_world(v["EP"])
        model = build(v, init_device_mesh("cpu", (v["EP"],), mesh_dim_names=("ep",))["ep"])
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])))
        _check(an, v, got, v)
        mem = summary(an, PRECISION, sizes=v)["values"]["memory"]
        assert int(mem["optimizer_state"]) == got["optimizer_state"], (v, mem["optimizer_state"])


#: a tiny Qwen3-MoE (tests/test_moe_experts_code.py's), traced under --ep with transformers' experts
QWEN = {"hidden_size": "64", "num_experts": "8", "num_experts_per_tok": "2", "num_hidden_layers": "2",
        "moe_intermediate_size": "32", "num_attention_heads": "4", "num_key_value_heads": "2", "vocab_size": "128"}


@pytest.mark.heavy
def test_hf_qwen3_moe_rank_against_pytorch_on_the_fake_group():
    """transformers' Qwen3-MoE (its grouped_mm experts code on the rank's E/EP weight shards) under
    --ep: EP a symbol; at random sizes (EP 2 or 4, E 8 or 16, the config's widths drawn) the rank's
    FLOPs, saved bytes, all-to-all bytes and parameter elements equal PyTorch running the same
    model's step on the fake group (rank 0, real tensors, the routers balanced)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from symcost.frontends.expert_parallel import apply
    from symcost.frontends.layout import Layout
    from symcost.frontends.parallel import fake_world

    spec = symcost.resolve("hf:qwen3_moe", QWEN, "eager")
    an = symcost.trace(spec, layout=Layout(ep=True), sizes={"EP": 2, "B": 2, "S": 16}, precision=PRECISION)
    assert "EP" in an.symbols and not an.pinned, an.pinned
    rng = random.Random(31)
    for _ in range(2):
        ep, e = rng.choice(((2, 8), (4, 8), (2, 16)))
        # (B >= 2: at B = 1 transformers' shifted labels stay a view of the padded ones, a regime of
        # its own that a trace at B = 2 does not hold)
        v = {**spec.values({}, inputs=False), "EP": ep, "E": e, "R": 2, "B": rng.randint(2, 3), "S": 8 * rng.randint(1, 2),
             "F": 8 * rng.randint(2, 5), "L": rng.randint(1, 2), "V": rng.randint(64, 160)}
        fake_world(ep)
        torch.manual_seed(0)
        model = spec.build(v)
        apply(model, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))["ep"])
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), spec=spec)
        _check(an, v, got, v)


def _launch(tmp_path, nproc: int, *runs: tuple[dict, list[str]]) -> list[list[dict]]:
    """tests/data/ep_rank.py on ``nproc`` gloo ranks, each of ``runs`` (sizes, extra arguments)
    in turn in one launch (its own directory under ``tmp_path``): per run, each rank's JSON."""
    script = os.path.join(os.path.dirname(__file__), "data", "ep_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), OMP_NUM_THREADS="1")
    args = []
    for i, (v, extra) in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        args += (["+"] if i else []) + [str(tmp_path / str(i))] + [str(v[k]) for k in "HDLVFERBS"] + extra
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        script] + args, env=env, capture_output=True, text=True, timeout=300 * len(runs))
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines()
                                        if any(w in line for w in ("Error", "error", "rank", "terminate", "what()")))[-4000:]
    return [[json.loads((tmp_path / str(i) / f"rank{rank}.json").read_text()) for rank in range(nproc)]
            for i in range(len(runs))]


#: the sizes of the 4-rank runs: EP 4 with the model's own routers, and EP 2 × DP 2
#: (REQUEST_DP's H, D, E and DP, defined below)
V_EP4 = _draw(random.Random(4), ep_choices=(4,))


@pytest.fixture(scope="module")
def gloo_4(tmp_path_factory):
    """Both 4-rank runs of this file on the same gloo ranks in one launch (the ranks start and
    join the process group once; each run its own mesh, model and tokens): EP 4 with the model's
    own routers (:data:`V_EP4`) and EP 2 × DP 2 (:data:`V_EP2_DP2`). ``{"ep4": ranks,
    "ep2_dp2": ranks}``."""
    ep4, ep2_dp2 = _launch(tmp_path_factory.mktemp("ep4"), 4, (V_EP4, ["own"]), (V_EP2_DP2, ["2"]))
    return {"ep4": ep4, "ep2_dp2": ep2_dp2}


@pytest.mark.heavy
@pytest.mark.parametrize("nproc, router", [(2, "balanced"), (4, "own")])
def test_real_gloo_ep(tmp_path, request, nproc, router):
    """``torchrun --nproc-per-node 2`` (the routers balanced) and ``4`` (the model's own routers:
    the built-in ``moe``'s fixed capacities C = N·R/E keep every shape whatever they choose, tokens
    over an expert's capacity dropped) with gloo on this CPU, real tensors, each rank its own tokens
    (tests/data/ep_rank.py): each rank's FLOPs, saved bytes, all-to-all bytes and parameter
    elements equal symcost's, and its peak (MemTracker in the run, AdamW for-loop) is within 5% of
    symcost's per-rank peak. (The 4-rank run shares its launch with test_real_gloo_ep2_dp2:
    :func:`gloo_4`.)"""
    from symcost.passes.memory import memory_model

    if nproc == 4:
        v, ranks = V_EP4, request.getfixturevalue("gloo_4")["ep4"]
    else:
        v = _draw(random.Random(nproc), ep_choices=(nproc,))
        ranks = _launch(tmp_path, nproc, (v, [] if router == "balanced" else ["own"]))[0]
    an = _trace()
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank in range(nproc):
        got = ranks[rank]
        assert got["world"] == nproc
        _check(an, v, got, (rank, v))
        assert abs(want - got["memtracker"]) <= 0.05 * got["memtracker"], (rank, want, got["memtracker"], v)


@pytest.mark.heavy
def test_report_mixtral_8x7b_ep8_parameters_per_rank():
    """``report tests/data/configs/mixtral-8x7b.json --ep 8``: the rank's parameter elements and
    its expert parameters equal a count of Mixtral-8x7B built by transformers on the meta device,
    each stacked expert tensor ([E, ...], E = 8) cut to its 1/8 shard, the rest whole; the model's
    46.7 B parameters and the 12.9 B a token uses (R = 2 of the E = 8 experts); all-to-all bytes per rank by hand (fp32 token exchanges: transformers casts
    the tokens to the experts' fp32 weights under bf16-mixed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "mixtral-8x7b.json")
    r = _cli(["report", path, "--ep", "8", "--set", "B=1", "S=512", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    got = json.loads(r.output[r.output.index("{"):])
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    e = cfg.num_local_experts
    rank = experts_rank = active = 0
    for name, p in model.named_parameters():
        stacked = ".experts." in name + "." and p.dim() and p.shape[0] == e
        rank += p.numel() // 8 if stacked else p.numel()
        experts_rank += p.numel() // 8 if stacked else 0
        active += p.numel() * cfg.num_experts_per_tok // e if stacked else p.numel()
    assert got["params"] == sum(p.numel() for p in model.parameters())
    # the parameters a token uses (R of the E experts), found from the rank's E/EP-expert GEMMs
    assert got["params_active"] == active
    assert got["parallel"]["params_rank"] == rank
    assert got["parallel"]["experts"]["params_rank"] == experts_rank > 0
    m, n_tokens, layers = cfg.hidden_size, 512, cfg.num_hidden_layers
    per_layer = 4 * 4 * n_tokens * cfg.num_experts_per_tok * m + 8 * e
    assert got["comm"]["all_to_all"] == layers * per_layer * 7 // 8


#: the traced request of EP under FSDP2 (docs/parallel.md §14.6): DP·EP = 4 ranks, E/EP = 8 experts each
REQUEST_DP = {"DP": 2, "EP": 2, "B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}


@functools.lru_cache(maxsize=None)
def _trace_dp():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("moe"), layout=Layout(ep=True, shard="fsdp"), sizes=REQUEST_DP, precision=PRECISION)


def _check_groups(an, v: dict, got: dict, what) -> None:
    """Per process group: each kind's bytes per rank equal the run's (DP: the dense parameters'
    dp_shard × ep group, DP_expert: the experts' dp_shard group, EP: the all-to-alls')."""
    env = an.bind(**v)
    for g in ("DP", "DP_expert", "EP"):
        for k in ("all_gather", "reduce_scatter", "all_to_all"):
            want = Fraction(str(an.comm_bytes(k, group=g).subs(env)))
            assert want == Fraction(got["by_group"].get(g, {}).get(k, "0")), (what, g, k)
    assert Fraction(got["by_group"]["DP_expert"]["reduce_scatter"]) > 0 and Fraction(got["by_group"]["DP"]["all_gather"]) > 0


@pytest.mark.heavy
def test_ep_under_fsdp_divides_by_dp_and_ep():
    """--ep N --dp M --shard fsdp: DP and EP both symbols; a rank holds P/(DP·EP) parameter
    elements (the dense ones over DP·EP ranks, its E/EP experts over DP); the experts' gradients
    are reduce-scattered over the DP ranks that hold the same experts: (DP-1)/DP of the rank's
    E/EP experts' fp32 gradients, by hand; the all-to-alls are those of --ep alone; the active
    parameters count R of the E experts, by hand."""
    import sympy

    from symcost.tracing.fit import SYMS

    an, alone = _trace_dp(), _trace()
    assert {"DP", "EP"} <= set(an.symbols) and not an.pinned, an.pinned
    B, S, H, D, L, E, R, F, EP, DP = (SYMS[k] for k in ("B", "S", "H", "D", "L", "E", "R", "F", "EP", "DP"))
    assert sympy.expand(an.params_shard - an.params / (DP * EP)) == 0
    experts_local = 3 * E * F * H * D * L / EP  # w1, w3 [E/EP, F, M], w2 [E/EP, M, F] per layer
    rs = an.comm_bytes("reduce_scatter", group="DP_expert")
    assert sympy.expand(rs - 4 * experts_local * (DP - 1) / DP) == 0
    assert sympy.expand(an.comm_bytes("all_to_all", group="EP") - alone.comm_bytes("all_to_all")) == 0
    # 6·N·P's P: a token uses R of the E experts, found from the rank's GEMMs on FSDP2's unsharded experts
    whole = 3 * E * F * H * D * L
    assert sympy.expand(an.params_active - (an.params - whole + whole * R / E)) == 0


@pytest.mark.heavy
def test_ep_under_fsdp_rank_against_pytorch_on_the_fake_group():
    """At random sizes (DP 2 or 4, EP 2 or 4, DP·EP <= E: Shard(0) of the local experts): rank 0's
    FLOPs, saved bytes, parameter elements and each group's all-gather, reduce-scatter and
    all-to-all bytes equal PyTorch's step with FSDP2 applied as torchtitan applies it under EP
    (tests/data/ep_rank.py ``fsdp_as_torchtitan``) on the fake group."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ep_rank import fsdp_as_torchtitan
    from symcost.frontends.parallel import fake_world

    an = _trace_dp()
    rng = random.Random(2828)
    for _ in range(2):
        dp, ep = rng.choice(((2, 2), (2, 4), (4, 2)))
        v = {**_draw(rng, ep_choices=(ep,)), "DP": dp, "E": 16, "H": 4, "D": 8, "V": 16 * rng.randint(3, 8)}
        v["S"] = 16 * rng.randint(1, 2)
        fake_world(dp * ep)
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp_shard", "ep"))
        model = build(v, mesh["ep"])
        flat = fsdp_as_torchtitan(model, mesh)
        groups = {mesh["ep"].get_group().group_name: "EP", mesh["dp_shard"].get_group().group_name: "DP_expert",
                  flat.get_group().group_name: "DP"}
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), groups=groups)
        env = an.bind(**v)
        assert int(an.flops("train").subs(env)) == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
        assert int(an.params_shard.subs(env)) == got["shard"], v
        _check_groups(an, v, got, v)


@pytest.mark.heavy
@pytest.mark.parametrize("experts, pin_ep", [(16, False), (8, True)])
def test_ep_under_fsdp_at_dp1_rank_against_pytorch_on_the_fake_group(experts, pin_ep):
    """``--ep N --dp 1 --shard fsdp``, torchtitan's single-node EP (dp_shard = ep: FSDP2's dense group,
    dp_shard × ep flattened, has the EP group's ranks; the experts' dp_shard group one rank): rank 0's
    FLOPs, saved bytes, parameter elements and each group's all-gather, reduce-scatter and all-to-all
    bytes equal PyTorch's step with FSDP2 applied as torchtitan applies it
    (tests/data/ep_rank.py ``fsdp_as_torchtitan``) on the fake group, at random B, S, L (the model's
    widths pinned, as the request gives them: each trace ~20 s) and EP 2 or 4 (EP a symbol), or EP 2
    pinned with E = 8: every mesh size pinned, the router's 8 rows no multiple of lcm(DP, 4)·lcm(EP, 4)
    = 16 at the request, where no probe passed the FSDP probe check (``tracing.fit.NoProbes``: the
    check is waived, ``frontends.parallel.MESH_PINNED``). Before the fake world of twice the mesh
    the dense all-gathers were labelled EP (the flattened group and the ep group were both the
    world's) and the fit failed ("... measures 0"). DP is pinned at 1 (a size of 1)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ep_rank import fsdp_as_torchtitan
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.frontends.parallel import fake_world

    sizes = dict(REQUEST_DP, DP=1, E=experts)
    pins = {s: "the test's widths" for s in ("H", "D", "V", "F", "E", "R") + (("EP",) if pin_ep else ())}
    an = symcost.trace(resolve("moe"), layout=Layout(ep=True, shard="fsdp"), sizes=sizes, precision=PRECISION,
                       _pins=pins)
    assert an.pinned.get("DP") == 1 and {"B", "S", "L"} | (set() if pin_ep else {"EP"}) <= set(an.symbols), an.pinned
    rng = random.Random(2801)
    for ep in (2,) if pin_ep else (2, 4):
        v = {**{k: sizes[k] for k in pins}, "DP": 1, "EP": ep, "B": rng.randint(1, 3), "S": 16 * rng.randint(1, 2),
             "L": rng.randint(1, 3)}
        # (a world of twice the mesh, so that the ep group and the flattened one are told apart by name:
        # under torchrun with EP ranks they are one group, the bytes the same)
        fake_world(2 * ep)
        mesh = DeviceMesh("cpu", torch.arange(ep).reshape(1, ep), mesh_dim_names=("dp_shard", "ep"))
        model = build(v, mesh["ep"])
        flat = fsdp_as_torchtitan(model, mesh)
        groups = {mesh["ep"].get_group().group_name: "EP", mesh["dp_shard"].get_group().group_name: "DP_expert",
                  flat.get_group().group_name: "DP"}
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), groups=groups)
        env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
        assert int(an.flops("train").subs(env)) == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
        assert int(an.params_shard.subs(env)) == got["shard"], v
        for g in ("DP", "DP_expert", "EP"):
            for k in ("all_gather", "reduce_scatter", "all_to_all"):
                want = Fraction(str(an.comm_bytes(k, group=g).subs(env)))
                assert want == Fraction(got["by_group"].get(g, {}).get(k, "0")), (v, g, k)
        assert Fraction(got["by_group"]["DP"]["all_gather"]) > 0 and Fraction(got["by_group"]["EP"]["all_to_all"]) > 0


#: the sizes of test_real_gloo_ep2_dp2's run (in :func:`gloo_4`)
V_EP2_DP2 = {**REQUEST_DP, "B": 3, "S": 32, "L": 2, "V": 64, "F": 16, "R": 2}


@pytest.mark.heavy
def test_real_gloo_ep2_dp2(gloo_4):
    """``torchrun --nproc-per-node 4`` with gloo on this CPU: EP 2 × DP 2 (the mesh (dp_shard, ep),
    FSDP2 as torchtitan applies it under EP, each rank its own tokens, the routers balanced):
    each rank's FLOPs, saved bytes, parameter elements, all-to-all bytes and each group's
    gradient reduce-scatter and parameter all-gather bytes equal symcost's, and its peak
    (MemTracker, AdamW for-loop) is within 5% of symcost's per-rank peak. (The run shares its
    launch with test_real_gloo_ep's 4-rank run: :func:`gloo_4`.)"""
    from symcost.passes.memory import memory_model

    nproc = 4
    v = V_EP2_DP2
    an = _trace_dp()
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank in range(nproc):
        got = gloo_4["ep2_dp2"][rank]
        assert got["world"] == nproc
        env_ = an.bind(**v)
        assert int(an.flops("train").subs(env_)) == got["flops"], rank
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env_)) == got["saved"], rank
        assert int(an.params_shard.subs(env_)) == got["shard"], rank
        _check_groups(an, v, got, rank)
        assert abs(want - got["memtracker"]) <= 0.05 * got["memtracker"], (rank, want, got["memtracker"], v)


@pytest.mark.heavy
def test_report_qwen3_30b_a3b_dp16_ep16_parameters_per_rank():
    """``report tests/data/configs/qwen3-30b-a3b.json --dp 16 --ep 16 --shard fsdp`` (256 ranks, as
    torchtitan lays them out: DP·EP = 256 > E = 128, so the local experts are Shard(1) over DP): the
    rank's parameter elements equal a count of Qwen3-30B-A3B built by transformers on the meta
    device, cut as PyTorch cuts rank 0's shard: each stacked expert tensor ``[E, a, b]`` to its
    E/16 experts and ceil(a/16) rows of its second dimension, every other parameter to ceil(d0/256)
    rows of its first (``torch.chunk``'s first chunk: the router's 128 rows give rank 0 one)."""
    import math

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "qwen3-30b-a3b.json")
    r = _cli(["report", path, "--ep", "16", "--dp", "16", "--shard", "fsdp", "--set", "B=1", "S=256", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    got = json.loads(r.output[r.output.index("{"):])
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    e, ep, dp = cfg.num_experts, 16, 16
    rank = 0
    for name, p in model.named_parameters():
        if ".experts." in name and p.dim() == 3 and p.shape[0] == e:
            rank += e // ep * -(-p.shape[1] // dp) * p.shape[2]
        else:
            rank += -(-p.shape[0] // (dp * ep)) * math.prod(p.shape[1:])
    assert got["params"] == sum(p.numel() for p in model.parameters())
    assert got["layout"]["experts_shard"] == 1 and got["parallel"]["ep"] == ep and got["parallel"]["dp"] == dp
    assert got["parallel"]["params_rank"] == rank
    assert got["parallel"]["comm_by_group"]["EP"]["all_to_all"] > 0


@pytest.mark.heavy
def test_ep_under_fsdp_step_time_by_group(monkeypatch):
    """``report --ep N --dp M --shard fsdp --gpu`` and ``time``: the step priced per process group
    (passes.parallel.step_time, performance.predict_dp; docs/parallel.md §14.6), closed forms at the
    traced sizes (fp32, b = 4 bytes):

    * the EP group's all-to-alls, by hand from §14.2: forward L·(EP-1)/EP·(2·N·R·M·b + 8·E) (dispatch,
      combine, the int64 counts), backward L·(EP-1)/EP·2·N·R·M·b, N = B·S, M = H·D; over NVLink where
      the EP ranks (consecutive, innermost) share a node, over the network where a node holds one
      device; exposed (bytes / bandwidth on the critical path);
    * with ``--overlap none`` the step = the roofline's compute + every group's bytes / its link
      (FSDP2's DP and DP_expert groups over the network when the DP·EP ranks span nodes);
    * the prediction's EP term: the same bytes / bandwidth plus alpha·(EP-1) per all-to-all (5·L of
      them: counts, dispatch, combine forward; dispatch and combine backward), Hockney's alpha-beta
      (hardware/efficiency.py);
    * ``report --gpu --json`` and ``time --json`` answer with these."""
    import dataclasses
    import json

    from symcost.hardware.devices import get_device
    from symcost.passes.parallel import step_time
    from symcost.passes.performance import predict_dp
    from symcost.passes.roofline import roofline

    an = _trace_dp()
    v = dict(REQUEST_DP)
    sizes = {k: x for k, x in v.items() if k in an.symbols}
    env = an.bind(**sizes)
    ep, L, E, b = v["EP"], v["L"], v["E"], 4
    nrm = v["B"] * v["S"] * v["R"] * v["H"] * v["D"]
    want = {"forward": L * Fraction(ep - 1, ep) * (2 * nrm * b + 8 * E),
            "backward": L * Fraction(ep - 1, ep) * 2 * nrm * b}
    h100 = get_device("h100")
    ic = h100.interconnect
    r = roofline(an, h100, {str(k): x for k, x in env.items()}, with_formulas=False)
    compute = sum(r["per_phase"].get(ph, {}).get("seconds", 0.0) for ph in ("forward", "backward"))
    for per_node, ep_bw, dp_bw in ((2, ic["link_bandwidth"], ic["network_bandwidth"]),
                                   (8, ic["link_bandwidth"], ic["link_bandwidth"]),
                                   (1, ic["network_bandwidth"], ic["network_bandwidth"])):
        st = step_time(an, h100, sizes, "none", devices_per_node=per_node)
        assert st["ranks"] == v["DP"] * ep and st["ep_link_bandwidth"] == ep_bw and st["link_bandwidth"] == dp_bw
        g = st["groups"]
        assert {k: Fraction(x) for k, x in g["EP"]["bytes"].items()} == want, (g["EP"], want)
        assert st["ep_comm"] == {ph: pytest.approx(float(want[ph]) / ep_bw) for ph in want}
        dense = sum(float(an.comm_bytes("total", group=grp).subs(env)) for grp in ("DP", "DP_expert"))
        assert dense > 0 and g["DP"]["bandwidth"] == g["DP_expert"]["bandwidth"] == dp_bw
        assert st["step_seconds"] == pytest.approx(compute + dense / dp_bw + float(sum(want.values())) / ep_bw)
    # Megatron's flex dispatcher (DeepEP / HybridEP, passes/hybrid_ep.py, never by default): a token
    # once per other rank holding one of its experts (one rank per node: all over the network; the
    # EP ranks in one node: over NVLink) where the trace sends a row per (token, expert) pair,
    # R·(EP-1)/EP per token: counted here over every top-R set of E experts
    sets = list(itertools.combinations(range(E), v["R"]))
    dedup = Fraction(sum(len({e // (E // ep) for e in s} - {0}) for s in sets), len(sets))
    for per_node, bw in ((1, ic["network_bandwidth"]), (8, ic["link_bandwidth"])):
        st = step_time(an, h100, sizes, "none", devices_per_node=per_node, dispatcher="hybridep")
        assert st["groups"]["EP"]["dispatcher"] == "hybridep" and 0 < dedup < v["R"] * Fraction(ep - 1, ep)
        assert st["ep_comm"] == {ph: pytest.approx(float(want[ph] * dedup / (v["R"] * Fraction(ep - 1, ep))) / bw)
                                 for ph in want}
    alpha = 1e-3  # (an alpha far above the kernels: the latency term is visible)
    dev = dataclasses.replace(h100, efficiency=dataclasses.replace(h100.efficiency, collective_latency=alpha))
    st = step_time(dev_an := an, dev, sizes, "none", devices_per_node=8)
    pd = predict_dp(dev_an, dev, sizes, "none", devices_per_node=8)
    ep_seconds = float(sum(want.values())) / ic["link_bandwidth"] + 5 * L * (ep - 1) * alpha
    assert sum(pd["exposed"].values()) == pytest.approx(ep_seconds, rel=1e-9)
    assert pd["step_seconds"] > st["step_seconds"] > 0
    # the commands answer (the cached trace stands for the trace; their option checks run)
    from symcost.commands import report as report_cmd, time as time_cmd

    monkeypatch.setattr(report_cmd, "trace_model", lambda *a, **k: (an, sizes))
    monkeypatch.setattr(time_cmd, "trace_model", lambda *a, **k: (an, sizes))
    flags = ["--ep", "2", "--dp", "2", "--shard", "fsdp", "--gpu", "h100", "--precision", PRECISION]
    res = _cli(["report", "moe", *flags, "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    js = json.loads(res.output[res.output.index("{"):])["parallel"]["step"]
    assert js["ep_comm"] == pytest.approx(step_time(an, h100, sizes)["ep_comm"]) and js["predicted"]["step_seconds"] > 0
    res = _cli(["time", "moe", *flags, "--tokens", "1e9", "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    js = json.loads(res.output[res.output.index("{"):])
    reps = v["DP"] * ep  # (every EP rank its own micro-batch)
    assert (js["ranks"], js["global_batch"], js["tokens_per_step"]) == (reps, v["B"] * reps, v["B"] * v["S"] * reps)
    assert js["time.device_hours"] == pytest.approx(js["time.seconds"] * reps / 3600)
    assert js["predicted"]["time.seconds"] > 0
    res = _cli(["report", "moe", *flags])
    assert res.exit_code == 0 and "EP group:" in res.output, res.output[-2000:]


def _cli(args):
    from click.testing import CliRunner

    from symcost.cli import main

    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("args, words", [
    (["report", "moe", "--ep", "3"], "does not divide the E=8 routed experts"),
    (["report", "moe", "--ep", "2", "--fp8", "tensorwise"], "expert parallelism is modelled alone, with --tp"),
    (["report", "moe", "--ep", "2", "--dp", "4", "--dp-replicate", "2", "--shard", "fsdp"],
     "HSDP and CPU offload with EP are not modelled yet"),
    (["report", "cs336-lm", "--ep", "2"], "has none (no symbols E and R)"),
])
def test_ep_refusals_are_one_line(args, words):
    """What --ep cannot run is refused in one line before any trace: an EP that does not divide E,
    --ep with FP8 training or HSDP (not modelled yet; with DDP and ZeRO-1 it runs:
    tests/test_expert_parallel_ddp.py), a dense model."""
    r = _cli(args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_cached_ep_trace_is_not_reused_for_one_expert_per_rank():
    """The trace cache reuses an ``--ep`` analysis at another EP (EP is a free size) but not across
    E/EP = 1, one expert per rank, a regime of its own (the permutes' copies become views)."""
    from symcost.graph.cache import _per_rank_ones

    meta = {"residues": {"E": [8, 0]}}
    assert _per_rank_ones(meta, {"E": 16, "EP": 2}) == _per_rank_ones(meta, {"E": 16, "EP": 8}) == []
    assert _per_rank_ones(meta, {"E": 8, "EP": 8}) == ["E/EP"]

"""Expert parallelism with tensor parallelism (``--ep N --tp M``, docs/parallel.md §14.8):
torchtitan's ``apply_moe_ep_tp`` with experts whole per EP rank, the EP group over the TP groups'
ranks, each TP rank routing N/TP of its micro-batch's tokens (symcost/frontends/expert_parallel_tp.py).

Oracles, independent of symcost's recorder, rules and fit: a real ``torchrun`` + gloo run of
4 ranks (EP 4 × TP 2: two TP groups, each its own tokens, one EP group) measuring the step with
PyTorch's own tools (tests/data/ep_rank.py ``measure``: ``flop_counter``'s registry,
``saved_tensors_hooks``, each collective seen at dispatch with its bus-bandwidth factor typed
there, the local shards' elements, MemTracker's peak), after checking on every rank that the laid
out model's loss and router gradient equal the same model's on one device; formulas by hand; and
DeepSeek-V3's published config against a meta-device count of the rank's shard.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

import symcost

PRECISION = "fp32"
#: the traced request: EP 4 over two TP groups of 2, E/EP = 4 experts per rank
REQUEST = {"EP": 4, "TP": 2, "B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}


@functools.lru_cache(maxsize=None)
def _trace():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("moe"), layout=Layout(ep=True, tp=True), sizes=REQUEST, precision=PRECISION)


@pytest.mark.heavy
def test_ep_tp_formulas_by_hand():
    """EP and TP both symbols (not pinned); each TP rank routes N/TP tokens: the routed experts'
    FLOPs (three GEMMs of 2·(N/TP)·R·M·F, forward and backward) and the all-to-all bytes
    L·(EP-1)/EP·(16·(N/TP)·R·M + 8·E) are --ep's divided by TP (the count exchange aside); the
    router runs on all N tokens (6·N·M·E per layer); the rank holds E/EP of each expert stack, 1/TP
    of the attention projections and head, the router, norms and (its own class) embedding whole; the router's
    gradient (E·M fp32 per layer) is all-reduced over TP."""
    import sympy

    from symcost.tracing.fit import SYMS

    an = _trace()
    assert {"EP", "TP"} <= set(an.symbols) and not an.pinned, an.pinned
    B, S, H, D, L, E, R, F, V, EP, TP = (SYMS[k] for k in ("B", "S", "H", "D", "L", "E", "R", "F", "V", "EP", "TP"))
    M, N = H * D, B * S
    assert sympy.expand(an.comm_bytes("all_to_all", group="EP")
                        - L * (EP - 1) / EP * (16 * N / TP * R * M + 8 * E)) == 0
    flops = an.flops("train")
    assert sympy.expand(flops.coeff(F) - 18 * N * R * M * L / TP) == 0  # the experts, 3 GEMMs × fwd + 2 bwd
    assert sympy.expand(flops.coeff(E) - 6 * N * M * L) == 0  # the router on all N tokens
    want = (4 * M * M / TP + M * E + 3 * E * F * M / EP + 2 * M) * L + M + V * M + V * M / TP  # (its own Embedding class: whole)
    assert sympy.expand(an.params_shard - want) == 0
    # the TP all-reduces include the router's gradient, E·M fp32 per layer at 2(TP-1)/TP
    assert sympy.expand(an.comm_bytes("all_reduce", group="TP").coeff(E) - 8 * M * L * (TP - 1) / TP) == 0


def _run(tmp_path, nproc: int, v: dict, extra: list[str]):
    """``ep_rank.py`` at ``v`` with ``extra`` on ``nproc`` gloo ranks: each rank's JSON."""
    return _launch(tmp_path, nproc, (v, extra))[0]


def _launch(tmp_path, nproc: int, *runs: tuple[dict, list[str]]):
    """``ep_rank.py`` on ``nproc`` gloo ranks, each of ``runs`` (sizes, extra arguments) in turn in
    one launch (its own directory under ``tmp_path``): per run, each rank's JSON."""
    script = os.path.join(os.path.dirname(__file__), "data", "ep_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), OMP_NUM_THREADS="1")
    args = []
    for i, (v, extra) in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        args += (["+"] if i else []) + [str(tmp_path / str(i))] + [str(v[k]) for k in "HDLVFERBS"] + extra
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        script] + args, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines()
                                        if any(w in line for w in ("Error", "error", "rank", "terminate", "what()")))[-4000:]
    return [[json.loads((tmp_path / str(i) / f"rank{rank}.json").read_text()) for rank in range(nproc)]
            for i in range(len(runs))]


#: the built-in ``moe`` of test_real_gloo_ep4_tp2
GLOO_V = {**REQUEST, "B": 3, "S": 16, "V": 64, "F": 16}


@pytest.fixture(scope="module")
def gloo_ep4_tp2(tmp_path_factory):
    """One 4-rank launch of EP 4 × TP 2 for both gloo tests of this file (ranks start and join
    the process group once): the built-in ``moe`` at :data:`GLOO_V`, then the tiny DeepSeek-V3
    at B 2, S 16, each with its own meshes, seeds and tokens. ``{"moe": ranks, "hf": ranks}``."""
    moe, hf = _launch(tmp_path_factory.mktemp("ep4_tp2"), 4, (GLOO_V, ["tp=2"]),
                      ({**REQUEST, "B": 2, "S": 16}, ["tp=2", "hf"]))
    return {"moe": moe, "hf": hf}


@pytest.mark.heavy
def test_real_gloo_ep4_tp2(gloo_ep4_tp2):
    """``torchrun --nproc-per-node 4`` with gloo: EP 4 × TP 2 (ranks {0,1} and {2,3} the TP groups,
    each its own tokens; all four the EP group), the routers balanced. On every rank the laid-out
    model's loss and router gradient equal the same model's on one device (the layout trains what
    one device trains), and the rank's FLOPs, saved bytes, parameter elements, all-to-all bytes over
    EP and all-reduce bytes over TP equal symcost's, its peak within 5% of MemTracker's."""
    from symcost.passes.memory import memory_model

    v, got = GLOO_V, gloo_ep4_tp2["moe"]
    an = _trace()
    env = an.bind(**v)
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank, g in enumerate(got):
        assert g["world"] == 4 and g["checks"]["loss"] < 1e-5 and g["checks"]["router_grad"] < 1e-5, (rank, g["checks"])
        assert int(an.flops("train").subs(env)) == g["flops"], rank
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == g["saved"], rank
        assert int(an.params_shard.subs(env)) == g["shard"], rank
        assert Fraction(g["comm"]["other"]) == 0
        for group, kind in (("EP", "all_to_all"), ("TP", "all_reduce")):
            assert Fraction(str(an.comm_bytes(kind, group=group).subs(env))) == Fraction(g["by_group"][group][kind]) > 0
        assert Fraction(str(an.comm_bytes("total").subs(env))) == sum(
            Fraction(x) for d in g["by_group"].values() for x in d.values())
        assert abs(want - g["memtracker"]) <= 0.05 * g["memtracker"], (rank, want, g["memtracker"])


@pytest.mark.heavy
def test_real_gloo_ep4_tp2_deepseek_v3_trains_as_one_device(gloo_ep4_tp2):
    """A tiny DeepSeek-V3 (transformers' model: MLA attention under transformers' TP plan, a dense
    first layer, a shared expert, the sigmoid router with its correction bias; tests/data/ep_rank.py
    ``TINY_DSV3``) laid out EP 4 × TP 2 on 4 gloo ranks: on every rank the loss, the router's
    gradient (all-reduced over TP) and the rank's rows of the shared expert's gradient (its
    column-parallel up projection) equal the same model's on one device with the TP group's tokens;
    the step's all-to-alls run over EP and its all-reduces over TP."""
    for rank, g in enumerate(gloo_ep4_tp2["hf"]):
        assert g["checks"]["loss"] < 1e-5 and g["checks"]["router_grad"] < 1e-5, (rank, g["checks"])
        assert g["checks"]["shared_grad"] < 1e-5, (rank, g["checks"])
        assert Fraction(g["by_group"]["EP"]["all_to_all"]) > 0 and Fraction(g["by_group"]["TP"]["all_reduce"]) > 0


#: --ep --tp --dp (docs/parallel.md §14.9): EP 2 over one TP group of 2, DP 2 ranks holding the same
#: experts; 4 ranks: TP {0, 1}, {2, 3}; EP the same; DP (dense, DP·EP/TP = 2) and DP_expert (DP = 2)
#: {0, 2}, {1, 3}, four process groups of their own
REQUEST_DP = {"DP": 2, "EP": 2, "TP": 2, "B": 2, "S": 16, "H": 8, "D": 4, "L": 2, "V": 64, "F": 16, "E": 16, "R": 2}


@functools.lru_cache(maxsize=None)
def _trace_dp():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    # (the config sizes pinned at the request: the gloo run is one point; B, S, L and the mesh
    # symbols DP, EP, TP stay symbols)
    pins = {s: "the gloo run's size" for s in ("H", "D", "V", "F", "E", "R")}
    return symcost.trace(resolve("moe"), layout=Layout(ep=True, tp=True, shard="fsdp", experts_shard=0),
                         sizes=REQUEST_DP, precision=PRECISION, _pins=pins)


@pytest.mark.heavy
def test_real_gloo_ep2_tp2_dp2_fsdp(tmp_path):
    """``torchrun --nproc-per-node 4`` with gloo: ``--ep 2 --tp 2 --dp 2 --shard fsdp`` (the mesh
    ``(dp_shard, ep_rest, tp)`` = (2, 1, 2), tests/data/ep_tp_dp_rank.py: EP × TP by symcost's layout,
    FSDP2 written out as torchtitan's ``apply_fsdp`` applies it with etp = 1, each TP group its own
    tokens, the routers balanced). On every rank the loss equals the same model's on one device; the
    rank's FLOPs, saved bytes, parameter elements and each process group's bytes per kind (TP
    all-reduce, EP all-to-all, DP (dense, DP·EP/TP ranks) and DP_expert (DP ranks) all-gather and
    gradient reduce-scatter) equal symcost's, and its peak (MemTracker, AdamW for-loop) is within 5%
    of symcost's. Both gradient groups reduce: the dense gradients over DP, the experts' over
    DP_expert, each a collective node of the graph."""
    from symcost.passes.memory import memory_model

    v = dict(REQUEST_DP)
    script = os.path.join(os.path.dirname(__file__), "data", "ep_tp_dp_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), OMP_NUM_THREADS="1")
    nproc = v["DP"] * v["EP"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        script, str(tmp_path)] + [str(v[k]) for k in "HDLVFERBS"] + [str(v["DP"]), str(v["TP"])],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines()
                                        if any(w in line for w in ("Error", "error", "rank", "terminate", "what()")))[-4000:]
    an = _trace_dp()
    # (TP is pinned at this request: no other TP runs the request's ops with H = 8 and EP = 2)
    assert {"DP", "EP", "B", "L"} <= set(an.symbols), (an.symbols, an.pinned)
    ops = {op.comm[3] for op in an.ops if op.comm is not None and op.comm[0] == "reduce_scatter"}
    assert ops == {"DP", "DP_expert"}, ops  # (the two gradient groups, each a collective node)
    envv = an.bind(**v)
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank in range(nproc):
        g = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert g["world"] == nproc and g["checks"]["loss"] < 1e-5, (rank, g["checks"])
        assert g["ranks"]["DP"] == g["ranks"]["DP_expert"] == [rank % 2, rank % 2 + 2], g["ranks"]
        assert g["ranks"]["TP"] == g["ranks"]["EP"] == [rank // 2 * 2, rank // 2 * 2 + 1], g["ranks"]
        assert int(an.flops("train").subs(envv)) == g["flops"], rank
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(envv)) == g["saved"], rank
        assert int(an.params_shard.subs(envv)) == g["shard"], rank
        assert Fraction(g["comm"]["other"]) == 0
        kinds = {"DP": ("all_gather", "reduce_scatter"), "DP_expert": ("all_gather", "reduce_scatter"),
                 "EP": ("all_to_all",), "TP": ("all_reduce",)}
        assert set(g["by_group"]) == set(kinds), g["by_group"]
        for group, ks in kinds.items():
            assert set(g["by_group"][group]) == set(ks), (group, g["by_group"][group])
            for k in ks:
                assert Fraction(str(an.comm_bytes(k, group=group).subs(envv))) == Fraction(g["by_group"][group][k]) > 0, (
                    rank, group, k)
        assert Fraction(str(an.comm_bytes("total").subs(envv))) == sum(
            Fraction(x) for d in g["by_group"].values() for x in d.values())
        assert abs(want - g["memtracker"]) <= 0.05 * g["memtracker"], (rank, want, g["memtracker"])


def _cli(args):
    from click.testing import CliRunner

    from symcost.cli import main

    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("args, words", [
    (["report", "moe", "--ep", "2", "--tp", "4"], "TP must divide EP"),
    (["report", "moe", "--ep", "4", "--tp", "2", "--sp"], "without sequence parallelism"),
])
def test_ep_tp_refusals_are_one_line(args, words):
    """What --ep --tp does not run is one line before any trace: a TP that does not divide EP (the
    EP group borrows the TP ranks), --sp with both (not modelled yet)."""
    r = _cli(args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.heavy
def test_report_deepseek_v3_ep64_pp8_tp2_parameters_per_rank():
    """``report tests/data/configs/deepseek-v3.json --ep 64 --pp 8 --tp 2`` (DeepSeek-V3's published
    config: MLA, 256 routed experts, top-8, one shared expert, 61 layers of which the first 3 dense;
    512 ranks: 8 stages of 32 TP pairs, one EP group of 64 per stage): every pipeline rank's
    parameter elements equal a count of DeepSeek-V3 built by transformers on the meta device, its
    stage's layers (the even split: 8, 8, 8, 8, 8, 7, 7, 7; the embedding on the first stage, the
    final norm and head on the last) cut as the layout cuts a rank's shard: each routed expert stack
    ``[256, …]`` to its 256/64 experts; over TP = 2 (transformers' ``tp_plan``, read here: colwise
    and rowwise projections, the vocabulary-parallel embedding and head) half of q_b, kv_b and o
    projections, the dense layers' FFNs, the shared experts (torchtitan's apply_moe_ep_tp), the
    embedding and head; whole the router, the norms, q_a and the replicated kv_a (``mla_kv_a_proj``).

    Sized for the suite: the published per-layer shapes at L = 19 (stages of 3, 3, 3, 2, …: the
    first stage holds only the 3 dense blocks, which EP leaves whole), and ``--schedule gpipe
    --microbatches 1``: a rank's parameters do not depend on the schedule or the micro-batches
    (the same stage split and layout), but each rank's peak, which ``report --pp`` computes by
    running the rank's schedule on fake tensors, costs one micro-batch instead of the default
    PP = 8 (1F1B needs m >= PP): 61 CPU-s instead of 92 (2026-12-05, loaded machine). The
    published 61 layers (8, 8, 8, 8, 8, 7, 7, 7) pass the same assertions (run by hand at 1fd5a08:
    12 min 44 s on the loaded 2-core machine, 3 min 50 s CPU; docs/parallel.md §14.8).

    Traced with ``--attention eager``: a rank's parameters do not depend on the attention kernel,
    and under SDPA (CUDA's memory-efficient kernel, whose logsumexp is padded to whole multiples of
    32 positions: no polynomial in S) each stage's check at the requested sizes failed, so each
    stage refitted on twice the probes, failed again and pinned every width before more attempts
    (each stage's trace mostly 'earlier attempts'): 130 CPU-s before, 91 after (2026-12-06)."""
    import re

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "deepseek-v3.json")
    layers = 19
    r = _cli(["report", path, "--ep", "64", "--pp", "8", "--tp", "2", "--schedule", "gpipe", "--microbatches", "1",
              "--attention", "eager", "--set", "B=1", "S=256", f"L={layers}", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    got = json.loads(r.output[r.output.index("{"):])
    cfg = AutoConfig.from_pretrained(path, num_hidden_layers=layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    e, ep, tp, pp = cfg.n_routed_experts, 64, 2, 8
    plan = model.tp_plan
    split = [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]
    start = [sum(split[:s]) for s in range(pp)]
    want = [0] * pp
    for name, p in model.named_parameters():
        n = p.numel()
        if ".mlp.experts." in name and p.shape[0] == e:
            n //= ep
        elif ".mlp.shared_experts." in name or any(
                plan[k] in ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output")
                and re.fullmatch(k.replace(".", r"\.").replace("*", r"\d+"), name.rpartition(".")[0]) for k in plan):
            n //= tp
        m = re.match(r"model\.layers\.(\d+)\.", name)
        stage = (max(s for s in range(pp) if start[s] <= int(m.group(1))) if m else
                 0 if "embed_tokens" in name else pp - 1)
        want[stage] += n
    rows = {row["rank"]: row for row in got["pipeline"]["ranks"]}
    assert [rows[s]["params"] for s in range(pp)] == want


@pytest.mark.heavy
def test_qwen3_30b_a3b_ep16_tp2_dp16_parameters_per_rank():
    """Qwen3-30B-A3B's published config (tests/data/configs/qwen3-30b-a3b.json) under ``--ep 16 --tp 2
    --dp 16 --shard fsdp`` (256 ranks per stage: torchtitan's tp = 2, ep = 16, dp_shard = 128;
    docs/parallel.md §14.9), at L = 2 of its per-layer shapes, traced with the config's sizes and
    the mesh pinned (L the one symbol: with free mesh sizes the fit fails, and with all of them pinned
    no probe passed the FSDP check's lcm(DP, 4)·lcm(EP, 4) = 256 at the request (128 router and q/k-norm
    rows) until ``tracing.fit.NoProbes`` waived it, docs/parallel.md §14.9): rank 0's parameter elements at the request
    (``passes.parallel.padded``, what ``report``'s ``parallel.params_rank`` prints) equal a count of
    Qwen3-30B-A3B built by transformers on the meta device and cut as PyTorch cuts rank 0's shards:
    over TP = 2 by the model's ``tp_plan`` (read here: colwise and vocabulary-parallel rows halved,
    rowwise columns halved; the router, norms and the MoE layer's experts not TP-split), then
    FSDP2's first chunk (``torch.chunk``) of every dense parameter's first dimension over the
    DP·EP/TP = 128 ranks of the dense group (the router's 128 rows: one), and each stacked expert
    tensor ``[E, a, b]`` to its E/EP = 8 experts and ceil(a/16) rows of its second dimension
    (``Shard(1)``: DP·EP = 256 > E = 128, torchtitan's rule)."""
    import math
    import re

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.passes.parallel import padded

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "qwen3-30b-a3b.json")
    layers, e, ep, tp, dp = 2, 128, 16, 2, 16
    spec = resolve(path)
    sizes = {"B": 1, "S": 256, "L": layers, "DP": dp, "EP": ep, "TP": tp}
    pins = {s: "the published config's size" for s in spec.symbols if s != "L"}
    pins.update({s: "the test's mesh" for s in ("DP", "EP", "TP")})
    an = symcost.trace(spec, layout=Layout(ep=True, tp=True, shard="fsdp", experts_shard=1), sizes=sizes,
                       precision="bf16-mixed", _pins=pins)
    assert "L" in an.symbols and an.pinned["DP"] == dp and an.pinned["EP"] == ep, an.pinned
    got = int(padded(an, an.bind(**{k: v for k, v in sizes.items() if k in an.symbols}))["params_shard"])
    cfg = AutoConfig.from_pretrained(path, num_hidden_layers=layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert cfg.num_experts == e
    dense = dp * ep // tp
    plan = model.tp_plan
    rank = 0
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if ".mlp.experts." in name and p.dim() == 3 and shape[0] == e:
            rank += e // ep * -(-shape[1] // dp) * shape[2]
            continue
        style = next((plan[k] for k in plan
                      if re.fullmatch(k.replace(".", r"\.").replace("*", r"\d+"), name.rpartition(".")[0])), None)
        if style in ("colwise", "embedding_rowwise", "colwise_gather_output"):
            shape[0] //= tp
        elif style == "rowwise" and p.dim() == 2:
            shape[1] //= tp
        rank += -(-shape[0] // dense) * math.prod(shape[1:])
    assert got == rank
    env = an.bind(**{k: v for k, v in sizes.items() if k in an.symbols})
    for g in ("DP", "DP_expert", "EP", "TP"):
        assert an.comm_bytes("total", group=g).subs(env) > 0, g



"""``symcost plan`` (symcost/passes/plan.py; docs/parallel.md §13).

One ``--tp`` trace of megatron-gpt at small sizes serves every check (module-level cache). Oracles:
``report --tp``'s per-rank summary (checked against PyTorch in test_tensor_parallel.py) where the
layout is pure TP; the ZeRO paper's model states and nccl-tests' ring factors for DP; PTD-P's
bubble and in-flight counts and ``report --pp``'s traced stages for PP (heavy); a brute-force list
of factorizations for the enumeration; the memory cap for the fit.
"""
from __future__ import annotations

import functools
import itertools
import random
import zlib

import pytest
import sympy

from conftest import run_cli
from symcost.hardware.devices import get_device
from symcost.passes.plan import Layout, Planner, enumerate_layouts, plan, trace_for_plan

PREC = "bf16-true-fp32-master"
SZ = {"H": 8, "D": 8, "L": 4, "V": 64, "S": 16}
ARGS = ["--set", "H=8", "D=8", "L=4", "V=64", "S=16"]


@functools.lru_cache(maxsize=None)
def _an():
    return trace_for_plan("megatron-gpt", SZ, PREC)


def _planner():
    return Planner(_an(), SZ, get_device("a100-80gb"), PREC)


def _rng(name):
    return random.Random(zlib.crc32(name.encode()))


def test_pure_tp_equals_report_tp():
    """dp = pp = m = 1: per-rank model states, activations, TP bytes and FLOPs are report --tp's."""
    from symcost.passes.tensor_parallel import summary

    an, pl = _an(), _planner()
    rng = _rng("pure-tp")
    for _ in range(3):
        t, b = rng.choice((1, 2, 4)), rng.randint(1, 5)
        r = pl.evaluate(Layout(1, t, 1, b, 1, "ddp", "none", "none"))
        v = summary(an, PREC, sizes={**SZ, "B": b, "TP": t})["values"]
        assert r["memory"]["model_states"] == int(v["memory"]["total"])
        assert r["memory"]["activations"] == int(v["memory"]["activations"])
        assert r["comm_bytes"]["tp"] == pytest.approx(float(v["comm"]["total"]), abs=1e-6)
        env = an.bind(**{**SZ, "B": b, "TP": t})
        assert r["flops_rank"] == pytest.approx(int(sympy.sympify(an.flops("train")).xreplace(env)))
        assert r["comm_bytes"]["dp"] == r["comm_bytes"]["pp"] == 0 and r["bubble"] == 0


def test_dp_states_and_bytes_follow_zero_and_ring():
    """Model states per rank: Rajbhandari et al. 2020 Table 1 (2 + 2 + K with K = 12 for
    fp32 master + Adam) over the rank's parameters; DP bytes per step: ring all-reduce of the
    gradients (DDP, ZeRO-1) or all-gather ×2 + reduce-scatter per micro-batch (FSDP). Plus
    torch.optim's 0-d fp32 step counter per parameter tensor, unsharded on every rank (as report
    --dp counts them), the tensors counted on the meta-built model."""
    import torch

    from symcost.frontends.models import resolve

    an, pl = _an(), _planner()
    spec = resolve("megatron-gpt")
    with torch.device("meta"):
        steps = 4 * sum(1 for _ in spec.build(spec.values(SZ)).parameters())
    rng = _rng("dp")
    for _ in range(4):
        d, t, b, m = rng.choice((2, 3, 8, 64)), rng.choice((1, 2, 4)), rng.randint(1, 3), rng.randint(1, 4)
        psi = int(sympy.sympify(an.params_shard).xreplace(an.bind(**{**SZ, "B": b, "TP": t})))
        for shard, states, bytes_ in (
                ("ddp", 16 * psi, 2 * (d - 1) / d * 2 * psi),
                ("zero1", 4 * psi + 12 * psi / d, 2 * (d - 1) / d * 2 * psi),
                ("fsdp", 16 * psi / d, m * (d - 1) / d * (2 + 2 + 2) * psi)):
            r = pl.evaluate(Layout(d, t, 1, b, m, shard, "none", "none"))
            assert r["memory"]["model_states"] == int(states) + steps
            assert r["comm_bytes"]["dp"] == pytest.approx(bytes_)
            assert r["links"]["dp"] == ("node" if d * t <= 8 and 8 % (d * t) == 0 else "network")


def test_hsdp_states_and_bytes_are_the_hsdp_trace():
    """HSDP (dp = R × dp/R): the screen's model states and data-parallel bytes of a one-device-
    stage layout (tp = pp = m = 1) equal those of report's HSDP trace of the same rank
    (``Layout(shard="fsdp", replicate=R)``: FSDP2 over the 2-D mesh on the fake process group,
    itself checked against PyTorch's HSDP in test_hsdp.py): states over the dp/R ranks of
    dp_shard, all-gathers and reduce-scatter over dp_shard, the gradient all-reduce over the R
    of dp_replicate; at random dp, R and micro-batch, sizes FSDP2 does not pad."""
    from symcost.frontends.layout import Layout as Mesh
    from symcost.frontends.models import resolve
    from symcost.passes.parallel import step_counter_bytes, summary

    import symcost

    pl = _planner()
    rng = _rng("hsdp")
    for R in (2, 4):
        an = symcost.trace(resolve("megatron-gpt"), layout=Mesh(shard="fsdp", replicate=R),
                           sizes={**SZ, "DP": 2 * R}, precision=PREC)
        for _ in range(2):
            dp, b = R * rng.choice((2, 4)), rng.randint(1, 3)
            r = pl.evaluate(Layout(dp, 1, 1, b, 1, "hsdp", "none", "none", 1, R))
            sz = {**SZ, "B": b, "DP": dp}
            v = summary(an, PREC, sizes=sz)["values"]
            # (torch.optim's 4-byte step per parameter tensor in both, unsharded: 476b798)
            assert step_counter_bytes(an, "adamw", PREC) != 0
            assert r["memory"]["model_states"] == int(v["memory"]["total"]), (dp, R)
            env = an.bind(**sz)
            rep = float(sympy.sympify(an.comm_bytes("total", group="DP_replicate")).xreplace(env))
            shard = float(sympy.sympify(an.comm_bytes("total", group="DP")).xreplace(env))
            assert rep > 0 and r["comm_bytes"]["dp_replicate"] == pytest.approx(rep, rel=1e-9), (dp, R)
            # dp_shard: the screen's two all-gathers and one reduce-scatter of every parameter per
            # micro-batch are an upper bound by the root's backward all-gather (FSDP2's root keeps
            # its parameters unsharded after the forward: reshard_after_forward=False)
            root = pl.f["params_rest"](b, 1) * pl.pol.param * (dp // R - 1) / (dp // R)
            assert r["comm_bytes"]["dp"] == pytest.approx(shard + root, rel=1e-9), (dp, R)
            # the shard group stays in a node (dp/R ranks), the replicate group spans the mesh
            assert r["links"]["dp"] == ("node" if dp // R <= 8 else "network")
    full = plan(_an(), SZ, get_device("a100-80gb"), 16, 10**12, 16, PREC, shards=("hsdp",), checkpoints=("none",))
    assert {x["layout"]["replicate"] for x in full["layouts"] if x["layout"]["dp"] == 16} == {2, 4, 8}


def test_pp_bubble_and_in_flight_are_ptdp():
    """Bubble (p − 1)/(v·m) and the first rank's micro-batches in flight (1F1B min(p, m), GPipe m):
    Narayanan et al. 2021 §2.2."""
    pl = _planner()
    for p, m, sched in ((2, 4, "1f1b"), (4, 4, "1f1b"), (2, 3, "gpipe"), (4, 9, "1f1b")):
        r = pl.evaluate(Layout(1, 1, p, 1, m, "ddp", "none", sched))
        assert r["bubble"] == pytest.approx((p - 1) / m)
        assert r["in_flight"] == (m if sched == "gpipe" else min(p, m))
    r = pl.evaluate(Layout(1, 1, 2, 1, 4, "ddp", "none", "interleaved-1f1b", 2))
    assert r["bubble"] == pytest.approx(1 / 8)
    assert r["in_flight"] == min(2 * 2 + 2 - 1, 2 * 4) / 2  # Korthikanti et al. 2022 §4.2.3, chunks / v


def _pytorch_interleaved(p, m, v):
    """PyTorch's ScheduleInterleaved1F1B for p ranks, m micro-batches, v stages per rank on a fake
    process group: None if its constructor refuses m, else the most model chunks any rank holds
    (walking its ``pipeline_order``: + at each F, − at each B)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        stages = [PipelineStage(torch.nn.Identity(), s, p * v, torch.device("cpu")) for s in range(0, p * v, p)]
        try:
            sched = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda out, target: out.sum())
        except ValueError:
            return None
        most = 0
        for acts in sched.pipeline_order.values():
            held = peak = 0
            for a in acts:
                kind = a.computation_type.value if a is not None else None
                held += {"F": 1, "B": -1}.get(kind, 0)
                peak = max(peak, held)
            most = max(most, peak)
        return most
    finally:
        dist.destroy_process_group()


def test_interleaved_layouts_are_the_ones_pytorch_runs():
    """plan enumerates the interleaved micro-batch counts PyTorch's constructor accepts (its flex
    rounds: m = 3 or 6 on 4 ranks, not only multiples of PP), and holds as many chunks in flight
    as its action lists do; where PP divides m, the bubble is PTD-P's (PP − 1)/(v·m)."""
    from symcost.frontends.pipeline import schedule_order, simulate

    pl, rng = _planner(), _rng("interleaved")
    cases = {(p, m) for p in (2, 4) for m in range(1, 3 * p + 1) if rng.random() < 0.5} | {(4, 6), (4, 3), (4, 9)}
    for p, m in sorted(cases):
        want = _pytorch_interleaved(p, m, 2)
        got = enumerate_layouts(p, m, 8, 8, schedules=("interleaved-1f1b",), micro_batches=(1,), max_tp=1,
                                shards=("ddp",), checkpoints=("none",))
        assert any(x.pp == p for x in got) == (want is not None), (p, m)
        if want is None:
            continue
        r = pl.evaluate(Layout(1, 1, p, 1, m, "ddp", "none", "interleaved-1f1b", 2))
        assert r["in_flight"] == want / 2, (p, m)
        sim = simulate(schedule_order("interleaved-1f1b", p, m, 2))
        assert r["bubble"] == pytest.approx(sim["bubble"])
        if m % p == 0:
            assert r["bubble"] == pytest.approx((p - 1) / (2 * m))


@pytest.mark.heavy
def test_pp_flops_equal_report_pp():
    """dp = tp = 1: the worst rank's FLOPs are the traced stages' (report --pp): the blocks of one
    stage plus everything outside the blocks (first stage's embedding + last stage's head), and
    its activations in flight are at least the first rank's."""
    from symcost.passes.pipeline import summary

    pl = _planner()
    for p, m in ((2, 4),):
        s = summary("megatron-gpt", p, "1f1b", m, precision=PREC, sizes={**SZ, "B": 2}, peak=False)
        r = pl.evaluate(Layout(1, 1, p, 2, m, "ddp", "none", "1f1b"))
        first, last = s["ranks"][0], s["ranks"][-1]
        # plan's worst rank = L/p blocks + everything outside them (the first stage's embedding and
        # the last stage's head) = first + last − one stage's blocks
        blk = m * pl.f["flops_block"](2, 1) * (SZ["L"] // p)
        assert r["flops_rank"] == pytest.approx(first["flops"] + last["flops"] - blk)
        assert r["in_flight"] == first["in_flight"]
        assert r["memory"]["activations"] >= first["activations"]


def _brute(N, G, L, H, mbs):
    out = set()
    for d, t, p in itertools.product(range(1, N + 1), repeat=3):
        if d * t * p != N or H % t or (t > 1 and H // t < 2) or L % p or G % d:
            continue
        for b in mbs:
            if (G // d) % b:
                continue
            m = G // d // b
            if p > 1 and m < p:
                continue
            for shard in (("ddp", "zero1", "fsdp", "hsdp") if d > 1 else ("ddp",)):
                # (HSDP: every replicate degree R with R · shard = d, both groups of 2 or more)
                for r in ([r for r in range(2, d) if d % r == 0] if shard == "hsdp" else (1,)):
                    for ck in ("none", "full", "optimal", "selective"):
                        out.add((d, t, p, b, m, shard, ck, "1f1b" if p > 1 else "none", 1, r, 1, 1))  # (ep, cp: a dense model, no --cp)
    return out


def test_enumeration_is_every_factorization():
    rng = _rng("enum")
    for _ in range(20):
        N, G = rng.choice((1, 4, 6, 8, 12, 16, 24, 64)), rng.choice((8, 16, 24, 48, 96))
        L, H = rng.choice((2, 4, 6, 12)), rng.choice((4, 8, 12, 16))
        mbs = (1, 2, 4, 8)
        got = [x.key() for x in enumerate_layouts(N, G, L, H, micro_batches=mbs)]
        assert len(got) == len(set(got))
        assert set(got) == _brute(N, G, L, H, mbs)


def test_only_layouts_that_fit_and_fastest_first():
    an = _an()
    rows = []
    for N, G in ((8, 16), (16, 32)):
        # (none and full: an "optimal" row is another layout under another cap, see the next test)
        full = plan(an, SZ, get_device("a100-80gb"), N, 10**12, G, PREC, keep_all=True, checkpoints=("none", "full"))
        mems = sorted(r["memory"]["total"] for r in full["layouts"])
        cap = mems[len(mems) // 2]  # half of them fit
        res = plan(an, SZ, get_device("a100-80gb"), N, cap, G, PREC, keep_all=True, checkpoints=("none", "full"))
        assert res["layouts"] and res["excluded"]
        assert all(r["memory"]["total"] <= cap for r in res["layouts"])
        assert all(r["memory"]["total"] > cap for r in res["excluded"])
        assert len(res["layouts"]) + len(res["excluded"]) == res["considered"] == full["considered"]
        times = [r["step_seconds"] for r in res["layouts"]]
        assert times == sorted(times)
        for r in res["layouts"]:  # MFU = model FLOPs of the global batch / (N · peak · time)
            assert r["mfu"] == pytest.approx(full["model_flops_per_sequence"] * G / (N * full["peak_flops"]
                                                                                   * r["step_seconds"]))
        rows.append(res)
    # the model FLOPs of a sequence: the one-device traced step (TP = 1, B = 1)
    env = an.bind(**{**SZ, "B": 1, "TP": 1})
    assert rows[0]["model_flops_per_sequence"] == int(sympy.sympify(an.flops("train")).xreplace(env))


def test_full_checkpoint_keeps_block_inputs():
    """Full recomputation keeps each block's input (Korthikanti et al. Table 2: 2·s·b·h per layer
    with 16-bit activations) and one block's activations, and adds a forward of the blocks."""
    pl = _planner()
    h, s, b = SZ["H"] * SZ["D"], SZ["S"], 2
    none = pl.evaluate(Layout(1, 2, 1, b, 1, "ddp", "none", "none"))
    full = pl.evaluate(Layout(1, 2, 1, b, 1, "ddp", "full", "none"))
    a = pl.f["a"](b, 2)
    assert none["memory"]["activations"] - full["memory"]["activations"] == \
        pytest.approx((SZ["L"] - 1) * a - SZ["L"] * 2 * s * b * h, abs=1)
    assert full["flops_rank"] > none["flops_rank"]


def test_optimal_checkpoint_is_the_fastest_block_plan_that_fits():
    """``--checkpoint optimal`` checkpoints the fewest whole blocks that fit the cap: against a
    brute force over every k of the stage's blocks (each evaluated as its own plan: k blocks'
    inputs kept, the others' activations, one block recomputed, k block forwards again), at a
    random cap between the none and full plans' memory, its row is the fastest k that fits, and
    the next fewer blocks do not fit."""
    import random

    pl = _planner()
    rng = random.Random(13)
    lay = Layout(1, 2, 1, 2, 1, "ddp", "optimal", "none")
    pl.cap = None
    none = pl.evaluate(Layout(1, 2, 1, 2, 1, "ddp", "none", "none"))
    full = pl.evaluate(Layout(1, 2, 1, 2, 1, "ddp", "full", "none"))
    nb = SZ["L"]
    for _ in range(3):
        pl.cap = rng.randint(full["memory"]["total"], none["memory"]["total"] - 1)
        got = pl.evaluate(lay)
        k = got["layout"]["checkpointed_blocks"]
        # brute force: each k's memory and time from its own parts (x kept for k blocks, a for the rest)
        a, x, out = pl.f["a"](2, 2), pl.f["x"](2, 2), pl.f["outside"](2, 2)
        states = none["memory"]["model_states"]
        fits = [j for j in range(nb + 1) if states + int(a * (nb - j) + x * j + out + (a if j else 0)) <= pl.cap]
        assert k == min(fits), (pl.cap, k, fits)
        assert got["memory"]["total"] <= pl.cap
        if k:
            assert none["step_seconds"] < got["step_seconds"] <= full["step_seconds"]
    pl.cap = None


def test_cli_json_and_errors(capsys):
    _an()
    code, out, err = run_cli(capsys, "plan", "megatron-gpt", "--devices", "8", "--device", "a100-80gb",
                             "--memory", "80GiB", "--global-batch", "16", *ARGS, "--json", "--top", "3",
                             "--trace-top", "0")
    assert code == 0, err
    import json

    js = json.loads(out)
    assert len(js["layouts"]) == 3 and js["fits"] >= 3
    top = js["layouts"][0]
    assert {"layout", "memory", "comm_bytes", "links", "bubble", "mfu", "step_seconds"} <= set(top)
    assert sum(top["comm_by_link"].values()) == pytest.approx(sum(top["comm_bytes"].values()))
    code, out, err = run_cli(capsys, "plan", "megatron-gpt", "--devices", "8", "--device", "a100-80gb",
                             "--memory", "80GiB", "--global-batch", "16", *ARGS, "--trace-top", "0")
    assert code == 0 and "MFU" in out and "fit" in out
    # nothing fits under the cap: exit status 3, as max-batch (the text says so, JSON has fits 0);
    # 64 blocks: about 3.1M parameters, 16 B each over 8 ranks at best, above 1 MiB everywhere
    DEEP = ["--set", "H=8", "D=8", "L=64", "V=64", "S=16"]
    code, out, err = run_cli(capsys, "plan", "megatron-gpt", "--devices", "8", "--device", "a100-80gb",
                             "--memory", "1MiB", "--global-batch", "16", *DEEP, "--trace-top", "0")
    assert code == 3 and "no layout fits" in out, (code, out, err)
    code, out, err = run_cli(capsys, "plan", "megatron-gpt", "--devices", "8", "--device", "a100-80gb",
                             "--memory", "1MiB", "--global-batch", "16", *DEEP, "--trace-top", "0", "--json")
    assert code == 3 and json.loads(out)["fits"] == 0, (code, err)
    for bad, msg in (
            (["--devices", "8x", "--memory", "80GiB", "--global-batch", "16"], "--devices"),
            (["--devices", "8", "--memory", "80XB", "--global-batch", "16"], "unknown unit"),
            (["--devices", "8", "--memory", "80GiB", "--global-batch", "0"], "--global-batch"),
            (["--devices", "7", "--memory", "80GiB", "--global-batch", "16"], "no layout of 7 devices"),
            (["--devices", "8", "--memory", "80GiB", "--global-batch", "16", "--shard", "zero9"], "--shard"),
            (["--devices", "8", "--memory", "80GiB", "--global-batch", "16", "--trace-top", "-1"], "--trace-top")):
        code, out, err = run_cli(capsys, "plan", "megatron-gpt", "--device", "a100-80gb", *bad, *ARGS)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_cached_trace_gives_the_same_layouts():
    """The trace cache's round trip (Analysis.to_dict / from_dict) evaluates every layout alike."""
    import json

    from symcost.graph.analysis import Analysis

    an = _an()
    back = Analysis.from_dict(json.loads(json.dumps(an.to_dict())))
    dev = get_device("h100-sxm")
    a, b = Planner(an, SZ, dev, PREC), Planner(back, SZ, dev, PREC)
    for lay in enumerate_layouts(8, 16, SZ["L"], SZ["H"], micro_batches=(1, 4))[::7]:
        assert a.evaluate(lay) == b.evaluate(lay)


@pytest.mark.heavy
def test_odd_heads_plan_without_tensor_parallelism():
    """A model whose heads TP = 2 cannot split (odd H) still gets a plan: traced at TP = 1
    (pinned), every layout has tp = 1, and a one-device layout's FLOPs and activations are those
    of the model's own (non-parallel) trace. Where the TP trace exists, a tp whose sharded sizes
    it does not divide (V = 68 at tp = 8) is not offered though H allows it."""
    import symcost
    from symcost.passes import memory

    sz = {"H": 5, "D": 8, "L": 4, "V": 64, "S": 16}
    an = trace_for_plan("megatron-gpt", sz, PREC)
    assert an.pinned.get("TP") == 1
    res = plan(an, sz, get_device("a100-80gb"), 4, 80 * 2**30, 8, PREC)
    assert res["layouts"] and {r["layout"]["tp"] for r in res["layouts"]} == {1}
    plain = symcost.trace("megatron-gpt", sizes=sz, precision=PREC, use_cache=False)
    b = _rng("odd-heads").randint(1, 4)
    r = Planner(an, sz, get_device("a100-80gb"), PREC).evaluate(Layout(1, 1, 1, b, 1, "ddp", "none", "none"))
    env = plain.bind(**{**sz, "B": b})
    assert r["flops_rank"] == pytest.approx(int(sympy.sympify(plain.flops("train")).xreplace(env)))
    mm = memory.memory_model(plain, PREC)
    assert r["memory"]["activations"] == int(sympy.sympify(mm.activations).xreplace(env))
    # V = 68 (the vocabulary-parallel head splits it): tp = 2 and 4 divide it, tp = 8 does not,
    # though H = 16 would allow 8; the probes keep it even (probe_check), and plan, as report
    # --tp 8, takes the uneven vocabulary (rejects: V and TP pinned in that trace,
    # test_odd_vocabulary_plan_has_the_tp_report_answers); F = 4h = 512 still splits over 8
    from symcost.frontends.tensor_parallel import rejects

    from symcost.frontends.layout import Layout as ModelLayout
    from symcost.frontends.models import resolve

    # (the model's tensor-parallel spec, built afresh: _an() may come from the trace cache, whose
    # spec keeps no code; plan resolves it again the same way, _tp_check)
    tspec = ModelLayout(tp=True).spec(resolve("megatron-gpt"))
    check = tspec.probe_check
    vals = {**tspec.values({**SZ, "H": 16, "V": 68}), "B": 1}
    assert check({**vals, "TP": 8}) and not check({**vals, "TP": 4})
    tps = {x.tp for x in enumerate_layouts(8, 8, 4, 16, tp_ok=lambda t: not check({**vals, "TP": t}))}
    assert tps == {1, 2, 4}
    assert rejects(tspec.probe_check, {**vals, "TP": 8}) is None
    assert rejects(tspec.probe_check, {**vals, "TP": 8}, "megatron-bf16")  # (Megatron pads V: report refuses)
    tps = {x.tp for x in enumerate_layouts(8, 8, 4, 16, tp_ok=lambda t: not rejects(tspec.probe_check, {**vals, "TP": t}))}
    assert tps == {1, 2, 4, 8}


@pytest.mark.heavy
def test_odd_vocabulary_plan_has_the_tp_report_answers():
    """V = 63, which no TP > 1 divides: report --tp 2 answers it (DTensor's Shard(0) holds ⌈V/TP⌉
    rows on rank 0; V and TP pinned, test_tensor_parallel.py checks it against PyTorch on the fake
    group), and plan now offers tp = 2 the same way (was: traced at TP = 1, tp = 1 only, the probe
    check's even split applied to V). Its pure-TP rows at random B equal report --tp 2's per-rank
    summary on that trace: model states, activations, TP bytes, FLOPs."""
    from symcost.passes.tensor_parallel import summary

    sz = {"H": 8, "D": 8, "L": 4, "V": 63, "S": 16}
    an = trace_for_plan("megatron-gpt", sz, PREC, use_cache=False)
    assert an.pinned == {"V": 63, "TP": 2} and "not a multiple of TP" in an.pin_reasons["V"]
    res = plan(an, sz, get_device("a100-80gb"), 2, 80 * 2**30, 4, PREC)
    assert {r["layout"]["tp"] for r in res["layouts"]} == {2}, res["notes"]
    pl = Planner(an, sz, get_device("a100-80gb"), PREC)
    for b in (1, _rng("odd-v").randint(2, 4)):
        r = pl.evaluate(Layout(1, 2, 1, b, 1, "ddp", "none", "none"))
        v = summary(an, PREC, sizes={**sz, "B": b, "TP": 2})["values"]
        assert r["memory"]["model_states"] == int(v["memory"]["total"])
        assert r["memory"]["activations"] == int(v["memory"]["activations"])
        assert r["comm_bytes"]["tp"] == pytest.approx(float(v["comm"]["total"]), abs=1e-6) and r["comm_bytes"]["tp"] > 0
        env = an.bind(**{**sz, "B": b, "TP": 2})
        assert r["flops_rank"] == pytest.approx(int(sympy.sympify(an.flops("train")).xreplace(env)))


@pytest.mark.heavy
def test_four_heads_plan_has_tp1_and_tp2():
    """4 heads: TP = 4 would leave one head per rank, so the TP = 2 trace pins TP (its probes
    cannot vary it). Layouts at tp = 1 are evaluated on a TP = 1 trace (``trace_at``); without
    one they are left out with a note, not evaluated at the pinned TP (the CLI once failed here:
    "TP was traced pinned to 2")."""
    sz = {"H": 4, "D": 8, "L": 4, "V": 64, "S": 16}
    an = trace_for_plan("megatron-gpt", sz, PREC)
    assert an.pinned.get("TP") == 2
    dev = get_device("a100-80gb")
    res = plan(an, sz, dev, 4, 80 * 2**30, 8, PREC, trace_at=lambda tp: trace_for_plan("megatron-gpt", sz, PREC, tp=tp))
    assert {r["layout"]["tp"] for r in res["layouts"]} == {1, 2} and not res["notes"]
    alone = plan(an, sz, dev, 4, 80 * 2**30, 8, PREC)
    assert {r["layout"]["tp"] for r in alone["layouts"]} == {2} and "tp = 1 left out" in alone["notes"][0]
    # a tp = 1 layout's FLOPs are those of the model's own (non-parallel) trace at B = b
    import symcost

    plain = symcost.trace("megatron-gpt", sizes=sz, precision=PREC, use_cache=False)
    row = next(r for r in res["layouts"] if r["layout"]["tp"] == r["layout"]["pp"] == r["layout"]["microbatches"] == 1)
    b = row["layout"]["micro_batch"]
    assert row["flops_rank"] == pytest.approx(int(sympy.sympify(plain.flops("train")).xreplace(plain.bind(**{**sz, "B": b}))))

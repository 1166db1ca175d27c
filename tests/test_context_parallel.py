"""Context parallelism (``--cp N``, issue 28 item 2): one rank's step with the sequence split over
CP ranks and the attention run as PyTorch's ring attention, against PyTorch running the same
step (tests/data/cp_rank.py: ``context_parallel`` over a ``cp`` mesh, ``FlopCounterMode``'s
registry, ``saved_tensors_hooks``, collective bytes at dispatch, ``MemTracker``):

* in-process on the fake process group at random sizes (rank 0 of CP = 2): model FLOPs, saved
  bytes, all-gather and all-to-all bytes, the step's peak;
* real ``torchrun`` + gloo, CP = 2 (heavy): every rank's FLOPs and exchange bytes equal
  symcost's rank; saved bytes equal on rank 0 and, on the last rank, less by its attention
  outputs' copies (below); peaks within 5%; the ring's attention equals one device's;
* real gloo, 4 ranks, FSDP2 over dp_shard × cp (heavy): the same per rank, with FSDP2's
  collectives and the parameter shard.
"""
from __future__ import annotations

import functools
import os
import random
import sys
from fractions import Fraction

import pytest
from click.testing import CliRunner

import symcost
from symcost.cli import main
from symcost.errors import SymcostError
from symcost.frontends.layout import Layout
from symcost.passes.memory import memory_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from cp_rank import config, measure, spec_and_values  # noqa: E402


def _draw(rng: random.Random, cp: int = 2) -> dict:
    H = rng.choice((2, 4, 6))
    K = rng.choice([k for k in (1, 2, H) if H % k == 0 and k < H] or [H])
    return {"H": H, "K": K, "D": rng.choice((8, 12, 16)), "L": 2, "V": rng.randrange(40, 120),
            "F": rng.randrange(24, 100, 4), "B": rng.randrange(2, 4), "S": 2 * cp * rng.randrange(3, 10)}


def _trace(v: dict, rotate: str = "allgather", cp: int = 2):
    """symcost's rank (hf:llama at sizes ``v``, fp32), traced once per process (a layout's trace is
    not in the trace cache)."""
    return _traced(tuple(sorted(v.items())), rotate, cp)


@functools.lru_cache(maxsize=4)
def _traced(v: tuple, rotate: str, cp: int):
    v = dict(v)
    return symcost.trace("hf:llama", config=config(v), layout=Layout(cp=True, cp_rotate=rotate),
                         sizes={"B": v["B"], "S": v["S"], "CP": cp}, precision="fp32")


#: the sizes both the in-process and the gloo check use (one trace)
V = _draw(random.Random(2812))


def _fake_rank0(v: dict, rotate: str, cp: int = 2) -> dict:
    """Rank 0 of ``cp`` on PyTorch's fake process group, real fp32 tensors (cp_rank.measure)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from cp_rank import cp_step
    from symcost.frontends.parallel import fake_world

    fake_world(cp)
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    spec, values = spec_and_values(v)
    torch.manual_seed(0)
    model = spec.build(values)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    ids = kwargs["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
        return measure(model, spec, args, kwargs, opt, cp_step(mesh, rotate))


def _check(an, v: dict, got: dict, what, saved_less: int = 0) -> None:
    env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
    assert int(an.flops("train").subs(env)) == got["flops"], what
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) - saved_less == got["saved"], what
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind, group="CP").subs(env))) == Fraction(want), (kind, what)


def test_cp_rank_matches_pytorch_at_random_sizes():
    """hf:llama (sdpa, grouped-query heads where drawn), fp32, CP = 2 with PyTorch's default
    all-gather rotation: symcost's rank at the traced sizes and at another random B, S equals rank 0
    of PyTorch's context_parallel on the fake group: model FLOPs, saved bytes, all-gather (K/V
    forward and in the backward) and all-to-all (dK/dV) bytes, the step's peak (MemTracker,
    AdamW for-loop)."""
    rng = random.Random(2812)
    v = V
    an = _trace(v)
    assert an.comm_bytes("all_gather", group="CP") != 0 and an.comm_bytes("all_to_all", group="CP") != 0
    mm = memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu")
    for w in (v, dict(v, B=rng.randrange(2, 5), S=4 * rng.randrange(3, 12))):  # (B = 1: a regime of its own)
        got = _fake_rank0(w, "allgather")
        _check(an, w, got, w)
        assert mm.peak(**{k: x for k, x in w.items() if k in an.symbols}) == pytest.approx(got["peak"], rel=0.05), w
    # report --cp's section (passes.context_parallel, render.context_parallel): the same bytes
    from symcost.passes.context_parallel import summary
    from symcost.render.context_parallel import to_json

    js = to_json(summary(an, {k: x for k, x in w.items() if k in an.symbols}))["context_parallel"]
    assert (js["cp"], js["rotate"]) == (2, "allgather")
    for kind, want in got["comm"].items():
        assert sum(js["comm"][kind].values()) == Fraction(want), kind
    assert js["comm"]["all_to_all"]["forward"] == 0 and js["total"] == sum(Fraction(x) for x in got["comm"].values())
    # time/mfu count a rank's tokens: B·S/CP per step
    from symcost.passes.roofline import tokens_compute

    tc = tokens_compute(an, {k: x for k, x in w.items() if k in an.symbols})
    assert (tc["tokens_per_step"], tc["flops.train_step"]) == (w["B"] * w["S"] // 2, got["flops"])


@pytest.mark.heavy
def test_real_gloo_cp2(tmp_path):
    """torchrun, 2 gloo ranks on this CPU, PyTorch's context_parallel with its default rotation
    (all-gather) (cp_rank.py): each rank's model FLOPs, all-gather and all-to-all bytes equal
    symcost's rank at random sizes, and the ring's causal attention equals one device's. Saved bytes: rank 0 equals
    symcost's; the last rank saves L·B·(S/CP)·H·D·4 bytes less: its last ring step merges
    without the round-robin partial update, so its attention output keeps the kernel's [B, S, H, D]
    memory order and o_proj's input is a view of it, where rank 0's output is a concatenation in
    [B, H, S, D] order that o_proj's reshape copies. Peaks within 5% (MemTracker)."""
    from cp_rank import gloo_ranks

    v = V
    an = _trace(v)
    mm = memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu")
    ranks = gloo_ranks(tmp_path, v, "allgather")
    env = {k: x for k, x in v.items() if k in an.symbols}
    for r, got in enumerate(ranks):
        assert got["ring_error"] < 1e-5, (r, got["ring_error"])
        assert got["tokens"] == v["S"] // 2
        less = 0 if r == 0 else v["L"] * v["B"] * (v["S"] // 2) * v["H"] * v["D"] * 4
        _check(an, v, got, (r, v), saved_less=less)
        assert mm.peak(**env) == pytest.approx(got["peak"], rel=0.05), (r, v)


#: the sizes of the CP × FSDP checks (DP = CP = 2)
V_FSDP = _draw(random.Random(2815))
V_FSDP["V"] = 4 * (V_FSDP["V"] // 4)  # (FSDP2 pads a first dimension DP·CP does not divide: not the case drawn here)


@functools.lru_cache(maxsize=1)
def _trace_fsdp():
    """symcost's rank of --dp 2 --shard fsdp --cp 2 (hf:llama at V_FSDP, fp32), once per process."""
    v = V_FSDP
    return symcost.trace("hf:llama", config=config(v), layout=Layout(cp=True, shard="fsdp"),
                         sizes={"B": v["B"], "S": v["S"], "CP": 2, "DP": 2}, precision="fp32")


#: the sizes of the CP × TP check (CP = TP = 2)
_rng = random.Random(2817)
_H = _rng.choice((4, 8))
V_TP = {"H": _H, "K": _rng.choice([k for k in (2, 4) if _H % k == 0]), "D": _rng.choice((8, 16)), "L": 2,
        "V": 2 * _rng.randrange(20, 60), "F": 4 * _rng.randrange(6, 20), "B": 2, "S": 4 * _rng.randrange(3, 6)}


@pytest.fixture(scope="module")
def gloo_4(tmp_path_factory):
    """The CP × FSDP run (:data:`V_FSDP`, mesh (dp_shard 2, cp 2)) and the CP × TP run
    (:data:`V_TP`, mesh (cp 2, tp 2)) on the same 4 gloo ranks in one launch (cp_rank.gloo_runs:
    the ranks start and join the process group once; each run its own meshes, model and tokens):
    ``{"fsdp": ranks, "tp": ranks}``."""
    from cp_rank import gloo_runs

    fsdp, tp = gloo_runs(tmp_path_factory.mktemp("cp4"), 4, (V_FSDP, "allgather", 2, None),
                         (V_TP, "allgather", None, 2))
    return {"fsdp": fsdp, "tp": tp}


@pytest.mark.heavy
def test_real_gloo_fsdp_over_dp_shard_cp(gloo_4):
    """CP × FSDP as torchtitan composes them: 4 gloo ranks on the mesh (dp_shard 2, cp 2),
    fully_shard per block and the root over the flattened dp_shard × cp (cp_rank.py), PyTorch's
    context_parallel over cp. Against symcost's rank (--dp 2 --shard fsdp --cp 2) at random sizes,
    every rank: model FLOPs, FSDP2's all-gather and reduce-scatter bytes over the DP·CP ranks, the
    ring's all-gather and all-to-all bytes over CP, parameter elements held (1/(DP·CP) of each);
    saved bytes equal on the first rank of each cp group and less by the attention outputs' copies
    on the last (test_real_gloo_cp2); peaks within 5% (MemTracker). (The launch is shared with
    test_real_gloo_cp_times_tp: :func:`gloo_4`.)"""
    v = V_FSDP
    an = _trace_fsdp()
    w = dict(v, DP=2)
    env = an.bind(**{k: x for k, x in w.items() if k in an.symbols})
    mm = memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu")
    spec, values = spec_and_values(v)
    block = 4 * sum(p.numel() for p in spec.build_meta(values).model.layers[0].parameters())  # (fp32, unsharded)
    for r, got in enumerate(gloo_4["fsdp"]):
        assert got["ring_error"] < 1e-5 and got["tokens"] == v["S"] // 2, (r, got)
        assert int(an.flops("train").subs(env)) == got["flops"], (r, w)
        less = 0 if r % 2 == 0 else v["L"] * v["B"] * (v["S"] // 2) * v["H"] * v["D"] * 4
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) - less == got["saved"], (r, w)
        for key, want in got["comm"].items():
            g, kind = key.split(".")
            assert Fraction(str(an.comm_bytes(kind, group=g).subs(env))) == Fraction(want), (r, key, w)
        assert int(an.params_shard.subs(env)) == got["shard"], (r, w)
        # the peak within 5%; once seen (1 run in 3, on one rank) a real rank held one more block's
        # unsharded fp32 tensors at its peak: gloo completes FSDP2's collectives in its own thread,
        # and a block's unsharded gradient (or parameters) lives until its reduce-scatter (or
        # all-gather) is waited on, a timing the fake group's instant collectives do not have
        peak = mm.peak(**{k: x for k, x in w.items() if k in an.symbols})
        assert peak == pytest.approx(got["peak"], rel=0.05) or peak + block == pytest.approx(got["peak"], rel=0.05), \
            (r, w, peak, got["peak"], block)


@pytest.mark.heavy
def test_real_gloo_cp_times_tp(gloo_4):
    """CP × TP as torchtitan composes them: 4 gloo ranks on the mesh (cp 2, tp 2) (cp_rank.py
    ``tp=2``), the model's tensor-parallel plan applied over tp by transformers' own code, then
    PyTorch's context_parallel over cp on the attention of the rank's H/TP query and K/TP key/value
    heads. Against symcost's rank (--cp 2 --tp 2) at random sizes, every rank: model FLOPs, the
    ring's all-gather and all-to-all bytes over CP, the plan's all-reduce and all-gather bytes over
    TP, parameter elements held; saved bytes equal on the first rank of each cp group and less by
    the attention outputs' copies (of its H/TP heads) on the last (test_real_gloo_cp2); peaks
    within 5% (MemTracker); the ring's attention equals one device's. (The launch is shared with
    test_real_gloo_fsdp_over_dp_shard_cp: :func:`gloo_4`.)"""
    v = V_TP
    an = symcost.trace("hf:llama", config=config(v), layout=Layout(cp=True, tp=True),
                       sizes={"B": v["B"], "S": v["S"], "CP": 2, "TP": 2}, precision="fp32")
    w = dict(v, TP=2)
    env = an.bind(**{k: x for k, x in w.items() if k in an.symbols})
    mm = memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu")
    peak = mm.peak(**{k: x for k, x in w.items() if k in an.symbols})
    ranks = gloo_4["tp"]
    assert {k for r in ranks for k, x in r["comm"].items() if x != "0"} == {
        "CP.all_gather", "CP.all_to_all", "TP.all_reduce", "TP.all_gather"}
    for r, got in enumerate(ranks):  # (rank r: cp r // 2, tp r % 2)
        assert got["ring_error"] < 1e-5 and got["tokens"] == v["S"] // 2, (r, got)
        assert int(an.flops("train").subs(env)) == got["flops"], (r, w)
        less = 0 if r < 2 else v["L"] * v["B"] * (v["S"] // 2) * (v["H"] // 2) * v["D"] * 4
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) - less == got["saved"], (r, w)
        for key, want in got["comm"].items():
            g, kind = key.split(".")
            assert Fraction(str(an.comm_bytes(kind, group=g).subs(env))) == Fraction(want), (r, key, w)
        assert int(an.params_shard.subs(env)) == got["shard"], (r, w)
        assert peak == pytest.approx(got["peak"], rel=0.05), (r, w, peak, got["peak"])


@pytest.mark.heavy
def test_cp_under_fsdp_step_time_by_group(monkeypatch):
    """``report --dp 2 --shard fsdp --cp 2 --gpu`` and ``time``: FSDP2's collectives over the DP·CP
    group under the overlap model beside the CP ring overlapped with its attention blocks as
    PyTorch schedules it (passes.parallel.step_time, performance.predict_dp; docs/parallel.md §15),
    closed forms with ``--overlap none`` on nodes of 2 devices (the CP pair inside a node's link,
    the DP·CP = 4 ranks over the network):

    * a free network and a link slower than every kernel: the step is the roofline's compute plus,
      per layer, the ring's x/bw - c0 forward and 3·x/bw - b0 - b1 backward (x the rank's K/V bytes
      2·B·K·(S/2)·D·4 by hand, c and b the roofline's attention kernels: test_gpu_ring_time_as_pytorch_schedules_it);
    * a free link: the step is the compute plus FSDP2's bytes over the network, by hand: all-gathers
      of every block forward and backward and of the root once (reshard_after_forward=False), the
      reduce-scatter of every gradient, (n-1)/n of each with n = DP·CP, fp32;
    * the prediction with free links and an alpha far above the kernels: per layer, the forward's
      all-gather waits alpha less block 0, the backward's all-gather and two dK/dV passes 3·alpha
      less both blocks ((CP-1)·alpha a pass, Hockney's alpha-beta; c, b the performance model's blocks);
    * ``report --gpu --json`` and ``time --json`` answer: DP·CP ranks, B·S·DP tokens per step."""
    import dataclasses
    import json

    from symcost.hardware.devices import get_device
    from symcost.passes.parallel import step_time
    from symcost.passes.performance import predict, predict_dp
    from symcost.passes.roofline import roofline

    v = V_FSDP
    an = _trace_fsdp()
    sizes = {k: x for k, x in dict(v, DP=2).items() if k in an.symbols}
    env = an.bind(**sizes)
    h100 = get_device("h100")
    r = roofline(an, h100, {str(k): x for k, x in env.items()}, with_formulas=False)
    compute = sum(r["per_phase"].get(ph, {}).get("seconds", 0.0) for ph in ("forward", "backward"))
    (c0, _), (b0, b1) = ([n["seconds"] / v["L"] for n in r["nodes"] if n["phase"] == ph and "attention" in n["op"]]
                         for ph in ("forward", "backward"))
    x = 2 * v["B"] * v["K"] * (v["S"] // 2) * v["D"] * 4

    def dev(link, network, alpha=None):
        d = dataclasses.replace(h100, interconnect=dict(h100.interconnect, link_bandwidth=link,
                                                        network_bandwidth=network))
        return d if alpha is None else dataclasses.replace(
            d, efficiency=dataclasses.replace(h100.efficiency, collective_latency=alpha))

    st = step_time(an, dev(1.0, 1e30), sizes, "none", devices_per_node=2)
    assert st["cp"]["inside"] and st["cp"]["bandwidth"] == 1.0 and st["ranks"] == 4
    assert st["step_seconds"] == pytest.approx(compute + v["L"] * ((x - c0) + (3 * x - b0 - b1)), rel=1e-9)
    spec, values = spec_and_values(v)
    model = spec.build_meta(values)
    blocks = sum(p.numel() for p in model.model.layers.parameters())
    root = sum(p.numel() for p in model.parameters()) - blocks
    fsdp = Fraction(3, 4) * 4 * (3 * blocks + 2 * root)
    st = step_time(an, dev(1e30, 50e9), sizes, "none", devices_per_node=2)
    assert st["groups"]["DP"]["ranks"] == 4 and Fraction(sum(st["groups"]["DP"]["bytes"].values())) == fsdp
    assert st["step_seconds"] == pytest.approx(compute + float(fsdp) / 50e9, rel=1e-9)
    alpha = 10.0
    p = predict(an, dev(1e30, 1e30, alpha), sizes)
    (c0, _), (b0, b1) = ([n["seconds"] / v["L"] for n in p["nodes"] if n["phase"] == ph and "attention" in n["op"]]
                         for ph in ("forward", "backward"))
    pd = predict_dp(an, dev(1e30, 1e30, alpha), sizes, "none", devices_per_node=2)
    assert sum(pd["exposed"].values()) == pytest.approx(v["L"] * ((alpha - c0) + (3 * alpha - b0 - b1)), rel=1e-9)
    # the commands answer (the cached trace stands for the trace; their option checks run)
    from symcost.commands import report as report_cmd, time as time_cmd

    monkeypatch.setattr(report_cmd, "trace_model", lambda *a, **k: (an, sizes))
    monkeypatch.setattr(time_cmd, "trace_model", lambda *a, **k: (an, sizes))
    flags = ["--dp", "2", "--shard", "fsdp", "--cp", "2", "--gpu", "h100", "--precision", "fp32"]
    res = CliRunner().invoke(main, ["report", "hf:llama", *flags, "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    js = json.loads(res.output[res.output.index("{"):])["parallel"]["step"]
    assert js["cp"]["exposed"] == pytest.approx(step_time(an, h100, sizes)["cp"]["exposed"])
    assert js["predicted"]["step_seconds"] > 0
    res = CliRunner().invoke(main, ["time", "hf:llama", *flags, "--tokens", "1e9", "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    js = json.loads(res.output[res.output.index("{"):])
    assert (js["ranks"], js["tokens_per_step"]) == (4, v["B"] * v["S"] * 2)
    assert js["time.device_hours"] == pytest.approx(js["time.seconds"] * 4 / 3600)
    res = CliRunner().invoke(main, ["report", "hf:llama", *flags])
    assert res.exit_code == 0 and "CP ring:" in res.output, res.output[-2000:]


def test_alltoall_rotation_recorded_as_pytorch_runs_it():
    """set_rotate_method("alltoall"): the forward passes K/V to the next rank CP - 1 times
    (permute_tensor, an all_to_all_single whose rank keeps nothing: its whole input per rank). One
    recording of rank 0 at random sizes, costed by symcost's rules, equals rank 0 of PyTorch's step
    on the fake group: model FLOPs, saved bytes, all-gather (none: the backward's K/V rotation is
    the forward's method too) and all-to-all bytes."""
    from symcost.graph import rules
    from symcost.graph.concrete import concrete_totals, op_view
    from symcost.tracing.record import record

    v = _draw(random.Random(2814))
    spec, values = spec_and_values(v)
    rec = record(Layout(cp=True, cp_rotate="alltoall").spec(spec), dict(values, CP=2), "fp32")
    tot = concrete_totals(rec)
    comm = {"all_gather": Fraction(0), "all_to_all": Fraction(0)}
    for op in rec.ops:
        if rules.classify(op.op) == "comm":
            kind, _, per_rank = rules.comm_volume(op_view(op, [t.shape for t in op.inputs],
                                                          [t.shape for t in op.outputs], op.ints), 2)
            if kind in comm:
                assert op.group == "CP", op.name
                comm[kind] += Fraction(str(per_rank))
    got = _fake_rank0(v, "alltoall")
    assert tot["flops.forward"] + tot["flops.backward"] == got["flops"], v
    assert tot["saved"] == got["saved"], v
    assert comm == {k: Fraction(x) for k, x in got["comm"].items()}, v
    assert comm["all_gather"] == 0 and comm["all_to_all"] > 0


def test_cp_refusals():
    """One line each: --cp-rotate without --cp; --cp with --dp under DDP (not modelled yet; the
    line lists what CP composes with, pipeline stages among them: tests/test_context_parallel_pp.py);
    time --cp --tp without --gpu (a tensor-parallel rank's step is priced per process group only);
    an unknown rotate method; a model whose attention is not SDPA."""
    r = CliRunner().invoke(main, ["report", "hf:llama", "--cp-rotate", "alltoall"])
    assert r.exit_code == 2 and "--cp-rotate needs --cp N" in r.output, r.output
    r = CliRunner().invoke(main, ["report", "hf:llama", "--cp", "2", "--dp", "2"])  # (--shard ddp)
    assert r.exit_code == 2 and "alone or under FSDP2" in r.output and "Traceback" not in r.output, r.output
    assert "pipeline stages (--pp N)" in r.output, r.output
    r = CliRunner().invoke(main, ["time", "hf:llama", "--cp", "2", "--tp", "2", "--tokens", "1e9", "--mfu", "0.4"])
    assert r.exit_code == 2 and "time --tp needs --gpu NAME" in r.output, r.output
    r = CliRunner().invoke(main, ["max-batch", "hf:llama", "--cp", "2", "--gpu", "h100", "--memory", "80GiB"])
    assert r.exit_code == 2 and "--gpu needs --dp N" in r.output, r.output  # (report --cp alone prices the ring)
    with pytest.raises(SymcostError, match="unknown --cp-rotate"):
        Layout(cp=True, cp_rotate="ring")
    with pytest.raises(SymcostError, match="does not call F.scaled_dot_product_attention"):
        symcost.trace("cs336-lm", layout=Layout(cp=True), sizes={"B": 1, "S": 16, "CP": 2, "L": 2}, use_cache=False)


def test_report_6np_counts_the_ranks_tokens(capsys):
    """report --cp: 6·N·P counts the rank's B·S/CP tokens (as ``time --cp``), P a meta-device count
    of the parameters the matmuls use (every nn.Linear weight, a tied one once); the remainder is
    the rank's model FLOPs (FlopCounterMode's in test_cp_rank_matches_pytorch_at_random_sizes)
    less that, in the text, the JSON and the formula."""
    import torch

    from symcost.render.report import human, render, to_json

    an = _trace(V)
    spec, values = spec_and_values(V)
    model = spec.build_meta(values)
    P = sum({id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}.values())
    sizes = {"B": V["B"], "S": V["S"], "CP": 2}
    env = an.bind(**{k: x for k, x in dict(V, CP=2).items() if k in an.symbols})
    total = int(an.flops("train").subs(env))
    sixnp = 6 * (V["B"] * V["S"] // 2) * P
    js = to_json(an, sizes)
    assert js["params_matmul"] == P
    assert js["flops"]["remainder"] == total - sixnp, (V, js["flops"]["remainder"], total - sixnp)
    assert symcost.parse_formula(an.train_simplified_str()).subs(env) == total
    render(an, sizes, table=False, width=250)
    out = capsys.readouterr().out
    assert f"6·N·P = {human(sixnp, 'FLOP')}, remainder = {human(total - sixnp, 'FLOP')}" in out, out
    assert "N = B·S/CP" in out


@pytest.mark.heavy
@pytest.mark.hf
def test_llama_3_8b_at_128k_parameters_per_rank():
    """Issue 28's acceptance: ``report tests/data/configs/llama-3-8b.json --cp 4 --set S=131072``
    and the same with ``--dp 2 --shard fsdp`` and with ``--tp 2`` answer; the parameter elements
    per rank equal a count on the meta device: under CP alone every parameter of the model
    transformers builds from the file; under FSDP2 over dp_shard × cp the local shard rank 0 holds
    after ``fully_shard`` per block and on the root over a (fake) group of DP·CP = 8 ranks, as
    torchtitan applies it; under CP × TP the local shards of transformers' own TP plan over 2
    (fake) ranks."""
    import json

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from cp_rank import tensor_parallel
    from symcost.frontends.parallel import destroy_world, fake_world

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "llama-3-8b.json")

    def meta():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))

    model = meta()
    whole = sum(p.numel() for p in model.parameters())
    fake_world(8)
    try:
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard_cp",))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        shard = sum(p.to_local().numel() for p in model.parameters())
    finally:
        destroy_world()
    fake_world(2)  # (CP × TP: the rank holds the TP plan's shards; CP shards no parameter)
    try:
        model = meta()
        tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        tp_shard = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    finally:
        destroy_world()
    assert tp_shard < whole
    for extra, want in (([], whole), (["--dp", "2", "--shard", "fsdp"], shard), (["--tp", "2"], tp_shard)):
        r = CliRunner().invoke(main, ["report", path, "--cp", "4", "--set", "S=131072", "--json", *extra])
        assert r.exit_code == 0, r.output[-2000:]
        got = json.loads(r.output[r.output.index("{"):])
        assert got["params"] == whole, (extra, got["params"], whole)
        cp = got["context_parallel"]
        assert (cp["cp"], cp["params_rank"]) == (4, want), (extra, cp["params_rank"], want)
        assert cp["total"] > 0


def test_gpu_ring_time_as_pytorch_schedules_it():
    """``report --cp 2 --gpu``: the step is the roofline's compute plus what the ring's exchange
    leaves exposed, PyTorch's schedule (``_templated_ring_attention(_backward)``, all-gather
    rotation; docs/parallel.md §15) derived here by hand for CP = 2 from the rank's K/V bytes
    x = 2·B·K·(S/2)·D·4 (fp32; the per-rank bytes test_cp_rank_matches_pytorch_at_random_sizes
    checks against PyTorch) and the roofline's seconds of the graph's attention kernels (c0, c1
    forward; b0, b1 backward), per layer:

    * a link so fast the exchange is free: nothing exposed, the step is the roofline's compute;
    * a link so slow every kernel waits (x/bw beyond every kernel): forward, the all-gather issued
      before block 0 and waited before block 1, x/bw - c0 exposed; backward, the same all-gather,
      then dK/dV passes of x issued after each block on the same stream: A + 2·g - b0 - b1 with
      A = g = x/bw (the first pass queued behind the all-gather, the second behind the first, the
      last waited after the loop).

    The link: the NVLink figure with CP inside a node, the network's with one device a node."""
    import dataclasses

    from symcost.hardware.devices import get_device
    from symcost.passes.context_parallel import step_time
    from symcost.passes.roofline import roofline

    v = V
    an = _trace(v)
    env = {k: x for k, x in v.items() if k in an.symbols}
    h100 = get_device("h100")
    r = roofline(an, h100, {str(k): x for k, x in an.bind(**env).items()}, with_formulas=False)
    compute = sum(p.get("seconds", 0.0) for ph, p in r["per_phase"].items() if ph in ("forward", "backward"))
    att = {ph: [n["seconds"] / v["L"] for n in r["nodes"] if n["phase"] == ph and "attention" in n["op"]]
           for ph in ("forward", "backward")}
    assert [len(x) for x in att.values()] == [2, 2], att
    (c0, c1), (b0, b1) = att["forward"], att["backward"]
    x = 2 * v["B"] * v["K"] * (v["S"] // 2) * v["D"] * 4
    for bw, want in ((1e30, 0.0), (1.0, v["L"] * ((x - c0) + (3 * x - b0 - b1)))):
        dev = dataclasses.replace(h100, interconnect=dict(h100.interconnect, link_bandwidth=bw))
        st = step_time(an, dev, env)
        assert st["link_bandwidth"] == bw and st["inside"]
        assert st["exposed_comm_seconds"] == pytest.approx(want, rel=1e-9, abs=1e-15), (bw, st)
        assert st["step_seconds"] == pytest.approx(compute + want, rel=1e-9), (bw, st)
        assert st["bytes"] == {"forward": v["L"] * x, "backward": 2 * v["L"] * x + v["L"] * x}
    st = step_time(an, h100, env, devices_per_node=1)
    assert (st["inside"], st["link_bandwidth"]) == (False, h100.interconnect["network_bandwidth"])


@pytest.mark.heavy
def test_report_cp_gpu_json_and_text(capsys):
    """``report hf:llama --cp 2 --gpu h100 --devices-per-node 1 --json``: ``context_parallel.step``
    (the step at least its compute, the ring's bytes the exchange table's, the ring over the network
    with one device a node); the text's line from the same pass."""
    import json

    from symcost.hardware.devices import get_device
    from symcost.passes.context_parallel import step_time, summary
    from symcost.render.context_parallel import render

    args = ["report", "hf:llama", "--cp", "2", "--gpu", "h100", "--devices-per-node", "1", "--set", "B=2", "S=64",
            "L=2", "H=4", "D=8", "K=2", "V=64", "F=32", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output[-2000:]
    cp = json.loads(r.output[r.output.index("{"):])["context_parallel"]
    js = cp["step"]
    assert js["step_seconds"] >= sum(js["compute"].values()) > 0 and js["cp"] == 2 and not js["inside"]
    assert js["link_bandwidth"] == get_device("h100").interconnect["network_bandwidth"]
    assert sum(js["bytes"].values()) == cp["total"]
    an = _trace(V)
    env = {k: x for k, x in V.items() if k in an.symbols}
    summ = dict(summary(an, env), step=step_time(an, get_device("h100"), env))
    render(summ, width=250)
    out = capsys.readouterr().out
    assert "step time bound on the device" in out and "inside one node" in out, out


def test_ring_schedule_limits():
    """PyTorch's ring schedule (passes.context_parallel.ring_seconds) in its two limits at random
    block times, CP = 2…8: a free link hides everything but the backward's last dK/dV pass (waited
    after the loop); a link slower than every kernel leaves the communication stream busy from the
    first issue to the end, so the call lasts all its passes back to back plus what runs before the
    first issue or after the last wait: forward (all-to-all) (CP-1)·kv + the last block, forward
    (all-gather) the gather + every block but the first, backward (all-to-all) (CP-1)·kv + CP·dkv."""
    from symcost.passes.context_parallel import ring_seconds

    rng = random.Random(2816)
    for _ in range(20):
        n = rng.randint(2, 8)
        blocks = [rng.uniform(1, 3) for _ in range(n)]
        tiny, huge = rng.uniform(1e-9, 1e-6), rng.uniform(1e3, 1e4)
        assert ring_seconds(blocks, tiny) == pytest.approx(sum(blocks))
        assert ring_seconds(blocks, tiny, allgather=True) == pytest.approx(sum(blocks))
        assert ring_seconds(blocks, tiny, tiny) == pytest.approx(sum(blocks) + tiny)
        assert ring_seconds(blocks, huge) == pytest.approx((n - 1) * huge + blocks[-1])
        assert ring_seconds(blocks, huge, allgather=True) == pytest.approx(huge + sum(blocks[1:]))
        g = rng.uniform(1e3, 1e4)
        assert ring_seconds(blocks, huge, g) == pytest.approx((n - 1) * huge + n * g)


def test_cp_with_as_many_key_value_heads_as_heads_answers():
    """The smallest input of a crash a newcomer met (hf:llama, K = H, --cp 2 at B = 2): the storage
    schedule's fit gave a parameter's size a Laurent term (… − 192·H/K), no polynomial, and the
    report stopped with an internal error; now such a fit is a FitError the tracer answers by more
    probes (then pinning). The report answers, and its parameters equal a meta-device count."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 128, "vocab_size": 128}
    r = CliRunner().invoke(main, ["report", "hf:llama", "--config", *(f"{k}={v}" for k, v in cfg.items()),
                                  "--cp", "2", "--set", "B=2", "S=64", "--json"])
    assert r.exit_code == 0, r.output[-1500:]
    got = json.loads(r.output[r.output.index("{"):])
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**cfg))
    assert got["params"] == sum(p.numel() for p in meta.parameters())

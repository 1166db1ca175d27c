"""The pipeline composed with the other mesh dimensions in one traced rank (issue 27 items 1 and
4): ``--pp`` with ``--dp`` (FSDP2) and with ``--tp --sp``.

Oracle: real ``torchrun`` + gloo runs on this CPU of torchtitan's mesh ``(pp, dp_shard | tp)``,
each stage module cut from the whole model, parallelised over the other dimension and driven by
``PipelineStage`` + ``Schedule1F1B`` (tests/data/pp_mesh_rank.py): each rank's FLOPs
(``flop_counter``'s registry on the local tensors), collective bytes per group and kind (ring
factors typed there, the group's size as PyTorch resolves it), point-to-point bytes, parameter
buffer and gradient bytes, and its peak (PyTorch's ``MemTracker`` over the measured step: the
storages' lifetimes). Sizes are drawn at random (seeded), with activations well above the
parameters as in training.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from fractions import Fraction

import pytest

from symcost.frontends.layout import Layout

PP, M = 2, 4
CACHE = ("cs336-lm", {}, None)  # through the trace cache, as `report --pp` traces them


def _draw(seed) -> dict:
    rng = random.Random(seed)
    return {"B": rng.randint(1, 2), "S": 16 * rng.randint(4, 8), "H": 4, "D": rng.choice((4, 8)),
            "L": rng.randint(PP, PP + 2), "V": 16 * rng.randint(2, 5), "F": 8 * rng.randint(2, 5)}


def _launch(tmp_path, *runs: tuple) -> list[list[dict]]:
    """Several runs of tests/data/pp_mesh_rank.py (each ``(v, dp, tp, shard, sp, ac, offload,
    offload_activations)`` on PP·dp·tp ranks: the launch has the most any run needs, and a run on
    fewer runs on the first of them) in one launch, each in its own directory under ``tmp_path``:
    per run, each of its ranks' JSON."""
    script = os.path.join(os.path.dirname(__file__), "data", "pp_mesh_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               OMP_NUM_THREADS="1")
    sizes = [PP * dp * tp for _, dp, tp, *_ in runs]
    n = max(sizes)
    args = []
    for i, (v, dp, tp, shard, sp, ac, offload, offload_activations) in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        args += (["+"] if i else []) + [str(tmp_path / str(i))] \
            + [str(x) for x in (PP, dp, tp, shard, int(sp), ac, M, *(v[k] for k in "BSHDLVF"))] \
            + (["offload"] if offload else []) + (["offload_activations"] if offload_activations else [])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                        script, *args], env=env, capture_output=True, text=True, timeout=400 * len(runs))
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines() if "rror" in line)[-4000:]
    return [[json.loads((tmp_path / str(i) / f"rank{rank}.json").read_text()) for rank in range(sizes[i])]
            for i in range(len(runs))]


def _check(r: dict, got: list[dict], peak_rel: float | None):
    """Each gloo rank against symcost's row of its pipeline rank: the FLOPs it runs (activation
    checkpointing's recomputation included: ``flops_hardware``; the model FLOPs without it where
    AC is on), its collective bytes per group and kind (the last stage's ``loss_parallel``
    all-reduces included), p2p bytes, shards and peak."""
    for g in got:
        row = r["ranks"][g["pp_rank"]]
        mem = row["memory"]
        assert g["flops"] == row["flops_hardware"], (g["pp_rank"], g["flops"], row["flops_hardware"])
        assert (row["flops"] < row["flops_hardware"]) == bool(r.get("ac")), row
        want = {grp: {k: Fraction(b) for k, b in d.items()} for grp, d in row["comm"].items()}
        real = {grp: {k: Fraction(b) for k, b in d.items()} for grp, d in g["comm"].items()}
        assert real == want, (g["pp_rank"], real, want)
        assert real["PP"] == {"send": row["send"], "recv": row["recv"]}  # the stage traces' p2p formulas
        assert (g["params"], g["buffers"], g["grads"]) == (mem["params"], mem["buffers"], mem["grads"]), (g, mem)
        if peak_rel is not None:
            assert abs(mem["peak"] - g["peak"]) <= peak_rel * g["peak"], (g["pp_rank"], mem, g["peak"])


#: the three 4-rank runs: PP 2 × FSDP 2 (seed of the sizes 2701), PP 2 × TP 2 with SP and
#: selective AC (2704), PP 2 × FSDP 2 with --offload --offload-activations (2720, :func:`_draw_offload`)
SEED_PP_FSDP, SEED_PP_TP, SEED_OFFLOAD = 2701, 2704, 2720


def _draw_offload(seed) -> dict:
    """The sizes of the offload run (B = 2: at B = 1 the activations are small beside gloo's
    timing of a collective's tensors, test_real_gloo_pp_by_fsdp_offload)."""
    rng = random.Random(seed)
    return {"B": 2, "S": 16 * rng.randint(3, 5), "H": 4, "D": rng.choice((8, 16)), "L": rng.randint(PP, PP + 1),
            "V": 16 * rng.randint(4, 8), "F": 32 * rng.randint(2, 4)}


#: the two FSDP 2 × TP 2 × PP 2 runs: (seed of the sizes, SP, AC)
RUNS_2X2X2 = [(2711, False, "none"), (2712, True, "selective")]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """Every gloo run of this file in one 8-rank launch (the ranks start, import torch, join the
    process group once; each run its own model, tokens, counters and offload hooks): the three
    4-rank runs (:data:`SEED_PP_FSDP`, :data:`SEED_PP_TP`, :data:`SEED_OFFLOAD`) on ranks 0-3 (a
    mesh of the first 4 ranks; ranks 4-7 skip them), then both :data:`RUNS_2X2X2` on all 8:
    ``{seed: ranks}``. (Was one 4-rank and one 8-rank launch: the 4 more processes' start-up,
    about 3 CPU-s each, saved.)"""
    runs = [(_draw(SEED_PP_FSDP), 2, 1, "fsdp", False, "none", False, False),
            (_draw(SEED_PP_TP), 1, 2, "none", True, "selective", False, False),
            (_draw_offload(SEED_OFFLOAD), 2, 1, "fsdp", False, "none", True, True)] \
        + [(_draw(seed), 2, 2, "fsdp", sp, ac, False, False) for seed, sp, ac in RUNS_2X2X2]
    seeds = (SEED_PP_FSDP, SEED_PP_TP, SEED_OFFLOAD, *(seed for seed, _, _ in RUNS_2X2X2))
    return dict(zip(seeds, _launch(tmp_path_factory.mktemp("pp"), *runs)))


@pytest.fixture(scope="module")
def gloo_4(gloo_runs):
    """The three 4-rank runs' ranks (:func:`gloo_runs`): ``{seed: ranks}``."""
    return {seed: gloo_runs[seed] for seed in (SEED_PP_FSDP, SEED_PP_TP, SEED_OFFLOAD)}


@pytest.mark.heavy
def test_real_gloo_pp_by_fsdp(gloo_4):
    """PP 2 × FSDP 2 (4 processes): FSDP2 inside ``PipelineStage`` all-gathers as the 1F1B schedule
    drives it (gradients kept unsharded between micro-batches, one reduce-scatter per step), so the
    rank's collective bytes per step are not m times one micro-batch's; symcost runs the same
    schedule on the fake mesh and counts them. FLOPs, collective and p2p bytes, parameter and
    gradient shards exact; the peak within 5%. (One launch with the file's other runs: :func:`gloo_runs`.)"""
    from symcost.passes.pipeline import summary

    v = _draw(SEED_PP_FSDP)
    r = summary("cs336-lm", PP, "1f1b", M, precision="fp32", sizes=dict(v, DP=2), inner=Layout(shard="fsdp"))
    _check(r, gloo_4[SEED_PP_FSDP], 0.05)
    for row in r["ranks"]:  # each rank holds half of its stage's parameters (DP = 2 divides them here)
        assert row["memory"]["params"] * 2 == 4 * row["params"], row


@pytest.mark.heavy
def test_real_gloo_pp_by_tp_sp_selective_ac(gloo_4):
    """PP 2 × TP 2 with SP and torchtitan's op-level selective AC (``--pp 2 --tp 2 --sp --ac
    selective``, refused before): the stage after the first receives its S/TP positions
    (``SequenceParallel``'s Shard(1)), so the p2p bytes are 1/TP of the boundary; the
    recomputation re-runs the sequence-parallel all-gathers (torchtitan's policy keeps
    reduce-scatter outputs, not all-gathers) and the FLOPs it runs. FLOPs run, collective bytes
    per group and kind (the last stage's ``loss_parallel`` all-reduces too), p2p bytes and
    shards equal the gloo run exactly; the peak within 5%. (One launch with the file's other runs:
    :func:`gloo_runs`.)"""
    from symcost.passes.pipeline import summary

    v = _draw(SEED_PP_TP)
    r = summary("cs336-lm", PP, "1f1b", M, precision="fp32", sizes=dict(v, TP=2),
                inner=Layout(tp=True, sp=True, ac="selective"))
    _check(dict(r, ac=True), gloo_4[SEED_PP_TP], 0.05)
    for row in r["ranks"]:  # one neighbour: M activations one way, M gradients the other, of S/TP positions
        assert row["send"] == row["recv"] == M * v["B"] * (v["S"] // 2) * v["H"] * v["D"] * 4, row


@pytest.mark.heavy
def test_real_gloo_pp_by_fsdp_offload(gloo_4):
    """PP 2 × FSDP 2 with CPU offload and activation offload (``--offload --offload-activations``;
    4 processes, random sizes; the gloo run under save_on_cpu(pin_memory=True)'s hooks, as
    tests/data/pp_mesh_rank.py says): per rank FLOPs, collective bytes per group and
    kind, p2p bytes, the host's parameter and gradient shards, H2D and D2H bytes per step equal
    the gloo run's, and so do the bytes packed and unpacked per step and the most pinned bytes the
    packed tensors of the micro-batches in flight hold at once; the device peak within 5% (gloo's threads release a collective's tensors at
    varying times: up to 2% seen at these sizes, 5% at B = 1, where the activations are smaller).
    FSDP2's CPU offload on a stage: tests/test_offload_pipeline.py (the report's contract); the
    gloo run in one launch with the file's other runs (:func:`gloo_runs`)."""
    from symcost.passes.pipeline import summary

    v = _draw_offload(SEED_OFFLOAD)
    r = summary("cs336-lm", PP, "1f1b", M, precision="fp32", sizes=dict(v, DP=2),
                inner=Layout(shard="fsdp", offload=True, offload_activations=True))
    got = gloo_4[SEED_OFFLOAD]
    for g in got:
        row = r["ranks"][g["pp_rank"]]
        host = row["memory"]["host"]
        assert (g["params"], g["grads"], g["host_buffers"]) == (host["params"], host["grads"], host["grads"]), (g, host)
        assert g["transfers"] == row["transfer"], (g["pp_rank"], g["transfers"], row["transfer"])
        assert row["host"]["params"] == host["params"]  # the policy's bytes of the shards (fp32)
        assert g["activation_offload"] == row["activation_offload"], (g["pp_rank"], g["activation_offload"],
                                                                      row["activation_offload"])
        # (the device holds no parameter or gradient between steps: _check compares 0 with 0)
        g.update(params=0, grads=0)
    _check(r, got, 0.05)


@pytest.fixture(scope="module")
def gloo_2x2x2(gloo_runs):
    """Both :data:`RUNS_2X2X2`' 8 ranks (:func:`gloo_runs`, the same launch): ``{seed: ranks}``."""
    return {seed: gloo_runs[seed] for seed, _, _ in RUNS_2X2X2}


@pytest.mark.heavy
@pytest.mark.parametrize("seed, sp, ac", RUNS_2X2X2)
def test_real_gloo_fsdp_tp_pp_2x2x2(gloo_2x2x2, seed, sp, ac):
    """FSDP 2 × TP 2 × PP 2 (8 processes, torchtitan's mesh ``(pp, dp_shard, tp)``), without AC
    and with SP and selective AC (both runs in one launch: :func:`gloo_runs`): each rank's FLOPs
    run, collective bytes per group and kind, p2p bytes, parameter, buffer and gradient shards
    equal the gloo run's exactly; the peak within 5%."""
    from symcost.passes.pipeline import summary

    v = _draw(seed)
    # (through the trace cache, as `report --pp` traces: the selective run's stage traces, L = 2,
    # are those test_stage_trace_that_pins_L_round_trips_the_trace_cache reads back)
    r = summary("cs336-lm", PP, "1f1b", M, precision="fp32", sizes=dict(v, DP=2, TP=2), cache=CACHE,
                inner=Layout(shard="fsdp", tp=True, sp=sp, ac=None if ac == "none" else ac))
    _check(dict(r, ac=ac != "none"), gloo_2x2x2[seed], 0.05)


@pytest.mark.heavy
def test_stage_trace_that_pins_L_round_trips_the_trace_cache(monkeypatch):
    """A stage of one block cannot fold its blocks, so its trace pins L at 1 (here the first
    stage of ``--pp 2 --dp 2 --tp 2 --sp --ac selective`` at L = 2): it is looked up with the
    stage's own block count, so the next request reads it back (it was traced again on every
    call: 22 s of a 25 s warm report).

    At the sizes and layout of the selective 2×2×2 gloo run above (seed 2712: L = 2), whose
    ``summary`` traced these stages into this process's trace cache: run after it (one file, one
    worker), the first request is that run's trace, not another trace of the composed stages
    (94 CPU-s, 2026-12-05; 0.1 s read back); run alone, it traces them here."""
    import symcost
    import symcost.passes.pipeline as P

    sizes = dict(_draw(2712), DP=2, TP=2)
    assert sizes["L"] == PP  # (one block a stage)
    inner = Layout(shard="fsdp", tp=True, sp=True, ac="selective")
    _, first = P.trace_stages("cs336-lm", PP, 1, "fp32", sizes, cache=CACHE, inner=inner)
    assert first["first"].pinned.get("L") == 1, first["first"].pinned  # (the case this guards)
    monkeypatch.setattr(P, "_TRACES", {})

    def no_trace(*a, **k):
        raise AssertionError("traced again: the cache was not read")
    monkeypatch.setattr(symcost, "trace", no_trace)
    _, again = P.trace_stages("cs336-lm", PP, 1, "fp32", sizes, cache=CACHE, inner=inner)
    assert {k: an.flops("train") for k, an in again.items()} == {k: an.flops("train") for k, an in first.items()}

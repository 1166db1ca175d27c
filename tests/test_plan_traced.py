"""``symcost plan``'s traced candidates (symcost/passes/plan_traced.py; docs/parallel.md §13.5).

Oracles: ``symcost report`` for the same layout (its ``--json`` per-rank peak: ``parallel.memory.peak``
without a pipeline, the most loaded rank's ``peak_with_optimizer`` with ``--pp``; both checked
against PyTorch in test_parallel_memory.py, test_hsdp.py, test_layout.py and
test_pipeline_parallel.py), once from the trace cache plan filled and once traced afresh
(``--no-cache``); the memory cap for the fit; step-time order.
"""
from __future__ import annotations

import functools
import json
import random

import pytest

from conftest import run_cli
from symcost.hardware.devices import get_device
from symcost.passes.plan import plan, trace_for_plan

# (bf16-true: the oracle of test_traced_rows_against_fsdp_mem_tracker, whose AdamW keeps no fp32
# master copy, needs it; every test here at that precision shares one trace and the layouts' traces
# in the cache; the fp32-master policy's plan: tests/test_plan.py)
PREC = "bf16-true"
SZ = {"H": 8, "D": 8, "L": 4, "V": 64, "S": 16}
SETS = ["H=8", "D=8", "L=4", "V=64", "S=16"]


@functools.lru_cache(maxsize=None)
def _an():
    return trace_for_plan("megatron-gpt", SZ, PREC)


def _report_args(x):
    """``report`` flags of a plan row's layout."""
    args = []
    if x["dp"] > 1:
        shard = "fsdp" if x["shard"] == "hsdp" else x["shard"]
        args += ["--dp", str(x["dp"]), "--shard", shard]
        if x["shard"] == "hsdp":
            args += ["--dp-replicate", str(x["replicate"])]
    if x["tp"] > 1:
        args += ["--tp", str(x["tp"])]
    ck = x["checkpoint"] if x["checkpoint"] != "optimal" else {0: "none", x["blocks"]: "full"}[x["checkpointed_blocks"]]
    if ck != "none":
        args += ["--ac", ck]
    if x["pp"] > 1:
        args += ["--pp", str(x["pp"]), "--schedule", x["schedule"], "--microbatches", str(x["microbatches"])]
    return args


def _report_peak(capsys, x, *extra):
    code, out, err = run_cli(capsys, "report", "megatron-gpt", *_report_args(x), "--precision", PREC, "--json",
                             *extra, "--set", *SETS, f"B={x['micro_batch']}")
    assert code == 0, err
    js = json.loads(out)
    if x["pp"] > 1:
        return max(r["peak_with_optimizer"] for r in js["pipeline"]["ranks"])
    return js["parallel"]["memory"]["peak"]


@pytest.mark.heavy
def test_traced_peak_is_reports_peak_and_rows_rerank(capsys):
    """The traced rows of a plan carry the peak ``report`` gives for the same layout (the same
    function path), fit the cap, and are ranked by step time; a selective row is priced by its
    trace (its recomputation adds time over the same layout without checkpointing)."""
    rng = random.Random(61)
    res = plan(_an(), SZ, get_device("a100-80gb"), 4, 10**12, 8, PREC, shards=("fsdp", "hsdp"),
               checkpoints=("none", "selective"), micro_batches=(1, 2), model="megatron-gpt", trace_top=3,
               keep_all=True)
    traced = [r for r in res["layouts"] if r["peak_source"] == "traced"]
    assert res["traced"] == 3 and len(traced) == 3 - len(res["dropped"])
    times = [r["step_seconds"] for r in res["layouts"]]
    assert times == sorted(times)
    assert all(r["memory"]["traced_peak"] <= res["memory_cap"] for r in traced)
    # the traced rows are the fastest the screen offered: every screened row is at least as slow
    # as the slowest traced row was before tracing priced a selective row's recomputation
    for r in rng.sample(traced, 2):
        assert r["memory"]["traced_peak"] == _report_peak(capsys, r["layout"]), r["layout"]
    # a layout traced afresh (no cache) gives the same peak
    r = traced[0]
    assert r["memory"]["traced_peak"] == _report_peak(capsys, r["layout"], "--no-cache"), r["layout"]
    sel = [r for r in res["layouts"] + res["excluded"] if r["layout"]["checkpoint"] == "selective"
           and r.get("peak_source") == "traced"]
    for r in sel:
        same = {**r["layout"], "checkpoint": "none", "checkpointed_blocks": 0}
        twin = next(o for o in res["layouts"] + res["excluded"] if o["layout"] == same)
        assert r["step_seconds"] > twin["step_seconds"]


@pytest.mark.heavy
def test_pipeline_row_traced_peak_is_report_pp(capsys):
    """A pipeline row (pp = 2 over dp 2 FSDP2) traced by plan: its peak is ``report --pp``'s
    most loaded rank's, and a cap between the screened memory and the traced peak drops it
    (:func:`refine` on the plan screened at that cap, handed that one layout's rows: the check is
    one layout's, so the other layouts are not traced)."""
    from symcost.passes.plan_traced import refine, traced_peak

    res = plan(_an(), SZ, get_device("a100-80gb"), 4, 10**12, 8, PREC, shards=("fsdp",), checkpoints=("none",),
               micro_batches=(2,))
    row = next(r for r in res["layouts"] if r["layout"]["pp"] == 2 and r["layout"]["dp"] == 2)
    t = traced_peak("megatron-gpt", row["layout"], SZ, PREC)
    assert t["peak"] == _report_peak(capsys, row["layout"])
    cap = min(t["peak"], row["memory"]["total"]) + abs(t["peak"] - row["memory"]["total"]) // 2
    out = plan(_an(), SZ, get_device("a100-80gb"), 4, cap, 8, PREC, shards=("fsdp",), checkpoints=("none",),
               micro_batches=(2,), keep_all=True)
    one = {**out, **{k: [r for r in out[k] if r["layout"] == row["layout"]] for k in ("layouts", "excluded")}}
    assert len(one["layouts"]) + len(one["excluded"]) == 1
    out = refine(one, "megatron-gpt", SZ, PREC, k=1, near=10.0)
    assert out["traced"] == 1
    same = [r for r in out["layouts"] if r["layout"] == row["layout"]]
    assert (t["peak"] <= cap) == bool(same)
    if same:
        assert same[0]["peak_source"] == "traced" and same[0]["memory"]["traced_peak"] == t["peak"]


def test_refine_refuses_bad_options_and_leaves_untraceable_rows():
    """``--trace-top`` below 0 is one line; an ``optimal`` row of 0 < k < n blocks has no traced
    counterpart and keeps its screened memory (labelled so)."""
    from symcost.errors import SymcostError
    from symcost.passes.plan_traced import mesh_of, refine

    with pytest.raises(SymcostError, match="--trace-top"):
        refine({"memory_cap": 1, "layouts": []}, "megatron-gpt", SZ, PREC, k=-1)
    lay = {"dp": 2, "tp": 1, "pp": 1, "shard": "fsdp", "checkpoint": "optimal", "checkpointed_blocks": 1,
           "blocks": 4, "schedule": "none", "microbatches": 1, "virtual": 1, "micro_batch": 1, "replicate": 1}
    assert mesh_of(lay) is None
    assert mesh_of({**lay, "checkpointed_blocks": 4}).ac == "full"
    assert mesh_of({**lay, "shard": "hsdp", "dp": 4, "replicate": 2, "checkpoint": "selective"}).replicate == 2
    assert mesh_of({**lay, "dp": 1, "checkpoint": "none"}) is None  # one plain device


@pytest.mark.heavy
def test_cli_labels_traced_and_screened_rows(capsys):
    """``plan --trace-top K``: JSON rows carry ``peak_source`` and the text table says which peak
    each row shows."""
    _an()
    args = ["plan", "megatron-gpt", "--devices", "4", "--device", "a100-80gb", "--memory", "80GiB",
            "--global-batch", "8", "--shard", "fsdp", "--checkpoint", "none,selective", "--micro-batch", "2",
            "--set", *SETS]
    code, out, err = run_cli(capsys, *args, "--json", "--top", "4", "--trace-top", "2")
    assert code == 0, err
    js = json.loads(out)
    src = [r["peak_source"] for r in js["layouts"]]
    assert js["traced"] == 2 and src.count("traced") == 2 - len(js["dropped"]) and "screened" in src
    code, out, err = run_cli(capsys, *args, "--top", "3", "--trace-top", "2")
    assert code == 0, err
    assert " tr " in out and "until 2 fit" in out



@pytest.mark.heavy
def test_traced_rows_against_fsdp_mem_tracker():
    """Independent oracle: for random traced rows of a plan (no pipeline: FSDP2 and HSDP, with
    and without selective checkpointing, the candidates here) and a random 2-D (dp, tp = 2) row
    priced by the same function, the per-rank peak plan reports against
    PyTorch's ``FSDPMemTracker`` on rank 0 of the real model wrapped the same way on the fake
    process group (benchmarks/bench_composed_mem_tracker.py ``tracker_layout_run``:
    ``Layout.fake_mesh`` + ``Layout.parallelize`` in torchtitan's order, one untracked step, one
    tracked step with foreach AdamW), within 1 % (that benchmark's rows agree within 0.2 %;
    docs/parallel.md "FSDPMemTracker on composed layouts"). bf16-true: the tracker's AdamW keeps
    no fp32 master copy, so the policy has none either."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from bench_composed_mem_tracker import tracker_layout_run

    from symcost.frontends.models import resolve
    from symcost.passes.plan_traced import mesh_of, traced_peak

    prec = PREC
    an = _an()
    res = plan(an, SZ, get_device("a100-80gb"), 8, 10**12, 16, prec, shards=("fsdp", "hsdp"),
               checkpoints=("none", "selective"), micro_batches=(2,), model="megatron-gpt", trace_top=3,
               keep_all=True)
    rows = [r for r in res["layouts"] if r["peak_source"] == "traced" and r["layout"]["pp"] == 1]
    assert len(rows) >= 2, [r["layout"] for r in res["layouts"][:8]]
    spec = resolve("megatron-gpt")
    rng = random.Random(27)
    picked = [(r["layout"], r["memory"]["traced_peak"]) for r in rng.sample(rows, min(2, len(rows)))]
    # the fastest rows here are all dp 8 (FSDP2 / HSDP): a random 2-D (dp, tp = 2) row of the same
    # plan priced by the same function refine calls
    mesh2 = [r for r in res["layouts"] + res["excluded"] if r["layout"]["tp"] == 2 and r["layout"]["pp"] == 1
             and r["layout"]["dp"] > 1]
    x2 = rng.choice(mesh2)["layout"]
    picked.append((x2, traced_peak("megatron-gpt", x2, SZ, prec)["peak"]))
    for x, got in picked:
        values = spec.values({**SZ, "B": x["micro_batch"], "DP": x["dp"], "TP": x["tp"]})
        peer = tracker_layout_run(spec, mesh_of(x), values, prec, foreach=True)["peak"]
        assert abs(got - peer) <= 0.01 * peer, (x, got, peer)


def test_refine_traces_until_k_fit_and_prunes_larger_micro_batches(monkeypatch):
    """refine's order (no trace here: ``traced_peak`` replaced by a stand-in whose selective rows
    peak at 3× their screened memory, the rest at 1.05×): candidates in step-time order until k
    of them fit, the traced rows over the cap dropped, and a pipeline-free layout over the cap at
    micro-batch b leaves out its rows at micro-batches ≥ b untraced."""
    from symcost.passes import plan_traced

    calls = []

    def fake(model, lay, sizes, precision, optimizer="adamw", sp=False, use_cache=True, routing=None):
        calls.append(dict(lay))
        row = rows_by_key[tuple(sorted(lay.items()))]
        f = 3.0 if lay["checkpoint"] == "selective" else 1.05
        return {"peak": int(row["memory"]["total"] * f), "rank": 0, "recompute_flops": 0.0, "source": "stand-in"}

    # (refine's mechanics on the bound's order: this scenario's 4 fitting rows among the first 16)
    res = plan(_an(), SZ, get_device("a100-80gb"), 8, 10**12, 16, PREC, checkpoints=("none", "full", "selective"),
               keep_all=True, rank_by="bound")
    mems = sorted(r["memory"]["total"] for r in res["layouts"] + res["excluded"])
    cap = mems[len(mems) // 3]
    res = plan(_an(), SZ, get_device("a100-80gb"), 8, cap, 16, PREC, checkpoints=("none", "full", "selective"),
               keep_all=True, rank_by="bound")
    rows = res["layouts"] + res["excluded"]
    rows_by_key = {tuple(sorted(r["layout"].items())): r for r in rows}
    monkeypatch.setattr(plan_traced, "traced_peak", fake)
    out = plan_traced.refine(res, "megatron-gpt", SZ, PREC, k=4)
    fitting = [r for r in out["layouts"] if r["peak_source"] == "traced"]
    assert len(fitting) == 4 and out["traced"] == len(calls) <= 16
    assert all(r["memory"]["traced_peak"] <= cap for r in out["layouts"] if r["peak_source"] == "traced")
    assert all(r["layout"]["checkpoint"] != "selective" for r in out["layouts"] if r["peak_source"] == "screened")
    over = {}
    for c in calls:  # nothing traced at a micro-batch as large as one of the same layout over the cap
        kind = plan_traced._kind(c)
        assert c["micro_batch"] < over.get(kind, 10**9), c
        row = rows_by_key[tuple(sorted(c.items()))]
        if c["pp"] == 1 and row["memory"]["traced_peak"] > cap:
            over[kind] = min(over.get(kind, c["micro_batch"]), c["micro_batch"])
    times = [r["step_seconds"] for r in out["layouts"]]
    assert times == sorted(times)

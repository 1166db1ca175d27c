"""Data-parallel traces in the trace cache (issue 15, symcost.graph.cache / serialize).

A data-parallel analysis written as data and read back must answer exactly as the fresh trace
(formulas, per-rank values with FSDP2's padding, step time over the interconnect); the cache is
keyed by the strategy (a DDP and an FSDP trace never share an entry), serves another DP from the
same entry, and ``--no-cache`` neither reads nor writes it. Where a test checks numbers of a
request served from the cache, the oracle is PyTorch itself: rank 0's collectives seen at
dispatch (``tests/test_parallel.py``'s ``_run_rank``: a ``TorchDispatchMode``, nccl-tests' ring
factors typed by hand) and ``FlopCounterMode``. Sizes are drawn at random (seeded), DP dividing
the sharded dimension or not.
"""
from __future__ import annotations

import functools
import json
import random

import pytest
import sympy

import symcost
from symcost.graph.analysis import Analysis
from symcost.graph.ops import COMM_KINDS, PHASES
from symcost.hardware.devices import get_device
from symcost.passes.parallel import OVERLAPS, step_time, summary

from test_parallel import _run_rank


@functools.lru_cache(maxsize=None)
def _fresh(shard: str):
    return symcost.trace("mlp", sizes={"DP": 8}, precision="bf16-mixed", shard=shard, use_cache=False)


def _same(a, b, where=""):
    """Equal values: formulas up to expansion, floats to 1e-12, containers element-wise."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert float(b) == pytest.approx(float(a), rel=1e-12, abs=0), where
    elif type(a).__name__ == "dtype" or type(b).__name__ == "dtype":  # a dtype reads back as its name
        assert str(a).removeprefix("torch.") == str(b).removeprefix("torch."), where
    elif isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        assert sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0, (where, a, b)
    else:
        assert a == b, (where, a, b)


def _draw(rng: random.Random) -> dict:
    """mlp sizes; DP from 2 to 16, dividing D or not (FSDP2 pads then)."""
    dp = rng.randint(2, 16)
    d = dp * rng.randint(2, 12) + (rng.randint(1, dp - 1) if rng.random() < 0.5 else 0)
    return {"B": rng.randint(2, 8), "S": rng.randint(2, 64), "D": d, "L": rng.randint(2, 6), "DP": dp}


@pytest.mark.parametrize("shard", ["ddp", "fsdp", "zero2"])
def test_round_trip_equals_fresh_trace(shard):
    """to_dict -> JSON -> from_dict: the strategy, the shards, each op's collective, the comm
    totals per kind and phase, summary() (formulas and padded values) and step_time() (every
    overlap model, one node and several) equal the fresh trace's at random sizes."""
    fresh = _fresh(shard)
    data = json.loads(json.dumps(fresh.to_dict()))
    back = Analysis.from_dict(data)
    # a cached analysis is written again as it was read (a cached trace kept its stored fusion
    # and module classes under its methods' names, so its to_dict failed: CI, 2026-12-06)
    assert json.loads(json.dumps(back.to_dict()))["fusion"] == data["fusion"] is not None
    assert json.loads(json.dumps(back.to_dict()))["module_classes"] == data["module_classes"]
    assert back.parallel == fresh.parallel == shard
    assert back.symbols == fresh.symbols and "DP" in back.symbols and back.pinned == fresh.pinned
    _same(fresh.param_shards, back.param_shards, "param_shards")
    _same(fresh.params_shard, back.params_shard, "params_shard")
    comms = [op.comm for op in fresh.ops]
    assert any(c is not None for c in comms)
    assert [c is None for c in comms] == [op.comm is None for op in back.ops]
    for a, b in zip(fresh.ops, back.ops):
        if a.comm is not None:
            assert a.comm[0] == b.comm[0]
            _same(list(a.comm[1:]), list(b.comm[1:]), f"comm of op {a.index}")
    for kind in COMM_KINDS + ("total",):
        for ph in PHASES + ("train",):
            _same(fresh.comm_bytes(kind, ph), back.comm_bytes(kind, ph), f"comm_bytes({kind}, {ph})")
    # the storage schedule (None for a data-parallel trace today) serialises with the rest
    assert (fresh.schedule is None) == (back.schedule is None)
    if fresh.schedule is not None:
        assert back.schedule.to_dict() == fresh.schedule.to_dict()
    _same(summary(fresh, "bf16-mixed", "adamw"), summary(back, "bf16-mixed", "adamw"), "summary")
    rng = random.Random(1500 + len(shard))
    dev = get_device("h100-sxm")
    for _ in range(4):
        v = _draw(rng)
        _same(summary(fresh, "bf16-mixed", "adamw", v)["values"], summary(back, "bf16-mixed", "adamw", v)["values"],
              f"values at {v}")
        for overlap in OVERLAPS:
            for nodes in (None, 2):
                if nodes and v["DP"] < 2:
                    continue
                want = step_time(fresh, dev, v, overlap, nodes=nodes, devices_per_node=v["DP"])
                _same(want, step_time(back, dev, v, overlap, nodes=nodes, devices_per_node=v["DP"]),
                      f"step_time({overlap}, nodes={nodes}) at {v}")


def _cli(*args):
    from click.testing import CliRunner

    from symcost.cli import main

    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, (args, r.output)
    return json.loads(r.output[r.output.index("{"):])


def _entries(root):
    return sorted(p for p in root.rglob("*.json") if not p.name.endswith(".meta.json"))


def _sets(v):
    return ["--set"] + [f"{k}={x}" for k, x in v.items() if k != "DP"]


def test_shards_never_share_an_entry(cache_dir):
    """ddp, fsdp and zero1 (the ddp trace with ZeRO-1 model states) of one model: three entries;
    each answer is its own strategy's (rank 0's collectives under that engine, by PyTorch)."""
    rng = random.Random(77)
    v = {"B": rng.randint(2, 4), "S": rng.randint(4, 16), "D": 4 * rng.randint(2, 10), "L": rng.randint(2, 4), "DP": 4}
    out = {}
    for shard in ("ddp", "fsdp", "zero1"):
        out[shard] = _cli("report", "mlp", "--dp", "4", "--shard", shard, "--json", *_sets(v))
        assert out[shard]["parallel"]["shard"] == shard
    assert len(_entries(cache_dir)) == 3 and len([p for p in cache_dir.iterdir() if p.is_dir()]) == 3
    for shard in ("fsdp", "ddp", "zero1"):  # read back: no entry added, each still its own
        again = _cli("report", "mlp", "--dp", "4", "--shard", shard, "--json", *_sets(v))
        assert again == out[shard], shard
    assert len(_entries(cache_dir)) == 3
    for shard in ("ddp", "fsdp"):
        got = _run_rank("mlp", shard, v)
        for kind, want in got["comm"].items():
            assert out[shard]["comm"][kind] == want, (shard, kind)
    assert out["ddp"]["comm"]["all_gather"] == 0 < out["fsdp"]["comm"]["all_gather"]
    assert out["zero1"]["comm"] == out["ddp"]["comm"]  # the same trace, ...
    mem = {s: out[s]["parallel"]["memory_per_rank"] for s in ("ddp", "zero1")}
    # ... other model states: the moments sharded 1/DP; torch.optim's 0-d fp32 ``step`` counter per
    # parameter tensor (4 B each) on every DDP rank, as the one-device step keeps them, and one
    # under ZeRO-1, whose optimizer steps one flat partition (DeepSpeed's stage_1_and_2.py)
    from symcost.frontends.models import resolve

    steps = 4 * len(list(resolve("mlp").build_meta({**v, "DP": 1}).parameters()))
    assert (mem["zero1"]["optimizer_state"] - 4) * 4 == mem["ddp"]["optimizer_state"] - steps


def test_one_entry_serves_every_dp(cache_dir):
    """A request at another DP (dividing the width or not: padded), batch, length or depth
    reads the entry traced at DP = 4 (the width D, a config size, is matched by value), and its
    collectives and FLOPs are rank 0's as PyTorch runs it at that DP."""
    rng = random.Random(4242)
    width = 4 * rng.randint(4, 12)
    v = {"B": 2, "S": 8, "D": width, "L": 2, "DP": 4}
    _cli("report", "mlp", "--dp", "4", "--shard", "fsdp", "--json", *_sets(v))
    entries = [p.read_bytes() for p in _entries(cache_dir)]
    assert len(entries) == 1
    for dp in (rng.choice([n for n in range(3, 16) if width % n]),
               rng.choice([n for n in range(5, 17) if width % n == 0] or [2]), rng.randint(2, 16)):
        w = {"B": rng.randint(2, 6), "S": rng.randint(2, 40), "D": width, "L": rng.randint(2, 5), "DP": dp}
        d = _cli("report", "mlp", "--dp", str(dp), "--shard", "fsdp", "--json", *_sets(w))
        assert [p.read_bytes() for p in _entries(cache_dir)] == entries, w  # read, not traced again
        got = _run_rank("mlp", "fsdp", w)
        for kind, want in got["comm"].items():
            assert d["comm"][kind] == want, (w, kind)
        assert d["flops"]["train"] == got["flops"], w
        assert d["parallel"]["dp"] == dp and d["parallel"]["divisible"] == (w["D"] % dp == 0)


def test_no_cache_neither_reads_nor_writes(cache_dir):
    """--no-cache on an empty cache writes nothing; with an entry there (here altered by hand,
    every all-gather doubled) the cached answer shows the alteration, --no-cache the true bytes
    (PyTorch's), and the entry is left as it was."""
    rng = random.Random(99)
    v = {"B": rng.randint(2, 4), "S": rng.randint(4, 16), "D": 4 * rng.randint(2, 10), "L": 2, "DP": 4}
    args = ("report", "mlp", "--dp", "4", "--shard", "fsdp", "--json", *_sets(v))
    true = _cli(*args, "--no-cache")
    assert _entries(cache_dir) == []
    assert _cli(*args) == true
    (entry,) = _entries(cache_dir)
    data = json.loads(entry.read_text())
    n = 0
    for row in data["ops"]:
        if len(row) > 15 and row[15] is not None and row[15][0] == "all_gather":
            row[15][2] = f"2*({row[15][2]})"
            n += 1
    assert n
    entry.write_text(json.dumps(data))
    altered = entry.read_bytes()
    assert _cli(*args)["comm"]["all_gather"] == 2 * true["comm"]["all_gather"]
    fresh = _cli(*args, "--no-cache")
    assert fresh == true and entry.read_bytes() == altered
    assert fresh["comm"]["all_gather"] == _run_rank("mlp", "fsdp", v)["comm"]["all_gather"]

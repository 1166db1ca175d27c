"""``--pp-split``: the blocks of each pipeline stage, Megatron-LM's even split, torchtitan's
default (the embedding and the output weighing a block each) or as given, against torchtitan's
own function (tests/data/torchtitan_split.py, copied from torchtitan) at random sizes."""
from __future__ import annotations

import os
import random
import sys

import pytest

from symcost.errors import SymcostError
from symcost.frontends.pipeline import parse_split, stage_blocks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from torchtitan_split import _generate_llm_fqn_per_model_part as torchtitan_parts  # noqa: E402


def _blocks(parts):
    return [sum(1 for m in p if m.startswith("layers.")) for p in parts]


def test_torchtitan_split_equals_torchtitans_own():
    """At random L, stage counts (PP × virtual stages) and first/last weights, the blocks per stage
    equal those of torchtitan's module lists wherever torchtitan splits (its ValueErrors: symcost
    refuses the same requests in one line); Llama-3-8B's 32 blocks on 4 stages: 8, 9, 8, 7."""
    assert stage_blocks(32, 4, "torchtitan") == [8, 9, 8, 7]
    rng = random.Random(4242)
    agreed = refused = 0
    for _ in range(400):
        L, n = rng.randint(1, 130), rng.choice((2, 3, 4, 6, 8, 16))
        a, b = rng.choice(((1, 1), (0, 0), (2, 1), (1, 2), (3, 3)))
        try:
            want = _blocks(torchtitan_parts(n, L, a, b))
        except ValueError:
            want = None
        if want is not None and (sum(want) != L or min(want) < 1):
            want = None  # (torchtitan builds it, leaving blocks out or a stage of no block: refused here)
        try:
            got = stage_blocks(L, n, ("torchtitan", a, b))
        except SymcostError:
            got = None
        assert got == want, (L, n, a, b)
        agreed += got is not None
        refused += got is None
    assert agreed > 200 and refused > 10


def test_even_and_explicit_splits():
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 8)
        L = rng.randint(n, 100)
        even = stage_blocks(L, n)
        assert sum(even) == L and max(even) - min(even) <= 1 and even == sorted(even, reverse=True)
        assert stage_blocks(L, n, parse_split("even")) == even
        given = tuple(rng.randint(1, 9) for _ in range(n))
        assert stage_blocks(sum(given), n, parse_split(",".join(map(str, given)))) == list(given)
    with pytest.raises(SymcostError, match="stages of"):
        stage_blocks(10, 3, (3, 3, 3))
    for bad in ("uneven", "3,0,2", "torchtitan:1", "torchtitan:-1,1", "3,x"):
        with pytest.raises(SymcostError, match="accepted"):
            parse_split(bad)


def test_cli_pp_split_refusals_are_one_line():
    from click.testing import CliRunner

    from symcost.cli import main

    for args, want in ((["--pp-split", "2,2,2"], "--pp-split needs --pp N"),
                       (["--pp", "3", "--pp-split", "uneven"], "accepted: even, torchtitan"),
                       (["--pp", "3", "--pp-split", "2,2"], "the pipeline has 3 stages of L = 6 blocks")):
        r = CliRunner().invoke(main, ["report", "cs336-lm", "--set", "L=6", *args])
        assert r.exit_code != 0 and want in r.output and "Traceback" not in r.output, (args, r.output)


def test_cli_schedules_pytorch_refuses_are_refused_before_any_trace(monkeypatch):
    """1F1B with fewer micro-batches than stages and virtual stages on a one-stage schedule: one
    line, and no stage is traced first (the stage traces are replaced by a failure here)."""
    from click.testing import CliRunner

    import symcost.passes.pipeline as pipeline
    from symcost.cli import main

    def no_trace(*a, **k):
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(pipeline, "trace_stages", no_trace)
    monkeypatch.setattr(pipeline, "summary", no_trace)
    for args, want in ((["--pp", "2", "--schedule", "1f1b", "--microbatches", "1"], "refuses 1f1b"),
                       (["--pp", "2", "--virtual-stages", "2"], "runs one stage per rank")):
        for cmd in ("report", "max-batch"):
            r = CliRunner().invoke(main, [cmd, "cs336-lm", "--set", "L=4", *args])
            assert r.exit_code == 2 and want in r.output and "Traceback" not in r.output, (cmd, args, r.output)

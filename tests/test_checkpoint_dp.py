"""``max-batch --checkpoint`` on a data-parallel rank (issue 30, "every other pass follows"):
the plan per B over the rank's step (symcost/passes/checkpoint/memory.py
``RankCheckpointedMemory``, docs/checkpoint.md "max-batch with checkpointing").

The oracle is PyTorch's own step of rank 0 on the fake process group (FSDP2 / DDP as symcost's
``--shard`` wraps it) with exactly the plan's blocks checkpointed as torchtitan's ``apply_ac``
wraps a block (before the engine; non-reentrant, ``preserve_rng_state=False``), its peak by
``torch.distributed._tools.mem_tracker.MemTracker`` (tests/test_parallel_memory.py ``_measure``).
Sizes are drawn at random, DP dividing the sharded width."""
from __future__ import annotations

import itertools
import json
import random

import pytest

import symcost
from symcost.frontends.layout import Layout

from test_parallel_memory import _cli, _measure

P = "bf16-mixed"


def _traces(shard: str):
    """The rank's plain step and its step with every block checkpointed (``--ac full``), as the
    CLI traces them (``--torch-device cpu``: one trace-cache entry each)."""
    an = symcost.trace("mlp", sizes={"DP": 8}, precision=P, shard=shard, torch_device="cpu")
    ck = symcost.trace("mlp", sizes={"DP": 8}, precision=P, layout=Layout(shard=shard, ac="full"), torch_device="cpu")
    return an, ck


@pytest.mark.parametrize("shard", ["fsdp", pytest.param("ddp", marks=pytest.mark.heavy),
                                   pytest.param("zero2", marks=pytest.mark.heavy)])
def test_max_batch_checkpoint_dp_at_the_boundary(shard):
    """``max-batch mlp --dp N --shard S --checkpoint optimal --memory CAP`` with CAP drawn between
    symcost's checkpointed peaks at a random B0 and B0 + 1: the answer is B0; PyTorch's step of
    rank 0 with exactly the answer's plan has MemTracker's peak = ``memory_at_max`` <= CAP, and with
    the plan chosen at B0 + 1 MemTracker's peak = ``memory_at_next`` > CAP. At B0 the composed peak
    of no block, every block and a random subset equals MemTracker's too, and the plan ``optimal``
    chooses has the least composed peak of all 2^L subsets of blocks."""
    from symcost.passes.checkpoint.memory import RankCheckpointedMemory, plan_memory
    from symcost.tracing.fit import SYMS

    rng = random.Random(f"checkpoint dp {shard}")
    dp = rng.choice((2, 4))
    v = {"S": rng.randint(3, 12), "D": 4 * dp * rng.randint(2, 6), "L": rng.randint(3, 5), "DP": dp}
    b0 = rng.randint(3, 8)
    an, ck = _traces(shard)
    mm, _ = plan_memory(an, "optimal", {}, "adamw", "default", "cpu", ck=ck)
    assert isinstance(mm, RankCheckpointedMemory) and mm.impl == "for-loop"
    lo, hi = mm.peak(**v, B=b0), mm.peak(**v, B=b0 + 1)
    assert lo < hi
    cap = rng.randint(lo, hi - 1)
    r = _cli(["max-batch", "mlp", "--dp", str(dp), "--shard", shard, "--checkpoint", "optimal", "--memory", f"{cap}B",
              "--precision", P, "--torch-device", "cpu", "--json", "--set"]
             + [f"{k}={x}" for k, x in v.items() if k != "DP"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert d["max_batch"] == b0 and d["parallel"] == {"dp": dp, "shard": shard, "per_rank": True}, d
    plan = mm.plan(**v, B=b0)
    assert d["checkpoint"]["segments"] == [list(s) for s in plan.segments]
    blocks = {b: [s for s, _ in mm.plan(**v, B=b).segments] for b in (b0, b0 + 1)}
    fits = _measure("mlp", shard, dict(v, B=b0), P, checkpointed=blocks[b0])
    over = _measure("mlp", shard, dict(v, B=b0 + 1), P, checkpointed=blocks[b0 + 1])
    assert (d["memory_at_max"], d["memory_at_next"]) == (fits, over) == (lo, hi), (fits, lo, over, hi)
    assert fits <= cap < over
    # the composition at B0, any plan; the search against every subset
    L = v["L"]
    env = an.bind(**v, B=b0)
    assert int(env[SYMS["L"]]) == L
    _, ch = mm.at(**v, B=b0)
    sim = ch.schedule.simulate
    for sub in ([], list(range(L)), sorted(rng.sample(range(L), rng.randint(1, L - 1)))):
        assert sim([(i, i + 1) for i in sub])[0] == _measure("mlp", shard, dict(v, B=b0), P, checkpointed=sub), sub
    every = [sim([(i, i + 1) for i in sub])[0] for n in range(L + 1) for sub in itertools.combinations(range(L), n)]
    assert lo == min(every), (lo, min(every))


@pytest.mark.parametrize("args,says", [
    (["--dp", "2", "--shard", "fsdp", "--checkpoint", "sqrt"], "--checkpoint sqrt is not planned on a data-parallel rank"),
    (["--dp", "2", "--shard", "fsdp", "--ac", "full", "--checkpoint", "optimal"],
     "--checkpoint optimal chooses which blocks to checkpoint and --ac full checkpoints every block: give one"),
])
def test_max_batch_checkpoint_dp_refusals(args, says, monkeypatch):
    """What the rank's planner does not plan is one line, before any trace."""
    import symcost.graph.build as build

    def no_trace(*a, **k):
        raise AssertionError("traced")

    monkeypatch.setattr(build, "trace", no_trace)
    r = _cli(["max-batch", "mlp", "--memory", "1GiB"] + args)
    assert r.exit_code == 2 and says in r.output, r.output

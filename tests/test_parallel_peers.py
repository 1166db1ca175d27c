"""symcost's per-rank model states against PyTorch's ``FSDPMemTracker`` (issue 15), the peer
torchtitan's memory estimator runs: one FSDP2 rank (``fully_shard`` per block, then the root)
on the fake process group under ``FakeTensorMode`` at a random world size and random sizes
(seeded; DP need not divide the sharded dimensions, so FSDP2's padding is exercised).

Oracle: the tracker's own categories right after an AdamW step (tests/fsdp_tracker_oracle.py):
``Sharded Param``, ``Sharded Grad`` and ``OptState`` (the two moments plus AdamW's 4-byte fp32
``step`` counter per parameter tensor, a hand count), each the bytes of the storages FSDP2 and
``torch.optim`` hold on rank 0.
"""
from __future__ import annotations

import random

from fsdp_tracker_oracle import tracker_run

import symcost
from symcost.passes.parallel import summary


def test_fsdp_model_states_match_fsdp_mem_tracker():
    """Parameters, gradients and AdamW state per rank (``summary(an, sizes=...)["values"]``,
    FSDP2's padding included) equal the tracker's categories, at three random world sizes in
    2..64 and random widths, one DP divides, two it need not (bf16-mixed: fp32 weights under autocast)."""
    precision = "bf16-mixed"
    rng = random.Random(1515)
    an = symcost.trace("mlp", sizes={"DP": 8}, precision=precision, shard="fsdp")
    for i in range(3):
        v = {"B": rng.randint(1, 4), "S": rng.randint(2, 32), "L": rng.randint(2, 4), "DP": rng.randint(2, 64)}
        # the first draw with DP dividing the width (no padding), the others at any width
        v["D"] = v["DP"] * rng.randint(1, 3) if i == 0 else rng.randint(4, 96)
        mem = summary(an, sizes=v)["values"]["memory"]
        got = tracker_run(an.spec, {**an.spec.defaults, **v}, precision)
        after = got["after_step"]
        assert after["Sharded Param"] == mem["params"], (v, "params")
        assert after["Sharded Grad"] == mem["grads"], (v, "grads")
        # (the tracker's OptState holds AdamW's 0-d step tensor per parameter: so does optimizer_state)
        assert after["OptState"] == mem["optimizer_state"] and got["steps"] > 0, (v, "optimizer state")

"""``plan`` prices a row under Megatron-LM's engine as ``report --dp --tp --gpu`` prices that
layout (issue 29; docs/performance-model.md, "plan: layouts ranked by the predicted step").

The oracle is ``report``'s own pricing of the layout's traced rank
(:func:`symcost.passes.performance.predict_dp` on a ``--dp --tp --shard ddp|zero1`` trace under
``--precision megatron-bf16``: Megatron's gradient buckets, its distributed optimizer's step over
the rank's shard, its per-iteration work), which traces the data-parallel engine the plan only
composes. The plan composes its row from its one ``--tp`` trace at L = 2 and 3. One documented
difference is taken out of both sides: the tensor-parallel collectives' latency (report adds
``collective_latency`` per ring step of each TP collective, the plan their bytes over the link
only), so each side's step less its TP collectives must agree to 1e-6. A second is taken out of
report's side: the ``aten.clone`` the engine's hook records in the backward of report's trace when
it takes the vocabulary-parallel embedding's gradient rows (b1c3d0a,
:func:`symcost.frontends.megatron.wrap_in_place`), an op of the hook, not of the model, that the
plan's trace has no engine to record.
"""
from __future__ import annotations

import pytest

import symcost
from symcost.frontends.layout import Layout as MeshLayout
from symcost.hardware.devices import get_device
from symcost.passes.performance import predict, predict_dp
from symcost.passes.plan import plan, trace_for_plan

PREC = "megatron-bf16"
#: small probes, sizes where an A100's kernels (not the host) set the step
SZ = {"H": 8, "D": 8, "L": 4, "V": 64, "S": 16}
BIG = {"H": 16, "D": 96, "L": 6, "V": 20480, "S": 512}
FLAGS = "--log-params-norm --log-num-zeros-in-grad --log-interval 1 --clip-grad 1.0"


def _hook_clone(an, dev, sizes) -> float:
    """Seconds of the engine hook's copy of the embedding gradient's rows in ``an``'s backward (0
    where the hook records none)."""
    ops = {op.index: op for op in an.ops}
    return sum(n["seconds"] for n in predict(an, dev, sizes)["nodes"]
               if n["op"].startswith("aten.clone") and ops[n["index"]].phase != "forward"
               and (ops[n["index"]].module or "").endswith("word_embeddings"))


@pytest.mark.heavy
def test_megatron_rows_are_reports_step_for_the_layout():
    dev = get_device("a100-80gb")
    an = trace_for_plan("megatron-gpt", SZ, PREC, use_cache=False)
    ranks = {s: symcost.trace("megatron-gpt", sizes={**SZ, "B": 2, "DP": 2, "TP": 2}, precision=PREC,
                              layout=MeshLayout(shard=s, tp=True)) for s in ("zero1", "ddp")}
    for flags in (None, FLAGS):
        for dp, b, shard in ((2, 4, "zero1"), (4, 2, "zero1"), (4, 2, "ddp")):
            res = plan(an, BIG, dev, 2 * dp, 10**13, dp * b, PREC, shards=(shard,), checkpoints=("none",),
                       micro_batches=(b,), megatron_args=flags)
            row = next(r for r in res["layouts"] if (r["layout"]["dp"], r["layout"]["tp"]) == (dp, 2))
            assert row["layout"]["microbatches"] == 1 and row["megatron"]["collectives"] >= 1
            want = predict_dp(ranks[shard], dev, {**BIG, "B": b, "DP": dp, "TP": 2}, megatron_args=flags)
            assert want["megatron_iteration"]["seconds"] > 0 and row["time"]["iteration"] > 0
            assert row["time"]["optimizer"] == pytest.approx(want["optimizer_seconds"], rel=1e-9)
            tp_exposed = sum(want["exposed"].values())  # (the TP group's: bytes over the link + alpha)
            tp_exposed += _hook_clone(ranks[shard], dev, {**BIG, "B": b, "DP": dp, "TP": 2})
            assert row["time"]["tp_comm"] < tp_exposed
            assert row["step_seconds"] - row["time"]["tp_comm"] == pytest.approx(want["step_seconds"] - tp_exposed,
                                                                                  rel=1e-6), (dp, b, shard, flags)

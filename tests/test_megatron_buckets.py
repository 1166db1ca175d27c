"""Megatron-LM's gradient buckets and its distributed optimizer's shard in the step-time model
(symcost/passes/megatron_buckets.py, issue 29).

The oracle is Megatron-Core's own bucketing rule, re-implemented here line by line from its
source (NVIDIA/Megatron-LM at d98e8a6):

- ``megatron/core/distributed/param_and_grad_buffer.py`` ``_compute_default_per_buffer_param_layout``
  (DDP: parameters in reverse order, a bucket closed once ``param_end_index - bucket_start_index
  >= bucket_size``, no padding);
- ``megatron/core/optimizer/distrib_optimizer.py`` ``DistributedOptimizer._compute_per_buffer_param_layout``
  (the distributed optimizer: ``pad_param_start`` to 64 elements, ``pad_bucket_end`` to
  lcm(DP, 128), ``megatron/core/optimizer/param_layout.py``);
- ``megatron/training/models/dist_utils.py`` / ``distributed_data_parallel.py``: ``bucket_size =
  max(40000000, 1000000 * dp_size)``, ``None`` without ``overlap_grad_reduce``;
- ``_build_gbuf_range_map``: each bucket split into DP equal contiguous ranges, one per rank.

The parameter order and sizes come from PyTorch: the model built on the meta device,
``named_parameters()``. The priced collectives (ring bytes per rank and α per ring step) are then
checked against the bucket list by hand.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import symcost
from symcost.frontends.layout import Layout


# --- Megatron-Core's rule, transcribed from its source (module docstring) --------------------------

def _pad_to_divisor(x, d):
    return int(math.ceil(x / d) * d)


def megatron_default_layout(numels, bucket_size):
    """param_and_grad_buffer.py _compute_default_per_buffer_param_layout (DDP)."""
    bucket_indices, per_bucket_numel_unpadded = [], []
    param_start_index = bucket_start_index = 0
    bucket_params = set()
    for i, this_numel in enumerate(numels[::-1]):
        param_end_index = param_start_index + this_numel
        bucket_params.add(i)
        if bucket_size is not None and (param_end_index - bucket_start_index) >= bucket_size:
            per_bucket_numel_unpadded.append(param_end_index - bucket_start_index)
            bucket_indices.append((bucket_start_index, param_end_index))
            bucket_start_index = param_end_index
            bucket_params = set()
        param_start_index = param_end_index
    if len(bucket_params) > 0:
        per_bucket_numel_unpadded.append(param_end_index - bucket_start_index)
        bucket_indices.append((bucket_start_index, param_end_index))
    return bucket_indices, per_bucket_numel_unpadded, None


def megatron_distopt_layout(numels, bucket_size, data_parallel_world_size):
    """distrib_optimizer.py _compute_per_buffer_param_layout (no shared embedding: one pipeline stage)."""
    param_index_map = {}
    bucket_indices, per_bucket_numel_unpadded = [], []
    param_start_index = bucket_start_index = 0
    bucket_params = set()
    bucket_id = 0

    def _finalize_bucket(param_end_index, bucket_start_index, bucket_id):
        per_bucket_numel_unpadded.append(param_end_index - bucket_start_index)
        bucket_end_index = _pad_to_divisor(param_end_index, math.lcm(data_parallel_world_size, 128))
        bucket_indices.append((bucket_start_index, bucket_end_index))
        return bucket_end_index, bucket_id + 1

    for i, param_numel in enumerate(numels[::-1]):
        param_start_index = _pad_to_divisor(param_start_index, 64)
        param_end_index = param_start_index + param_numel
        param_index_map[i] = (param_start_index, param_end_index, bucket_id)
        bucket_params.add(i)
        if bucket_size is not None and (param_end_index - bucket_start_index) >= bucket_size:
            bucket_start_index, bucket_id = _finalize_bucket(param_end_index, bucket_start_index, bucket_id)
            bucket_params = set()
            param_start_index = bucket_start_index
        else:
            param_start_index = param_end_index
    if len(bucket_params) > 0:
        _finalize_bucket(param_end_index, bucket_start_index, bucket_id)
    return bucket_indices, per_bucket_numel_unpadded, param_index_map


def megatron_bucket_size(dp, overlap_grad_reduce):
    size = max(40000000, 1000000 * dp)
    return size if overlap_grad_reduce else None


def rank_ranges(bucket_indices, param_index_map, dp):
    """_build_gbuf_range_map: per rank, the (tensors, elements) of its ranges of every bucket."""
    out = []
    for r in range(dp):
        t = e = 0
        for start, end in bucket_indices:
            size = (end - start) // dp
            lo, hi = start + r * size, start + (r + 1) * size
            for s, f, _ in param_index_map.values():
                if f > lo and s < hi and f > s:
                    t += 1
                    e += min(f, hi) - max(s, lo)
        out.append((t, e))
    return out


# --- the layout against the rule, at random parameter lists -----------------------------------------

def test_layout_is_megatrons_rule_at_random_sizes():
    from symcost.passes import megatron_buckets as mb

    rng = random.Random(1729)
    for _ in range(200):
        numels = [rng.choice((rng.randint(1, 300), rng.randint(1, 5000), rng.randint(1, 10**5)))
                  for _ in range(rng.randint(1, 60))]
        dp = rng.randint(1, 80)
        size = rng.choice((None, rng.randint(1, sum(numels)), rng.randint(1, 2 * max(numels))))
        for distributed in (False, True):
            got = mb.layout(numels, size, dp, distributed)
            if distributed:
                idx, unpadded, _ = megatron_distopt_layout(numels, size, dp)
            else:
                idx, unpadded, _ = megatron_default_layout(numels, size)
            assert [(b["start"], b["end"]) for b in got] == idx, (numels, dp, size, distributed)
            assert [b["unpadded"] for b in got] == unpadded
            assert all(b["elements"] % (math.lcm(dp, 128) if distributed else 1) == 0 for b in got)
    for dp in (1, 8, 40, 41, 1024):  # the default size, and none without --overlap-grad-reduce
        assert mb.bucket_size(dp, True) == megatron_bucket_size(dp, True)
        assert mb.bucket_size(dp, False) is None and mb.bucket_size(dp, True, bucketing=False) is None


# --- a traced Megatron rank: buckets, priced bytes and latency, the optimizer's shard -------------

@pytest.fixture(scope="module")
def megatron_ranks():
    sizes = {"B": 2, "S": 16, "H": 2, "D": 8, "L": 2, "V": 64, "DP": 4}
    return {shard: symcost.trace("megatron-gpt", sizes=sizes, precision="megatron-bf16", layout=Layout(shard=shard))
            for shard in ("ddp", "zero1")}


@pytest.mark.parametrize("shard", ["ddp", "zero1"])
def test_traced_rank_prices_megatrons_buckets(megatron_ranks, shard, monkeypatch):
    """At random sizes never traced (the formulas bound at new H, D, L, V, DP) the engine's buckets
    are the rule's over PyTorch's ``named_parameters()`` of the model built there, with a small
    bucket size so that several buckets form (the rule is the same at Megatron's 40M); the step's
    data-parallel bytes are the buckets' ring bytes (fp32 gradients, bf16 parameters: --bf16's
    ``accumulate_allreduce_grads_in_fp32``), its α one collective per bucket, and the distributed
    optimizer's step is over the busiest rank's range."""
    from symcost.frontends.models import resolve
    from symcost.hardware.devices import get_device
    from symcost.passes import megatron_buckets as mb
    from symcost.passes.parallel import step_time
    from symcost.passes.performance import efficiency_of, predict_dp
    from symcost.render.data_parallel import bucket_rows
    from symcost.render.report import human

    an = megatron_ranks[shard]
    dev = get_device("h100-sxm")
    eff = efficiency_of(dev)
    rng = random.Random(7 + len(shard))
    spec = resolve("megatron-gpt")
    for _ in range(2):
        v = {"B": 2, "S": 16, "H": rng.randint(2, 4), "D": 8 * rng.randint(1, 3), "L": rng.randint(2, 5),
             "V": rng.randint(50, 300), "DP": rng.choice((2, 3, 4, 8))}
        with torch.device("meta"):
            model = spec.build(v)
        numels = [p.numel() for _, p in model.named_parameters() if p.requires_grad]
        small = rng.randint(max(numels) // 2, sum(numels) // 2)
        monkeypatch.setattr(mb, "BUCKET_MIN", small)
        monkeypatch.setattr(mb, "BUCKET_PER_RANK", 1)
        dp, zero1 = v["DP"], shard == "zero1"
        for overlap in ("none", "backward"):
            size = megatron_bucket_size(1, overlap != "none") and small  # (max(small, 1·DP) = small)
            idx, _, index_map = (megatron_distopt_layout(numels, size, dp) if zero1
                                 else megatron_default_layout(numels, size))
            st = step_time(an, dev, v, overlap)
            b = st["buckets"]
            assert b["buffers"][0]["buckets"] == [e - s for s, e in idx]
            # ring bytes per rank: DDP all-reduces fp32 buckets; zero1 reduce-scatters them and
            # all-gathers the bf16 parameters (before the next forward)
            elems = sum(e - s for s, e in idx)
            if zero1:
                want = {"backward": 4 * elems * (dp - 1) / dp, "forward": 2 * elems * (dp - 1) / dp}
            else:
                want = {"backward": 4 * elems * 2 * (dp - 1) / dp, "forward": 0.0}
            assert st["bytes"] == pytest.approx(want, rel=1e-12), (v, overlap)
            # the report's per-rank table shows these priced bytes beside the trace's bf16 all-reduce
            rows = {r[0].strip(): r for r in bucket_rows(st)["DP"]}
            priced = ({"reduce_scatter": want["backward"], "all_gather": want["forward"]} if zero1
                      else {"all_reduce": want["backward"]})
            assert {k: r[2] for k, r in rows.items()} == {f"over the DP group: {k} (priced)": human(x, "B")
                                                          for k, x in priced.items()}, rows
            assert all(f"{elems:,} x" in r[1] and f"{len(idx)} bucket(s)" in r[1] for r in rows.values()), rows
            p = predict_dp(an, dev, v, overlap)
            steps = len(idx) * (2 * (dp - 1))  # (an all-reduce 2(n-1); a reduce-scatter and an all-gather n-1 each)
            assert p["collectives"] == len(idx) * (2 if zero1 else 1)
            assert p["latency_seconds"] == pytest.approx(steps * eff.collective_latency, rel=1e-12)
            if zero1:
                ranks = rank_ranges(idx, index_map, dp)
                t, e = max(t for t, _ in ranks), max(e for _, e in ranks)
                # the H100's host runs ahead: the step is max(host per tensor, device per byte)
                want_opt = max(eff.optimizer_per_tensor * t, eff.optimizer_per_byte * 2 * e)
                assert p["optimizer_seconds"] == pytest.approx(want_opt, rel=1e-12)
                assert t < len(numels) or dp == 1
            else:  # (DDP's optimizer steps over every parameter on every rank: as without buckets)
                assert p["optimizer_seconds"] == pytest.approx(
                    max(eff.optimizer_per_tensor * len(numels),
                        eff.optimizer_per_byte * 2 * sum(numels)), rel=1e-12)


@pytest.mark.parametrize("shard", ["ddp", "zero1"])
def test_interleaved_chunks_have_their_own_buckets(megatron_ranks, shard, monkeypatch):
    """An interleaved rank's v model chunks (plan's interleaved rows): Megatron wraps each chunk in
    a DistributedDataParallel of its own (megatron/training/models/dist_utils.py at d98e8a6, one
    per ``model_chunk``, ``disable_bucketing = model_chunk_idx > 0``), so each has its own buffers:
    the first chunk bucketed by the rule, every later one a single bucket. Oracle: the model built
    at random sizes on the meta device, ``named_parameters()`` cut as Megatron's chunks hold them
    (the embeddings with the first chunk's first blocks, ``layers.k`` in chunk k·v // L, the final
    norm and output layer with the last), the rule above applied per chunk."""
    from symcost.frontends.models import resolve
    from symcost.passes import megatron_buckets as mb

    an = megatron_ranks[shard]
    rng = random.Random(31 + len(shard))
    spec = resolve("megatron-gpt")
    for _ in range(3):
        v = rng.choice((2, 3))
        env = {"B": 2, "S": 16, "H": rng.randint(2, 4), "D": 8 * rng.randint(1, 3), "L": v * rng.randint(1, 3),
               "V": rng.randint(50, 300), "DP": rng.choice((2, 3, 4, 8))}
        with torch.device("meta"):
            model = spec.build(env)
        named = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
        parts = [[] for _ in range(v)]
        seen = False
        for n, k in named:
            if n.startswith("layers."):
                seen = True
                parts[int(n.split(".")[1]) * v // env["L"]].append(k)
            else:
                parts[v - 1 if seen else 0].append(k)
        small = rng.randint(1, max(parts[0]))
        monkeypatch.setattr(mb, "BUCKET_MIN", small)
        monkeypatch.setattr(mb, "BUCKET_PER_RANK", 1)
        dp, zero1 = env["DP"], shard == "zero1"
        for overlap in ("none", "backward"):
            want, shard_t, shard_e = [], 0, 0
            for c, numels in enumerate(parts):
                size = small if overlap != "none" and c == 0 else None
                idx, _, index_map = (megatron_distopt_layout(numels, size, dp) if zero1
                                     else megatron_default_layout(numels, size))
                want.append([e - s for s, e in idx])
                if zero1:
                    ranks = rank_ranges(idx, index_map, dp)
                    shard_t += max(t for t, _ in ranks)
                    shard_e += max(e for _, e in ranks)
            got = mb.engine(an, an.bind(**env), {"DP": dp}, overlap, chunks=v)
            assert [b["buckets"] for b in got["buffers"]] == want, (env, v, overlap)
            assert [b["chunk"] for b in got["buffers"]] == list(range(v))
            assert got["collectives"] == sum(map(len, want)) * (2 if zero1 else 1)
            if zero1:
                assert (got["optimizer_shard"]["tensors"], got["optimizer_shard"]["elements"]) == (shard_t, shard_e)
            one = mb.engine(an, an.bind(**env), {"DP": dp}, overlap)  # (v = 1: the whole rank as one chunk, as before)
            assert one["buffers"][0]["elements"] == sum(map(sum, parts)) and "chunk" not in one["buffers"][0]


def test_report_text_labels_the_bound_and_megatrons_engine(megatron_ranks, capsys):
    """report --dp --gpu's text under megatron-*: the roofline's step is labelled the lower bound
    (a reader took it for the step), its overlap explained as Megatron's buckets
    (--overlap-grad-reduce), not FSDP2's all-gathers and prefetch, and one line gives Megatron's
    per-iteration work that the prediction includes, at the prediction's own seconds."""
    from symcost.commands.report import _render_iteration
    from symcost.hardware.devices import get_device
    from symcost.passes.parallel import step_time, summary
    from symcost.passes.performance import predict_dp
    from symcost.render.data_parallel import render_parallel

    an, dev = megatron_ranks["ddp"], get_device("h100-sxm")
    v = {"B": 2, "S": 16, "H": 3, "D": 16, "L": 3, "V": 100, "DP": 2}
    st, p = step_time(an, dev, v, "backward"), predict_dp(an, dev, v, "backward")
    render_parallel(an, v, summary(an, "megatron-bf16", "adamw", v), width=10_000, step=st)
    _render_iteration(p)
    out = capsys.readouterr().out
    assert "lower bound (roofline, fused; not the predicted step)" in out and "step time per rank" not in out, out
    assert "FSDP2" not in out and "prefetch" not in out and "(--overlap-grad-reduce)" in out, out
    it = p["megatron_iteration"]
    assert it["seconds"] > 0 and f"included in the prediction: {it['seconds'] * 1e3:.4g} ms per optimizer step" in out
    assert "over the DP group: all_reduce (priced)" in out, out


def test_overlap_defaults_to_megatrons_under_its_engine(megatron_ranks):
    """``--overlap`` left out: Megatron-LM's engine (megatron-* with ddp/zero1) runs without
    ``--overlap-grad-reduce`` and ``--overlap-param-gather`` (both ``store_true``, ``default=False``
    in megatron/training/arguments.py at d98e8a6), so the CLI's default there is ``none``;
    PyTorch's engines keep ``backward``; a given ``--overlap`` wins. The pipeline commands, which
    have no analysis at hand, decide from the precision, shard and ``--fsdp-mp``."""
    from symcost.commands._options import overlap_of

    for shard, an in megatron_ranks.items():
        assert overlap_of({}, an) == "none", shard
        for given in ("backward", "full", "none"):
            assert overlap_of({"symcost.overlap": given}, an) == given
    assert overlap_of({}, None, "megatron-fp16", "ddp") == overlap_of({}, None, "megatron-bf16", "zero1") == "none"
    assert overlap_of({}, None, "megatron-bf16", "fsdp") == "backward"  # (PyTorch's FSDP2 under a megatron policy)
    assert overlap_of({}, None, "megatron-bf16", "ddp", ("bf16", "fp32")) == "backward"
    assert overlap_of({}, None, "bf16-mixed", "ddp") == overlap_of({}, None, None, None) == "backward"


@pytest.mark.heavy
def test_step_grows_by_the_items(megatron_ranks, monkeypatch):
    """``predict_dp``'s step grows by exactly the items' seconds (``--overlap none``), and an
    optimizer step of K micro-batches counts the per-iteration items once and the loss checks K
    times (:func:`symcost.passes.accumulation.accumulated`). On this file's zero1 rank (the
    items' own checks: tests/test_megatron_iteration.py, whose module trace of the same rank this
    replaced: one cold trace less)."""
    from test_megatron_iteration import RECIPE, _sizes_and_params

    from symcost.hardware.devices import get_device
    from symcost.passes import megatron_iteration as mi
    from symcost.passes.accumulation import accumulated
    from symcost.passes.performance import predict_dp

    zero1 = megatron_ranks["zero1"]
    dev = get_device("h100-sxm")
    v, _, _ = _sizes_and_params(5)
    p = predict_dp(zero1, dev, v, "none", megatron_args=RECIPE)
    it = p["megatron_iteration"]
    assert it["flags"]["log_params_norm"] and set(it["items"]) >= {"params_norm", "count_zeros", "loss_check"}
    with monkeypatch.context() as m:
        m.setattr(mi, "work", lambda *a, **k: [])
        q = predict_dp(zero1, dev, v, "none", megatron_args=RECIPE)
    assert p["step_seconds"] - q["step_seconds"] == pytest.approx(it["seconds"], rel=1e-9)
    each = it["per_micro_batch"] + it["per_micro_batch_backward"]  # (the loss checks, the main-gradient adds)
    assert it["per_micro_batch"] > 0 and it["per_micro_batch_backward"] > 0
    assert p["iteration_seconds"] == pytest.approx(it["seconds"] - each)
    K = 3
    grow = accumulated(p, K, "zero1", "none", p["optimizer_seconds"])["step_seconds"] - \
        accumulated(q, K, "zero1", "none", q["optimizer_seconds"])["step_seconds"]
    assert grow == pytest.approx(it["seconds"] + (K - 1) * each, rel=1e-9)

"""Megatron-LM's per-iteration work in the step-time model (symcost/passes/megatron_iteration.py,
issue 29).

The oracle is Megatron-LM's source (NVIDIA/Megatron-LM at d98e8a6) read by hand, with the
parameters from PyTorch (the model built on the meta device, ``named_parameters()``):

- ``clip_grads.py`` ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32``: one
  ``multi_tensor_l2norm`` over the optimizer's fp32 grads (4 bytes per element read), one
  ``multi_tensor_scale_tensor`` reading and writing them; ``count_zeros_fp32``: per grad tensor
  ``numel - count_nonzero`` added up (three kernels a tensor);
- ``optimizer.py`` ``_copy_model_grads_to_main_grads`` (``main_grad.float()``: a cast only from a
  16-bit buffer, fp16) and ``_copy_main_params_to_model_params`` (fp32 -> 16-bit: 4 + 2 bytes per
  element; ``copy_`` per tensor under bf16, one ``multi_tensor_scale`` under fp16);
- ``param_and_grad_buffer.py`` ``start_grad_sync``: the bucket scaled by 1/DP (read and written);
  ``check_grads``: its norm (read);
- the distributed optimizer's shard: each bucket of the buffer (parameters in reverse order,
  starts padded to 64 elements, the end to lcm(DP, 128)) split into DP equal ranges, the busiest
  rank's elements (``_build_gbuf_range_map``).

Each term is then priced by hand from the device's efficiency figures.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import symcost

RECIPE = "--log-params-norm --log-num-zeros-in-grad --log-interval 1 --clip-grad 1.0 --lr 1e-4"
# (the check on a traced rank, that predict_dp's step grows by the items, is
# tests/test_megatron_buckets.py test_step_grows_by_the_items: on that file's zero1 trace)


class _Rank:
    """A rank's parameters as :func:`work` and the bucket layout read them (``param_shapes`` in
    ``named_parameters()`` order, ``precision``, ``parallel``), from PyTorch's model on the meta
    device: what a trace folds (tests/test_megatron_buckets.py checks the traced ones)."""

    def __init__(self, model, precision, parallel):
        self.param_shapes = {n: (tuple(p.shape), "torch.bfloat16", 1) for n, p in model.named_parameters()}
        self.precision, self.parallel, self.ops, self.frozen, self.param_shards = precision, parallel, [], set(), {}


def _shard_elements(numels, dp):
    """The distributed optimizer's busiest rank over one bucket (no --overlap-grad-reduce)."""
    spans, start = [], 0
    for n in numels[::-1]:
        start = math.ceil(start / 64) * 64
        spans.append((start, start + n))
        start += n
    end = math.ceil(start / math.lcm(dp, 128)) * math.lcm(dp, 128)
    part = end // dp
    best = (0, 0)
    for r in range(dp):
        lo, hi = r * part, (r + 1) * part
        held = [min(b, hi) - max(a, lo) for a, b in spans if a < hi and b > lo]
        best = (max(best[0], sum(held)), max(best[1], len(held)))
    return best + (end,)


def test_parse_args():
    from symcost.passes import megatron_iteration as mi

    f = mi.parse_args(RECIPE)
    assert f["log_params_norm"] and f["log_num_zeros_in_grad"] and f["log_interval"] == 1 and f["clip_grad"] == 1.0
    assert mi.parse_args("--clip-grad=0 --no-check-for-nan-in-loss-and-grad")["clip_grad"] == 0.0
    assert not mi.parse_args("--no-check-for-nan-in-loss-and-grad")["check_for_nan_in_loss_and_grad"]
    assert mi.parse_args(None) == mi.DEFAULTS
    with pytest.raises(symcost.SymcostError):
        mi.parse_args("--log-interval often")


def test_megatron_args_warns_of_the_flags_it_ignores():
    """``--megatron-args`` names, in one stderr line, the flags it does not read, each of which
    leaves :func:`parse_args` unchanged when dropped while every flag it does not name changes
    it; Megatron's overlap flags point at symcost's ``--overlap``. Parsed by the CLI before the
    model (an unknown one: nothing traced)."""
    from click.testing import CliRunner

    from symcost.cli import main
    from symcost.passes import megatron_iteration as mi

    text = "--bogus-flag 3 --overlap-grad-reduce --clip-grad 0 --lr 1e-4 --loss-scale -1 --log-params-norm"
    ignored = mi.ignored_args(text)
    assert ignored == ["--bogus-flag", "--overlap-grad-reduce", "--lr"], ignored
    words = text.split()
    for i, w in enumerate(words):  # (each flag with its value words: dropped, parse_args changes iff it is read)
        if w.startswith("--"):
            j = next((k for k in range(i + 1, len(words)) if words[k].startswith("--")), len(words))
            same = mi.parse_args(" ".join(words[:i] + words[j:])) == mi.parse_args(text)
            assert same == (w in ignored), w
    assert mi.ignored_args(RECIPE) == ["--lr"] and mi.ignored_warning("--clip-grad 0") is None
    r = CliRunner().invoke(main, ["report", "no-such-model", "--megatron-args", text])
    warn = [ln for ln in r.stderr.splitlines() if "--megatron-args ignores" in ln]
    assert len(warn) == 1 and "--bogus-flag, --overlap-grad-reduce, --lr" in warn[0], r.stderr
    assert "--overlap-grad-reduce: symcost's --overlap backward|full sets that" in warn[0], warn


def _sizes_and_params(seed):
    from symcost.frontends.models import resolve

    rng = random.Random(seed)
    v = {"B": 2, "S": 16, "H": rng.randint(2, 4), "D": 8 * rng.randint(1, 3), "L": rng.randint(2, 5),
         "V": rng.randint(50, 300), "DP": rng.choice((2, 3, 8))}
    with torch.device("meta"):
        model = resolve("megatron-gpt").build(v)
    return v, model, [p.numel() for _, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("key", [("megatron-bf16", "ddp"), ("megatron-bf16", "zero1"), ("megatron-fp16", "ddp")])
def test_items_are_megatrons_at_random_sizes(key):
    """At random sizes, each item's bytes and kernels are the source's (module docstring) over
    PyTorch's parameters, and each is priced by hand."""
    from symcost.hardware.devices import get_device
    from symcost.passes import megatron_buckets as mb
    from symcost.passes import megatron_iteration as mi
    from symcost.passes.performance import efficiency_of

    prec, shard = key
    dev = get_device("h100-sxm")
    eff = efficiency_of(dev)
    v, model, numels = _sizes_and_params(11 + len(shard) + len(prec))
    an = _Rank(model, prec, shard)
    P, T, dp = sum(numels), len(numels), v["DP"]
    fp16, is_zero1 = prec == "megatron-fp16", shard == "zero1"
    Eg, Tg, padded = _shard_elements(numels, dp) if is_zero1 else (P, T, P)
    gbuf = 2 if fp16 else 4  # (--bf16: fp32 main grads in the buffer; --fp16: 16-bit)
    ranks = {"DP": dp, "ranks": dp}
    # (without --overlap-grad-reduce: one bucket of the whole buffer)
    buckets = mb.engine(an, {}, ranks, "none")
    flags = mi.parse_args(RECIPE)
    items = {i["name"]: i for i in mi.work(an, {}, ranks, buckets, flags)}
    assert items["grad_scaling"]["read"] == items["grad_scaling"]["written"] == gbuf * padded
    assert items["grad_norm"]["read"] == 4 * Eg
    assert items["clip"]["read"] == items["clip"]["written"] == 4 * Eg
    assert items["count_zeros"]["read"] == 4 * Eg and items["count_zeros"]["kernels"] == 3 * Tg + 3
    assert items["copy_main_to_model"]["read"] == 4 * Eg and items["copy_main_to_model"]["written"] == 2 * Eg
    assert items["copy_main_to_model"]["kernels"] == (1 if fp16 else Tg)
    assert items["params_norm"]["read"] == (2 * P if fp16 else 4 * Eg)
    if fp16:  # dynamic loss scale: no NaN checks; the cast to fp32 main grads and the unscale
        assert "check_grads" not in items and "loss_check" not in items
        assert (items["copy_to_main_grads"]["read"], items["copy_to_main_grads"]["written"]) == (2 * P, 4 * P)
        assert items["unscale_check_inf"]["read"] == items["unscale_check_inf"]["written"] == 4 * P
    else:
        assert items["check_grads"]["read"] == 4 * padded and items["check_grads"]["syncs"] == 2
        assert items["copy_to_main_grads"]["kernels"] == 0 and "unscale_check_inf" not in items
    assert padded >= P and (Eg < P) == is_zero1
    # the backward post-hook's param.main_grad.add_(param.grad.data) (distributed_data_parallel.py
    # _make_backward_post_hook), every micro-batch: the main grad (the buffer's dtype) read and
    # written, the 16-bit grad read; with gradient-accumulation fusion (the default) the linear
    # weights' GEMMs accumulate into the buffer themselves, so the 1-D tensors only; without it
    # (--no-gradient-accumulation-fusion) every tensor
    dims = [p.dim() for _, p in model.named_parameters() if p.requires_grad]
    one_d = [n for n, d in zip(numels, dims) if d < 2]
    add = items["main_grad_add"]
    assert (add["kernels"], add["read"], add["written"], add["per"]) == (
        len(one_d), (gbuf + 2) * sum(one_d), gbuf * sum(one_d), "micro-batch-backward")
    unfused = {i["name"]: i for i in mi.work(an, {}, ranks, buckets, mi.parse_args(RECIPE + " --no-gradient-"
                                                                                    "accumulation-fusion"))}
    add = unfused["main_grad_add"]
    assert (add["kernels"], add["read"], add["written"]) == (T, (gbuf + 2) * P, gbuf * P)
    assert {k: v for k, v in unfused.items() if k != "main_grad_add"} == {k: v for k, v in items.items()
                                                                          if k != "main_grad_add"}
    # priced as an item of its own, every micro-batch: max(host, device)
    h = add["ops"] * eff.host_per_op("forward") + add["kernels"] * eff.host_launch
    d = (add["read"] + add["written"]) / (dev.bandwidth * eff.memory) + add["kernels"] * eff.kernel_gap
    three = mi.price([add], dev, 3, flags)
    assert three["seconds"] == pytest.approx(3 * max(h, d), rel=1e-12)
    assert three["per_micro_batch_backward"] == pytest.approx(max(h, d), rel=1e-12) and three["per_micro_batch"] == 0
    # priced by hand: max(host, device) + the all-reduce's ring latency over the grad-stats group
    n = dp if is_zero1 else 1  # (every rank with the distributed optimizer, else the model-parallel group)
    want = max(6 * eff.host_per_op("forward") + 6 * eff.host_launch,
               4 * Eg / (dev.bandwidth * eff.memory) + 6 * eff.kernel_gap) + 2 * (n - 1) * eff.collective_latency
    priced = mi.price(list(items.values()), dev, 1, flags)
    assert {i["name"]: i["seconds"] for i in priced["items"]}["grad_norm"] == pytest.approx(want, rel=1e-12)
    assert priced["seconds"] == pytest.approx(sum(i["seconds"] for i in priced["items"]), rel=1e-12)


def test_a_pipeline_rank_of_two_chunks():
    """A rank of two model chunks (an interleaved pipeline's virtual stages, not the last): one
    optimizer over both (the norms, the zeros count and the copies over every parameter of the
    two, the statistics once), each chunk's bucket scaled and checked, no loss check or loss
    all-reduce (``is_pp_last_stage``); the model-parallel group is TP × PP."""
    from symcost.passes import megatron_iteration as mi

    v, model, numels = _sizes_and_params(3)
    whole = _Rank(model, "megatron-bf16", "ddp")
    names = list(whole.param_shapes)
    cut = len(names) // 2
    a, b = _Rank(model, "megatron-bf16", "ddp"), _Rank(model, "megatron-bf16", "ddp")
    a.param_shapes = {k: whole.param_shapes[k] for k in names[:cut]}
    b.param_shapes = {k: whole.param_shapes[k] for k in names[cut:]}
    ranks = {"DP": 2, "TP": 1, "PP": 4, "ranks": 8}
    flags = mi.parse_args(RECIPE)
    one = {i["name"]: i for i in mi.work(whole, {}, ranks, None, flags)}
    two = {i["name"]: i for i in mi.work(a, {}, ranks, None, flags, [(b, {}, None)], last_stage=False)}
    P, T = sum(numels), len(numels)
    assert two["grad_norm"]["read"] == 4 * P and two["count_zeros"]["kernels"] == 3 * T + 3
    assert two["copy_main_to_model"]["kernels"] == T and two["params_norm"]["read"] == 4 * P
    assert two["grad_scaling"]["kernels"] == 2 and two["check_grads"]["syncs"] == 4  # (a bucket per chunk)
    assert two["stats_reduce"] == one["stats_reduce"] and two["stats_reduce"]["collectives"] == [["MP", 4, 3]]
    assert "loss_check" not in two and "loss_reduce" not in two and "loss_check" in one

"""Megatron-LM's per-iteration work outside the traced forward/backward, as the step-time model prices it.

A ``megatron-*`` trace (docs/memory.md, "Policies of training frameworks") records one
micro-batch's forward and backward, the data-parallel engine's collectives
(:mod:`symcost.passes.megatron_buckets`) and, priced apart, an AdamW step. Megatron-LM's
``train_step`` and training loop run more every iteration, on the device and on the host, much
of it behind a device-to-host synchronisation (``.item()``, ``bool()`` of a CUDA tensor, a timer's
``torch.cuda.synchronize``). From the source (NVIDIA/Megatron-LM at d98e8a6, 2026-08-22;
``megatron/training/training.py`` ``train_step`` and ``train``'s loop, ``training_log``;
``megatron/core/optimizer/optimizer.py`` ``MixedPrecisionOptimizer.step`` / ``prepare_grads`` /
``step_with_ready_grads``; ``megatron/core/optimizer/distrib_optimizer.py``;
``megatron/core/optimizer/clip_grads.py``; ``megatron/core/distributed/param_and_grad_buffer.py``
``start_grad_sync`` / ``check_grads``; ``megatron/training/utils/common_utils.py``
``calc_params_l2_norm`` / ``reduce_max_stat_across_model_parallel_group``; ``pretrain_gpt.py``
``loss_func``), each item only where its flag turns it on (:data:`DEFAULTS`: Megatron's argparse
defaults, ``megatron/training/arguments.py``):

===========================  =====================================================================
item                         what runs (per iteration unless said)
===========================  =====================================================================
main_grad_add (per micro-b.) the backward post-hook of each parameter
                             (``DistributedDataParallel._make_backward_post_hook``):
                             ``param.main_grad.add_(param.grad.data)``, the gradient accumulated into
                             the main-gradient buffer, every micro-batch in the backward; with
                             gradient-accumulation fusion (Megatron's default) the linear layers'
                             weight-gradient GEMMs accumulate into it themselves, so only the other
                             tensors (taken as the 1-D ones: biases, norms) are added;
                             ``--no-gradient-accumulation-fusion`` (the functional tests') and
                             Megatron-LM of 2021 (a8d172b, no such fusion) add every one
grad_scaling                 ``bucket.grad_data *= 1/DP`` per bucket before its collective (DP > 1)
check_grads                  ``--check-for-nan-in-loss-and-grad`` (on by default; off under fp16's
                             dynamic loss scale): per bucket the gradient buffer's L2 norm, then
                             ``isnan``/``isinf``, each tested on the host (2 syncs)
loss_check (per micro-b.)    the same flag: ``isnan``/``isinf`` of the loss, tested on the host
copy_to_main_grads           ``main_param.grad = main_grad.float()`` per optimizer tensor (a cast
                             kernel only where the buffer is 16-bit: fp16; a slice view with the
                             distributed optimizer)
unscale_check_inf            fp16: ``_amp_foreach_non_finite_check_and_unscale_`` over the main
                             grads, ``found_inf`` all-reduced (MAX) and ``.item()``
grad_norm                    ``--clip-grad`` > 0 (1.0 by default): ``multi_tensor_l2norm`` over the
                             grads, squared, all-reduced, square-rooted
clip                         the same: coefficient, ``clamp_max_``, ``multi_tensor_scale_tensor``
                             over the grads (read and written)
count_zeros                  ``--log-num-zeros-in-grad``: per optimizer tensor ``numel -
                             count_nonzero(grad)`` added up, all-reduced, ``.item()``
copy_main_to_model           after the inner step: the fp32 main params into the 16-bit model
                             params (``copy_`` per tensor; fp16 one ``multi_tensor_scale``; the
                             distributed optimizer its shard into the parameter buffer)
stats_reduce                 ``update_successful``, ``grad_norm`` (and ``num_zeros``) each a tensor
                             all-reduced over the model-parallel group and ``.item()``-ed
loss_reduce                  the micro-batches' ``[loss, tokens]`` stacked, summed, all-reduced over
                             the data-parallel group, divided
loss_scale_item              ``optimizer.get_loss_scale().item()`` after ``train_step``
params_norm                  ``--log-params-norm``: ``calc_params_l2_norm``: eight bucket norms
                             (``multi_tensor_l2norm`` of the fp32 main params, or the fp16
                             params), six all-reduces, ``.item()``
training_log                 every ``--log-interval`` iterations: the learning rate's reduce-max,
                             the loss ``.item()``, and the ``interval-time`` timer's ``elapsed``
                             (``barrier=True``: two world barriers and two
                             ``torch.cuda.synchronize``)
===========================  =====================================================================

Each item is priced as the performance model prices ops (docs/performance-model.md, "Megatron's
per-iteration work"): its bytes at the achievable bandwidth plus ``kernel_gap`` per kernel on
the device, ``host_per_op`` per aten op plus ``host_launch`` per kernel on the host, and each
small all-reduce's ring latency 2(n−1)·``collective_latency``; an item ends at max(host, device)
plus its latency (the syncs between the items leave nothing of one item to overlap with the
next). What is not priced, for want of a figure: the Python of the loop and of ``training_log``
that issues no aten op (TensorBoard writes, the parameter filters, the scheduler), and the host's
wait at each sync beyond its op.

Nothing here traces: it reads the rank's parameters (:mod:`symcost.passes.megatron_buckets`).
"""
from __future__ import annotations

import shlex
from typing import Any, Mapping, Sequence

#: Megatron-LM's argparse defaults of the flags that change the per-iteration work
#: (megatron/training/arguments.py at d98e8a6: --clip-grad 1.0, --log-interval 100,
#: --no-check-for-nan-in-loss-and-grad store_false, the rest store_true)
DEFAULTS = {"clip_grad": 1.0, "log_interval": 100, "log_params_norm": False, "log_num_zeros_in_grad": False,
            "check_for_nan_in_loss_and_grad": True, "loss_scale": None, "gradient_accumulation_fusion": True,
            # (the MoE dispatcher: None, not given, prices the traced alltoall dispatcher, docs/moe.md;
            # Megatron's flex backend defaults to deepep)
            "moe_token_dispatcher_type": None, "moe_flex_dispatcher_backend": "deepep", "moe_enable_deepep": False}
#: the source commit every item cites
SOURCE = "NVIDIA/Megatron-LM d98e8a6"


#: The flags :func:`parse_args` reads (the others do not change the per-iteration work).
READ = ("--clip-grad", "--log-interval", "--loss-scale", "--log-params-norm", "--log-num-zeros-in-grad",
        "--no-check-for-nan-in-loss-and-grad", "--no-gradient-accumulation-fusion",
        # (the MoE token dispatcher: the EP group's exchanges, symcost.passes.hybrid_ep)
        "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-enable-deepep")


def parse_args(text: str | None) -> dict[str, Any]:
    """Megatron-LM command-line flags (``"--log-params-norm --clip-grad 0 --log-interval 1"``) ->
    :data:`DEFAULTS` updated with them. Flags that do not change the per-iteration work are
    ignored (a recipe's whole argument list may be given).

    Raises:
        SymcostError: a value flag without a number.
    """
    from symcost.errors import SymcostError

    flags = dict(DEFAULTS)
    words = shlex.split(text or "")
    values = {"--clip-grad": ("clip_grad", float), "--log-interval": ("log_interval", int),
              "--loss-scale": ("loss_scale", float),
              "--moe-token-dispatcher-type": ("moe_token_dispatcher_type", str),
              "--moe-flex-dispatcher-backend": ("moe_flex_dispatcher_backend", str)}
    switches = {"--log-params-norm": ("log_params_norm", True), "--log-num-zeros-in-grad": ("log_num_zeros_in_grad", True),
                "--no-check-for-nan-in-loss-and-grad": ("check_for_nan_in_loss_and_grad", False),
                "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", False),
                "--moe-enable-deepep": ("moe_enable_deepep", True)}
    i = 0
    while i < len(words):
        w = words[i]
        key, _, inline = w.partition("=")
        if key in values:
            name, cast = values[key]
            raw = inline if inline else (words[i + 1] if i + 1 < len(words) else None)
            if raw is None and cast is str:
                raise SymcostError(f"Megatron flag {key} takes a value")
            try:
                flags[name] = cast(raw)
            except (TypeError, ValueError):
                raise SymcostError(f"Megatron flag {key} takes a number, got {raw!r}") from None
            i += 1 if inline else 2
            continue
        if key in switches:
            name, value = switches[key]
            flags[name] = value
        i += 1
    return flags


#: Megatron-LM flags that symcost's own options set: ``--overlap backward`` is Megatron's
#: ``--overlap-grad-reduce``, ``--overlap full`` adds ``--overlap-param-gather``
#: (docs/performance-model.md, "Megatron-LM's engine").
SET_BY_OPTIONS = {"--overlap-grad-reduce": "--overlap backward|full", "--overlap-param-gather": "--overlap full"}


def ignored_args(text: str | None) -> list[str]:
    """The flags of ``text`` (Megatron-LM's command line) that :func:`parse_args` does not read, in
    order, each once: a word that starts with ``-`` and is not a number (``--loss-scale -1``'s
    value), the value words after it skipped. ``"--bogus-flag 3 --clip-grad 0"`` -> ``["--bogus-flag"]``."""
    out: list[str] = []
    for w in shlex.split(text or ""):
        key = w.partition("=")[0]
        if key.startswith("-") and not _number(key) and key not in READ and key not in out:
            out.append(key)
    return out


def _number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def ignored_warning(text: str | None) -> str | None:
    """One warning line naming the flags of ``text`` that the per-iteration model ignores
    (:func:`ignored_args`), and for Megatron's overlap flags the symcost option that sets them
    (:data:`SET_BY_OPTIONS`); None where every flag is read."""
    ignored = ignored_args(text)
    if not ignored:
        return None
    set_by = [f"{f}: symcost's {SET_BY_OPTIONS[f]} sets that" for f in ignored if f in SET_BY_OPTIONS]
    return ("warning: --megatron-args ignores " + ", ".join(ignored) + " (only the flags that change Megatron's "
            "per-iteration work are read: " + ", ".join(sorted(READ)) + ")" + ("; " + "; ".join(set_by) if set_by else ""))


def _dims(an, env) -> list[int]:
    """The number of dimensions of each trained parameter of ``an`` in :func:`symcost.passes.megatron_buckets._typed`'s
    order (a folded run unfolded block by block, as there)."""
    import sympy

    frozen = getattr(an, "frozen", None) or set()
    out, entries = [], [(len(shape), rep) for name, (shape, _, rep) in an.param_shapes.items() if name not in frozen]
    i = 0
    while i < len(entries):
        rep = entries[i][1]
        j = i + 1
        while j < len(entries) and rep != 1 and entries[j][1] == rep:
            j += 1
        out.extend([d for d, _ in entries[i:j]] * int(sympy.sympify(rep).xreplace(env)))
        i = j
    return out


def _item(name, source, ops=0, kernels=0, read=0, written=0, collectives=(), syncs=0, per="iteration"):
    return {"name": name, "source": source, "ops": ops, "kernels": kernels, "read": read, "written": written,
            "collectives": [list(c) for c in collectives], "syncs": syncs, "per": per}


def work(an, env: Mapping, ranks: Mapping[str, int], buckets: Mapping[str, Any] | None,
         flags: Mapping[str, Any] | None = None, others: Sequence[tuple] = (),
         last_stage: bool = True) -> list[dict[str, Any]]:
    """The per-iteration items of one rank (module docstring) of a Megatron-engine trace ``an``
    (:func:`symcost.passes.megatron_buckets.is_megatron_engine`) at ``env``.

    Args:
        an: the analysis (its parameters, ``precision``, ``parallel``: ``zero1`` is the distributed
            optimizer).
        env: symbol values.
        ranks: :func:`symcost.passes.parallel.group_sizes` (``DP``, ``TP``, ``PP``, ``ranks``).
        buckets: :func:`symcost.passes.megatron_buckets.engine`'s result (its ``buffers`` and, with
            the distributed optimizer, ``optimizer_shard``); None: one bucket per buffer is assumed.
        flags: :func:`parse_args`' dict (None: :data:`DEFAULTS`).
        others: ``(an, env, buckets)`` of the rank's other model chunks (a pipeline rank's
            virtual stages): one optimizer steps them all, their buckets scaled and checked each.
        last_stage: the rank runs the loss (a pipeline's last stage: the loss checks and the loss
            all-reduce run there only, ``is_pp_last_stage``).

    Returns:
        ``[{"name", "source", "ops" (aten ops the host dispatches), "kernels" (device kernels),
        "read", "written" (device bytes), "collectives" [[group, ranks, count]] (one-element
        all-reduces), "syncs" (device-to-host synchronisations), "per" ("iteration",
        "micro-batch" (in the forward), "micro-batch-backward" or "log": every log_interval
        iterations)}]``; ``group`` ``"DP"``, ``"MP"``
        (tensor × pipeline), ``"stats"`` (the optimizer's grad-stats group: model-parallel, all
        ranks with the distributed optimizer), ``"world"``, ``"one"`` (a group of one rank).
    """
    from symcost.passes import megatron_buckets as mb
    from symcost.passes.memory.policies import POLICIES

    f = dict(DEFAULTS, **(flags or {}))
    pol = POLICIES[an.precision]
    fp16 = "fp16" in str(an.precision)
    distributed = an.parallel == "zero1"
    dp, tp, pp = int(ranks.get("DP", 1)), int(ranks.get("TP", 1)), int(ranks.get("PP", 1))
    world = int(ranks.get("ranks", dp * tp * pp))
    gb = pol.grad  # (the gradient buffer's bytes per element: fp32 under --bf16, 16-bit under --fp16)
    main = 4  # fp32 main params and main grads
    T = E = Tg = Eg = 0
    Ta = Ea = 0  # (the tensors the backward post-hook adds into the main-gradient buffer)
    bucket_elems: list[int] = []
    for a, e, b in ((an, env, buckets), *others):
        numels = [n for _, n in mb._expanded(a, e)]
        added = numels if not f["gradient_accumulation_fusion"] else [n for n, d in zip(numels, _dims(a, e)) if d < 2]
        Ta, Ea = Ta + len(added), Ea + sum(added)
        T, E = T + len(numels), E + sum(numels)
        if distributed and b and "optimizer_shard" in b:  # (the distributed optimizer's shard of the chunk)
            Tg, Eg = Tg + int(b["optimizer_shard"]["tensors"]), Eg + int(b["optimizer_shard"]["elements"])
        else:
            Tg, Eg = Tg + len(numels), Eg + sum(numels)
        # (each bucket's elements, padding included; one bucket of the chunk's buffer without a layout)
        bucket_elems += [x for buf in (b or {}).get("buffers", []) for x in buf["buckets"]] or [sum(numels)]
    nb = len(bucket_elems)
    stats = ("stats", world if distributed else tp * pp)
    mp = ("MP", tp * pp)
    check = f["check_for_nan_in_loss_and_grad"] and not (fp16 and f["loss_scale"] is None)
    ddp = "megatron/core/distributed/param_and_grad_buffer.py"
    opt = "megatron/core/optimizer/optimizer.py"
    items = []
    if Ta:
        items.append(_item("main_grad_add", f"{ddp.replace('param_and_grad_buffer', 'distributed_data_parallel')} "
                           "_make_backward_post_hook: param.main_grad.add_(param.grad.data)"
                           + (" (--no-gradient-accumulation-fusion: every tensor)" if not f["gradient_accumulation_fusion"]
                              else " (gradient-accumulation fusion: the 1-D tensors)"),
                           ops=Ta, kernels=Ta, read=(gb + pol.param) * Ea, written=gb * Ea, per="micro-batch-backward"))
    if dp > 1:
        items.append(_item("grad_scaling", f"{ddp} start_grad_sync: bucket.grad_data *= gradient_scaling_factor (1/DP)",
                           ops=nb, kernels=nb, read=gb * sum(bucket_elems), written=gb * sum(bucket_elems)))
    if check:
        items.append(_item("check_grads", f"{ddp} check_grads: grad_data.norm(p=2), validate_result(isnan), (isinf)",
                           ops=5 * nb, kernels=5 * nb, read=gb * sum(bucket_elems), syncs=2 * nb))
        if last_stage:
            items.append(_item("loss_check", "pretrain_gpt.py loss_func: validate_result(loss, isnan), (isinf)",
                               ops=4, kernels=4, syncs=2, per="micro-batch"))
    if distributed:  # (a view and a slice of the buffer, .float() of fp32 is the tensor itself)
        items.append(_item("copy_to_main_grads", "megatron/core/optimizer/distrib_optimizer.py "
                           "_copy_model_grads_to_main_grads: main_grad.view(-1)[range].float()", ops=3 * Tg,
                           kernels=Tg if gb != main else 0, read=gb * Eg if gb != main else 0,
                           written=main * Eg if gb != main else 0))
    else:
        items.append(_item("copy_to_main_grads", f"{opt} Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads: "
                           "main_param.grad = main_grad.float()", ops=Tg, kernels=Tg if gb != main else 0,
                           read=gb * Eg if gb != main else 0, written=main * Eg if gb != main else 0))
    if fp16:
        items.append(_item("unscale_check_inf", f"{opt} _unscale_main_grads_and_check_for_nan: fill_, "
                           "_amp_foreach_non_finite_check_and_unscale_, all_reduce(found_inf, MAX), .item()",
                           ops=4, kernels=4, read=main * Eg, written=main * Eg, collectives=[(*stats, 1)], syncs=1))
    clip = "megatron/core/optimizer/clip_grads.py"
    if f["clip_grad"] and f["clip_grad"] > 0:
        items.append(_item("grad_norm", f"{clip} get_grad_norm_fp32: zeros x2, multi_tensor_l2norm, **2, "
                           "all_reduce(SUM), pow(1/2)", ops=6, kernels=6, read=main * Eg, collectives=[(*stats, 1)]))
        items.append(_item("clip", f"{clip} clip_grad_by_total_norm_fp32: +1e-6, max_norm/, zeros, clamp_max_, "
                           "multi_tensor_scale_tensor", ops=5, kernels=5, read=main * Eg, written=main * Eg))
    if f["log_num_zeros_in_grad"]:
        items.append(_item("count_zeros", f"{clip} count_zeros_fp32: per tensor numel - count_nonzero(grad), "
                           "summed; all_reduce, .item()", ops=3 * Tg + 3, kernels=3 * Tg + 3, read=main * Eg,
                           collectives=[(*stats, 1)], syncs=1))
    if distributed:
        items.append(_item("copy_main_to_model", "megatron/core/optimizer/distrib_optimizer.py "
                           "_copy_main_params_to_model_params: param_data.view(-1)[range].copy_(shard_main_param)",
                           ops=3 * Tg, kernels=Tg, read=main * Eg, written=pol.param * Eg))
    elif fp16:
        items.append(_item("copy_main_to_model", f"{opt} _multi_tensor_copy_this_to_that: multi_tensor_scale",
                           ops=1, kernels=1, read=main * E, written=pol.param * E))
    else:  # (bf16: no overflow buffer, so a copy_ per tensor)
        items.append(_item("copy_main_to_model", f"{opt} _multi_tensor_copy_this_to_that: that.copy_(this) per tensor",
                           ops=T, kernels=T, read=main * E, written=pol.param * E))
    n_stats = 3 if f["log_num_zeros_in_grad"] else 2
    items.append(_item("stats_reduce", "megatron/training/training.py train_step: logical_and_across_model_parallel_group, "
                       "reduce_max_stat_across_model_parallel_group (grad_norm" + (", num_zeros" if n_stats == 3 else "")
                       + "): torch.tensor, all_reduce, .item() x2", ops=4 * n_stats + 1, kernels=4 * n_stats + 1,
                       collectives=[(*mp, n_stats)], syncs=2 * n_stats + 1))
    if last_stage:
        items.append(_item("loss_reduce", "megatron/training/training.py train_step: vstack, sum, all_reduce(dp_cp), "
                           "val[0] / val[1]", ops=6, kernels=4, collectives=[("DP", dp, 1)]))
    items.append(_item("loss_scale_item", "megatron/training/training.py train: optimizer.get_loss_scale().item()",
                       ops=1, kernels=1, syncs=1))
    if f["log_params_norm"]:
        # (eight bucket norms: one holds the dense params (the shard's with the distributed
        # optimizer), seven are torch.zeros; four DP/expert-DP reductions, one over a gtp group of
        # one rank, one model-parallel; the adds between)
        data = (main * Eg if distributed else main * E) if not fp16 else pol.param * E
        items.append(_item("params_norm", "megatron/training/utils/common_utils.py calc_params_l2_norm: "
                           "_compute_norm_2 x8, _sum_reduce x4, all_reduce x2, .item()", ops=24, kernels=23,
                           read=data, collectives=[("DP", dp, 4), ("one", 1, 1), (*mp, 1)], syncs=1))
    items.append(_item("training_log", "megatron/training/training.py training_log: reduce_max (learning rate), "
                       "total_loss_dict +=, .item(), timers('interval-time').elapsed(barrier=True) "
                       "(megatron/core/timers.py: barrier + torch.cuda.synchronize, at stop and start)",
                       ops=9, kernels=9, collectives=[(*mp, 1), ("world", world, 2)], syncs=5, per="log"))
    return items


def price(items, device, micro_batches: int = 1, flags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Seconds of :func:`work`'s items on ``device`` (module docstring).

    Each item: device = (read + written) / (bandwidth · ``memory``) + kernels · ``kernel_gap``;
    host = ops · ``host_per_op`` + kernels · ``host_launch``; latency = Σ count · 2(n−1) ·
    ``collective_latency`` over its all-reduces (none for a group of one rank); seconds =
    max(host, device) + latency, times its count per optimizer step (``micro-batch`` and
    ``micro-batch-backward`` items ``micro_batches`` times, ``log`` items 1/log_interval).

    The main-gradient adds (``micro-batch-backward``) run inside the backward, with no
    synchronisation, so a device-bound backward would hide their host work; they are priced as an
    item of their own all the same (max(host, device)), as ``plan`` and a pipeline rank price
    them: their ops are not in the traced backward's host/device queue (docs/performance-model.md).

    Returns:
        ``{"seconds" (per optimizer step, the micro-batch items included), "per_micro_batch"
        (the forward's micro-batch items' seconds, each micro-batch: the loss checks),
        "per_micro_batch_backward" (the backward's, each micro-batch: the main-gradient adds),
        "device", "host", "latency",
        "syncs" (per optimizer step), "items" [each item with its "seconds" per occurrence]}``.
    """
    from symcost.hardware.efficiency import default_efficiency

    eff = device.efficiency if device.efficiency is not None else default_efficiency(device)
    f = dict(DEFAULTS, **(flags or {}))
    bw = device.bandwidth * eff.memory
    per_op = eff.host_per_op("forward")
    launch = float(eff.host_launch or 0.0)
    gap = float(eff.kernel_gap or 0.0)
    tot = {"device": 0.0, "host": 0.0, "latency": 0.0, "syncs": 0.0, "seconds": 0.0, "per_micro_batch": 0.0,
           "per_micro_batch_backward": 0.0}
    out = []
    for it in items:
        dev = (it["read"] + it["written"]) / bw + it["kernels"] * gap
        host = it["ops"] * per_op + it["kernels"] * launch
        lat = sum(c * 2 * (n - 1) * eff.collective_latency for _, n, c in it["collectives"])
        s = max(host, dev) + lat
        times = {"iteration": 1.0, "micro-batch": float(micro_batches), "micro-batch-backward": float(micro_batches),
                 "log": 1.0 / max(1, int(f["log_interval"]))}[it["per"]]
        for k, v in (("device", dev), ("host", host), ("latency", lat), ("syncs", it["syncs"]), ("seconds", s)):
            tot[k] += times * v
        if it["per"] == "micro-batch":
            tot["per_micro_batch"] += s
        elif it["per"] == "micro-batch-backward":
            tot["per_micro_batch_backward"] += s
        out.append({**it, "device_seconds": dev, "host_seconds": host, "latency_seconds": lat, "seconds": s})
    return {**tot, "items": out}

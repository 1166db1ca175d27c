"""``symcost serve``: the largest serving batch under a memory cap, time per output token and
tokens/s bounds, and the time to first token, from the traced decode and prefill steps.

Registered in :data:`symcost.cli.COMMANDS`. The computing is :mod:`symcost.passes.inference`;
the text :mod:`symcost.render.inference`.
"""
from __future__ import annotations

import json

import click

from symcost.errors import SymcostError
from ._device import device_options, resolve_device
from ._options import common, early_checks, trace_model

#: exit status when not one sequence at the full context fits (as ``max-batch``)
NOTHING_FITS = 3


def _keep_tp(ctx, param, value):
    """``--tp N`` (N > 1) reaches :func:`trace_model` as ``report --tp`` does (the click
    context's ``symcost.tp``): both inference steps are traced as one rank of N."""
    if value is not None and value > 1:
        ctx.meta["symcost.tp"] = value
    return value


@click.command()
@click.argument("model", default="hf:llama")
@common
@device_options
@click.option("--memory", "memory", default=None, metavar="CAP",
              help="memory cap per device (e.g. 80GiB; 80GB is 80e9 bytes) [default: the device's memory]")
@click.option("--context", type=int, default=8192, show_default=True,
              help="tokens per sequence (prompt + output) every concurrent sequence may reach")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["static", "dynamic"]), default="static", show_default=True,
              help="the model's cache class: static (StaticCache, written in place, as compiled generation "
                   "and serving engines) or dynamic (DynamicCache, grown by concatenation)")
@click.option("--kv-dtype", "kv_dtype", default=None, metavar="fp8|int8|bf16|fp16|fp32",
              help="cost the KV cache in this dtype (modelled: the traced cache's bytes scaled by the element "
                   "sizes; int8/fp8 1 byte, their scales not counted) [default: the traced cache's dtype]")
@click.option("--plot", default=None, metavar="FILE.png",
              help="draw tokens/s and time per output token against the batch, 1 to the largest (needs matplotlib)")
@click.option("--tp", "tp", type=click.IntRange(min=1), default=None, metavar="N", callback=_keep_tp,
              help="tensor-parallel size: trace one rank of N under the model's plan (transformers' base_model_tp_plan, "
                   "else the Megatron plan); --memory is per device, the batch per rank's replica, the time per "
                   "token the rank's step plus its all-reduces over the device's link. N must divide the query "
                   "and the key/value heads")
@click.option("--no-prefill", is_flag=True, help="leave out the prefill step (time to first token)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def serve(model, sets, config, attention, precision, debug, device_name, devices_file, peak_flops, bandwidth,
          memory, context, kv_cache, kv_dtype, plot, tp, no_prefill, as_json):
    """Largest concurrent batch of MODEL at --context tokens per sequence under --memory, with the
    decode roofline (time per output token, tokens/s) and the prefill's time to first token.

    MODEL: hf:MODEL_TYPE, hf:ORG/NAME or path/config.json (a model with a KV cache; an encoder-decoder,
    T5, BART, Whisper: --context counts decoder tokens, the source is S_enc, its prefill the encoder
    and the first decoder step, its cache the cross-attention keys and values too; a state-space
    model, Mamba, Mamba-2: a state cache, fixed per sequence; Jamba, Zamba, Zamba2: states and the
    attention blocks' keys and values). The decode
    step (one new token onto a cache of T = context - 1 tokens) and the prefill (context tokens)
    are traced through the model's own cache class; --precision defaults to the weights in bf16
    (bf16-true). --kv-dtype models the cache in another dtype (labelled "modelled"). Exit status 3
    when not one sequence fits. With --tp N one rank of N tensor-parallel ranks is traced: its
    weights and KV cache (K/N key/value heads per layer) against --memory, its step's FLOPs and
    all-reduces; the prefill's FLOPs are the rank's and the whole model's. See docs/inference.md.
    """
    ctx = click.get_current_context()
    if ctx.get_parameter_source("precision") == click.core.ParameterSource.DEFAULT:
        precision = "bf16-true"  # served weights are bf16, not autocast over fp32 master weights
    early_checks(model, sets, config, attention, precision)
    from symcost.units import parse_memory

    if isinstance(context, bool) or context < 2:
        raise SymcostError(f"--context must be at least 2 tokens, got {context}")
    bad = [s for s in sets if s.partition("=")[0].strip() in ("B", "S", "T")]
    if bad:
        raise SymcostError(f"--set {bad[0]}: serve chooses B (the answer), S (1 new token) and T (--context)")
    dev = resolve_device(device_name, devices_file, peak_flops, bandwidth)
    if memory is None:
        if not dev.memory:
            raise SymcostError(f"device {dev.key} gives no memory capacity; pass --memory")
        memory = int(dev.memory)
    cap = parse_memory(memory)
    from symcost.passes import inference

    if kv_dtype is not None and kv_dtype not in inference.KV_DTYPES:
        raise SymcostError(f"unknown --kv-dtype {kv_dtype!r}; accepted: {', '.join(inference.KV_DTYPES)}")
    if plot:
        from symcost.render.plots import check_plot_path, require_matplotlib

        require_matplotlib()
        check_plot_path(plot)

    dec, sizes = trace_model(model, sets, config, attention, precision, step="decode", kv_cache=kv_cache,
                             extra_sizes={"T": context - 1})
    pre = whole = None
    # a request's first step: a decoder-only model's prompt of --context tokens; an encoder-decoder's
    # encoder over S_enc and its first decoder step over the start token (symcost.frontends.hf_encdec)
    first = inference.ENCDEC_PROMPT if inference.encoder_decoder(dec) else context
    if not no_prefill:
        pre, _ = trace_model(model, sets, config, attention, precision, step="prefill", kv_cache=kv_cache,
                             extra_sizes={"S": first})
        if ctx.meta.get("symcost.tp"):  # the whole model's prefill FLOPs: the prefill on one device
            tp_n = ctx.meta.pop("symcost.tp")
            try:
                whole, _ = trace_model(model, sets, config, attention, precision, step="prefill",
                                       kv_cache=kv_cache, extra_sizes={"S": first})
            finally:
                ctx.meta["symcost.tp"] = tp_n
    sizes = {k: v for k, v in sizes.items() if k not in ("T", "S")}
    r = inference.serve(dec, pre, dev, cap, context, sizes, kv_dtype, prefill_whole=whole)
    from symcost.render import inference as text

    if plot and r["batch"] >= 1:
        from symcost.render.plots import token_rate_plot

        curve = inference.token_rate(dec, dev, context, r["batch"], sizes, r["kv_dtype"])
        token_rate_plot(curve, plot, title=f"{dec.model} on {dev.key}, context {context}")

    if as_json:
        click.echo(json.dumps(text.to_json(dec.model, precision, dev, r), indent=1, default=str))
    else:
        from symcost.render.report import console

        text.render_text(console(), dec.model, precision, dev, r)
        if plot:
            console().print(f"plot written to {plot}" if r["batch"] >= 1
                            else f"no plot written to {plot}: not one sequence fits")
    if r["batch"] < 1:
        raise SystemExit(NOTHING_FITS)


# --help says the default serve takes (the shared option's is training's bf16-mixed; serve() swaps it)
for _p in serve.params:
    if _p.name == "precision":
        _p.show_default = "bf16-true: served weights in bf16"

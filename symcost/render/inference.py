"""The text and JSON of ``symcost serve``: what :func:`symcost.passes.inference.serve` returns, as a
few header lines and two narrow tables (rich), readable at 80 columns. Nothing here computes a
cost."""
from __future__ import annotations

from rich import box
from rich.table import Table

from symcost.render.report import human
from symcost.render.roofline import _fmt_s
from symcost.hardware.efficiency import DEFAULTED

_NARROW = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True,
           "title_justify": "left"}


def to_json(model: str, precision: str, dev, r: dict) -> dict:
    """The JSON object of ``symcost serve --json`` (base units: bytes, seconds, FLOPs):
    ``model``, ``precision``, ``device`` (key), ``context``, ``kv_cache``, ``kv_dtype`` (``dtype``,
    ``element``, ``bytes`` per element, ``from``: the traced cache's dtype, ``modelled``: true when
    the cache's bytes are scaled from the traced ones rather than traced, ``scale``), ``max_batch``,
    ``memory`` (``cap``, ``at_max`` = M(max_batch), ``at_next`` = M(max_batch + 1), ``check``,
    ``components`` at max_batch: params, buffers, inputs, kv_cache, workspace, peak),
    ``kv`` (``per_token``, ``per_sequence``, ``total``, formulas, ``cache``: "kv", "state" or
    "kv+state"; an encoder-decoder's ``cross_per_sequence``: its cross-attention keys and values,
    bytes; a state-space model's ``state_per_sequence``: its recurrent states), ``encoder`` (an
    encoder-decoder only: ``S_enc`` source positions, ``prompt`` = the first decoder step's
    tokens; its prefill is the encoder and that step), ``seconds_per_token`` and
    ``tokens_per_second`` (at max_batch), ``decode`` and ``decode_batch_1`` (the decode
    roofline: per-op sum, aggregate bound, crossing batch, ``model_flops`` of the step),
    ``prefill_seconds`` (time to first token bound of one sequence of ``context`` tokens) and ``prefill`` (``seconds``, ``sizes``,
    ``seconds_by_bound``, ``flops``: the prefill step's model FLOPs, what ``FlopCounterMode``
    counts on the real forward, ``flops_all``, ``flops_formula``; with ``--tp`` these are one
    rank's, ``flops_model`` the whole model's and ``tp`` its collectives); with ``--tp``, ``tp``
    (``size``, the per-device cap, the batch per rank's replica, ``replicated``: the weight matrices
    the plan leaves whole on every rank, elements each and share of the parameters) and ``decode.tp`` (the rank's
    all-reduces per step: ``collectives``, ``bytes``, ``seconds``, ``link``, ``note``).; ``predicted`` (the performance
    model beside these bounds, :func:`symcost.passes.inference.predicted`: ``seconds_per_token``,
    ``tokens_per_second`` at max_batch, ``seconds_per_token_batch_1``, ``prefill_seconds``,
    ``calibrated``, ``defaulted``)."""
    d = r["decode"]
    out = {
        "model": model, "precision": precision, "device": dev.key, "context": r["context"],
        "kv_cache": r["kv_cache"], "kv_dtype": r["kv_dtype"].to_json(), "max_batch": r["batch"],
        "memory": {"cap": r["memory"]["cap"], "at_max": r["memory"]["at"], "at_next": r["memory"]["next"],
                   "check": r["memory"]["checked"], "components": r["memory"]["components"],
                   "peak_where": r["memory"]["peak_where"], "inequality": r["memory"]["inequality"]},
        "kv": {k: r["kv"][k] for k in ("per_token", "per_sequence", "total", "tokens", "formula", "per_token_formula",
                                        "cross_per_sequence", "state_per_sequence", "cache", "layers") if k in r["kv"]},
        "seconds_per_token": d["seconds_per_token"], "tokens_per_second": d["tokens_per_second"],
        "decode": _decode_json(d), "decode_batch_1": _decode_json(r["decode_batch_1"]),
    }
    if "encoder" in r:  # (an encoder-decoder: S_enc source positions, the decoder's first-step tokens)
        out["encoder"] = r["encoder"]
    if r["memory"].get("reason"):
        out["memory"]["reason"] = r["memory"]["reason"]
    if r["memory"].get("limited_by"):
        out["memory"]["limited_by"] = r["memory"]["limited_by"]
    if "prefill" in r:
        out["prefill_seconds"] = r["prefill"]["seconds"]
        out["prefill"] = {"seconds": r["prefill"]["seconds"], "sizes": r["prefill"]["sizes"],
                          "seconds_by_bound": r["prefill"]["roofline"]["seconds_by_bound"],
                          "flops": r["prefill"]["flops"], "flops_all": r["prefill"]["flops_all"],
                          "flops_formula": r["prefill"]["flops_formula"]}
        for k in ("flops_model", "tp"):  # (serve --tp: the whole model's FLOPs, the rank's collectives)
            if k in r["prefill"]:
                out["prefill"][k] = r["prefill"][k]
    if r.get("tp") is not None:
        out["tp"] = r["tp"]
    if r.get("predicted") is not None and r["batch"] >= 1:
        out["predicted"] = r["predicted"]
    return out


def _decode_json(d: dict) -> dict:
    out = {"batch": d["batch"], "sizes": d["sizes"], "seconds_per_token": d["seconds_per_token"],
           "tokens_per_second": d["tokens_per_second"],
           "seconds_by_bound": d["roofline"]["seconds_by_bound"], "aggregate": d["aggregate"],
           "model_flops": d["roofline"]["model_flops"]}
    if "crossing" in d:
        out["crossing"] = d["crossing"]
    if "tp" in d:
        out["tp"] = d["tp"]
    return out


def render_text(c, model: str, precision: str, dev, r: dict) -> None:
    """Print the serve report on the rich console ``c``."""
    mem, kv, d, d1 = r["memory"], r["kv"], r["decode"], r["decode_batch_1"]
    prec = d["precision"]
    c.print(f"[bold]symcost serve[/bold]: {model} on {dev.name}   precision {precision} ({prec} peak "
            f"{dev.peak_for(prec)[0] / 1e12:.4g} TFLOP/s, bandwidth {dev.bandwidth / 1e12:.4g} TB/s, "
            f"ridge {dev.ridge(prec):.1f} FLOP/byte)")
    kind = kv.get("cache", "kv")
    # (a state-space model's cache holds recurrent states, fixed per sequence: no "KV" for them)
    cname = {"kv": "KV cache", "state": "state cache", "kv+state": "cache (KV + states)"}[kind]
    c.print(f"context {r['context']} tokens per sequence; {cname}: {r['kv_cache']} "
            f"(transformers' {'StaticCache' if r['kv_cache'] == 'static' else 'DynamicCache'}); memory cap "
            f"{human(mem['cap'], 'B')}")
    kd = r["kv_dtype"]
    if "encoder" in r:
        e = r["encoder"]
        c.print(f"encoder-decoder: the encoder runs once per request over S_enc = {e['S_enc']} source positions; "
                "each decoder step reads the cross-attention keys and values (computed by the first step) and "
                "its own KV cache")
        c.print(f"KV cache: {human(kv['per_sequence'], 'B')} per sequence of {kv['tokens']} decoder tokens = "
                f"{human(kv.get('cross_per_sequence', 0), 'B')} cross-attention (S_enc = {e['S_enc']}) + "
                f"{kv.get('per_token_formula', '-')} bytes per decoder token")
    elif kind == "state":
        c.print(f"state cache (the Mamba layers' conv and SSM states, fixed in size: "
                f"{kv.get('per_token_formula', '0')} bytes more per token): "
                f"{human(kv['per_sequence'], 'B')} per sequence, at any of its {kv['tokens']} tokens")
    elif kind == "kv+state":
        c.print(f"cache: {human(kv['per_sequence'], 'B')} per sequence of {kv['tokens']} tokens = "
                f"{human(kv.get('state_per_sequence', 0), 'B')} recurrent states (Mamba layers, fixed) + "
                f"{kv.get('per_token_formula', '-')} bytes per token (attention layers' keys and values)")
    else:
        c.print(f"KV cache: {kv['per_token']:,} bytes per token ({kv.get('per_token_formula', '-')}), "
                f"{human(kv['per_sequence'], 'B')} per sequence of {kv['tokens']} tokens")
    what = "KV" if kind == "kv" else "cache"
    if kd.modelled:
        c.print(f"  {what} dtype {kd.name} ({kd.dtype}): [bold]modelled[/bold] from the traced {kd.traced} cache, its "
                f"bytes × {kd.scale} (memory, {what} sizes, decode bytes; quantisation scales not counted)")
    else:
        c.print(f"  {what} dtype {kd.traced} (traced)")
    if r["batch"] < 1:
        c.print(f"[bold red]not one sequence of {r['context']} tokens fits[/bold red]: {mem.get('reason', '')}")
        return
    ok = "✓" if mem["checked"] else "✗ (check failed)"
    c.print(f"[bold]largest batch: {r['batch']} concurrent sequences[/bold]   "
            f"check: M({r['batch']}) = {human(mem['at'], 'B')} ≤ cap < M({r['batch'] + 1}) = "
            f"{human(mem['next'], 'B')} {ok}")
    if mem.get("limited_by"):
        c.print(f"  limited by the model: {mem['limited_by']}")
    t = Table(title=f"Memory at B = {r['batch']} (decode step at T = {r['context'] - 1})", **_NARROW)
    t.add_column("component")
    t.add_column("bytes", justify="right", no_wrap=True)
    t.add_column("", justify="right", no_wrap=True)
    inputs = "inputs (token ids; the encoder's output)" if "encoder" in r else "inputs (token ids)"
    names = {"params": "weights", "buffers": "buffers", "inputs": inputs, "kv_cache": cname,
             "workspace": "workspace (the step's largest transient set)", "peak": "peak"}
    for k, label in names.items():
        v = mem["components"][k]
        t.add_row(label, f"{v:,}", human(v, "B"))
    c.print(t)
    dt = Table(title="Decode (one token per sequence per step)", **_NARROW)
    for col in ("batch", "time/token", "tokens/s", f"(weights+{'KV' if kind == 'kv' else 'cache'})/BW", "FLOPs/peak",
                "bound"):
        dt.add_column(col, justify="right", no_wrap=True)
    for x in ([d1, d] if d1 is not d else [d]):
        a = x["aggregate"]
        dt.add_row(str(x["batch"]), _fmt_s(x["seconds_per_token"]), f"{x['tokens_per_second']:,.0f}",
                   _fmt_s(a["memory_seconds"]), _fmt_s(a["compute_seconds"]), a["bound"])
    c.print(dt)
    c.print("  time/token: the per-op roofline of the traced decode step (fused bytes), summed; "
            f"(weights+{'KV' if kind == 'kv' else 'cache'})/BW and FLOPs/peak: the aggregate bounds")
    cr = d.get("crossing")
    if cr:
        where = (f"B ≈ {cr['value']:.4g}" if cr["value"] is not None else
                 f"never (the {'KV ' if kind == 'kv' else ''}cache's bytes grow with B as fast as the FLOPs, below the "
                 "ridge)"
                 if cr["compute_bound"] == "never" else "always")
        c.print(f"decode turns compute-bound (aggregate) at: {where}")
    if "tp" in d:
        tp = d["tp"]
        c.print(f"tensor parallel: one rank of TP = {tp['size']} (memory, KV cache, time per token per rank); "
                f"{tp['collectives']} all-reduce(s) per decode step, {tp['bytes']:,} B per rank"
                + (f", {_fmt_s(tp['seconds'])} over {tp['link']} (in time/token)" if tp["seconds"] is not None
                   else f": {tp['note']}"))
    whole = (r.get("tp") or {}).get("replicated") or []
    if whole:  # what the plan did not split: every rank holds all of it (transformers' MoE plans: the experts)
        parts = [f"{g['module'] or '(root)'} ({', '.join(g['params'])}"
                 + (f", {100 * g['share']:.0f}% of the parameters" if g.get("share") else "") + ")" for g in whole[:4]]
        more = f" and {len(whole) - 4} more" if len(whole) > 4 else ""
        c.print("left whole on every rank (the plan does not split them): " + "; ".join(parts) + more)
    if "prefill" in r:
        p = r["prefill"]
        what = (f"the encoder over {r['encoder']['S_enc']} positions + the first decoder step of "
                f"{r['encoder']['prompt']} token" if "encoder" in r else f"1 sequence of {r['context']} tokens")
        c.print(f"prefill, time to first token bound ({what}): "
                f"{_fmt_s(p['seconds'])}; model FLOPs {p['flops']:,}"
                + (f" per rank, {p['flops_model']:,} the whole model" if "flops_model" in p else ""))
    pr = r.get("predicted")
    if pr is not None:
        c.print(f"predicted (performance model, {pr['mode']}): time/token {_fmt_s(pr['seconds_per_token'])} at B = "
                f"{r['batch']} ({pr['tokens_per_second']:,.0f} tokens/s), {_fmt_s(pr['seconds_per_token_batch_1'])} at "
                f"B = 1" + (f"; time to first token {_fmt_s(pr['prefill_seconds'])}" if pr["prefill_seconds"] is not None
                            else "") + "; the figures above are the roofline bounds"
                + ("" if pr["calibrated"] else f" ({DEFAULTED})"))

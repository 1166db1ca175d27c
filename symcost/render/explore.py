"""The explorer page (``symcost explore``, ``symcost.explore``, ``Analysis._repr_html_``): one
self-contained HTML file whose numbers are the passes' formulas compiled to JavaScript.

Nothing here computes a cost. The formulas come from the passes — the memory model
(:func:`symcost.passes.memory.memory_model`), one data-parallel rank
(:func:`symcost.passes.parallel.summary`), every op's FLOPs and fused bytes for the roofline
(:func:`symcost.passes.roofline.roofline`'s inputs), the checkpoint √L law
(:func:`symcost.passes.checkpoint.costs.law`) — and sympy's JavaScript code printer
(:class:`sympy.printing.jscode.JavascriptCodePrinter`) turns each into a JavaScript function of
the symbols. The page's script (``explore_app.js``) evaluates them as the sliders move, formats
them as the CLI's text does (:func:`symcost.render.report.human`) and draws them with uPlot
(MIT, vendored in ``vendor/``; no network, no server).

A page holds one or more *variants*: analyses of the same model traced under a precision and a
layout (one device, or one rank of ``--dp DP --shard ddp|fsdp``; activation checkpointing off or
``--ac full``). The precision, layout and checkpointing controls pick among them.
"""
from __future__ import annotations

import html
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import sympy
from sympy.printing.jscode import JavascriptCodePrinter

from symcost.tracing.fit import SYMS

_HERE = pathlib.Path(__file__).resolve().parent
#: the memory categories of one device (``report --json``'s ``memory.*`` keys), in plot order
SINGLE_CATEGORIES = ("params", "grads", "optimizer", "master_weights", "buffers", "inputs", "activations")
#: one data-parallel rank's (``report --dp N --json``'s ``parallel.memory_per_rank.*``)
RANK_CATEGORIES = ("params", "grads", "optimizer_state", "master", "activations")


class _Printer(JavascriptCodePrinter):
    """sympy's JavaScript printer, symbols read from the page's size object ``v``."""

    def _print_Symbol(self, expr):
        return f"v.{expr.name}"


def js_function(expr) -> str:
    """A formula as JavaScript source: ``function(v){return ...;}`` with each symbol ``X`` read
    as ``v.X`` (sympy's :class:`JavascriptCodePrinter`: ``Math.pow``, ``Math.max``, ternaries
    for ``Piecewise``)."""
    code = _Printer({"strict": False}).doprint(sympy.sympify(expr))
    return f"function(v){{return {code};}}"


class _JS(str):
    """Raw JavaScript inside the page's data (see :func:`_dump`)."""


def _dump(obj: Any) -> str:
    """``obj`` as a JavaScript literal: JSON, with :class:`_JS` strings emitted as code."""
    if isinstance(obj, _JS):
        return str(obj)
    if isinstance(obj, Mapping):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_dump(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_dump(v) for v in obj) + "]"
    return json.dumps(obj)


def _fn(expr) -> _JS:
    return _JS(js_function(expr))


@dataclass
class Variant:
    """One traced analysis of the page: ``precision``, ``shard`` (None: one device, else the
    data-parallel strategy of a ``--dp`` trace) and ``ac`` (None or ``"full"``)."""

    an: Any
    precision: str
    shard: str | None = None
    ac: str | None = None

    @property
    def key(self) -> str:
        """The variant's key on the page: ``precision|shard|ac``."""
        return f"{self.precision}|{self.shard or 'none'}|{self.ac or 'none'}"


def variant_of(an) -> Variant:
    """The :class:`Variant` an analysis is: its precision, data-parallel strategy and
    activation checkpointing (from its layout)."""
    from symcost.frontends.layout import layout_of

    lay = layout_of(an)
    return Variant(an, an.precision, getattr(an, "parallel", None), getattr(lay, "ac", None))


def _memory(v: Variant) -> dict:
    """The memory formulas of a variant: each category and the peak (one device: the memory
    model; a data-parallel rank: the rank's states, activations and peak)."""
    if v.shard is None:
        from symcost.passes.memory import memory_model

        mm = memory_model(v.an)
        cats = {"params": mm.params, "grads": mm.grads, "optimizer": mm.optimizer,
                "master_weights": mm.master_weights, "buffers": mm.buffers, "inputs": mm.inputs,
                "activations": mm.activations}
        return {"categories": {k: _fn(e) for k, e in cats.items()}, "peak": _fn(mm.peak_expr()),
                "static": _fn(mm.static)}
    from symcost.passes.parallel import summary

    s = summary(v.an)
    pk = s.get("peak") or {}
    return {"categories": {k: _fn(s["memory"][k]) for k in RANK_CATEGORIES},
            "peak": _fn(pk["formula"]) if "formula" in pk else None,
            "comm": _fn(s["comm"]["total"])}


def _ops(an) -> list[dict]:
    """Every op the roofline times, as :func:`symcost.passes.roofline.roofline` reads it: repeat,
    all FLOPs, model FLOPs, fused bytes and their written part, transcendentals per class and the
    device precision key of the op."""
    from symcost.graph import fusion
    from symcost.passes.roofline import op_precision, training_precision

    fe = fusion.estimate(an)
    train_key = training_precision(an)
    out = []
    for op in an.ops:
        if op.cost.bytes == 0 and op.cost.flops_all == 0:
            continue
        out.append({"op": op.name.removeprefix("aten."), "module": op.module, "phase": op.phase,
                    "key": op_precision(op, train_key), "rep": _fn(op.repeat), "F": _fn(op.cost.flops_all),
                    "Fm": _fn(op.cost.flops), "Bf": _fn(fe.node_bytes[op.index]),
                    "Wf": _fn(fe.node_written[op.index]),
                    "T": {k: _fn(n) for k, n in op.cost.transcendentals.items() if n != 0}})
    return out


def _law(an) -> dict | None:
    """The checkpoint √L law's block costs ``a``, ``x`` (bytes) and ``f`` (FLOPs), or None
    where the model has no uniform block chain."""
    from symcost.errors import SymcostError
    from symcost.passes.checkpoint.costs import block_costs, law

    try:
        lw = law(block_costs(an))
    except (SymcostError, ValueError, KeyError, AttributeError):
        return None
    return {k: _fn(lw[k]) for k in ("a", "x", "f")}


def _devices(names: Iterable[str] | None = None) -> tuple[list[dict], dict]:
    """The catalogue's devices (``symcost devices``) as the page needs them, and the precision
    fallbacks of :meth:`Device.peak_for`."""
    from symcost.hardware.devices import FALLBACK, catalogue

    out = []
    for key, d in catalogue().items():
        if names is not None and key not in names:
            continue
        if d.serial_passes:  # (a calibrated CPU's serial passes are not modelled on the page)
            continue
        out.append({"key": key, "name": d.name, "peak": dict(d.peak), "bandwidth": d.bandwidth,
                    "write_bandwidth": d.write_bandwidth, "memory": d.memory,
                    "rates": dict(d.transcendental_rate)})
    return out, {k: list(v) for k, v in FALLBACK.items()}


def _kv(decode) -> dict | None:
    """The KV cache of a decode step (:func:`symcost.passes.inference.kv_cache`'s ``formula``:
    the bytes the cache holds after the step, B sequences of T + S tokens), or None."""
    if decode is None:
        return None
    return {"model": decode.model, "precision": decode.precision, "total": _fn(decode.kv_bytes),
            "pinned": dict(decode.pinned)}


def page_data(variants: list[Variant], sizes: Mapping[str, int] | None = None, device: str = "h100-sxm",
              devices: Iterable[str] | None = None, decode=None) -> dict:
    """The page's data: symbols (name, meaning, value), the variants' formulas as JavaScript,
    the devices, the starting ``sizes`` and ``device``; with ``decode`` (a decode step's
    analysis, ``symcost.trace(..., step="decode")``) its KV cache.

    The roofline ops and the checkpoint law come from each precision's one-device variant
    without checkpointing (``symcost roofline`` and ``symcost checkpoint`` trace no layout).
    """
    base = variants[0].an
    names: dict[str, str] = {}
    for v in variants:
        for s, meaning in v.an.symbols.items():
            names.setdefault(s, meaning)
    env = base.bind(**{k: val for k, val in (sizes or {}).items() if k in base.symbols})
    start = {s: int(env[SYMS[s]]) if SYMS.get(s) in env else None for s in names}
    for s, val in (sizes or {}).items():
        start[s] = int(val)
    if "DP" in names and start.get("DP") is None:
        start["DP"] = 8
    devs, fallback = _devices(devices)
    data_variants = []
    for v in variants:
        entry = {"key": v.key, "precision": v.precision, "shard": v.shard, "ac": v.ac,
                 "memory": _memory(v),
                 "flops": {ph: _fn(v.an.flops(ph)) for ph in ("forward", "backward", "train")}}
        if v.shard is None and v.ac is None:
            from symcost.passes.roofline import training_precision

            entry["train_key"] = training_precision(v.an)
            entry["ops"] = _ops(v.an)
            entry["law"] = _law(v.an)
        data_variants.append(entry)
    return {
        "model": base.model,
        "symbols": [{"name": s, "meaning": m, "value": start.get(s)} for s, m in names.items()],
        "pinned": dict(base.pinned),
        "variants": data_variants,
        "devices": devs,
        "fallback": fallback,
        "device": device,
        "kv": _kv(decode),
    }


def _read(name: str) -> str:
    return (_HERE / name).read_text(encoding="utf-8")


def _safe(text: str) -> str:
    """Text inside a ``<script>`` element: no ``</script`` (nor ``<!--``) can end it early."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def render_page(data: Mapping) -> str:
    """The self-contained HTML page of :func:`page_data`'s ``data``: uPlot's script and styles,
    the page's own, and the data, all inline."""
    title = f"symcost explore: {data['model']}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title>\n"
        f"<style>{_read('vendor/uPlot.min.css')}</style>\n<style>{_read('explore.css')}</style>\n"
        f"</head><body>\n<div id=\"app\"></div>\n"
        "<!-- uPlot v1.6.32 (MIT License, Copyright (c) 2022 Leon Sorokin): symcost/render/vendor/ -->\n"
        f"<script>{_safe(_read('vendor/uPlot.iife.min.js'))}</script>\n"
        f"<script>const SYMCOST = {_safe(_dump(data))};</script>\n"
        f"<script>{_safe(_read('explore_app.js'))}</script>\n"
        "</body></html>\n")


class Page:
    """An explorer page: ``html`` (the self-contained document), :meth:`save`, and the inline
    view Jupyter shows (``_repr_html_``: the page in an ``<iframe srcdoc>``, its script and
    styles kept apart from the notebook's)."""

    def __init__(self, html_text: str):
        self.html = html_text

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        """Write the page to ``path`` (UTF-8); returns the path.

        Raises:
            SymcostError: the file cannot be written (one line: the path and the reason).
        """
        from symcost.errors import SymcostError

        p = pathlib.Path(path)
        try:
            p.write_text(self.html, encoding="utf-8")
        except OSError as e:
            raise SymcostError(f"cannot write {p}: {e.strerror or e}") from None
        return p

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" style="width:100%;height:1400px;'
                'border:0" sandbox="allow-scripts"></iframe>')


def explore(analyses, sizes: Mapping[str, int] | None = None, device: str = "h100-sxm") -> Page:
    """The explorer view of one analysis or a list of them (variants of one model: other
    precisions, ``--dp`` ranks, ``--ac full``; and at most one decode step, whose KV cache the
    page shows), as a :class:`Page` (Jupyter shows it inline).

    Args:
        analyses: an :class:`~symcost.graph.analysis.Analysis` or a list of them.
        sizes: the sizes the sliders start at (others at the model's defaults).
        device: the device selected at first (a key of ``symcost devices``).

    Raises:
        SymcostError: no training step among ``analyses``, or more than one decode step.
    """
    from symcost.errors import SymcostError

    ans = list(analyses) if isinstance(analyses, (list, tuple)) else [analyses]
    train = [a for a in ans if getattr(a, "step", "train") == "train"]
    decode = [a for a in ans if getattr(a, "step", "train") == "decode"]
    if not train:
        raise SymcostError("explore shows a training step: give its analysis (a decode step adds its KV cache)")
    if len(decode) > 1 or len(train) + len(decode) != len(ans):
        raise SymcostError("explore takes at most one inference step, a decode step (step='decode')")
    variants = sorted((variant_of(a) for a in train), key=lambda v: (v.shard is not None, v.ac is not None))
    return Page(render_page(page_data(variants, sizes, device, decode=decode[0] if decode else None)))

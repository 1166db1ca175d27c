"""The graph library's readable pages (``graphs/<name>.md``, ``graphs/index.md``): each graph's
totals as formulas (sympy's text, which :func:`symcost.parse_formula` reads) and as LaTeX
(``sympy.latex``), the symbols with the sizes traced at, the regime and the versions."""
from __future__ import annotations

from typing import Mapping

import sympy

from symcost.frontends.spec import SYMBOL_MEANINGS

#: The totals a page shows: (JSON name, words).
QUANTITIES = (
    ("params", "parameters P"),
    ("params_active", "parameters active per token (mixture of experts: R of E experts)"),
    ("flops.forward", "model FLOPs, forward"),
    ("flops.backward", "model FLOPs, backward"),
    ("flops.train", "model FLOPs, training step"),
    ("flops_hw.train", "hardware FLOPs, training step (recomputation included)"),
    ("flops_all.train", "all FLOPs, training step (elementwise, reductions, softmax, norms too)"),
    ("bytes.train", "bytes moved, training step (each op's inputs read and outputs written once)"),
    ("activations", "activations: bytes autograd saves for backward (parameters excluded)"),
)


def totals(an) -> dict[str, sympy.Expr]:
    """The formulas of :data:`QUANTITIES` of ``an`` (``activations``: the saved tensors' bytes)."""
    out = {}
    for name, _ in QUANTITIES:
        if name == "activations":
            out[name] = sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
        else:
            out[name] = sympy.sympify(an.quantity(name))
    return out


def page(name: str, entry: Mapping, an) -> str:
    """``graphs/<name>.md``: what was traced, with which versions, in which regime, and every
    total of :data:`QUANTITIES` as a formula and as LaTeX."""
    tw = entry["traced_with"]
    sizes = entry.get("sizes_traced") or {}
    cfg = " ".join(f"{k}={v}" for k, v in (entry.get("config") or {}).items())
    model = str(entry["model"])
    att = entry.get("attention") or ("transformers' default (sdpa where the model has it)"
                                     if model.startswith("hf:") or model.endswith(".json") else "the model's own code")
    lines = [f"# {name}: `{model}`" + (f" `--config {cfg}`" if cfg else ""), "",
             f"One training step of `{model}` traced by symcost at precision {entry['precision']}, attention {att}, "
             f"with torch {tw.get('torch')}, transformers {tw.get('transformers')}, symcost {tw.get('symcost')} "
             f"(tracing sources {str(tw.get('symcost_sources'))[:12]}). Regenerate with "
             f"`symcost graphs build --only {name}`.", ""]
    pinned = ", ".join(f"{k} = {v}" for k, v in an.pinned.items()) or "none"
    facts = getattr(an, "request_facts", None) or {}
    equal = ", ".join(" = ".join(p) for p in facts.get("equal", [])) or "none"
    lines += [f"**Regime**: pinned {pinned}; equal sizes {equal}. These formulas hold in this regime; "
              "`symcost report` serves them at other sizes of it after checking every parameter's shape there "
              "on the meta device (docs/user-guide.md, \"The graph library\").", "",
              "| symbol | meaning | traced at |", "| --- | --- | --- |"]
    for s in an.symbols:
        lines.append(f"| {s} | {SYMBOL_MEANINGS.get(s, 'a size of the model')} | {sizes.get(s, an.pinned.get(s, ''))} |")
    lines += ["", "## Totals", ""]
    words = dict(QUANTITIES)
    tot = totals(an)
    if tot["params_active"] == tot["params"]:
        del tot["params_active"]  # (no mixture of experts)
    for q, expr in tot.items():
        lines += [f"### {q}: {words[q]}", "", "```", str(expr), "```", "", "$$", sympy.latex(expr), "$$", ""]
    return "\n".join(lines)


def index_page(entries: list[Mapping]) -> str:
    """``graphs/index.md``: one row per graph (model, regime, symbols, versions traced with)."""
    lines = ["# The graph library", "",
             "Traced op graphs of one training step, shipped with symcost: `symcost report` answers from them "
             "without tracing (docs/user-guide.md, \"The graph library\"). Each `<name>.json` is the analysis as "
             "the trace cache holds it; each `<name>.md` its totals as formulas and LaTeX. Regenerate all with "
             "`symcost graphs build` (one: `--only NAME`).", "",
             "| graph | model | sizes traced at | pinned | torch | transformers |", "| --- | --- | --- | --- | --- | --- |"]
    for e in sorted(entries, key=lambda e: e["name"]):
        tw = e.get("traced_with") or {}
        sizes = " ".join(f"{k}={v}" for k, v in sorted((e.get("sizes_traced") or {}).items()))
        pinned = " ".join(f"{k}={v}" for k, v in (e.get("meta", {}).get("pinned") or {}).items()) or "-"
        lines.append(f"| [{e['name']}]({e['name']}.md) | `{e['model']}` | {sizes} | {pinned} | {tw.get('torch')} | "
                     f"{tw.get('transformers')} |")
    return "\n".join(lines) + "\n"

"""Rendering: the report's rich tables, readable units and the JSON contract.

Nothing here computes a cost; it prints what :class:`symcost.graph.analysis.Analysis` (and the memory
pass) return. Text output fits the terminal: rich's width detection, 100 columns when stdout is
not a terminal (and ``COLUMNS`` is not set); module names are never broken, and the per-module
table shows the leading term of each formula (the full formulas are in ``symcost formulas`` and
``--json``).
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from typing import Any, Mapping

import sympy
from rich import box
from rich.console import Console
from rich.table import Table

from symcost.frontends.layout import layout_of
from symcost.graph.analysis import PHASES, Analysis
from symcost.tracing.modules import module_classes, module_group  # noqa: F401  (re-exported)
from symcost.tracing.fit import SYMS

#: the label of every text output whose attention matmuls were counted causally
CAUSAL_LABEL = ("attention FLOPs: causal count (S*(S+1)/2 score pairs per attention matmul, "
                "--attention-flops causal; FlopCounterMode counts S^2)")
#: width of text output when stdout is not a terminal and COLUMNS is not set
PIPE_WIDTH = 100


def console(width: int | None = None) -> Console:
    """The rich console for text output: ``width`` if given, else the terminal's (rich's own
    detection, which honours ``COLUMNS``), else :data:`PIPE_WIDTH` columns when not a TTY."""
    if width is None and "COLUMNS" not in os.environ and not sys.stdout.isatty():
        width = PIPE_WIDTH
    return Console(width=width, highlight=False, emoji=False)


_SCALES = {
    "B": (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)),
    "FLOP": (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)),
}


def human(value: float, unit: str) -> str:
    """Readable number: FLOPs in kFLOP ... EFLOP (decimal), bytes in KiB ... TiB (binary), three
    decimals; small values as they are (``512 B``, ``999 FLOP``)."""
    v = float(value)
    for u, f in _SCALES.get(unit, ()):
        if abs(v) >= f:
            return f"{v / f:.3f} {u}"
    if unit in _SCALES:
        return f"{int(v)} {unit}"
    return f"{v:.4g} {unit}"


def short(value: float, unit: str) -> str:
    """A compact cell: three significant digits and a prefix (``206G``, ``1.21Gi``); the unit
    is in the column header. FLOPs decimal, bytes binary."""
    v = float(value)
    if unit == "B":
        for u, f in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
            if abs(v) >= f:
                return f"{v / f:.3g}{u}"
        return f"{int(v)}"
    for u, f in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= f:
            return f"{v / f:.3g}{u}"
    return f"{int(v)}"


def fmt(expr) -> str:
    """A formula as text: sympy's string form (parseable by :func:`symcost.parse_formula`)."""
    return str(expr)


_SUP = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def pretty(expr, sep: str = "·") -> str:
    """A formula for reading: ``sep`` for products and superscript powers (not parseable)."""
    text = str(expr)
    text = re.sub(r"\*\*\(?(-?\d+)\)?", lambda m: m.group(1).translate(_SUP), text)
    return text.replace("*", sep)


def _degree(term) -> int:
    return sum(int(e) for b, e in term.as_powers_dict().items() if isinstance(b, sympy.Symbol) and e.is_number)


def leading(expr, env: Mapping | None = None):
    """The leading term of a polynomial (or Laurent polynomial): highest total degree, ties
    broken by the larger value at ``env`` (the sizes shown). 0 for 0."""
    expr = sympy.expand(sympy.sympify(expr))
    terms = sympy.Add.make_args(expr)
    if expr == 0:
        return sympy.Integer(0)
    top = max(_degree(t) for t in terms)
    cands = [t for t in terms if _degree(t) == top]
    if len(cands) > 1 and env:
        return max(cands, key=lambda t: abs(float(t.xreplace(env))))
    return cands[0]


def module_rows(an: Analysis) -> list[dict[str, Any]]:
    """Per-module totals (repeat folded in): FLOPs forward/backward, all FLOPs, bytes (train)."""
    zero = sympy.Integer(0)
    acc: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "flops.forward": zero, "flops.backward": zero, "flops_all": zero, "bytes": zero, "repeat": 1})
    order: list[str] = []
    for op in an.ops:
        key = module_group(op.module, an.layer_container, getattr(an, "stacks", None))
        if key not in acc:
            order.append(key)
        row = acc[key]
        if op.phase in PHASES:
            row[f"flops.{op.phase}"] += op.repeat * op.cost.flops
        row["flops_all"] += op.repeat * op.cost.flops_all
        row["bytes"] += op.repeat * op.cost.bytes
        row["repeat"] = op.repeat
    return [{"module": k, **{f: sympy.expand(v) if isinstance(v, sympy.Basic) else v
                             for f, v in acc[k].items()}} for k in order]


def _value(expr, env):
    return int(sympy.sympify(expr).xreplace(env))


def _row_label(key: str, classes: Mapping[str, str], parent: str = "") -> str:
    """``key`` relative to ``parent``; a module named only by indices (a factory's
    ``nn.Sequential``: ``{i}.0``) gets its class (``{i}.0 Linear``)."""
    name = key[len(parent) + 1:] if parent and key.startswith(parent + ".") else key
    if key == parent:
        return "(own ops)"
    last = key.rsplit(".", 1)[-1]
    if (last.isdigit() or last == "{i}") and key in classes:
        name = f"{name} {classes[key]}"
    return name


def _block_of(key: str, container: str | None) -> str | None:
    """The block a row belongs to (``model.layers.{i}``, ``layers.0``), or None."""
    if container is None:
        return None
    pre = f"{container}." if container else ""
    if not key.startswith(pre) and container:
        return None
    rest = key[len(pre):].split(".")
    if not rest or not rest[0] or not (rest[0].isdigit() or rest[0] == "{i}"):
        return None
    return pre + rest[0]


def _count(rep) -> str:
    return "1" if rep == 1 else pretty(rep).replace(" ", "")


def provenance(an: Analysis) -> str:
    """``traced in X s``, and where the analysis came from the trace cache, that it was read back
    from there (the seconds are those of the trace that wrote the entry, not of this run); where
    it came from the graph library, ``from the graph library (traced with torch X, transformers
    Y)``, the sizes traced at where the request's differ, and any version that differs here."""
    lib = an.__dict__.get("library")
    if lib:  # served from the graph library (symcost.graph.library)
        out = f"from the graph library (traced with torch {lib['torch']}, transformers {lib['transformers']})"
        if lib.get("traced_at"):
            at = " ".join(f"{k}={v}" for k, v in lib["traced_at"].items())
            out += f", traced at {at}, every parameter's shape checked at these sizes on the meta device"
        if lib.get("differs"):
            out += (f"; what differs from this installation: {', '.join(lib['differs'])} (`symcost graphs build` "
                    "retraces the library)")
        return out + "; --no-cache traces afresh"
    out = f"traced in {sum(an.timings.values()):.1f} s"
    if an.__dict__.get("cached_from"):
        out += " (read back from the trace cache; --no-cache traces afresh)"
    return out


def assumed(precision: str, optimizer: str, cap: int | None, device: str | None, cap_from: str | None = None) -> dict:
    """What a report without the one-device memory section assumed (``--dp``, ``--tp``, ``--pp``),
    in the keys :func:`header` reads from the memory section's JSON: ``bytes_per_param`` (weights +
    gradients + full-size optimizer state + master weights, unsharded), ``optimizer_name``,
    ``optimizer_impl`` (the policy's engine's, else torch.optim's default on ``device``:
    :func:`symcost.passes.memory.default_impl`), ``device``, ``memory_cap`` (bytes)
    and ``memory_cap_from`` (where the cap comes from, e.g. ``"--memory"``)."""
    from symcost.passes.memory import default_impl, optimizer as get_optimizer, policy

    pol, opt = policy(precision), get_optimizer(optimizer)
    return {"bytes_per_param": pol.param + pol.grad + opt.full * pol.state + pol.master, "optimizer_name": opt.name,
            "optimizer_impl": default_impl(device, pol.name, opt.name) if device else None, "device": device, "memory_cap": cap,
            "memory_cap_from": cap_from}


def assumption_rows(g: Table, precision: str, js: Mapping) -> None:
    """The ``precision`` and ``optimizer`` rows of :func:`header`'s grid from ``js`` (the memory
    section's JSON, or :func:`assumed`)."""
    from symcost.frontends.precision import SUMMARY

    bpp, opt, cap = js.get("bytes_per_param"), js.get("optimizer_name"), js.get("memory_cap")
    g.add_row("precision", f"{precision}" + (f", {bpp} bytes/param with {opt}" if bpp else "")
              + (f": {SUMMARY[precision]}" if precision in SUMMARY else ""))
    if opt:
        impl, dev, src = js.get("optimizer_impl"), js.get("device"), js.get("memory_cap_from")
        g.add_row("optimizer", opt + (f"; memory cap {human(cap, 'B')}" + (f" ({src})" if src else "") if cap else "")
                  + (f"; {impl} step on {dev}" if impl and dev else ""))


def over_cap(peak: int | None, cap: int | None, who: str) -> str | None:
    """The line that flags a peak above the memory cap (None when it fits or either is unknown)."""
    if peak is None or cap is None or peak <= cap:
        return None
    return (f"[bold red]does not fit[/bold red]: {who} peaks at {human(peak, 'B')} > memory cap {human(cap, 'B')} "
            f"(by {human(peak - cap, 'B')})")


def header(an: Analysis, sizes: Mapping[str, int], memory: dict | None, title: str,
           layout_words: str | None = None) -> tuple[str, Table]:
    """The report's opening: a title line and a two-column grid of what it assumed (precision
    and bytes per parameter, optimizer and memory cap, attention, regime with pinned and tied
    symbols, the sizes). ``layout_words``: the layout row's mesh in words (default
    ``Layout.describe``)."""
    js = (memory or {}).get("json", {})
    cls = an.spec.extra.get("config_class")
    first = f"[bold]{title}[/bold] {an.model}" + (f" ({cls})" if cls else "") + f", {provenance(an)}"
    g = Table.grid(padding=(0, 2))
    g.add_column(no_wrap=True, style="bold")
    g.add_column()
    assumption_rows(g, an.precision, js)
    att = an.spec.extra.get("attention")  # what the model was built with (hf:, config.json): JSON's `attention`
    if att:
        g.add_row("attention", att + (" (transformers' default; --attention eager: explicit matmuls)"
                                      if att == "sdpa" else " (explicit matmuls)"))
    else:
        g.add_row("attention", "the model's own code")
    if an.spec.extra.get("task"):  # the head and loss an hf: model trains with (--task)
        cls_name = an.spec.extra.get("model_class")
        g.add_row("task", an.spec.extra["task"] + (f": {cls_name}" if cls_name else "")
                  + " (the head and loss trained; --task chooses among the model type's heads)")
    if an.spec.extra.get("loss_choice") == "megatron":  # (symcost.frontends.megatron: megatron-*, --loss)
        g.add_row("loss", "Megatron-LM's vocab-parallel cross entropy (fp32 softmax in place; --loss model: the "
                          "model's own)")
    if an.spec.extra.get("routing_description"):  # mixture of experts (symcost.passes.moe)
        g.add_row("routing", an.spec.extra["routing_description"] + " (--routing)")
    if an.spec.extra.get("experts_code"):  # which experts code ran (symcost.frontends.moe.experts_forward)
        g.add_row("experts", an.spec.extra["experts_code"])
    layout = layout_of(an)
    if layout:  # the mesh one rank of which was traced (symcost.frontends.layout)
        if layout.dims:
            g.add_row("layout", f"{layout_words or layout.describe(sizes)}: one rank traced, per-rank figures (mesh dimensions in "
                                "torchtitan's order)")
        else:  # a step technique on one device (--ac): no mesh, no ranks
            g.add_row("layout", layout.describe(sizes))
    reasons = getattr(an, "pin_reasons", {}) or {}
    regime = [f"{a} = {v} pinned ({reasons.get(a, 'its regime')})" for a, v in an.pinned.items()]
    regime += [f"{a} tied to {b}" for a, b in an.spec.tied.items()]
    # sizes the probes kept in the request's residue class (Mamba-2's S mod its chunk size, a split
    # size mod 8 under --tp): the formulas hold in that class only (Analysis.subs says so elsewhere)
    regime += [f"{a} ≡ {r} (mod {m}): the formulas hold for {a} in this class"
               for a, (m, r) in sorted((getattr(an, "residues", None) or {}).items()) if m > 1]
    # sizes padded to whole chunks (ModelSpec.pads): the range the formulas hold in (Mamba-2's S
    # below one chunk of the scan: one padded chunk of constant length; or two chunks and more)
    if getattr(an, "bounds", None):
        from symcost.tracing.probes import bounds_words

        pads = getattr(an.spec, "pads", None) or {}
        regime += [f"{bounds_words(a, b, pads.get(a))}: the formulas hold for {a} in this range"
                   for a, b in sorted(an.bounds.items())]
    g.add_row("regime", "; ".join(regime) if regime else "no pinned or tied symbols")
    env = an.bind(**sizes)
    given = [f"{s}={env[SYMS[s]]}" for s in an.symbols if s in sizes]
    dflt = [f"{s}={env[SYMS[s]]}" for s in an.symbols if s not in sizes]
    g.add_row("sizes", " ".join(given) + (" (set); " if given and dflt else " (set)" if given else "")
              + " ".join(dflt) + (" (defaults)" if dflt else ""))
    return first, g


def render(an: Analysis, sizes: Mapping[str, int], table: bool = True, memory: dict | None = None,
           width: int | None = None, assumed: dict | None = None, layout_words: str | None = None) -> None:
    """Print the report: what it assumed, symbols, per-module table, totals as formulas, the
    6·N·P form (with numbers at ``sizes``), the memory section. ``width``: columns (default: the
    terminal's, 100 when not a terminal). ``assumed``: the header's optimizer and memory cap
    where there is no memory section (:func:`assumed`); ``layout_words``: :func:`header`'s."""
    c = console(width)
    env = an.bind(**sizes) if sizes else None
    shown = env or an.bind()
    first, grid = header(an, sizes or {}, memory or ({"json": assumed} if assumed else None),
                         "symcost report" if table else "symcost formulas", layout_words)
    c.print(first)
    c.print(grid)
    if getattr(an, "attention_count", "full") == "causal":
        c.print(CAUSAL_LABEL)
    st = Table(title="Symbols", title_justify="left", box=box.SIMPLE_HEAD)
    st.add_column("symbol", no_wrap=True)
    st.add_column("meaning")
    st.add_column("value" if sizes else "default", justify="right", no_wrap=True)
    for s, meaning in an.symbols.items():
        v = shown[SYMS[s]]
        st.add_row(s, meaning, f"{v}" + ("" if not sizes or s in sizes else " (default)"))
    for a, b in an.spec.tied.items():
        st.add_row(a, f"tied: {a} = {b} in this configuration", "")
    for a, v in an.pinned.items():
        why = getattr(an, "pin_reasons", {}).get(a, "size 1 traces other kernels")
        st.add_row(a, f"pinned: {a} = {v} ({why})", str(v))
    c.print(st)

    if table:
        _module_table(c, an, env, shown)

    tt = Table(title="Totals (per training step)", title_justify="left", box=box.SIMPLE_HEAD)
    tt.add_column("quantity", no_wrap=True)
    tt.add_column("formula", overflow="fold")
    if env:
        tt.add_column("value", justify="right", no_wrap=True)
    items = [("params (P_total)", an.params, "")]
    for ph in PHASES + ("train",):
        items.append((f"model FLOPs, {ph}", an.flops(ph), "FLOP"))
    items += [("all FLOPs, train", an.flops("train", "all"), "FLOP"), ("bytes moved, train", an.bytes("train"), "B")]
    for name, expr, unit in items:
        cells = [name, fmt(expr)]
        if env:
            v = _value(expr, env)
            cells.append(human(v, unit) if unit else f"{v:,}")
        tt.add_row(*cells)
    c.print(tt)

    P, rem, form = an.train_simplified()
    tp, cp = an.tp_share(), an.cp_share()
    groups = an.token_groups()
    if tp != 1:
        n_words = n_per_step(an) if cp == 1 else "N = B·S/CP: the rank's tokens, S/CP of each sequence"
        c.print(f"[bold]Training model FLOPs of one rank = 6·N·P/TP + remainder[/bold]   ({n_words}; "
                "P: the whole model's, each of the TP ranks runs 1/TP of the split matmuls)")
    elif cp != 1:
        c.print(f"[bold]Training model FLOPs of one rank = 6·N·P + remainder[/bold]   (N = B·S/CP: the rank's "
                "tokens, S/CP of each sequence)")
    elif len(groups) > 1:  # (an encoder-decoder: each stack's weights on the tokens it processes)
        c.print("[bold]Training model FLOPs = 6·N_enc·P_enc + 6·N_dec·P_dec + remainder[/bold]   (Raffel et al. "
                "2020 §3.2.2: the encoder runs on the source tokens, the decoder and head on the target tokens; "
                "N_enc = B·S_enc, N_dec = B·S per step)")
    else:
        c.print(f"[bold]Training model FLOPs = 6·N·P + remainder[/bold]   ({n_per_step(an)})")
    if len(groups) > 1:
        for (names, Pk), what in zip(groups, ("P_enc (weights on the source tokens: the encoder's, the "
                                              "cross-attention's key/value projections)",
                                              "P_dec (weights on the target tokens: the decoder's, the head)")):
            c.print(f"  {what} = {fmt(Pk)}")
    c.print(f"  P (parameters used as matmul operands) = {fmt(P)}")
    c.print(f"  P_total (all parameters, tied once)    = {fmt(an.params)}")
    c.print(f"  non-embedding params (Kaplan et al. 2020's N) = {fmt(an.params_nonembedding)}"
            + (f"   (embedding: {', '.join(an.embedding_params)})" if an.embedding_params else ""))
    moe_facts = _moe_summary(an)
    if moe_facts is not None:
        c.print(f"  mixture of experts, routing {moe_facts['routing']['description']}")
        c.print(f"    P above counts R of the E experts (P_active); with all E experts: {fmt(an.params_matmul)}"
                f"; P_active (all kinds) = {fmt(an.params_active)}; memory holds all of P_total")
        if moe_facts["slots_per_expert"] is not None:
            c.print(f"    token slots per expert (the busiest expert's load) C = {fmt(moe_facts['slots_per_expert'])}"
                    + (f" = {_slots(moe_facts['slots_per_expert'], env)}" if env else ""))
    for why, names in an.params_not_in_P().items():
        c.print(f"    not in P, {why}: {', '.join(names)}")
    c.print(f"  remainder = {fmt(rem)}")
    c.print(f"  flops.train = {an.train_simplified_str()}")
    attn = an.attention_flops
    if env:
        N = _value(sympy.Mul(*(SYMS[n] for n in an.n_symbols())) / cp, {**env, **{SYMS[k]: v for k, v in an.pinned.items()}})
        total = _value(an.flops("train"), env)
        sixnp = 6 * N * _value(P, env) / (_value(tp, {**env, **{SYMS[k]: v for k, v in an.pinned.items()}}) if tp != 1 else 1)
        if len(groups) > 1:  # (6·N_enc·P_enc + 6·N_dec·P_dec: the total less the exact remainder)
            sixnp = _value(an.flops("train"), env) - _value(rem, env)
        fwd, bwd = _value(an.flops("forward"), env), _value(an.flops("backward"), env)
        if total == 0:
            c.print(f"[yellow]warning[/yellow]: model FLOPs are 0 at these sizes (no matmul-class op ran); "
                    f"all FLOPs, train = {human(_value(an.flops('train', 'all'), env), 'FLOP')}; the 6·N·P "
                    "form and the forward : backward split do not apply")
        else:
            name = "6·N_enc·P_enc + 6·N_dec·P_dec" if len(groups) > 1 else f"6·N·P{'/TP' if tp != 1 else ''}"
            c.print(f"  at these sizes: {name} = {human(sixnp, 'FLOP')}, remainder = {human(total - sixnp, 'FLOP')}"
                    f" ({(total - sixnp) / total:.1%} of {human(total, 'FLOP')})")
            ratio = f"1 : {bwd / fwd:.3f}" if fwd else "- (no forward model FLOPs)"
            c.print(f"  forward : backward = {ratio}    attention (matmuls without a parameter"
                    f" operand) = {_value(attn, env) / total:.1%} of model FLOPs")
            hw = _value(an.flops("train", "hardware"), env)
            if hw != total:  # (JSON flops_hw.train)
                c.print(f"  hardware FLOPs, train = {human(hw, 'FLOP')} (+{(hw - total) / total:.1%}: what activation "
                        "checkpointing and a fused attention backward run again; HFU counts them, MFU does not)")
    else:
        c.print(f"  attention matmuls (no parameter operand), train = {fmt(attn)}")
    _unsupported(c, an, env)
    if memory:
        render_memory(memory, c, an.precision)


def _unsupported(c, an: Analysis, env) -> None:
    """One warning line per op without a cost rule (its FLOPs count as 0): never a silent zero."""
    for k, v in an.unsupported.items():
        c.print(f"[yellow]warning[/yellow]: no cost rule for {k} ×{_value(v, env) if env else fmt(v)}, "
                "the times it runs per step; its FLOPs count as 0")


def _module_table(c: Console, an: Analysis, env, shown) -> None:
    """The per-module table: one row per module one level below each block (blocks folded:
    a row's costs are summed over the times it runs per step), leading terms or numbers."""
    classes = module_classes(an)
    rows = module_rows(an)
    width = max(len(_row_label(r["module"], classes, _block_of(r["module"], an.layer_container) or ""))
                + (2 if _block_of(r["module"], an.layer_container) else 0) for r in rows)

    def section(block):  # the block's name, and its class where that does not widen the column
        label = _row_label(block, classes)
        return label if len(label) <= width else block
    if env:
        title = ("Per module, per training step, at the sizes above: model FLOPs forward (fwd) and backward "
                 "(bwd), all FLOPs (all), bytes moved and FLOP per byte")
        cols = [("fwd", "FLOP"), ("bwd", "FLOP"), ("all", "FLOP"), ("bytes", "B"), ("FLOP/B", "")]
    else:
        title = ("Per module, per training step (forward + backward): leading terms of model FLOPs, all "
                 "FLOPs and bytes moved")
        cols = [("model", ""), ("all", ""), ("bytes", ""), ("FLOP/B *", "")]
    lengths = sorted(set((getattr(an, "stacks", None) or {}).values())) or ["L"]  # (several stacks: each own length)
    mt = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
               caption=(f"runs: times per step (blocks folded over {', '.join(lengths)}); costs are summed over them. "
                        + ("Values in k/M/G/T (10³…) FLOP and Ki/Mi/Gi (2¹⁰…) bytes." if env else
                           "Leading terms only (full formulas: symcost formulas, or --json); "
                           "* FLOP per byte at the default sizes.")),
               caption_justify="left")
    mt.add_column("module", no_wrap=True, min_width=width)
    mt.add_column("runs", no_wrap=True, justify="right")
    for name, unit in cols:
        mt.add_column(name, justify="right", overflow="fold")
    current = None
    for row in rows:
        key = row["module"]
        block = _block_of(key, an.layer_container)
        if block != current:
            current = block
            if block is not None:
                mt.add_row(f"[bold]{section(block)}[/bold]", "", *[""] * len(cols))
        label = _row_label(key, classes, block or "")
        if block is not None:
            label = "  " + label
        fa, by = row["flops_all"], row["bytes"]
        if env:
            fw, bw = _value(row["flops.forward"], env), _value(row["flops.backward"], env)
            fv, bv = _value(fa, env), _value(by, env)
            cells = [short(fw, "FLOP"), short(bw, "FLOP"), short(fv, "FLOP"), short(bv, "B"),
                     f"{fv / bv:.1f}" if bv else "-"]
        else:
            model = sympy.expand(row["flops.forward"] + row["flops.backward"])
            fv, bv = _value(fa, shown), _value(by, shown)
            cells = [pretty(leading(model, shown), " "), pretty(leading(fa, shown), " "),
                     pretty(leading(by, shown), " "), f"{fv / bv:.1f}" if bv else "-"]
        mt.add_row(label, _count(row["repeat"]), *cells)
    c.print(mt)


def render_memory(memory: dict, c: Console | None = None, precision: str | None = None) -> None:
    """Print the memory section produced by the memory pass (rows of label, formula, value),
    then every precision policy with its bytes per parameter."""
    c = c or console()
    t = Table(title=memory.get("title", "Memory"), title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("component")
    t.add_column("formula (bytes)", overflow="fold")
    rows = memory.get("rows", [])
    valued = any(v for _, _, v in rows)
    if valued:
        t.add_column("value", justify="right", no_wrap=True)
    for label, formula, value in rows:
        t.add_row(label, formula, *([value] if valued else []))
    c.print(t)
    for line in memory.get("lines", []):
        c.print(line)
    policy_table(c, memory.get("json", {}).get("optimizer_name", "adamw"), precision)


def policy_table(c: Console, optimizer_name: str = "adamw", current: str | None = None) -> None:
    """Every ``--precision`` with its bytes per parameter (weights + gradients + optimizer state
    + master weights) under ``optimizer_name``."""
    from symcost.passes.memory import POLICIES, optimizer
    from symcost.frontends.precision import SUMMARY

    opt = optimizer(optimizer_name)
    t = Table(title=f"Precision policies (--precision), bytes per parameter with {opt.name}", title_justify="left",
              box=box.SIMPLE_HEAD)
    t.add_column("precision", no_wrap=True)
    t.add_column("B/param", justify="right", no_wrap=True)
    t.add_column("weights + grads + state + master: what it models")
    for name, pol in POLICIES.items():
        bpp = pol.param + pol.grad + opt.full * pol.state + pol.master
        mark = " (this report)" if name == current else ""
        step = f" (+{pol.grad_copy} at the step)" if pol.grad_copy else ""  # an fp32 gradient copy, transient
        t.add_row(name + mark, str(bpp) + (f" +{pol.grad_copy}" if pol.grad_copy else ""),
                  f"{pol.param} + {pol.grad} + {opt.full}×{pol.state} + {pol.master}{step}: "
                  f"{SUMMARY.get(name, pol.note)}")
    c.print(t)


def render_values(an: Analysis, sizes: Mapping[str, int], memory: dict | None = None,
                  width: int | None = None) -> None:
    """Print the totals as integers (``symcost eval`` without --json), with the ops that have no
    cost rule (counted as 0) listed as the report lists them."""
    c = console(width)
    vals = an.subs(**sizes)
    env = an.bind(**sizes)
    c.print(f"{an.model} at " + ", ".join(f"{k}={v}" for k, v in sorted((str(k), v) for k, v in env.items()))
            + f"   precision {an.precision}"
            + (f", attention {an.spec.extra['attention']}" if an.spec.extra.get("attention") else ""))
    if getattr(an, "attention_count", "full") == "causal":
        c.print(CAUSAL_LABEL)
    for k, v in vals.items():
        unit = "FLOP" if k.startswith("flops") else ("B" if k.startswith("bytes") else "")
        c.print(f"  {k:<18} {v:>24,}" + (f"   ({human(v, unit)})" if unit else ""))
    if memory and "json" in memory:
        for k, v in memory["json"].items():
            if isinstance(v, int) and not isinstance(v, bool):
                unit = "" if k in ("max_batch", "bytes_per_param") else "B"
                c.print(f"  memory.{k:<22} {v:>17,}" + (f"   ({human(v, unit)})" if unit else ""))
                if k == "max_batch" and memory["json"].get("max_batch_reason"):
                    c.print(f"    (no batch fits: {memory['json']['max_batch_reason']})")
        if memory["json"].get("fits") is False:
            c.print(f"  [bold red]does not fit[/bold red]: {memory['json']['fits_reason']}")
    _unsupported(c, an, env)


def _mesh_sizes(layout, env) -> dict:
    """``{dimension: size}`` of ``layout``'s mesh at ``env`` (symbol -> value; the symbol's
    name for a size not there): ``report --json``'s ``layout.mesh``."""
    def size_of(sym):
        v = (env or {}).get(SYMS[sym]) if sym in SYMS else None
        return int(v) if v is not None else sym

    out = {}
    for d in layout.dims:
        try:
            n = layout.dim_size(d, size_of)
        except TypeError:  # (DP/R with DP not given)
            n = None
        out[d] = int(n) if isinstance(n, int) or getattr(n, "is_Integer", False) else str(n)
    return out


def to_json(an: Analysis, sizes: Mapping[str, int] | None, memory: dict | None = None) -> dict:
    """The JSON contract: formulas (strings sympify parses) without sizes, integers with them.

    Keys: model, precision, attention (the implementation of an ``hf:`` model; else null),
    symbols, params, params_matmul, params_embedding, params_nonembedding (Kaplan et al. 2020's
    N), flops.{forward,backward,train, train_simplified} (model FLOPs: the same for every attention
    kernel), flops_hw.* (hardware FLOPs: a fused attention backward's recomputed scores
    included), flops_all.*, bytes.*, transcendentals.*
    (exp, log, erf, tanh, sin and sqrt evaluations, all classes together), attention_flops,
    attention_flops_count ("full" or "causal": how the attention matmuls were counted),
    unsupported_ops (and memory.* when the memory pass ran); params_active (equal to params for a
    dense model) and moe (null for a dense model, else ``routing`` {model, capacity_factor,
    description}, ``slots_per_expert`` C (the busiest expert's token slots) and
    ``params_active_matmul``, the P of 6·N·P_active).
    """
    env = an.bind(**sizes) if sizes is not None else None

    def out(expr):
        return _value(expr, env) if env is not None else fmt(expr)

    P, rem, form = an.train_simplified()
    symbols = {}
    for s, meaning in an.symbols.items():
        symbols[s] = {"meaning": meaning}
        if env is not None:
            symbols[s]["value"] = env[SYMS[s]]
    res = {
        "model": an.model,
        "precision": an.precision,
        "attention": an.spec.extra.get("attention"),
        "task": an.spec.extra.get("task"),  # (hf: models with a head other than the causal LM's: --task)
        # the mesh one rank of which was traced: {dimension: size} (torchtitan's names and order;
        # the symbol's name where no size is given), empty for one device, as report --pp has it
        "layout": {"mesh": _mesh_sizes(layout_of(an), env), **layout_of(an).to_dict()},
        "symbols": symbols,
        "tied_symbols": dict(an.spec.tied),
        "pinned_symbols": dict(an.pinned),
        "params": out(an.params),
        "params_matmul": out(P),
        "params_embedding": out(an.params_embedding),
        "params_nonembedding": out(an.params_nonembedding),
        "flops": {ph: out(an.flops(ph)) for ph in PHASES + ("train",)},
        "flops_all": {ph: out(an.flops(ph, "all")) for ph in PHASES + ("train",)},
        "flops_hw": {ph: out(an.flops(ph, "hardware")) for ph in PHASES + ("train",)},
        "bytes": {ph: out(an.bytes(ph)) for ph in PHASES + ("train",)},
        "transcendentals": {ph: out(an.transcendentals(ph)) for ph in PHASES + ("train",)},
        "attention_flops": out(an.attention_flops),
        "attention_flops_count": getattr(an, "attention_count", "full"),
        "unsupported_ops": {k: out(v) for k, v in an.unsupported.items()},
    }
    res["flops"]["train_simplified"] = out(form) if env is not None else an.train_simplified_str()
    res["flops"]["remainder"] = out(rem)
    res["params_active"] = out(an.params_active)
    moe_facts = _moe_summary(an)
    res["moe"] = None if moe_facts is None else {
        "routing": moe_facts["routing"],
        "experts_code": moe_facts["experts_code"],
        "slots_per_expert": None if moe_facts["slots_per_expert"] is None else _slots(moe_facts["slots_per_expert"], env),
        "params_active_matmul": out(moe_facts["params_active_matmul"]),
    }
    if memory and "json" in memory:
        res["memory"] = memory["json"]
    return res


def parallel_json(an: Analysis, sizes: Mapping[str, int] | None, summary: dict) -> dict:
    """JSON of :func:`symcost.passes.parallel.summary`: ``comm`` {all_gather, reduce_scatter,
    all_reduce, total} (bytes one rank sends, = receives, per step, ring algorithm) and
    ``parallel`` {shard, dp, engine, sharded, memory_per_rank {params, grads, optimizer_state,
    master, total, activations}, memory {peak, where, parts}: the rank's peak from its storage
    schedule, :func:`symcost.passes.parallel.rank_peak`} (formulas without sizes, with
    ``memory.peak_at_defaults``; with sizes the pass's exact values,
    FSDP2's padding included, and ``divisible``: whether DP divides every sharded dimension, i.e.
    whether the formulas hold there as they are)."""
    vals = summary.get("values") if sizes is not None else None

    def num(v):
        v = sympy.sympify(v)
        return int(v) if v.is_integer else float(v)

    peak = peak_json(summary, vals is not None)
    if vals is None:
        out = {
            "comm": {k: fmt(v) for k, v in summary["comm"].items()},
            "parallel": {"shard": summary["shard"], "dp": "DP" if "DP" in an.symbols else an.pinned.get("DP"),
                         "engine": summary["engine"], "sharded": summary["label"],
                         "memory_per_rank": {k: fmt(v) for k, v in summary["memory"].items()},
                         "memory": peak},
        }
        if summary.get("tensor_parallel"):  # the 2-D mesh
            out["parallel"].update(tp="TP" if "TP" in an.symbols else an.pinned.get("TP"),
                                   sp=summary["tensor_parallel"] == "tp+sp")
        _hsdp_json(an, out["parallel"], None)
        if summary.get("comm_by_group"):  # each group's collectives
            out["parallel"]["comm_by_group"] = {g: {k: fmt(v) for k, v in d.items()}
                                                for g, d in summary["comm_by_group"].items()}
        if "params_rank" in summary:  # (--ep under FSDP2: EP and the rank's parameter elements)
            out["parallel"].update(ep="EP" if "EP" in an.symbols else an.pinned.get("EP"),
                                   params_rank=fmt(summary["params_rank"]))
        if summary.get("offload"):
            from symcost.render.offload import offload_json

            out["parallel"]["offload"] = offload_json(summary["offload"], False, fmt)
        return out
    out = {
        "comm": {k: num(v) for k, v in vals["comm"].items()},
        "parallel": {"shard": summary["shard"], "dp": int(vals["dp"]), "engine": summary["engine"],
                     "sharded": summary["label"], "divisible": bool(vals["divisible"]),
                     "memory_per_rank": {k: num(v) for k, v in vals["memory"].items()},
                     "memory": peak},
    }
    if summary.get("tensor_parallel"):
        out["parallel"].update(tp=int(vals["tp"]), sp=summary["tensor_parallel"] == "tp+sp")
    _hsdp_json(an, out["parallel"], int(vals["dp"]))
    if vals.get("comm_by_group"):
        out["parallel"]["comm_by_group"] = {g: {k: num(v) for k, v in d.items()}
                                            for g, d in vals["comm_by_group"].items()}
    if "params_rank" in vals:
        out["parallel"].update(ep=int(vals["ep"]), params_rank=num(vals["params_rank"]))
    if summary.get("offload"):
        from symcost.render.offload import offload_json

        out["parallel"]["offload"] = offload_json(summary["offload"], True, fmt)
    return out


def _hsdp_json(an: Analysis, par: dict, dp: int | None) -> None:
    """HSDP's two data-parallel sizes in ``par``: ``dp_replicate`` R and ``dp_shard`` (DP/R:
    the formula's, or at ``dp``)."""
    from symcost.frontends.layout import layout_of

    r = layout_of(an).replicate
    if r:
        par.update(dp_replicate=r, dp_shard=dp // r if dp is not None else f"DP/{r}")


def _slots(expr, env):
    """Slots per expert: the formula without sizes; an int at sizes, a float where N·R/E is
    fractional (the balanced average)."""
    if env is None:
        return fmt(expr)
    v = sympy.sympify(expr).subs(env)
    return int(v) if v.is_integer else float(v)


def n_per_step(an) -> str:
    """What the N = B·S of the 6·N·P line counts, in the model's words: the meaning the model
    declares for S (``ModelSpec.extra["meanings"]``, e.g. ``{"S": "patches per image"}``); else
    tokens where the traced step looks its inputs up in an embedding table (a language model);
    else no unit, saying that the model declares none (an image model's S is no token count). A
    model without a sequence (:meth:`~symcost.graph.conventions.Conventions.n_symbols`: S in
    neither its FLOPs nor its pins) has N = B, the samples (B's meaning where the model gives one)."""
    from symcost.frontends.spec import SYMBOL_MEANINGS

    if an.n_symbols() == ("B",):
        meaning = an.symbols.get("B")
        what = meaning if meaning is not None and meaning != SYMBOL_MEANINGS["B"] else "samples per step"
        return f"N = B per step, B: {what}; the model has no sequence (S is in none of its FLOPs)"

    meaning = an.symbols.get("S")
    if meaning is not None and meaning != SYMBOL_MEANINGS["S"]:
        return f"N = B·S per step, S: {meaning}"
    if "lookup" in an.embedding_params.values():
        return "N = B·S tokens per step"
    return "N = B·S per step; the model declares no meaning for S and looks up no tokens"


def _moe_summary(an: Analysis) -> dict | None:
    """:func:`symcost.passes.moe.summary` (None for a dense model)."""
    from symcost.passes.moe import summary

    return summary(an)


def memory_section(an: Analysis, sizes, cap: str, precision: str, optimizer: str, **options) -> dict | None:
    """The memory section of the report, when the memory pass is available (else None).

    ``options`` go to :func:`symcost.render.memory.report_section` (e.g. ``evaluate=True``: integers
    even without sizes, at the model's defaults).
    """
    from symcost.render.memory import report_section

    return report_section(an, sizes, cap, precision, optimizer, **options)


def peak_json(summary, at_sizes: bool) -> dict:
    """The JSON form of a per-rank summary's ``peak`` (:func:`symcost.passes.parallel.rank_peak`):
    ``peak`` (bytes at the sizes asked for; the formula without sizes, then ``peak_at_defaults``
    in bytes), ``where``, ``parts`` (bytes, adding up to the peak) and ``formula``; or
    ``peak: None`` and ``error`` where the trace has no storage schedule."""
    pk = summary.get("peak") or {}
    if "error" in pk:
        return {"peak": None, "error": pk["error"]}
    peak = {"peak": pk["value"] if at_sizes else fmt(pk["formula"]), "where": pk["where"],
            "parts": pk["parts"], "formula": fmt(pk["formula"])}
    if not at_sizes:
        peak["peak_at_defaults"] = pk["value"]
    return peak


def add_peak_row(t, pk: dict) -> None:
    """A ``memory.peak`` row (formula, or a pointer to --json where it is long; bytes) in a
    :func:`per_rank_table` from :func:`peak_json`'s dict."""
    if pk.get("peak") is None:
        t.add_row("memory.peak", "", pk.get("error", ""))
        return
    val = pk["peak"] if isinstance(pk["peak"], int) else pk["peak_at_defaults"]
    f = pk["formula"] if len(pk["formula"]) <= 120 else "(a Max of live sets: --json prints it)"
    t.add_row("memory.peak" + ("" if isinstance(pk["peak"], int) else " (at the defaults)"), f, human(val, "B"))


def per_rank_table(summary, js, par, priced=None):
    """The rich table of one rank's collectives and memory: each ``summary["comm"]`` and
    ``summary["memory"]`` formula with its value (bytes per rank per step) from the JSON forms
    ``js["comm"]`` and ``par["memory_per_rank"]``; ``priced`` {group: [(label, formula, value)]}
    adds rows after a group's traced ones (the bytes the step time prices where they differ:
    Megatron-LM's buckets, :func:`symcost.render.data_parallel.bucket_rows`)."""
    from rich.table import Table

    t = Table("per rank, per step", "formula", "value", box=None)
    for k, v in summary["comm"].items():
        val = js["comm"][k]
        t.add_row(f"comm.{k} (sent = received)", fmt(v), human(val, "B") if isinstance(val, (int, float)) else "")
    left = dict(priced or {})
    for g, d in (summary.get("comm_by_group") or {}).items():  # the 2-D mesh: each group's share
        for k, v in d.items():
            if v != 0:
                val = par["comm_by_group"][g][k]
                t.add_row(f"  over the {g} group: {k}", fmt(v), human(val, "B") if isinstance(val, (int, float)) else "")
        for row in left.pop(g, ()):
            t.add_row(*row)
    for rows in left.values():
        for row in rows:
            t.add_row(*row)
    for k, v in summary["memory"].items():
        val = par["memory_per_rank"][k]
        t.add_row(f"memory.{k}", fmt(v), human(val, "B") if isinstance(val, (int, float)) else "")
    return t

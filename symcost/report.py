"""Rendering: the report's rich tables, readable units and the JSON contract.

Nothing here computes a cost; it prints what :class:`symcost.analysis.Analysis` (and the memory
pass) return.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

import sympy
from rich.console import Console
from rich.table import Table

from .analysis import PHASES, Analysis
from .fit import SYMS

_console = None
#: the label of every text output whose attention matmuls were counted causally
CAUSAL_LABEL = ("attention FLOPs: causal count (S*(S+1)/2 score pairs per attention matmul, "
                "--attention-flops causal; FlopCounterMode counts S^2)")


def console() -> Console:
    """The rich console used for text output (wide enough for formulas)."""
    global _console
    if _console is None:
        _console = Console(width=160, highlight=False, emoji=False)
    return _console


def human(value: float, unit: str) -> str:
    """Readable number: FLOPs in GFLOP/TFLOP/PFLOP, bytes in KiB/MiB/GiB (binary)."""
    v = float(value)
    if unit == "B":
        for u, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(v) >= f:
                return f"{v / f:.3f} {u}"
        return f"{int(v)} B"
    if unit == "FLOP":
        for u, f in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
            if abs(v) >= f:
                return f"{v / f:.3f} {u}"
        return f"{int(v)} FLOP"
    return f"{v:.4g} {unit}"


def fmt(expr) -> str:
    """A formula as text: sympy's string form with · for products is kept parseable."""
    return str(expr)


def module_group(module: str, container: str | None) -> str:
    """Row key of the per-module table: one level below each block, top-level parts as is."""
    if not module:
        return "(loss / top level)"
    parts = module.split(".")
    if container is not None:
        cparts = container.split(".") if container else []
        n = len(cparts)
        if parts[:n] == cparts and len(parts) > n:
            return ".".join(parts[: n + 2])
        return ".".join(parts[: max(n, 1)])
    return ".".join(parts[:1])


def module_rows(an: Analysis) -> list[dict[str, Any]]:
    """Per-module totals (repeat folded in): FLOPs forward/backward, all FLOPs, bytes (train)."""
    zero = sympy.Integer(0)
    acc: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "flops.forward": zero, "flops.backward": zero, "flops_all": zero, "bytes": zero, "repeat": 1})
    order: list[str] = []
    for op in an.ops:
        key = module_group(op.module, an.layer_container)
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
    return int(sympy.sympify(expr).subs(env))


def render(an: Analysis, sizes: Mapping[str, int], table: bool = True, memory: dict | None = None) -> None:
    """Print the report: symbols, per-module table, totals as formulas, 6·N·P form (+ numbers)."""
    c = console()
    env = an.bind(**sizes) if sizes else None
    c.print(f"[bold]symcost report[/bold]: {an.model}   precision {an.precision}   "
            f"(traced in {sum(an.timings.values()):.1f} s)")
    if getattr(an, "attention_count", "full") == "causal":
        c.print(CAUSAL_LABEL)
    st = Table(title="Symbols", title_justify="left")
    st.add_column("symbol")
    st.add_column("meaning")
    st.add_column("value" if sizes else "default")
    defaults = an.bind() if not sizes else env
    for s, meaning in an.symbols.items():
        v = (env or defaults)[SYMS[s]]
        mark = "" if not sizes or s in sizes else " (default)"
        st.add_row(s, meaning, f"{v}{mark}")
    for a, b in an.spec.tied.items():
        st.add_row(a, f"tied: {a} = {b} in this configuration", "")
    for a, v in an.pinned.items():
        st.add_row(a, f"pinned: {a} = {v} (size 1 traces other kernels, so it is not a symbol here)", str(v))
    c.print(st)

    if table:
        mt = Table(title="Per module (training step, forward + backward)" + (" at the sizes above" if env else ""),
                   title_justify="left")
        for col in ("module", "× (summed in)", "model FLOPs fwd", "model FLOPs bwd", "all FLOPs", "bytes", "FLOP/byte"):
            mt.add_column(col, overflow="fold")
        for row in module_rows(an):
            fa, by = row["flops_all"], row["bytes"]
            if env:
                fv, bv = _value(fa, env), _value(by, env)
                cells = [human(_value(row["flops.forward"], env), "FLOP"),
                         human(_value(row["flops.backward"], env), "FLOP"),
                         human(fv, "FLOP"), human(bv, "B"), f"{fv / bv:.2f}" if bv else "-"]
            else:
                inten = sympy.cancel(fa / by) if by != 0 else 0
                cells = [fmt(row["flops.forward"]), fmt(row["flops.backward"]), fmt(fa), fmt(by),
                         fmt(inten)]
            mt.add_row(row["module"], str(row["repeat"]), *cells)
        c.print(mt)

    tt = Table(title="Totals", title_justify="left")
    tt.add_column("quantity")
    tt.add_column("formula", overflow="fold")
    if env:
        tt.add_column("value")
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
    c.print("[bold]Training model FLOPs = 6·N·P + remainder[/bold]   (N = B·S tokens per step)")
    c.print(f"  P (parameters used as matmul operands) = {fmt(P)}")
    c.print(f"  P_total (all parameters, tied once)    = {fmt(an.params)}")
    c.print(f"  N (non-embedding, Kaplan et al. 2020)  = {fmt(an.params_nonembedding)}"
            + (f"   (embedding: {', '.join(an.embedding_params)})" if an.embedding_params else ""))
    for why, names in an.params_not_in_P().items():
        c.print(f"    not in P, {why}: {', '.join(names)}")
    c.print(f"  remainder = {fmt(rem)}")
    c.print(f"  flops.train = {an.train_simplified_str()}")
    attn = an.attention_flops
    if env:
        N = _value(SYMS["B"] * SYMS["S"], {**env, **{SYMS[k]: v for k, v in an.pinned.items()}})
        total = _value(an.flops("train"), env)
        sixnp = 6 * N * _value(P, env)
        fwd, bwd = _value(an.flops("forward"), env), _value(an.flops("backward"), env)
        c.print(f"  at these sizes: 6·N·P = {human(sixnp, 'FLOP')}, remainder = {human(total - sixnp, 'FLOP')}"
                f" ({(total - sixnp) / total:.1%} of {human(total, 'FLOP')})")
        c.print(f"  forward : backward = 1 : {bwd / fwd:.3f}    attention (matmuls without a parameter"
                f" operand) = {_value(attn, env) / total:.1%} of model FLOPs")
    else:
        c.print(f"  attention matmuls (no parameter operand), train = {fmt(attn)}")
    if an.unsupported:
        c.print(f"[yellow]warning[/yellow]: ops without a cost rule (counted as 0, listed here): "
                + ", ".join(f"{k} ×{fmt(v)}" for k, v in an.unsupported.items()))
    if memory:
        render_memory(memory)


def render_memory(memory: dict) -> None:
    """Print the memory section produced by the memory pass (rows of label, formula, value)."""
    c = console()
    t = Table(title=memory.get("title", "Memory"), title_justify="left")
    t.add_column("component")
    t.add_column("formula", overflow="fold")
    t.add_column("value")
    for label, formula, value in memory.get("rows", []):
        t.add_row(label, formula, value)
    c.print(t)
    for line in memory.get("lines", []):
        c.print(line)


def render_values(an: Analysis, sizes: Mapping[str, int], memory: dict | None = None) -> None:
    """Print the totals as integers (``symcost eval`` without --json)."""
    c = console()
    vals = an.subs(**sizes)
    env = an.bind(**sizes)
    c.print(f"{an.model} at " + ", ".join(f"{k}={v}" for k, v in sorted((str(k), v) for k, v in env.items())))
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


def to_json(an: Analysis, sizes: Mapping[str, int] | None, memory: dict | None = None) -> dict:
    """The JSON contract: formulas (strings sympify parses) without sizes, integers with them.

    Keys: model, precision, symbols, params, params_matmul, params_embedding,
    params_nonembedding (Kaplan et al. 2020's N), flops.{forward,backward,train,
    train_simplified}, flops_all.*, bytes.*, attention_flops, attention_flops_count ("full" or
    "causal": how the attention matmuls were counted), unsupported_ops (and memory.* when the
    memory pass ran).
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
        "symbols": symbols,
        "tied_symbols": dict(an.spec.tied),
        "pinned_symbols": dict(an.pinned),
        "params": out(an.params),
        "params_matmul": out(P),
        "params_embedding": out(an.params_embedding),
        "params_nonembedding": out(an.params_nonembedding),
        "flops": {ph: out(an.flops(ph)) for ph in PHASES + ("train",)},
        "flops_all": {ph: out(an.flops(ph, "all")) for ph in PHASES + ("train",)},
        "bytes": {ph: out(an.bytes(ph)) for ph in PHASES + ("train",)},
        "attention_flops": out(an.attention_flops),
        "attention_flops_count": getattr(an, "attention_count", "full"),
        "unsupported_ops": {k: out(v) for k, v in an.unsupported.items()},
    }
    res["flops"]["train_simplified"] = out(form) if env is not None else an.train_simplified_str()
    res["flops"]["remainder"] = out(rem)
    if memory and "json" in memory:
        res["memory"] = memory["json"]
    return res


def memory_section(an: Analysis, sizes, cap: str, precision: str, optimizer: str, **options) -> dict | None:
    """The memory section of the report, when the memory pass is available (else None).

    ``options`` go to ``symcost.memory.report_section`` (e.g. ``evaluate=True``: integers even
    without sizes, at the model's defaults).
    """
    try:
        from . import memory as mem
    except ImportError:
        return None
    return mem.report_section(an, sizes, cap, precision, optimizer, **options)

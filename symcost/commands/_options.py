"""Options and helpers every ``symcost`` command shares: --set/--config parsing, the common
options, and tracing the model a command names.

Imports nothing heavy at module level (the CLI's --help must stay fast); torch comes in with the
trace.
"""
from __future__ import annotations

import re

import click

from ..errors import SymcostError
from ..spec import SYMBOL_MEANINGS

_MULTI = ("--set", "--config")
_PAIR = re.compile(r"^[A-Za-z_][\w.]*=")


def expand_multi(argv: list[str]) -> list[str]:
    """Let ``--set B=8 S=1024`` mean ``--set B=8 --set S=1024`` (same for --config).

    The token right after ``--set`` is always its value (so ``--set B`` reaches parse_sizes and
    gets its error); later tokens belong to it while they look like ``KEY=VALUE``.
    """
    out: list[str] = []
    current, first = None, False
    for tok in argv:
        if tok in _MULTI:
            current, first = tok, True
            continue
        if current and (first or _PAIR.match(tok)):
            out += [current, tok]
            first = False
            continue
        current = None
        out.append(tok)
    if current and first:
        out.append(current)  # "--set" with nothing after: click says it needs a value
    return out


def parse_sizes(pairs: tuple[str, ...]) -> dict[str, int]:
    """``("B=8", "S=1024")`` -> ``{"B": 8, "S": 1024}``; values are positive integers.

    Raises:
        SymcostError: malformed pair, unknown symbol, non-integer or non-positive value.
    """
    sizes: dict[str, int] = {}
    for pair in pairs:
        key, eq, val = pair.partition("=")
        key = key.strip()
        if not eq:
            raise SymcostError(f"--set takes SYMBOL=INTEGER, got {pair!r}")
        if key not in SYMBOL_MEANINGS:
            raise SymcostError(f"unknown symbol {key!r} in --set; accepted: {', '.join(SYMBOL_MEANINGS)}")
        raw = val.strip()
        val = raw.replace("_", "")
        if not re.fullmatch(r"[+-]?\d+", val):
            raise SymcostError(f"{key} must be a positive integer, got {raw!r}")
        n = int(val)
        if n <= 0:
            raise SymcostError(f"{key} must be a positive integer, got {n}")
        sizes[key] = n
    return sizes


def parse_config(pairs: tuple[str, ...]) -> dict[str, str]:
    """``("rope_theta=10000",)`` -> ``{"rope_theta": "10000"}`` (values parsed by the hf loader)."""
    out = {}
    for pair in pairs:
        key, eq, val = pair.partition("=")
        if not eq or not key.strip():
            raise SymcostError(f"--config takes KEY=VALUE, got {pair!r}")
        out[key.strip()] = val.strip()
    return out


def _store_attention_flops(ctx, param, value):
    ctx.meta["symcost.attention_flops"] = value
    return value


def common(f):
    # --attention-flops reaches trace_model through the click context (no command signature
    # changes): every command that traces a model honours it
    f = click.option("--attention-flops", type=click.Choice(["full", "causal"]), default="full",
                     show_default=True, expose_value=False, callback=_store_attention_flops,
                     help="count attention matmuls over all S_q*S_k score pairs (full, as "
                          "FlopCounterMode) or over the S*(S+1)/2 of a causal mask (causal)")(f)
    f = click.option("--debug", is_flag=True, help="show tracebacks")(f)
    f = click.option("--precision", default="bf16-mixed", show_default=True,
                     help="fp32, bf16, bf16-mixed, bf16-mixed-master, fp16-mixed, fp16")(f)
    f = click.option("--attention", type=click.Choice(["eager", "sdpa"]), default="eager",
                     help="attention implementation for hf: models")(f)
    f = click.option("--config", "config", multiple=True, metavar="KEY=VALUE",
                     help="hf: config override (repeatable: --config a=1 b=2)")(f)
    f = click.option("--set", "sets", multiple=True, metavar="SYM=INT",
                     help="symbol value, e.g. --set B=8 S=1024")(f)
    return f


def trace_model(model, sets, config, attention, precision="bf16-mixed"):
    from ..analysis import trace
    from ..models import resolve
    from ..record import PRECISIONS

    sizes = parse_sizes(sets)
    if precision not in PRECISIONS:
        raise SymcostError(f"unknown precision {precision!r}; accepted: {', '.join(PRECISIONS)}")
    spec = resolve(model, parse_config(config), attention)
    # reject sizes the model cannot take before the (seconds-long) trace
    unknown = [k for k in sizes if k not in spec.all_symbols and k not in spec.tied]
    if unknown:
        raise SymcostError(f"unknown symbol {unknown[0]!r} for {spec.name}; accepted: {', '.join(spec.all_symbols)}")
    values = {**spec.defaults, **sizes}
    values.update({a: values.get(b) for a, b in spec.tied.items()})
    msg = spec.check(values)
    if msg:
        raise SymcostError(msg)
    an = trace(spec, sizes=sizes, precision=precision)
    ctx = click.get_current_context(silent=True)
    an = an.with_attention_flops(ctx.meta.get("symcost.attention_flops", "full") if ctx else "full")
    an.bind(**sizes)  # validate before rendering
    return an, sizes

"""The ``symcost`` command: report, formulas, eval (and max-batch, see symcost.memory).

Every command traces the model (:func:`symcost.trace`) and renders what the passes return; bad
input is one line on stderr and exit code 2 (``--debug`` shows the traceback).
"""
from __future__ import annotations

import json
import os
import re
import sys
import traceback

import click

from .errors import SymcostError
from .models import SYMBOL_MEANINGS

_MULTI = ("--set", "--config")
_PAIR = re.compile(r"^[A-Za-z_][\w.]*=")


def _expand_multi(argv: list[str]) -> list[str]:
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


class _Group(click.Group):
    def main(self, args=None, **kwargs):  # noqa: D401 - click hook
        args = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in args
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep the output to symcost's
        try:
            return super().main(_expand_multi(args), standalone_mode=False, **kwargs)
        except SymcostError as e:
            if debug:
                traceback.print_exc()
            click.echo(f"symcost: error: {e}", err=True)
            sys.exit(2)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"symcost: error: {e.format_message()} (see symcost --help)", err=True)
            sys.exit(2)
        except click.exceptions.Abort:
            click.echo("symcost: aborted", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as e:  # noqa: BLE001
            if debug:
                traceback.print_exc()
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            click.echo(f"symcost: internal error: {type(e).__name__}: {msg} (rerun with --debug for the traceback)",
                       err=True)
            sys.exit(1)


def _common(f):
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


def _trace(model, sets, config, attention, precision="bf16-mixed"):
    from .analysis import trace
    from .models import resolve
    from .record import PRECISIONS

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
    an.bind(**sizes)  # validate before rendering
    return an, sizes


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="symcost")
def main():
    """symcost: closed-form FLOPs, bytes and memory of a PyTorch training step."""


@main.command()
@click.argument("model", default="cs336-lm")
@_common
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--memory", "memory", default="80GiB", show_default=True,
              help="memory cap for the largest-batch line (bytes, or 80GiB / 80GB)")
@click.option("--optimizer", default="adamw", show_default=True, help="adamw, adam, sgd, adafactor")
def report(model, sets, config, attention, precision, debug, as_json, memory, optimizer):
    """The main job: symbols, per-module costs, totals as formulas and the 6·N·P form.

    MODEL: cs336-lm (default), gpt2, mlp, megatron-gpt, hf:MODEL_TYPE or path/file.py:factory.
    """
    from . import report as rep

    try:
        from .memory import optimizer as _check_optimizer, parse_memory
    except ImportError:
        pass
    else:  # bad --memory / --optimizer: say so before tracing
        parse_memory(memory)
        _check_optimizer(optimizer)
    an, sizes = _trace(model, sets, config, attention, precision)
    mem = rep.memory_section(an, sizes, memory, precision, optimizer)
    if as_json:
        click.echo(json.dumps(rep.to_json(an, sizes if sizes else None, memory=mem), indent=1))
    else:
        rep.render(an, sizes, memory=mem)


def _totals_command(name: str, evaluate: bool, doc: str):
    """``formulas`` (evaluate=False) and ``eval`` (True): the same totals as formulas or integers."""

    @main.command(name=name, help=doc)
    @click.argument("model")
    @_common
    @click.option("--json", "as_json", is_flag=True, help="print one JSON object")
    @click.option("--optimizer", default="adamw", show_default=True,
                  help="adamw, adam, sgd, sgd-nomomentum, adafactor")
    def command(model, sets, config, attention, precision, debug, as_json, optimizer):
        from . import report as rep

        an, sizes = _trace(model, sets, config, attention, precision)
        mem = rep.memory_section(an, sizes, "80GiB", precision, optimizer, evaluate=evaluate)
        if as_json:
            click.echo(json.dumps(rep.to_json(an, sizes if evaluate else None, memory=mem), indent=1))
        elif evaluate:
            rep.render_values(an, sizes, memory=mem)
        else:
            rep.render(an, {}, table=False, memory=mem)

    return command


formulas = _totals_command("formulas", False, "Closed-form totals of MODEL as formulas in the canonical symbols.")
eval_ = _totals_command("eval", True, "Totals of MODEL as integers at --set sizes (others at the model's defaults).")


def _register_memory_commands():
    try:
        from . import memory_cli  # noqa: F401  (adds max-batch when the memory pass exists)
    except ImportError:
        pass


_register_memory_commands()

if __name__ == "__main__":  # pragma: no cover
    main()

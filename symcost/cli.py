"""The ``symcost`` command line: the group, its error handling, and the one registry of commands.

Each command lives in its own module under :mod:`symcost.commands` and is listed once in
:data:`COMMANDS`; the group imports a command's module only when that command (or ``--help``)
needs it. Every command traces the model (:func:`symcost.trace`) and renders what the passes
return; bad input is one line on stderr and exit code 2 (``--debug`` shows the traceback).
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback

import click

from .commands._options import expand_multi
from symcost.errors import SymcostError

#: The one place commands are registered: name -> "module:attribute" of a click command.
COMMANDS: dict[str, str] = {
    "report": "symcost.commands.report:report",
    "formulas": "symcost.commands.totals:formulas",
    "eval": "symcost.commands.totals:eval_",
    "max-batch": "symcost.commands.max_batch:max_batch",
    "devices": "symcost.commands.devices:devices",
    "calibrate": "symcost.commands.calibrate:calibrate",
    "roofline": "symcost.commands.roofline:roofline",
    "mfu": "symcost.commands.mfu:mfu",
    "time": "symcost.commands.time:time_",
    "validate": "symcost.commands.validate:validate",
    "checkpoint": "symcost.commands.checkpoint:checkpoint",
    "serve": "symcost.commands.serve:serve",
    "plan": "symcost.commands.plan:plan",
    "explore": "symcost.commands.explore:explore",
    "graphs": "symcost.commands.graphs:graphs",
}


class _Group(click.Group):
    """A click group that loads its commands from :data:`COMMANDS` on demand and turns
    :class:`SymcostError` and usage errors into one line on stderr (exit 2)."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)

    def main(self, args=None, **kwargs):  # noqa: D401 - click hook
        args = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in args
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep the output to symcost's
        try:
            return super().main(expand_multi(args), standalone_mode=False, **kwargs)
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
        except BrokenPipeError:  # `symcost ... --json | head`: quietly, exit 1 as rich's console
            devnull = os.open(os.devnull, os.O_WRONLY)  # does for tables (Console.on_broken_pipe)
            os.dup2(devnull, sys.stdout.fileno())  # (no second error when Python flushes at exit)
            sys.exit(1)
        except Exception as e:  # noqa: BLE001
            if debug:
                traceback.print_exc()
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            click.echo(f"symcost: internal error: {type(e).__name__}: {msg} (rerun with --debug for the traceback)",
                       err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="symcost")
def main():
    """symcost: closed-form FLOPs, bytes and memory of a PyTorch training step."""


if __name__ == "__main__":  # pragma: no cover
    main()

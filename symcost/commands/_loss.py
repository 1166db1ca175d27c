"""``--loss model|megatron``: the loss a traced training step runs (symcost.frontends.megatron)."""
from __future__ import annotations

import click

#: (listed here so --help imports no torch; symcost.frontends.megatron.LOSSES)
LOSS_CHOICES = ("model", "megatron")


def _keep(ctx, param, value):
    if value is not None:
        ctx.meta["symcost.loss"] = value
    return value


def loss_option(f):
    """``--loss``: kept in the click context's ``meta["symcost.loss"]`` (read by ``trace_model``)."""
    return click.option("--loss", type=click.Choice(LOSS_CHOICES), default=None, expose_value=False,
                        callback=_keep,
                        help="the training step's loss: model (the model's own) or megatron (Megatron-LM's "
                             "vocab-parallel cross entropy, fp32 softmax in place) [default: megatron under "
                             "--precision megatron-*, else model]")(f)


def loss_of(ctx) -> str | None:
    """The ``--loss`` a command was given, None where not given (or no such option)."""
    return ctx.meta.get("symcost.loss") if ctx is not None else None

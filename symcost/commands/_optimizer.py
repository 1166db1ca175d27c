"""``--optimizer-impl``, shared by the commands whose memory answer includes the optimizer step
(``max-batch``, ``checkpoint``); it goes with :func:`._options.optimizer_option` (``--optimizer``,
``--torch-device``), which decides what ``default`` means."""
from __future__ import annotations

import click


def optimizer_impl_option(f):
    """``--optimizer-impl`` (parameter ``impl``): how the optimizer step runs, hence its
    temporaries (:func:`symcost.passes.memory.resolve_impl` checks it against ``--torch-device``)."""
    return click.option("--optimizer-impl", "impl", default="default", show_default=True,
                        help="default (what torch.optim picks on --torch-device), foreach, for-loop, fused")(f)

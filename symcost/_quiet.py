"""Import-time noise of optional libraries, filtered (nothing else they log is touched).

With torchao installed (the ``fp8`` and ``test`` extras), transformers imports it whenever it loads
a model, and its import logs, on every run, a warning per prebuilt kernel library this machine
cannot load (``Failed to load .../_C_mxfp8...so``: CUDA kernels on a CPU build of torch) and torch's
pytree logs that its Enum registrations are deprecated. Neither says anything about the user's
request; they went to stderr before every ``report hf:...``. diffusers logs one more when it loads
(its torchao quantizer's classes). :func:`install` adds a
:class:`logging.Filter` to those two loggers that drops exactly those two messages.
"""
from __future__ import annotations

import logging

#: logger name -> the starts of the messages dropped
DROPPED = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    # diffusers' import of torchao's quantized tensor classes (loading torchao-serialized checkpoints,
    # which symcost never does)
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
}


class _Drop(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def install() -> None:
    """Attach the filters (once; importing nothing)."""
    for name, starts in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(starts))

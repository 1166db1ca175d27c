"""What a regime is, as a recording shows it: the ops PyTorch ran, the tensors autograd saved, the
storages the step allocated (docs/tracing.md, "Regimes and probes")."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import Recording


def digest(sig: tuple) -> str:
    """sha256 of a :func:`regime_signature` (hex), as the analysis keeps it."""
    return hashlib.sha256(repr(sig).encode()).hexdigest()


def regime_signature(rec: Recording) -> tuple:
    """What a regime is made of: the aten op sequence, the number of storages autograd saves,
    and the number of storages the step allocates (copies that became views change it); for an
    inference step also the number of KV-cache tensors that hold fewer elements than their
    storage (a sliding window that drops tokens: the cache stops growing with T)."""
    sig = (tuple(op.name for op in rec.ops), len(rec.saved), sum(1 for e in rec.events if e.nbytes > 0))
    if getattr(rec, "step", "train") != "train":
        sig += (rec.kv_evicted,)
    return sig

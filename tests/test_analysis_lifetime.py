"""An Analysis is freed once the caller drops it: no class-level cache keeps it (functools.cache on
its methods did, so a process tracing many models kept every one: a CI worker OOM-killed)."""
from __future__ import annotations

import gc
import weakref

import symcost
from symcost.passes.memory.model import memory_model


def test_dropped_analysis_is_freed_after_its_totals_and_memory_model():
    an = symcost.trace("cs336-lm", sizes={"L": 2}, use_cache=False, torch_device="cpu")
    an.flops("train"), an.flops("forward", kind="hardware"), an.bytes(), an.transcendentals(), an.comm_bytes()
    memory_model(an).peak(B=3)  # (a memory model holds its analysis)
    ref = weakref.ref(an)
    del an
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]

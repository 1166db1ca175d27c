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


def test_dropped_tensor_parallel_trace_frees_its_recorded_ops():
    """A layout's trace leaves no recorded op alive once dropped: the recording mode's tensor
    finalizers held it (a bound method), and tensors a DTensor trace leaves behind kept it with
    every op it recorded (7,365 ``OpCall`` after one megatron-gpt ``--tp`` trace; a test worker
    grew by millions of objects per layout-heavy file)."""
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.tracing.recording import OpCall

    def alive():
        gc.collect()
        return sum(isinstance(o, OpCall) for o in gc.get_objects())

    before = alive()
    an = symcost.trace(resolve("megatron-gpt"), layout=Layout(tp=True), sizes={"TP": 2, "L": 2}, use_cache=False,
                       torch_device="cpu")
    assert an.recordings and alive() > before
    del an
    assert alive() == before

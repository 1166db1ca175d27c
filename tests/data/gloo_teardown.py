"""A clean end for the gloo rank scripts under tests/data (imported from their own folder).

Two ways a rank that has done its work can still die at its end, both seen in CI:

1. gloo's barrier can return on one rank while a peer still waits for that rank's last write; a
   rank that then closes its connections (``destroy_process_group`` or exit) makes the peer fail
   with "Connection closed by peer", and gloo's worker thread aborts the process (SIGABRT):
   pytorch/gloo issue 155, "Barrier followed by context destruction causes some participants to
   fail". Seen once on a 4-rank run. ``finish()`` waits after the gloo barrier until every rank
   has passed it, through the rendezvous store (no gloo connection involved), and only then tears
   the group down.
2. "terminate called without an active exception" and SIGABRT at interpreter exit, after the
   results are written (test_offload's and test_parallel's 2-rank runs, compile_dp_rank.py's;
   more often on a loaded machine). ``destroy_process_group`` drops the group from c10d's maps,
   but the C++ ``ProcessGroupGloo`` lives on while anything holds it: its two worker threads
   ("pt_gloo_runloop") are still running at exit. A worker descheduled between completing a
   collective and releasing it releases it late; if that is after ``Py_FinalizeEx`` began, the
   release calls into Python (the work's tensors drop their Python objects through PyTorch's
   ``ConcretePyInterpreterVTable::decref``, or a Python object it held is deallocated), takes
   the GIL from a thread Python does not own while the interpreter finalizes, and CPython
   (before 3.14) ends such a thread with ``pthread_exit``, whose forced unwind through a C++
   destructor (``noexcept``) is ``std::terminate`` without an exception. Two core dumps of
   dp_rank.py (with its gloo workers at nice 19 on a busy CPU) show it: the aborting thread in
   ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` (this barrier's, holding the earlier
   barrier and DDP's all-reduce) -> ``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` ->
   ``gil_scoped_acquire`` -> ``take_gil`` -> ``PyThread_exit_thread`` -> ``std::terminate``
   (in the other, a thread other than the main one deallocates DDP's ``Reducer``:
   ``~Reducer`` -> ``THPVariable_dealloc`` -> ``PyEval_RestoreThread`` ->
   ``PyThread_exit_thread``), the main thread in ``Py_FinalizeEx`` -> ``PyGC_Collect``.
   pytorch/pytorch issue 190489 (open) describes the same: "a non-main thread calling into
   ConcretePyInterpreterVTable during Py_FinalizeEx, taking the GIL, and unwinding through
   PyThread_exit_thread", from a gloo work and from an autograd worker, its
   ``Py_IsInitialized()`` guard being still true during finalization; PyTorch PR
   179291 (an atexit ``destroy_process_group``) was abandoned by its author as "much more
   complicated than I anticipated"; CPython gh-87135 (3.14 hangs such threads instead): "no
   plausible safe way ... in the face of things like C++ code with finalizers anywhere on a
   thread's stack". No teardown order from Python closes the window (some worker always
   releases the last collective after the main thread has moved on), so ``finish()`` ends the
   process with ``os._exit(0)`` once the group is torn down: no interpreter finalization, no
   exit-time destructors, nothing left for a late worker to race.

A rank that raises before ``finish()`` still exits non-zero with its traceback (torchrun then
stops its peers and the launching test fails): ``finish()`` belongs on the success path only,
not in a ``finally`` (a failed rank would wait in the barrier for peers that never come; PyTorch's
own MultiProcessTestCase and torchtitan's train.py destroy the group only on a clean exit).
"""
import os
import sys

import torch.distributed as dist


def finish(tag="done"):
    """Barrier over gloo, then a store-based barrier, then ``destroy_process_group``, then
    ``os._exit(0)`` after flushing stdout and stderr (the module docstring says why); rank 0
    exits last, once every other rank has said through the store that it is leaving (launched
    with ``init_method="env://"``, as ``mp.spawn`` workers are, rank 0 hosts the store: leaving
    first, it reset a peer's pending ``store.wait``, "Connection reset by peer", in
    tests/test_megatron_run.py). Does not return: call it last, once the rank's results are
    written and closed.

    Every rank must call it with the same ``tag``. Raises what the store raises on a timeout
    (the process group's own timeout), before exiting."""
    from torch.distributed.distributed_c10d import _get_default_store

    dist.barrier()
    store, n, rank = _get_default_store(), dist.get_world_size(), dist.get_rank()
    store.set(f"symcost-teardown/{tag}/{rank}", "1")
    store.wait([f"symcost-teardown/{tag}/{r}" for r in range(n)])
    dist.destroy_process_group()
    if rank == 0:
        store.wait([f"symcost-teardown/{tag}/left/{r}" for r in range(1, n)])
    else:
        store.set(f"symcost-teardown/{tag}/left/{rank}", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""A clean end for the gloo rank scripts under tests/data (imported from their own folder).

gloo's barrier can return on one rank while a peer still waits for that rank's last write; a rank
that then closes its connections (``destroy_process_group`` or exit) makes the peer fail with
"Connection closed by peer", and gloo's worker thread aborts the process (SIGABRT): pytorch/gloo
issue 155, "Barrier followed by context destruction causes some participants to fail". Seen once
in CI on a 4-rank run. ``finish()`` waits after the gloo barrier until every rank has passed it,
through the rendezvous store (no gloo connection involved), and only then tears the group down.
"""
import torch.distributed as dist


def finish(tag="done"):
    """Barrier over gloo, then a store-based barrier, then ``destroy_process_group``.

    Every rank must call it with the same ``tag``. Raises what the store raises on a timeout
    (the process group's own timeout)."""
    from torch.distributed.distributed_c10d import _get_default_store

    dist.barrier()
    store, n = _get_default_store(), dist.get_world_size()
    store.set(f"symcost-teardown/{tag}/{dist.get_rank()}", "1")
    store.wait([f"symcost-teardown/{tag}/{r}" for r in range(n)])
    dist.destroy_process_group()

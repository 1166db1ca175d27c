"""PyTorch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``, the peer
torchtitan's ``scripts/estimate/estimation.py`` runs) on one rank of an FSDP2 training step on
the fake process group, under ``FakeTensorMode``: an independent measurement of the tensors
FSDP2 and ``torch.optim`` allocate on the rank, by category.

The model is built by its spec on the meta device and wrapped exactly as symcost's data-parallel
trace wraps it (``symcost.frontends.parallel.wrap``: ``fully_shard`` per block, then the root;
``fake_group``): the same configuration, nothing of symcost's counting. Used by
tests/test_parallel_peers.py and benchmarks/bench_fsdp_mem_tracker.py.
"""
from __future__ import annotations

import contextlib


#: FSDPMemTracker's categories (``_FSDPRefType`` values), in the order the benchmarks print them
CATEGORIES = ("Sharded Param", "Unsharded Param", "Buffer", "Sharded Grad", "Unsharded Grad", "OptState",
              "Activation", "Temp", "All Gather", "Reduce Scatter", "Inputs")
SHORT = {"Sharded Param": "shP", "Unsharded Param": "unshP", "Buffer": "buf", "Sharded Grad": "shG",
         "Unsharded Grad": "unshG", "OptState": "opt", "Activation": "act", "Temp": "temp",
         "All Gather": "AG", "Reduce Scatter": "RS", "Inputs": "inp"}

def tracker_run(spec, values: dict, precision: str, shard: str = "fsdp", foreach: bool = True,
                torchtitan_loop: bool = False) -> dict:
    """Rank 0 of ``values["DP"]`` ranks (fake process group, fake tensors), wrapped as symcost
    wraps the model: one untracked AdamW training step (FSDP2's lazy init, the optimizer state
    made), then one step under ``FSDPMemTracker``. With ``torchtitan_loop``, torchtitan's
    estimator's loop instead: the tracker entered before the first of two steps,
    ``reset_mod_stats()`` after the first (the tracker's peak is not reset: it covers both).

    Returns:
        ``peak`` (bytes: the tracker's peak ``Total`` over the tracked step, what torchtitan's
        estimator reports), ``at_peak`` {category: bytes at that peak}, ``fwd_bwd`` {category:
        bytes at the peak of forward + backward, read before the optimizer step}, ``after_step``
        {category: bytes right after the optimizer step}, ``steps`` (number of optimizer step
        counters: one 4-byte fp32 tensor per parameter tensor), ``where`` (the phase and the
        deepest FSDP module whose forward or backward peak is the forward + backward peak; None
        with ``torchtitan_loop``, whose ``fwd_bwd`` also covers the first step).

    Note: DTensor's sharding propagation runs each new op (its cache is per process) on fake
    tensors of the *global* shapes, in the active fake mode (torch/distributed/tensor/
    _sharding_prop.py, ``detect_fake_mode() or FakeTensorMode()``), and the tracker counts them:
    a first optimizer step in a fresh process reaches several times the unsharded parameters'
    bytes (docs/parallel.md). The default protocol's untracked step fills that cache.
    """
    import torch
    from memory_oracle import AUTOCAST, DTYPES
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState

    from symcost.frontends.parallel import fake_group, wrap
    from symcost.tracing.record import find_layer_container

    with torch.device("meta"):
        model = spec.build(values)
    layers = spec.layers if spec.layers is not None else find_layer_container(spec, model, values)
    if precision in DTYPES and DTYPES[precision] != torch.float32:
        model.to(DTYPES[precision])  # on the meta device, before the parameters become DTensors
    cast = AUTOCAST.get(precision)

    def autocast():
        return torch.autocast("cpu", dtype=cast) if cast else contextlib.nullcontext()
    wrap(model, layers, shard, fake_group(values["DP"]))

    def plain(snap):
        ((_device, cats),) = snap.items()
        return {str(getattr(k, "value", k)): v for k, v in cats.items()}

    def step(tracker=None):
        with autocast():
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
        loss.backward()
        fwd_bwd = plain(tracker.get_tracker_snapshot("peak")) if tracker else None
        opt.step()
        after = plain(tracker.get_tracker_snapshot("current")) if tracker else None
        opt.zero_grad()
        return fwd_bwd, after

    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        args, kwargs = spec.make_inputs(values, torch.device("cpu"))
        if torchtitan_loop:
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((args, kwargs))
            with tracker:
                step(tracker)
                tracker.reset_mod_stats()  # iteration 0 has no optimizer state (torchtitan)
                fwd_bwd, after = step(tracker)
        else:
            step()  # untracked: FSDP2's lazy init and the optimizer state exist before the tracked step
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((args, kwargs))
            with tracker:
                fwd_bwd, after = step(tracker)
        at_peak = plain(tracker.get_tracker_snapshot("peak"))
        where = []
        for stats in (() if torchtitan_loop else tracker.memory_tracking.values()):
            for state, phase in ((_FSDPModState.PEAK_FW, "forward"), (_FSDPModState.PEAK_BW, "backward")):
                snaps = stats.snapshots.get(state)
                if snaps and any(cats.get("Total") == fwd_bwd["Total"] for cats in snaps[-1].values()):
                    where.append((len(stats.mod_fqn), f"{phase} {stats.mod_fqn or '(root)'}"))
    return {"peak": at_peak["Total"], "at_peak": at_peak, "fwd_bwd": fwd_bwd, "after_step": after,
            "steps": sum(1 for st in opt.state.values() if "step" in st),
            "where": None if torchtitan_loop else max(where)[1] if where else "outside the FSDP modules (the loss)"}

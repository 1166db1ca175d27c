"""Activation checkpointing as PyTorch runs it, where the model is built and laid out
(docs/checkpoint.md): ``torch.utils.checkpoint.checkpoint`` (non-reentrant) with the two CPU
generator states it holds made visible to the recorder (:func:`traced_checkpoint`), a checkpointed
call's keywords without a key/value cache (:func:`without_cache`), and every block of a model
checkpointed in place (:func:`checkpoint_blocks`, torchtitan's ``full`` activation checkpointing).
The planning passes (:mod:`symcost.passes.checkpoint`) and the layout
(:mod:`symcost.frontends.layout`) use them.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def without_cache(kwargs: dict) -> dict:
    """``kwargs`` of a checkpointed call without a key/value cache: ``use_cache`` False, cache
    keywords None (what ``transformers``' ``GradientCheckpointingLayer`` does to a layer it
    checkpoints)."""
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for k in _CACHE_KWARGS:
        if kwargs.get(k) is not None:
            kwargs[k] = None
    return kwargs


_RNG_BYTES: list[int] = []


def rng_state_bytes() -> int:
    """Bytes of the CPU generator's state, ``torch.get_rng_state()`` (5056 for mt19937): what a
    checkpoint with ``preserve_rng_state=True`` (the default) stashes per call
    (torch/utils/checkpoint.py, ``_get_device_module``/``get_rng_state`` in the frame)."""
    if not _RNG_BYTES:
        import torch

        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            _RNG_BYTES.append(torch.get_rng_state().nbytes)
    return _RNG_BYTES[0]


def traced_checkpoint(fn, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` as symcost traces it: the same call, plus the two
    CPU generator states a checkpoint holds that the dispatcher never sees (they are made by
    ``torch.get_rng_state()``, outside any op), as placeholder storages of
    :func:`rng_state_bytes`:

    * the state stashed at the forward (``preserve_rng_state=True``, the default), an extra
      (ignored) input, which the checkpoint's frame keeps as long as its inputs;
    * the state ``torch.random.fork_rng`` saves while the segment is recomputed in the backward
      (torch/utils/checkpoint.py, ``recompute_fn``), made when the recomputation starts and
      dropped when it ends (also when it stops early).
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    hold = torch.empty(rng_state_bytes(), dtype=torch.uint8)
    calls = [0]

    def run(_hold, *a, **k):
        calls[0] += 1
        if calls[0] == 1:  # the forward
            return fn(*a, **k)
        fork = torch.empty(rng_state_bytes(), dtype=torch.uint8)  # noqa: F841 - held while recomputing
        try:
            return fn(*a, **k)
        finally:
            del fork

    return checkpoint(run, hold, *args, **kwargs)


def checkpoint_blocks(model, layers: str) -> None:
    """Checkpoint every block of ``model`` (the children of the ``layers`` container) in place:
    each block's ``forward`` runs under :func:`traced_checkpoint` (non-reentrant), as torchtitan's
    ``full`` activation checkpointing wraps each transformer block (``ptd_checkpoint_wrapper``,
    torchtitan/distributed/activation_checkpoint.py) after tensor parallelism and before FSDP:
    the module's hooks (FSDP2's all-gathers) stay outside the checkpointed region and the
    recomputation in the backward re-runs the block's own ``forward``. The module names stay
    those of the model (no ``_checkpoint_wrapped_module`` level)."""
    import functools

    for block in model.get_submodule(layers).children():
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return traced_checkpoint(_inner, *args, use_reentrant=False, **without_cache(kwargs))

        block.forward = functools.update_wrapper(forward, inner)

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


#: the op-level selective policy's kept ops (torchtitan's ``_save_list``,
#: torchtitan/models/llama3/infra/parallelize.py before the policy moved to named tensors;
#: ``selective_ac_option = "op"``): matmuls (every second one recomputed), the fused attention
#: kernels, the reduce-scatter, max. ``_scaled_dot_product_flash_attention_for_cpu`` is the CPU
#: trace's counterpart of the GPU flash kernel (the dispatcher picks it on this machine).
OP_SAC_SAVE = ("aten.mm.default", "aten._scaled_dot_product_efficient_attention.default",
               "aten._scaled_dot_product_flash_attention.default",
               "aten._scaled_dot_product_flash_attention_for_cpu.default",
               "_c10d_functional.reduce_scatter_tensor.default", "aten.max.default")


def op_sac_context():
    """``context_fn`` of torchtitan's op-level selective checkpointing: a fresh
    ``create_selective_checkpoint_contexts`` with its policy (outputs of :data:`OP_SAC_SAVE` kept,
    except every second ``mm`` of the block's forward, counted apart in the forward and in the
    recomputation; everything else recomputed)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        name = str(func)
        mode = "recompute" if ctx.is_recompute else "forward"
        if name == "aten.mm.default":
            count[mode] += 1
        keep = name in OP_SAC_SAVE and not (name == "aten.mm.default" and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return _without_profiler_ops(create_selective_checkpoint_contexts(policy))


#: the profiler's ``record_function`` ops (torch/autograd/profiler.py ``record_function``), which
#: selective checkpointing must not replay (:func:`_without_profiler_ops`)
_PROFILER_OPS = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")


def _without_profiler_ops(contexts):
    """The two modes of ``create_selective_checkpoint_contexts`` (the forward's caching mode and
    the recomputation's cached one) with the profiler's ``record_function`` ops run as they are,
    outside the replay's per-op invocation counters, as ``SAC_IGNORED_OPS`` runs ``detach``.

    Why: PyTorch 2.13's selective checkpointing replays by invocation index per op
    (``_CachedTorchDispatchMode``: "``{func}`` invocation index ``i`` encountered during backward
    but not found in storage"), and FSDP2's hooks open ``record_function`` regions a different
    number of times in the recomputation than in the forward: a ``fully_shard`` unit nested in a
    checkpointed block (torchtitan's experts module under EP, its own unit over the experts'
    data-parallel group) runs ``_root_pre_forward`` again in the recomputation, whose
    ``record_function("FSDP::root_pre_forward")`` the forward skipped (there the root's forward
    was running: ``iter_forward_root`` set), so the recomputation asks the storage for one more
    ``profiler._record_function_enter_new`` than the forward stored. An annotation, not a value of
    the model: the fixes proposed in PyTorch ignore these ops in selective checkpointing
    (pytorch/pytorch PRs #185178 and #196862: "Profiler record-function enter/exit ops are also
    ignored by SAC", for torchtitan issue #3427, DeepSeek-V3 with FSDP + EP and selective AC, which
    fails as symcost's trace did). The ops the block computes are stored and replayed as before.
    """
    return tuple(_replaying_class(mode) for mode in contexts)


#: a selective-checkpoint mode's class -> its subclass that runs the profiler ops outside the replay
_REPLAYING: dict = {}


def _replaying_class(mode):
    """``mode`` with its class swapped for the subclass that runs :func:`_profiler_overloads`'
    ops directly (the same instance, storage and policy)."""
    base = type(mode)
    cls = _REPLAYING.get(base)
    if cls is None:
        ignored = _profiler_overloads()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in ignored:
                return func(*args, **(kwargs or {}))
            return base.__torch_dispatch__(self, func, types, args, kwargs)

        cls = _REPLAYING[base] = type(base.__name__, (base,), {"__torch_dispatch__": __torch_dispatch__,
                                                                 "__module__": __name__})
    mode.__class__ = cls
    return mode


def _profiler_overloads() -> frozenset:
    """Every overload of the :data:`_PROFILER_OPS` this torch build registers."""
    import torch

    ops = set()
    for name in _PROFILER_OPS:
        packet = getattr(torch.ops.profiler, name, None)
        if packet is None:
            continue
        ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


#: activation checkpointing of a layout (``--ac``): mode -> what is checkpointed
AC_MODES = {
    "full": "every block under a non-reentrant checkpoint (torchtitan's mode 'full'): each block keeps its input, "
            "its forward runs again in the backward",
    "selective": "every block under torchtitan's op-level selective policy (mode 'selective', selective_ac_option "
                 "'op'): matmul outputs kept except every second one, fused attention, reduce-scatter and max "
                 "outputs kept, the rest recomputed",
}


#: depth of activation checkpointing's recomputations running now (:func:`checkpoint_blocks`)
_RECOMPUTING = [0]


#: the blocks whose recomputation runs now, innermost last (:func:`checkpoint_blocks`)
_RECOMPUTING_BLOCKS: list = []


def recomputing_block():
    """The block (``nn.Module``) whose forward :func:`checkpoint_blocks` runs again now, or None:
    the recomputation calls the block's own ``forward``, not the module, so no module hook names
    the ops it runs outside its submodules (the residual adds); the recorder names them by it."""
    return _RECOMPUTING_BLOCKS[-1] if _RECOMPUTING_BLOCKS else None


def recomputing() -> bool:
    """True while a block checkpointed by :func:`checkpoint_blocks` runs its forward again in the
    backward: the recorder marks those ops' FLOPs as hardware FLOPs only (shared/conventions.md:
    model FLOPs do not count recomputation; HFU does)."""
    return _RECOMPUTING[0] > 0


def checkpoint_blocks(model, layers, mode: str = "full") -> None:
    """Checkpoint every block of ``model`` (the children of the ``layers`` container, or of each
    container of a list of them: every stack of an encoder-decoder's blocks, as ``transformers``'
    ``gradient_checkpointing_enable()`` checkpoints each layer of both stacks) in place,
    as torchtitan's ``apply_ac`` wraps each transformer block (``ptd_checkpoint_wrapper``,
    torchtitan/distributed/activation_checkpoint.py) after tensor parallelism and before FSDP:
    each block's ``forward`` runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
    preserve_rng_state=False)`` (torchtitan's defaults), with :func:`op_sac_context` for
    ``mode="selective"``. The module's hooks (FSDP2's all-gathers) stay outside the checkpointed
    region and the recomputation re-runs the block's own ``forward``; the module names stay those
    of the model (no ``_checkpoint_wrapped_module`` level).

    Raises:
        SymcostError: an unknown ``mode`` (:data:`AC_MODES`).
    """
    from symcost.errors import SymcostError

    if mode not in AC_MODES:
        raise SymcostError(f"unknown --ac {mode!r}; accepted: none, {', '.join(AC_MODES)}")
    blocks = [b for c in ([layers] if isinstance(layers, str) else layers) for b in model.get_submodule(c).children()]
    checkpoint_modules(blocks, mode)


def checkpoint_modules(blocks, mode: str = "full") -> None:
    """Checkpoint each module of ``blocks`` on its own in place, as :func:`checkpoint_blocks` does
    for every block of its containers (a checkpoint plan's chosen blocks of several stacks:
    :class:`symcost.passes.checkpoint.stacks.StackPlan`)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    extra = {"context_fn": op_sac_context} if mode == "selective" else {}
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, _block=block, **kwargs):
            calls = [0]

            def run(*a, **k):  # the first call is the forward, a later one the recomputation
                calls[0] += 1
                if calls[0] == 1:
                    return _inner(*a, **k)
                _RECOMPUTING[0] += 1
                _RECOMPUTING_BLOCKS.append(_block)
                try:
                    return _inner(*a, **k)
                finally:
                    _RECOMPUTING_BLOCKS.pop()
                    _RECOMPUTING[0] -= 1

            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **extra,
                              **without_cache(kwargs))

        block.forward = functools.update_wrapper(forward, inner)

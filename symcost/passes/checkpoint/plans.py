"""A checkpoint :class:`Plan`: which blocks are checkpointed in which segments, applied to a
model with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from symcost.errors import SymcostError
from symcost.frontends.checkpointing import traced_checkpoint
from symcost.frontends.checkpointing import without_cache as _without_cache


KINDS = ("none", "every-layer", "sqrt", "optimal")

@dataclass
class Plan:
    """Which blocks of ``container`` are checkpointed, in which segments ``[start, end)``.

    ``kind``: how it was chosen (``none``, ``every-layer``, ``sqrt``, ``optimal``,
    ``budget``, ``memory``, ``sequential``). ``interval`` is the segment length when all
    segments have one (else None).
    """

    container: str
    L: int
    segments: list[tuple[int, int]]
    kind: str = "optimal"

    @property
    def interval(self) -> int | None:
        lens = [e - s for s, e in self.segments]
        if not lens:
            return None
        return lens[0] if len(set(lens[:-1])) <= 1 and lens[-1] <= lens[0] else None

    def modules(self) -> list[str]:
        """The checkpointed segments as module paths (``layers.0-layers.2``)."""
        pre = f"{self.container}." if self.container else ""
        return [f"{pre}{s}" if e - s == 1 else f"{pre}{s}..{pre}{e - 1}" for s, e in self.segments]

    def apply(self, model, _traced: bool = False):
        """Checkpoint the plan's segments of ``model`` in place and return it.

        Each segment's first block runs the whole segment inside
        ``torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)``
        (non-reentrant: correct also when the block input needs no grad, and kwargs pass
        through); the segment's other blocks return the segment's output when the parent model
        calls them. Parameter names, hooks and the module tree stay as they are, and the new
        forwards hold the blocks by weak reference: the applied model makes no reference cycle
        (dropped, it is freed at once, as the original, not whenever Python's cyclic garbage
        collector runs).

        As Hugging Face's gradient checkpointing does (``transformers``' ``GradientCheckpointingLayer``
        and ``merge_with_config_defaults``), a segment is checkpointed only when its first block
        is in training mode and gradients are enabled (otherwise it runs as is, for generation),
        and then runs without a key/value cache: a ``use_cache`` keyword becomes False and a
        cache keyword (``cache``, ``past_key_values``, ``past_key_value``, ``layer_past``) None,
        since the recomputation would write the cache a second time (a doubled sequence length:
        wrong attention, or a shape error with eager attention). A model whose config keeps
        ``use_cache=True`` (a ``transformers`` model as loaded) and whose ``forward`` takes
        ``use_cache`` gets a forward pre-hook that passes ``use_cache=False`` in training with
        gradients enabled, so it builds and returns no cache, as Hugging Face's model does.

        Raises:
            SymcostError: the model's block container does not hold ``L`` blocks.
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        blocks = list((model.get_submodule(self.container) if self.container else model).children())
        if len(blocks) != self.L:
            raise SymcostError(f"the plan is for {self.L} blocks in {self.container!r}, "
                               f"the model has {len(blocks)}")
        for s, e in self.segments:
            # the blocks by weak reference only: a block's forward that held its block (or the
            # segment's blocks) would make every block a reference cycle, kept with its parameters
            # and gradients after the model is dropped until the cyclic garbage collector runs
            seg = [weakref.ref(b) for b in blocks[s:e]]
            state = {"inside": False, "out": None}
            origs = [b.__dict__.get("forward") for b in blocks[s:e]]  # an instance's own forward, if any

            def run(*args, _seg=seg, _state=state, **kwargs):
                _state["inside"] = True
                try:
                    out = None
                    for ref in _seg:
                        out = ref()(*args, **kwargs)
                        args = (out if not isinstance(out, (tuple, list)) else out[0],) + tuple(args[1:])
                    return out
                finally:
                    _state["inside"] = False

            def make(i, _own, _me, _state=state, _n=len(seg), _run=run, _first=seg[0]):
                def forward(*args, **kwargs):
                    if _state["inside"]:
                        if _own is not None:
                            return _own(*args, **kwargs)
                        me = _me()
                        return type(me).forward(me, *args, **kwargs)
                    if i == 0:
                        if not (_first().training and torch.is_grad_enabled()):
                            out = _run(*args, **kwargs)  # nothing to replay: as is, cache included
                        else:
                            out = (traced_checkpoint if _traced else checkpoint)(
                                _run, *args, use_reentrant=False, **_without_cache(kwargs))
                        if _n > 1:
                            _state["out"] = out
                        return out
                    out = _state["out"]
                    if i == _n - 1:
                        _state["out"] = None
                    return out
                return forward

            for i, b in enumerate(blocks[s:e]):
                b.forward = make(i, origs[i], seg[i])
        if self.segments:
            _no_cache_in_training(model)
        return model


#: keywords by which ``transformers`` layers take a key/value cache (names differ by version/model)
def _no_cache_in_training(model) -> None:
    """A forward pre-hook on ``model`` passing ``use_cache=False`` in training with gradients
    enabled, where its config asks for a cache and its ``forward`` takes ``use_cache`` (what a
    ``transformers`` model does under gradient checkpointing). Installed once per model."""
    import inspect

    import torch

    cfg = getattr(model, "config", None)
    if not getattr(cfg, "use_cache", False) or getattr(model, "_symcost_no_cache_hook", False):
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if "use_cache" not in params:
        return

    def hook(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
            kwargs = dict(kwargs, use_cache=False)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._symcost_no_cache_hook = True

"""How a tensor-parallel step is recorded: DTensor's shape propagation hidden from the recorder, and
the ops PyTorch runs in a number that depends on the group size (chunk + cat around a collective,
``torch.chunk``'s TP views) run as ops whose number does not (docs/parallel.md §11;
:func:`hide_shape_propagation`, :func:`hidden`, used by :mod:`symcost.tracing.record`).

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import warnings


class _Hidden:
    depth = 0


def _view_chunk_cat(res, group_size: int, gather_dim: int):
    """``torch._utils._maybe_view_chunk_cat`` (an all-gather's result, gathered on dim 0, moved
    to ``gather_dim``) by its reference formula: unflatten, movedim, flatten. The same data
    movement (a copy of the gathered tensor, a view where the dims crossed have size 1), in
    ops whose number does not depend on the group size (chunk + cat take ``group_size``
    tensors: a trace at TP = 2 and one at TP = 4 would run different ops)."""
    if gather_dim == 0:
        return res
    data, wrap = _float8_data(res)
    return wrap(data.unflatten(0, (group_size, -1)).movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1))


def _chunk_cat(tensor, num_chunks: int, narrow_dim: int, cat_dim: int = 0):
    """``torch._utils._chunk_or_narrow_cat`` (a reduce-scatter's input on ``narrow_dim`` laid
    out on dim 0) by unflatten, movedim, flatten: the same copy, in ops independent of
    ``num_chunks`` (see :func:`_view_chunk_cat`)."""
    data, wrap = _float8_data(tensor)
    return wrap(data.unflatten(narrow_dim, (num_chunks, -1)).movedim(narrow_dim, cat_dim)
                .flatten(cat_dim, cat_dim + 1))


def _float8_data(t):
    """``(data, wrap)``: FP8 training's float8 tensor (torchao's ``Float8TrainingTensor``, which
    runs chunk and cat but no movedim: torchao's float8 TP styles all-gather and reduce-scatter
    it) as its fp8 data and the function that wraps data moved the same way with its scale
    (torchao's own ``cat`` keeps the scale so); any other tensor as itself."""
    if type(t).__name__ != "Float8TrainingTensor":
        return t, lambda d: d
    cls = type(t)
    return t._data, lambda d: cls(d, t._scale, t._orig_dtype, t._linear_mm_config, t._gemm_input_role,
                                  t._axiswise_dim)


class _Lazy:
    """A read-only sequence of ``n`` items made on access (``make(i)``)."""

    def __init__(self, n: int, make):
        self.n, self.make = n, make

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.make(i)

    def __iter__(self):
        return (self[i] for i in range(self.n))


def _lazy_chunk(orig):
    """``Shard._custom_chunk`` that, for an even split, makes only the chunks asked for (a
    ``narrow`` view each) instead of ``torch.chunk``'s TP views of which one is used."""
    def chunk(tensor, num_chunks, dim):
        n = int(num_chunks)
        size = tensor.size(dim)
        if size % n:
            return orig(tensor, num_chunks, dim=dim)
        c = size // n
        return _Lazy(n, lambda i: tensor.narrow(dim, i * c, c))
    return chunk


def _lazy_split(orig):
    """``Shard._split_tensor_helper`` that, for an even split, returns the shards lazily (see
    :func:`_lazy_chunk`): the rank's own shard is the only one a redistribution uses."""
    def split(tensor, num_chunks, with_padding, contiguous, dim):
        n = int(num_chunks)
        if tensor.size(dim) % n:
            return orig(tensor, num_chunks, with_padding, contiguous, dim)
        c = tensor.size(dim) // n

        def make(i):
            t = tensor.narrow(dim, i * c, c)
            return t.contiguous() if contiguous else t
        return _Lazy(n, make), ([0] * n if with_padding else [])
    return split


@contextlib.contextmanager
def hide_shape_propagation():
    """The context a tensor-parallel step is recorded in.

    * DTensor's shape propagation (which runs each op once more on global-shape fake tensors,
      cached per op signature) raises :attr:`_Hidden.depth`; a recorder skips ops while it is
      positive, so it records only the local ops each rank runs;
    * the functional collectives' chunk + cat around an all-gather or reduce-scatter on a
      dimension other than 0 run as unflatten + movedim + flatten (:func:`_view_chunk_cat`,
      :func:`_chunk_cat`): the same bytes, in ops whose number does not depend on TP;
    * DTensor's even split of a tensor into TP shards (``Shard._custom_chunk``,
      ``Shard._split_tensor_helper``: ``torch.chunk``'s TP views, of which a redistribution keeps
      the rank's) makes only the shards used (:func:`_lazy_chunk`);
    * DTensor's warning that its random operators "may not have complete support on cpu device
      mesh" (a dropout on a DTensor: BART's under sequence parallelism) is not shown: the mesh is
      the recording's fake one on the CPU, not the target's, and the rank's dropout is recorded
      on its local shard either way.
    """
    from torch.distributed.tensor.placement_types import Shard
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached
    saved = funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat

    def hidden(self, op_schema):
        _Hidden.depth += 1
        try:
            return orig(self, op_schema)
        finally:
            _Hidden.depth -= 1

    shard_saved = Shard.__dict__["_custom_chunk"], Shard.__dict__["_split_tensor_helper"]
    ShardingPropagator._propagate_tensor_meta_non_cached = hidden
    funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat = _view_chunk_cat, _chunk_cat
    Shard._custom_chunk = staticmethod(_lazy_chunk(shard_saved[0].__func__))
    Shard._split_tensor_helper = staticmethod(_lazy_split(shard_saved[1].__func__))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"DTensor random operators may not have complete support",
                                    category=UserWarning)
            yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig
        funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat = saved
        Shard._custom_chunk, Shard._split_tensor_helper = shard_saved


def hidden() -> bool:
    """True inside DTensor's shape propagation (:func:`hide_shape_propagation`)."""
    return _Hidden.depth > 0

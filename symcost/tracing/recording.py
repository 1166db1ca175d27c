"""What a recording of one step is: the ops it ran (:class:`OpCall`, with :class:`TensorInfo` and
the references of their arguments), the storages autograd saved (:class:`SavedTensor`), the
storages allocated and freed (:class:`MemoryEvent`), and the :class:`Recording` that holds them
(made by :func:`symcost.tracing.record.record`, read by the fit and the memory schedule)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for the i-th tensor input of an op inside its recorded argument tree."""

    index: int


@dataclass(frozen=True)
class IntRef:
    """Placeholder for the i-th integer argument of an op (sizes fitted like tensor dims)."""

    index: int


@dataclass
class TensorInfo:
    """One tensor an op reads or writes: concrete shape, dtype, producer (op index or source)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tid: int  # recording-wide tensor id
    source: str | None = None  # "param:<name>", "buffer:<name>", "input:<i>" for leaf tensors
    storage: int | None = None  # its storage's key (inference steps only: to find the KV cache's reads)


@dataclass
class OpCall:
    """One aten op call of the training step, as recorded."""

    op: Any  # torch._ops.OpOverload
    name: str  # e.g. "aten.mm.default"
    module: str  # dotted module path ("" for the root)
    phase: str  # "forward" | "backward"
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    ints: list[int]  # integer scalar arguments, in order (bools excluded)
    args_tree: Any  # (args, kwargs) with TensorRef / IntRef placeholders
    # an inference step: the positions of the inputs that are (views of) the KV cache's storages,
    # those it holds before or after the step (set by _inference_step)
    kv_reads: tuple[int, ...] = ()
    kv_writes: tuple[int, ...] = ()  # positions of the outputs that allocate a storage the cache then holds
    # where the op ran when that differs from ``module`` (FSDP2's work for another unit, e.g. the
    # backward prefetch of the previous block's parameters inside this block's backward): the
    # memory schedule cuts the step into blocks by where storages are allocated and freed
    host: str | None = None
    # a collective on a 2-D mesh (--dp with --tp): the mesh symbol of its process group ("DP" or
    # "TP"); None on a 1-D mesh, whose one group is the recording's (symcost.graph.totals.trace_group)
    group: str | None = None
    # an op of activation checkpointing's recomputation in the backward (--ac, symcost.frontends.
    # checkpointing.recomputing): its matmul FLOPs are hardware FLOPs, not model FLOPs
    recompute: bool = False


@dataclass
class SavedTensor:
    """A storage autograd saved for backward (parameters and buffers excluded)."""

    nbytes: int
    dtype: torch.dtype
    module: str  # the module that saved it first
    shape: tuple[int, ...]
    also: set[str] = field(default_factory=set)  # other modules that saved the same storage
    # the module whose op made the storage (None: an input's, or made outside the recorded ops): a
    # block's output saved by the next block is one storage per pair of neighbouring blocks
    made_in: str | None = None


@dataclass
class MemoryEvent:
    """A storage allocated (``nbytes`` > 0) or freed (< 0) just before op ``index`` ran.

    An allocation is stamped with the op that created the storage; a free with the number of
    ops recorded when the last tensor viewing the storage died (so it belongs before that op).
    """

    index: int
    nbytes: int
    storage: int
    # data-parallel recordings: the module running when it happened (a free in an FSDP2 hook
    # after a block's last op, e.g. the last unit's all-gather buffer released by the root,
    # belongs where it happens, not to that op)
    host: str | None = None
    # an inference step: a storage of the KV cache (a DynamicCache's concatenation allocating the
    # tensor the cache then holds, or the free of the tensor it replaced; _inference_step)
    kv: bool = False


@dataclass
class Recording:
    """Everything recorded of one training step at one set of concrete sizes."""

    values: dict[str, int]
    ops: list[OpCall]
    params: dict[str, tuple[tuple[int, ...], torch.dtype]]  # unique parameters by name
    param_module: dict[str, str]
    saved: list[SavedTensor] = field(default_factory=list)
    layer_container: str | None = None
    events: list[MemoryEvent] = field(default_factory=list)  # storages of non-leaf tensors
    n_forward: int = 0  # ops[:n_forward] are the forward (with the loss)
    n_backward: int = 0  # then the backward; the rest is the optimizer step
    precision: str = "fp32"
    tied: dict[str, list[str]] = field(default_factory=dict)  # parameter -> its tied aliases
    # unique buffers by storage (first name), and the bytes of the step's input tensors (unique
    # storages), both allocated before the step runs, so not in ``events``
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    input_nbytes: int = 0
    # len(events) when the step ended: later events are frees at teardown (grads, ...), not the step
    events_end: int = -1
    # an inference step (``ModelSpec.step`` "prefill" or "decode"): the bytes of the storages the
    # KV cache holds after the step, per cache layer (each storage once, in the first layer that
    # holds it), and how many of its tensors hold fewer elements than their storage (a sliding
    # window that dropped tokens: part of the regime). The cache's storages are in ``events`` only
    # where the step allocates or frees them (``MemoryEvent.kv``: a DynamicCache's concatenation).
    step: str = "train"
    kv_layers: list[int] = field(default_factory=list)
    kv_evicted: int = 0
    # data-parallel recordings (spec.extra["parallel"]): the strategy, and each parameter's shard
    # on this rank (local shape; ``params`` keeps the global shape)
    parallel: str | None = None  # or "tp" / "tp+sp": tensor (and sequence) parallelism, group TP
    param_shards: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # the 2-D mesh (DP, TP) of a data-parallel strategy over tensor parallelism: "tp" or "tp+sp"
    # (``parallel`` names the strategy); each collective's group is its ``OpCall.group``
    tensor_parallel: str | None = None
    # HSDP (Layout.replicate): the dp_replicate degree; the "DP" group is then dp_shard (DP/R ranks)
    replicate: int | None = None
    # an inference step, per cache layer: the bytes of the storages the step replaced (freed, each
    # paired with the allocation of its replacement in ``events``) minus those of the storages it
    # allocated for the cache (the cache's bytes before the step minus after, over the storages
    # the step changed: 0 for a StaticCache, minus one token per tensor for a DynamicCache)
    kv_start: list[int] = field(default_factory=list)
    # why no block list folds over L (several stacks follow L, or none does): the step is recorded
    # as it is, and the tracer pins L at the request (graph.build)
    no_fold: str | None = None
    # an inference step, per cache layer: the bytes of each of its storages, in the order the layer
    # holds them (``kv_layers`` are their sums; a hybrid layer holds keys, values and recurrent states)
    kv_parts: list[tuple[int, ...]] = field(default_factory=list)
    # parameters (names as in ``params``) with ``requires_grad=False``: frozen (Whisper's encoder
    # position table, a frozen backbone); they get no gradient, no optimizer state and no reduction
    frozen: frozenset = field(default_factory=frozenset)

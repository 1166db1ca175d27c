"""The op graph's elements: :class:`SymOp`, one op of the folded training step with symbolic shapes
and costs, and the phases of a step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from symcost.graph import rules

PHASES = ("forward", "backward")
#: kinds of collectives a data-parallel step runs (symcost.graph.rules.COMM_OPS)
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
#: point-to-point transfers between pipeline stages (bytes this rank sends / receives)
P2P_KINDS = ("send", "recv")


@dataclass
class SymOp:
    """One op of the folded graph with symbolic shapes and costs."""

    index: int
    name: str
    family: str
    module: str
    phase: str
    repeat: Any  # 1, or the symbol L for ops of the repeated block
    in_shapes: list[tuple]
    in_dtypes: list[torch.dtype]
    out_shapes: list[tuple]
    out_dtypes: list[torch.dtype]
    cost: rules.Cost
    layer: int | None = None
    attention: bool = False  # a matmul-class op with no parameter operand
    #: a collective (family ``comm``): ``(kind, size, per_rank, group)``, see
    #: :func:`symcost.graph.rules.comm_volume` (bytes), ``group`` the mesh symbol of its process
    #: group (``"DP"``, ``"TP"``; absent from analyses cached before the 2-D mesh: the trace's one)
    comm: tuple | None = None
    # an inference step: positions of the inputs that are the KV cache's storages (the recording's
    # ``OpCall.kv_reads``: the cache held before or after the step, read through any view)
    kv_reads: tuple[int, ...] = ()
    kv_writes: tuple[int, ...] = ()  # outputs that allocate a storage the cache holds after the step
    #: a fused attention kernel (SDPA's, the raw flash/efficient ones): ``(is_causal, masked)`` as
    #: called (masked: an ``attn_mask``/bias tensor given), what the CUDA dispatcher chooses by
    #: (symcost.hardware.attention); None for other ops and in analyses saved before it was kept
    attn_flags: tuple[bool, bool] | None = None

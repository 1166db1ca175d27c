"""Checkpoint segments as integer algorithms: uniform and ``checkpoint_sequential`` splits, the
segment model's cost and its exact optimum (Chen et al. 2016, Sec. 4.1; Griewank & Walther's
revolve ordering). Pure Python on per-block byte and FLOP counts."""

from __future__ import annotations

from typing import Sequence

from symcost.passes.checkpoint_dp import Costs


def uniform_segments(L: int, k: int) -> list[tuple[int, int]]:
    """Checkpointed segments ``[start, end)`` of k blocks each, the last one shorter."""
    return [(s, min(s + k, L)) for s in range(0, L, k)]


def sequential_default(L: int, segments: int) -> list[tuple[int, int]]:
    """The split of ``torch.utils.checkpoint.checkpoint_sequential(functions, segments, input)``
    (torch/utils/checkpoint.py): ``segment_size = len(functions) // segments``, every segment of
    that size but the last, which takes the rest and is *not* checkpointed (it runs plainly).

    Returned as the checkpointed segments only (the last, plain one left out).
    """
    size = max(1, L // segments)
    out, end = [], -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        out.append((start, end + 1))
    return out


def plan_cost(segments: Sequence[tuple[int, int]], a: Sequence[int], x: Sequence[int],
              f: Sequence[int], head: int = 0, fr: Sequence[int] | None = None) -> tuple[int, int]:
    """(activation peak in bytes, recompute FLOPs) of checkpointing ``segments`` of a block chain
    in the segment model (:meth:`symcost.passes.checkpoint_dp.Costs.segment_model`).

    The model (Chen et al. 2016, Sec. 4; the order of the backward as in Griewank & Walther's
    revolve): blocks outside a segment keep their activations ``a_i``; a checkpointed segment
    keeps only its input ``x_start`` during the forward; in the backward, segment s is
    recomputed while everything kept before it is live: peak = max(kept at the end of the
    forward + ``head``, max over segments of kept-before-s + x_s + Σ a over s). ``head`` is
    what the step holds at the end of the forward besides the blocks' activations.
    Recompute = Σ f over checkpointed blocks (each recomputed once), except that the last block
    of a segment costs ``fr`` (default ``f``): a non-reentrant checkpoint stops recomputing as
    soon as every tensor the backward needs is back (``torch.utils.checkpoint``'s early stop,
    on by default), so the ops after the segment's last saved tensor never rerun.
    """
    from symcost.passes.checkpoint_dp import Costs

    return Costs.segment_model(a, x, f, head, fr).cost(segments)


def optimal_segments(a: Sequence[int], x: Sequence[int], f: Sequence[int],
                     budget: int | None = None, head: int = 0,
                     fr: Sequence[int] | None = None) -> tuple[list[tuple[int, int]], int, int]:
    """The exact optimum of the segment model (:func:`plan_cost`) over every segmentation:
    without ``budget`` the least activation peak (ties: least recompute), with ``budget``
    (bytes) the least recompute within it (ties: least peak); the search is
    :meth:`symcost.passes.checkpoint_dp.Costs.optimal`. Returns ``(segments, peak, recompute)``.

    Raises:
        SymcostError: no segmentation fits ``budget``.
    """
    from symcost.passes.checkpoint_dp import Costs

    return Costs.segment_model(a, x, f, head, fr).optimal(budget)

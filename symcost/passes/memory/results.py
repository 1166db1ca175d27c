"""What the memory pass answers: a solution for the largest size under a cap, the gradient
accumulation plan, and the answer that nothing fits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from symcost.errors import SymcostError

class NothingFits(SymcostError):
    """Not even a batch (micro-batch) of 1 fits under the cap: an answer, not bad input (the CLI
    exits with status 3)."""


@dataclass
class Solution:
    """The largest ``var`` (B, S or a size of the model: the image side) whose peak fits under ``cap``
    at the other sizes.

    ``value`` is 0 when even ``var = 1`` does not fit (``dominant`` then names the component
    that dominates at 1). ``memory_at`` / ``memory_next`` are M(value) and M(value + 1) in bytes,
    ``bound`` the real root sympy found (the inequality's supremum), ``limited_by`` a reason
    other than memory that capped the value (the model's own limits, e.g. S <= n_positions).
    """

    var: str
    value: int
    cap: int
    memory_at: int | None
    memory_next: int | None
    sizes: dict[str, int]
    bound: Any = None
    inequality: str = ""
    dominant: tuple[str, int] | None = None
    limited_by: str | None = None
    seconds: float = 0.0
    checked: bool = False
    adjusted: int = 0
    # the next admissible value after ``value`` (``memory_next`` is M there): value + 1, or
    # value + modulus where the formulas hold in a residue class of ``var`` (an image side mod 32);
    # the least admissible value when ``value`` is 0
    next_value: int | None = None
    modulus: int = 1


@dataclass
class AccumulationPlan:
    """Gradient accumulation: B_global = micro_batch x accumulation_steps x devices.

    Memory is the peak per device; FLOPs are model FLOPs (forward + backward) per device per
    optimizer step. ``exact`` is False when no divisor of the per-device batch is as large as the
    largest micro-batch that fits (``note`` says what was done).
    """

    global_batch: int
    devices: int
    per_device_batch: int
    micro_batch: int
    accumulation_steps: int
    max_micro_batch: int
    exact: bool
    memory: int
    memory_without: int
    flops_per_device: int
    flops_total: int
    cap: int
    note: str = ""

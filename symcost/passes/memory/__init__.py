"""Memory of one training step: static memory by precision policy, activations, peak, max batch.

Everything here is derived from a traced :class:`~symcost.graph.analysis.Analysis`; nothing is typed in
per architecture. The accounting (see docs/memory.md and ../shared/conventions.md):

* **Static memory** (bytes, live for the whole step): parameters, optimizer state and master
  weights, each ``bytes per element x elements`` of the precision policy (:data:`POLICIES`) and
  the optimizer (:data:`OPTIMIZERS`), over the parameters of the trace (tied ones once), plus the
  model's buffers and the step's input tensors. Gradients follow the same policy; they are static
  in the sense of the JSON contract (``memory.grads``) but in the peak they are allocated where
  the backward really allocates them (``optimizer.zero_grad(set_to_none=True)`` between steps).
* **Activations**: what autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
  parameters and buffers excluded, deduplicated by storage: ``Analysis.saved`` fitted and folded.
* **Peak** of a *steady-state* step (optimizer state already allocated, gradients set to None by
  the previous ``zero_grad``): static memory plus the largest live set over the traced schedule:
  every storage the forward and the backward allocate and free, in the order they did (the
  recording's memory events), folded to any L (block 0, then L-1 blocks like block 1 in forward;
  L-1 blocks like block 1, then block 0 in backward), then the optimizer step's transient buffers.
  The candidates for the maximum are polynomials; those dominated for all sizes are dropped, so
  the peak is one polynomial where the maximiser does not depend on the sizes, else ``Max(...)``
  of the few that can win (``Piecewise`` on L = 1 when a candidate needs two blocks).

The schedule is fitted once, at trace time (:func:`fit_schedule` -> ``Analysis.schedule``, a
:class:`MemorySchedule` of plain data), so the pass needs the analysis only, not the probe
recordings (a cached analysis has none). Polynomials are elements of sympy's sparse polynomial
rings (``sympy.polys.rings``, exact ``ZZ``/``QQ`` coefficients).

The package: :mod:`.policies` (bytes per element by precision policy and optimizer),
:mod:`.live` (live sets, dominance), :mod:`.model` (:class:`MemoryModel`: static memory,
activations, peak), :mod:`.solve` (largest batch or sequence under a cap, accumulation plans),
:mod:`.results` (what the solver returns), :mod:`.advice` (what would fit when nothing does). The schedule itself is fitted by the tracer
(:mod:`symcost.tracing.schedule`); the report's text is :mod:`symcost.render.memory`.

Public entry points: :func:`memory_model` (-> :class:`MemoryModel` with ``peak``, ``solve``,
``plan_accumulation``), :func:`default_impl`, :data:`POLICIES`, :data:`OPTIMIZERS`.
"""
from __future__ import annotations

from symcost.units import GiB, binary, dominant_text, gib, parse_memory  # noqa: F401  (re-exported)
from symcost.tracing.poly import Algebra, NotIntegral, Terms, terms_expr  # noqa: F401
from symcost.tracing.schedule import MemorySchedule, ScheduleEvent, ScheduleUnit, fit_schedule  # noqa: F401
from symcost.passes.memory.policies import (  # noqa: F401
    DEVICES, ENGINE_FUSED_ADAM, FOREACH_DEVICES, IMPLS, OPTIMIZERS, POLICIES, STEP_BYTES, Optimizer, Policy,
    check_layout, default_impl, engine_impl, optimizer, policy, resolve_impl)
from symcost.passes.memory.live import Candidate  # noqa: F401
from symcost.passes.memory.results import AccumulationPlan, NothingFits, Solution  # noqa: F401
from symcost.passes.memory.model import MemoryModel, memory_model  # noqa: F401
from symcost.passes.memory.advice import alternatives, alternatives_text  # noqa: F401

"""Activation checkpointing: the √L law from the traced graph, the exact optimum, apply, predict.

The pass takes an :class:`~symcost.graph.analysis.Analysis` and returns plain data. Its pieces:

* :func:`block_costs` — per block of the L repeated blocks, from the trace: ``a`` the bytes
  autograd saves inside the block (``memory_model(an).activations_per_layer``; the special end
  block's own share where the trace has one), ``x`` the bytes of the block's input that a
  checkpoint keeps (the output of the previous block: the last forward op's output in the graph)
  and ``f`` the block's forward model FLOPs (recomputed once per checkpointed block).
* :func:`law` — the symbolic trade-off for a checkpoint every k blocks (Chen et al. 2016,
  "Training Deep Nets with Sublinear Memory Cost", Sec. 4.1): activation memory
  ``M(k) = (L/k)·x + k·a`` (the kept segment inputs plus one segment's activations while it is
  recomputed), stationary point ``k* = sqrt(L·x/a)`` (``L/k* = sqrt(L·a/x)`` segments) and
  ``M(k*) = 2·sqrt(L·a·x)``, found with sympy; the same law one level down over the chain of the
  block's ops (interval in ops); the trade-off table over k.
* :func:`optimal_segments` — exact dynamic programming over the (possibly non-uniform) block
  sequence, Chen et al.'s segment DP with Griewank & Walther's ordering insight (revolve: later
  segments are shorter because more checkpoints are live when they are recomputed): (a) the
  least activation peak, (b) the least recompute FLOPs under an activation budget.
* :class:`Plan` — which blocks are checkpointed in which segments; :meth:`Plan.apply` wraps
  them in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` in place (parameter
  names unchanged).
* :func:`exact` — the applied plan traced by symcost itself (the recording sees the recomputed
  forward and what is really kept), so the memory pass gives the step's peak exactly and the
  FLOPs include the recomputation exactly as ``FlopCounterMode`` counts them.
* :func:`analyse` — all of it for ``symcost checkpoint`` (JSON contract ``checkpoint.*``).

Modules: ``segments`` (integer segment algorithms), ``costs`` (block costs, the law), ``plans``
(:class:`Plan`), ``traces`` (checkpointed steps traced), ``schedule`` (the step's peak under a
plan, :class:`Chain`, :func:`make_plan`, :func:`exact`), ``analyse`` (the pass), ``memory``
(max-batch with checkpointing), ``stacks`` (a model of several stacks of blocks: the plan per
stack, :func:`~symcost.passes.checkpoint.stacks.analyse_stacks`). Every name above is importable
from this package.
"""

from __future__ import annotations

from symcost.frontends.checkpointing import rng_state_bytes, traced_checkpoint  # noqa: F401  (re-exported)
from symcost.passes.checkpoint.segments import optimal_segments, plan_cost, sequential_default, uniform_segments  # noqa: F401
from symcost.passes.checkpoint.costs import BlockCosts, block_costs, integer_k, law  # noqa: F401
from symcost.passes.checkpoint.plans import KINDS, Plan  # noqa: F401
from symcost.passes.checkpoint.traces import _uniform_trace, every_layer, recompute_last, uniform_spec, use_every_layer, use_model  # noqa: F401
from symcost.passes.checkpoint.schedule import Chain, StepSchedule, chain, exact, is_uniform, law_of, make_plan  # noqa: F401
from symcost.passes.checkpoint.analyse import analyse, tradeoff  # noqa: F401
from symcost.passes.checkpoint.memory import CheckpointedMemory, plan_memory  # noqa: F401
from symcost.passes.checkpoint.stacks import StackPlan, StackSchedule, analyse_stacks  # noqa: F401

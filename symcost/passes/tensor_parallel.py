"""One rank of tensor (and sequence) parallel training: per-rank collectives and memory from a
``--tp`` trace (:mod:`symcost.frontends.tensor_parallel`; docs/parallel.md, "Tensor and sequence
parallelism").

Every quantity comes from the traced rank: its collectives (``Analysis.comm_bytes``: all-reduce
without sequence parallelism, all-gather and reduce-scatter pairs with it, ring bytes per rank),
the parameter elements it holds (``Analysis.params_shard``: column- and row-parallel shards
plus what the plan replicates, norms, biases of row-parallel layers, position embeddings), and the
bytes autograd saves on it. Model states follow the precision policy per element of the rank's
parameters (tensor parallelism shards weights, gradients and optimizer state alike: each rank
updates its own shard).
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError


def is_tensor_parallel(an) -> bool:
    """Whether ``an`` traces one rank of tensor parallelism (``--tp``)."""
    return (getattr(an, "parallel", None) or "").startswith("tp")


def summary(an, precision: str | None = None, optimizer: str = "adamw",
            sizes: Mapping[str, int] | None = None, impl: str = "default", device: str = "cuda") -> dict[str, Any]:
    """One rank of a ``--tp`` trace: formulas in the symbols and ``TP``.

    Returns:
        ``sp`` (sequence parallelism on), ``comm`` (``all_gather``, ``reduce_scatter``,
        ``all_reduce``, ``total``: bytes one rank sends, equal to those it receives, per step,
        ring algorithm as nccl-tests' bus bandwidth), ``memory`` (``params``, ``grads``,
        ``optimizer_state``, ``master``, ``total``: :func:`symcost.passes.parallel.model_state_bytes`
        of the rank's parameter elements; ``activations``: bytes autograd saves on the rank),
        ``peak`` (:func:`symcost.passes.parallel.rank_peak`: the rank's peak memory of a
        steady-state step from the rank's traced storage schedule, in the symbols and TP and
        1/TP: ``formula``, and at ``sizes`` or the defaults ``value`` in bytes, ``where`` and
        ``parts``: the policy's parameters and optimizer state of the rank's shards, buffers,
        inputs, and the live set's gradients, forward and backward storages and optimizer
        temporaries; docs/parallel.md §11, "The rank's peak"); ``grads_beyond_shards``: the
        gradient elements the rank holds beyond its parameters' shards (the vocabulary-parallel
        embedding's gradient, whole on every rank: (1 − 1/TP)·V·d; 0 where none, and under a
        policy with a gradient buffer, Megatron-LM's); with
        ``sizes`` also ``values``:
        the same as numbers, and ``tp``. ``impl`` and ``device`` choose the optimizer
        implementation whose temporaries count (:func:`symcost.passes.memory.resolve_impl`).

    Raises:
        SymcostError: ``an`` is no tensor-parallel trace.
    """
    if not is_tensor_parallel(an):
        raise SymcostError("this trace is not tensor-parallel; trace with --tp N")
    from symcost.passes.parallel import rank_parts

    # a transformers model whose config has a plan runs transformers' plan (frontends.tensor_parallel.apply)
    which = "transformers' tp_plan: the config's base_model_tp_plan with its embedding and head rules" \
        if config_tp_plan(an) else "Megatron plan"
    out = {"sp": an.parallel == "tp+sp", **rank_parts(an, "TP", precision, optimizer, sizes, impl, device),
           "engine": f"torch.distributed.tensor.parallel.parallelize_module ({which}"
                     + (", SequenceParallel norms)" if an.parallel == "tp+sp" else ")")}
    out["replicated"] = replicated(an)
    # gradient elements beyond the rank's shards: PyTorch keeps the vocabulary-parallel
    # embedding's gradient whole ([V, d], Replicate; passes/memory/states.py grads_traced)
    from symcost.passes.memory.policies import policy
    from symcost.passes.memory.states import grads_traced

    # (a policy's gradient buffer, Megatron-LM's main_grad, holds the shards: its
    # VocabParallelEmbedding computes the local rows' gradient)
    held = None if policy(precision or an.precision).grad_buffer else grads_traced(an)
    out["grads_beyond_shards"] = sympy.Integer(0) if held is None else \
        sympy.expand(held - an.params_shard + an.params_shard_frozen)
    return out


def replicated(an) -> list[dict[str, Any]]:
    """The weight matrices the tensor-parallel plan leaves whole on every rank, from the traced
    rank: parameters of two or more dimensions whose shard on the rank has the full shape
    (``Analysis.param_shards`` against ``Analysis.param_shapes``), grouped by module.

    A user reading a per-rank figure must know what the plan did not split: transformers' plans
    for mixture-of-experts models (Mixtral, Qwen3-MoE) shard attention only and leave the experts
    to their expert-parallel plan, so under ``--tp`` every rank holds every expert (issue 27);
    plans without vocabulary parallelism replicate the embedding and the output head.

    Returns:
        ``[{"module": folded module path, "params": [names], "elements": formula}, ...]``, largest
        first, ``elements`` the parameters' elements (in the symbols; each rank holds all of
        them). Norms, biases and other vectors (one dimension) are left out.
    """
    shards = getattr(an, "param_shards", None) or {}
    groups: dict[str, dict] = {}
    for name, (shape, _, rep) in an.param_shapes.items():
        if len(shape) < 2 or name not in shards:
            continue
        if any(sympy.simplify(a - b) != 0 for a, b in zip(shards[name][0], shape)):
            continue
        module, _, leaf = name.rpartition(".")
        g = groups.setdefault(module, {"module": module, "params": [], "elements": sympy.Integer(0)})
        g["params"].append(leaf)
        g["elements"] = sympy.expand(g["elements"] + rep * sympy.Mul(*shape))
    probe = {s: 1000 for s in an.symbols}  # order by size at a large point of every symbol

    def size(g):
        v = g["elements"].xreplace({sympy.Symbol(k, positive=True, integer=True): x for k, x in probe.items()})
        return float(v) if v.is_number else 0.0

    return sorted(groups.values(), key=size, reverse=True)


def config_tp_plan(an) -> dict | None:
    """The ``base_model_tp_plan`` of a ``transformers`` model's config class (the plan
    :func:`symcost.frontends.tensor_parallel.apply` runs for it), or None (built-in models, and
    configs without a plan: the Megatron plan)."""
    name = ((getattr(getattr(an, "spec", None), "extra", None) or {}).get("config_class"))
    if not isinstance(name, str):
        return None
    try:
        import transformers
    except ImportError:
        return None
    return getattr(getattr(transformers, name, None), "base_model_tp_plan", None) or None

"""One rank of expert-parallel training: per-rank all-to-all bytes, experts and memory from an
``--ep`` trace (:mod:`symcost.frontends.expert_parallel`; docs/parallel.md §14, "Expert
parallelism").

Every quantity comes from the traced rank: its collectives (``Analysis.comm_bytes``: the token
dispatch and combine ``all_to_all_single`` of every MoE layer, forward and backward, and the
split-size exchange; bytes each rank sends, (EP-1)/EP of each exchange's input), the parameter
elements it holds (``Analysis.params_shard``: the E/EP experts of its shard of every stacked
expert weight, the dense parameters whole), and the bytes autograd saves on it. Model states
follow the precision policy per element of the rank's parameters: the experts' gradients and
optimizer state are ``Shard(0)`` DTensors like their weights, each rank updating its own experts.
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError


def is_expert_parallel(an) -> bool:
    """Whether ``an`` traces one rank of expert parallelism alone (``--ep``)."""
    return getattr(an, "parallel", None) == "ep"


def expert_params(an) -> tuple[sympy.Expr, sympy.Expr]:
    """``(all, rank)``: elements of the parameters expert parallelism shards (those whose rank
    shard differs from the whole parameter: the stacked expert weights), in the whole model and
    on the traced rank (``Analysis.param_shards``). Formulas in the symbols and EP."""
    shards = getattr(an, "param_shards", None) or {}
    whole, local = sympy.Integer(0), sympy.Integer(0)
    for name, (shape, _, rep) in an.param_shapes.items():
        if name not in shards:
            continue
        sh = shards[name][0]
        if all(sympy.simplify(a - b) == 0 for a, b in zip(sh, shape)):
            continue
        whole += rep * sympy.Mul(*shape)
        local += rep * sympy.Mul(*sh)
    return sympy.expand(whole), sympy.expand(local)


def summary(an, precision: str | None = None, optimizer: str = "adamw",
            sizes: Mapping[str, int] | None = None, impl: str = "default", device: str = "cuda") -> dict[str, Any]:
    """One rank of an ``--ep`` trace: formulas in the symbols and ``EP``.

    Returns:
        ``comm`` (``all_to_all`` and the other kinds, ``total``: bytes one rank sends, equal to
        those it receives, per step), ``params_rank`` (parameter elements the rank holds: the dense
        ones whole, E/EP of each expert stack), ``experts`` (``params``: elements of the stacked expert
        weights in the model, ``params_rank``: on the rank, E/EP experts of each),
        ``memory`` (``params``, ``grads``, ``optimizer_state``, ``master``, ``total`` of the
        rank's parameter elements, :func:`symcost.passes.parallel.model_state_bytes`;
        ``activations``: bytes autograd saves on the rank), ``peak``
        (:func:`symcost.passes.parallel.rank_peak` of the rank's traced storage schedule),
        ``engine``; with ``sizes`` also ``values``: the same as numbers, and ``ep``.

    Raises:
        SymcostError: ``an`` is no expert-parallel trace.
    """
    from symcost.passes.parallel import rank_parts

    if not is_expert_parallel(an):
        raise SymcostError("this trace is not expert-parallel; trace with --ep N")
    whole, local = expert_params(an)
    out = {**rank_parts(an, "EP", precision, optimizer, sizes, impl, device), "params_rank": an.params_shard,
           "experts": {"params": whole, "params_rank": local},
           "engine": "experts as Shard(0) DTensors over the ep mesh, tokens dispatched and combined by "
                     "all_to_all_single (torchtitan's AllToAllTokenDispatcher; symcost.frontends.expert_parallel)"}
    if sizes is not None:
        env = an.bind(**sizes)
        out["values"]["experts"] = {k: sympy.sympify(v).xreplace(env) for k, v in out["experts"].items()}
        out["values"]["params_rank"] = sympy.sympify(an.params_shard).xreplace(env)
    return out

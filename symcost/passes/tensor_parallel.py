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
from symcost.graph.ops import COMM_KINDS
from symcost.passes.parallel import model_state_bytes


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
        temporaries; docs/parallel.md §11, "The rank's peak"); with ``sizes`` also ``values``:
        the same as numbers, and ``tp``. ``impl`` and ``device`` choose the optimizer
        implementation whose temporaries count (:func:`symcost.passes.memory.resolve_impl`).

    Raises:
        SymcostError: ``an`` is no tensor-parallel trace.
    """
    if not is_tensor_parallel(an):
        raise SymcostError("this trace is not tensor-parallel; trace with --tp N")
    comm = {k: an.comm_bytes(k) for k in COMM_KINDS if k != "broadcast"}
    comm["total"] = an.comm_bytes("total")
    mem = model_state_bytes(an.params_shard, 1, "ddp", precision or an.precision, optimizer)
    mem["activations"] = sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
    from symcost.passes.parallel import rank_peak

    out = {"sp": an.parallel == "tp+sp", "comm": comm, "memory": mem,
           "peak": rank_peak(an, precision, optimizer, sizes, impl, device),
           "engine": "torch.distributed.tensor.parallel.parallelize_module (Megatron plan"
                     + (", SequenceParallel norms)" if an.parallel == "tp+sp" else ")")}
    if sizes is not None:
        env = an.bind(**sizes)
        out["values"] = {
            "comm": {k: sympy.sympify(v).xreplace(env) for k, v in comm.items()},
            "memory": {k: sympy.sympify(v).xreplace(env) for k, v in mem.items()},
            "tp": env.get(sympy.Symbol("TP", positive=True, integer=True), an.pinned.get("TP")),
        }
    return out

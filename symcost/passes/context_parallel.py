"""What one context-parallel rank exchanges (``report --cp N``; docs/parallel.md §15): the bytes
of the ring's collectives over the CP group, by kind and phase, from the traced graph's
collective nodes (:meth:`symcost.graph.analysis.Analysis.comm_bytes`), and the tokens the rank
holds.

Per rank and per attention layer, with PyTorch's ring attention (Liu et al. 2023;
``torch.distributed.tensor.experimental._context_parallel._attention``), x = the bytes of the
rank's keys and values (2·B·K·(S/CP)·D elements of the attention's dtype):

* forward, ``set_rotate_method("allgather")``: one all-gather of the rank's K/V, (CP-1)·x sent
  (nccl-tests' ring: (n-1)/n of the gathered CP·x); ``"alltoall"``: CP-1 passes to the next rank
  (``permute_tensor``), x each;
* backward: the forward's K/V rotation once more, and CP passes of the dK/dV accumulators (fp32
  under ``convert_to_f32``, PyTorch's default: 2·x at 16-bit) by all-to-all, whatever the method.

These are what the traced graph's collective nodes hold; the formulas come from the trace (CP is
pinned at the request: :func:`symcost.frontends.context_parallel.context_parallel`).
"""
from __future__ import annotations

from typing import Mapping

import sympy

from symcost.frontends.layout import layout_of
from symcost.graph.ops import PHASES

#: the collective kinds the ring runs
KINDS = ("all_gather", "all_to_all")


def summary(an, sizes: Mapping[str, int] | None = None) -> dict:
    """``{"cp", "rotate", "shard", "comm": {kind: {phase: bytes formula}, "total": formula},
    "params_rank", "values"}`` (``shard``: the data-parallel strategy FSDP2 runs over dp_shard × cp,
    or None): the bytes one CP rank sends (= receives) per step over the CP group, by kind
    (all-gather, all-to-all) and phase; ``params_rank`` the parameter elements the rank holds
    (``Analysis.params_shard``: every parameter under CP alone, FSDP2's dim-0 shard over the DP·CP
    ranks with ``--dp N --shard fsdp``); ``values`` the same at ``sizes`` (None without sizes).

    Raises:
        ValueError: ``an`` was not traced under ``--cp``.
    """
    layout = layout_of(an)
    if not layout.cp:
        raise ValueError("not a context-parallel trace")
    comm = {k: {ph: an.comm_bytes(k, ph, group="CP") for ph in PHASES} for k in KINDS}
    total = sympy.Add(*[v for d in comm.values() for v in d.values()])
    out = {"cp": an.pinned.get("CP", sympy.Symbol("CP")), "rotate": layout.cp_rotate, "shard": layout.shard,
           "comm": comm, "total": total, "params_rank": an.params_shard, "values": None}
    if sizes:
        env = an.bind(**{k: v for k, v in sizes.items() if k in an.symbols})
        out["values"] = {"comm": {k: {ph: sympy.sympify(v).xreplace(env) for ph, v in d.items()}
                                  for k, d in comm.items()},
                         "total": sympy.sympify(total).xreplace(env),
                         "params_rank": sympy.sympify(an.params_shard).xreplace(env)}
    return out

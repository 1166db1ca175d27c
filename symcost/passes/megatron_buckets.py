"""Megatron-LM's gradient buckets and its distributed optimizer's shard, as the step-time model prices them.

A ``megatron-*`` trace under ``--shard ddp|zero1`` runs Megatron's data-parallel engine as memory
sees it (:func:`symcost.frontends.megatron.wrap_in_place`: one all-reduce per gradient, hooked
after accumulation). Megatron-Core does not reduce gradient by gradient: its
``DistributedDataParallel`` packs the gradients into contiguous buffers and issues one collective
per *bucket* of a buffer (NVIDIA/Megatron-LM at d98e8a6):

- **Buffers** (``param_and_grad_buffer.py`` ``group_params_for_buffers``): one per
  (parameter dtype, gradient dtype, expert-parallel) key; the gradient dtype is fp32 where
  ``grad_reduce_in_fp32`` (``--bf16`` sets ``accumulate_allreduce_grads_in_fp32``,
  ``megatron/training/arguments.py``; the ``megatron-*`` policy's ``grad`` bytes,
  :data:`symcost.passes.memory.POLICIES`), the parameters' dtype otherwise. The experts' buffer
  (``param.allreduce`` False) reduces over the expert-data-parallel group, the dense one over
  the data-parallel (× context-parallel) group.
- **Bucket size** (``distributed_data_parallel_config.py`` ``bucket_size``;
  ``megatron/training/models/dist_utils.py``): max(40,000,000, 1,000,000 · DP) elements with
  ``overlap_grad_reduce``; without it ``bucket_size = None``: the whole buffer is one bucket.
  A pipeline rank other than the first (``pp_rank > 0``) and every model chunk after the first
  of an interleaved schedule (``disable_bucketing``) keep one bucket per buffer too.
- **Layout** (``param_and_grad_buffer.py`` ``_compute_default_per_buffer_param_layout``, DDP;
  ``optimizer/distrib_optimizer.py`` ``_compute_per_buffer_param_layout``, the distributed
  optimizer): the parameters in reverse ``named_parameters()`` order (backprop order), a bucket
  closed once it holds at least ``bucket_size`` elements; with the distributed optimizer each
  parameter starts on a 64-element boundary and each bucket ends on a multiple of
  lcm(DP, 128) (``optimizer/param_layout.py`` ``pad_param_start``, ``pad_bucket_end``).
- **Collectives** (``_ParamAndGradBucketGroup.start_grad_sync``, ``start_param_sync``): DDP
  all-reduces each bucket's gradients; the distributed optimizer reduce-scatters them (the
  gradient dtype) and, after its step, all-gathers each bucket's parameters (the parameter
  dtype; ``DistributedOptimizer.step_with_ready_grads``).

So the engine's collectives are one per bucket (two with the distributed optimizer), not one
per gradient, and their bytes are the gradient buffer's dtype. The distributed optimizer's step
runs over the rank's shard: of every bucket the rank's 1/DP contiguous range, the parameters
that overlap it (``_build_gbuf_range_map``).

Nothing here traces: it reads the analysis's parameter shapes (folded names in
``named_parameters()`` order, TP- and EP-local shapes where the trace has them) at concrete sizes.
"""
from __future__ import annotations

import bisect
import math
import re
from typing import Any, Mapping, Sequence

import sympy

from symcost.graph.opsets import dtype_names, itemsize

#: Megatron-Core's default bucket size: max(BUCKET_MIN, BUCKET_PER_RANK · DP) elements
BUCKET_MIN = 40_000_000
BUCKET_PER_RANK = 1_000_000
#: parameter start alignment and bucket-end divisor of the distributed optimizer's layout
PARAM_ALIGN = 64
BUCKET_ALIGN = 128


def is_megatron_engine(an) -> bool:
    """Whether ``an`` was traced under Megatron-LM's data-parallel engine: a ``megatron-*``
    policy with ``--shard ddp`` or ``zero1`` (PyTorch's ``replicate`` otherwise), as
    :func:`symcost.passes.parallel.summary` names it."""
    from symcost.frontends.layout import layout_of
    from symcost.frontends.megatron import is_megatron

    return (getattr(an, "parallel", None) in ("ddp", "zero1") and is_megatron(getattr(an, "precision", None))
            and not layout_of(an).fsdp_mp)


def bucket_size(dp: int, overlap_grad_reduce: bool, bucketing: bool = True) -> int | None:
    """Megatron-Core's bucket size in elements for a data-parallel group of ``dp`` ranks:
    max(40,000,000, 1,000,000 · dp) with ``overlap_grad_reduce`` (``--overlap`` other than
    ``none``), None (one bucket per buffer) without it or where ``bucketing`` is off (a pipeline
    rank after the first, a model chunk after the first)."""
    if not overlap_grad_reduce or not bucketing:
        return None
    return max(BUCKET_MIN, BUCKET_PER_RANK * int(dp))


def _walk(numels: Sequence[int], size: int | None, dp: int, distributed: bool):
    """Megatron-Core's layout walk over one buffer (module docstring): ``(buckets, spans)``, the
    buckets as :func:`layout` returns them and each parameter's ``(start, end)`` in the buffer,
    backprop order."""
    pad_end = math.lcm(int(dp), BUCKET_ALIGN)
    buckets: list[dict[str, int]] = []
    spans: list[tuple[int, int]] = []
    start = bucket_start = end = count = 0

    def close(param_end: int) -> int:
        stop = -(-param_end // pad_end) * pad_end if distributed else param_end
        buckets.append({"start": bucket_start, "end": stop, "elements": stop - bucket_start,
                        "unpadded": param_end - bucket_start, "params": count})
        return stop

    for n in reversed(list(numels)):
        if distributed:
            start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        end = start + int(n)
        spans.append((start, end))
        count += 1
        if size is not None and end - bucket_start >= size:
            bucket_start = start = close(end)
            count = 0
        else:
            start = end
    if count:
        close(end)
    return buckets, spans


def layout(numels: Sequence[int], size: int | None, dp: int, distributed: bool) -> list[dict[str, int]]:
    """The buckets of one buffer holding parameters of ``numels`` elements (in ``named_parameters()``
    order), as Megatron-Core lays them out (module docstring).

    Args:
        numels: elements of each parameter, forward order (reversed here: backprop order).
        size: the bucket size in elements (None: one bucket).
        dp: ranks of the group the buffer is reduced over (the padding's divisor).
        distributed: the distributed optimizer's layout (64-element parameter starts, bucket ends
            padded to lcm(dp, 128)); DDP's has no padding.

    Returns:
        ``[{"start", "end", "elements" (end - start, padding included), "unpadded" (the
        parameters' elements and their alignment gaps), "params"}]``, the first bucket the
        model's end (reduced first).
    """
    return _walk(numels, size, dp, distributed)[0]


def _expanded(an, env: Mapping) -> list[tuple[str, int]]:
    """``[(name, local elements)]`` of :func:`_typed`."""
    return [(name, n) for name, n, _ in _typed(an, env)]


def _typed(an, env: Mapping, blocks: bool = False) -> list[tuple]:
    """``[(name, local elements, bytes per element)]`` of every trained parameter of ``an`` at ``env``, in
    ``named_parameters()`` order: a run of folded entries repeated r times (a block stack) is
    unfolded block by block; the shape is the rank's (the TP- and EP-local shard where the trace
    has one, rank 0's ceil where a split does not divide). ``blocks``: each entry also carries its
    block's index k and the run's r (``(name, n, bytes, k, r)``; k None outside a folded run)."""
    frozen = getattr(an, "frozen", None) or set()
    shards = getattr(an, "param_shards", None) or {}
    entries = []
    for name, (shape, dtype, rep) in an.param_shapes.items():
        if name in frozen:
            continue
        sh = shards.get(name, (shape,))[0]
        n = math.prod(int(sympy.ceiling(sympy.sympify(d).xreplace(env))) for d in sh)
        entries.append((name, n, itemsize(dtype_names([dtype])[0]), sympy.sympify(rep)))
    out: list[tuple] = []
    i = 0
    while i < len(entries):
        rep = entries[i][3]
        j = i + 1
        while j < len(entries) and rep != 1 and entries[j][3] == rep:
            j += 1
        r = int(sympy.sympify(rep).xreplace(env))
        for k in range(r):
            tail = ((k if rep != 1 else None), r) if blocks else ()
            out.extend((name.replace("{i}", str(k)), n, b, *tail) for name, n, b, _ in entries[i:j])
        i = j
    return out


def chunked(an, env: Mapping, chunks: int) -> list[list[tuple[str, int, int]]]:
    """:func:`_typed`'s parameters of the rank of ``an`` at ``env`` split into the ``chunks`` model
    chunks an interleaved schedule gives one pipeline rank (Megatron-LM's ``model`` list, one
    ``DistributedDataParallel`` per chunk: ``megatron/training/models/dist_utils.py``): the folded
    block stack (the parameters repeated once per block, L of them at ``env``) in ``chunks``
    consecutive runs of blocks (block k in chunk k·chunks // L), the parameters before the stack
    (the embeddings: the first virtual stage's ``pre_process``) in the first chunk, those after
    it (the final norm, an untied output layer: the last virtual stage's ``post_process``) in
    the last. ``chunks`` = 1: one chunk of every parameter (:func:`_typed`).

    Raises:
        ValueError: ``chunks`` < 1."""
    if int(chunks) < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    typed = _typed(an, env, blocks=True)
    c = int(chunks)
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(c)]
    seen = False
    for name, n, b, k, r in typed:
        if k is None:  # (outside the stack: before it the first chunk, after it the last)
            out[c - 1 if seen else 0].append((name, n, b))
        else:
            seen = True
            out[min(c - 1, k * c // max(1, r))].append((name, n, b))
    return out


def buffers(an, env: Mapping, ranks: Mapping[str, int], overlap: str, bucketing: bool = True,
            params: Sequence[tuple[str, int, int]] | None = None) -> list[dict[str, Any]]:
    """Megatron-Core's gradient buffers of the traced rank of ``an`` (a :func:`is_megatron_engine`
    trace) at ``env`` (symbol -> value), and their buckets.

    Args:
        an: the analysis.
        env: symbol values (``an.bind``'s).
        ranks: ``{group label: ranks}`` (:func:`symcost.passes.parallel.group_sizes`): ``"DP"``
            the dense buffer's group (DP, DP·EP under expert parallelism), ``"DP_expert"`` the
            experts'.
        overlap: ``--overlap``: ``none`` is Megatron without ``--overlap-grad-reduce`` (one
            bucket per buffer), ``backward``/``full`` with it.
        bucketing: False for a pipeline rank after the first or a model chunk after the first.
        params: the ``(name, local elements, bytes per element)`` of the chunk laid out (one model
            chunk of :func:`chunked`); None: every trained parameter of the rank (:func:`_typed`).

    Returns:
        ``[{"group", "ranks", "grad_bytes" (per element: 4 under a ``megatron-bf16`` policy's fp32
        gradient reduction, else the parameters'), "param_bytes" (the traced parameters' dtype),
        "distributed" (zero1), "bucket_size" (elements or None), "elements" (the buffer's,
        unpadded), "numels", "buckets" (:func:`layout`)}]``, one per group and parameter dtype,
        the dense buffers first; a group of one rank has no buckets.
    """
    from symcost.passes.memory.policies import POLICIES

    pol = POLICIES[an.precision]
    fp32_grads = pol.grad == 4 and pol.param < 4  # (--bf16's grad_reduce_in_fp32: the policy's fp32 main grads)
    distributed = an.parallel == "zero1"
    groups = _grouped(an, env, params)
    out = []
    for g, nbytes in sorted(groups, key=lambda k: k[0] != "DP"):  # (the dense buffers first, in parameter order)
        n = int(ranks.get(g, ranks.get("DP", 1)))
        # (the size from the dense group's ranks, Megatron's dp_cp group: DP·EP under expert parallelism)
        size = bucket_size(ranks.get("DP", n), overlap != "none", bucketing)
        numels = groups[(g, nbytes)]
        out.append({"group": g, "ranks": n, "grad_bytes": 4 if fp32_grads else nbytes, "param_bytes": nbytes,
                    "distributed": distributed, "bucket_size": size, "elements": sum(numels),
                    "numels": numels, "buckets": layout(numels, size, n, distributed) if n > 1 else []})
    return out


def _grouped(an, env: Mapping, params: Sequence[tuple[str, int, int]] | None = None) -> dict[tuple[str, int], list[int]]:
    """The trained parameters' local elements (:func:`_expanded`) by buffer: ``(group, bytes per
    element)``, the group ``"DP_expert"`` for the parameters of a module whose gradients the trace
    reduces over the expert-data-parallel group (Megatron's ``param.allreduce`` False), ``"DP"``
    for the rest, and one buffer per parameter dtype (``group_params_for_buffers``' key)."""
    from symcost.graph.totals import comm_group

    experts = {op.module for op in an.ops if op.comm is not None and comm_group(an, op) == "DP_expert"}
    out: dict[tuple[str, int], list[int]] = {}
    for name, n, nbytes in (_typed(an, env) if params is None else params):
        folded = re.sub(r"\.\d+\.", ".{i}.", name)
        expert = any(folded.startswith(m + ".") or name.startswith(m + ".") for m in experts)
        out.setdefault(("DP_expert" if expert else "DP", nbytes), []).append(n)
    return out


def collectives(bufs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The engine's collectives per step from :func:`buffers`: for each bucket an ``all_reduce``
    of its gradients (DDP) or a ``reduce_scatter`` of its gradients and an ``all_gather`` of its
    parameters (the distributed optimizer), each ``{"group", "kind", "phase", "ranks", "bytes"
    (the bucket's, padding included), "ring_bytes" (per rank: 2(n−1)/n of them for an
    all-reduce, (n−1)/n for the others), "steps" (the ring's latency steps: 2(n−1), n−1)}``.
    The gradients' in the backward; the parameters' all-gather after the optimizer step, before
    the next forward, so in the forward's phase (hidden only under ``--overlap full``:
    Megatron's ``--overlap-param-gather`` issues it under the next forward)."""
    out = []
    for buf in bufs:
        n = buf["ranks"]
        for b in buf["buckets"]:
            kinds = ([("reduce_scatter", "backward", buf["grad_bytes"]), ("all_gather", "forward", buf["param_bytes"])]
                     if buf["distributed"] else [("all_reduce", "backward", buf["grad_bytes"])])
            for kind, phase, per in kinds:
                nbytes = b["elements"] * per
                ring = 2 * (n - 1) if kind == "all_reduce" else n - 1
                out.append({"group": buf["group"], "kind": kind, "phase": phase, "ranks": n, "bytes": nbytes,
                            "ring_bytes": nbytes * ring / n, "steps": ring})
    return out


def by_group(colls: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], float]:
    """``{(group, phase): ring bytes per rank}`` of :func:`collectives`."""
    out: dict[tuple[str, str], float] = {}
    for c in colls:
        key = (c["group"], c["phase"])
        out[key] = out.get(key, 0.0) + c["ring_bytes"]
    return out


def optimizer_shard(bufs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The distributed optimizer's step on its busiest rank, from :func:`buffers`: of every
    bucket, rank r's contiguous range [start + r·e/n, start + (r+1)·e/n) (e the bucket's padded
    elements, n its group's ranks; ``optimizer/distrib_optimizer.py`` ``_build_gbuf_range_map``),
    the parameter tensors that overlap it (each a shard tensor of the optimizer) and their
    elements in it; per buffer the most tensors and the most elements any rank holds (each a
    maximum of its own: the step's host time follows the tensors, its device time the bytes, and
    it ends with the slowest rank's, as the all-gather waits for it), summed over the buffers.

    Returns:
        ``{"tensors", "elements", "param_bytes" (elements × the parameters' bytes)}``.
    """
    tensors = elements = nbytes = 0
    for buf in bufs:
        n = buf["ranks"]
        if n <= 1 or not buf["buckets"]:
            t = len(buf["numels"])
            tensors, elements, nbytes = tensors + t, elements + buf["elements"], nbytes + buf["elements"] * buf["param_bytes"]
            continue
        _, spans = _walk(buf["numels"], buf["bucket_size"], n, buf["distributed"])
        ends = [f for _, f in spans]  # (increasing: the walk lays the parameters out in order)
        best = [0, 0]
        for r in range(n):
            t = e = 0
            for b in buf["buckets"]:
                part = b["elements"] // n
                lo, hi = b["start"] + r * part, b["start"] + (r + 1) * part
                i = bisect.bisect_right(ends, lo)  # (the first parameter ending after lo)
                while i < len(spans) and spans[i][0] < hi:
                    t += 1
                    e += min(spans[i][1], hi) - max(spans[i][0], lo)
                    i += 1
            best = [max(best[0], e), max(best[1], t)]
        tensors, elements = tensors + best[1], elements + best[0]
        nbytes += best[0] * buf["param_bytes"]
    return {"tensors": tensors, "elements": elements, "param_bytes": nbytes}


#: the process groups whose traced collectives the engine's buckets replace
GROUPS = ("DP", "DP_expert")

#: The overlap models (``--overlap``, :data:`symcost.passes.parallel.OVERLAPS`) as Megatron-LM's
#: engine runs them (docs/performance-model.md, "Megatron-LM's engine"; :func:`engine`): its
#: buckets, not FSDP2's all-gathers and prefetch.
OVERLAPS = {
    "none": "Megatron's gradient buffer reduced as one bucket after the backward (no --overlap-grad-reduce), "
            "nothing hidden",
    "backward": "each gradient bucket's all-reduce (the distributed optimizer's reduce-scatter) starts once the "
                "backward has filled it and hides under the rest of the backward (--overlap-grad-reduce); the "
                "distributed optimizer's parameter all-gather, where it runs (zero1), is exposed",
    "full": "the buckets' gradient reductions hide under the backward (--overlap-grad-reduce) and the "
            "distributed optimizer's parameter all-gather, where it runs (zero1), under the next forward "
            "(--overlap-param-gather)",
}


def engine(an, env: Mapping, ranks: Mapping[str, int], overlap: str, bucketing: bool = True,
           chunks: int = 1) -> dict[str, Any]:
    """Megatron-LM's data-parallel collectives of one step of ``an`` (a :func:`is_megatron_engine`
    trace) at ``env``, as the step-time model prices them in place of the trace's all-reduce per
    gradient (:func:`symcost.passes.parallel.step_time`, :func:`symcost.passes.performance.predict_dp`).

    Args: as :func:`buffers`, and ``chunks``: the model chunks the rank holds (an interleaved
    schedule's virtual stages, :func:`chunked`; ``plan``'s interleaved rows). Megatron wraps each
    chunk in a ``DistributedDataParallel`` of its own, with its own buffers and buckets, and
    disables bucketing on every chunk after the first (``disable_bucketing = model_chunk_idx >
    0``, megatron/training/models/dist_utils.py at d98e8a6): the first chunk is laid out with
    ``bucketing``, each later one as one bucket per buffer. (``report --pp`` traces each virtual
    stage apart and calls this once per stage.)

    Returns:
        ``{"by_group" {(group, phase): ring bytes per rank}, "latency_steps" {group: {phase:
        ring steps}} (each collective's 2(n−1) or n−1, summed: × ``collective_latency`` is its
        α), "collectives" (how many), "buffers" [{group, ranks, grad_bytes, param_bytes,
        bucket_size, elements, buckets (each bucket's padded elements)}], "distributed" (the
        distributed optimizer, ``zero1``), "optimizer_shard" (:func:`optimizer_shard`, zero1
        only), "rule" (one line)}``.
    """
    if int(chunks) == 1:
        bufs = buffers(an, env, ranks, overlap, bucketing)
    else:
        bufs = [dict(b, chunk=c) for c, part in enumerate(chunked(an, env, chunks))
                for b in buffers(an, env, ranks, overlap, bucketing and c == 0, part)]
    colls = collectives(bufs)
    steps: dict[str, dict[str, int]] = {}
    for c in colls:
        g = steps.setdefault(c["group"], {"forward": 0, "backward": 0})
        g[c["phase"]] += c["steps"]
    distributed = an.parallel == "zero1"
    out = {"by_group": by_group(colls), "latency_steps": steps, "collectives": len(colls), "distributed": distributed,
           "buffers": [{k: v for k, v in b.items() if k != "numels"} | {"buckets": [x["elements"] for x in b["buckets"]]}
                       for b in bufs],
           "rule": ("Megatron-Core's DistributedDataParallel: a contiguous gradient buffer per dtype (the experts' "
                    "apart), one " + ("reduce-scatter of its gradients and one all-gather of its parameters"
                                      if distributed else "all-reduce") + " per bucket of "
                    + ("max(40M, 1M x DP) elements (--overlap-grad-reduce)" if overlap != "none" and bucketing
                       else "the whole buffer (no --overlap-grad-reduce, or not the first pipeline rank or chunk)")
                    + (f"; {int(chunks)} model chunks, each its own buffers, bucketing off after the first"
                       if int(chunks) > 1 else ""))}
    if distributed:
        out["optimizer_shard"] = optimizer_shard(bufs)
    return out

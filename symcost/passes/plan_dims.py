"""The expert- and context-parallel dimensions of ``symcost plan``'s screen (docs/parallel.md
§13.6): what a layout with EP or CP ranks changes on a rank, read off the plan's one
tensor-parallel trace (:mod:`symcost.passes.plan`) and composed by the rules of §14 and §15.

Expert parallelism (EP ranks; torchtitan's ``ParallelDims`` with ``etp = 1``: EP borrows every
CP and TP rank and some of ``dp_shard``, ``ep % (cp·tp) == 0`` and ``(dp_shard·cp·tp) % ep ==
0``; every EP rank holds E/EP whole experts, so EP divides E):

* the routed expert stacks (:func:`symcost.graph.totals.is_routed`) are held E/EP per rank, the
  dense parameters as the tensor-parallel rank holds them; the experts' gradients are reduced
  over the dp·cp·tp/ep ranks that hold the same experts (torchtitan's ``efsdp`` mesh), the dense
  ones over the dp·cp ranks;
* per MoE layer, per micro-batch, four all-to-alls on the EP group (dispatch and combine, forward
  and backward: :func:`symcost.frontends.expert_parallel.builtin_forward` / ``hf_forward``, as
  torchtitan's ``AllToAllTokenDispatcher``), each rank sending (EP−1)/EP of each exchange's input
  (nccl-tests' all-to-all), plus the forward's split-size exchange of E int64 counts
  (``_token_count_exchange``). The exchanged tensors are read off the graph
  (:func:`expert_exchange`): the dispatch moves the routed slots as they enter the layer's first
  expert GEMM, before any dtype cast (the EP rank exchanges them before its GEMMs cast them), the
  combine the last expert GEMM's output; backward moves their gradients, the same sizes and dtypes;
* the routed FLOPs per rank are unchanged (EP ranks run E·C slots through E/EP experts: GShard
  §3.2), so the step's compute is the trace's; over TP ranks (ep a multiple of tp, §14.8) each TP
  rank dispatches N/TP of the tokens: the experts' work (:func:`expert_ops`, FLOPs and seconds)
  and the all-to-all payload are 1/TP of the tensor-parallel trace's.

Context parallelism (CP ranks, PyTorch's ``context_parallel`` with the all-gather rotation,
torchtitan's default; the load-balanced causal ring of §15):

* everything on the rank at S/CP tokens (the trace's formulas evaluated at S/CP), except that
  each attention call runs CP blocks of S/CP queries: block 0 the causal kernel at S/CP, blocks
  1…CP−1 half of one (:func:`ring_blocks`): (CP+1)/2 times the S/CP kernel's FLOPs and seconds;
* the ring's bytes per attention call and rank (:func:`attention_kv`: x = the rank's K and V as
  the attention kernel reads them): the forward all-gather (CP−1)·x, the backward the same plus
  CP passes of the fp32 dK/dV accumulators; their exposed time is
  :func:`symcost.passes.context_parallel.ring_seconds`'s schedule;
* CP only where every attention is a fused SDPA kernel (PyTorch's CP dispatcher handles those
  only: ``report --cp`` refuses the rest), S a multiple of 2·CP (the load balancer's chunks).

Megatron-LM's engine (``--precision megatron-*`` rows with ``--shard ddp|zero1``, no EP): the
rank's data-parallel collectives are its gradient buckets', its distributed optimizer steps over
the rank's shard, and its per-iteration work runs beside the step (:func:`megatron_engine`, the
same functions ``report --dp --gpu`` prices them with: :mod:`symcost.passes.megatron_buckets`,
:mod:`symcost.passes.megatron_iteration`), on the worst pipeline rank's parameters.
"""
from __future__ import annotations

from typing import Iterable

import sympy

from symcost.graph.opsets import itemsize, numel, same_tensor

#: attention kernels PyTorch's context parallelism dispatches (and SDPA's CPU kernel, which
#: symcost registers the same way: docs/parallel.md §15)
SDPA_KERNELS = ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                "aten.scaled_dot_product_attention")


def ep_options(E: int | None, dp_shard: int, cp: int, tp: int) -> list[int]:
    """The EP sizes a layout of ``dp_shard`` data-sharding, ``cp`` context- and ``tp``
    tensor-parallel ranks takes for ``E`` routed experts: 1, and every ep > 1 dividing E with
    ep a multiple of cp·tp dividing dp_shard·cp·tp (torchtitan's ``ParallelDims._validate``,
    ``etp = 1``: "EP would borrow all cp and tp and some dp_shard degree"). ``E`` None: [1]."""
    if not E or E < 2:
        return [1]
    span = dp_shard * cp * tp
    return [1] + [e for e in range(2, E + 1) if E % e == 0 and e % (cp * tp) == 0 and span % e == 0]


#: the fewest tokens per rank the default CP sizes leave (CP is for long sequences: torchtitan's
#: and Megatron-LM's long-context recipes split 32k–1M tokens; S = 8192 gets no CP by default)
MIN_CP_TOKENS = 8192


def cp_options(S: int, devices: int, cps: Iterable[int] | None) -> list[int]:
    """The CP sizes to try: ``cps`` (or, by default, every power of two) that divide
    ``devices`` and leave the load balancer 2·CP whole chunks of S (``S % (2·CP) == 0``), with
    at least :data:`MIN_CP_TOKENS` tokens per rank (``cps`` None). 1 always."""
    out = [1]
    cand = sorted(set(cps)) if cps is not None else [2 ** k for k in range(1, 21)]
    for c in cand:
        if c > 1 and devices % c == 0 and S % (2 * c) == 0 and (cps is not None or S // c >= MIN_CP_TOKENS):
            out.append(c)
    return out


def routed_params(an) -> tuple[set, sympy.Expr, sympy.Expr]:
    """``(names, whole, held)``: the routed expert stacks of the trace (their names), their
    elements in the model and on the traced (tensor-parallel) rank. Formulas."""
    from symcost.graph.totals import is_routed

    shards = getattr(an, "param_shards", None) or {}
    names = {n for n in an.param_shapes if is_routed(an, n)}
    whole = sympy.Add(*[rep * numel(an.param_shapes[n][0]) for n in names for rep in [an.param_shapes[n][2]]])
    held = sympy.Add(*[(shards[n][2] * numel(shards[n][0])) if n in shards else
                       an.param_shapes[n][2] * numel(an.param_shapes[n][0]) for n in names])
    return names, sympy.expand(whole), sympy.expand(held)


def _routed_gemms(an, names) -> list:
    """Forward matmul-class ops that read a routed stack (through views and casts), program order."""
    g = an.graph
    hit = set()
    for n in names:
        frontier, seen = list(g.successors(f"param:{n}")) if f"param:{n}" in g else [], set()
        while frontier:
            u = frontier.pop()
            if u in seen:
                continue
            seen.add(u)
            d = g.nodes[u]
            if same_tensor(d):
                frontier.extend(g.successors(u))
            elif d.get("family") == "model" and d.get("phase") == "forward":
                hit.add(u)
    return [op for op in an.ops if op.index in hit]


def _source_dtype(an, op) -> str:
    """The dtype of ``op``'s first input before the casts and views that lead to it."""
    g = an.graph
    want = op.in_shapes[0]
    u = op.index
    dtype = str(op.in_dtypes[0]).removeprefix("torch.")
    while True:
        preds = [p for p in g.predecessors(u) if not str(p).startswith(("param:", "buffer:", "input:"))
                 and isinstance(p, int)]
        pick = [p for p in preds if g.edges[p, u].get("shape") == (want if u == op.index else
                                                                     g.nodes[u]["in_shapes"][0])]
        if not pick:
            return dtype
        p = pick[0]
        d = g.nodes[p]
        dtype = (d.get("dtypes") or [dtype])[0]
        if not same_tensor(d):
            return dtype
        u = p


def expert_exchange(an) -> dict[str, sympy.Expr] | None:
    """What the EP all-to-alls move, per step (one micro-batch) of the traced rank, read off the
    graph: ``payload`` (bytes of the dispatched slots plus the combined outputs of every MoE
    layer: the first expert GEMM's token operand before its casts, the last one's output; one
    direction, forward), ``layers`` (MoE layers: the count exchanges); both formulas. None
    without routed experts."""
    names, _, _ = routed_params(an)
    if not names:
        return None
    gemms = _routed_gemms(an, names)
    if not gemms:
        return None
    # one MoE layer's expert GEMMs are consecutive among the forward model ops (attention and the
    # dense projections lie between two layers')
    model_ops = [op for op in an.ops if op.phase == "forward" and op.family == "model"]
    routed = {op.index for op in gemms}
    groups, cur = [], []
    for op in model_ops:
        if op.index in routed:
            cur.append(op)
        elif cur:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    payload, layers = sympy.Integer(0), sympy.Integer(0)
    for grp in groups:
        first, last = grp[0], grp[-1]
        send = numel(first.in_shapes[0]) * itemsize(_source_dtype(an, first))
        back = numel(last.out_shapes[0]) * itemsize(str(last.out_dtypes[0]).removeprefix("torch."))
        payload += first.repeat * (send + back)
        layers += first.repeat
    return {"payload": sympy.expand(payload), "layers": sympy.expand(layers)}


def expert_ops(an) -> set[int]:
    """Indices of the ops of the routed experts' modules (those of the forward expert GEMMs),
    forward and backward: the work that follows the routed slots. Under EP over TP ranks
    (torchtitan's ``etp = 1``, docs/parallel.md §14.8) each TP rank dispatches N/TP of the tokens,
    so this work is 1/TP of a tensor-parallel trace's, whose TP ranks all run every slot."""
    names, _, _ = routed_params(an)
    mods = {op.module for op in _routed_gemms(an, names)} if names else set()
    return {op.index for op in an.ops if op.module in mods and op.phase in ("forward", "backward")}


def attention_kv(an) -> dict[str, sympy.Expr] | None:
    """The forward attention kernels' K and V bytes per step of the traced rank (``kv``) and
    the same elements in fp32 (``kv_fp32``: the backward's dK/dV accumulators,
    ``_cp_options.convert_to_f32``), their model FLOPs forward and backward (``flops``), and the
    calls (``calls``), the forward's FLOPs alone (``flops_forward``); None where some attention is no fused SDPA kernel (no context
    parallelism: PyTorch's dispatcher handles those only)."""
    att = [op for op in an.ops if op.attention and op.phase in ("forward", "backward")]
    if not att or any(not op.name.startswith(SDPA_KERNELS) for op in att):
        return None
    kv = kv32 = calls = sympy.Integer(0)
    for op in att:
        if op.phase != "forward":
            continue
        els = numel(op.in_shapes[1]) + numel(op.in_shapes[2])
        kv += op.repeat * (numel(op.in_shapes[1]) * itemsize(str(op.in_dtypes[1]).removeprefix("torch."))
                           + numel(op.in_shapes[2]) * itemsize(str(op.in_dtypes[2]).removeprefix("torch.")))
        kv32 += op.repeat * 4 * els
        calls += op.repeat
    flops = sympy.Add(*[op.repeat * op.cost.flops for op in att])
    fwd = sympy.Add(*[op.repeat * op.cost.flops for op in att if op.phase == "forward"])
    return {"kv": sympy.expand(kv), "kv_fp32": sympy.expand(kv32), "flops": sympy.expand(flops),
            "flops_forward": sympy.expand(fwd), "calls": sympy.expand(calls)}


def ring_blocks(cp: int, block: float) -> list[float]:
    """Seconds (or FLOPs) of the CP ring steps of one attention call on a rank, given the causal
    kernel's at S/CP (``block``): step 0 the whole causal block, steps 1…CP−1 half of one (the
    load-balanced ring: rank r holds chunks r and 2·CP−1−r; each later step computes half the
    queries or half the keys unmasked, docs/parallel.md §15). Sum: block·(CP+1)/2."""
    return [block] + [block / 2] * (cp - 1)


def alltoall_seconds(nbytes: float, ep: int, ic: dict) -> tuple[str, float]:
    """``(link, seconds)`` of all-to-alls moving ``nbytes`` per rank (sent, = received) over an
    EP group of ``ep`` consecutive ranks: inside a node (ep divides the devices per node) at the
    scale-up link's bandwidth; across nodes each rank's share to the other nodes' ranks,
    (ep − d)/(ep − 1) of its bytes with d ranks per node, crosses its network port and the rest the
    scale-up link, concurrently (nccl-tests' all-to-all, one NIC per device: the slower of the two)."""
    if ep <= 1 or nbytes <= 0:
        return "none", 0.0
    d = int(ic.get("devices_per_node", 1) or 1)
    if ep <= d and d % ep == 0:
        return "node", nbytes / ic["link_bandwidth"]
    far = (ep - d) / (ep - 1) if ep > d else 1.0
    return "network", max(nbytes * far / ic["network_bandwidth"], nbytes * (1 - far) / ic["link_bandwidth"])


class _Engine:
    """``an`` as Megatron's engine with ``--shard shard`` sees it (its ``parallel``): the plan's
    tensor-parallel trace has no data-parallel engine of its own."""

    def __init__(self, an, shard: str):
        self._an, self.parallel = an, shard

    def __getattr__(self, name):
        return getattr(self._an, name)


#: plan's note under --precision megatron-*
MEGATRON_NOTE = ("Megatron-LM's engine (--precision megatron-*): eager kernels; ddp/zero1 rows' data-parallel "
                 "collectives are its gradient buckets', zero1's optimizer steps over the rank's shard, and its "
                 "per-iteration work (grad norm, clipping, checks, logging; --megatron-args) is added, as report "
                 "--dp --gpu prices them; fsdp/hsdp and EP rows are PyTorch's engines")


def megatron_engine(an, env, ranks, shard: str, overlap: str, device, eager: bool, flags=None,
                    chunks: int = 1) -> dict:
    """Megatron-LM's engine on one plan row's rank, priced as ``report --dp --gpu`` prices it
    (:func:`symcost.passes.performance.predict_dp`): the buckets' collectives
    (:func:`symcost.passes.megatron_buckets.engine`: one all-reduce, or reduce-scatter and
    all-gather, per bucket; ring bytes per rank by phase, α per ring step), the distributed
    optimizer's step over its busiest rank's shard (``zero1``; the AdamW figures
    ``optimizer_per_tensor`` and ``optimizer_per_byte`` as :func:`~symcost.passes.performance.host_stretches`
    stretches them), and the per-iteration work (:func:`symcost.passes.megatron_iteration.work`
    and ``price``).

    Args:
        an: the plan's trace (a ``megatron-*`` precision).
        env: symbol values of the rank (``an.bind``: the stage's blocks as L, b as B, tp as TP).
        ranks: ``{"DP", "TP", "PP", "ranks"}`` (the data-parallel group: dp·cp ranks).
        shard: ``ddp`` or ``zero1`` (the distributed optimizer).
        overlap: ``--overlap`` (``none``: one bucket per buffer).
        device: the device (its efficiency table).
        eager: an eager step (its host runs ahead of the device where the efficiency table's
            ``host_async`` says so, as :func:`~symcost.passes.performance.predict`'s).
        flags: :func:`symcost.passes.megatron_iteration.parse_args`' dict or a flag string (None:
            Megatron-LM's defaults).
        chunks: the model chunks of the rank (an interleaved row's v): each its own buffers,
            bucketing on the first only (:func:`symcost.passes.megatron_buckets.engine`).

    Returns:
        ``{"bytes" {forward, backward} (ring bytes per rank: the all-gather's in the forward),
        "latency" {forward, backward} (seconds of α), "collectives", "optimizer" (seconds of the
        distributed optimizer's step, None under ``ddp``: the unsharded step),
        "iteration_step" (seconds once per optimizer step), "iteration_micro_batch" (seconds each
        micro-batch: the loss checks), "iteration_micro_batch_backward" (seconds in each
        micro-batch's backward: the main-gradient adds), "rule", "flags"}``.
    """
    from symcost.passes import megatron_buckets as mb
    from symcost.passes import megatron_iteration as mi
    from symcost.passes.performance import efficiency_of, host_stretches

    rank = _Engine(an, shard)
    eng = mb.engine(rank, env, ranks, overlap, chunks=chunks)
    eff = efficiency_of(device)
    phases = ("forward", "backward")
    nbytes = {ph: float(sum(v for (_, p), v in eng["by_group"].items() if p == ph)) for ph in phases}
    latency = {ph: sum(s.get(ph, 0) for s in eng["latency_steps"].values()) * eff.collective_latency
               for ph in phases}
    optimizer = None
    if "optimizer_shard" in eng:
        sh = eng["optimizer_shard"]
        optimizer = host_stretches({}, {}, eff.optimizer_per_tensor * sh["tensors"],
                                   eff.optimizer_per_byte * sh["param_bytes"], bool(eff.host_async) and eager)["optimizer"]
    f = flags if isinstance(flags, dict) else mi.parse_args(flags)
    f = {**mi.DEFAULTS, **f}
    it = mi.price(mi.work(rank, env, ranks, eng, f), device, 1, f)
    return {"bytes": nbytes, "latency": latency, "collectives": eng["collectives"], "optimizer": optimizer,
            "iteration_step": it["seconds"] - it["per_micro_batch"] - it["per_micro_batch_backward"],
            "iteration_micro_batch": it["per_micro_batch"],
            "iteration_micro_batch_backward": it["per_micro_batch_backward"],
            "rule": eng["rule"], "flags": f}

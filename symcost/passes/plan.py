"""``symcost plan``: the parallel layouts of N devices, ranked by predicted step time
(docs/parallel.md, "13. Planning a layout").

What is traced and what is composed:

* **Traced once per (model, precision, sequence parallelism, regime)**: one rank of tensor
  parallelism (:mod:`symcost.frontends.tensor_parallel`, the symbol ``TP``, B free). From it:
  per block (the coefficient of L) and outside the blocks (the rest), a micro-batch's model
  FLOPs, saved bytes (:func:`symcost.passes.checkpoint.block_costs`: ``a``, the block input
  ``x`` a checkpoint keeps, the forward FLOPs ``f``), parameter elements held (``params_shard``)
  and TP collective bytes (ring, per rank); the roofline time of a micro-batch per phase
  (:func:`symcost.passes.roofline.roofline` at L = 2 and 3, split the same way). TP = 1 is the
  same formulas at TP = 1 (no collectives; the one-device ops).
* **Composed** (formulas of the papers, stated here): a pipeline stage holds L/PP blocks and, on
  the worst rank, everything outside the blocks (embedding and head together: an upper bound of
  either end stage); micro-batches in flight on the first rank: GPipe m, 1F1B min(PP, m),
  interleaved: the most model chunks a rank of PyTorch's schedule holds, /v (min(v·PP + PP − 1,
  v·m)/v where PP divides m: Narayanan et al. 2021 §2.2; Korthikanti et al. 2022 §4.2.3);
  bubble (PP − 1)/m (Narayanan et al. 2021 §2.2, eq. 1), interleaved read off PyTorch's schedule
  ((PP − 1)/(v·m) where PP divides m; more in its flex rounds), as ``report --pp`` does; data-parallel model states by
  :func:`symcost.passes.parallel.model_state_bytes` over the rank's parameters; data-parallel
  collectives as nccl-tests' ring over the rank's gradients and parameters (the bytes a DP trace
  records, docs/parallel.md §3); the pipeline's point-to-point bytes are the block input ``x``
  forward and its gradient back per micro-batch and stage boundary.
* **Step time** (the overlap model, :data:`OVERLAP`): per micro-batch the worst stage's roofline
  compute (plus the recomputed forward of its checkpointed blocks: all under ``full``, the fewest
  that fit the cap under ``optimal``), plus its TP
  collectives (on the critical path, as in Megatron-LM) and its point-to-point transfers, times
  m·(1 + bubble); plus the data-parallel collectives not hidden under the last micro-batch's
  backward (``overlap="backward"``) or all of them (``"none"``). MFU = model FLOPs of the global
  batch (one device's traced step, no recomputation) / (N · peak · step time).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import sympy

from symcost._memo import BoundedMemo, method_cache
from symcost.errors import SymcostError
from symcost.passes.parallel import model_state_bytes
from symcost.tracing.fit import SYMS

from symcost.passes.plan_space import (  # (the search space, re-exported)
    CHECKPOINTS, OVERLAP, SCHEDULES, SHARDS, Layout, divisors, enumerate_layouts, interleaved_accepts,
    interleaved_schedule)

__all__ = ["CHECKPOINTS", "OVERLAP", "SCHEDULES", "SHARDS", "Layout", "Planner", "divisors", "enumerate_layouts",
           "interleaved_accepts", "interleaved_schedule", "plan", "trace_for_plan"]


def _split_L(e) -> tuple[sympy.Expr, sympy.Expr]:
    """``e = rest + L·block`` (a polynomial of degree ≤ 1 in L) -> (block, rest)."""
    L = SYMS["L"]
    e = sympy.expand(sympy.sympify(e))
    poly = sympy.Poly(e, L)
    if poly.degree() > 1:
        raise SymcostError(f"a per-step quantity is not linear in L ({e}); plan composes L/PP blocks per stage")
    return poly.coeff_monomial(L), poly.coeff_monomial(1)


class Planner:
    """The traced quantities of one model, evaluated per layout (see the module docstring).

    Args:
        an: a ``--tp`` Analysis (``symcost.trace(spec, layout=Layout(tp=True, sp=sp), ...)``), B free.
        sizes: the request's sizes (S, H, D, L, V, ... at the model's defaults where absent).
        device: a :class:`~symcost.hardware.devices.Device` with an interconnect table.
        precision: the memory policy of the model states (bytes per parameter).
    """

    def __init__(self, an, sizes: Mapping[str, int], device, precision: str, optimizer: str = "adamw",
                 overlap: str = "backward", fused: bool = True, predicted: bool = True, skew: float = 1.0,
                 megatron_args=None, megatron_overlap: str | None = None):
        from symcost.passes.checkpoint import block_costs
        from symcost.passes.memory.policies import policy
        from symcost.passes.roofline import training_precision

        if overlap not in OVERLAP or (megatron_overlap or overlap) not in OVERLAP:
            raise SymcostError(f"unknown --overlap {megatron_overlap if overlap in OVERLAP else overlap!r}; "
                               f"accepted: {', '.join(OVERLAP)}")
        #: the overlap of the rows under Megatron-LM's engine (ddp/zero1 under megatron-*): plan's
        #: default there is Megatron's, none (its --overlap-grad-reduce is off by default)
        self.megatron_overlap = megatron_overlap or overlap
        self.cap: int | None = None  # bytes per device: checkpoint "optimal" fits its blocks under it (plan sets it)
        ic = device.interconnect or {}
        if not ic.get("link_bandwidth") or not ic.get("network_bandwidth"):
            raise SymcostError(f"{device.key} lists no interconnect (link_bandwidth, devices_per_node, "
                               "network_bandwidth); add one with --devices-file")
        self.an, self.device, self.precision, self.optimizer, self.overlap, self.fused = \
            an, device, precision, optimizer, overlap, fused
        #: rank by the performance model's step (True) or by the roofline bound (False); both are kept
        self.predicted = predicted
        #: ``--routing skew=X``: an EP row's most loaded rank receives min(X, EP) times the balanced
        #: slots (symcost.frontends.moe.Routing): its experts' work and all-to-all payload scale by it
        self.skew = float(skew)
        self.pol = policy(precision)
        from symcost.frontends.megatron import is_megatron

        #: Megatron-LM's engine on the ddp/zero1 rows (plan_dims.megatron_engine); its flags (None: defaults)
        self.megatron, self.megatron_args = is_megatron(precision), megatron_args
        self.sizes = {k: v for k, v in an.spec.values(dict(sizes)).items() if k in an.symbols and k not in ("B", "TP")}
        self.L = int(self.sizes["L"])
        self.peak, _ = device.peak_for(training_precision(an))
        self.ic = ic
        from symcost.passes import plan_dims

        B, TP, S = SYMS["B"], SYMS["TP"], SYMS["S"]
        #: S, the sequence, is an argument (a context-parallel rank runs S/CP tokens: §13.6)
        fix = {SYMS[k]: v for k, v in self.sizes.items() if k not in ("L", "S")}
        self.S = int(self.sizes.get("S", 0) or 0)
        bc = block_costs(an, lead_outside=True)
        def lam(e):  # f(b, tp, s = S)
            fn = sympy.lambdify((B, TP, S), sympy.sympify(e).xreplace(fix), "math")
            return lambda b, t, s=self.S: fn(b, t, s)
        def split(e):
            return tuple(map(lam, _split_L(e)))
        flops_b, flops_r = _split_L(an.flops("train"))
        comm_b, comm_r = _split_L(an.comm_bytes("total"))
        par_b, par_r = _split_L(an.params_shard)
        # frozen parameters (requires_grad=False: held, no gradient or optimizer state) and the
        # parameter tensors with a gradient (torch.optim's 0-d step counter each: step_counter_bytes)
        fro_b, fro_r = _split_L(an.params_shard_frozen)
        from symcost.passes.parallel import step_counter_bytes

        stp_b, stp_r = _split_L(step_counter_bytes(an, optimizer, precision))
        from symcost.passes.memory.states import grads_traced  # (beyond the shards: the vocab-parallel
        gheld = None if self.pol.grad_buffer else grads_traced(an)  # embedding's whole gradient, not Megatron's)
        gbe_b, gbe_r = _split_L(0 if gheld is None else sympy.expand(gheld - an.params_shard + an.params_shard_frozen))
        self.f = {"flops_block": lam(flops_b), "flops_rest": lam(flops_r), "fwd_block": lam(bc.f),
                  "a": lam(bc.a), "x": lam(bc.x), "outside": lam(bc.outside),
                  "comm_block": lam(comm_b), "comm_rest": lam(comm_r),
                  "params_block": lam(par_b), "params_rest": lam(par_r),
                  "frozen_block": lam(fro_b), "frozen_rest": lam(fro_r), "steps_block": lam(stp_b),
                  "steps_rest": lam(stp_r), "grads_beyond_block": lam(gbe_b), "grads_beyond_rest": lam(gbe_r)}
        # expert parallelism: the routed stacks (whole, and as the traced rank holds them) and the
        # all-to-alls' payload per micro-batch, per block and outside the blocks
        names, whole, held = plan_dims.routed_params(an)
        ex = plan_dims.expert_exchange(an) if names else None
        self.experts = ex is not None
        if self.experts:
            (self.f["experts_block"], self.f["experts_rest"]), (self.f["held_block"], self.f["held_rest"]) = \
                split(whole), split(held)
            self.f["a2a_block"], self.f["a2a_rest"] = split(ex["payload"])
            self.f["moe_layers_block"], self.f["moe_layers_rest"] = split(ex["layers"])
            self._experts_ops = plan_dims.expert_ops(an)
            self.f["exflops_block"], self.f["exflops_rest"] = split(sympy.Add(*[
                op.repeat * op.cost.flops for op in an.ops if op.index in self._experts_ops]))
        self.E = int(self.sizes["E"]) if self.experts and "E" in self.sizes else \
            (int(an.pinned["E"]) if self.experts and "E" in (an.pinned or {}) else None)
        # context parallelism: the attention kernels' K/V and FLOPs (None: not every attention is SDPA)
        att = plan_dims.attention_kv(an)
        self.cp_ok = att is not None and "S" in an.symbols
        if self.cp_ok:
            for k in ("kv", "kv_fp32", "flops", "flops_forward", "calls"):
                self.f[f"att_{k}_block"], self.f[f"att_{k}_rest"] = split(att[k])
        one = {TP: 1, B: 1, SYMS["L"]: self.L, S: self.S, **fix}
        #: model FLOPs of one sequence on one device (the traced step at TP = 1, B = 1)
        self.model_flops_per_seq = int(sympy.sympify(an.flops("train")).xreplace(one))
        self.params = int(sympy.sympify(an.params).xreplace(one))

    def _sizes(self, L: int, b: int, tp: int, s: int | None) -> dict:
        return {**self.sizes, "L": L, "B": b, **({"TP": tp} if "TP" in self.an.symbols else {}),
                **({"S": s} if s else {})}

    def _attention_split(self, nodes, ph: dict, L: int) -> None:
        """Add the attention kernels' seconds per phase (``attn_forward``, ``attn_backward``) and the
        routed experts' (``experts_forward``, ``experts_backward``) of a roofline or performance
        model's ``nodes`` to ``ph[L]``."""
        att = {op.index for op in self.an.ops if op.attention}
        ex = getattr(self, "_experts_ops", set())
        for k in ("forward", "backward"):
            ph[L]["attn_" + k] = sum(n["seconds"] for n in nodes if n["index"] in att and n["phase"] == k)
            ph[L]["experts_" + k] = sum(n["seconds"] for n in nodes if n["index"] in ex and n["phase"] == k)

    @property
    def _two(self) -> tuple[int, int]:
        """The two block counts the per-block seconds are differenced at: 2 and 3, or past a
        model's leading blocks of another kind (DeepSeek-V3's 3 dense ones: 5 and 6)."""
        lead = int(getattr(self.an.spec, "lead_blocks", 0) or 0)
        return lead + 2, lead + 3

    def _per_block(self, ph: dict, keys) -> dict[str, float]:
        lo, hi = self._two
        out = {}
        for k in keys:
            blk = ph[hi][k] - ph[lo][k]
            out[k + "_block"], out[k + "_rest"] = blk, ph[lo][k] - lo * blk
        return out

    @method_cache
    def times(self, b: int, tp: int, s: int | None = None) -> dict[str, float]:
        """Roofline seconds of one micro-batch of ``b`` sequences at TP = ``tp`` (``s`` tokens each,
        default S): per block and outside the blocks, forward and backward, and of the attention
        kernels among them (``attn_forward_block``, …), from the roofline at L = 2 and L = 3."""
        from symcost.passes.roofline import roofline

        ph = {}
        for L in self._two:
            r = roofline(self.an, self.device, self._sizes(L, b, tp, s), fused=self.fused, with_formulas=False)
            ph[L] = {k: r["per_phase"].get(k, {}).get("seconds", 0.0) for k in ("forward", "backward")}
            self._attention_split(r["nodes"], ph, L)
        return self._per_block(ph, ("forward", "backward", "attn_forward", "attn_backward", "experts_forward", "experts_backward"))

    @method_cache
    def times_predicted(self, b: int, tp: int, s: int | None = None) -> dict[str, float]:
        """The performance model's seconds (:func:`symcost.passes.performance.predict`: GEMM
        efficiency by shape, memory-bound ops at the achievable bandwidth, a launch per kernel)
        of one micro-batch of ``b`` sequences at TP = ``tp``, per block and outside the blocks,
        forward and backward (each phase's kernel boundaries and the host time the device does not hide, ``phase_overhead``),
        and the AdamW step's (``optimizer_block``, ``optimizer_rest``), from L = 2 and L = 3 as
        :meth:`times`."""
        from symcost.passes.performance import predict

        ph = {}
        for L in self._two:
            sz = self._sizes(L, b, tp, s)
            p = predict(self.an, self.device, sz, mode="compiled" if self.fused else "eager")
            d = {"forward": p["phase_overhead"]["forward"], "backward": p["phase_overhead"]["backward"],
                 "optimizer": p["terms"]["optimizer"]}  # (each phase's exposed host time: performance.host_stretches)
            for node in p["nodes"]:
                d["forward" if node["phase"] == "forward" else "backward"] += node["seconds"]
            ph[L] = d
            self._attention_split(p["nodes"], ph, L)
        return self._per_block(ph, ("forward", "backward", "optimizer", "attn_forward", "attn_backward", "experts_forward",
                                       "experts_backward"))

    def link(self, group: int, span: int) -> tuple[str, float]:
        """The link a ring of ``group`` ranks spread over ``span`` consecutive devices runs on:
        the scale-up link when aligned groups of the span fit in one node (span divides the devices
        per node), else the network (docs/parallel.md §6)."""
        if group <= 1:
            return "none", math.inf
        per_node = self.ic.get("devices_per_node", 1)
        if span <= per_node and per_node % span == 0:  # aligned groups of span ranks stay in a node
            return "node", self.ic["link_bandwidth"]
        return "network", self.ic["network_bandwidth"]

    def evaluate(self, lay: Layout) -> dict[str, Any]:
        """Per-rank memory, FLOPs, comm bytes by link, bubble, step time and MFU of ``lay`` (the
        worst rank: the first pipeline stage with everything outside the blocks). A layout with
        expert- or context-parallel ranks is composed from the same trace by the rules of
        :mod:`symcost.passes.plan_dims` (its ``composed`` lists them)."""
        from symcost.passes.context_parallel import ring_seconds
        from symcost.passes.plan_dims import alltoall_seconds, ring_blocks

        f, b, t, p, d, m, v = self.f, lay.b, lay.tp, lay.pp, lay.dp, lay.m, lay.virtual
        ep, c = lay.ep, lay.cp
        if ep > 1 and not self.experts:
            raise SymcostError("expert parallelism needs routed experts; this model has none")
        if c > 1 and (not self.cp_ok or self.S % (2 * c)):
            raise SymcostError(f"context parallelism over {c} ranks needs SDPA attention and S a multiple of 2·CP")
        sv = self.S // c  # the tokens per sequence on the rank
        nb = self.L // p  # blocks per rank

        def at(key):  # a per-micro-batch quantity of the worst stage: nb blocks and the rest
            return f[key + "_block"](b, t, sv) * nb + f[key + "_rest"](b, t, sv)
        # --- memory (bytes) ---
        # the dense parameters as the tensor-parallel rank holds them; with EP, E/EP whole experts
        # (torchtitan's etp = 1), their states sharded over the dp·cp·tp/ep ranks holding them
        params_rank = int(at("params"))
        experts_rank = experts_block = 0
        if self.experts and ep > 1:
            params_rank -= int(at("held"))
            experts_rank = int(at("experts")) // ep
            experts_block = f["experts_block"](b, t, sv) / ep
        # HSDP: FSDP2's states sharded over the dp_shard group of dp/R ranks (report's
        # passes.parallel.shard_degree), whole on each of the R replicas (docs/parallel.md §0.1);
        # CP ranks hold the same parameters as their dp peers (FSDP over dp_shard × cp, torchtitan)
        hsdp, r = lay.shard == "hsdp", lay.replicate
        sd = lay.shard_degree * c
        se = max(1, sd * t // ep) if ep > 1 else sd  # the expert-data-parallel shard group
        shard = "fsdp" if hsdp else lay.shard
        # (frozen parameters, requires_grad=False, counted with the dense ones: no gradient or state)
        states = model_state_bytes(params_rank, sd, shard if sd > 1 else "ddp", self.precision, self.optimizer,
                                   frozen=int(at("frozen")))
        if experts_rank:
            es = model_state_bytes(experts_rank, se, shard if se > 1 else "ddp", self.precision, self.optimizer)
            states = {k: states[k] + es[k] for k in ("params", "grads", "optimizer_state", "master", "total")}
        if sd == 1 and t > 1:  # (report --tp's grads, §11; a DP engine keeps the embedding's rows)
            beyond = int(self.pol.grad * at("grads_beyond"))
            states["grads"] += beyond
            states["total"] += beyond
        # torch.optim's step counters, one per parameter tensor with a gradient on the rank, unsharded
        # (report --dp's, --tp's, --ep's and --pp's too: passes.parallel.step_counter_bytes)
        steps = int(at("steps"))
        states["optimizer_state"] += steps
        states["total"] += steps
        if lay.schedule == "gpipe":
            in_flight = m
        elif lay.schedule == "interleaved-1f1b":
            in_flight, bubble = interleaved_schedule(p, m, v)
        elif lay.schedule == "1f1b":
            in_flight = min(p, m)
        else:
            in_flight = 1
        a, x = f["a"](b, t, sv), f["x"](b, t, sv)
        gathered = 0
        dense_block = f["params_block"](b, t, sv) - (f["held_block"](b, t, sv) if experts_rank else 0)
        if lay.shard in ("fsdp", "hsdp") and sd > 1:  # FSDP2: the block run and the one prefetched, whole
            gathered = 2 * self.pol.param * (dense_block * (1 - 1 / sd) + experts_block * (1 - 1 / se))

        def activations(k):  # k of the nb blocks checkpointed (their inputs kept), + one block recomputed
            return (a * (nb - k) + x * k + f["outside"](b, t, sv)) * in_flight + (a if k else 0)

        k = {"none": 0, "full": nb, "selective": nb}.get(lay.checkpoint)
        if k is None:  # optimal: the fewest blocks that fit the cap (all of them if none does)
            fixed = int(states["total"]) + int(gathered)
            k = next((j for j in range(nb + 1) if self.cap is None or fixed + int(activations(j)) <= self.cap), nb)
        act = activations(k)
        memory = {"model_states": int(states["total"]), "activations": int(act), "fsdp_gathered": int(gathered)}
        memory["total"] = sum(memory.values())
        # --- FLOPs per rank per step ---
        # selective (torchtitan's op policy): bounds only, full's memory and none's time; its
        # recomputation is read off its trace (plan_traced.refine)
        kt = 0 if lay.checkpoint == "selective" else k
        ring_extra = (c - 1) / 2 if c > 1 else 0.0  # the ring's attention: (CP+1)/2 kernels at S/CP
        recompute = (f["fwd_block"](b, t, sv) + (f["att_flops_forward_block"](b, t, sv) * ring_extra if c > 1 else 0)) * kt
        flops_mb = at("flops") + recompute + (at("att_flops") * ring_extra if c > 1 else 0)
        # under EP each TP rank dispatches N/TP of the tokens (§14.8), and under --routing skew=X the
        # most loaded EP rank's experts receive xs = min(X, EP) times the balanced slots: its experts'
        # work is xs/TP of the tensor-parallel trace's (ex_cut the share taken off; negative: added)
        xs = min(self.skew, ep) if ep > 1 else 1.0
        ex_cut = (1 - xs / t) if ep > 1 and (t > 1 or xs != 1) else 0.0
        flops_mb -= at("exflops") * ex_cut if ex_cut else 0
        # --- communication ---
        tp_link, tp_bw = self.link(t, t)
        pp_link, pp_bw = self.link(p, t * p * c)
        n = d * t * p * c
        dp_link, dp_bw = self.link(sd, sd * t) if hsdp else self.link(d * c, n)
        rep_link, rep_bw = self.link(r, n)  # (HSDP's dp_replicate group; none for r = 1)
        tp_bytes = at("comm") * m
        pp_bytes = (2 * x * m * (1 if p > 1 else 0)) * v  # forward activation + its gradient, each boundary
        pb, gb = self.pol.param, self.pol.grad

        def ring(g):
            return (g - 1) / g
        rep_bytes = 0.0
        if lay.shard in ("fsdp", "hsdp"):
            dp_bytes = m * (ring(sd) * params_rank + (ring(se) * experts_rank if se > 1 else 0)) * (2 * pb + gb)
            # HSDP: each micro-batch's reduce-scattered gradient shard all-reduced over the R
            # replicas (FSDP2's foreach_reduce: all_reduce on the replicate group), ring 2(R-1)/R
            rep_bytes = m * 2 * (r - 1) / r * (params_rank / sd + experts_rank / se) * gb
        else:  # ddp / zero1: one all-reduce (zero1: reduce-scatter + all-gather) of the gradients per step
            dp_bytes = 2 * (ring(sd) * params_rank + (ring(se) * experts_rank if se > 1 else 0)) * gb
        # EP: dispatch and combine, forward and backward, (EP-1)/EP of each, and the forward's
        # E int64 split sizes per MoE layer, per micro-batch (docs/parallel.md §14.2); what the rank sends
        ep_bytes, ep_link, ep_s = 0.0, "none", 0.0
        if ep > 1:
            # (skew: the dispatch and the combine's gradient go out balanced, the combine and the
            # dispatch's gradient carry the xs-fold slots: 2 + 2·xs exchanges, symcost.frontends.moe)
            ep_bytes = m * ring(ep) * ((1 + xs) * at("a2a") / t + 8 * self.E * at("moe_layers"))
            ep_link, ep_s = alltoall_seconds(ep_bytes / m, ep, self.ic)
        # CP: per attention call the K/V all-gather forward and backward, CP fp32 dK/dV passes
        cp_bytes, cp_link, cp_bw = 0.0, "none", math.inf
        if c > 1:
            calls = max(1.0, at("att_calls"))
            kv, kv32 = at("att_kv") / calls, at("att_kv_fp32") / calls
            cp_bytes = m * calls * (2 * (c - 1) * kv + c * kv32)
            cp_link, cp_bw = self.link(c, c * t)
        # --- time: the bound (roofline compute) and the prediction (the performance model's
        # compute and AdamW step), composed by the same schedule and overlap rule ---
        tp_s = tp_bytes / m / tp_bw if t > 1 else 0.0
        pp_s = pp_bytes / m / pp_bw if p > 1 else 0.0
        if lay.schedule != "interleaved-1f1b":
            bubble = (p - 1) / m if p > 1 else 0.0
        dp_s = (dp_bytes / dp_bw if sd > 1 or se > 1 else 0.0) + (rep_bytes / rep_bw if r > 1 else 0.0)
        meg = None  # Megatron-LM's engine on ddp/zero1 rows without EP (plan_dims.megatron_engine; module docstring)
        if self.megatron and lay.shard in ("ddp", "zero1") and ep == 1:
            from symcost.passes.plan_dims import megatron_engine

            meg = megatron_engine(self.an, self.an.bind(**self._sizes(nb, b, t, None)), {"DP": sd, "TP": t, "PP": p,
                                  "ranks": n}, lay.shard, self.megatron_overlap, self.device, not self.fused,
                                  self.megatron_args, chunks=v if lay.schedule == "interleaved-1f1b" else 1)
            # (its buckets' bytes by phase: the all-gather in the forward)
            dp_bytes = sum(meg["bytes"].values())
            dp_s = dp_bytes / dp_bw if sd > 1 else 0.0

        def compose(tm, optimizer: float, predicted: bool = False) -> dict[str, float]:
            fwd = tm["forward_block"] * nb + tm["forward_rest"]
            bwd = tm["backward_block"] * nb + tm["backward_rest"]
            if ex_cut:  # (the experts' share of the TP rank's tokens)
                fwd -= (tm["experts_forward_block"] * nb + tm["experts_forward_rest"]) * ex_cut
                bwd -= (tm["experts_backward_block"] * nb + tm["experts_backward_rest"]) * ex_cut
            cp_exp = 0.0
            if c > 1:  # the ring: (CP+1)/2 kernels per call, and the exchange its schedule leaves exposed
                af = tm["attn_forward_block"] * nb + tm["attn_forward_rest"]
                ab = tm["attn_backward_block"] * nb + tm["attn_backward_rest"]
                fwd += af * ring_extra
                bwd += ab * ring_extra
                blk_f, blk_b = ring_blocks(c, af / calls), ring_blocks(c, ab / calls)
                cp_exp = calls * (ring_seconds(blk_f, (c - 1) * kv / cp_bw, None, True) - sum(blk_f)
                                  + ring_seconds(blk_b, (c - 1) * kv / cp_bw, kv32 / cp_bw, True) - sum(blk_b))
            bwd += (tm["forward_block"] + (tm["attn_forward_block"] * ring_extra if c > 1 else 0)) * kt  # recomputed
            # (Megatron's per-iteration work, predicted only: the loss checks each micro-batch, the rest once)
            once = meg["iteration_step"] if meg is not None and predicted else 0.0
            fwd += meg["iteration_micro_batch"] if meg is not None and predicted else 0.0
            bwd += meg["iteration_micro_batch_backward"] if meg is not None and predicted else 0.0
            per_mb_s = fwd + bwd + tp_s + pp_s + ep_s + cp_exp
            pipe_s = m * per_mb_s * (1 + bubble)
            dps = dp_s
            if meg is not None:  # (report's predict_dp: the all-gather exposed in the forward, the
                # gradients' buckets under the last backward with the optimizer step and the iteration's work)
                g = {ph: (meg["bytes"][ph] / dp_bw + (meg["latency"][ph] if predicted else 0.0)) if sd > 1 else 0.0
                     for ph in ("forward", "backward")}
                dps = sum(g.values())
                exposed = (dps if self.megatron_overlap == "none"
                           else g["forward"] + max(0.0, g["backward"] - bwd - optimizer - once))
            elif self.overlap == "none":
                exposed = dp_s
            elif lay.shard in ("fsdp", "hsdp"):
                exposed = m * max(0.0, dp_s / m - (fwd + bwd))
            else:
                exposed = max(0.0, dp_s - bwd)
            return {"compute": m * (fwd + bwd), "tp_comm": m * tp_s, "pp_comm": m * pp_s, "ep_comm": m * ep_s,
                    "cp_exposed": m * cp_exp, "bubble": m * per_mb_s * bubble, "dp_exposed": exposed,
                    "dp_comm": dps, "optimizer": optimizer, "iteration": once, "step": pipe_s + exposed + optimizer + once}

        s_arg = sv if c > 1 else None
        bound = compose(self.times(b, t, s_arg), 0.0)
        tq = self.times_predicted(b, t, s_arg) if self.predicted else None
        opt_s = tq["optimizer_block"] * nb + tq["optimizer_rest"] if tq is not None else 0.0
        opt_s = meg["optimizer"] if meg is not None and meg["optimizer"] is not None else opt_s  # (zero1: the shard)
        pred = compose(tq, opt_s, predicted=True) if tq is not None else bound
        step = pred["step"]
        gbatch = d * b * m
        model_flops = self.model_flops_per_seq * gbatch
        parts = (("tp", tp_bytes, tp_link), ("pp", pp_bytes, pp_link), ("dp", dp_bytes, dp_link),
                 ("dp_replicate", rep_bytes, rep_link), ("ep", ep_bytes, ep_link), ("cp", cp_bytes, cp_link))
        return {
            "layout": {"dp": d, "tp": t, "pp": p, "micro_batch": b, "microbatches": m, "shard": lay.shard,
                       "checkpoint": lay.checkpoint, "checkpointed_blocks": k, "blocks": nb,
                       "schedule": lay.schedule, "virtual": v, "replicate": r, "ep": ep, "cp": c},
            "memory": memory, "in_flight": in_flight, "params_rank": params_rank + experts_rank,
            "flops_rank": float(flops_mb * m),
            "comm_bytes": {k: float(bv) for k, bv, _ in parts},
            "links": {k: ln for k, _, ln in parts},
            "comm_by_link": {ln: float(sum(bv for _, bv, lk in parts if lk == ln)) for ln in ("node", "network")},
            "composed": [k for k, on in (("ep", ep > 1), ("cp", c > 1)) if on],
            **({"megatron": {"collectives": meg["collectives"], "rule": meg["rule"]}} if meg is not None else {}),
            "bubble": bubble,
            "time": pred, "time_bound": bound, "predicted": tq is not None,
            "step_seconds": step, "bound_seconds": bound["step"], "model_flops": model_flops,
            "screen_bounds": lay.checkpoint == "selective",
            "mfu": model_flops / (n * self.peak * step) if step else 0.0,
            "mfu_bound": model_flops / (n * self.peak * bound["step"]) if bound["step"] else 0.0,
        }


def plan(an, sizes: Mapping[str, int], device, devices: int, memory: int, global_batch: int,
         precision: str, optimizer: str = "adamw", overlap: str = "backward", shards=SHARDS,
         checkpoints=CHECKPOINTS, schedules=("1f1b",), micro_batches=None, keep_all: bool = False,
         trace_at=None, model: str | None = None, trace_top: int = 0, near: float = 0.1, sp: bool = False,
         progress=None, rank_by: str = "predicted", eps=None, cps=None, routing=None,
         megatron_args=None, megatron_overlap: str | None = None) -> dict[str, Any]:
    """Rank the layouts of ``devices`` devices for a global batch of ``global_batch`` sequences.

    Returns:
        ``layouts`` (those whose per-rank memory fits ``memory`` bytes, fastest first; with
        ``keep_all`` also ``excluded``), ``considered`` (how many were evaluated), ``overlap``,
        ``model_flops`` per step and ``params``; ``notes`` where tensor parallelism is not
        offered (a trace at TP = 1: the model's plan cannot split it over 2 ranks, and why).

    Raises:
        SymcostError: ``devices`` or ``global_batch`` not positive, no layout of ``devices``
            devices divides the model and the batch.

    ``an`` serves every tp when its TP is free; a trace with TP pinned (4 heads: TP = 4 would
    leave one per rank, so the probes cannot vary TP) serves its own tp only, and the layouts at
    another tp are evaluated on ``trace_at(tp)`` (:func:`trace_for_plan` at that TP), or left out
    with a note when it is not given.

    ``rank_by``: ``predicted`` (the performance model's step, :meth:`Planner.times_predicted`:
    ``step_seconds`` and ``mfu``; the bound beside as ``bound_seconds``, ``mfu_bound``) or ``bound``
    (the roofline's, in both; docs/performance-model.md).

    ``eps``: for a model with routed experts, the expert-parallel sizes to try (None: every size
    torchtitan allows, :func:`symcost.passes.plan_dims.ep_options`; those of ``eps`` it allows
    otherwise, ``(1,)`` none); ``cps``: the context-parallel sizes to try
    (None: every power of two leaving at least 8192 tokens per rank,
    :func:`symcost.passes.plan_dims.cp_options`; offered only where every attention is an SDPA
    kernel). Rows with EP or CP are composed from the trace (docs/parallel.md §13.6; their
    ``composed`` names the dimensions) and keep their screened memory (no traced peak).

    ``megatron_args``: under ``--precision megatron-*``, the run's Megatron-LM flags
    (:func:`symcost.passes.megatron_iteration.parse_args`; None: its defaults); those rows are
    priced eager, with Megatron's engine on ddp/zero1 rows (:func:`symcost.passes.plan_dims.megatron_engine`);
    ``megatron_overlap`` is those rows' overlap (None: ``overlap``; the CLI's default under
    ``megatron-*`` is ``none``, Megatron-LM's, the other rows keep ``backward``), and an interleaved
    row's v model chunks each have their own buffers, bucketed on the first chunk only.

    ``routing`` (``--routing``, :func:`symcost.frontends.moe.parse_routing`'s text; None: balanced):
    ``capacity=C`` is the trace's own (``an`` traced under it, :func:`trace_for_plan`'s
    ``routing``; the traced peaks of ``trace_top`` too); ``skew=X`` prices each EP row's most
    loaded rank: its experts' work and all-to-all payload min(X, EP) times the balanced (the
    screened memory stays the balanced rank's). The result's ``routing`` says which.

    ``trace_top`` > 0 (with ``model``, a name or config path): the fastest ``trace_top`` rows the
    screen puts within ``near`` of the cap get the per-rank peak of their composed trace, as
    ``report`` computes it for that layout, and are re-ranked
    (:func:`symcost.passes.plan_traced.refine`; each row's ``peak_source``). Without it,
    ``selective`` rows (bounds only) are left out.
    """
    if rank_by not in ("predicted", "bound"):
        raise SymcostError(f"unknown ranking {rank_by!r}; accepted: predicted, bound")
    from symcost.frontends.megatron import is_megatron
    from symcost.frontends.moe import parse_routing

    rt = parse_routing(routing)
    # (Megatron-LM runs eager: its rows priced as report --dp --gpu prices them, eager kernels and launches)
    pl = Planner(an, sizes, device, precision, optimizer, overlap, predicted=rank_by == "predicted",
                 skew=float(rt.skew), fused=not is_megatron(precision), megatron_args=megatron_args,
                 megatron_overlap=megatron_overlap)
    pl.cap = memory
    if pl.pol.sharded_optimizer_only:  # (megatron-bf16-moments: Megatron-LM runs it only with its distributed optimizer)
        shards = tuple(s for s in shards if s != "ddp")
    H = int(pl.sizes.get("H", 1))
    K = int(pl.sizes["K"]) if "K" in pl.sizes else None
    pinned = int((getattr(an, "pinned", None) or {}).get("TP", 0))
    check = _tp_check(an)
    planners = {}  # tp -> Planner on a trace that serves it

    def planner(tp: int):
        if not pinned or pinned == tp:
            return pl
        if tp not in planners:
            other = trace_at(tp) if trace_at is not None else None
            planners[tp] = None if other is None else Planner(other, sizes, device, precision, optimizer, overlap,
                                                              predicted=pl.predicted, skew=pl.skew, fused=pl.fused,
                                                              megatron_args=megatron_args,
                                                              megatron_overlap=megatron_overlap)
            if planners[tp] is not None:
                planners[tp].cap = memory
        return planners[tp]

    def why_not(tp: int):  # why the tensor-parallel plan cannot split the model over tp ranks, or None
        from symcost.frontends.tensor_parallel import rejects  # (a V that tp does not divide: as report --tp)

        return None if check is None else rejects(check, {**an.spec.values(dict(pl.sizes)), "B": 1, "TP": tp}, precision)

    from symcost.passes.plan_dims import cp_options

    # a trace without tensor parallelism (no TP among its symbols) serves tp = 1 only
    no_tp = pinned == 1 or ("TP" not in an.symbols and not pinned)
    cp_sizes = cp_options(pl.S, devices, cps) if pl.cp_ok and pl.S else [1]
    lays = enumerate_layouts(devices, global_batch, pl.L, H, shards=shards, checkpoints=checkpoints,
                             schedules=schedules, micro_batches=micro_batches, K=K, tp_ok=lambda tp: why_not(tp) is None,
                             max_tp=1 if no_tp else None, E=pl.E, cps=cp_sizes, eps=eps)
    if not lays:
        raise SymcostError(f"no layout of {devices} devices fits the model and global batch {global_batch}: "
                           f"dp·tp·pp·cp = {devices} needs tp | H ({H}) and every size the TP plan shards, "
                           f"pp | L ({pl.L}), dp | {global_batch}")
    rows, missing = [], set()
    for x in lays:
        p = planner(x.tp)
        if p is None:
            missing.add(x.tp)
        else:
            r = p.evaluate(x)
            lay = r["layout"]
            if x.checkpoint == "optimal" and {0: "none", lay["blocks"]: "full"}.get(lay["checkpointed_blocks"]) \
                    in checkpoints:
                continue  # (the same layout as its none or full row)
            rows.append(r)
    fit = sorted((r for r in rows if r["memory"]["total"] <= memory), key=lambda r: r["step_seconds"])
    out = {"layouts": fit, "considered": len(rows), "overlap": OVERLAP[overlap],
           **({"megatron_overlap": pl.megatron_overlap} if is_megatron(precision) else {}), "params": pl.params,
           "model_flops_per_sequence": pl.model_flops_per_seq, "peak_flops": pl.peak, "devices": devices,
           "global_batch": global_batch, "memory_cap": memory, "sizes": pl.sizes,
           "links": f"node {pl.ic['link_bandwidth'] / 1e9:g} GB/s per direction ({pl.ic.get('devices_per_node')} "
                    f"per node), network {pl.ic['network_bandwidth'] / 1e9:g} GB/s per device"}
    from symcost.passes.plan_dims import MEGATRON_NOTE

    out["notes"] = [MEGATRON_NOTE] if pl.megatron else []
    out["routing"] = rt.as_json() if pl.experts else None
    if rt.kind == "skew" and pl.experts:
        out["notes"].append(f"--routing {rt.name}: each EP row's most loaded rank receives min({float(rt.skew):g}, EP) "
                            "times the balanced slots (its experts' time and all-to-all payload; memory screened "
                            "balanced); rows without EP run balanced")
    elif routing is not None and not pl.experts:
        raise SymcostError(f"--routing applies to mixture-of-experts models; {an.model} has no routed experts")
    out["ep_sizes"] = sorted({x.ep for x in lays})
    out["cp_sizes"] = cp_sizes
    if pl.experts and len(out["ep_sizes"]) > 1:
        out["notes"].append(f"expert parallelism: ep in {{{', '.join(map(str, out['ep_sizes']))}}} (E = {pl.E}; "
                            "torchtitan's rule: ep | E, a multiple of cp·tp dividing dp_shard·cp·tp); EP rows are "
                            "composed from the trace (screened: their all-to-alls over the EP group's link, "
                            "docs/parallel.md §13.6), not traced per layout")
    if cps is not None and not pl.cp_ok:
        out["notes"].append("context parallelism not offered: some attention of this model is no "
                            "scaled_dot_product_attention kernel (PyTorch's context_parallel dispatches those only)")
    elif len(cp_sizes) > 1:
        out["notes"].append(f"context parallelism: cp in {{{', '.join(map(str, cp_sizes))}}}; CP rows are composed "
                            "from the trace at S/CP with the load-balanced ring's (CP+1)/2 attention kernels and its "
                            "K/V all-gathers and fp32 dK/dV passes (screened, docs/parallel.md §13.6)")
    if no_tp and pinned != 1:
        out["notes"].append("tensor parallelism not offered: the trace has no TP (a one-device trace)")
    if pinned == 1:
        out["notes"].append(f"tensor parallelism not offered: TP = 2 cannot split this model ({why_not(2)}); "
                            "layouts with tp = 1 only")
    if missing:
        out["notes"].append(f"layouts with tp = {', '.join(map(str, sorted(missing)))} left out: the trace "
                            f"holds at TP = {pinned} only")
    out["excluded"] = [r for r in rows if r["memory"]["total"] > memory]
    if trace_top and model is not None:
        from symcost.passes.plan_traced import refine

        out = refine(out, model, sizes, precision, optimizer, sp, trace_top, near, progress=progress,
                     routing=routing if rt.kind == "capacity" else None)
        kept = {id(r) for r in out["layouts"]}
        out["excluded"] = [r for r in rows if id(r) not in kept]
    else:
        out["excluded"] += [r for r in out["layouts"] if r["screen_bounds"]]
        out["layouts"] = [r for r in out["layouts"] if not r["screen_bounds"]]
        for r in out["layouts"]:
            r["peak_source"] = "screened"
    if not keep_all:
        del out["excluded"]
    return out


def _tp_check(an):
    """``check(values) -> why or None``: whether the model's tensor-parallel plan splits every
    size it shards at ``values["TP"]`` (``tensor_parallel``'s ``probe_check``). An analysis read
    from the trace cache has no code: the model is resolved again by name (None if it cannot be)."""
    if an.spec.probe_check is not None:
        return an.spec.probe_check
    from symcost.frontends.layout import layout_of
    from symcost.frontends.models import resolve
    from symcost.frontends.tensor_parallel import tensor_parallel

    try:
        return tensor_parallel(resolve(an.model), layout_of(an).sp).probe_check
    except SymcostError:
        return None


_TRACES = BoundedMemo(8)  # (the 8 last used requests' traces)


def trace_for_plan(model, sizes: Mapping[str, int], precision: str, sp: bool = False, use_cache: bool = True,
                   tp: int | None = None, routing: str | None = None):
    """The ``--tp`` trace plan evaluates (B and TP free): kept in this process for requests whose
    sizes fall in the same regime, and for a model given by name in the trace cache under the
    entry ``report --tp`` keeps (options ``{"tp", "sp"}``, the same trace; a round trip gives the
    same layouts' numbers, tested); ``use_cache=False`` traces afresh. ``tp``: trace at that TP
    (default 2, or 1 for a model TP = 2 cannot split); the trace may pin it (``Analysis.pinned``).
    ``routing``: ``--routing capacity=C`` traces the MoE layers under it
    (:func:`symcost.frontends.moe.with_routing`; the trace cache's entry of ``report --tp 2
    --routing capacity=C``); balanced and ``skew=X`` (priced per EP row, :class:`Planner`) trace
    balanced.

    Raises:
        SymcostError: the model cannot be traced; ``routing`` on a model without routed experts."""
    import symcost
    from symcost.frontends.models import resolve
    from symcost.frontends.spec import ModelSpec
    from symcost.frontends.layout import Layout

    from symcost.frontends.moe import parse_routing, with_routing

    spec = model if isinstance(model, ModelSpec) else resolve(model)
    traced_routing = routing if routing is not None and parse_routing(routing).kind == "capacity" else None
    if routing is not None:
        with_routing(spec, routing)  # (a dense model: one line)
    if traced_routing is not None:
        spec = with_routing(spec, traced_routing)
    req = {k: v for k, v in sizes.items() if k not in ("B", "TP")}
    key = (spec.name, tuple(sorted(spec.defaults.items())), precision, sp, traced_routing)
    # TP = 2 when the model's plan accepts it (TP then free: every tp the layouts try); a model
    # whose heads or sharded sizes are odd is traced at TP = 1 (pinned: plan tries tp = 1 only)
    tsizes = {**req, "TP": 2 if tp is None else tp}
    layout = Layout(tp=True, sp=sp)
    tspec = layout.spec(spec)
    from symcost.frontends.tensor_parallel import rejects

    # (a V that TP = 2 does not divide is traced at TP = 2, V and TP pinned, as report --tp 2 traces it)
    if tp is None and tspec.probe_check and rejects(tspec.probe_check, {**spec.values(req), "B": 1, "TP": 2},
                                                    precision) is not None:
        tsizes["TP"] = 1
    vals = {**spec.values(req), "TP": tsizes["TP"]}
    for an in _TRACES.get(key, []):
        if all(vals.get(s, 0) % mo == r for s, (mo, r) in an.residues.items()) \
                and all(vals.get(s) == v for s, v in an.pinned.items() if s not in ("B",)):
            return an

    def fresh():
        return symcost.trace(tspec, sizes=tsizes, precision=precision)

    if isinstance(model, str) and use_cache:  # the disk cache: the entry `report --tp` uses (same trace)
        from symcost.graph.cache import cached_trace

        options = {**({"routing": traced_routing} if traced_routing is not None else {}), **layout.cache_options()}
        an = cached_trace(model, {}, None, precision, tsizes, fresh, options=options)
    else:
        an = fresh()
    _TRACES[key] = [*_TRACES.get(key, []), an]
    return an

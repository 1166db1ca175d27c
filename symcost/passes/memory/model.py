"""The memory model of a traced step: static memory by policy, activations, the folded live sets,
and the peak (see the package docstring, :mod:`symcost.passes.memory`, for the accounting).

Solving for the largest size under a cap is :class:`~symcost.passes.memory.solve.Solver`, which
:class:`MemoryModel` mixes in.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping

import sympy
from sympy.polys.domains import QQ, ZZ

from symcost._memo import per_object
from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS, parse_formula
from symcost.tracing.poly import Algebra, NotIntegral, terms_expr
from symcost.tracing.schedule import MemorySchedule
from symcost.passes.memory.live import Candidate, _pareto, _peval, _sign
from symcost.passes.memory.policies import Optimizer, Policy, optimizer, policy, resolve_impl
from symcost.passes.memory.solve import Solver


#: the events of a pass of a repeated unit with one-pass events (``ScheduleEvent.once``), by the
#: kind of pass: its first, its last, one between them (``mid``, ``second``), or the only one
_PASS_EVENTS = {"second": "mid"}


def _in_pass(once: str, kind: str) -> bool:
    """Whether an event (``once``: ``""``, ``"first"``, ``"last"``) happens in a pass of ``kind``."""
    return not once or kind == "single" or once == _PASS_EVENTS.get(kind, kind)


def memory_model(an, precision: str | None = None, optimizer_name: str = "adamw",
                 impl: str = "default", device: str = "cuda") -> "MemoryModel":
    """The :class:`MemoryModel` of a traced step (cached per analysis and options).

    Args:
        an: a :class:`~symcost.graph.analysis.Analysis`.
        precision: the policy (default: the precision ``an`` was traced with; another one
            changes the static bytes and the gradients, the activations stay the trace's).
        optimizer_name: one of :data:`OPTIMIZERS`.
        impl: how the optimizer step runs, one of :data:`IMPLS` (decides its temporaries);
            ``default`` is the engine's under a framework's policy (fused Adam under
            ``megatron-*`` and ``deepspeed-*`` on CUDA), else what ``torch.optim`` runs on
            ``device`` (:func:`default_impl`).
        device: the device the step runs on (only decides ``impl="default"``).

    Raises:
        SymcostError: unknown policy / optimizer / impl; a trace whose memory events differ
            between probes (then no formula exists).
    """
    pol = policy(precision or an.precision)
    opt = optimizer(optimizer_name)
    impl = resolve_impl(impl, device, pol.name, opt.name)
    # (kept in the analysis: a WeakKeyDictionary entry whose MemoryModel holds its key never died)
    return per_object(an, ("memory_model", pol.name, opt.name, impl), lambda: MemoryModel(an, pol, opt, impl))


class MemoryModel(Solver):
    """Training memory of a traced step under a precision policy and an optimizer.

    Attributes (sympy polynomials in the model's symbols, bytes):
        params: ``policy.param * P`` (P: all parameters, tied ones once).
        grads: ``policy.grad * P_train``, P_train = P − P_frozen: the parameters that require
            grad (a frozen one, ``requires_grad=False``, gets no gradient, and torch.optim keeps
            no state for a parameter whose ``grad`` is None; ``Analysis.params_frozen``).
        optimizer: the optimizer's state: ``full * policy.state * P_train`` plus, for Adafactor,
            ``policy.state * sum(rows + cols)`` over tensors of >= 2 dims and ``numel`` over
            vectors (the shapes of the trace), plus the step counters (:meth:`step_bytes`: 4 bytes
            per parameter tensor with a gradient for torch.optim; none under Megatron-LM's and
            DeepSpeed's fused Adam).
        master_weights: ``policy.master * P_train`` (Megatron-LM copies only the parameters
            that require grad: megatron/core/optimizer/optimizer.py).
        grad_buffer: the gradients when the policy keeps them in a persistent buffer
            (``Policy.grad_buffer``: Megatron-LM's ``main_grad``), static memory; else 0 (the
            backward allocates them: the schedule's gradient storages, scaled to the policy's
            bytes). With a buffer each gradient the backward allocates is a transient in the
            parameter's dtype, added into the buffer and freed (:meth:`grad_transient`).
        buffers: the model's buffers (their traced dtypes, shared storages once).
        inputs: the step's input tensors (e.g. token ids and labels, int64).
        activations: bytes autograd saves for backward (``Analysis.saved``, folded over L).
        activations_per_layer: those of one generic block (None without repeated blocks).
        kv_cache: an inference step's KV cache after the step (``Analysis.kv_bytes``; 0 for a
            training step), times ``kv_scale`` (a cache modelled in another dtype: its element
            size over the traced one, :func:`symcost.passes.inference.kv_dtype`; 1 by default).
            Where the step replaces the cache's tensors (a DynamicCache's concatenation) the
            schedule holds the new tensors' allocations and the old ones' frees
            (``ScheduleEvent.kv``, also times ``kv_scale``) and the live sets start from
            ``MemorySchedule.kv_start`` (the cache before the step minus after it), so that
            static + live set is what the allocator holds: the old and the new tensor of a
            layer together from the concatenation until the old one is freed.
        static: params + optimizer + master_weights + grad_buffer + buffers + inputs + kv_cache
            (live all step).
        candidates: the :class:`Candidate` live sets (bytes on top of ``static``) of a normal
            step; ``candidates_accum`` those of an accumulation micro-step (gradients live from
            the start, each new gradient a transient).
        schedule: the analysis' :class:`MemorySchedule` (all the pass reads besides the
            parameter shapes and saved tensors); ``alg`` the polynomial ring of its candidates.
        impl, device: the optimizer implementation assumed (``impl="default"`` resolved by
            :func:`default_impl` for ``device`` and the policy: the engine's fused Adam under
            ``megatron-*``/``deepspeed-*``).
    """

    def __init__(self, an, pol: Policy, opt: Optimizer, impl: str = "default", device: str = "cuda",
                 kv_scale: Fraction | int = 1):
        self.an, self.policy, self.opt = an, pol, opt
        self.impl, self.device = resolve_impl(impl, device, pol.name, opt.name), device
        self.gens = tuple(an.symbols)
        self._syms = [SYMS[s] for s in self.gens]
        self.schedule: MemorySchedule = an.schedule
        if self.schedule is None:
            raise SymcostError(f"{an.model}: this analysis has no memory schedule (trace it with symcost.trace)")
        self.has_L = "L" in self.gens
        P = an.params
        from symcost.frontends.layout import layout_of

        if getattr(an, "tensor_parallel", None) or layout_of(an).ep_replicate:
            # (and --ep under DDP / Megatron's distributed optimizer, docs/parallel.md §14.11: the
            # engine holds the dense parameters and the rank's E/EP experts whole)
            # the 2-D mesh: the data-parallel engine holds, shards and updates the TP-local
            # parameters (1/TP of each split weight, the replicated ones whole)
            from symcost.passes.memory.states import params_tp_local

            P = params_tp_local(an)
            P_frozen = params_tp_local(an, frozen=True)
        else:
            P_frozen = an.params_frozen
        self.P = P
        # the frozen parameters (requires_grad=False): held, with no gradient, optimizer state or
        # master copy (torch.optim skips a parameter whose grad is None); P_train the rest
        self.P_frozen = sympy.expand(P_frozen)
        self.P_train = sympy.expand(P - P_frozen)
        self.opt_share = None  # a data-parallel rank's optimizer updates shards (set by _rank_states)
        self.opt_local = False  # the schedule's parameter sizes are already the rank's (a --tp trace)
        self.host: dict[str, Any] = {}  # FSDP2's CPU offload: the model states on the host (_rank_states)
        self.params = sympy.expand(pol.param * P)
        self.grads = sympy.expand(pol.grad * self.P_train)
        self.master_weights = sympy.expand(pol.master * self.P_train)
        self.n_tensors = an.param_tensors_trained  # (those with a gradient: torch.optim's state)
        self.optimizer = self._optimizer_state()
        self.parallel = getattr(an, "parallel", None)
        if (self.parallel or "").startswith("tp") or self.parallel == "ep":
            # (expert parallelism: the experts' Shard(0) DTensors, placed and updated as TP's)
            self._tp_rank_states()
        elif self.parallel is not None:
            self._rank_states()
        # a persistent gradient buffer (Megatron-LM's main_grad) is static; else the backward allocates them
        self.grad_buffer = self.grads if pol.grad_buffer else sympy.Integer(0)
        self.buffers, self.inputs = self._buffers_inputs()
        # an inference step's KV cache after the step (0 for a training step): live all step
        self.kv_scale = Fraction(kv_scale)
        self.kv_cache = sympy.expand(sympy.Rational(self.kv_scale.numerator, self.kv_scale.denominator)
                                     * (getattr(an, "kv_bytes", 0) or 0))
        self.activations = sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
        per_layer = [nb for _, nb, _, rep in an.saved if rep != 1 and sympy.sympify(rep).has(SYMS["L"])]
        self.activations_per_layer = sympy.expand(sympy.Add(*per_layer)) if per_layer else None
        self.static = sympy.expand(self.params + self.optimizer + self.master_weights + self.grad_buffer
                                   + self.buffers + self.inputs + self.kv_cache)
        for domain in (ZZ, QQ):  # integer coefficients (fast) unless a size needs fractions
            self.alg = Algebra(self.gens, domain, inverses=tuple(getattr(self.schedule, "inverses", None) or ()))
            try:
                self._load_schedule()
                break
            except NotIntegral:
                continue

    # -- static ----------------------------------------------------------------------------------
    def _rank_states(self) -> None:
        """One rank's model states in a data-parallel trace: what the ``--shard`` strategy
        shards (:func:`symcost.passes.memory.states.model_state_bytes`, Rajbhandari et al. 2020 §5.1;
        FSDP/ZeRO-3: the traced DTensor shards), plus Adam's 4-byte step counters, one per
        parameter tensor on every rank. Gradients are scaled to this size where the schedule
        allocates them (:meth:`_load_schedule`)."""
        from symcost.passes.memory.states import SHARDED, model_state_bytes, optimizer_share, shard_degree
        from symcost.frontends.parallel import SHARDS

        if self.opt.factored:
            raise SymcostError(f"--optimizer {self.opt.name}: the per-rank state of a factored optimizer is not "
                               "modelled with --dp yet; use adamw, adam or sgd")
        an = self.an
        DP = shard_degree(an, SYMS["DP"] if "DP" in an.symbols else an.pinned.get("DP", 1))
        traced = SHARDS[self.parallel][0] == "fully_shard" and "params" in SHARDED[self.parallel]
        dp = SYMS["DP"] if "DP" in an.symbols else an.pinned.get("DP", 1)
        share = an.params_shard if traced else optimizer_share(an, dp)
        fshare = an.params_shard_frozen if traced else optimizer_share(an, dp, frozen=True)
        st = model_state_bytes(self.P, DP, self.parallel, self.policy.name, self.opt.name, share,
                               self.P_frozen, fshare)
        self.params, self.grads, self.master_weights = (sympy.expand(st[k]) for k in ("params", "grads", "master"))
        if self.parallel == "zero2":
            # the peak is the traced engine's (FSDP2 reshard_after_forward=False): at rest it holds
            # the parameters' shard; the whole parameters are the schedule's unsharded buffers,
            # live from the unit's forward all-gather to its post-backward reshard
            self.params = sympy.expand(self.policy.param * an.params_shard)
        self.optimizer = sympy.expand(st["optimizer_state"] + self.step_bytes())
        if "optimizer_state" in SHARDED[self.parallel]:
            # the optimizer steps the rank's shards: its temporaries are a shard's (1/DP of each tensor)
            self.opt_share = sympy.expand(share - fshare)
        from symcost.frontends.layout import layout_of

        if layout_of(an).offload:
            # FSDP2's CPU offload (docs/parallel.md §0.2): the sharded parameters, their gradients,
            # the optimizer state and its step live on the host; the schedule (the device's) holds
            # neither the gradient shards (copied to the host) nor the step's temporaries
            self.host = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                         "master_weights": self.master_weights}
            zero = sympy.Integer(0)
            self.params = self.grads = self.optimizer = self.master_weights = zero

    def _tp_rank_states(self) -> None:
        """One rank's model states in a tensor-parallel trace (``--tp``): the precision policy per
        element of the parameters the rank holds (``Analysis.params_shard``: the local shards of
        the column- and row-parallel weights plus what the plan replicates), as PyTorch's
        ``parallelize_module`` distributes them; gradients and Adam's moments are DTensors of the
        same placements, so each rank holds and updates its own shard (Shoeybi et al. 2019 §3),
        except the vocabulary-parallel embedding's gradient, which PyTorch keeps whole
        (:func:`symcost.passes.memory.states.grads_traced`: the traced gradients' elements);
        plus Adam's 4-byte step counters, one per parameter tensor. The optimizer's temporaries
        are those of the local shards (the schedule's parameter sizes are the local ones)."""
        if self.opt.factored:
            raise SymcostError(f"--optimizer {self.opt.name}: the per-rank state of a factored optimizer is not "
                               "modelled with --tp yet; use adamw, adam or sgd")
        shard, pol = self.an.params_shard, self.policy
        trained = sympy.expand(shard - self.an.params_shard_frozen)  # (requires_grad=False: no states)
        self.params = sympy.expand(pol.param * shard)
        # the gradients PyTorch keeps: the shards', but the vocabulary-parallel embedding's whole
        # [V, d] (a Replicate DTensor: states.grads_traced); a persistent gradient buffer
        # (Megatron-LM's main_grad) is the parameters' shards
        from symcost.passes.memory.states import grads_traced

        held = None if pol.grad_buffer or self.parallel == "ep" else grads_traced(self.an)
        self.grads = sympy.expand(pol.grad * (trained if held is None else held))
        self.master_weights = sympy.expand(pol.master * trained)
        self.optimizer = sympy.expand(self.opt.full * pol.state * trained + self.step_bytes())
        self.opt_share, self.opt_local = trained, True

    def _optimizer_state(self) -> sympy.Expr:
        an, pol, opt = self.an, self.policy, self.opt
        total = opt.full * pol.state * self.P_train
        if opt.factored:
            fac = []
            frozen = set(getattr(an, "frozen", ()) or ())
            for name, (shape, _, rep) in an.param_shapes.items():
                if name in frozen:
                    continue
                if len(shape) >= 2:
                    rows = sympy.Mul(*shape[:-1])
                    cols = sympy.Mul(*shape[:-2]) * shape[-1]
                    fac.append(rep * (rows + cols))
                else:
                    fac.append(rep * sympy.Mul(*shape))
            total += pol.state * sympy.Add(*fac)
        return sympy.expand(total + self.step_bytes())

    def step_bytes(self) -> sympy.Expr:
        """Bytes of the optimizer's step counters the rank keeps
        (:func:`symcost.passes.memory.states.step_counter_bytes`: 4 per parameter tensor with a
        gradient for torch.optim's Adam(W), one flat partition's under ``zero1``, none under
        Megatron-LM's and DeepSpeed's fused Adam)."""
        from symcost.passes.memory.states import step_counter_bytes

        return step_counter_bytes(self.an, self.opt.name, self.policy.name)

    def _buffers_inputs(self) -> tuple[sympy.Expr, sympy.Expr]:
        sched = self.schedule
        own = tuple(getattr(sched, "inverses", None) or ())
        return terms_expr(sched.gens, sched.buffers, own), terms_expr(sched.gens, sched.inputs, own)

    def bytes_per_param(self) -> int:
        """params + grads + full-size optimizer state + master weights, bytes per parameter
        (the "12" of 12P for bf16-mixed Adam). Adafactor's factored state and Adam's 4-byte step
        counters are not per parameter and are listed apart."""
        p = self.policy
        return p.param + p.grad + self.opt.full * p.state + p.master

    # -- polynomials -------------------------------------------------------------------------------
    def _poly(self, expr):
        """A sympy polynomial in the symbols as an element of the ring ``self.alg.R``."""
        return self.alg.from_expr(expr)

    def _expr(self, p) -> sympy.Expr:
        return self.alg.expr(p)

    # -- schedule ----------------------------------------------------------------------------------
    def _load_schedule(self) -> None:
        """The trace's :class:`MemorySchedule` as ring elements, gradients in the policy's bytes."""
        sched, alg = self.schedule, self.alg
        if sched.error:
            raise SymcostError(sched.error)
        if tuple(sched.gens) != self.gens:
            raise SymcostError(f"{self.an.model}: the memory schedule's symbols {sched.gens} are not the "
                               f"trace's {list(self.gens)}")
        # with a persistent gradient buffer (static memory) a gradient the backward allocates is a
        # transient in the parameter's dtype, added into the buffer and dropped (grad_transient)
        grad_ratio = Fraction(self.policy.param if self.policy.grad_buffer else self.policy.grad, sched.grad_itemsize)
        cache: dict = {}
        evpolys = []
        for e in sched.events:
            kv = getattr(e, "kv", False)
            key = (tuple(map(tuple, e.bytes)), e.grad, kv)
            p = cache.get(key)
            if p is None:
                p = alg.from_terms(e.bytes)
                if e.grad and grad_ratio != 1:
                    p = alg.scale(p, grad_ratio)
                if kv and self.kv_scale != 1:  # a KV-cache storage, in the modelled cache dtype
                    p = alg.scale(p, self.kv_scale)
                cache[key] = p
            evpolys.append(p)
        self._evpolys = evpolys
        # where the running total starts: the KV cache before the step minus after it (static)
        self._kv_start = alg.scale(alg.from_terms(getattr(sched, "kv_start", None) or []), self.kv_scale)
        self.grad_events = {k for k, e in enumerate(sched.events) if e.grad}
        self.units = [(range(u.start, u.stop), alg.from_expr(parse_formula(u.repeat)), u.min_L, u.label)
                      for u in sched.units]
        # the length symbol each unit's min_L counts (several stacks: their own symbols)
        self.unit_syms = [getattr(u, "sym", "L") or "L" for u in sched.units]
        self._poly(self.static)  # (in the same ring: raises NotIntegral here, not in solve)
        self.candidates = self._candidates(accumulate=False)
        self.candidates_accum = self._candidates(accumulate=True)

    def _label(self, k: int, unit_label: str) -> str:
        """``"<where>: <module> <op>"`` of event ``k``: where is the unit's label (``forward,
        block``, ``backward, first block``, ...) or, for a schedule not folded into blocks (one
        unit, ``step``), the event's phase (``forward``/``backward``): ``step`` alone would read
        as the optimizer step, which has its own label."""
        e = self.schedule.events[k]
        if unit_label == "step" and e.phase:
            unit_label = e.phase
        return f"{unit_label}: {e.module or '(top level)'} {e.op}"

    def _candidates(self, accumulate: bool) -> list[Candidate]:
        """Live sets at each allocation along the folded schedule (+ the optimizer step).

        Within one pass of a unit the live set after each allocation is a prefix sum of the
        events; its shift (x -> x + 1, for the dominance test) is the same prefix sum of the
        events' shifts, so both are accumulated together.
        """
        alg = self.alg
        R = alg.R
        base = self._poly(self.grads) if accumulate and not self.policy.grad_buffer else R.zero
        base = base + self._kv_start
        out: list[Candidate] = []
        shifted = {}

        def sh(k):
            s = shifted.get(k)
            if s is None:
                s = shifted[k] = alg.shift(self._evpolys[k])
            return s

        for ui, (ids, rep, min_L, ulabel) in enumerate(self.units):
            once = self._once(ids, rep)
            deltas = {}
            offsets = []  # (offset before the pass, valid for L >=, pass kind)
            for kind in (("first", "single", "last", "mid") if once else ("first",)):
                # prefix sums within one pass of the unit; only allocations can raise the maximum
                local: list[Candidate] = []
                pre, pre_s = R.zero, R.zero
                for k in ids:
                    if not _in_pass(once.get(k, ""), kind):
                        continue
                    p = self._evpolys[k]
                    if self.grad_transient(accumulate) and k in self.grad_events:
                        # a new gradient, added in place (or into the gradient buffer), then freed
                        local.append(Candidate(pre + p, pre_s + sh(k), 1, str(k)))
                        continue
                    pre, pre_s = pre + p, pre_s + sh(k)
                    if self.schedule.events[k].alloc == k:
                        local.append(Candidate(pre, pre_s, 1, str(k)))
                deltas[kind] = (pre, _pareto(local))
            delta, locs = deltas["first" if not once else "mid"]
            if rep == 1:
                offsets = [(base, 1, "first")]
            elif not once:
                s = _sign(alg, delta)
                if s >= 0:  # the last pass can be the highest: base + (rep - 1)·delta
                    offsets.append((base + (rep - 1) * delta, min_L, "last"))
                if s <= 0:  # the first pass can be the highest
                    offsets.append((base, min_L, "first"))
            else:
                # a free of a storage allocated before the unit happens in its first or its last
                # pass only (MemorySchedule.events' once): the passes differ (rep = L - min_L + 1)
                o_first = deltas["first"][0] - delta
                lasts = any(v == "last" for v in once.values())
                firsts = any(v == "first" for v in once.values())
                offsets = [(base, min_L, "single"),  # one pass (below the first pass's live sets otherwise)
                           (base, min_L + lasts, "first"),
                           (base + o_first + (rep - 1) * delta, min_L + firsts, "last")]
                s = _sign(alg, delta)
                if s >= 0:
                    offsets.append((base + o_first + (rep - 2) * delta, min_L + 2, "mid"))
                if s <= 0:
                    offsets.append((base + o_first + delta, min_L + 2, "second"))
            for off, mL, kind in offsets:
                off_s = alg.shift(off)
                for c in deltas[_PASS_EVENTS.get(kind, kind)][1] if once else locs:
                    out.append(Candidate(off + c.poly, off_s + c.shifted, mL, self._label(int(c.label), ulabel),
                                         (ui, int(c.label), kind), self.unit_syms[ui]))
            base = base + self._unit_total(rep, deltas["single"][0] if once else delta, delta)
        # optimizer step: gradients (and whatever else is live) plus its temporaries
        base_s = alg.shift(base)
        for t, what in self._optimizer_transients():
            out.append(Candidate(base + t, base_s + alg.shift(t), 1, f"optimizer step ({what})", ("optimizer", t)))
        if not out:
            out.append(Candidate(R.zero, R.zero, 1, "step"))
        self.end_live = base
        return _pareto(out)

    def grad_transient(self, accumulate: bool) -> bool:
        """Whether a gradient the backward allocates is a transient, added where the gradients
        live and freed at once, rather than kept to the end of the step: in an accumulation
        micro-step (``AccumulateGrad`` adds it to the gradient in place) and under a policy with
        a persistent gradient buffer (Megatron-LM's DDP hook: ``param.main_grad.add_(param.grad);
        param.grad = None``)."""
        return accumulate or self.policy.grad_buffer

    def _once(self, ids: range, rep) -> dict[int, str]:
        """The events of a repeated unit that happen in one of its passes only
        (``ScheduleEvent.once``: ``"first"`` or ``"last"``); empty for a unit run once."""
        if rep == 1:
            return {}
        ev = self.schedule.events
        return {k: ev[k].once for k in ids if ev[k].once}

    @staticmethod
    def _unit_total(rep, single, mid):
        """Bytes a unit leaves allocated over its ``rep`` passes: every pass's events ``mid``
        ``rep`` times, plus the events of one pass only (``single - mid``)."""
        return rep * mid + (single - mid)

    def _param_numels(self) -> list[tuple[Any, Any]]:
        """(elements, Adafactor's rows + columns) of the parameter tensors in the optimizer's
        order (that of the L = 2 trace, which has every kind of neighbour), ring elements."""
        out = [(self.alg.from_terms(a), self.alg.from_terms(b)) for a, b in self.schedule.params]
        if self.opt_share is not None and not self.opt_local:  # each tensor's shard on this rank (1/DP of it)
            inv = self.alg.x[-1]
            out = [(a * inv, b * inv) for a, b in out]
        return out

    def _optimizer_transients(self) -> list[tuple[Any, str]]:
        """Temporaries of one optimizer step (bytes), modelled on torch.optim 2.x's code.

        Adam/AdamW: foreach ``exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)`` (a state-sized copy
        of every tensor); for-loop ``denom = (exp_avg_sq.sqrt() / bc).add_(eps)`` (two
        temporaries of the tensor while the previous tensor's ``denom`` is still referenced).
        Adafactor: foreach ``var_estimates`` of every tensor; for-loop ``var_estimate`` (row_var @
        col_var, plus row and column means; ``grad * grad`` and a clone for vectors) while the
        previous tensor's is still referenced. SGD updates in place; fused kernels keep none
        (torch's ``fused=True``; Transformer Engine's, Apex's and DeepSpeed's ``FusedAdam``, which
        the ``megatron-*`` and ``deepspeed-*`` policies run by default, :func:`engine_impl`: one
        ``multi_tensor_applier(multi_tensor_adam, ...)`` over chunks of the group's tensors, updated
        in place), except Transformer Engine's with moments below fp32 (``megatron-bf16-moments``:
        ``get_unscaled_state`` makes an fp32 copy of every moment of the parameter group, kept until
        the step has cast them all back, one bf16 cast at a time; transformer_engine/pytorch/
        optimizers/fused_adam.py ``step``, ``_apply_scale``): 4 bytes × the moments × the elements
        the rank updates, plus the state's bytes of one tensor. A policy whose optimizer steps an fp32 copy of the gradients (``Policy.grad_copy``:
        Megatron-LM fp16, DeepSpeed's ZeRO) adds that copy of every tensor the rank updates to
        each of them (alone where the update keeps no temporaries).
        """
        if self.host:  # FSDP2's CPU offload: the step runs on the host
            return []
        share = self._poly(self.P_train if self.opt_share is None else self.opt_share)
        update = self._update_transients(share)
        if not self.policy.grad_copy:
            return update
        copy = share * self.policy.grad_copy
        return [(t + copy, what + ", with the fp32 gradient copy") for t, what in update] or [(copy, "fp32 gradient copy")]

    def _update_transients(self, share) -> list[tuple[Any, str]]:
        """:meth:`_optimizer_transients` of the update itself (``share``: the elements the rank
        updates, a ring element)."""
        opt, st, impl, alg = self.opt, self.policy.state, self.impl, self.alg
        if impl == "fused" and opt.full and st < 4 and self.policy.name.startswith("megatron-"):
            # Transformer Engine's FusedAdam with 16-bit moments: fp32 copies of the moments of the
            # whole group (Megatron-LM steps the 1-D parameters, which take no weight decay, as a
            # group of their own: counted with the others here, a few bytes per 1-D element over)
            copies = share * (4 * opt.full)
            out = [Candidate(copies + numel * st, alg.shift(copies + numel * st), 1,
                             "fused Adam's fp32 copies of the 16-bit moments")
                   for numel, _ in self._param_numels()]
            return [(c.poly, c.label) for c in _pareto(out)]
        if impl == "fused" or opt.name in ("sgd", "sgd-nomomentum"):
            return []
        if impl == "foreach":
            return [(share * st, "foreach temporaries of all tensors")]
        out = []
        prev = alg.R.zero
        for numel, fac in self._param_numels():
            if opt.name == "adafactor":
                cur = numel + fac if fac else numel * 2
            else:
                cur = numel * 2
            q = (prev + cur) * st
            out.append(Candidate(q, alg.shift(q), 1, "for-loop temporaries"))
            prev = cur if opt.name == "adafactor" else numel
        return [(c.poly, c.label) for c in _pareto(out)]

    # -- evaluation ------------------------------------------------------------------------------------
    def _values(self, env: Mapping) -> tuple:
        return self.alg.values(tuple(int(env[s]) for s in self._syms)) if self._syms else (1,)

    def _env(self, sizes: Mapping[str, int]) -> dict:
        return self.an.bind(**dict(sizes))

    def full_values(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """Every value a check of the model needs, by name: the model's defaults, ``sizes`` over
        them, the pinned symbols (B = 1, S = 1) and the tied ones (K = H). No check raises."""
        an = self.an
        vals = {**an.spec.defaults, **dict(getattr(an, "pinned", {}) or {}), **{k: int(v) for k, v in sizes.items()}}
        vals.update({a: vals[b] for a, b in an.spec.tied.items() if b in vals})
        return vals

    def _cands(self, L: int | Mapping | None, accumulate: bool) -> list[Candidate]:
        """The live sets valid at ``L`` (an int: the blocks of L; a mapping, sympy symbol ->
        value: every stack's symbol, where several stacks fold; None: all).

        Raises:
            SymcostError: fewer blocks than the schedule's fold holds for."""
        lens = self._lengths(L)
        for sym, v in lens.items():
            least = min((u[2] for u, s in zip(self.units, self.unit_syms) if s == sym), default=1)
            if v < least:
                raise SymcostError(f"{self.an.model}: this trace's storage schedule holds for {sym} >= {least} "
                                   f"(its first and last blocks differ from the others); trace at {sym} = {v} "
                                   f"for the peak there (symcost.trace(..., sizes={{'{sym}': {v}}}) or --set {sym}={v})")
        cs = self.candidates_accum + self.candidates if accumulate else self.candidates
        return [c for c in cs if self._valid(c, lens)]

    def _lengths(self, L: int | Mapping | None) -> dict[str, int]:
        """Length symbol -> value, from ``_cands``' argument (symbols the schedule's units count only)."""
        if L is None:
            return {}
        if not isinstance(L, Mapping):
            return {"L": int(L)}
        out = {}
        for sym in set(self.unit_syms):
            v = L.get(SYMS[sym]) if sym in SYMS else None
            if v is None:
                v = L.get(sym)
            if v is not None:
                out[sym] = int(v)
        return out

    @staticmethod
    def _valid(c: Candidate, lens: Mapping[str, int]) -> bool:
        """Whether live set ``c`` exists at the stack lengths ``lens`` (a symbol absent: yes)."""
        v = lens.get(c.sym)
        return v is None or c.min_L <= v

    def peak(self, accumulate: bool = False, **sizes: int) -> int:
        """Peak bytes of a steady-state step at ``sizes`` (others at the model's defaults).

        ``accumulate=True``: a gradient-accumulation micro-step (gradients live from the start).

        Raises:
            SymcostError: bad sizes (see ``Analysis.bind``).
        """
        env = self._env(sizes)
        vals = self._values(env)
        dyn = max(_peval(c.poly, vals) for c in self._cands(env, accumulate))
        return int(sympy.sympify(self.static).xreplace(env)) + int(dyn)

    def peak_where(self, **sizes: int) -> str:
        """Where in the schedule the peak is reached at ``sizes`` (a label)."""
        env = self._env(sizes)
        vals = self._values(env)
        return max(self._cands(env, False), key=lambda c: _peval(c.poly, vals)).label

    #: the parts of a live set (:meth:`peak_parts`), in the order a table shows them
    LIVE_PARTS = ("gradients", "forward", "backward", "optimizer_step")

    def static_parts(self) -> tuple[str, ...]:
        """The static parts :meth:`peak_parts` lists: ``params``, ``optimizer``,
        ``master_weights``, ``grad_buffer`` (only with a policy that keeps a persistent gradient
        buffer), ``buffers``, ``inputs``."""
        return ("params", "optimizer", "master_weights") + (("grad_buffer",) if self.policy.grad_buffer else ()) \
            + ("buffers", "inputs")

    def peak_parts(self, accumulate: bool = False, **sizes: int) -> dict[str, Any]:
        """What the peak at ``sizes`` is made of, in bytes, adding up to :meth:`peak` exactly.

        The static parts (live all step: ``params``, ``optimizer``, ``master_weights``,
        ``grad_buffer`` where the policy keeps one, ``buffers``, ``inputs``), then the live set
        where the peak is reached, split by the storages in it: ``gradients`` (gradient buffers
        allocated so far: all of them at the optimizer step, the blocks done so far in the
        backward; all of them from the start in an accumulation micro-step; none with a
        persistent ``grad_buffer``), ``forward`` (storages the forward allocated that are still
        live: the activations saved for backward that the backward has not yet freed, and at a
        forward peak the forward's own outputs), ``backward`` (other storages the backward
        allocated: activation gradients and temporaries), ``optimizer_step`` (the optimizer's
        temporaries, :meth:`_optimizer_transients`). Each storage goes to the part of the op that
        allocated it (the schedule's events, ``MemorySchedule.events``); the walk replays the
        fold of :meth:`_candidates` up to the winning live set. Also ``peak`` (the sum) and
        ``where`` (its label).

        Raises:
            SymcostError: bad sizes (see ``Analysis.bind``).
        """
        env = self._env(sizes)
        vals = self._values(env)
        L = env.get(SYMS["L"])
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        exact = {k: sympy.sympify(getattr(self, k)).xreplace(env) for k in self.static_parts()}
        out: dict[str, Any] = {k: int(v) for k, v in exact.items()}
        live = dict.fromkeys(self.LIVE_PARTS, 0)
        win = max(self._cands(env, accumulate), key=lambda c: _peval(c.poly, vals))
        events = self.schedule.events
        size = [_peval(p, vals) for p in self._evpolys]

        def part(k):
            a = events[events[k].alloc]
            return "gradients" if a.grad else ("forward" if a.phase == "forward" else "backward")

        if accumulate and not self.policy.grad_buffer:
            live["gradients"] += ev(self.grads)
        live["forward"] += int(_peval(self._kv_start, vals))  # (an inference step's cache: see _candidates)
        origin = win.origin
        in_unit = origin is not None and origin[0] != "optimizer"
        stop = origin[0] if in_unit else len(self.units)  # units before it are passed in full
        for ui, (ids, rep, _min_L, _label) in enumerate(self.units[:stop + 1]):
            n = _peval(rep, vals)
            once = self._once(ids, rep)
            kinds = ("single", "mid", "first", "last") if once else ("mid",)
            win_kind = origin[2] if ui == stop else None
            delta = {kind: dict.fromkeys(self.LIVE_PARTS, 0) for kind in kinds}
            prefix = None
            for k in ids:
                for kind in kinds:
                    if not _in_pass(once.get(k, ""), kind):
                        continue
                    d = delta[kind]
                    mine = win_kind is not None and _PASS_EVENTS.get(win_kind, win_kind) == kind if once else True
                    if self.grad_transient(accumulate) and k in self.grad_events:
                        if ui == stop and k == origin[1] and mine:  # a new gradient, added in place: the peak
                            prefix = dict(d)
                            prefix["gradients"] += size[k]
                        continue
                    d[part(k)] += size[k]
                    if ui == stop and k == origin[1] and mine:
                        prefix = dict(d)
            mid = delta["mid"]
            one = delta["single"] if once else mid  # the events of one pass only: one - mid
            if ui < stop:
                for key in self.LIVE_PARTS:
                    live[key] += n * mid[key] + one[key] - mid[key]
            else:  # the winning pass: the passes before it, then its prefix
                o_first = {key: delta["first"][key] - mid[key] for key in self.LIVE_PARTS} if once else None
                for key in self.LIVE_PARTS:
                    before = {"first": 0, "single": 0,
                              "last": (n - 1) * mid[key] + (o_first[key] if once else 0),
                              "mid": (n - 2) * mid[key] + (o_first[key] if once else 0),
                              "second": mid[key] + (o_first[key] if once else 0)}[win_kind]
                    live[key] += before + prefix[key]
        if origin is not None and origin[0] == "optimizer":
            live["optimizer_step"] += int(_peval(origin[1], vals))
        # (a data-parallel trace at a DP that does not divide the sharded dimensions: the
        # unpadded formulas give fractions of a byte, each part rounded down, as the peak is)
        integral = all(int(v) == v for v in (*live.values(), *exact.values()))
        out.update({k: int(v) for k, v in live.items()})
        out["peak"] = sum(out[k] for k in (*self.static_parts(), *self.LIVE_PARTS))
        out["where"] = win.label
        if not integral:
            out["peak"] = self.peak(accumulate, **sizes)
        elif origin is not None and out["peak"] != self.peak(accumulate, **sizes):  # pragma: no cover - a bug
            raise SymcostError(f"{self.an.model}: the parts of the peak do not add up at {dict(sizes)}")
        return out

    def step_floor(self, **sizes: int) -> int:
        """Bytes no activation checkpointing plan goes below at ``sizes``: static memory plus the
        live set of the optimizer step (what is live when the backward ends: the gradients and
        any storage the step leaves; plus the optimizer's largest temporaries,
        :meth:`_optimizer_transients`). Checkpointing changes what the forward keeps for the
        backward, not these.

        Raises:
            SymcostError: bad sizes (see ``Analysis.bind``).
        """
        env = self._env(sizes)
        vals = self._values(env)
        end = _peval(self._kv_start, vals)
        kept = lambda k: not (self.policy.grad_buffer and k in self.grad_events)  # noqa: E731 (a transient)
        for ids, rep, _m, _l in self.units:
            once = self._once(ids, rep)
            mid = sum(_peval(self._evpolys[k], vals) for k in ids if k not in once and kept(k))
            end += self._unit_total(_peval(rep, vals), sum(_peval(self._evpolys[k], vals) for k in ids if kept(k)), mid)
        return int(sympy.sympify(self.static).xreplace(env)) + int(end) + self.optimizer_step_transient(**sizes)

    def optimizer_step_transient(self, **sizes: int) -> int:
        """Bytes of the optimizer step's largest temporaries at ``sizes`` (on top of what is live
        when the backward ends: :meth:`_optimizer_transients`, by the implementation
        ``self.impl``: a state-sized copy of every tensor for foreach Adam, none for a fused one).

        Raises:
            SymcostError: bad sizes (see ``Analysis.bind``).
        """
        vals = self._values(self._env(sizes))
        return int(max((_peval(t, vals) for t, _ in self._optimizer_transients()), default=0))

    def peak_terms(self, accumulate: bool = False) -> list[tuple[sympy.Expr, int, str]]:
        """The live sets that can be the largest at some sizes: ``(bytes on top of static,
        valid for L >= min_L, where in the step)``; the peak is static + the largest valid one."""
        return [(self._expr(c.poly), c.min_L, c.label) for c in _pareto(self._cands(None, accumulate))]

    def peak_expr(self, accumulate: bool = False) -> sympy.Expr:
        """The peak as a formula: static + the live set's polynomial, or ``Max`` of those that
        can win at some sizes; ``Piecewise`` on L where some need two blocks."""
        cs = self._cands(None, accumulate)

        def mx(cands):
            exprs = [self._expr(c.poly) for c in _pareto(cands)]
            inner = exprs[0] if len(exprs) == 1 else sympy.Max(*exprs, evaluate=False)
            return sympy.Add(self.static, inner, evaluate=False) if self.static != 0 else inner

        if self.has_L and any(c.min_L > 1 for c in cs) and set(self.unit_syms) <= {"L"}:
            # a candidate of a repeated block needs min_L blocks (2; n + 2 after n leading blocks)
            cuts = sorted({c.min_L for c in cs if c.min_L > 1}, reverse=True)
            pieces = [(mx([c for c in cs if c.min_L <= m]), SYMS["L"] >= m) for m in cuts]
            return sympy.Piecewise(*pieces, (mx([c for c in cs if c.min_L <= 1]), True))
        syms = sorted({c.sym for c in cs if c.min_L > 1})
        if syms:
            # several stacks: a candidate of a repeated block of a stack needs min_L blocks there;
            # one piece per combination of the stacks' cuts
            import itertools

            cuts = [sorted({c.min_L for c in cs if c.sym == s} | {1}, reverse=True) for s in syms]
            pieces = []
            for combo in itertools.product(*cuts):  # (most blocks first: the first true piece holds)
                if all(m == 1 for m in combo):
                    continue
                lens = dict(zip(syms, combo))
                pieces.append((mx([c for c in cs if self._valid(c, lens)]),
                               sympy.And(*[SYMS[s] >= m for s, m in lens.items() if m > 1])))
            return sympy.Piecewise(*pieces, (mx([c for c in cs if c.min_L <= 1]), True))
        return mx(cs)

    def components(self, **sizes: int) -> dict[str, int]:
        """Every component in bytes at ``sizes`` (JSON names: params, grads, optimizer,
        master_weights, grad_buffer, buffers, inputs, activations, kv_cache, peak)."""
        env = self._env(sizes)
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        out = {k: ev(getattr(self, k)) for k in
               ("params", "grads", "optimizer", "master_weights", "grad_buffer", "buffers", "inputs", "activations",
                "kv_cache")}
        if self.activations_per_layer is not None:
            out["activations_per_layer"] = ev(self.activations_per_layer)
        out["peak"] = self.peak(**sizes)
        return out


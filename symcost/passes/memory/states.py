"""Model states per data-parallel rank: which states each strategy shards over the DP ranks and
their bytes (Rajbhandari et al. 2020, "ZeRO", section 5.1 and Table 1; docs/parallel.md), the
shard degree under HSDP, and the TP-local parameters the data-parallel engine wraps on the 2-D
mesh. The memory model (:mod:`symcost.passes.memory.model`) and the data-parallel pass
(:mod:`symcost.passes.parallel`, which re-exports these names) both read them; this module imports
neither."""
from __future__ import annotations

from typing import Any

import sympy

from symcost.errors import SymcostError
from symcost.frontends.layout import layout_of
from symcost.frontends.parallel import SHARDS, check_shard
from symcost.passes.memory.policies import OPTIMIZERS, check_layout, policy as get_policy
from symcost.tracing.fit import SYMS


#: which model states each strategy shards over the DP ranks
SHARDED: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "zero1": ("optimizer_state", "master"),
    "zero2": ("grads", "optimizer_state", "master"),
    "zero3": ("params", "grads", "optimizer_state", "master"),
    "fsdp": ("params", "grads", "optimizer_state", "master"),
}


def shard_degree(an, dp, ep=None):
    """The ranks a data-parallel trace's states are sharded over at data-parallel size ``dp``
    (an int or the symbol DP): ``dp``, and under HSDP (``Layout.replicate`` R) the ``dp_shard``
    group's DP/R; with context parallelism, FSDP2's ``dp_shard × cp`` ranks, DP·CP (CP pinned);
    with expert parallelism (``Layout.ep_fsdp``) DP·EP, ``ep`` the EP size (an int; None: the
    symbol EP, or its pinned value): the dense parameters over dp_shard × ep, each rank's E/EP
    experts over DP, P/(DP·EP) elements per rank in all (docs/parallel.md §14.6)."""
    lay = layout_of(an)
    if lay.ep_fsdp:
        if ep is None:
            ep = SYMS["EP"] if "EP" in an.symbols else an.pinned.get("EP", 1)
        return dp * ep
    if lay.cp and lay.shard is not None:
        cp = an.pinned.get("CP", 1)
        return int(dp) * cp if isinstance(dp, (int, sympy.Integer)) else dp * cp
    r = lay.replicate
    if not r:
        return dp
    if isinstance(dp, (int, sympy.Integer)):
        return int(dp) // r
    return dp / r


def model_state_bytes(P, DP, shard: str, precision: str = "bf16-true-fp32-master",
                      optimizer: str = "adamw", P_shard=None, frozen=0, frozen_shard=None) -> dict[str, Any]:
    """Bytes of model states one rank holds: ``params``, ``grads``, ``optimizer_state``,
    ``master`` and ``total``.

    Args:
        P: parameter count (an int or a formula).
        DP: data-parallel size (an int or the symbol DP).
        shard: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``fsdp``.
        precision: a precision policy (bytes per element of weights, gradients, optimizer
            state and master weights).
        optimizer: a ``torch.optim``-style optimizer with full-shape state (Adam(W): 2 moments,
            SGD with momentum: 1); the 4-byte step counters are left out.
        P_shard: elements of a sharded tensor set on one rank (default P/DP; the traced FSDP2
            shards for ``fsdp``/``zero3``).
        frozen: the elements of P with ``requires_grad=False`` (``Analysis.params_frozen``; an
            int or a formula, 0 by default), and ``frozen_shard`` those of ``P_shard`` (default
            frozen/DP). A frozen parameter is held (``params``, sharded as the others) but has
            no gradient, optimizer state or master copy: torch.optim skips a parameter whose
            ``grad`` is None (``_init_group``), DDP and FSDP2 reduce only parameters that
            require grad, Megatron-LM builds its gradient buffers, parameter groups and main
            parameters from ``requires_grad`` parameters only (megatron/core/distributed/
            distributed_data_parallel.py, optimizer/__init__.py ``_get_param_groups``,
            optimizer/optimizer.py), and DeepSpeed's ZeRO partitions the trainable ones. So
            ``grads``, ``optimizer_state`` and ``master`` count P − frozen (P_shard −
            frozen_shard where sharded): a separate term, the formulas stay symbolic.

    Returns:
        The four components and their ``total`` (ints or formulas in bytes): what the rank
        keeps from step to step. Formula: Rajbhandari et al. 2020, section 5.1 and Table 1
        (module docstring). A policy whose optimizer makes an fp32 copy of the gradients at its
        step (``Policy.grad_copy``: Megatron-LM fp16, DeepSpeed's ZeRO) adds ``step_grad_copy``,
        that copy's bytes (sharded as the optimizer state), outside ``total``: it exists during
        the step only, where the rank's peak counts it; Megatron-LM's table of bytes per
        parameter counts it, the ZeRO paper's K = 12 does not, DeepSpeed's estimators do (18).

    Raises:
        SymcostError: an unknown strategy, policy or optimizer, Adafactor (its factored
            state is per tensor shape, not per parameter; not modelled per rank yet), or a
            policy its framework does not run under ``shard`` (:func:`~symcost.passes.memory.
            policies.check_layout`).
    """
    check_shard(shard)
    pol = get_policy(precision)
    check_layout(pol.name, DP, shard)
    if optimizer not in OPTIMIZERS:
        raise SymcostError(f"unknown optimizer {optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
    opt = OPTIMIZERS[optimizer]
    if opt.factored:
        raise SymcostError(f"--optimizer {optimizer}: the per-rank state of a factored optimizer is not "
                           "modelled with --dp yet; use adamw, adam or sgd")
    per = {"params": pol.param, "grads": pol.grad, "optimizer_state": pol.state * opt.full,
           "master": pol.master}
    share = P_shard if P_shard is not None else sympy.sympify(P) / DP
    fshare = frozen_shard if frozen_shard is not None else sympy.sympify(frozen) / DP
    whole = {"params": (share, P)}  # (what each state is over: sharded, whole)
    trained = (share - fshare, P - frozen)
    out = {k: b * whole.get(k, trained)[0 if k in SHARDED[shard] else 1] for k, b in per.items()}
    out["total"] = sum(out.values())
    if pol.grad_copy:
        out["step_grad_copy"] = pol.grad_copy * trained[0 if "optimizer_state" in SHARDED[shard] else 1]
    return out


def step_counter_bytes(an, optimizer: str, precision: str | None = None) -> sympy.Expr:
    """Bytes of the optimizer's step counters on one rank, as each framework keeps them.

    torch.optim's Adam and AdamW (and Adafactor) keep a 0-d fp32 ``step`` tensor per parameter
    tensor they update (torch/optim/adam.py ``_init_group``): a plain tensor beside the DTensor
    moments of an FSDP2 or tensor-parallel parameter, so every rank of one device, ``ddp``,
    ``fsdp``, ``zero2`` (FSDP2), ``zero3``, ``--tp``, ``--ep`` and a pipeline stage holds one per
    parameter tensor with a gradient (``Analysis.param_tensors_trained``: torch.optim makes no
    state for a parameter whose ``grad`` is None), unsharded (checked on a fake process group:
    ``opt.state[p]["step"]`` is a ``Tensor`` of shape ``()``). torch.optim keeps them on the CPU
    unless ``capturable`` or ``fused`` (``torch.zeros((), device=p.device)`` then, else
    ``torch.tensor(0.0, device="cpu")``); symcost counts them wherever they live (a few KiB; the
    trace does not see those flags), as ``opt.state``'s bytes hold them.

    ``zero1`` (DeepSpeed's ZeRO-1, docs/parallel.md): the wrapped optimizer steps one flat fp32
    partition per parameter group (deepspeed/runtime/zero/stage_1_and_2.py: ``param_group['params']
    = [self.single_partition_of_fp32_groups[i]]``), so a torch.optim AdamW keeps one ``step``
    tensor: 4 bytes (one group). (Under expert parallelism, ``--ep --dp --shard zero1``, the
    distributed optimizer is Megatron-LM's, whose torch.optim fallback steps each parameter's
    range of the shard: counted per parameter tensor, an upper bound.) ``zero2`` stays one per
    parameter tensor: DeepSpeed's ZeRO-2 is the same optimizer as its ZeRO-1 (deepspeed/runtime/
    engine.py: ``DeepSpeedZeroOptimizer(..., partition_grads=zero_stage == ZeroStageEnum.gradients)``;
    stage_1_and_2.py sets the flat partition as every group's params whatever ``partition_grads``,
    deepspeedai/DeepSpeed at edaa722), but symcost's ``zero2`` runs FSDP2
    (``reshard_after_forward=False``), whose AdamW keeps a ``step`` per DTensor parameter, and its
    peak is that engine's (MemTracker's, to the byte: tests/test_parallel_memory.py
    ``test_mlp_rank_peak_matches_memtracker[zero2]``; one counter there was 12 B under it on mlp at L = 2).

    0 under a ``megatron-*`` or ``deepspeed-*`` policy (``precision``): Transformer Engine's and
    Apex's ``FusedAdam``, which Megatron-LM runs, keep one ``group["step"]`` per parameter group, a
    Python int (transformer_engine/pytorch/optimizers/fused_adam.py ``step``;
    megatron/core/optimizer/distrib_optimizer.py ``state_dict`` reads it), and DeepSpeed's
    ``FusedAdam`` a Python int ``state['step']`` per flat partition (deepspeed/ops/adam/
    fused_adam.py). SGD keeps none. Bytes, a polynomial in the symbols."""
    from symcost.passes.memory.policies import OPTIMIZERS, STEP_BYTES

    opt = OPTIMIZERS.get(optimizer)
    if opt is None or not opt.step or str(precision or "").startswith(("megatron-", "deepspeed-")):
        return sympy.Integer(0)
    if getattr(an, "parallel", None) == "zero1" and not layout_of(an).ep_replicate:
        return sympy.Integer(STEP_BYTES)  # (one flat partition, one parameter group)
    return sympy.expand(STEP_BYTES * an.param_tensors_trained)


def optimizer_share(an, dp, ep=None, frozen: bool = False):
    """Parameter elements of one rank's ZeRO-1/2 shard (the optimizer state and master weights
    it keeps) for a trace whose engine does not shard the parameters (``ddp``, ``zero1``; the
    memory policies of ``zero2``), at data-parallel size ``dp`` (an int or the symbol DP): the
    engine's parameters over :func:`shard_degree`'s ranks, and under expert parallelism with a
    replicating engine (``Layout.ep_replicate``, docs/parallel.md §14.11) the whole model's
    parameters (``Analysis.params``) over DP·EP: Megatron-Core's distributed optimizer shards the
    dense buffers over its data-parallel group (DP·EP ranks here) and the experts' over the
    expert-data-parallel group (DP), P_dense/(DP·EP) + (P_experts/EP)/DP = P/(DP·EP)
    (megatron/core/optimizer/distrib_optimizer.py ``_build_gbuf_range_map``: each buffer's range
    split over its own group). ``frozen``: the share's frozen elements only (``requires_grad=False``,
    :func:`model_state_bytes`' ``frozen_shard``)."""
    deg = shard_degree(an, dp, ep)
    if layout_of(an).ep_replicate:
        return sympy.sympify(an.params_frozen if frozen else an.params) / deg
    return sympy.sympify(params_tp_local(an, frozen)) / deg


def params_tp_local(an, frozen: bool = False) -> sympy.Expr:
    """Parameter elements of one tensor-parallel rank on the 2-D mesh (``--dp`` with ``--tp``):
    what the data-parallel engine wraps, before it shards (``Analysis.params_shard`` times DP for
    FSDP2, whose shards split the TP-local rows; ``params_shard`` itself for ``replicate``);
    ``params_shard`` for a tensor-parallel trace and an expert-parallel one without data
    parallelism (``--ep``, a pipeline stage's too: the dense parameters and E/EP experts) and
    one under a replicating engine (``--ep --dp --shard ddp|zero1``, docs/parallel.md §14.11),
    ``params`` otherwise. ``frozen``: those of the frozen parameters only (``requires_grad=False``:
    ``Analysis.params_frozen``, ``params_shard_frozen``)."""
    whole, held = (an.params_frozen, an.params_shard_frozen) if frozen else (an.params, an.params_shard)
    if not getattr(an, "tensor_parallel", None):
        label = getattr(an, "parallel", None) or ""
        # (and under a replicating engine with expert parallelism, §14.11: the dense parameters and
        # the rank's E/EP experts, which DDP and Megatron's engine hold whole)
        return (held if (label.startswith("tp") or label == "ep" or layout_of(an).ep_replicate)
                else whole)
    if SHARDS[an.parallel][0] != "fully_shard":
        return held
    DP = SYMS["DP"] if "DP" in an.symbols else an.pinned.get("DP", 1)
    return sympy.expand(held * DP)


def grads_traced(an) -> sympy.Expr | None:
    """Gradient elements one rank holds at the end of its traced step, as PyTorch allocated
    them: the storages the backward allocates that are still live when the step ends
    (``MemorySchedule.events`` with ``grad``), each unit's times its repeat, over the schedule's
    gradient itemsize (``grad_itemsize``: one gradient dtype assumed, as the memory model's
    peak scales them). A polynomial in the symbols (and ``TP``); None where the trace has no
    usable schedule.

    This is where a ``--tp`` rank's gradients differ from its parameters' shards: PyTorch's
    vocabulary-parallel embedding (``RowwiseParallel`` on an ``nn.Embedding``, weight
    ``Shard(0)``, ``[V/TP, d]`` local) gets its gradient back as a whole ``Replicate`` DTensor
    (``[V, d]`` local): DTensor's ``embedding_dense_backward`` strategies
    (torch/distributed/tensor/_ops/_embedding_ops.py) offer ``Shard(1)``, ``Partial`` or
    all-``Replicate`` outputs and no ``Shard(0)``, and the output gradient arrives replicated
    (the forward's ``Partial`` output normalised to ``Replicate``), so every rank computes the
    whole table's gradient locally, with no collective, and ``AccumulateGrad`` keeps it as it
    is. Checked on two gloo ranks and on the fake process group (tests/test_tensor_parallel.py):
    ``.grad`` ``Replicate``, local ``[V, d]``, beside the ``Shard(0)`` weight and AdamW's
    ``[V/TP, d]`` moments (each optimizer op slices the gradient to the weight's shard). A
    tied column-parallel head (GPT-2) accumulates its ``Shard(0)`` gradient first and the
    embedding's whole one is added into it in place: the shard stays, the whole one is a
    transient of the backward."""
    sched = getattr(an, "schedule", None)
    if sched is None or sched.error or not sched.events:
        return None
    from symcost.tracing.fit import parse_formula
    from symcost.tracing.poly import terms_expr

    own = tuple(getattr(sched, "inverses", None) or ())
    total = sympy.Integer(0)
    for u in sched.units:
        rep = parse_formula(u.repeat)
        for e in sched.events[u.start:u.stop]:
            if e.grad and e.bytes:
                total += (1 if e.once else rep) * terms_expr(sched.gens, e.bytes, own)
    return sympy.expand(total / sched.grad_itemsize)

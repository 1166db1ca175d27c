"""The whole checkpoint pass for ``symcost checkpoint`` (JSON contract ``checkpoint.*``)."""

from __future__ import annotations

import time
from typing import Any, Mapping

from symcost.errors import SymcostError
from symcost.frontends.checkpointing import rng_state_bytes
from symcost.tracing.fit import SYMS
from symcost.passes.checkpoint.segments import uniform_segments
from symcost.passes.checkpoint.costs import integer_k
from symcost.passes.checkpoint_ops import require_block_list
from symcost.passes.checkpoint.plans import Plan
from symcost.passes.checkpoint.schedule import Chain, chain, exact, law_of, make_plan


def analyse(an, sizes: Mapping[str, int] | None = None, memory: int | None = None,
            budget: float | None = None, kind: str = "optimal", optimizer: str = "adamw",
            impl: str = "foreach", exact_peak: bool = True, table: bool = True) -> dict:
    """The checkpoint plan of a traced model at ``sizes`` (plain data; JSON keys of
    ``symcost checkpoint``).

    ``memory`` (bytes): the least recompute whose step peak fits (the exact search on the step
    model, :meth:`Chain.step_optimal`). ``budget`` (0..1): the least recompute whose activation
    peak (segment model) is at most that fraction of the activations without checkpointing (as
    torch.compile's ``activation_memory_budget``). Otherwise ``kind`` (default ``optimal``: the
    least step peak). ``table=False`` leaves the trade-off tables out.

    Returns ``{"plan", "interval", "segments", "activations", "peak", "recompute_flops",
    "train_flops", "tradeoff", "law", "optimality_gap", ...}``: bytes, FLOPs; ``law`` formula
    strings. ``peak`` is the step's peak with the plan applied (:func:`exact`); ``activations``
    the plan's activation peak by the segment model (:func:`plan_cost`); ``optimality_gap`` the
    bound (bytes) on how far the search's least peak can be above the best plan's
    (:meth:`StepSchedule.costs`).

    Raises:
        SymcostError: no one list of repeated blocks (several stacks:
            :func:`~symcost.passes.checkpoint_ops.require_block_list`); bad sizes; a budget
            outside (0, 1]; a cap no plan meets (the message gives the least peak).
    """
    from symcost.passes.memory import memory_model

    t0 = time.perf_counter()
    sizes = dict(sizes or {})
    env = an.bind(**sizes)
    require_block_list(an)
    if SYMS["L"] not in env:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")
    L = int(env[SYMS["L"]])
    ch = chain(an, L, env, optimizer, impl)
    lw = law_of(an)
    base_train = int(an.flops("train").xreplace(env))
    plain_act = ch.cost([])[0]
    c = ch.costs.container
    if budget is not None:
        if not (0 < budget <= 1):
            raise SymcostError(f"--budget is a fraction of the activations without checkpointing, "
                               f"in (0, 1]; got {budget}")
        cap_act = int(budget * plain_act)
        least = ch.optimal()[1]
        if cap_act < least:
            raise SymcostError(f"--budget {budget} asks for activations <= {cap_act} bytes; the least any "
                               f"plan reaches is {least} bytes ({least / plain_act:.3f} of {plain_act})")
        plan = Plan(c, L, ch.optimal(cap_act)[0], "budget")
    elif memory is not None:
        plan = Plan(c, L, ch.step_optimal(memory)[0], "memory")
    else:
        plan = make_plan(an, kind, L, env, ch=ch)
    t_solve = time.perf_counter() - t0
    act, rec = ch.cost(plan.segments)
    out: dict[str, Any] = {
        "model": an.model, "L": L, "kind": plan.kind,
        "plan": plan.modules(), "interval": plan.interval, "segments": [list(s) for s in plan.segments],
        "n_segments": len(plan.segments),
        "activations": act, "activations_none": plain_act,
        "recompute_flops": rec, "train_flops": base_train + rec, "train_flops_none": base_train,
        "solve_seconds": t_solve, "optimality_gap": ch.step[1],
    }
    mm = memory_model(an, an.precision, optimizer, impl)
    out["peak_none"] = mm.peak(**sizes)
    out["peak"] = None
    if exact_peak:
        ex = exact(an, plan, sizes, optimizer, impl, ch=ch)
        out["peak"] = ex["peak"]
        out["peak_source"] = ex["peak_source"]
        out["peak_where"] = ex["where"]
    out["tradeoff"] = tradeoff(ch, L) if table else []
    out["op_tradeoff"] = []
    if table:  # one level down: which tensors inside a block to keep (symcost.passes.checkpoint_ops)
        from symcost.passes import checkpoint_ops

        try:
            out["op_tradeoff"] = checkpoint_ops.tradeoff(an, env)
        except SymcostError:
            pass
    out["law"] = {k: str(v) for k, v in lw.items() if k not in ("k", "j")}
    out["k_star"] = float(lw["k_star"].xreplace({**env, SYMS["L"]: L}))
    out["k_best"] = integer_k(lw, env, L, ch.head)
    out["block"] = {"a": ch.a[-1], "x": ch.x[-1] - rng_state_bytes(), "rng_state": rng_state_bytes(),
                    "f": ch.f[-1], "f_last": ch.fr[-1], "ops": ch.costs.n_ops, "head": ch.head}
    out["plan_object"] = plan
    return out


def tradeoff(ch: Chain, L: int) -> list[dict]:
    """The trade-off table: no checkpointing, every interval k = 1..L (⌈L/k⌉ segments), then
    activation budgets 0.9, 0.8, ... of the activations without checkpointing (the segment
    model's least recompute within each): activation peak (segment model), ``peak`` (the step's,
    :meth:`Chain.peak`; bytes) and recompute FLOPs."""
    def row(segs, **key):
        act, rec = ch.cost(segs)
        return {**key, "segments": len(segs), "activations": act,
                "peak": ch.peak(segs) if ch.schedule is not None else None, "recompute_flops": rec}

    rows = [row([], k=None)]
    for k in range(1, L + 1):
        rows.append(row(uniform_segments(L, k), k=k))
    plain = ch.cost([])[0]
    least = ch.optimal()[1]
    for tenth in range(9, 0, -1):
        cap = plain * tenth // 10
        if cap < least:
            break
        rows.append(row(ch.optimal(cap)[0], budget=tenth / 10))
    return rows

"""What would fit when nothing does: other precision policies, optimizers with less state,
activation checkpointing and the cap, each answered from the same traced step.

When not even ``var = 1`` fits under the cap (:meth:`~symcost.passes.memory.solve.Solver.solve`
returns 0), :func:`alternatives` solves the same problem (cap, var, the other sizes) with one
option changed at a time, on the memory model of the same trace:

* **another precision policy** (:data:`~symcost.passes.memory.policies.POLICIES`): the static
  bytes, the gradients and the optimizer's temporaries follow the policy; the activations and
  other storages of the step are the trace's. That is exact between policies that trace the same
  dtypes (:data:`symcost.frontends.precision.PRECISIONS`: ``bf16-true``,
  ``bf16-true-fp32-state`` and ``bf16-true-fp32-master`` all trace ``model.to(bfloat16)``), and
  an upper bound from an fp32 or autocast trace to a model cast to 16 bits (each storage of the
  16-bit model is at most as large, and it keeps no autocast weight copies): the largest size
  given is then at least what fits, and the user re-runs with ``--precision`` to get it exactly.
  Other changes (to fp32, or from 16-bit to autocast) would not be bounded and are not offered;
  fp16 policies have the bytes of their bf16 twins and are left out for brevity.
* **an optimizer with less state** (``sgd``, ``sgd-nomomentum``, ``adafactor``): exact (the
  optimizer changes the static state and the step's temporaries only).
* **activation checkpointing**: it lowers only what the forward keeps for the backward, never the
  static memory, the gradients or the optimizer step; so static + the live set of the optimizer
  step (:meth:`MemoryModel.step_floor`) at ``var = 1`` is a floor no plan goes below. Above the
  cap: checkpointing cannot help; else it may (``--checkpoint optimal`` traces the plan).
* **the cap**: the peak at ``var = 1``, M(1), is the least cap under which ``var = 1`` fits.

Sharding over more devices (ZeRO, FSDP, tensor parallelism) is not modelled.
"""
from __future__ import annotations

from typing import Mapping

from symcost.errors import SymcostError
from symcost.frontends.precision import PRECISIONS
from symcost.passes.memory.model import memory_model
from symcost.passes.memory.policies import POLICIES
from symcost.units import parse_memory

#: optimizers offered as having less state than Adam/AdamW (torch.optim's per-element state)
LIGHTER = ("adafactor", "sgd", "sgd-nomomentum")


def _traced_as(precision: str) -> tuple[str, str | None]:
    weights, autocast, _ = PRECISIONS[precision]
    return weights, autocast


def activations_bound(traced: str, other: str) -> str | None:
    """How a trace under precision ``traced`` bounds the activations of precision ``other``:
    ``"exact"`` (the same dtypes traced), ``"upper bound"`` (``other`` casts the model to 16 bits,
    ``traced`` runs an fp32 model with or without autocast: each storage is at most as large), or
    None (not bounded: not offered)."""
    a, b = _traced_as(traced), _traced_as(other)
    if a == b or (a[1] is None and b[1] is None and a[0] != "float32" and b[0] != "float32"):
        return "exact"  # bf16 and fp16 elements are both 2 bytes
    if a[0] == "float32" and b[0] != "float32" and b[1] is None:
        return "upper bound"
    return None


def alternatives(mm, cap: int | str, var: str, sizes: Mapping[str, int], checkpointing: bool = True,
                 least: int = 1) -> list[dict]:
    """What would fit where ``mm.solve(cap, var, **sizes)`` found nothing (see the module
    docstring). ``mm``: a :class:`~symcost.passes.memory.model.MemoryModel`; ``sizes``: the
    other sizes, as given to ``solve``; ``checkpointing``: whether to say what activation
    checkpointing can do (False when the step is checkpointed already); ``least``: the smallest
    admissible ``var`` (1; an image side in a residue class: ``Solution.next_value``), where
    "M(1)" below is taken (each dict's ``at``).

    Returns a list of dicts, one per option, all sizes in bytes:

    * ``{"option": "--precision bf16-true", "kind": "precision" | "optimizer", "precision",
      "optimizer", "fits": bool, "max": the largest var under the cap (0: none), "memory_at_1":
      M(1), "exact": bool}``; ``exact`` False: ``max`` is a lower bound (activations bounded by
      the trace's). Those that fit, largest ``max`` first; when none of a kind fits, the one of
      least M(1).
    * ``{"option": "--checkpoint optimal", "kind": "checkpoint", "floor": bytes no plan goes
      below at var = 1, "may_fit": floor <= cap}`` (left out when ``checkpointing`` is False).
    * ``{"option": "--memory", "kind": "memory", "min_cap": M(1)}``: the least cap that fits 1.

    Raises:
        SymcostError: bad cap or sizes (as ``solve``).
    """
    cap = parse_memory(cap)
    sizes = {k: v for k, v in sizes.items() if k != var}
    at1 = {**sizes, var: least}
    out: list[dict] = []
    traced = mm.an.precision

    def trial(kind, option, other, bound):
        try:
            sol = other.solve(cap, var, **sizes)
            m1 = other.peak(**at1)
        except SymcostError:
            return None
        return {"option": option, "kind": kind, "precision": other.policy.name, "optimizer": other.opt.name,
                "fits": sol.value >= 1, "max": sol.value, "memory_at_1": m1, "exact": bound == "exact", "at": least}

    groups: list[list[dict]] = []
    pol_trials = []
    for name in POLICIES:
        if name == mm.policy.name or name.startswith("fp16") or POLICIES[name].source:
            continue  # (a framework's own policy, megatron-* / deepspeed-*, describes a run: not a knob offered)
        bound = activations_bound(traced, name)
        if bound is None:
            continue
        r = trial("precision", f"--precision {name}", memory_model(mm.an, name, mm.opt.name, mm.impl), bound)
        if r is not None:
            pol_trials.append(r)
    groups.append(pol_trials)
    opt_trials = []
    state_now = mm.components(**at1)["optimizer"]
    for name in LIGHTER:
        if name == mm.opt.name:
            continue
        try:
            other = memory_model(mm.an, mm.policy.name, name, mm.impl)
        except SymcostError:  # an optimizer not modelled for this trace (Adafactor with --dp)
            continue
        if other.components(**at1)["optimizer"] >= state_now:
            continue
        r = trial("optimizer", f"--optimizer {name}", other, "exact")
        if r is not None:
            opt_trials.append(r)
    groups.append(opt_trials)
    for g in groups:
        fit = sorted((r for r in g if r["fits"]), key=lambda r: -r["max"])
        out += fit if fit else sorted(g, key=lambda r: r["memory_at_1"])[:1]
    if checkpointing:
        floor = mm.step_floor(**at1)
        out.append({"option": "--checkpoint optimal", "kind": "checkpoint", "floor": floor, "may_fit": floor <= cap,
                    "at": least})
    out.append({"option": "--memory", "kind": "memory", "min_cap": mm.peak(**at1), "at": least})
    return out


def cap_arg(nbytes: int) -> str:
    """A ``--memory`` value of at least ``nbytes``: rounded up to 0.1 GiB or 0.1 MiB, else bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{-(-nbytes * 10 // size) / 10:g}{unit}"
    return f"{nbytes}B"


def alternatives_text(alts: list[dict], var: str, cap: int) -> list[str]:
    """One short line per entry of :func:`alternatives` (binary units, as the conventions ask)."""
    from symcost.units import binary

    lines = []
    for a in alts:
        if a["kind"] in ("precision", "optimizer"):
            tag = "" if a["exact"] else (f" (at least: this trace's activations bound {a['precision']}'s; "
                                         f"{a['option']} gives it exactly)")
            if a["fits"]:
                lines.append(f"{a['option']}: fits, largest {var} = {a['max']}{tag}")
            else:
                lines.append(f"{a['option']}: still does not fit (M({a.get('at', 1)}) = {binary(a['memory_at_1'])})")
        elif a["kind"] == "checkpoint":
            if a["may_fit"]:
                lines.append(f"{a['option']}: may fit: it lowers only the activations; static memory + gradients + "
                             f"optimizer step need {binary(a['floor'])} at {var} = {a.get('at', 1)}, under the cap "
                             "(traces the plan)")
            else:
                lines.append(f"activation checkpointing cannot fit it: static memory + gradients + optimizer step "
                             f"alone need {binary(a['floor'])} at {var} = {a.get('at', 1)}, above the cap {binary(cap)}")
        elif a["kind"] == "memory":
            at = a.get("at", 1)
            lines.append(f"--memory {cap_arg(a['min_cap'])} or more (M({at}) = {a['min_cap']:,} bytes): fits {var} = {at}")
    return lines

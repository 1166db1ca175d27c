"""The memory section of ``symcost report`` (and of ``formulas``/``eval`` JSON): what the memory
pass (:mod:`symcost.passes.memory`) returns, as rows, lines and JSON."""
from __future__ import annotations

from typing import Any, Mapping

import sympy

from symcost.units import binary, gib, parse_memory
from symcost.passes.memory import STEP_BYTES, engine_impl, memory_model
from symcost.passes.memory.live import _pareto, _peval

class _Text:
    """A row's formula text, printed on first use (sympy's printer takes a while on long
    formulas, and ``eval`` never shows them); ``str()`` and rich both render it."""

    def __init__(self, fn, arg):
        self._fn, self._arg, self._s = fn, arg, None

    def __str__(self) -> str:
        if self._s is None:
            self._s = self._fn(self._arg)
        return self._s

    def __rich__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return repr(str(self))


#: The memory table's row of :attr:`MemoryModel.static` (what the peak row adds its live set to).
STATIC_LABEL = "static (parameters + optimizer state + master weights + buffers + inputs; no gradients)"
#: ... under a policy that keeps its gradients in a persistent buffer (Megatron-LM's main_grad)
STATIC_LABEL_GRAD_BUFFER = "static (parameters + optimizer state + master weights + gradient buffer + buffers + inputs)"


def report_section(an, sizes: Mapping[str, int] | None, cap: str | int = "80GiB",
                   precision: str | None = None, optimizer_name: str = "adamw",
                   impl: str = "default", evaluate: bool | None = None, device: str = "cuda") -> dict:
    """The memory section of ``symcost report`` (and of ``formulas``/``eval`` JSON).

    Returns ``{"title", "rows": [(label, formula, value)], "lines": [...], "json": {...}}``. The
    JSON carries ``params``, ``grads``, ``optimizer``, ``master_weights``, ``buffers``,
    ``inputs``, ``activations``, ``activations_per_layer``, ``peak`` (bytes: formula strings that
    ``sympy.sympify`` parses when ``evaluate`` is false, integers at ``sizes`` when true; by
    default integers exactly when sizes are given) and ``max_batch``, ``memory_at_max``,
    ``memory_cap`` (integers, at the sizes or the model's defaults), ``max_batch_reason`` (why
    ``max_batch`` is 0: :meth:`MemoryModel.no_fit_reason`; None otherwise), ``fits`` (whether
    the peak at the sizes is within the cap) with ``fits_reason`` (why not; None when it fits),
    and when evaluated ``peak_parts`` (:meth:`MemoryModel.peak_parts`: the static parts and the
    live set at the peak, adding up to ``peak``).

    Raises:
        SymcostError: bad cap, policy, optimizer or sizes.
    """
    sizes = dict(sizes or {})
    capb = parse_memory(cap)
    mm = memory_model(an, precision, optimizer_name, impl, device)
    evaluate = bool(sizes) if evaluate is None else evaluate
    vsizes = {k: v for k, v in sizes.items()}
    comp = mm.components(**vsizes)
    pol, opt = mm.policy, mm.opt
    peak_f = _Text(lambda _: str(mm.peak_expr()), None)  # built only when shown
    rows = []
    label = {
        "params": f"parameters ({pol.param} B each)",
        "grads": f"gradients ({pol.grad} B each)",
        "optimizer": f"optimizer state ({opt.name}" + (f", {opt.full}×{pol.state} B each" if opt.full else "")
                     + (", factored" if opt.factored else "") + (", 4 B step per tensor" if opt.step else "") + ")",
        "master_weights": f"master weights ({pol.master} B each)",
        "grad_buffer": f"gradient buffer ({pol.grad} B each, persistent: the backward accumulates into it)",
        "buffers": "buffers",
        "inputs": "inputs",
        "activations": "activations (saved for backward)",
        "activations_per_layer": "  per layer (one block)",
        "peak": "peak (steady-state step)",
    }
    formulas = {
        "params": mm.params, "grads": mm.grads, "optimizer": mm.optimizer,
        "master_weights": mm.master_weights, "grad_buffer": mm.grad_buffer if pol.grad_buffer else None,
        "buffers": mm.buffers, "inputs": mm.inputs,
        "activations": mm.activations, "activations_per_layer": mm.activations_per_layer,
        "peak": peak_f,
    }
    live_sets = _pareto(mm._cands(None, False))  # what peak_terms() lists, as ring elements
    env = mm._env(vsizes)
    static_v = int(mm.static.xreplace(env))
    lens = mm._lengths(env)  # (every stack's length: L, or each stack's own symbol)
    vals = mm._values(env)
    win = max((c for c in live_sets if mm._valid(c, lens)), key=lambda c: _peval(c.poly, vals))
    for k, f in formulas.items():
        if f is None:
            continue
        shown = f if isinstance(f, _Text) else _Text(str, f)
        if k == "peak" and len(live_sets) > 1:
            shown = _Text(lambda w: (f"static + the largest of {len(live_sets)} live sets (Max; memory.peak in "
                                     f"--json); {'here' if sizes else 'at the defaults'} static + {mm._expr(w)}"),
                          win.poly)
        rows.append((label[k], shown, gib(comp[k])))
        if k == "inputs":  # what the peak row calls static: every part live all step, not gradients
            rows.append((STATIC_LABEL_GRAD_BUFFER if pol.grad_buffer else STATIC_LABEL, _Text(str, mm.static),
                         gib(static_v)))
    bpp = mm.bytes_per_param()
    parts = [f"{pol.param} (params)", f"{pol.grad} (grads)"]
    if opt.full:
        parts.append(f"{opt.full}×{pol.state} ({opt.name} state)")
    if pol.master:
        parts.append(f"{pol.master} (master)")
    named = "parameters + gradients + optimizer state" + (" + master weights" if pol.master else "")
    lines = [
        f"per parameter: {' + '.join(parts)} = {bpp} bytes → {bpp}·P_total = {sympy.expand(bpp * mm.P)} bytes"
        f" (P_total = {mm.P} from the trace; precision {pol.name}: {pol.note})"
    ]
    if mm.P_frozen != 0:  # requires_grad=False: held, no gradient, optimizer state or master copy
        lines.append(f"  − {bpp - pol.param} bytes per frozen parameter (requires_grad=False: no gradient, optimizer "
                     f"state or master copy) × P_frozen = {mm.P_frozen}")
    if pol.grad_copy:
        lines.append(f"  + {pol.grad_copy} bytes per parameter the rank updates of an fp32 gradient copy during the "
                     "optimizer step only (in the peak's optimizer-step live set, not in the static memory)")
    steps = mm.step_bytes()
    if opt.step and steps == sympy.expand(STEP_BYTES * mm.n_tensors):
        lines.append(f"  + {STEP_BYTES} bytes of {opt.torch} step counter per parameter tensor with a gradient × {mm.n_tensors} tensors")
    elif opt.step and steps == 0:
        lines.append(f"  + no step counter tensors: {pol.name}'s fused Adam keeps one step per parameter group, a Python int")
    elif opt.step:
        lines.append(f"  + {steps} bytes of step counters (one per flat partition the optimizer steps)")
    if opt.factored:
        lines.append("  + Adafactor's factored second moment (rows + columns per matrix, full vectors), in the optimizer row")
    at = "at the sizes above" if sizes else "at the model's defaults"
    keys = ("params", "grads", "optimizer") + (("master_weights",) if pol.master else ())
    lines.append(f"{named} {at}: {' + '.join(f'{comp[k]:,}' for k in keys)} = {sum(comp[k] for k in keys):,} bytes "
                 f"({gib(sum(comp[k] for k in keys))}); "
                 + ("the gradients are a persistent buffer (static: the backward accumulates into it)"
                    if pol.grad_buffer else "the static row leaves the gradients out (the backward allocates them: "
                    "the peak counts them in its live sets)"))
    parts = mm.peak_parts(**vsizes)
    live = [(k, name) for k, name in (("gradients", "gradients"), ("forward", "forward tensors still live"),
                                      ("backward", "backward temporaries"),
                                      ("optimizer_step", "optimizer-step temporaries"),
                                      ("checkpointed", "the checkpointed step's live set")) if parts.get(k)]
    lines.append(f"peak {at}: {gib(comp['peak'])}, reached at {parts['where']}; = static {gib(static_v)}"
                 + "".join(f" + {name} {gib(parts[k])}" for k, name in live))
    if "B" not in mm.gens:
        sol = None
        lines.append(f"B is pinned to {an.pinned.get('B', 1)} in this trace: run max-batch without --set B to solve for it")
    else:
        sol = mm.solve(capb, "B", **{s: v for s, v in vsizes.items() if s != "B"})
    fits = comp["peak"] <= capb
    fits_reason = None
    if not fits:  # the sizes asked for do not fit under the cap: say so, whatever max_batch is
        fits_reason = (f"the peak {at}, {comp['peak']:,} bytes ({binary(comp['peak'])}), exceeds the cap "
                       f"{capb:,} bytes ({binary(capb)}) by {binary(comp['peak'] - capb)}")
        if sol is not None and sol.value >= 1:
            fits_reason += f"; the largest B that fits at the other sizes is {sol.value}"
        lines.append(f"[bold red]does not fit[/bold red] under {gib(capb)}: {fits_reason}")
    reason = None
    if sol is None:
        pass
    elif sol.value >= 1:
        lines.append(
            f"largest batch under {gib(capb)}: B = {sol.value}   (check: M({sol.value}) = {gib(sol.memory_at)} ≤ cap < "
            f"M({sol.value + 1}) = {gib(sol.memory_next)})" + (f"; {sol.limited_by}" if sol.limited_by else "")
        )
    else:
        reason = mm.no_fit_reason(sol, **vsizes)
        lines.append(f"largest batch under {gib(capb)}: none (max_batch 0): {reason}")
    js: dict[str, Any] = {}
    for k, f in formulas.items():
        if f is None:
            continue
        js[k] = comp[k] if evaluate else str(f)
    js["static"] = static_v if evaluate else str(mm.static)
    if not evaluate:
        js["peak_terms"] = [{"formula": str(e), "min_L": m, "where": w} for e, m, w in mm.peak_terms()]
    js["bytes_per_param"] = bpp
    js["max_batch"] = sol.value if sol else None
    js["max_batch_reason"] = reason  # why max_batch is 0 (None when a batch fits or B is pinned)
    js["memory_at_max"] = sol.memory_at if sol else None
    js["memory_cap"] = capb
    js["fits"] = fits  # whether the peak at the sizes (or the defaults) is within memory_cap
    js["fits_reason"] = fits_reason  # why not (None when it fits)
    if evaluate:
        js["peak_parts"] = parts  # static parts + the live set at the peak, adding up to peak
    js["optimizer_name"] = opt.name
    js["optimizer_impl"] = mm.impl
    js["device"] = device
    return {
        "title": f"Memory: precision {pol.name}, optimizer {opt.name} ({mm.impl}"
                 + ((f", {pol.name}'s engine on {device}" if engine_impl(pol.name, opt.name, device)
                     else f", torch.optim's default on {device}") if impl == "default" else "") + "), steady-state step "
                 f"(values {at})",
        "rows": rows,
        "lines": lines,
        "json": js,
    }

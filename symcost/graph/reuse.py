"""Formulas reused at sizes other than those they were checked at: the model built there on the
meta device, its parameter shapes compared with the fitted ones.

The fit sees the model at small probe sizes. A size that is a step function of the symbols is
constant over all of them and is fitted as that constant: torchtitan's SwiGLU width
1024·⌈⌊1.3·⌊8·dim/3⌋⌋/1024⌉ is 1024 for every dim up to 590, 14336 at Llama-3-8B's dim 4096
(torchtitan/models/llama3/model/model.py, ``FeedForward``). The trace checks its formulas at the
request itself, where such a size shows (and the symbols at fault are pinned there); evaluated
anywhere else (``Analysis.subs``, a cached analysis answering another request of the same regime)
they would be silently wrong. So there, before a number is given, the model is built at those
sizes on the meta device (no memory, initialisers skipped: :meth:`ModelSpec.build_meta`) and each
parameter's shape is compared with its fitted formula: a parameter that differs means the
formulas do not hold there (:class:`NotAtTheseSizes`), and the step is traced again at those
sizes. Only parameter shapes are compared: a step function in an activation's size alone (a
sequence padded to a multiple) is not caught here; the check at the request is what finds those.
Torch is imported only by the build.
"""
from __future__ import annotations

import re
from typing import Mapping

import sympy

from symcost.errors import SymcostError
from symcost.frontends.spec import INPUT_SYMBOLS
from symcost.tracing.fit import SYMS


class NotAtTheseSizes(SymcostError):
    """The fitted formulas do not hold at the sizes asked for: a parameter's shape there differs
    (``param``, its ``fitted`` and its built ``shape``; ``values`` the sizes)."""

    def __init__(self, msg: str, param: str, fitted: tuple, shape: tuple, values: Mapping[str, int]):
        super().__init__(msg)
        self.param, self.fitted, self.shape, self.values = param, fitted, shape, dict(values)


class StepSize(Exception):
    """Raised inside a trace whose fitted parameter shapes do not hold at the request itself:
    ``pins`` (symbol -> reason, :func:`at_fault`) are to be pinned at the requested values and the
    regime traced again (:func:`symcost.graph.build.trace`)."""

    def __init__(self, pins: Mapping[str, str]):
        super().__init__(", ".join(pins))
        self.pins = dict(pins)



def other_regime(an, values: Mapping[str, int]) -> None:
    """Warn (``UserWarning``) where ``values`` set a symbol to 1 that ``an`` was traced larger: size 1
    is a regime of its own (PyTorch turns copies into views there and broadcasts run other kernels:
    shared/conventions.md, "Regimes"; the trace cache matches requests by the same facts,
    :func:`symcost.frontends.spec.request_facts`), so the formulas fitted at sizes of 2 and more were
    not checked at 1 (parameter counts hold; activations and bytes may not: a torchtune Llama's
    activations were 192 B off at B = 1). Nothing is said for an analysis without its request's
    facts. Issue 30: a formula reused outside the sizes it was checked at says so."""
    import warnings

    from symcost.frontends.spec import request_facts

    traced = (getattr(an, "request_facts", None) or {}).get("ones")
    if traced is None:
        return
    now = request_facts(values, list(an.symbols))["ones"]
    new = [s for s in now if s not in traced and s not in an.pinned]
    if new:
        at = ", ".join(f"{s}=1" for s in new)
        warnings.warn(
            f"{an.model}: {at} is a regime of its own (size 1); this trace's formulas were fitted and checked "
            f"at {', '.join(new)} of 2 and more, not at 1: trace at {at} (symcost.trace(..., sizes={{"
            + ", ".join(f"'{s}': 1" for s in new) + "}) or --set " + " ".join(f"{s}=1" for s in new)
            + ") for figures checked there", stacklevel=3)

def config_values(an, values: Mapping[str, int]) -> dict[str, int]:
    """The model's own sizes among ``values``: its config symbols (B, S, T and mesh sizes shape
    no parameter of the model as built), pinned ones included."""
    own = set(an.spec.symbols) - set(INPUT_SYMBOLS)
    return {str(k): int(v) for k, v in values.items() if str(k) in own}


def checked_at(an, values: Mapping[str, int]) -> bool:
    """Whether the formulas of ``an`` were checked at ``values``' model sizes: the trace's own
    request (its check recorded the step there; L or a folded stack's own length alone may differ:
    the blocks repeat), or sizes a previous :func:`check` passed."""
    cfg = config_values(an, values)
    req = config_values(an, getattr(an, "request_sizes", {}) or {})
    lengths = {"L"} | {s for s in (getattr(an, "stack_blocks", None) or {}) if s not in (an.pinned or {})}
    if req and all(req.get(k) == v for k, v in cfg.items() if k not in lengths):
        return True
    return tuple(sorted(cfg.items())) in an.__dict__.get("_checked_sizes", set())


def _folded(an, name: str) -> str | None:
    """``name`` of a built model's parameter as ``an.param_shapes`` has it (the L blocks folded to
    ``{container}.{i}.``), or None where the analysis has no such parameter."""
    if name in an.param_shapes:
        return name
    c = an.layer_container
    if c is not None:
        pre = f"{c}." if c else ""
        m = re.match(rf"^{re.escape(pre)}(\d+)\.", name)
        if m is None:
            return None
        lead = getattr(an.spec, "lead_blocks", 0) or 0
        # (block 0 stands for the leading blocks of another kind where the model has them)
        folded = pre + ("0." if int(m.group(1)) < lead else "{i}.") + name[m.end():]
        if folded in an.param_shapes:
            return folded
    for c, sym in (getattr(an, "stacks", None) or {}).items():  # several stacks (graph/stacks.py)
        pre = f"{c}." if c else ""
        m = re.match(rf"^{re.escape(pre)}(\d+)\.", name)
        if m is not None:
            for label in ("{i}", "{" + f"{sym}-1" + "}", "0"):
                folded = pre + label + "." + name[m.end():]
                if folded in an.param_shapes:
                    return folded
    return None


def mismatch(an, values: Mapping[str, int], spec=None) -> tuple[str, tuple, tuple] | None:
    """The first parameter whose fitted shape at ``values`` differs from the shape the model has
    when built there on the meta device: ``(name, fitted, built)``; None if every parameter the
    analysis knows agrees.

    Args:
        an: the analysis (its ``param_shapes``, folded over the L blocks).
        values: symbol -> int, every symbol of the formulas and the pinned ones.
        spec: the model to build (default ``an.spec``; the trace cache gives a live spec for an
            analysis read back as data).

    Raises:
        SymcostError: the model cannot be built there (the factory's own error).
    """
    spec = spec or an.spec
    vals = {**{str(k): int(v) for k, v in values.items()}, **{k: int(v) for k, v in an.pinned.items()}}
    vals.update({a: vals[b] for a, b in spec.follows.items() if a not in vals and b in vals})
    vals.update({a: vals[b] for a, b in spec.tied.items() if b in vals})
    model = spec.build_meta(vals)
    env = {SYMS[k]: int(v) for k, v in values.items() if k in SYMS}
    env.update({SYMS[k]: int(v) for k, v in an.pinned.items() if k in SYMS})
    for name, p in model.named_parameters():
        key = _folded(an, name)
        if key is None:
            continue
        fitted = tuple(int(sympy.sympify(x).xreplace(env)) for x in an.param_shapes[key][0])
        if fitted != tuple(p.shape):
            return name, fitted, tuple(p.shape)
    return None


def check(an, values: Mapping[str, int], spec=None) -> None:
    """Raise :class:`NotAtTheseSizes` where the formulas of ``an`` do not hold at ``values``
    (:func:`mismatch`); remember sizes that pass. Sizes the formulas were checked at already
    (:func:`checked_at`) and analyses of a parallel layout (their build shards the model over a
    mesh) are not built again.

    Raises:
        NotAtTheseSizes: a parameter's shape differs there.
    """
    if checked_at(an, values) or an.parallel or an.tensor_parallel:
        return
    try:
        found = mismatch(an, values, spec)
    except Exception:  # noqa: BLE001 - a model that does not build here: bind's own checks answer
        return
    if found is None:
        an.__dict__.setdefault("_checked_sizes", set()).add(tuple(sorted(config_values(an, values).items())))
        return
    name, fitted, shape = found
    req, cfg = config_values(an, an.request_sizes), config_values(an, values)
    at = " ".join(f"{k}={v}" for k, v in cfg.items() if req.get(k) != v)
    raise NotAtTheseSizes(
        f"{an.model}: at {at} the model's {name} is {list(shape)}, but the formulas (traced at "
        f"{' '.join(f'{k}={v}' for k, v in req.items())}) give {list(fitted)}: a size that is a step function "
        f"of the symbols, constant over every size traced; trace at these sizes (symcost.trace(..., "
        f"sizes={cfg}) or --set {at})", name, fitted, shape, values)



def at_fault(an, values: Mapping[str, int], param: str, spec=None) -> dict[str, str]:
    """The config symbols whose value moves ``param``'s shape at ``values`` otherwise than its
    fitted formula moves: each symbol s but L is set to nearby values the model accepts (s + 1,
    s + 2, 2·s, s − 1; ``spec.check``) and the model built there on the meta device; s is at
    fault when the built shape's change differs from the fitted formula's change. Returns symbol
    -> the reason to pin it (what :func:`symcost.graph.build.trace` pins at the requested value
    from the start, so that the fit never meets the step); every config symbol but L where no
    single one shows it.
    """
    spec = spec or an.spec
    stack = set((getattr(an, "stacks", None) or {}).values())
    own = [s for s in spec.symbols if s not in INPUT_SYMBOLS and s != "L" and s not in spec.tied and s not in stack]
    base = {str(k): int(v) for k, v in values.items()}
    base.update({a: base[b] for a, b in spec.follows.items() if a not in base and b in base})
    base.update({a: base[b] for a, b in spec.tied.items() if b in base})
    formula = an.param_shapes[_folded(an, param)][0]

    def fitted(vals):
        env = {SYMS[k]: int(v) for k, v in vals.items() if k in SYMS}
        return [int(sympy.sympify(x).xreplace(env)) for x in formula]

    def built(vals):
        p = dict(spec.build_meta(vals).named_parameters()).get(param)
        return None if p is None else list(p.shape)

    here, here_fit = built(base), fitted(base)
    reason = (f"{param} is a step function of it ({here} here, {here_fit} by the formula fitted at the "
              "probe sizes): no polynomial in it holds at this size")
    out = {}
    for s in own:
        for w in (base[s] + 1, base[s] + 2, 2 * base[s], base[s] - 1):
            trial = {**base, s: w}
            trial.update({a: trial[b] for a, b in spec.tied.items() if b in trial})
            if w < 1 or spec.check({k: x for k, x in trial.items() if k in spec.symbols}):
                continue
            try:
                there = built(trial)
            except Exception:  # noqa: BLE001 - a size the model's code refuses: the next one
                continue
            if there is not None and here is not None and len(there) == len(here) and any(
                    b - a != fb - fa for a, b, fa, fb in zip(here, there, here_fit, fitted(trial))):
                out[s] = reason
                break
    return out or {s: reason for s in own}

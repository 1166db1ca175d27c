"""The roofline pass: per-op bound, step-time lower bound, MFU ceiling, crossings, tokens and time.

Takes an :class:`~symcost.graph.analysis.Analysis` and a :class:`~symcost.hardware.devices.Device`; returns
plain data (dicts of numbers and formula strings). Nothing here prints.

Rules (Williams, Waterman & Patterson, "Roofline: an insightful visual performance model",
CACM 52(4), 2009):

- arithmetic intensity of an op: I = FLOPs / bytes (FLOP/byte), FLOPs being all FLOPs of the op
  (``flops_all``: matmul FLOPs plus the per-element counts of :mod:`symcost.graph.rules`), bytes its
  traffic (unfused, or fused by :mod:`symcost.graph.fusion` for a compiled step);
- ridge point of the device at the op's precision: peak FLOP/s / bandwidth;
- attainable FLOP/s = min(peak, bandwidth x I); the op is compute-bound when I >= ridge;
- time bound of one execution = max(FLOPs / peak, bytes / bandwidth, transcendental
  evaluations / the device's special-function rate), in seconds (the third ceiling:
  FlashAttention-3, Shah et al. 2024, sec. 3; :func:`symcost.hardware.devices.op_time`); on a device with
  ``serial_passes`` (a CPU) a row-normalising op's memory time adds to the larger of the other
  two instead, and a GEMM's packing of its [k, n] operand adds to its compute time; the step's lower bound is the sum over ops (times their repeat), since ops of one
  stream run one after the other;
- MFU ceiling = model FLOPs of the step / (step lower bound x peak at the training precision):
  no run of that step on that device can exceed it (PaLM's MFU, Chowdhery et al. 2022, App. B).
  The training precision is the dtype the traced matmul-class ops ran in
  (:func:`training_precision`), the same figure their compute time was bounded with: bf16 under
  ``bf16-mixed`` and under ``--precision fp32 --fsdp-mp bf16`` (FSDP2 casts the parameters to
  bf16 and the matmuls run in bf16), not the ``--precision`` flag's own dtype.

An op's precision is its output dtype (``bf16`` matmuls under autocast, ``fp32`` for the fp32
norms and losses), mapped to the device's figure by :meth:`~symcost.hardware.devices.Device.peak_for`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction
from typing import Any, Mapping

import sympy

from symcost.hardware.devices import TRAINING_PRECISION, Device, dtype_key, op_time
from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS
from symcost.graph.opsets import ROW_NORMALISING, dtype_names, packed_operand


def _num(x, env) -> int:
    if not isinstance(x, sympy.Basic):
        return int(x)
    v = x.xreplace(env)  # (a polynomial: xreplace evaluates it, much faster than subs)
    if not isinstance(v, sympy.Basic) or v.is_number:
        return int(v)
    return int(x.subs(env))


def op_precision(op, default: str) -> str:
    """Device precision key of a :class:`~symcost.graph.ops.SymOp`: ``fp8`` for a matmul-class op
    (model FLOPs) on fp8 operands (FP8 training's ``aten._scaled_mm``, whose output is bf16 or
    fp32: the tensor cores run at the fp8 peak), else its first floating output dtype, else its
    first floating input, else ``default`` (the training precision)."""
    ins = dtype_names(op.in_dtypes)
    if op.cost.flops != 0 and any(dtype_key(d) == "fp8" for d in ins):
        return "fp8"
    for d in dtype_names(op.out_dtypes) + ins:  # names: no torch for a cached analysis
        k = dtype_key(d)
        if k is not None:
            return k
    return default


def training_precision(an, env: Mapping | None = None) -> str:
    """Device precision key of the model's matmuls: the peak MFU divides by (issue 27).

    Read from the trace, not from the ``--precision`` flag: the key (:func:`op_precision`) of
    the traced ops that carry model FLOPs (the matmul-class ops, conventions.md), i.e. the dtype
    they really ran in. The flag alone does not say it: under ``--precision fp32 --fsdp-mp bf16``
    FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` all-gathers bf16 parameters and every
    matmul runs in bf16, so the step's compute is timed at the bf16 peak and its MFU must divide
    by that peak too (the fp32 peak put MFU above 1000%). Where the matmuls run in more than one
    dtype, the one that carries the most model FLOPs at ``env`` (an :meth:`Analysis.bind`
    mapping; the model's defaults when None) wins, the flag's key on a tie. A trace without
    model FLOPs falls back to the flag (``bf16-mixed`` -> bf16, :data:`TRAINING_PRECISION`).
    """
    flag = TRAINING_PRECISION.get(an.precision, "fp32")
    by_key: dict[str, list] = {}
    for op in an.ops:
        if op.cost.flops != 0:  # model FLOPs: the matmul-class ops only
            by_key.setdefault(op_precision(op, flag), []).append(op)
    if len(by_key) <= 1:
        return next(iter(by_key), flag)
    env = an.bind() if env is None else env
    share = {k: sum(_num(op.repeat, env) * _num(op.cost.flops, env) for op in ops) for k, ops in by_key.items()}
    return max(share, key=lambda k: (share[k], k == flag))


def precision_note(an, env: Mapping | None = None) -> str | None:
    """Why the step's compute is timed (and MFU divided) at another peak than the ``--precision``
    flag names, or None where they agree: the matmul-class ops that carry most of the model FLOPs
    ran in :func:`training_precision`'s dtype, not the flag's (e.g. transformers' ``grouped_mm``
    experts under ``bf16-mixed``: ``torch._grouped_mm`` has no autocast kernel, torch 2.13, so
    with fp32 weights the expert GEMMs run in fp32; docs/moe.md). ``env``: as for
    :func:`training_precision`. The sentence names the ops and their share of the model FLOPs."""
    flag = TRAINING_PRECISION.get(an.precision, "fp32")
    key = training_precision(an, env)
    if key == flag:
        return None
    env = an.bind() if env is None else env
    by_op: dict[str, float] = {}
    total = 0.0
    for op in an.ops:
        if op.cost.flops != 0:
            f = _num(op.repeat, env) * _num(op.cost.flops, env)
            total += f
            if op_precision(op, flag) == key:
                by_op[op.name] = by_op.get(op.name, 0.0) + f
    share = sum(by_op.values()) / total if total else 0.0
    names = ", ".join(sorted(by_op, key=by_op.get, reverse=True)[:3])
    why = (" (torch._grouped_mm has no autocast kernel: an MoE's grouped expert GEMMs run in their weights' "
           "dtype)" if any("grouped_mm" in n for n in by_op) else "")
    return (f"{100 * share:.0f}% of the model FLOPs ({names}) run in {key}, not {flag} as --precision "
            f"{an.precision} suggests{why}: compute is timed and MFU divided at the {key} peak")


def bound_of(flops: float, nbytes: float, peak: float, bandwidth: float, written: float = 0,
             write_bandwidth: float | None = None, transcendental_seconds: float = 0.0,
             serial: bool = False, pack_seconds: float = 0.0) -> dict:
    """Roofline of one op execution.

    Args:
        flops: FLOPs; nbytes: bytes moved (read + written); peak: FLOP/s; bandwidth: byte/s;
        written: the part of ``nbytes`` written, timed at ``write_bandwidth`` (byte/s) where the
            device has one (a calibrated CPU), else at ``bandwidth``.
        transcendental_seconds: the time the device's special-function throughput needs for the
            op's transcendental evaluations (:meth:`Device.transcendental_seconds`), a third
            ceiling beside FLOP/s and bandwidth (0: none, or not timed on the device).
        serial: the op's memory and compute times add up (a row-normalising op on a device with
            ``serial_passes``: :meth:`symcost.hardware.devices.Device.op_seconds`).
        pack_seconds: a GEMM's packing pass before its multiply on such a device (reading and
            writing its [k, n] operand once), added to its compute time.

    Returns:
        ``intensity`` (FLOP/byte; None for an op that moves no bytes, e.g. one fused entirely
        into its region), ``ridge`` (peak / bandwidth, FLOP/byte), ``bound`` ("compute" when
        FLOPs / peak is the largest of the three times, i.e. intensity >= ridge on a
        one-bandwidth device; "memory" when the memory time is; "transcendental" when the
        special functions are: compute-bound on the special-function units), ``attainable``
        (FLOP/s = min(peak, FLOPs / memory time, FLOPs / transcendental time) = min(peak,
        bandwidth x intensity) for an op without transcendentals on a one-bandwidth device),
        ``seconds`` (max of the three times).
    """
    ridge = peak / bandwidth
    t_mem = (nbytes - written) / bandwidth + written / (write_bandwidth or bandwidth)
    t_cmp = flops / peak
    intensity = flops / nbytes if nbytes else None
    t, bound = op_time(t_cmp, t_mem, transcendental_seconds, serial, pack_seconds)
    return {
        "intensity": intensity, "ridge": ridge, "bound": bound,
        "attainable": peak if t == t_cmp else (flops / t if t else peak),
        "seconds": t,
    }


def pack_seconds(op, device: Device, env: Mapping) -> float:
    """Seconds a CPU BLAS spends packing a GEMM's [k, n] operand before the multiply (reading and
    writing it once, :meth:`Device.pack_seconds`) on a device with ``serial_passes``; 0 for other
    ops, matrix-vector products (m or n = 1 at ``env``) and other devices."""
    if not device.serial_passes:
        return 0.0
    pk = packed_operand(op.name, op.in_shapes, op.in_dtypes, op.out_shapes)
    if pk is None:
        return 0.0
    b, m, n = pk
    if _num(m, env) <= 1 or _num(n, env) <= 1:
        return 0.0
    b = _num(b, env)
    return device.pack_seconds(b)


def roofline(an, device: Device, sizes: Mapping[str, int] | None = None, fused: bool = True,
             crossing_symbol: str | None = None, with_formulas: bool = True,
             extra_bytes: Mapping[int, tuple[Any, ...]] | None = None) -> dict:
    """The roofline of every op of the training step at ``sizes`` on ``device``.

    Args:
        an: the Analysis.
        device: the device (peak FLOP/s per precision, bandwidth in byte/s).
        sizes: symbol values (others at the model's defaults).
        fused: time ops with their fused bytes (a compiled step, :mod:`symcost.graph.fusion`);
            False: the unfused bytes (eager PyTorch).
        crossing_symbol: also solve, for every matmul-class op, the value of this symbol at which
            it crosses the ridge (:func:`crossing`).
        with_formulas: also build the symbolic step time (:func:`formulas`) and each node's
            ``intensity_formula`` (False: both None, which saves the symbolic work).
        extra_bytes: op index -> ``(bytes, written bytes, fused bytes, fused written bytes)``
            (formulas, may be negative) added to that op's unfused and fused traffic before it is
            timed (a modelled change of what the op moves, e.g. a KV cache in another dtype:
            :func:`symcost.passes.inference.kv_traffic`); the fused bytes are kept >= 0 and the
            written part within them. The symbolic step time (``formulas``) does not include them.

    Returns:
        ``{"device", "precision", "fused", "nodes": [...], "step_seconds",
        "step_seconds_unfused", "mfu_ceiling", "model_flops", "per_phase", "per_module",
        "formulas", "notes", "crossings"}``. Each node: op, module, phase, repeat, precision,
        flops (all FLOPs of one execution), model_flops, bytes (unfused), fused_bytes,
        intensity (FLOP/byte of the bytes used for time), ridge, bound, attainable (FLOP/s),
        seconds (time bound of all ``repeat`` executions), share (of the step).

    Raises:
        SymcostError: bad sizes (see :meth:`Analysis.bind`), or a device without a figure.
    """
    from symcost.graph import fusion
    from symcost.tracing.modules import module_group

    env = an.bind(**(sizes or {}))
    fe = fusion.estimate(an)
    train_key = training_precision(an, env)
    bw = device.bandwidth
    notes: set[str] = set()
    why = precision_note(an, env)
    if why:
        notes.add(why)
    if not fe.exact:
        notes.add("this Analysis has no probe recordings: fused bytes are the unfused bytes")
    nodes = []
    t_fused = t_unfused = 0.0
    for op in an.ops:
        if op.cost.bytes == 0 and op.cost.flops_all == 0:
            continue
        key = op_precision(op, train_key)
        peak, used = device.peak_for(key)
        if used != key:
            notes.add(f"{device.key} lists no {key} figure: {key} ops use its {used} peak")
        rep = _num(op.repeat, env)
        F = _num(op.cost.flops_all, env)
        Fm = _num(op.cost.flops, env)
        Bu = _num(op.cost.bytes, env)
        Bf = _num(fe.node_bytes[op.index], env)
        Wf = _num(fe.node_written[op.index], env)
        Wu = _num(fusion.written_bytes(op), env)
        if extra_bytes and op.index in extra_bytes:
            dB, dW, dBf, dWf = (_num(x, env) for x in extra_bytes[op.index])
            Bu, Wu = Bu + dB, Wu + dW
            Bf = max(Bf + dBf, 0)
            Wf = min(max(Wf + dWf, 0), Bf)
        T = {k: _num(n, env) for k, n in op.cost.transcendentals.items()}
        t_tr = device.transcendental_seconds(T)
        if T and not t_tr:
            notes.add(f"{device.key} gives no transcendental rate: exp/log/erf/tanh/sin/sqrt are not timed")
        serial = device.serial_passes and op.name.rsplit(".", 1)[0] in ROW_NORMALISING
        t_pack = pack_seconds(op, device, env)
        rf = bound_of(F, Bf, peak, bw, Wf, device.write_bandwidth, t_tr, serial, t_pack)
        ru = bound_of(F, Bu, peak, bw, Wu, device.write_bandwidth, t_tr, serial, t_pack)
        r = rf if fused else ru
        t_fused += rep * rf["seconds"]
        t_unfused += rep * ru["seconds"]
        nodes.append({
            "index": op.index, "op": op.name, "module": op.module, "phase": op.phase, "repeat": rep,
            "precision": key, "flops": F, "model_flops": Fm, "bytes": Bu, "fused_bytes": Bf,
            "transcendentals": sum(T.values()), "transcendental_seconds": rep * t_tr,
            "intensity": r["intensity"], "ridge": r["ridge"], "bound": r["bound"],
            "attainable": r["attainable"], "seconds": rep * r["seconds"],
            "intensity_formula": (str(sympy.cancel(op.cost.flops_all / (fe.node_bytes[op.index] if fused else op.cost.bytes)))
                                  if (fe.node_bytes[op.index] if fused else op.cost.bytes) != 0 else "oo")
            if with_formulas else None,
        })
    step = t_fused if fused else t_unfused
    for n in nodes:
        n["share"] = n["seconds"] / step if step else 0.0
    model_flops = _num(an.flops("train"), env)
    peak_train, _ = device.peak_for(train_key)
    per_phase: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "flops": 0, "model_flops": 0, "bytes": 0,
                                                      "fused_bytes": 0, "memory_bound_seconds": 0.0})
    per_module: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "flops": 0, "bytes": 0, "fused_bytes": 0,
                                                       "memory_bound_seconds": 0.0})
    for n in nodes:
        for acc in (per_phase[n["phase"]], per_module[module_group(n["module"], an.layer_container, getattr(an, "stacks", None))]):
            acc["seconds"] += n["seconds"]
            acc["flops"] += n["repeat"] * n["flops"]
            acc["bytes"] += n["repeat"] * n["bytes"]
            acc["fused_bytes"] += n["repeat"] * n["fused_bytes"]
            if n["bound"] == "memory":
                acc["memory_bound_seconds"] += n["seconds"]
        per_phase[n["phase"]]["model_flops"] += n["repeat"] * n["model_flops"]
    out = {
        "device": device.to_json(),
        "precision": train_key,
        "fused": fused,
        "sizes": {str(k): v for k, v in env.items()},
        "nodes": nodes,
        "step_seconds": step,
        "step_seconds_fused": t_fused,
        "step_seconds_unfused": t_unfused,
        "model_flops": model_flops,
        "mfu_ceiling": model_flops / (step * peak_train) if step else 0.0,
        "per_phase": dict(per_phase),
        "per_module": dict(per_module),
        "formulas": formulas(an, device, fe, fused) if with_formulas else None,
        "notes": sorted(notes),
    }
    if crossing_symbol:
        out["crossings"] = crossings(an, device, crossing_symbol, env)
    return out


def formulas(an, device: Device, fe=None, fused: bool = True) -> dict:
    """Symbolic forms: step-time lower bound (seconds) as a sum of ``Max(FLOPs/peak,
    bytes/bandwidth, transcendentals/rate)`` over ops (read and written bytes apart where the
    device has a write bandwidth; the transcendental term where the op has any and the device a
    rate; on a ``serial_passes`` device the serial forms of :func:`symcost.hardware.devices.op_time`, GEMMs
    taken with m, n > 1), and the ridge points (FLOP/byte) per precision."""
    from symcost.graph import fusion

    fe = fe or fusion.estimate(an)
    train_key = training_precision(an)
    terms = []
    for op in an.ops:
        b = fe.node_bytes[op.index] if fused else op.cost.bytes
        if b == 0 and op.cost.flops_all == 0:
            continue
        peak, _ = device.peak_for(op_precision(op, train_key))
        w = fe.node_written[op.index] if fused else fusion.written_bytes(op)
        t_mem = (b - w) / sympy.Float(device.bandwidth, 6) + w / sympy.Float(device.write_bandwidth or device.bandwidth, 6)
        t_tr = sympy.Add(*[n / sympy.Float(r, 6) for k, n in op.cost.transcendentals.items()
                           if (r := device.rate_for(k))])
        t_cmp = sympy.Rational(1) * op.cost.flops_all / sympy.Float(peak, 6)
        pk = packed_operand(op.name, op.in_shapes, op.in_dtypes, op.out_shapes) if device.serial_passes else None
        if device.serial_passes and op.name.rsplit(".", 1)[0] in ROW_NORMALISING:
            terms.append(op.repeat * (t_mem + sympy.Max(t_cmp, t_tr)))
        elif pk is not None:  # a GEMM on a CPU (m, n > 1): packing, then the multiply
            pack = device.pack_seconds(pk[0])
            terms.append(op.repeat * sympy.Max(t_mem, t_cmp + pack))
        else:
            terms.append(op.repeat * sympy.Max(t_cmp, t_mem, *([t_tr] if t_tr != 0 else [])))
    return {
        "step_seconds": str(sympy.Add(*terms)),
        "ridge": {k: v / device.bandwidth for k, v in device.peak.items()},
    }


def crossing(flops: sympy.Expr, nbytes: sympy.Expr, symbol: str, ridge: float,
             env: Mapping[sympy.Symbol, int]) -> dict:
    """Where an op crosses the ridge: the value of ``symbol`` at which FLOPs = ridge x bytes.

    Solves ``flops - r * bytes = 0`` for the symbol with sympy (symbolically in the other symbols
    and the ridge r when the equation is at most quadratic in it), then at ``env`` and
    ``r = ridge``. Where the equation is no polynomial in the symbol (an MoE inference step's
    weight bytes hold the power (1 − R/E)^(B·S) of the experts hit, docs/moe.md) there is no
    closed form: ``solution`` is None and the value is the first positive root found numerically
    (sign changes on a geometric grid from 2^-10 to 2^40, then bisection to float precision).

    Returns:
        ``{"symbol", "solution" (formula, or None), "value" (float or None), "compute_bound"}``
        where ``compute_bound`` is ``"symbol >= value"`` / ``"symbol <= value"``, ``"always"``
        or ``"never"`` (intensity on the same side of the ridge at every positive value).
    """
    X = SYMS[symbol]
    r = sympy.Symbol("r", positive=True)
    eq = sympy.expand(flops - r * nbytes)
    solution = None
    if X in eq.free_symbols and not eq.is_polynomial(X):
        return _crossing_numeric(flops, nbytes, eq, X, r, symbol, ridge, env)
    if X in eq.free_symbols and sympy.degree(eq, X) == 1:  # a·X + b = 0 (no simplify pass: fast)
        a, b = sympy.Poly(eq, X).all_coeffs()
        solution = [str(sympy.cancel(-b / a))]
    elif X in eq.free_symbols and sympy.degree(eq, X) == 2:
        sols = sympy.solve(eq, X)
        if sols:
            solution = [str(s) for s in sols]
    others = {k: v for k, v in env.items() if k != X}
    num = sympy.Poly(eq.subs(others).subs(r, sympy.Float(ridge, 15)), X) if X in eq.free_symbols else None

    def intensity_at(x):
        e = {**others, X: x}
        b = float(nbytes.subs(e)) if isinstance(nbytes, sympy.Basic) else float(nbytes)
        f = float(flops.subs(e)) if isinstance(flops, sympy.Basic) else float(flops)
        return f / b if b else math.inf

    roots = []
    if num is not None and num.degree() > 0:
        roots = sorted(float(sympy.re(x)) for x in num.nroots(n=15) if abs(sympy.im(x)) < 1e-9 and sympy.re(x) > 0)
    if not roots:
        state = "always" if intensity_at(env.get(X, 1)) >= ridge else "never"
        return {"symbol": symbol, "solution": solution, "value": None, "compute_bound": state}
    x0 = roots[0]
    above = intensity_at(x0 * 2 + 1) >= ridge
    return {"symbol": symbol, "solution": solution, "value": x0,
            "compute_bound": f"{symbol} >= {x0:.6g}" if above else f"{symbol} <= {x0:.6g}"}


def _crossing_numeric(flops, nbytes, eq, X, r, symbol: str, ridge: float, env) -> dict:
    """:func:`crossing` where ``eq`` (flops − r·bytes) is no polynomial in ``X``: the first
    positive root by sign changes on a geometric grid (2^-10 .. 2^40, 4 points per octave) and
    bisection; ``solution`` None (no closed form)."""
    others = {k: v for k, v in env.items() if k != X}
    g = sympy.lambdify(X, eq.xreplace(others).subs(r, sympy.Float(ridge, 15)), "mpmath")

    def val(x: float) -> float:
        return float(g(x))

    grid = [2.0 ** (k / 4) for k in range(-40, 161)]
    ys = [val(x) for x in grid]
    x0 = None
    for (a, ya), (b, yb) in zip(zip(grid, ys), zip(grid[1:], ys[1:])):
        if ya == 0:
            x0 = a
            break
        if (ya < 0) != (yb < 0):
            for _ in range(200):
                m = (a + b) / 2
                if m in (a, b):
                    break
                ym = val(m)
                if (ym < 0) == (ya < 0):
                    a, ya = m, ym
                else:
                    b = m
            x0 = (a + b) / 2
            break
    if x0 is None:
        state = "always" if val(float(env.get(X, 1))) >= 0 else "never"
        return {"symbol": symbol, "solution": None, "value": None, "compute_bound": state}
    above = val(x0 * 2 + 1) >= 0
    return {"symbol": symbol, "solution": None, "value": x0,
            "compute_bound": f"{symbol} >= {x0:.6g}" if above else f"{symbol} <= {x0:.6g}"}


def crossings(an, device: Device, symbol: str, env: Mapping[sympy.Symbol, int]) -> list[dict]:
    """:func:`crossing` for every distinct matmul-class op (unfused bytes: the op's own kernel).

    Raises:
        SymcostError: ``symbol`` is not a symbol of the model.
    """
    if symbol not in an.symbols:
        raise SymcostError(f"--crossing {symbol}: not a symbol of {an.model}; accepted: {', '.join(an.symbols)}")
    train_key = training_precision(an, env)
    seen = set()
    out = []
    for op in an.ops:
        if op.family != "model" or op.cost.flops == 0:
            continue
        key = (op.name, op.cost.flops_all, op.cost.bytes)
        if key in seen:
            continue
        seen.add(key)
        ridge = device.ridge(op_precision(op, train_key))
        c = crossing(op.cost.flops_all, op.cost.bytes, symbol, ridge, env)
        c.update({"op": op.name, "module": op.module, "phase": op.phase, "ridge": ridge,
                  "intensity_formula": str(sympy.cancel(op.cost.flops_all / op.cost.bytes))})
        out.append(c)
    return out


# -- tokens, compute, MFU and time ----------------------------------------------------------------
def parse_count(text: str | int | float, what: str) -> int:
    """``"300e9"``, ``"15e12"``, ``"1_000"``, ``1024`` -> a positive integer (exactly: decimal
    scientific notation is read without float rounding).

    Raises:
        SymcostError: not a positive whole number.
    """
    from decimal import Decimal, InvalidOperation

    try:
        d = Decimal(str(text).replace("_", "").strip())
    except InvalidOperation:
        raise SymcostError(f"{what} takes a positive whole number such as 300e9, got {text!r}") from None
    if not d.is_finite() or d <= 0 or d != d.to_integral_value():
        raise SymcostError(f"{what} takes a positive whole number such as 300e9, got {text!r}")
    return int(d)


def _exact(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


#: ``--recompute`` modes: none, selective (the attention core), full (every block)
RECOMPUTE = ("none", "selective", "full")


def parse_fraction(text: str | float, what: str) -> float:
    """A utilization such as ``0.45``, ``45%``, ``140/312`` or ``140e12/312e12`` -> a float in (0, 1].

    Raises:
        SymcostError: not a number or a ratio of two numbers, or outside (0, 1].
    """
    from decimal import Decimal, InvalidOperation

    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            x = Fraction(Decimal(raw[:-1].strip())) / 100
        elif "/" in raw:
            a, b = raw.split("/", 1)
            x = Fraction(Decimal(a.strip())) / Fraction(Decimal(b.strip()))
        else:
            x = Fraction(Decimal(raw))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        raise SymcostError(f"{what} takes a fraction of peak such as 0.45, 45% or 140/312, got {text!r}") from None
    if not 0 < x <= 1:
        raise SymcostError(f"{what} must lie in (0, 1] (above 100% of peak is impossible), got {text!r} = {float(x):.4g}")
    return float(x)


def recompute_flops(an, recompute: str = "none") -> sympy.Expr:
    """Matmul FLOPs one training step adds by activation recomputation, a formula in the symbols.

    ``full`` (Narayanan et al. 2021, sec. 3.5; ``torch.utils.checkpoint`` around each of the L
    blocks, Hugging Face's ``gradient_checkpointing_enable``, ``symcost checkpoint --plan
    every-layer``): the step traced with every block checkpointed
    (:func:`symcost.passes.checkpoint.uniform_spec`, k = 1, in ``an``'s regime) less the plain
    step: each block's forward once more, up to the checkpoint's early stop (ops after a block's
    last saved tensor are not rerun); never the embedding, the final norm, the LM head or the loss.
    ``selective`` (Korthikanti et al. 2022, sec. 4.2: the attention core, Q·Kᵀ, softmax, dropout
    and attention over V, checkpointed): the forward score products Q·Kᵀ of unfused attention
    (attention matmuls whose output's last dimension is the key length S) once more. PyTorch's
    non-reentrant checkpoint stops after the last tensor the region saves (the dropped-out
    probabilities), so P·V, whose output nothing in the region saves, is not rerun; Megatron-LM's
    reentrant checkpoint reruns it too (Korthikanti et al. count both products, 4·B·S²·h per
    layer, twice this). A fused attention kernel keeps no scores; its backward already recomputes
    them (hardware FLOPs, ``flops_hw``), so selective recomputation adds nothing there.

    Raises:
        SymcostError: unknown mode; ``full`` on a model whose blocks cannot be traced checkpointed;
            a mode on a step traced with ``--ac`` (its recomputation is in the trace already).
    """
    if recompute not in RECOMPUTE:
        raise SymcostError(f"--recompute takes {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "none":
        return sympy.Integer(0)
    from symcost.frontends.layout import layout_of

    if layout_of(an).ac:  # the traced step recomputes already (its hardware FLOPs): counted once
        raise SymcostError(f"--recompute {recompute} with --ac {layout_of(an).ac}: the step was traced with its "
                           "checkpointing, whose recomputation is already in its hardware FLOPs; give one of them")
    if recompute == "selective":
        S = SYMS["S"]
        return sympy.expand(sympy.Add(*[  # the score products: an output over the keys (last dim S)
            op.repeat * op.cost.flops_hw for op in an.ops
            if op.attention and op.phase == "forward" and "attention" not in op.name
            and op.out_shapes and sympy.sympify(op.out_shapes[0][-1]).has(S)]))
    from symcost.passes import checkpoint

    # the every-layer trace given for an's request (symcost.commands: read from the trace cache),
    # else traced now in an's own regime
    sub = checkpoint.every_layer(an, getattr(an, "request_sizes", None) or None).with_attention_flops(getattr(an, "attention_count", "full"))
    return sympy.expand(sub.flops("train", "hardware") - an.flops("train", "hardware"))


def tokens_compute(an, sizes: Mapping[str, int] | None, tokens: int | None = None,
                   recompute: str = "none") -> dict:
    """Per-token FLOPs and the compute of a token budget, model and hardware.

    ``flops.per_token`` = model FLOPs of one training step / (B·S) (B·S/CP: a context-parallel
    rank's tokens, :mod:`symcost.frontends.context_parallel`) (a formula and its value; the
    same for every attention kernel and any recomputation: what MFU, 6·N·P and ``time --mfu``
    count). ``flops.per_token_hardware`` = what the step really multiplies: model FLOPs plus the
    kernels' own extra work (``flops.kernel_extra_step``: a fused attention backward's recomputed
    scores, :meth:`Analysis.flops` ``kind="hardware"``) plus ``recompute``
    (``flops.recompute_step``, :func:`recompute_flops`): HFU's numerator (Chowdhery et al. 2022,
    App. B).

    ``sizes`` (every symbol's value used, B and S included) and ``params`` (all parameters) say
    which model was counted. With ``tokens``: ``compute.total`` = model FLOPs of a step x tokens / (B·S) and
    ``compute.hardware`` the same with hardware FLOPs, exactly (rationals; integers when B·S
    divides), next to ``compute.6NP`` = 6·P·tokens (Kaplan et al. 2020, eq. 2.1, P the matmul
    parameters one token runs through, ``params_active_matmul``: :attr:`Analysis.params_matmul`
    for a dense model, R of the E routed experts for a mixture of experts, as the report's
    6·N·P form and shared/conventions.md; ``params_matmul`` stays the count over all experts)
    and, under ``full``, ``compute.8NP`` = 8·P·tokens (Narayanan et al. 2021, sec. 5.1: one
    more forward). An encoder-decoder counts each stack's weights on the tokens it processes, as
    the report's form (:meth:`~symcost.graph.conventions.Conventions.six_np_pairs`; Raffel et al.
    2020 §3.2.2): ``flops.per_token_6P`` = 6·(B·S_enc·P_enc + B·S·P_dec) / (B·S) (exact), the
    tokens being the B·S target tokens of a step as in ``compute.total``, and ``six_np.groups``
    lists each pair (``tokens``: N's factors, ``N`` and ``P`` at ``sizes``).

    Raises:
        SymcostError: bad sizes or recompute mode.
    """
    extra = recompute_flops(an, recompute)
    env = an.bind(**(sizes or {}))
    B, S = (an.pinned.get(n) or env[SYMS[n]] for n in ("B", "S"))
    train = an.flops("train")
    kernel = sympy.expand(an.flops("train", "hardware") - train)
    step_flops, step_kernel, step_rec = _num(train, env), _num(kernel, env), _num(extra, env)
    step_hw = step_flops + step_kernel + step_rec
    from symcost.graph.totals import params_active_matmul

    P = _num(params_active_matmul(an), env)  # the P of 6·N·P: a token's matmul parameters (R of E experts)
    Bs, Ss = (sympy.Integer(an.pinned[n]) if n in an.pinned else SYMS[n] for n in ("B", "S"))
    from symcost.frontends.layout import layout_of

    if layout_of(an).cp:  # (context parallelism: the rank's step holds S/CP of each sequence's tokens)
        cp = an.pinned.get("CP") or env[SYMS["CP"]]
        S, Ss = int(S) // int(cp), Ss / cp  # (exact: 2·CP divides S, the spec's constraint)
    per_token_formula = sympy.factor_terms(sympy.cancel(sympy.expand(train) / (Bs * Ss)))
    out: dict[str, Any] = {
        "sizes": {str(k): int(v) for k, v in env.items()},
        "params": _num(an.params, env),
        "flops.per_token": _exact(Fraction(step_flops, B * S)),
        "flops.per_token_formula": str(per_token_formula),
        "flops.train_step": step_flops,
        "flops.per_token_hardware": _exact(Fraction(step_hw, B * S)),
        "flops.train_step_hardware": step_hw,
        "flops.kernel_extra_step": step_kernel,
        "flops.recompute_step": step_rec,
        "tokens_per_step": B * S,
        "params_matmul": _num(an.params_matmul, env),  # (all experts)
        "params_active_matmul": P,
        "recompute": recompute,
    }
    # 6·N·P per token: 6·P, or an encoder-decoder's 6·(B·S_enc·P_enc + B·S·P_dec) / (B·S), the
    # pairs of the report's form (Conventions.six_np_pairs, one split for every command)
    pairs = an.six_np_pairs()
    P6 = Fraction(6 * P)
    if len(pairs) > 1:
        groups = [{"tokens": "·".join(str(f) for f in N), "N": _num(sympy.Mul(*N), env), "P": _num(Pk, env)}
                  for N, Pk in pairs]
        out["six_np.groups"] = groups
        P6 = Fraction(6 * sum(g["N"] * g["P"] for g in groups), B * S)
    out["flops.per_token_6P"] = _exact(P6)
    if recompute == "full":
        out["flops.per_token_8P"] = _exact(P6 * Fraction(8, 6))
    if tokens is not None:
        out["tokens"] = tokens
        out["compute.total"] = _exact(Fraction(step_flops * tokens, B * S))
        out["compute.hardware"] = _exact(Fraction(step_hw * tokens, B * S))
        out["compute.6NP"] = _exact(P6 * tokens)
        if recompute == "full":
            out["compute.8NP"] = _exact(P6 * Fraction(8, 6) * tokens)
        out["compute.steps"] = _exact(Fraction(tokens, B * S))
    return out


def mfu(flops_per_token: float, tokens_per_second: float, devices: int, peak: float) -> float:
    """Model FLOPs utilization (PaLM's definition, Chowdhery et al. 2022, App. B):
    model FLOPs per token x tokens/s / (devices x peak FLOP/s at the training precision).

    Raises:
        SymcostError: an MFU above 1 (the throughput is impossible on that device count).
    """
    if devices <= 0 or tokens_per_second <= 0:
        raise SymcostError("--devices and --tokens-per-second must be positive")
    u = flops_per_token * tokens_per_second / (devices * peak)
    if u > 1:
        raise SymcostError(
            f"implied MFU is {100 * u:.1f}%: {tokens_per_second:.6g} tokens/s x {flops_per_token:.6g} FLOP/token "
            f"exceeds {devices} x {peak:.4g} FLOP/s peak; check --tokens-per-second, --devices and --device")
    return u


def train_time(total_flops: float, devices: int, peak: float, utilization: float) -> dict:
    """Wall-clock time of ``total_flops`` on ``devices`` devices at ``utilization`` x peak.

    seconds = total FLOPs / (devices x peak x utilization) (Narayanan et al. 2021, eq. 4 with
    the achieved FLOP/s X = peak x utilization); also days and device-hours.

    Raises:
        SymcostError: utilization not in (0, 1] or devices not positive.
    """
    if not 0 < utilization <= 1:
        raise SymcostError(f"--mfu must lie in (0, 1] (an MFU above 100% is impossible), got {utilization}")
    if devices <= 0:
        raise SymcostError("--devices must be a positive integer")
    s = total_flops / (devices * peak * utilization)
    return {"seconds": s, "days": s / 86400, "device_hours": s * devices / 3600}

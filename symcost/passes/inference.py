"""The inference pass: KV-cache bytes, the decode roofline, prefill time to first token and the
largest serving batch under a memory cap.

Takes the :class:`~symcost.graph.analysis.Analysis` of inference steps (``symcost.trace(...,
step="decode" | "prefill")``: a forward through the model's own KV cache, with the cache length T
as a symbol for decode) and a :class:`~symcost.hardware.devices.Device`; returns plain data.
Nothing here prints (text: :mod:`symcost.render.inference`). Derivations and sources:
docs/inference.md.

- **KV cache** (:func:`kv_cache`): the bytes of the storages the model's cache holds after the
  step, fitted from the traced cache (``Analysis.kv_bytes``): grouped-query heads, a separate
  ``head_dim``, sliding windows and the dtype come out of the trace, never a typed formula.
  Per token = the cache's bytes / (B·(T + S)) (all layers, one sequence), per sequence = at B = 1.
- **Decode roofline** (:func:`decode`): the step's per-op roofline
  (:func:`symcost.passes.roofline.roofline`, fused bytes: a compiled step), whose sum is the time
  per output token bound; beside it the textbook aggregate form, time >= max(FLOPs / peak,
  (weight bytes + KV bytes) / bandwidth) (Pope et al., "Efficiently Scaling Transformer
  Inference", MLSys 2023, sec. 2: at small batch decode is bound by loading the weights and the
  cache), and the batch at which the aggregate becomes compute-bound, FLOPs(B) = ridge x bytes(B)
  solved for B with sympy (:func:`symcost.passes.roofline.crossing`). A mixture of experts reads
  the weights of the experts the step's tokens hit, E·(1 − (1 − R/E)^(B·S)) per layer in
  expectation under uniform routing, in the aggregate (:func:`weight_bytes`) and per op
  (:func:`step_traffic`; docs/moe.md, "Experts a step reads").
- **Prefill** (:func:`prefill`): the per-op roofline of the prefill step, the time to first token
  bound.
- **Serving memory** (:func:`serving_memory`, :func:`max_batch`): weights + buffers + inputs + the
  KV cache after a decode step at T = context - 1 (every sequence at the full context) + the
  step's largest transient live set (the storage schedule of the traced step; where the step
  replaces the cache's tensors, a DynamicCache's ``torch.cat``, the new and the old tensor are in
  it as the allocator holds them, from a start of the cache before the step minus after it:
  ``MemorySchedule.kv_start``), i.e. the training memory model (:class:`~symcost.passes.memory.MemoryModel`)
  with no gradients, optimizer state or master weights; the largest B is solved by its solver and
  checked at the boundary exactly as ``max-batch`` checks it: M(B) <= cap < M(B + 1).
- **A KV cache in another dtype** (:func:`kv_dtype`, ``serve --kv-dtype``): *modelled*, not
  traced. The cache's bytes (the trace's) times itemsize(new) / itemsize(traced) in the memory
  model (:class:`~symcost.passes.memory.MemoryModel`'s ``kv_scale``), the KV sizes and the
  aggregate roofline; in the per-op roofline, the bytes each op moves from or into the cache's
  storages (``SymOp.kv_reads`` / ``kv_writes``, found by storage in the trace) scaled the same
  way (:func:`kv_traffic`). Quantisation scales (per channel / per token) are not counted.
"""
from __future__ import annotations

import dataclasses
import weakref
from fractions import Fraction
from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.hardware.devices import Device
from symcost.tracing.fit import SYMS
from symcost.passes.memory.policies import Optimizer, policy
from symcost.graph.totals import is_routed
from symcost.passes.roofline import _num, crossing, roofline, training_precision

#: The optimizer of an inference step: none (no state, no step, no temporaries).
NO_OPTIMIZER = Optimizer("none", 0, False, False, "no optimizer (inference)")

_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}


def _itemsize(dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise SymcostError(f"no element size known for dtype {name}")
    return _ITEMSIZE[name]


#: ``--kv-dtype`` names -> the element dtype a cache in that format holds (int8 and fp8: 1 byte)
KV_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclasses.dataclass(frozen=True)
class KVDtype:
    """The KV cache's element dtype for the costs: the traced one, or one modelled in its place.

    Attributes:
        name: as asked (``fp8``) or the traced dtype's name when none was.
        dtype: the element dtype's torch name (``float8_e4m3fn``).
        traced: the traced cache's dtype name (``bfloat16``).
        scale: itemsize(dtype) / itemsize(traced), exact (fp8 over bf16: 1/2).
        modelled: True when the dtype is not the traced one's (the bytes are scaled, not traced).
    """

    name: str
    dtype: str
    traced: str
    scale: Fraction
    modelled: bool

    def to_json(self) -> dict:
        """``{"dtype", "element", "bytes" (per element), "from" (traced), "modelled", "scale"}``."""
        return {"dtype": self.name, "element": self.dtype,
                "bytes": _itemsize(self.dtype) if self.dtype in _ITEMSIZE else None, "from": self.traced,
                "modelled": self.modelled, "scale": float(self.scale)}


def cache_dtype(an) -> str:
    """The dtype of the KV cache's tensors in the trace: that of every op input read from the
    cache's storages and every output written into them (``SymOp.kv_reads`` / ``kv_writes``).

    Raises:
        SymcostError: a training step; no op touches the cache; the cache holds several dtypes.
    """
    names = cache_dtypes(an)
    if len(names) > 1:
        raise SymcostError(f"{an.model}: the KV cache holds several dtypes ({', '.join(sorted(names))}); "
                           "--kv-dtype needs one")
    return names.pop()


def cache_dtypes(an) -> set[str]:
    """The dtypes of the cache's tensors in the trace (:func:`cache_dtype`), all of them: a Mamba-2
    cache in bf16 holds its conv states in bf16 and its SSM states in fp32.

    Raises:
        SymcostError: a training step; no op touches the cache.
    """
    if getattr(an, "step", "train") == "train":
        raise SymcostError(f"{an.model}: a training step has no KV cache; trace step='decode' or 'prefill'")
    from symcost.graph.opsets import dtype_names  # by name: a warm run imports no torch

    names = set()
    for op in an.ops:
        if getattr(op, "kv_reads", ()):
            ins = dtype_names(op.in_dtypes)
            names.update(ins[k] for k in op.kv_reads)
        if getattr(op, "kv_writes", ()):
            outs = dtype_names(op.out_dtypes)
            names.update(outs[k] for k in op.kv_writes)
    if not names:
        raise SymcostError(f"{an.model}: no op of this trace reads or writes the KV cache's storages; "
                           "cannot tell its dtype (trace it again: symcost trace --no-cache)")
    return names


def kv_dtype(an, name: str | None = None) -> KVDtype:
    """The KV-cache dtype to cost ``an``'s cache in: ``name`` (one of :data:`KV_DTYPES`, modelled
    unless it is the traced dtype) or, with None, the traced cache's own (:func:`cache_dtype`;
    ``"unknown"`` where the trace cannot tell it, the dtypes joined by "+" where the cache holds
    several, e.g. ``"bfloat16+float32"``: nothing is scaled then).

    Raises:
        SymcostError: an unknown name (the message lists the accepted ones); with a name, as
            :func:`cache_dtype`.
    """
    if name is not None and name not in KV_DTYPES:
        raise SymcostError(f"unknown --kv-dtype {name!r}; accepted: {', '.join(KV_DTYPES)}")
    if name is None:
        try:
            traced = "+".join(sorted(cache_dtypes(an)))
        except SymcostError:  # nothing to scale: the traced cache as it is, its dtype unnamed
            return KVDtype("traced", "unknown", "unknown", Fraction(1), False)
        return KVDtype(traced, traced, traced, Fraction(1), False)
    traced = cache_dtype(an)
    dtype = KV_DTYPES[name] if name is not None else traced
    scale = Fraction(_itemsize(dtype), _itemsize(traced))
    return KVDtype(name or traced, dtype, traced, scale, dtype != traced)


_TRAFFIC: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def kv_traffic(an, kv: KVDtype | None) -> dict[int, tuple[sympy.Expr, ...]]:
    """What a cache in ``kv.dtype`` changes in each op's traffic (for
    :func:`symcost.passes.roofline.roofline`'s ``extra_bytes``): op index -> ``(bytes, written,
    fused bytes, fused written)``, formulas: (scale - 1) x the bytes the op's count moves from or
    into the cache: the inputs read from its storages (``SymOp.kv_reads``: the attention's keys and
    values, an eager attention's copy of them to all heads, a DynamicCache's concatenation reading
    the old cache) and the outputs it allocates (``kv_writes``: the concatenation's result); for an
    in-place partial write (``index_copy_`` of the new token into a StaticCache) the slice
    written. The fused figures count only the inputs and outputs the fused estimate charges the op
    (:attr:`symcost.graph.fusion.FusionEstimate.charged`: a cache read inside a fused region is
    not charged, so it does not shrink either). Empty for ``kv`` None or not modelled."""
    from symcost.graph import fusion
    from symcost.graph.opsets import PARTIAL_WRITES, nbytes, partial_write_bytes

    if kv is None or not kv.modelled:
        return {}
    per = _TRAFFIC.setdefault(an, {})
    if kv.dtype in per:
        return per[kv.dtype]
    f = sympy.Rational(kv.scale.numerator, kv.scale.denominator) - 1
    charged = fusion.estimate(an).charged
    out = {}
    for op in an.ops:
        reads, writes = getattr(op, "kv_reads", ()), getattr(op, "kv_writes", ())
        if not reads and not writes:
            continue
        if op.name.rsplit(".", 1)[0] in PARTIAL_WRITES:  # its own kernel: fused = unfused
            if 0 not in reads:
                continue
            w = sympy.expand(f * partial_write_bytes(op)[1])
            out[op.index] = (w, w, w, w)
            continue
        ins, outs = (charged or {}).get(op.index, (reads, writes))
        r = sum((nbytes(op.in_shapes[k], op.in_dtypes[k]) for k in reads), sympy.Integer(0))
        w = sum((nbytes(op.out_shapes[k], op.out_dtypes[k]) for k in writes), sympy.Integer(0))
        rf = sum((nbytes(op.in_shapes[k], op.in_dtypes[k]) for k in reads if k in ins), sympy.Integer(0))
        wf = sum((nbytes(op.out_shapes[k], op.out_dtypes[k]) for k in writes if k in outs), sympy.Integer(0))
        if r == 0 and w == 0:
            continue
        out[op.index] = tuple(sympy.expand(f * x) for x in (r + w, w, rf + wf, wf))
    per[kv.dtype] = out
    return out


def _scaled(x, kv: KVDtype | None):
    """``x`` (bytes of the cache) in ``kv``'s dtype: exact where the result is whole."""
    if kv is None or kv.scale == 1:
        return x
    if isinstance(x, sympy.Basic):
        return sympy.expand(sympy.Rational(kv.scale.numerator, kv.scale.denominator) * x)
    v = Fraction(x) * kv.scale
    return int(v) if v.denominator == 1 else float(v)


def encoder_decoder(an) -> bool:
    """Whether ``an`` is an inference step of an encoder-decoder (``hf:`` T5, BART, Whisper:
    :mod:`symcost.frontends.hf_encdec`): its prefill is the encoder over S_enc positions and the
    first decoder step, and its KV cache holds the cross-attention keys and values too."""
    return (getattr(an.spec, "extra", {}) or {}).get("task") in ("seq2seq", "speech-seq2seq")


def cache_kind(an) -> str:
    """What the cache of ``an`` (an inference step) holds: ``"kv"`` (attention keys and values,
    one token more per step: decoder-only and encoder-decoder transformers), ``"state"`` (a
    state-space model's recurrent states, ``hf:mamba``, ``hf:mamba2``: per layer a conv state and an
    SSM state of fixed size, written in place, the bytes do not grow with T) or ``"kv+state"`` (a
    hybrid, ``hf:jamba``, ``hf:zamba``, ``hf:zamba2``: the Mamba layers' states beside the attention
    layers' keys and values, which alone grow with T). A state-space model is one whose spec says
    so (``extra["state_space"]``: :mod:`symcost.frontends.hf_ssm`, ``hf_tasks.ssm_spec``); whether
    it also holds keys and values is read off the trace (the cache's bytes depend on T)."""
    if not (getattr(an.spec, "extra", {}) or {}).get("state_space"):
        return "kv"
    return "kv+state" if an.kv_bytes.has(SYMS["T"]) else "state"


#: The decoder tokens of an encoder-decoder's first step (``generate``'s ``decoder_input_ids``: the
#: decoder start token; Whisper's forced task tokens would be a few more).
ENCDEC_PROMPT = 1


def _check(an, step: str) -> None:
    if getattr(an, "step", "train") != step:
        raise SymcostError(f"{an.model}: this analysis is of a {getattr(an, 'step', 'train')} step, not {step} "
                           f"(trace it with symcost.trace(..., step={step!r}))")


def _tokens(an, env) -> tuple[int, int]:
    """(B, T + S): the sequences and the tokens each holds in the cache after the step."""
    val = lambda s: int(an.pinned[s]) if s in an.pinned else int(env[SYMS[s]])  # noqa: E731
    T = val("T") if an.step == "decode" else 0
    return val("B"), T + val("S")


def read_params(an) -> set[str]:
    """Folded names of the parameters the traced step's ops read (directly or through views and
    casts): the parameter nodes of ``an.graph``, which the graph holds only where an op takes the
    parameter as an input. An encoder-decoder's decode step reads none of the encoder's (the encoder
    runs once, in the prefill) nor the cross-attention's key and value projections (their outputs
    are cached by the first step)."""
    return {n for n in an.param_shapes if f"param:{n}" in an.graph}


def weight_bytes(an) -> sympy.Expr:
    """Bytes of the parameters an inference step reads: every parameter its ops read
    (:func:`read_params`; tied ones once, in its traced dtype) but the tables only read by an
    embedding lookup (a lookup reads B·S rows, which the step's ops count). A mixture of experts reads the weights of the experts its tokens hit:
    each routed expert stack (:func:`symcost.graph.totals.is_routed`) counts f =
    :func:`symcost.passes.moe.hit_fraction` of its bytes, f = (1 − (1 − R/E)^(B·S)) under
    ``balanced`` routing (R/E for one token, tending to 1 as B·S grows; docs/moe.md, "Experts a
    step reads"), 1 under ``capacity``. A polynomial for a dense model; for an MoE model a sympy
    expression with that power of B·S. Bytes."""
    from symcost.passes.moe import hit_fraction

    lookup = {n for n, why in an.embedding_params.items() if why == "lookup" and n not in an.matmul_params}
    lookup |= set(an.param_shapes) - read_params(an)  # (not read by the step at all)
    f = hit_fraction(an)
    routed = {n for n in an.param_shapes if is_routed(an, n)} if f != 1 else set()
    dense = sympy.expand(sympy.Add(*[
        rep * sympy.Mul(*shape) * _itemsize(dtype)
        for n, (shape, dtype, rep) in an.param_shapes.items() if n not in lookup and n not in routed]))
    experts = sympy.expand(sympy.Add(*[
        rep * sympy.Mul(*shape) * _itemsize(dtype)
        for n, (shape, dtype, rep) in an.param_shapes.items() if n in routed and n not in lookup]))
    return dense + f * experts if experts != 0 else dense


def step_traffic(an, kv: KVDtype | None = None) -> dict[int, tuple[sympy.Expr, ...]]:
    """The modelled changes of an inference step's per-op traffic, for
    :func:`symcost.passes.roofline.roofline`'s ``extra_bytes``: a KV cache in ``kv``'s dtype
    (:func:`kv_traffic`) plus, for a mixture of experts, only the experts hit read
    (:func:`symcost.passes.moe.expert_traffic`), summed per op (bytes)."""
    from symcost.passes.moe import expert_traffic

    out = dict(kv_traffic(an, kv))
    for i, d in expert_traffic(an).items():
        out[i] = tuple(a + b for a, b in zip(out[i], d)) if i in out else d
    return out


def kv_cache(an, sizes: Mapping[str, int] | None = None, kv: KVDtype | None = None) -> dict:
    """The KV cache of an inference step at ``sizes`` (others at the model's defaults); with
    ``kv`` (:func:`kv_dtype`) every byte count in that dtype (the traced bytes x ``kv.scale``).

    Returns:
        ``total`` (bytes the cache holds after the step: B sequences of T + S tokens, every
        layer), ``per_sequence`` (the same at B = 1), ``per_token`` (total / (B·(T + S)): one
        token of one sequence, every layer; a float where a sliding window keeps fewer tokens),
        ``tokens`` (T + S), ``formula`` (the total, a polynomial string), ``per_token_formula``
        (d total / d T / B where T is a symbol: the bytes each further cached token adds),
        ``layers`` (per folded layer: name, bytes formula, repeat), ``kv_cache`` (the class),
        ``kv_dtype`` (:meth:`KVDtype.to_json`, with ``kv``), ``cache`` (:func:`cache_kind`); a
        state-space model's decode step (``cache`` "state" or "kv+state") ``state_per_sequence``:
        the recurrent states' bytes of one sequence, which do not grow with its tokens (the traced
        total at T + S = 0, B = 1: the Mamba layers' conv and SSM states; the attention layers'
        keys and values are the rest, ``per_token_formula`` bytes per token).

    Raises:
        SymcostError: a training analysis; bad sizes.
    """
    if getattr(an, "step", "train") == "train":
        raise SymcostError(f"{an.model}: a training step has no KV cache; trace step='decode' or 'prefill'")
    env = an.bind(**dict(sizes or {}))
    B, n = _tokens(an, env)
    kvb = _scaled(an.kv_bytes, kv)
    total = _num(an.kv_bytes, env)
    one = _num(an.kv_bytes, {**env, SYMS["B"]: 1}) if "B" in an.symbols else total
    per_token = Fraction(total, B * n) * (kv.scale if kv is not None else 1)
    total, one = _scaled(total, kv), _scaled(one, kv)
    out = {"total": total, "per_sequence": one,
           "per_token": int(per_token) if per_token.denominator == 1 else float(per_token),
           "tokens": n, "batch": B, "formula": str(kvb), "kv_cache": an.kv_cache, "cache": cache_kind(an),
           "layers": [[name, str(_scaled(nb, kv)), str(rep)] for name, nb, rep in an.kv_layers]}
    if kv is not None:
        out["kv_dtype"] = kv.to_json()
    if "T" in an.symbols:
        Bs = SYMS["B"] if "B" in an.symbols else sympy.Integer(B)
        out["per_token_formula"] = str(sympy.factor_terms(sympy.cancel(sympy.diff(kvb, SYMS["T"]) / Bs)))
        if encoder_decoder(an):
            # the cross-attention keys and values over the S_enc source positions: the bytes that do
            # not grow with the decoder's tokens, the traced total at T + S = 0 (one sequence)
            S = int(an.pinned["S"]) if "S" in an.pinned else env[SYMS["S"]]
            out["cross_per_sequence"] = _scaled(_num(an.kv_bytes, {**env, SYMS["B"]: 1, SYMS["T"]: -S}), kv)
        elif out["cache"] != "kv":
            # the recurrent states: the bytes that do not grow with the tokens, the traced total at
            # T + S = 0 (one sequence; the attention layers' keys and values are 0 there)
            S = int(an.pinned["S"]) if "S" in an.pinned else env[SYMS["S"]]
            out["state_per_sequence"] = _scaled(_num(an.kv_bytes, {**env, SYMS["B"]: 1, SYMS["T"]: -S}), kv)
    return out


def _roofline_summary(rf: dict) -> dict:
    per_bound: dict[str, float] = {}
    for n in rf["nodes"]:
        per_bound[n["bound"]] = per_bound.get(n["bound"], 0.0) + n["seconds"]
    return {"step_seconds": rf["step_seconds"], "seconds_by_bound": per_bound,
            "flops": sum(n["repeat"] * n["flops"] for n in rf["nodes"]),
            "model_flops": rf["model_flops"],
            "bytes": sum(n["repeat"] * n["fused_bytes"] for n in rf["nodes"]), "notes": rf["notes"]}


def decode(an, device: Device, sizes: Mapping[str, int] | None = None, fused: bool = True,
           with_crossing: bool = True, kv: KVDtype | None = None) -> dict:
    """The decode step on ``device``'s roofline at ``sizes`` (B, T; others at the defaults); with
    ``kv`` (:func:`kv_dtype`) the cache in that dtype: the aggregate's KV bytes x ``kv.scale`` and
    every op's bytes from or into the cache scaled alike (:func:`kv_traffic`). A mixture of
    experts' expert matmuls read the experts hit (:func:`step_traffic`).

    Returns:
        ``seconds_per_token`` (the per-op roofline's sum: no decode step at these sizes runs
        faster; each of the B sequences gets one token per step), ``tokens_per_second`` (B /
        that), ``roofline`` (its summary: seconds per binding resource, FLOPs, fused bytes),
        ``aggregate`` (``compute_seconds`` = all FLOPs / peak, ``memory_seconds`` = (weight
        bytes + KV bytes) / bandwidth, ``weight_bytes`` (:func:`weight_bytes`: an MoE's experts
        hit), ``kv_bytes``, ``bound``),
        ``crossing`` (the batch where the aggregate turns compute-bound:
        :func:`symcost.passes.roofline.crossing` of all FLOPs against weight + KV bytes in B,
        ``solution`` formulas in the ridge r and the other symbols (None for an MoE model: found
        numerically), ``value`` at these sizes;
        ``compute_bound`` "never" where the KV cache's bytes grow with B as fast as the FLOPs
        relative to the ridge; left out with ``with_crossing=False``), ``precision``, ``sizes``.

    Raises:
        SymcostError: not a decode analysis; bad sizes; a device without a figure.
    """
    _check(an, "decode")
    env = an.bind(**dict(sizes or {}))
    rf = roofline(an, device, {str(k): v for k, v in env.items() if str(k) in an.symbols}, fused=fused,
                  with_formulas=False, extra_bytes=step_traffic(an, kv))
    B, _ = _tokens(an, env)
    prec = training_precision(an, env)
    peak, _ = device.peak_for(prec)
    flops = an.flops("forward", "all")
    W = weight_bytes(an)
    kvb = _scaled(an.kv_bytes, kv)
    traffic = W + kvb
    F, Wn, KV = _num(flops, env), _num(W, env), _num(kvb, env)
    t_c, t_m = F / peak, (Wn + KV) / device.bandwidth
    out = {
        "precision": prec, "sizes": {str(k): int(v) for k, v in env.items()}, "batch": B,
        "seconds_per_token": rf["step_seconds"],
        "tokens_per_second": B / rf["step_seconds"] if rf["step_seconds"] else None,
        "roofline": _roofline_summary(rf),
        "aggregate": {"compute_seconds": t_c, "memory_seconds": t_m, "seconds": max(t_c, t_m),
                      "bound": "compute" if t_c >= t_m else "memory", "flops": F, "weight_bytes": Wn,
                      "kv_bytes": KV, "flops_formula": str(flops), "bytes_formula": str(traffic)},
    }
    if "B" in an.symbols and with_crossing:
        out["crossing"] = crossing(flops, traffic, "B", device.ridge(prec), env)
    tp = tp_comm(an, device, env)
    if tp is not None:
        out["tp"] = tp
        if tp["seconds"] is not None:  # the all-reduces sit between the ops that make and use their tensors
            out["seconds_per_token"] = rf["step_seconds"] + tp["seconds"]
            out["tokens_per_second"] = B / out["seconds_per_token"] if out["seconds_per_token"] else None
    return out


def tp_comm(an, device: Device, env) -> dict | None:
    """A tensor-parallel inference step's collectives (``serve --tp``; None for one device): the
    bytes one rank sends in them (``Analysis.comm_bytes``: the row-parallel projections'
    all-reduces, ring algorithm 2(TP-1)/TP × the tensor's bytes, :func:`symcost.graph.rules.comm_volume`)
    and their time over the device's scale-up link, ``bytes / link_bandwidth``
    (``Device.interconnect``; the TP ranks of one server share it), exposed: each all-reduce sits
    between the op that makes its tensor and the one that reads it (Shoeybi et al. 2019 §3, as
    :func:`symcost.passes.parallel.step_time` adds the TP group's). The per-collective latency
    (microseconds each, which dominate a decode step's small all-reduces) is not modelled.

    Returns:
        ``{"size": TP, "collectives": n per step, "bytes": per rank (B), "seconds" (None where the
        device lists no interconnect), "link", "link_bandwidth" (B/s), "note"}``, or None.
    """
    if not getattr(an, "tensor_parallel", None) and not str(getattr(an, "parallel", None) or "").startswith("tp"):
        return None
    tp = int(env.get(SYMS["TP"], an.pinned.get("TP", 1)))
    nbytes = _num(an.comm_bytes("total", "forward"), env)
    count = _num(sympy.Add(*[op.repeat for op in an.ops if op.comm is not None and op.comm[0] != "wait"]), env)
    ic = getattr(device, "interconnect", None) or {}
    bw = ic.get("link_bandwidth")
    return {"size": tp, "collectives": count, "bytes": nbytes, "seconds": nbytes / bw if bw else None,
            "link": ic.get("link") if bw else None, "link_bandwidth": bw,
            "note": ("all-reduce bytes over the scale-up link, exposed; per-collective latency not modelled" if bw
                     else f"{device.key} lists no interconnect: the collectives are not timed "
                          "(add an [interconnect] table with --devices-file)")}


def prefill(an, device: Device, sizes: Mapping[str, int] | None = None, fused: bool = True,
            whole=None) -> dict:
    """The prefill step (S tokens per sequence into an empty cache) on ``device``'s roofline (an
    MoE's expert matmuls reading the experts hit, :func:`step_traffic`: all but (1 − R/E)^(B·S)):
    ``seconds`` (the per-op roofline's sum: the time to first token bound of B sequences of S
    prompt tokens), ``roofline`` (summary), ``sizes``, and the step's FLOPs at ``sizes``:
    ``flops`` (model FLOPs, shared/conventions.md: the matmul-class ops with
    ``torch.utils.flop_counter``'s formulas, attention counted without causal halving, what
    ``FlopCounterMode`` counts on the real prefill forward; an integer count), ``flops_all``
    (model FLOPs plus the per-element counts of :mod:`symcost.graph.rules`) and ``flops_formula``
    (the model FLOPs as a polynomial in the trace's symbols). Under a tensor-parallel layout
    (``serve --tp``) these are one rank's, ``tp`` is :func:`tp_comm` and ``seconds`` adds its
    all-reduce time; ``whole``, the same prefill traced on one device, gives ``flops_model`` (the
    whole model's model FLOPs at ``sizes``, TP aside).

    Raises:
        SymcostError: not a prefill analysis; bad sizes.
    """
    _check(an, "prefill")
    env = an.bind(**dict(sizes or {}))
    rf = roofline(an, device, {str(k): v for k, v in env.items() if str(k) in an.symbols}, fused=fused,
                  with_formulas=False, extra_bytes=step_traffic(an))
    model_flops = an.flops("forward", "model")
    out = {"seconds": rf["step_seconds"], "roofline": _roofline_summary(rf),
           "sizes": {str(k): int(v) for k, v in env.items()},
           "flops": int(_num(model_flops, env)), "flops_all": int(_num(an.flops("forward", "all"), env)),
           "flops_formula": str(model_flops)}
    if whole is not None:
        _check(whole, "prefill")
        wenv = whole.bind(**{k: v for k, v in dict(sizes or {}).items() if k != "TP"})
        out["flops_model"] = int(_num(whole.flops("forward", "model"), wenv))
    tp = tp_comm(an, device, env)
    if tp is not None:
        out["tp"] = tp
        if tp["seconds"] is not None:
            out["seconds"] = rf["step_seconds"] + tp["seconds"]
    return out


def serving_memory(an, kv: KVDtype | None = None):
    """The memory model of serving with ``an``'s inference step: the training memory model
    (:class:`~symcost.passes.memory.MemoryModel`) under the trace's precision with no gradients,
    optimizer state or master weights; its static part holds the KV cache after the step, in
    ``kv``'s dtype where given (the model's ``kv_scale``; the step's transients stay the trace's)."""
    from symcost.passes.memory.model import MemoryModel

    pol = policy(an.precision)
    pol = dataclasses.replace(pol, name=f"{pol.name} (inference)", grad=0, state=0, master=0,
                              note=f"{pol.param}-byte weights, no gradients or optimizer state (inference)")
    if getattr(an, "step", "train") == "train":
        raise SymcostError(f"{an.model}: serving memory needs an inference step (step='decode')")
    return MemoryModel(an, pol, NO_OPTIMIZER, impl="fused", kv_scale=kv.scale if kv is not None else 1)


def max_batch(an, cap: int | str, context: int, sizes: Mapping[str, int] | None = None,
              kv: KVDtype | None = None):
    """The largest number of concurrent sequences whose decode step fits under ``cap`` with every
    sequence at ``context`` tokens (the step at T = context - 1 leaves ``context`` tokens in the
    cache): :meth:`~symcost.passes.memory.solve.Solver.solve` of :func:`serving_memory` (with
    the cache in ``kv``'s dtype) for B.

    Returns:
        ``(memory model, Solution)``; the solution's ``checked`` says M(B) <= cap < M(B + 1)
        held in exact integers (as ``max-batch``'s).

    Raises:
        SymcostError: not a decode analysis, B not a symbol, a context below 2, bad cap.
    """
    _check(an, "decode")
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise SymcostError(f"--context must be an integer of at least 2 tokens, got {context!r}")
    S = int(an.pinned.get("S", 1))
    sizes = {**dict(sizes or {}), "T": context - S}
    sizes = {k: v for k, v in sizes.items() if k in an.symbols}
    mm = serving_memory(an, kv)
    return mm, mm.solve(cap, "B", **sizes)


def serve(decode_an, prefill_an, device: Device, cap: int | str, context: int,
          sizes: Mapping[str, int] | None = None, kv_dtype_name: str | None = None, prefill_whole=None) -> dict:
    """Everything ``symcost serve`` answers, as data; ``kv_dtype_name`` (one of
    :data:`KV_DTYPES`; None: the traced cache's dtype) models the KV cache in that dtype in the
    memory, the KV sizes and the decode roofline (:func:`kv_dtype`; the prefill stays traced).
    ``prefill_whole``: under ``--tp``, the prefill traced on one device (the whole model's FLOPs,
    :func:`prefill`'s ``whole``).

    Returns:
        ``batch`` (largest B, 0 when not one sequence fits), ``memory`` (``at``: M(B), ``next``:
        M(B + 1), ``checked``, ``cap``, ``components`` at B: params, buffers, inputs, kv_cache,
        ``workspace`` = the step's largest transient live set, ``peak_where``, ``inequality``,
        ``reason`` when nothing fits), ``kv`` (:func:`kv_cache` at B), ``decode`` (:func:`decode`
        at B), ``decode_batch_1`` (:func:`decode` at B = 1), ``prefill`` (:func:`prefill` of one
        sequence of ``context`` tokens: time to first token), ``context``, ``kv_dtype``
        (:class:`KVDtype`); for a tensor-parallel trace (``serve --tp``) ``tp`` (``size``, ``per``)
        and every figure is one rank's (:func:`tp_comm` in ``decode`` and ``prefill``).

    Raises:
        SymcostError: as :func:`max_batch`, :func:`decode`, :func:`prefill`.
    """
    from symcost.units import parse_memory

    sizes = dict(sizes or {})
    kv = kv_dtype(decode_an, kv_dtype_name)
    capb = parse_memory(cap)
    mm, sol = max_batch(decode_an, capb, context, sizes, kv)
    T = context - int(decode_an.pinned.get("S", 1))
    at = {**{k: v for k, v in sizes.items() if k in decode_an.symbols}, "T": T}
    out: dict[str, Any] = {"context": context, "batch": sol.value, "kv_cache": decode_an.kv_cache, "kv_dtype": kv}
    if encoder_decoder(decode_an):
        env = {str(k): int(v) for k, v in decode_an.bind(**at).items()}
        out["encoder"] = {"S_enc": env.get("S_enc", int(decode_an.pinned.get("S_enc", 0))), "prompt": ENCDEC_PROMPT}
    mem = {"cap": capb, "at": sol.memory_at, "next": sol.memory_next, "checked": sol.checked,
           "inequality": sol.inequality, "bound": None if sol.bound is None else str(sol.bound),
           "limited_by": sol.limited_by}
    b = max(sol.value, 1)
    comp = mm.components(**at, B=b)
    static = sum(comp[k] for k in ("params", "buffers", "inputs", "kv_cache"))
    mem["components"] = {k: comp[k] for k in ("params", "buffers", "inputs", "kv_cache")}
    mem["components"]["workspace"] = comp["peak"] - static
    mem["components"]["peak"] = comp["peak"]
    mem["peak_where"] = mm.peak_where(**at, B=b)
    if sol.value < 1:
        mem["reason"] = mm.no_fit_reason(sol, **at)
    out["memory"] = mem
    out["kv"] = kv_cache(decode_an, {**at, "B": b}, kv)
    out["decode"] = decode(decode_an, device, {**at, "B": b}, kv=kv)
    out["decode_batch_1"] = (decode(decode_an, device, {**at, "B": 1}, with_crossing=False, kv=kv) if b != 1
                             else out["decode"])
    if "tp" in out["decode"]:
        out["tp"] = {"size": out["decode"]["tp"]["size"],
                     "per": "one rank: the cap is per device; weights, KV cache (its key/value heads), FLOPs and "
                            "all-reduces are the rank's; the batch is the TP ranks' shared one",
                     "replicated": _replicated(decode_an, {**at, "B": b})}
    if prefill_an is not None:
        pre = {k: v for k, v in sizes.items() if k in prefill_an.symbols}
        # one request: a decoder-only model's prompt of context tokens; an encoder-decoder's encoder
        # over S_enc source positions and its first decoder step over the start token
        first = ENCDEC_PROMPT if encoder_decoder(prefill_an) else context
        pre.update({k: v for k, v in (("B", 1), ("S", first)) if k in prefill_an.symbols})
        out["prefill"] = prefill(prefill_an, device, pre, whole=prefill_whole)
    out["predicted"] = predicted(decode_an, prefill_an, device, {**at, "B": b}, pre if prefill_an is not None else None,
                                 out, kv)
    return out


def predicted(decode_an, prefill_an, device: Device, at: Mapping[str, int], pre: Mapping[str, int] | None,
              bounds: Mapping[str, Any], kv: KVDtype | None = None) -> dict[str, Any]:
    """The performance model's time per output token and time to first token (docs/performance-model.md),
    beside :func:`serve`'s bounds: :func:`symcost.passes.performance.predict` (compiled mode: fused
    bytes, a launch per fused kernel, as a serving engine's compiled or CUDA-graphed step runs; no
    optimizer) of the decode step at ``at`` (B = the batch) and at B = 1, and of the prefill at
    ``pre``; a ``--tp`` rank's all-reduce seconds (:func:`tp_comm`) added as the bounds add them.

    Returns:
        ``{"mode", "seconds_per_token", "tokens_per_second" (at the batch), "seconds_per_token_batch_1",
        "prefill_seconds" (None without a prefill), "calibrated", "defaulted", "kv_bytes"}``
        (``kv_bytes``: "traced", or "traced, not the modelled --kv-dtype" when the cache's bytes
        are modelled: the prediction reads the traced bytes).
    """
    from symcost.passes.performance import predict

    def tp_s(d):
        return (d.get("tp") or {}).get("seconds") or 0.0

    dec = predict(decode_an, device, at, mode="compiled", optimizer=False)
    b = int(at["B"])
    one = dec if b == 1 else predict(decode_an, device, {**at, "B": 1}, mode="compiled", optimizer=False)
    spt = dec["step_seconds"] + tp_s(bounds["decode"])
    out = {"mode": "compiled", "seconds_per_token": spt, "tokens_per_second": b / spt if spt else None,
           "seconds_per_token_batch_1": one["step_seconds"] + tp_s(bounds["decode_batch_1"]),
           "prefill_seconds": None, "calibrated": dec["calibrated"], "defaulted": dec["defaulted"],
           "kv_bytes": "traced" if kv is None or not kv.modelled else "traced, not the modelled --kv-dtype"}
    if prefill_an is not None and pre is not None:
        pf = predict(prefill_an, device, pre, mode="compiled", optimizer=False)
        out["prefill_seconds"] = pf["step_seconds"] + tp_s(bounds["prefill"])
    return out


def _replicated(an, sizes: Mapping[str, int]) -> list[dict[str, Any]]:
    """The weight matrices the tensor-parallel plan leaves whole on every rank of a ``serve --tp``
    decode trace (:func:`symcost.passes.tensor_parallel.replicated`: e.g. transformers' plans for
    Mixtral and Qwen3-MoE shard attention only, so every rank holds every expert), at ``sizes``:
    ``[{"module", "params", "elements", "share"}]`` (elements each rank holds; share of the model's
    parameters), largest first."""
    from symcost.passes.tensor_parallel import replicated

    env = an.bind(**{k: v for k, v in sizes.items() if k in an.symbols})
    total = an.params.xreplace(env)
    out = []
    for g in replicated(an):
        n = int(g["elements"].xreplace(env))
        out.append({"module": g["module"], "params": g["params"], "elements": n,
                    "share": float(n / total) if total else None})
    return out


def token_rate(decode_an, device: Device, context: int, max_b: int, sizes: Mapping[str, int] | None = None,
               kv: KVDtype | None = None, points: int = 40) -> dict:
    """The decode bounds against the batch, for a plot: :func:`decode` at up to ``points`` batches
    from 1 to ``max_b`` (every integer when there are few, else log-spaced, 1 and ``max_b``
    always), every sequence at ``context`` tokens (T = context - S).

    Returns:
        ``rows`` (per batch: ``batch``, ``seconds_per_token`` (per-op roofline sum: the time per
        output token bound), ``tokens_per_second`` (B / that), ``memory_seconds`` and
        ``compute_seconds`` (the aggregate bounds)), ``crossing`` (the batch where the aggregate
        turns compute-bound, :func:`decode`'s ``crossing``, None without B), ``kv_dtype``.

    Raises:
        SymcostError: ``max_b`` below 1; as :func:`decode`.
    """
    import math

    if isinstance(max_b, bool) or not isinstance(max_b, int) or max_b < 1:
        raise SymcostError(f"the largest batch to plot must be at least 1, got {max_b!r}")
    if max_b <= points:
        bs = list(range(1, max_b + 1))
    else:
        bs = sorted({max(1, min(max_b, round(math.exp(math.log(max_b) * i / (points - 1))))) for i in range(points)})
    T = context - int(decode_an.pinned.get("S", 1))
    at = {**{k: v for k, v in dict(sizes or {}).items() if k in decode_an.symbols}, "T": T}
    rows, cross = [], None
    for b in bs:
        d = decode(decode_an, device, {**at, "B": b}, with_crossing=b == bs[-1], kv=kv)
        a = d["aggregate"]
        rows.append({"batch": b, "seconds_per_token": d["seconds_per_token"], "tokens_per_second": d["tokens_per_second"],
                     "memory_seconds": a["memory_seconds"], "compute_seconds": a["compute_seconds"]})
        cross = d.get("crossing", cross)
    return {"rows": rows, "crossing": cross, "kv_dtype": None if kv is None else kv.to_json(), "context": context}

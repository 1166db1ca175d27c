"""From probe recordings to one symbolic op graph of the training step: ``trace``.

``trace(model)`` records the training step at probe sizes (:mod:`symcost.tracing.record`), aligns
the recordings op by op, rebuilds every size as a polynomial in the canonical symbols
(:mod:`symcost.tracing.fit`), folds the L repeated blocks into one block with ``repeat = L``,
fits the storage schedule (:mod:`symcost.tracing.schedule`), applies the cost rules
(:mod:`symcost.graph.rules`) to the symbolic shapes, and checks the resulting totals against fresh
recordings (other sizes, L = 3) that took no part in the fit. The result is an
:class:`~symcost.graph.analysis.Analysis`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import TYPE_CHECKING, Any, Mapping

import sympy

from symcost._lazy import LazyModule
from symcost.errors import SymcostError
from symcost.frontends.layout import Layout, layout_of
from symcost.frontends.megatron import for_run
from symcost.frontends.parallel import MESH_PINNED
from symcost.frontends.tensor_parallel import UNEVEN_V
from symcost.frontends.spec import INPUT_SYMBOLS, SYMBOL_MEANINGS, ModelSpec, request_facts
from symcost.tracing.fit import (CHECK_L, FIT_L, N_RANDOM, SYMS, Fitter, FitError, NoProbes, Unvariable, find_base,
                                 leaves_moe_values, model_divisors, plan_probes, probe_pool, random_near, random_point,
                                 random_pools)
from symcost.tracing.modules import _layer_of
from symcost.tracing.probes import frozen_blocks_differ
from symcost.tracing.probes import bounds_words, pad_bounds
from symcost.tracing.regime import digest, regime_signature
from symcost.tracing.schedule import fit_schedule
from symcost.tracing.symbols import own_sizes
from symcost.tracing.poly import MESH
from symcost.graph.align import _align, _layer_roles, _matmul_params, _middle
from symcost.graph.stacks import check_blocks, own_stacks, request_stacks, saved_role, stack_roles
from symcost.tracing.stacks import stack_fit_blocks
from symcost.graph.kv_fit import _fit_kv
from symcost.graph.analysis import Analysis
from symcost.graph.concrete import (attention_flags, concrete_cost, concrete_totals,  # noqa: F401  (concrete_totals: API)
                                    op_view, recomputed)
from symcost.graph.ops import COMM_KINDS, PHASES, SymOp
from symcost.graph.reuse import StepSize
from symcost.graph.totals import trace_group

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import Recording

# torch, the recorder and the cost rules load on first use
nx = LazyModule("networkx")
torch = LazyModule("torch")
rules = LazyModule("symcost.graph.rules")


def resolve(model, config=None, attention="eager"):
    """:func:`symcost.frontends.models.resolve` (imported on first use: it imports torch)."""
    from symcost.frontends.models import resolve as _resolve

    return _resolve(model, config, attention)


def record(spec, values, precision="fp32", optimizer=None, strict=False):
    """:func:`symcost.tracing.record.record` (imported on first use: it imports torch)."""
    from symcost.tracing.record import record as _record

    return _record(spec, values, precision, optimizer, strict=strict)


def trace(model: str | ModelSpec = "cs336-lm", config: Mapping[str, str] | None = None,
          attention: str | None = None, sizes: Mapping[str, int] | None = None,
          precision: str = "bf16-mixed", n_random: int = N_RANDOM, seed: int = 0, use_cache: bool = True,
          step: str | None = None, kv_cache: str = "dynamic", shard: str | None = None,
          fsdp_mp: str | None = None, layout: Layout | None = None, torch_device: str = "cuda",
          _pins: Mapping[str, str] | None = None) -> Analysis:
    """Trace a model's training step (or an inference step) into a symbolic cost graph, in the
    regime of ``sizes``.

    A model given by name is read from the trace cache (:mod:`symcost.graph.cache`, the one the
    CLI reads and writes; ``SYMCOST_CACHE_DIR`` moves it) when an entry of the same source,
    options and regime is there, and written to it after a fresh trace; ``use_cache=False``
    traces afresh and writes nothing. A :class:`ModelSpec` is never cached (its code is not
    data), nor is a model the cache cannot key (``hf:ORG/NAME``, a spec whose size check is code).
    An analysis read from the cache is data: every total, the graph, the memory and roofline
    passes, no torch import; what needs the live model (activation checkpointing plans, which
    re-trace it; the probe recordings) needs ``use_cache=False``.

    The regime follows the request (shared/conventions.md, "Regimes"). The requested values are
    the model's config defaults with ``sizes`` on top (B and S count only where ``sizes`` sets
    them). Then:

    * a symbol requested as 1 is pinned at 1 (size 1 turns copies into views; K = 1 is
      multi-query attention);
    * for each pair of symbols requested equal (``spec.request_facts``: K = H, ...), one probe
      breaks the equality: if that changes the ops (:func:`regime_signature`), the pair is tied
      in this trace (K follows H), else the two are independent symbols;
    * every probe must run the ops of the request itself (recorded at its own sizes with L = 2):
      a probe that does not is redrawn, and a symbol that cannot vary without leaving the regime,
      or whose sizes no polynomial fits there (ALiBi slopes of a head count that is not a power of
      two, ...), is pinned at the requested value; the formulas are in the other symbols;
    * the formulas are checked at the requested sizes themselves (L = 2) and at two random
      probes with L = 3.

    Args:
        model: a built-in name (``cs336-lm``, ``gpt2``, ``mlp``, ``megatron-gpt``),
            ``hf:MODEL_TYPE``, ``hf:ORG/NAME``, ``path/config.json``, ``path/to/file.py:factory``,
            or a :class:`ModelSpec`.
        config: ``hf:`` config overrides (key -> value string).
        attention: ``eager`` or ``sdpa`` for ``hf:`` models (None: transformers' default, sdpa
            where the model has it); other models refuse it.
        sizes: the values the formulas will be used at; they choose the regime traced.
        precision: a name of :data:`symcost.frontends.precision.PRECISIONS`: ``bf16-mixed`` (autocast
            over fp32 weights; the default), ``fp16-mixed``, ``fp32``, ``bf16-true``,
            ``fp16-true`` (model cast), ``bf16-true-fp32-state``, ``bf16-true-fp32-master``;
            decides dtypes, hence bytes and activations.
        n_random: random probes in the fit (besides base and one per symbol; default
            :data:`symcost.tracing.fit.N_RANDOM`, doubled once when the check or the fit fails).
        seed: probe sampling seed.
        use_cache: read and write the trace cache (models given by name, training steps only;
            the CLI caches inference steps itself; a data-parallel trace, ``shard``, is not kept
            there yet).
        step: ``"train"`` (forward, loss, backward), or an inference step through the model's own
            KV cache (:meth:`ModelSpec.for_step`): ``"prefill"`` (S tokens per sequence into an
            empty cache) or ``"decode"`` (S new tokens per sequence, 1 unless ``sizes`` sets S,
            onto a cache of T tokens: T is a symbol). None: the spec's own step (``"train"`` for
            a model name).
        kv_cache: the cache class of an inference step, ``"dynamic"`` (``DynamicCache``) or
            ``"static"`` (``StaticCache`` of T + S tokens).
        shard: data-parallel training, one rank traced: ``ddp``, ``fsdp``, ``zero1``, ``zero2``
            or ``zero3`` (:data:`symcost.frontends.parallel.SHARDS`); the formulas gain the
            symbol ``DP`` (the group size; ``sizes["DP"]``, default 8) and the step's
            collectives (``Analysis.comm_bytes``). None: one device.
        fsdp_mp: with ``shard``, FSDP2's ``MixedPrecisionPolicy`` given to every unit:
            ``"PARAM[,REDUCE]"`` (``bf16``, ``fp16``, ``fp32``; REDUCE fp32 unless given), as
            :func:`symcost.frontends.parallel.parse_fsdp_mp` reads it.
        layout: the parallel layout, one rank traced (:class:`symcost.frontends.layout.Layout`:
            data parallelism, tensor and sequence parallelism, on one mesh in torchtitan's
            order); the formulas gain each dimension's symbol (``sizes["DP"]``, ``sizes["TP"]``,
            default 8). ``shard`` and ``fsdp_mp`` are the shorthand of a data-parallel layout
            (not with ``layout``).
        torch_device: the device type the step runs on (``--torch-device``, ``cuda`` by
            default as in the CLI): ``"cuda"`` records dropout and attention with dropout as
            CUDA dispatches them (:mod:`symcost.tracing.device_kernels`); ``"cpu"`` and other
            types record the CPU's kernels (what a real CPU step runs: the tests' oracles).
        _pins: internal: symbol -> reason, symbols pinned at the requested value from the start
            (:meth:`Analysis.subs` tracing again where a step-function width was fitted as a
            constant: :func:`symcost.graph.reuse.at_fault` names the symbols that move it).

    Returns:
        An :class:`Analysis` (``pinned``, ``pin_reasons``, ``regime_ties``, ``request_facts``,
        ``residues`` say which regime) whose totals were checked against fresh recordings at
        sizes not used in the fit.

    Raises:
        SymcostError: bad model/config, sizes PyTorch rejects (the spec's constraints), an
            untraceable model, an inference step of a model without a KV cache.
    """
    if layout is None:
        from symcost.frontends.parallel import parse_fsdp_mp

        layout = Layout(shard=shard, fsdp_mp=parse_fsdp_mp(fsdp_mp) if isinstance(fsdp_mp, str) else fsdp_mp)
    elif shard is not None or fsdp_mp is not None:
        raise SymcostError("give the data-parallel strategy in the layout (Layout(shard=...)), not beside it")
    if use_cache and step is None and not layout and not isinstance(model, ModelSpec):
        from symcost.graph.cache import cached_trace

        def fresh():
            return trace(model, config, attention, sizes, precision, n_random, seed, use_cache=False,
                         torch_device=torch_device)

        # the CLI's key (strings as --config gives them), plus the probe plan when it is not the default
        options = None if (n_random, seed) == (N_RANDOM, 0) else {"n_random": n_random, "seed": seed}
        if torch_device not in (None, "cuda"):  # (the default device is not in the key: the CLI's)
            options = {**(options or {}), "torch_device": torch_device}
        an = cached_trace(str(model), {str(k): str(v) for k, v in dict(config or {}).items()}, attention,
                          precision, dict(sizes or {}), fresh, True, options)
        if an.__dict__.get("cached_from"):
            env = an.bind(**dict(sizes or {}))  # the size checks a fresh trace makes first (S within positions, ...)
            from symcost.graph import reuse

            values = {str(k): int(v) for k, v in env.items()}
            if not reuse.checked_at(an, values):
                # an analysis of the same regime traced at other sizes: its formulas must hold at
                # these (a step-function width does not), checked on the model built on the meta device
                live = for_run(resolve(model, config, attention), precision, torch_device)
                try:
                    reuse.check(an, values, spec=live)
                except reuse.NotAtTheseSizes as e:  # traced afresh, the symbols that move the step pinned
                    an = trace(model, config, attention, sizes, precision, n_random, seed, use_cache=False,
                               torch_device=torch_device, _pins=reuse.at_fault(an, values, e.param, spec=live))
        return an
    spec = model if isinstance(model, ModelSpec) else resolve(model, config, attention)
    spec = own_sizes(spec)
    if step is not None:
        spec = spec.for_step(step, kv_cache)
    base = spec
    spec = for_run(layout.spec(spec), precision, torch_device)  # (the loss and engine of megatron-*)
    sizes = dict(sizes or {})
    if spec.step == "decode":
        sizes.setdefault("S", 1)  # one new token per sequence: S = 1 is pinned, its own regime
    values = spec.values(sizes, inputs=False)
    if layout.ep_fsdp and not layout.ep_replicate and layout.experts_shard is None:
        # the experts' FSDP2 placement, torchtitan's rule at the request (Shard(1) where DP·EP > E),
        # kept for every probe (docs/parallel.md §14.6)
        from symcost.frontends.expert_parallel import experts_shard_dim

        layout = dataclasses.replace(layout, experts_shard=experts_shard_dim(values))
        spec = for_run(layout.spec(base), precision, torch_device)
        values = spec.values(sizes, inputs=False)
    why = spec.check({k: v for k, v in values.items() if k in spec.symbols or k in INPUT_SYMBOLS})
    if why:
        raise SymcostError(f"{spec.name}: {why}")
    facts = request_facts(values, spec.all_symbols)
    pins = {s: 1 for s in facts["ones"]}
    reasons = {s: "size 1 runs other kernels (copies become views)" for s in pins}
    for s, why in {**dict(getattr(spec, "pin", None) or {}), **dict(_pins or {})}.items():  # (ModelSpec.pin)
        if s in values and s not in pins:
            pins[s], reasons[s] = values[s], why
    n = spec.lead_blocks
    if n and "L" in values and "L" not in pins and values["L"] <= n:
        # every block is one of the n leading blocks (DeepSeek-V3's dense blocks before the MoE
        # ones): a model PyTorch builds, whose blocks are all of one kind. Traced as it is, with
        # L pinned (its formulas hold up to L = n only); the blocks are traced one by one.
        pins["L"] = values["L"]
        reasons["L"] = (f"L <= {n}: every block is one of the {n} leading blocks (no block of the "
                        f"other kind), a regime of its own whose formulas hold for L <= {n} only")
    for s, m in (getattr(spec, "pads", None) or {}).items():
        # a size padded to whole chunks (Mamba-2's scan): a request of one whole chunk is a regime
        # of one value (fewer pad to it, more make two chunks: other ops), pinned, said
        if s in values and s not in pins and m > 1 and pad_bounds(values[s], m)[0] == pad_bounds(values[s], m)[1]:
            pins[s] = values[s]
            reasons[s] = (f"{s} = {m} is one whole chunk of {m}, no padding: fewer pad to one chunk and more make "
                          f"two chunks, each running other ops")
    if layout_of(spec).cp and "CP" in values:
        # ring attention runs CP steps per attention call (PyTorch's _templated_ring_attention):
        # the rank's op sequence follows CP, which no probe can vary alone (a fold over the ring's
        # steps, as over the L blocks, is not done); pinned before any probe is tried
        pins["CP"] = values["CP"]
        reasons["CP"] = ("ring attention runs CP steps per attention call, so the rank's ops follow CP "
                         "(formulas for this CP; docs/parallel.md §15)")
    uneven = None
    if layout_of(spec).tp and "TP" in values and "V" in values and "V" not in pins and "TP" not in pins:
        # TP does not divide V: DTensor shards the vocabulary unevenly (⌈V/TP⌉ rows on the recorded
        # rank), no polynomial in V or TP: both pinned, the other symbols free (was refused after
        # ~19 s: 'no probe sizes ... stay in the regime'); under megatron-* a one-line refusal
        from symcost.frontends.tensor_parallel import uneven_vocab

        for s, why in uneven_vocab(spec, values, precision).items():
            pins[s], reasons[s] = values[s], why
            uneven = values["V"]
    recordings: dict = {}
    widened, n_random0, seed0 = False, n_random, seed
    relax = False  # (the sharding probe checks waived: NoProbes below)
    started = time.perf_counter()
    for _ in range(len(SYMS) + 2):
        try:
            token, token_v = MESH_PINNED.set(relax), UNEVEN_V.set(uneven)
            try:
                an = _trace_regime(spec, values, facts, pins, reasons, precision, n_random, seed, recordings)
            finally:
                MESH_PINNED.reset(token)
                UNEVEN_V.reset(token_v)
            earlier = time.perf_counter() - started - sum(an.timings.values())  # (each pin traces again)
            if earlier > 0.05:
                an.timings["earlier attempts"] = earlier
            # (what Analysis.subs traces again with, at sizes where these formulas do not hold)
            an.__dict__["trace_again"] = functools.partial(
                trace, model=model, config=config, attention=attention, sizes=dict(sizes), precision=precision,
                n_random=n_random0, seed=seed0, use_cache=use_cache, step=step, kv_cache=kv_cache,
                layout=layout, torch_device=torch_device)
            return an
        except NoProbes:
            # every mesh size pinned (after failures of the free ones): the sharding probe checks'
            # divisibilities, there so that DP, EP, TP can vary, would ask the request's own mesh to
            # divide each first dimension (Qwen3-30B-A3B's 128 router rows over DP·EP = 256 ranks);
            # once more without them (frontends.parallel.MESH_PINNED: FSDP2's padding at the pinned
            # mesh is constant where the first dimension is; where not, the fit's checks say so)
            mesh = [s for s in MESH if s in spec.all_symbols]
            if relax or not mesh:
                raise
            # a mesh size still free: a size pinned at the request (V = 37, odd) leaves no probe whose
            # first dimensions the mesh divides; FSDP2 pads them to ceil(d0/DP) rows, no polynomial in
            # DP: the mesh sizes pinned too (was refused: 'no probe sizes for B, S, ..., DP')
            for s in mesh:
                if s not in pins and s in values:
                    pins[s] = values[s]
                    reasons[s] = ("no probe keeps every parameter's first dimension a multiple of it at the "
                                  "other pinned sizes (the rows FSDP2 pads are no polynomial in it): formulas "
                                  f"for this {s}")
            relax = True
        except StepSize as e:
            new = {s: why for s, why in e.pins.items() if s not in pins and s in values}
            if not new:
                raise SymcostError(f"{spec.name}: a parameter's shape at the requested sizes is no polynomial in "
                                   f"the symbols, with {', '.join(e.pins)} pinned") from e
            for s, why in new.items():
                pins[s], reasons[s] = values[s], why
        except CheckFailed as e:
            if widened:  # more probes did not help: the regime is not polynomial in these symbols
                n_random, seed = n_random0, seed0
                _pin_for(e, pins, reasons, values)
                continue
            # formulas that fit every probe but not a fresh recording: the probes did not pin the
            # polynomial down (a regime whose constraints leave few combinations, e.g. E dividing
            # B·R in a decode step). Before pinning anything, fit once more on twice the random probes.
            widened, n_random, seed = True, 2 * n_random, seed + 1
        except Unvariable as e:
            if e.symbol in pins:
                raise
            if e.symbol not in values:  # B or S, not requested: pinned at the model's default
                default = spec.values(sizes).get(e.symbol)
                if default is None:
                    raise
                values = {**values, e.symbol: default}
                pins[e.symbol] = default
                reasons[e.symbol] = (f"no other value of it runs the same ops (the model's default "
                                     f"{e.symbol} = {default}; ask for another with sizes={{{e.symbol!r}: ...}})")
                continue
            pins[e.symbol] = values[e.symbol]
            reasons[e.symbol] = ("no other value of it runs the same ops as the requested one"
                                 if e.symbol != "L" and not getattr(e, "stack", False) else str(e))
        except FitError as e:
            if not widened:
                # a signature with more terms than the probes to spare can fit: more probes
                # before a symbol is pinned for it (a pinned symbol is a formula lost)
                widened, n_random, seed = True, 2 * n_random, seed + 1
                continue
            n_random, seed = n_random0, seed0
            try:
                _pin_for(e, pins, reasons, values)
            except FitError:
                # only sizes the request left at the model's defaults are left (B, S): pinned
                # there, said, as where no other value runs the same ops; never refused
                full = spec.values(sizes)
                left = [d for d in e.deps if d not in pins and d not in values and full.get(d) is not None]
                if not left:
                    raise
                for d in left:
                    values = {**values, d: full[d]}
                    pins[d] = full[d]
                    reasons[d] = (f"no polynomial in it fits the sizes of its regime (the model's default {d} = "
                                  f"{full[d]}; ask for another with sizes={{{d!r}: ...}})")
    raise SymcostError(f"{spec.name}: could not find a regime to trace {values} in")


class CheckFailed(FitError):
    """The fitted formulas disagree with a fresh recording of the regime (:func:`_validate`)."""


def _pin_for(e: FitError, pins: dict, reasons: dict, values: Mapping[str, int]) -> None:
    """Pin the symbols a :class:`FitError` names (config symbols first) at the requested values.

    Raises:
        FitError: ``e`` itself when nothing is left to pin.
    """
    deps = [d for d in e.deps if d not in pins and d in values]
    new = [d for d in deps if d not in INPUT_SYMBOLS] or deps
    if not new:
        raise e
    for d in new:
        pins[d] = values[d]
        reasons[d] = getattr(e, "pin_reason", None) or "no polynomial in it fits the sizes of its regime"


def _trace_regime(spec: ModelSpec, values: Mapping[str, int], facts: dict, pins: Mapping[str, int],
                  reasons: Mapping[str, str], precision: str, n_random: int, seed: int,
                  recordings: dict) -> Analysis:
    """One attempt of :func:`trace` with ``pins`` fixed; raises Unvariable / FitError to pin more."""
    import time

    t0 = time.perf_counter()
    pinned = dict(pins)
    base_syms = tuple(s for s in spec.all_symbols if s not in pinned)
    # several stacks of blocks, each folded under its own length (T5; L_enc, L_dec: graph/stacks.py)
    own, stacks = own_stacks(spec, {**values, **pinned}, base_syms)
    fixed = {**pinned, **{s: stack_fit_blocks(spec) for s in set(stacks.values())},
             **({"L": FIT_L + spec.lead_blocks + _middle(spec)} if "L" in base_syms else {})}
    request = {**{k: v for k, v in values.items() if k in spec.all_symbols or k in spec.tied},
               **{s: v for s, v in fixed.items()}}
    for s in spec.input_symbols:  # B, S (T) not requested: the regime of any size other than 1
        request.setdefault(s, {"B": 2, "S": 16, "T": 16}[s])

    def rec_at(p, strict=False):
        # (a recording of a probe at the request's sizes, from an earlier attempt, is no strict one)
        key = tuple(sorted(p.items())) + ((("strict", 1),) if strict else ())
        if key not in recordings:
            try:
                recordings[key] = record(spec, p, precision, strict=strict)
            except SymcostError as e:
                recordings[key] = e
        return recordings[key]

    # the request: strict (a small one on real tensors gives way to fake ones at the first read
    # of a tensor's value: control flow on values raises there, where a real step would take a
    # branch on the zero-filled weights unseen), and it is the regime
    req = rec_at(request, strict=True)
    if isinstance(req, SymcostError):  # PyTorch itself rejects the requested sizes
        raise SymcostError(f"{req} (at the requested sizes, before any probe)") from req
    stacks, blocks = request_stacks(spec, own, stacks, base_syms, req, rec_at, request)
    if blocks:  # (a stack whose end blocks both stand apart, T5's, is probed with three blocks)
        fixed.update(blocks)
        request.update(blocks)
        req = rec_at(request, strict=True)
    want_sig = regime_signature(req)
    if "L" in base_syms and "L" not in stacks.values() and req.layer_container is None and req.no_fold:
        raise Unvariable("L", req.no_fold)  # (several block stacks follow L, or none: pinned, traced unfolded)
    folds = {**({req.layer_container: "L"} if "L" in base_syms and req.layer_container is not None else {}),
             **{c: s for c, s in stacks.items() if s in base_syms}}
    if folds:  # (blocks whose frozen parameters differ: no block stands for the others, tracing/probes.py)
        try:
            at_request = spec.build_meta({**values, **pinned})
        except Exception:  # noqa: BLE001 - the request was recorded at FIT_L; a build failure says nothing here
            at_request = None
        frozen_pin = at_request is not None and frozen_blocks_differ(at_request, folds, getattr(req, "frozen", frozenset()))
        if frozen_pin:
            raise frozen_pin

    def accept(p):
        r = rec_at(p)
        return not isinstance(r, SymcostError) and regime_signature(r) == want_sig

    moduli = {s: m for s, m in spec.moduli.items() if s in base_syms}
    # a size padded to whole chunks of m (ModelSpec.pads, Mamba-2's c·⌈S/c⌉): the request's regime
    # is a range (2..m-1: one padded chunk of constant length, any class; or its class mod m from
    # two chunks on), which every probe and check keeps (the spec's probe check refuses the rest)
    bounds = {s: list(pad_bounds(request[s], m)) for s, m in (getattr(spec, "pads", None) or {}).items()
              if s in base_syms and s in request and m > 1}
    for s, (lo, hi) in bounds.items():
        # (below one chunk any class: modulus 1, whose pool is every small value 2, 3, ..., so a
        # range of two values, 2 <= S <= 3 for a chunk of 4, has both in it)
        moduli[s] = math.lcm(moduli.get(s, 1), spec.pads[s]) if hi is None else 1
    if bounds:
        def bounded(p, _own=spec.probe_check):
            for s, (lo, hi) in bounds.items():
                if s in p and not (lo <= p[s] and (hi is None or p[s] <= hi)):
                    return f"{s}={p[s]} is outside the request's regime {bounds_words(s, (lo, hi), spec.pads[s])}"
            return _own(p) if _own else None

        spec = dataclasses.replace(spec, probe_check=bounded)
    # equal pairs: tied while a probe that breaks the equality runs other ops
    ties: dict[str, str] = {}
    lent: dict[str, int | None] = {}  # leader -> its own modulus, where a follower's was lent to it
    for a, b in facts["equal"]:
        if {a, b} & set(stacks.values()):
            continue  # (a stack's length is fixed in every probe: equal to nothing)
        if b in MESH and a not in MESH:
            # a mesh size leads (K = TP: one KV head per rank): the ring has 1/TP, not 1/K, so a
            # rank's shard K·D/TP stays a polynomial (TP·D·TP⁻¹) where D·H·V/K would not be one
            a, b = b, a
        if a in base_syms and b in base_syms and b not in ties and a not in ties and b not in ties.values():
            ties[b] = a
            if b in moduli and a not in fixed and a not in MESH and moduli.get(a, 1) % moduli[b]:
                # the follower takes the leader's values: the leader keeps the follower's residue
                # too while tied (E = H = 8 under --ep: E stays a multiple of 8, which EP must divide);
                # never a mesh size's (K = TP: TP in multiples of 8 leaves the DP x TP probes no room)
                lent.setdefault(a, moduli.get(a))
                moduli[a] = math.lcm(moduli.get(a, 1), moduli[b])
    syms = tuple(s for s in base_syms if s not in ties)
    base = find_base(syms, spec.probe_ok, seed, fixed, accept=accept, request=request, ties=ties, moduli=moduli)
    for follower, leader in list(ties.items()):
        # one probe breaking the equality decides: the first valid value of the follower's whole
        # pool (an MoE probe needs E | B·S·R and R <= E, which the small values of E may all
        # miss), preferably one that leaves an MoE's E three values and R two (see find_base)
        free = [s for s in base_syms if (s not in fixed and s not in ties) or s == follower]
        pools = {s: probe_pool(s, request.get(s), moduli.get(s)) for s in free}
        others = {a: b for a, b in ties.items() if a != follower}
        valid = [dict(base, **{follower: v}) for v in probe_pool(follower, request.get(follower), moduli.get(follower))
                 if v != base[leader] and spec.probe_ok(dict(base, **{follower: v})) is None]
        valid.sort(key=lambda p: not leaves_moe_values(p, free, spec.probe_ok, pools, others))  # stable
        if valid and accept(valid[0]):
            del ties[follower]
            base = valid[0]  # the untied pair keeps distinct values in the base probe
    for leader, own in lent.items():  # a tie broken: the leader's own residue class again (or none)
        if leader not in ties.values():
            if own is None:
                moduli.pop(leader, None)
            else:
                moduli[leader] = own
    syms = tuple(s for s in base_syms if s not in ties)
    plan = plan_probes(syms, spec.probe_ok, n_random=n_random, seed=seed, fixed=fixed, accept=accept,
                       request=request, ties=ties, moduli=moduli, base=base,
                       divisors=model_divisors(spec.constraints))
    symbols = syms
    spec = dataclasses.replace(spec, tied={**spec.tied, **ties})
    recs = [rec_at(p) for p in plan.points]
    t1 = time.perf_counter()
    _align(recs, spec)
    fitter = Fitter(plan)
    ref = recs[0]
    container = None if stacks else ref.layer_container

    def fit_shape(getter, what):
        shapes0 = getter(ref)
        return [
            tuple(fitter(tuple(getter(r)[k][d] for r in recs), what) for d in range(len(s)))
            for k, s in enumerate(shapes0)
        ]

    # with L pinned (blocks that differ), every block is traced on its own: nothing is folded
    role = (stack_roles(spec, ref, stacks, precision, blocks) if stacks
            else _layer_roles(spec, ref, None if "L" in pinned else container, precision))

    # parameters
    param_shapes: dict[str, tuple] = {}
    folded_name: dict[str, str] = {}
    for name, (shape, dtype) in ref.params.items():
        keep, repeat, fname = role(name.rpartition(".")[0], name)
        if not keep:
            continue
        sym = tuple(fitter(tuple(r.params[name][0][d] for r in recs), f"size of {name}") for d in range(len(shape)))
        param_shapes[fname] = (sym, dtype, repeat)
        folded_name[name] = fname
    # a buffer packing parameters (FSDP2's all-gather buffer of a block) is a sum of their sizes;
    # each size up to its numeric factor (the fit finds the coefficients): sizes equal up to one,
    # H·D and 448·H·D (Whisper's LayerNorm and decoder position table), would be collinear columns
    # whose least-norm split is no rational combination (hf:whisper --dp 2 pinned H, D, V, N_mel)
    sizes = {sympy.expand(sympy.Mul(*sh)) for sh, _, _ in param_shapes.values()}
    fitter.hints = sorted({h.primitive()[1] for h in sizes if not h.is_number}
                          | ({sympy.Integer(1)} if any(h.is_number and h != 1 for h in sizes) else set()),
                          key=sympy.default_sort_key)
    lay = layout_of(spec)
    if lay.ep_fsdp and lay.tp:  # (FSDP2's groups of --ep --tp --dp, whose shards its buffers hold: §14.9)
        fitter.hint_groups = tuple(dict.fromkeys(sympy.sympify(lay.group_size(
            g, lambda x: SYMS[x] if x in symbols else pinned.get(x, ref.values.get(x, 1)))) for g in ("DP", "DP_expert")))
    # data-parallel: each parameter's shard on one rank (FSDP2: dim 0 split over DP ranks)
    param_shards: dict[str, tuple] = {}
    for name, shape in ref.param_shards.items():
        if name in folded_name:
            sym = tuple(fitter(tuple(r.param_shards[name][d] for r in recs), f"shard of {name}")
                        for d in range(len(shape)))
            param_shards[folded_name[name]] = (sym,) + param_shapes[folded_name[name]][1:]
    used, ops_with_param = _matmul_params(ref)
    matmul_params = {folded_name[n] for n in used if n in folded_name}

    # ops
    ops: list[SymOp] = []
    unsupported: dict[str, Any] = {}
    cost_cache: dict = {}
    for i, op in enumerate(ref.ops):
        keep, repeat, module = role(op.module)
        if not keep:
            continue
        layer = _layer_of(op.module, container)
        in_shapes = [
            tuple(fitter(tuple(r.ops[i].inputs[k].shape[d] for r in recs), f"dimension of {op.name}")
                  for d in range(len(t.shape)))
            for k, t in enumerate(op.inputs)
        ]
        out_shapes = [
            tuple(fitter(tuple(r.ops[i].outputs[k].shape[d] for r in recs), f"dimension of {op.name}")
                  for d in range(len(t.shape)))
            for k, t in enumerate(op.outputs)
        ]
        # (an op given an optional integer argument at some probes only, e.g. a vocabulary-parallel
        # embedding's padding_idx where the rank's rows hold the pad id: not a size; the base
        # probe's values are kept as they are, unfitted)
        ints = ([fitter(tuple(r.ops[i].ints[k] for r in recs), f"size argument of {op.name}")
                 for k in range(len(op.ints))] if len({len(r.ops[i].ints) for r in recs}) == 1
                else [sympy.Integer(x) for x in op.ints])
        family = rules.classify(op.op)
        key = (op.name, tuple(in_shapes), tuple(out_shapes), tuple(ints),
               tuple(t.dtype for t in op.inputs + op.outputs), getattr(op, "recompute", False))
        c = cost_cache.get(key)
        if c is None:
            try:
                c = rules.cost(op_view(op, in_shapes, out_shapes, ints), family)
                c = rules.Cost(*(rules.expand_flops(x) for x in (c.flops, c.flops_all, c.bytes)),
                               c.transcendentals, rules.expand_flops(c.flops_hw))
            except (AssertionError, TypeError, ValueError):
                # A registry formula that cannot take symbols (e.g. asserts H % K == 0): fit
                # its concrete values at the probes instead.
                cs = [concrete_cost(r.ops[i]) for r in recs]
                c = rules.Cost(*(fitter(tuple(int(getattr(x, a)) for x in cs), f"cost of {op.name}")
                                 for a in ("flops", "flops_all", "bytes")),
                               {k: fitter(tuple(int(x.transcendentals.get(k, 0)) for x in cs), f"cost of {op.name}")
                                for k in sorted({k for x in cs for k in x.transcendentals})},
                               fitter(tuple(int(x.flops_hw) for x in cs), f"cost of {op.name}"))
            if getattr(op, "recompute", False):
                c = recomputed(c)
            cost_cache[key] = c
        if family == "unsupported":
            unsupported[op.name] = unsupported.get(op.name, 0) + repeat
        comm = None
        if family == "comm":
            g = op.group or trace_group(ref)
            n = layout_of(spec).group_size(g, lambda x: SYMS[x] if x in symbols else pinned.get(x, ref.values.get(x, 1)))
            kind, size, per_rank = rules.comm_volume(op_view(op, in_shapes, out_shapes, ints), n)
            comm = (kind, sympy.expand(size), sympy.expand(per_rank), g)
        ops.append(SymOp(
            index=i, name=op.name, family=family, module=module,
            phase=op.phase, repeat=repeat, in_shapes=in_shapes,
            in_dtypes=[t.dtype for t in op.inputs], out_shapes=out_shapes,
            out_dtypes=[t.dtype for t in op.outputs], cost=c, layer=layer,
            attention=family == "model" and op.phase == "forward" and i not in ops_with_param,
            comm=comm,
            kv_reads=tuple(getattr(op, "kv_reads", ())), kv_writes=tuple(getattr(op, "kv_writes", ())),
            attn_flags=(attention_flags(op_view(op, in_shapes, out_shapes, ints))
                        if family == "model" and "attention" in op.name else None),
        ))
    # Backward attention matmuls: those of the backward with no parameter gradient involved are
    # hard to tell apart generically; attribute by module: a module whose forward model op is
    # attention marks its backward model ops as attention only if it holds no parameter.
    attn_modules = {op.module for op in ops if op.attention}
    param_modules = {n.rpartition(".")[0] for n in param_shapes}
    for op in ops:
        if op.phase == "backward" and op.family == "model" and op.module in attn_modules \
                and op.module not in param_modules:
            op.attention = True

    # saved activations
    saved = []
    folded = container is not None and "L" not in pinned and not spec.lead_blocks
    n_blocks = len({_layer_of(op.module, container) for op in ref.ops} - {None}) if folded else 0
    for k, s in enumerate(ref.saved):
        keep, repeat, module = saved_role(s, stacks, role) if stacks else role(s.module)
        layers = {_layer_of(m, container) for m in s.also | {s.module}}
        made = _layer_of(s.made_in, container) if s.made_in is not None and folded else None
        if made is not None and layers == {made, made + 1}:
            # a block's output saved by the block (a closing ReLU keeps its result) and by the
            # next one: one storage per pair of neighbouring blocks, L - 1 in all (the first
            # pair of the probe's blocks stands for all but the probe's others)
            keep, module = True, role(s.made_in)[2]
            repeat = SYMS["L"] - n_blocks + 1 if made == 0 else sympy.Integer(1)
        elif len(layers) > 1:  # one storage saved by several blocks (e.g. rotary cos/sin): once
            keep, repeat, module = True, sympy.Integer(1), "(shared by blocks)"
        if not keep:
            continue
        nb = fitter(tuple(r.saved[k].nbytes for r in recs), f"saved tensor of {s.module or 'the root'}")
        saved.append((module, nb, s.dtype, repeat))

    whole = None  # the cache at the request's own L, where a window has dropped tokens (_fit_kv)
    if spec.step != "train" and getattr(req, "kv_evicted", 0) and values.get("L", request.get("L")) != request.get("L"):
        whole = rec_at(dict(request, L=values["L"]))
        whole = None if isinstance(whole, SymcostError) else whole
    kv_layers = _fit_kv(spec, recs, fitter, role, container, pinned, whole, stacks) if spec.step != "train" else []

    t2 = time.perf_counter()
    graph = _build_graph(ref, ops, role)
    syms = {s: SYMBOL_MEANINGS.get(s) or spec.meaning(s) for s in symbols}
    if "D" in syms and "H" not in syms and "H" not in spec.tied and "H" not in pinned:
        syms["D"] = "model width (the model has no attention heads)"
    # what the model itself says a symbol counts (ModelSpec.meanings or extra["meanings"]: an image model's S)
    syms.update({k: spec.meaning(k) for k in {**dict(spec.extra.get("meanings") or {}), **spec.meanings} if k in syms})
    an = Analysis(
        model=spec.name, spec=spec, graph=graph, ops=ops, symbols=syms, param_shapes=param_shapes,
        matmul_params=matmul_params, unsupported=unsupported, saved=saved, layer_container=container,
        stacks=dict(stacks),
        precision=precision, tied={folded_name.get(k, k): v for k, v in ref.tied.items()},
        recordings=recs, plan=plan, fitter=fitter, role=role,
        # (a data-parallel step's storages hold shards: sizes in DP and 1/DP, a tensor-parallel
        # step's in TP and 1/TP: tracing/poly.py)
        schedule=fit_schedule(recs, fitter, role, container, symbols, spec.name,
                     lead=0 if "L" in pinned else spec.lead_blocks,
                     middle=bool(_middle(spec)) and "L" not in pinned and not stacks, stacks=stacks,
                     special=getattr(role, "special", None)),
        step=spec.step, kv_cache=spec.kv_cache if spec.step != "train" else None, kv_layers=kv_layers,
        parallel=ref.parallel, param_shards=param_shards, tensor_parallel=ref.tensor_parallel,
        frozen={folded_name[n] for n in getattr(ref, "frozen", ()) if n in folded_name},
    )
    an.pinned = pinned
    an.stack_blocks = {s: blocks.get(s, FIT_L) for s in set(stacks.values())}
    an.pin_reasons = {k: reasons[k] for k in pinned}
    an.regime_ties = dict(ties)
    an.request_facts = facts
    an.request_sizes = {k: int(v) for k, v in values.items()}
    an.residues = {s: [m, values[s] % m] for s, m in moduli.items() if (m > 1 or s not in bounds) and s in symbols and s in values}
    an.bounds = {s: b for s, b in bounds.items() if s in symbols}
    an.signature = digest(want_sig)
    if not an.parallel and not an.tensor_parallel:
        # a parameter shape fitted at the probes that the model does not have at the request: a
        # step function of the symbols (torchtitan's SwiGLU width), constant over every probe.
        # The symbols that move it are pinned at the request and the regime traced again.
        from symcost.graph import reuse

        at = {**{str(k): int(v) for k, v in values.items()}, **pinned}
        try:
            found = reuse.mismatch(an, at)
        except Exception:  # noqa: BLE001 - a model that does not build apart from its step: the check answers
            found = None
        if found is not None:
            raise reuse.StepSize(reuse.at_fault(an, at, found[0]))
    pools = random_pools([s for s in symbols if s not in fixed], plan.points[0], request, moduli)
    # sizes that are no probe (an MoE's fractional N·R/E slots per expert) are answered by the
    # formulas, not recorded exactly: they are checked at the probes only
    _validate(an, spec, symbols, seed, pinned, pools=pools, ties=ties, accept=accept,
              request=(request, req) if spec.probe_ok(request) is None else None, base=plan.points[0])
    an.timings = {"record": t1 - t0, "fit": t2 - t1, "check": time.perf_counter() - t2}
    return an


def _validate(an: Analysis, spec: ModelSpec, symbols, seed: int, pinned: Mapping[str, int],
              pools=None, ties=None, accept=None, request=None, base=None) -> None:
    """Check the formulas against fresh recordings: two random probes (L = 3) of the regime and,
    given ``request = (values, recording)``, the requested sizes themselves. Where no random
    point meets the model's constraints with every size drawn at once (a rank of the 2-D mesh),
    the probes vary two or three sizes of ``base`` (the fit's base probe), as the fit does
    (:func:`symcost.tracing.fit.random_near`).

    Raises:
        CheckFailed: a formula disagrees with a recording in the regime (the caller fits again on
            more probes, then pins symbols).
    """
    import random

    rng = random.Random(seed + 1000)
    fit_blocks = dict(getattr(an, "stack_blocks", None) or {})  # (several stacks: check_blocks)
    fixed = {**pinned, **check_blocks(fit_blocks), **({"L": CHECK_L + spec.lead_blocks} if "L" in symbols else {})}
    config_syms = [s for s in symbols if s not in INPUT_SYMBOLS and s != "L" and s not in fit_blocks]

    def compare(p, rec):
        want = concrete_totals(rec)
        # xreplace: a plain substitution of numbers (subs pattern-matches: 1.5 s a trace)
        env = {SYMS[k]: sympy.Integer(v) for k, v in p.items() if k in symbols}
        got = {f"{k}.{ph}": None for k in ("flops", "flops_all", "bytes") for ph in PHASES}
        for ph in PHASES:
            got[f"flops.{ph}"] = an.flops(ph).xreplace(env)
            got[f"flops_hw.{ph}"] = an.flops(ph, "hardware").xreplace(env)
            got[f"flops_all.{ph}"] = an.flops(ph, "all").xreplace(env)
            got[f"bytes.{ph}"] = an.bytes(ph).xreplace(env)
            got[f"transcendentals.{ph}"] = an.transcendentals(ph).xreplace(env)
        got["params"] = an.params.xreplace(env)
        got["saved"] = sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]).xreplace(env)
        got["kv"] = an.kv_bytes.xreplace(env)
        if an.parallel is not None or layout_of(spec).cp:  # (context parallelism: the ring's collectives)
            for k in COMM_KINDS:
                got[f"comm.{k}"] = an.comm_bytes(k).xreplace(env)
        if an.parallel is not None:
            got["shards"] = an.params_shard.xreplace(env)
        # (whole units on both sides: a collective's (n-1)/n share of its bytes is a fraction where n
        # does not divide them, DP = 15 at Narayanan et al.'s 1,920 GPUs, and int() of the formula
        # truncates it while the fresh recording keeps it exact)
        bad = {k: (int(got[k]), want[k]) for k in want if int(got[k]) != int(want[k])}
        if bad:
            k, (g, w) = next(iter(bad.items()))
            return (f"{spec.name}: the recovered formula for {k} gives {g} but a fresh trace at {p} "
                    f"measures {w}; the model's costs are not polynomial in {', '.join(symbols)}")
        return None

    if request is not None:
        msg = compare(*request)
        if msg:
            raise CheckFailed(msg + " at the requested sizes", config_syms or symbols)
    checked = 0
    for _ in range(6):
        try:
            p = random_point(symbols, spec.probe_ok, rng, fixed, pools, ties)
        except SymcostError:
            if base is None:
                raise
            free = [s for s in symbols if s not in fixed]
            p = random_near(dict(base, **fixed), free, spec.probe_ok, rng, pools or {}, ties)
        try:
            rec = record(spec, p, an.precision)
        except SymcostError:
            continue
        msg = compare(p, rec)
        fit_at = {**fit_blocks, **({"L": FIT_L + spec.lead_blocks + _middle(spec)} if "L" in p else {})}
        if msg and accept is not None and fit_at and not accept(dict(p, **fit_at)):
            continue  # the random point left the regime: draw another
        if msg:
            raise CheckFailed(msg, config_syms or symbols)
        checked += 1
        if checked == 2:
            return
    if checked == 0:
        # (no random size records: a regime narrower than the pools, e.g. K_conv drawn above S): pinned, not refused
        e = CheckFailed(f"{spec.name}: no fresh probe of this regime could be recorded to check the formulas",
                        config_syms or symbols)
        e.pin_reason = "no random size of its regime records the same ops, so the formulas could not be checked away from it"
        raise e


def _build_graph(ref: Recording, ops: list[SymOp], role) -> nx.DiGraph:
    g = nx.DiGraph()
    producer: dict[int, tuple[int, int]] = {}
    kept = {op.index: op for op in ops}
    for i, op in enumerate(ref.ops):
        sop = kept.get(i)
        for k, t in enumerate(op.outputs):
            producer[t.tid] = (i, k)
        if sop is None:
            continue
        g.add_node(
            i, kind="op", op=op.name, family=sop.family, module=sop.module, phase=sop.phase,
            repeat=sop.repeat, in_shapes=sop.in_shapes, out_shapes=sop.out_shapes,
            dtypes=[str(d).removeprefix("torch.") for d in sop.out_dtypes],
            flops=sop.cost.flops, flops_hw=sop.cost.flops_hw, flops_all=sop.cost.flops_all, bytes=sop.cost.bytes,
            intensity=(sympy.cancel(sop.cost.flops_all / sop.cost.bytes) if sop.cost.bytes != 0 else 0),
        )
        for k, t in enumerate(op.inputs):
            shape = sop.in_shapes[k]
            nbytes = rules.nbytes(shape, t.dtype)
            if t.source:
                kind, _, name = t.source.partition(":")
                src = f"{kind}:{role(name.rpartition('.')[0], name)[2]}"
                if src not in g:
                    g.add_node(src, kind=src.split(":")[0], shape=shape,
                               dtypes=[str(t.dtype).removeprefix("torch.")])
                g.add_edge(src, i, shape=shape, bytes=nbytes)
            elif t.tid in producer and producer[t.tid][0] in kept:
                g.add_edge(producer[t.tid][0], i, shape=shape, bytes=nbytes)
    return g

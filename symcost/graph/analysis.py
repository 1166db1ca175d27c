"""The op graph of one training step and everything read off it: :class:`Analysis`.

An Analysis is what :func:`symcost.trace` (:mod:`symcost.graph.build`) returns and every pass
reads: the folded op list and its ``networkx`` graph with symbolic shapes and costs, the
parameters, the saved tensors, the storage schedule and the regime it was traced in. Its pieces:
:class:`~symcost.graph.totals.Totals` (FLOPs, bytes, parameter counts),
:class:`~symcost.graph.conventions.Conventions` (embedding parameters, causal counts, 6·N·P),
:class:`~symcost.graph.serialize.Serialized` (to and from plain data); this module holds the fields,
evaluation at sizes (``bind``, ``subs``, ``lambdify``) and export.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy

from symcost._lazy import LazyModule
from symcost.errors import SymcostError
from symcost.frontends.spec import MESH_HINT, ModelSpec
from symcost.tracing.fit import FIT_L, SYMS
from symcost.tracing.regime import digest, regime_signature
from symcost.graph.conventions import Conventions
from symcost.graph.ops import PHASES, SymOp  # noqa: F401  (re-exported)
from symcost.graph.serialize import Serialized
from symcost.graph.totals import Totals

nx = LazyModule("networkx")


def record(spec, values, precision="fp32", optimizer=None):
    """:func:`symcost.tracing.record.record` (imported on first use: it imports torch)."""
    from symcost.tracing.record import record as _record

    return _record(spec, values, precision, optimizer)


@dataclass(eq=False)
class Analysis(Totals, Conventions, Serialized):
    """The symbolic cost model of one training step (forward + backward) of a model, or of one
    inference step (``step`` "prefill" or "decode": a forward through the model's KV cache).

    Attributes:
        model: the model name.
        spec: its :class:`~symcost.frontends.models.ModelSpec`.
        graph: ``networkx.DiGraph``; op nodes carry ``op``, ``family``, ``module``, ``phase``,
            ``repeat`` (1 or L), ``in_shapes``/``out_shapes`` (sympy), ``dtypes``, ``flops``,
            ``flops_hw``, ``flops_all``, ``bytes`` and ``intensity`` (FLOP/byte); edges carry the tensor's
            ``shape`` and ``bytes``. Parameter and input nodes have ``kind`` "param"/"input".
        ops: the folded op list in execution order.
        symbols: the free symbols (name -> meaning).
        param_shapes: parameter name (folded) -> (shape, dtype, repeat).
        unsupported: aten op name -> number of executions (per training step, symbolic).
        saved: activations saved for backward: list of (module, nbytes expr, dtype, repeat).
        pinned: symbols fixed at the requested value in this trace (not symbols of the formulas),
            with ``pin_reasons``; ``regime_ties`` (follower -> leader), ``request_facts`` and
            ``residues`` complete the regime it was traced for (see :func:`trace`).
        schedule: the step's storage schedule (:class:`symcost.tracing.schedule.MemorySchedule`): every
            allocation and free with its symbolic size, the fold units over L, parameter sizes
            in the optimizer's order, buffers and inputs; what the memory passes read.
    """

    model: str
    spec: ModelSpec
    graph: nx.DiGraph
    ops: list[SymOp]
    symbols: dict[str, str]
    param_shapes: dict[str, tuple]
    matmul_params: set[str]
    unsupported: dict[str, Any]
    saved: list[tuple] = field(default_factory=list)
    layer_container: str | None = None
    # several stacks of repeated blocks folded each under its own length symbol (container ->
    # symbol: T5's encoder.block and decoder.block -> L; graph/stacks.py); empty where one block
    # list (layer_container) or none folds
    stacks: dict[str, str] = field(default_factory=dict)
    # blocks of each stack symbol in the probes (2; 3 where both end blocks stand apart, T5: its
    # formulas then hold for the symbol >= 2)
    stack_blocks: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    precision: str = "fp32"
    tied: dict[str, list[str]] = field(default_factory=dict)
    recordings: list = field(default_factory=list, repr=False)  # probe recordings (for passes)
    plan: Any = None  # the fit's ProbePlan: recordings[i] was taken at plan.points[i]
    fitter: Any = None  # fit.Fitter over those probes: signature (one int per probe) -> polynomial
    role: Any = None  # role(module, name=None) -> (keep, repeat, folded name), see _layer_roles
    pinned: dict[str, int] = field(default_factory=dict)  # sizes fixed at the requested value (not symbols)
    # the regime it was traced for (plain data; see trace()): request_facts of the request, the
    # symbols tied to another (follower -> leader), why each pinned symbol is pinned, and the
    # residue classes (symbol -> [modulus, residue]) the formulas hold in
    request_facts: dict = field(default_factory=dict)
    regime_ties: dict[str, str] = field(default_factory=dict)
    pin_reasons: dict[str, str] = field(default_factory=dict)
    residues: dict[str, list] = field(default_factory=dict)
    # the range each padded size's formulas hold in (symbol -> [lo, hi], hi None: no bound;
    # ModelSpec.pads: Mamba-2's S below one chunk of the scan, or from two chunks on)
    bounds: dict[str, list] = field(default_factory=dict)
    signature: str = ""  # sha256 of regime_signature() of the request's recording
    # the requested values the regime was chosen for (symbol -> int; B and S where requested):
    # a pass that traces a variant of the step (checkpoint.uniform_spec) traces the same regime
    request_sizes: dict = field(default_factory=dict)
    # the step traced: "train", or an inference step ("prefill", "decode") through the KV-cache
    # class ``kv_cache``; ``kv_layers``: the cache's bytes after the step per (folded) layer,
    # ``(name, bytes formula, repeat)`` (``kv_bytes`` is their total)
    step: str = "train"
    kv_cache: str | None = None
    kv_layers: list = field(default_factory=list)
    # data-parallel traces (symcost.frontends.parallel): the --shard strategy, and each
    # parameter's shard on one rank: name (folded) -> (shape, dtype, repeat), as param_shapes
    parallel: str | None = None
    param_shards: dict[str, tuple] = field(default_factory=dict)
    # the 2-D mesh (--dp with --tp): "tp" or "tp+sp", the tensor parallelism inside each
    # data-parallel rank (``parallel`` is then the --shard strategy); None on a 1-D mesh
    tensor_parallel: str | None = None
    # parameters (folded names, as ``param_shapes``) with ``requires_grad=False``: frozen, with no
    # gradient, no optimizer state and no reduction (torch.optim skips a parameter whose ``grad``
    # is None; DDP, FSDP2 and Megatron-LM's buffers take only those that require grad)
    frozen: set = field(default_factory=set)

    def in_regime(self, **sizes: int) -> bool:
        """Whether ``sizes`` (others at the defaults) run the ops this trace's request ran: the
        cheap facts (pinned values, ties, residues, constraints: :meth:`bind`) and then one
        recording at those sizes with L = 2 whose :func:`regime_signature` must match (a BLOOM
        trace at a power-of-two H does not hold at H = 12). About one probe recording of time.
        
        Raises:
            SymcostError: an analysis read from the trace cache (it cannot build the model).
        """
        self.require_live("in_regime (one recording at the sizes)")
        try:
            env = self.bind(**sizes)
        except SymcostError:
            return False
        values = {str(k): int(v) for k, v in env.items()}
        for s in self.spec.input_symbols:  # not requested: the regime of any size other than 1
            values[s] = sizes.get(s, self.pinned.get(s, {"B": 2, "S": 16, "T": 16}[s]))
        if "L" in values and "L" not in self.pinned:
            values["L"] = FIT_L + getattr(self.spec, "lead_blocks", 0)
        for s in set(self.stacks.values()):  # (every stack holds its probe blocks, FIT_L or 3)
            values[s] = self.stack_blocks.get(s, FIT_L)
        values.update({a: values[b] for a, b in self.spec.tied.items() if b in values})
        try:
            rec = record(self.spec, values, self.precision)
        except SymcostError:
            return False
        return digest(regime_signature(rec)) == self.signature
    schedule: Any = None  # tracing.schedule.MemorySchedule: the step's storage schedule as data

    def require_live(self, what: str) -> None:
        """Raise unless this analysis carries its live trace (the probe recordings and the fold
        of the blocks), which an analysis read from the trace cache (data only) does not.

        Raises:
            SymcostError: naming ``what`` needs it and how to trace afresh.
        """
        if not self.recordings or self.role is None:
            raise SymcostError(
                f"{self.model}: {what} needs the live trace (the model and its probe recordings); this analysis "
                "was read from the trace cache, which keeps data only: trace it with "
                "symcost.trace(..., use_cache=False) (the CLI's --no-cache)")

    # -- evaluation -----------------------------------------------------------------------------
    def bind(self, **sizes: int) -> dict[sympy.Symbol, int]:
        """Symbol values: the given ``sizes`` over the model's defaults; tied symbols follow.

        Raises:
            SymcostError: a symbol the model does not have, or a non-positive / non-integer value.
        """
        values = {s: self.spec.defaults[s] for s in self.symbols if s in self.spec.defaults}
        for k, v in sizes.items():
            if k in self.pinned and v == self.pinned[k]:
                continue
            if k in self.pinned:
                raise SymcostError(
                    f"{k} was traced pinned to {self.pinned[k]} ({self.pin_reasons.get(k, 'its regime')}); "
                    f"trace again for {k}={v} (symcost.trace(..., sizes={{{k!r}: {v}}}) or --set {k}={v})")
            if k in self.spec.tied:
                other = self.spec.tied[k]
                if v == sizes.get(other, self.spec.defaults.get(other)):
                    continue
                if k in self.regime_ties:
                    raise SymcostError(
                        f"{k} was traced equal to {other} (that regime runs other ops in {self.model}); "
                        f"trace again for {k}={v} (symcost.trace(..., sizes={{{k!r}: {v}}}) or --set {k}={v})")
                raise SymcostError(f"{k} is tied to {other} in {self.model}; it cannot be set on its own")
            if k not in self.symbols:
                known = ", ".join(self.symbols)
                raise SymcostError(f"unknown symbol {k!r} for {self.model}; accepted: {known}{MESH_HINT.get(k, '')}")
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SymcostError(f"{k} must be a positive integer, got {v!r}")
            if k in self.residues and v % self.residues[k][0] != self.residues[k][1]:
                m, r = self.residues[k]
                raise SymcostError(
                    f"{k}={v} lies outside the regime {k} = {r} mod {m} this trace holds for (its sizes are "
                    f"polynomial in {k} only there); trace again for {k}={v} (--set {k}={v})")
            if k in (self.bounds or {}) and not (self.bounds[k][0] <= v and (self.bounds[k][1] is None
                                                                       or v <= self.bounds[k][1])):
                from symcost.tracing.probes import bounds_words

                raise SymcostError(
                    f"{k}={v} lies outside the regime {bounds_words(k, self.bounds[k], (getattr(self.spec, 'pads', None) or {}).get(k))} "
                    f"this trace holds for (other sizes run other ops); trace again for {k}={v} (--set {k}={v})")
            values[k] = v
        for a, b in self.spec.follows.items():  # K = H where the config leaves K unset
            if a not in sizes and a in values and b in values:
                values[a] = values[b]
        values.update(self.pinned)
        lead = getattr(self.spec, "lead_blocks", 0) or 0
        if lead and "L" in self.symbols and "L" not in self.pinned and values.get("L", lead + 1) <= lead:
            raise SymcostError(
                f"L={values['L']}: {self.model} has {lead} leading blocks of another kind "
                f"({self.spec.extra.get('lead_blocks_note', 'the first blocks')}); this trace's formulas "
                f"hold for L > {lead}, and a model of L <= {lead} blocks is all leading blocks, a regime of "
                f"its own: trace again for L={values['L']} (symcost.trace(..., sizes={{'L': {values['L']}}}) "
                f"or --set L={values['L']})")
        for s, n in (self.stack_blocks or {}).items():
            if n > FIT_L and s not in self.pinned and values.get(s, 2) < 2:
                raise SymcostError(
                    f"{s}={values[s]}: the first and the last block of {self.model}'s stack of {s} blocks differ "
                    f"from the others, so this trace's formulas hold for {s} >= 2; a stack of one block is a "
                    f"regime of its own: trace again for {s}={values[s]} (symcost.trace(..., sizes={{'{s}': "
                    f"{values[s]}}}) or --set {s}={values[s]})")
        missing = [s for s in self.symbols if s not in values]
        if missing:
            raise SymcostError(f"no value for {', '.join(missing)}; set it with --set")
        msg = self.spec.check(values)
        if msg:
            raise SymcostError(msg)
        if self.role is not None:  # (a live trace: the model can be built at these sizes)
            from symcost.graph import reuse

            reuse.check(self, values)  # the fitted parameter shapes hold here (a step-function width)
        return {SYMS[k]: v for k, v in values.items()}

    def subs(self, **sizes: int) -> dict[str, int]:
        """Every total as an integer at the given sizes (others at the model's defaults).

        A size set to 1 that this step was traced larger (size 1 is a regime of its own:
        shared/conventions.md, "Regimes") is evaluated with a warning that the formulas were not
        checked there (:func:`symcost.graph.reuse.other_regime`; a trace at that size checks them).

        Where the formulas do not hold at these sizes (a parameter's shape there is not its fitted
        formula's: a width that is a step function of the symbols, :mod:`symcost.graph.reuse`),
        the step is traced again at them with the options of this trace, a warning says so (and
        what the new trace pinned), and its totals are returned.

        Raises:
            SymcostError: as :meth:`bind`; :class:`symcost.graph.reuse.NotAtTheseSizes` where the
                formulas do not hold and this analysis cannot trace again (read from the cache).
        """
        from symcost.graph.reuse import NotAtTheseSizes, other_regime

        try:
            env = self.bind(**sizes)
        except NotAtTheseSizes as e:
            return self._traced_again(e, sizes).subs(**sizes)
        other_regime(self, {str(k): v for k, v in env.items()})  # (a size of 1 traced larger: a warning)
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731  (xreplace: no re-simplifying)
        out = {"params": ev(self.params), "params_matmul": ev(self.params_matmul)}
        out["params_active"] = ev(self.params_active)
        for ph in PHASES + ("train",):
            out[f"flops.{ph}"] = ev(self.flops(ph))
            out[f"flops_hw.{ph}"] = ev(self.flops(ph, "hardware"))
            out[f"flops_all.{ph}"] = ev(self.flops(ph, "all"))
            out[f"bytes.{ph}"] = ev(self.bytes(ph))
            out[f"transcendentals.{ph}"] = ev(self.transcendentals(ph))
        return out

    def _traced_again(self, e, sizes: dict) -> "Analysis":
        """This step traced again at ``sizes`` (on top of this trace's request) with this trace's
        options, once per sizes, with a warning naming why; ``e`` re-raised where this analysis
        keeps no options to trace with (read from the trace cache)."""
        import warnings

        trace = self.__dict__.get("trace_again")  # (symcost.graph.build.trace with this trace's options)
        if trace is None:
            raise e
        key = tuple(sorted(sizes.items()))
        memo = self.__dict__.setdefault("_traced_again", {})
        if key not in memo:
            from symcost.graph.reuse import at_fault

            pins = at_fault(self, e.values, e.param)  # (pinned from the start: the fit never meets the step)
            again = trace(sizes={**dict(trace.keywords.get("sizes") or {}), **sizes}, _pins=pins)
            pinned = ", ".join(f"{k}={v}" for k, v in again.pinned.items()) or "nothing"
            warnings.warn(f"{e}. Traced again at these sizes (pinned: {pinned})", stacklevel=3)
            memo[key] = again
        return memo[key]

    def quantity(self, name: str) -> sympy.Expr:
        """A total by its JSON name: ``params``, ``params_matmul``, ``flops.<phase>``,
        ``flops_hw.<phase>``, ``flops_all.<phase>``, ``bytes.<phase>``, ``attention_flops``."""
        if name in ("params", "params_matmul", "attention_flops", "params_active", "params_active_matmul"):
            return getattr(self, name)
        kind, _, phase = name.partition(".")
        if kind == "flops":
            return self.flops(phase)
        if kind == "flops_hw":
            return self.flops(phase, "hardware")
        if kind == "flops_all":
            return self.flops(phase, "all")
        if kind == "bytes":
            return self.bytes(phase)
        if kind == "transcendentals":
            return self.transcendentals(phase)
        raise SymcostError(f"unknown quantity {name!r}")

    def lambdify(self, *names: str):
        """A fast numpy function of the symbols for the named totals (vectorised over arrays).

        ``f = an.lambdify("flops.train"); f(B=np.array([...]), S=..., ...)`` returns an array per
        name (float64; exact below 2**53). Symbols not passed take the model's defaults.
        """
        syms = [SYMS[s] for s in self.symbols]
        fn = sympy.lambdify(syms, [self.quantity(n) for n in names], modules="numpy")
        defaults = {str(k): v for k, v in self.bind().items()}

        def f(**sizes):
            import numpy as np

            args = [np.asarray(sizes.get(s, defaults.get(s)), dtype=np.float64) for s in self.symbols]
            return fn(*args)

        return f

    def __repr__(self) -> str:
        P, rem, form = self.train_simplified()
        return (
            f"<symcost.Analysis {self.model}: {len(self.ops)} ops "
            f"({self.graph.number_of_nodes()} graph nodes), symbols {','.join(self.symbols)}\n"
            f"  params = {self.params}\n  flops.train = {form}>"
        )

    def _repr_latex_(self) -> str:
        P, rem, form = self.train_simplified()
        return (
            r"$\mathrm{FLOPs}_{train} = " + sympy.latex(form) + r"$"
            + r"<br>$P = " + sympy.latex(P) + "$"
        )

    def _repr_html_(self) -> str:
        """Jupyter's inline view: the explorer page of this analysis (:func:`symcost.explore`,
        built by the render stage through the public API, in an ``<iframe srcdoc>``)."""
        import symcost

        return symcost.explore(self)._repr_html_()

    def write(self, path: str) -> None:
        """Write the graph as GraphML (``.graphml``) or node-link JSON (``.json``).

        Sympy values are written as strings that :func:`symcost.parse_formula` parses.
        """
        g = nx.DiGraph()
        for n, d in self.graph.nodes(data=True):
            g.add_node(str(n), **{k: str(v) for k, v in d.items()})
        for u, v, d in self.graph.edges(data=True):
            g.add_edge(str(u), str(v), **{k: str(x) for k, x in d.items()})
        if path.endswith(".graphml"):
            nx.write_graphml(g, path)
        elif path.endswith(".json"):
            import json

            with open(path, "w") as f:
                json.dump(nx.node_link_data(g, edges="edges"), f, indent=1)
        else:
            raise SymcostError(f"unknown graph format for {path!r}; accepted: .graphml, .json")

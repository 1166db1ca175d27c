"""From probe recordings to one symbolic op graph of the training step, with costs and totals.

``trace(model)`` records the training step at probe sizes (:mod:`symcost.record`), aligns the
recordings op by op, rebuilds every size as a polynomial in the canonical symbols
(:mod:`symcost.fit`), folds the L repeated blocks into one block with ``repeat = L``, applies the
cost rules (:mod:`symcost.rules`) to the symbolic shapes, and checks the resulting totals against
fresh recordings (other sizes, L = 3) that took no part in the fit.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import sympy

from ._lazy import LazyModule
from . import opsets
from .modules import _fold_name, _layer_of, _rename_block  # noqa: F401  (re-exported)
from .errors import SymcostError
from .fit import (SYMS, Fitter, FitError, ProbePlan, Unvariable, find_base, parse_formula, plan_probes,
                  probe_pool, random_point, random_pools)
from .memory import MemorySchedule, fit_schedule
from .spec import INPUT_SYMBOLS, SYMBOL_MEANINGS, Constraint, ModelSpec, request_facts

if TYPE_CHECKING:  # pragma: no cover
    from .record import OpCall, Recording

# torch, the recorder and the cost rules load on first use: a cached Analysis
# (symcost.cache) is evaluated without them.
nx = LazyModule("networkx")
torch = LazyModule("torch")
rules = LazyModule("symcost.rules")


def resolve(model, config=None, attention="eager"):
    """:func:`symcost.models.resolve` (imported on first use: it imports torch)."""
    from .models import resolve as _resolve

    return _resolve(model, config, attention)


def record(spec, values, precision="fp32", optimizer=None):
    """:func:`symcost.record.record` (imported on first use: it imports torch)."""
    from .record import record as _record

    return _record(spec, values, precision, optimizer)


def tree_flatten(*args, **kwargs):
    from torch.utils._pytree import tree_flatten as _f

    return _f(*args, **kwargs)


def tree_unflatten(*args, **kwargs):
    from torch.utils._pytree import tree_unflatten as _f

    return _f(*args, **kwargs)

PHASES = ("forward", "backward")
FIT_L = 2
CHECK_L = 3


@dataclass
class SymOp:
    """One op of the folded graph with symbolic shapes and costs."""

    index: int
    name: str
    family: str
    module: str
    phase: str
    repeat: Any  # 1, or the symbol L for ops of the repeated block
    in_shapes: list[tuple]
    in_dtypes: list[torch.dtype]
    out_shapes: list[tuple]
    out_dtypes: list[torch.dtype]
    cost: rules.Cost
    layer: int | None = None
    attention: bool = False  # a matmul-class op with no parameter operand


def _op_view(op: OpCall, in_shapes, out_shapes, ints) -> rules.OpView:
    from .record import IntRef, TensorRef

    flat, spec = tree_flatten(op.args_tree, is_leaf=lambda x: isinstance(x, (TensorRef, IntRef)))
    vals = []
    for a in flat:
        if isinstance(a, TensorRef):
            vals.append(tuple(in_shapes[a.index]))
        elif isinstance(a, IntRef):
            vals.append(ints[a.index])
        else:
            vals.append(a)
    args, kwargs = tree_unflatten(vals, spec)
    return rules.OpView(
        op.op, op.name, in_shapes, [t.dtype for t in op.inputs], out_shapes,
        [t.dtype for t in op.outputs], tuple(args), dict(kwargs),
    )


def concrete_cost(op: OpCall) -> rules.Cost:
    """Cost of a recorded op at its concrete sizes."""
    return rules.cost(
        _op_view(op, [t.shape for t in op.inputs], [t.shape for t in op.outputs], op.ints)
    )


def _matmul_params(rec: Recording) -> tuple[set[str], set[int]]:
    """Parameters that reach a matmul-class op (through views) in the forward, and those ops."""
    origin: dict[int, str] = {}
    used: set[str] = set()
    ops_with_param: set[int] = set()
    for i, op in enumerate(rec.ops):
        if op.phase != "forward":
            break
        srcs = set()
        fam = rules.classify(op.op)
        operands = op.inputs
        if fam == "model":  # bias operands are not matmul weights (flop_counter ignores bias adds)
            operands = [t for k, t in enumerate(op.inputs) if k not in rules.bias_positions(op.op)]
        for t in operands:
            if t.source and t.source.startswith("param:"):
                srcs.add(t.source[6:])
            elif t.tid in origin:
                srcs.add(origin[t.tid])
        if (fam == "view" or str(op.op.overloadpacket) in rules.PASS_THROUGH) and srcs:
            for t in op.outputs:
                origin[t.tid] = next(iter(srcs))
        if fam == "model" and srcs:
            used |= srcs
            ops_with_param.add(i)
    return used, ops_with_param


@dataclass(eq=False)
class Analysis:
    """The symbolic cost model of one training step (forward + backward) of a model.

    Attributes:
        model: the model name.
        spec: its :class:`~symcost.models.ModelSpec`.
        graph: ``networkx.DiGraph``; op nodes carry ``op``, ``family``, ``module``, ``phase``,
            ``repeat`` (1 or L), ``in_shapes``/``out_shapes`` (sympy), ``dtypes``, ``flops``,
            ``flops_all``, ``bytes`` and ``intensity`` (FLOP/byte); edges carry the tensor's
            ``shape`` and ``bytes``. Parameter and input nodes have ``kind`` "param"/"input".
        ops: the folded op list in execution order.
        symbols: the free symbols (name -> meaning).
        param_shapes: parameter name (folded) -> (shape, dtype, repeat).
        unsupported: aten op name -> number of executions (per training step, symbolic).
        saved: activations saved for backward: list of (module, nbytes expr, dtype, repeat).
        pinned: symbols fixed at the requested value in this trace (not symbols of the formulas),
            with ``pin_reasons``; ``regime_ties`` (follower -> leader), ``request_facts`` and
            ``residues`` complete the regime it was traced for (see :func:`trace`).
        schedule: the step's storage schedule (:class:`symcost.memory.MemorySchedule`): every
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
    signature: str = ""  # sha256 of regime_signature() of the request's recording

    def in_regime(self, **sizes: int) -> bool:
        """Whether ``sizes`` (others at the defaults) run the ops this trace's request ran: the
        cheap facts (pinned values, ties, residues, constraints: :meth:`bind`) and then one
        recording at those sizes with L = 2 whose :func:`regime_signature` must match (a BLOOM
        trace at a power-of-two H does not hold at H = 12). About one probe recording of time.
        """
        try:
            env = self.bind(**sizes)
        except SymcostError:
            return False
        values = {str(k): int(v) for k, v in env.items()}
        for s in ("B", "S"):  # not requested: the regime of any size other than 1
            values[s] = sizes.get(s, self.pinned.get(s, {"B": 2, "S": 16}[s]))
        if "L" in values and "L" not in self.pinned:
            values["L"] = FIT_L
        values.update({a: values[b] for a, b in self.spec.tied.items() if b in values})
        try:
            rec = record(self.spec, values, self.precision)
        except SymcostError:
            return False
        return _digest(regime_signature(rec)) == self.signature
    schedule: Any = None  # memory.MemorySchedule: the step's storage schedule as data

    def params_not_in_P(self) -> dict[str, list[str]]:
        """Parameters outside P, grouped by why: embedding lookups, biases, norms/elementwise."""
        pre = self.__dict__.get("_params_not_in_P")
        if pre is not None:  # read back with the analysis (from_dict)
            return {k: list(v) for k, v in pre.items()}
        out: dict[str, list[str]] = {}
        g = self.graph
        for name in self.param_shapes:
            if name in self.matmul_params:
                continue
            node = f"param:{name}"
            why = "other (unused in the forward)"
            frontier = list(g.successors(node)) if node in g else []
            while frontier:
                n = frontier.pop(0)
                d = g.nodes[n]
                if d.get("phase") != "forward":
                    continue
                if opsets.same_tensor(d):
                    frontier.extend(g.successors(n))
                    continue
                op = d.get("op", "")
                lookup = any(k in op for k in ("embedding", "aten.index", "index_select", "gather"))
                why = ("embedding lookups" if lookup else
                       "biases" if d.get("family") == "model" else "norms and elementwise scales")
                break
            out.setdefault(why, []).append(name)
        if self.tied:
            out["tied (counted once)"] = [f"{a} = {', '.join(b)}" for a, b in self.tied.items()]
        return out

    # -- as data (the trace cache) -------------------------------------------------------------
    #: Bumped whenever the layout of :meth:`to_dict` changes (older cache entries are rebuilt).
    FORMAT = 1

    def __getattr__(self, name: str):
        # ``ops`` and ``graph`` of an Analysis read back by from_dict are parsed on first use
        lazy = self.__dict__.get("_lazy")
        if lazy is not None and name in ("ops", "graph"):
            value = _load_ops(lazy["ops"]) if name == "ops" else _load_graph(lazy["graph"])
            self.__dict__[name] = value
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _formula(self, key: str):
        pre = self.__dict__.get("_formulas")
        return pre.get(key) if pre else None

    def to_dict(self) -> dict:
        """The analysis as plain data (JSON): formulas as strings :func:`symcost.parse_formula`
        reads, the per-op costs and shapes, the graph, the saved tensors, the memory schedule,
        the totals, and the spec's data (name, symbols, defaults, tied, constraints, layers,
        extra). :meth:`from_dict` reads it back without torch; what needs the model itself
        (``spec.build``, the recordings) is not kept.

        Raises:
            SymcostError: the spec's ``check`` is code, not declarative ``constraints`` (it
                could not be checked again from data).
        """
        spec = self.spec
        if getattr(spec.check, "__qualname__", "").split(".<locals>")[0] != "ModelSpec.__post_init__":
            raise SymcostError(f"{spec.name}: its size check is code, not declarative constraints; "
                               "such a trace is not kept as data")
        s = str
        totals = {f"{k}.{ph}": s(self.flops(ph, "all" if k == "flops_all" else "model") if k != "bytes"
                                 else self.bytes(ph))
                  for k in ("flops", "flops_all", "bytes") for ph in PHASES + ("train",)}
        totals.update({f"transcendental_total.{ph}": s(self.transcendentals(ph)) for ph in PHASES + ("train",)})
        totals.update({k: s(getattr(self, k)) for k in _CACHED_TOTALS if hasattr(type(self), k)})
        dt = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        ops = [[op.index, op.name, op.family, op.module, op.phase, s(op.repeat),
                [[s(x) for x in sh] for sh in op.in_shapes], [dt(d) for d in op.in_dtypes],
                [[s(x) for x in sh] for sh in op.out_shapes], [dt(d) for d in op.out_dtypes],
                [s(op.cost.flops), s(op.cost.flops_all), s(op.cost.bytes),
                 {k: s(n) for k, n in op.cost.transcendentals.items()}], op.layer, op.attention]
               for op in self.ops]
        g = self.graph
        graph = {
            "nodes": [[n if isinstance(n, int) else s(n), {k: _data(v) for k, v in d.items()}]
                      for n, d in g.nodes(data=True)],
            "edges": [[u if isinstance(u, int) else s(u), v, {k: _data(x) for k, x in d.items()}]
                      for u, v, d in g.edges(data=True)],
        }
        plan = self.plan
        return {
            "format": self.FORMAT,
            "model": self.model, "precision": self.precision, "symbols": dict(self.symbols),
            "spec": {"name": spec.name, "symbols": list(spec.symbols), "defaults": dict(spec.defaults),
                     "tied": dict(spec.tied), "layers": spec.layers, "moduli": dict(getattr(spec, "moduli", {})),
                     "follows": dict(getattr(spec, "follows", {})),
                     "constraints": [[c.kind, c.a, c.b, c.why] for c in spec.constraints],
                     "extra": _jsonable(spec.extra)},
            "param_shapes": {n: [[s(x) for x in sh], dt(d), s(rep)] for n, (sh, d, rep) in self.param_shapes.items()},
            "matmul_params": sorted(self.matmul_params),
            "unsupported": {k: s(v) for k, v in self.unsupported.items()},
            "saved": [[m, s(nb), dt(d), s(rep)] for m, nb, d, rep in self.saved],
            "layer_container": self.layer_container, "timings": dict(self.timings),
            "tied": {k: list(v) for k, v in self.tied.items()}, "pinned": dict(self.pinned),
            "plan": None if plan is None else {"symbols": list(plan.symbols), "points": plan.points,
                                               "axis": plan.axis},
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "totals": totals, "totals_terms": _totals_terms(self.symbols, totals),
            "ops": ops, "graph": graph, "params_not_in_P": self.params_not_in_P(),
            "embedding_params": dict(self.embedding_params) if hasattr(type(self), "embedding_params") else None,
            "fusion": self._fusion_data(),
            "module_classes": self._module_classes(),
            # the regime's data (plain dicts), where the tracer records it
            "regime": {k: _jsonable(getattr(self, k)) for k in _REGIME_FIELDS if hasattr(self, k)},
        }

    def _module_classes(self) -> dict | None:
        """Module path -> class name (:func:`symcost.modules.module_classes`), kept for the report
        of a cached analysis; None when unavailable."""
        if "_module_classes" in self.__dict__:
            return self.__dict__["_module_classes"]
        from .modules import module_classes

        return module_classes(self) or None

    def _fusion_data(self) -> dict | None:
        """The fused-bytes estimate (:func:`symcost.fusion.estimate`, which needs the probe
        recordings) as data, so a cached analysis gives the same fused bytes; None without
        recordings."""
        if "_fusion_data" in self.__dict__:
            return self.__dict__["_fusion_data"]
        if not self.recordings:
            return None
        try:
            from . import fusion
        except ImportError:
            return None
        fe = fusion.estimate(self)
        return {"node_bytes": [[i, str(v)] for i, v in fe.node_bytes.items()],
                "node_written": [[i, str(v)] for i, v in fe.node_written.items()],
                "region_of": [[i, r] for i, r in fe.region_of.items()],
                "regions": [[r, list(ids)] for r, ids in fe.regions.items()], "exact": bool(fe.exact)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Analysis":
        """An Analysis from :meth:`to_dict`'s data, without importing torch.

        Totals are parsed at once (a few formulas); ``ops`` and ``graph`` on first use. Its spec
        checks sizes (``bind``) from the constraints but cannot build the model.

        Raises:
            SymcostError: data of another format; KeyError/TypeError/ValueError on malformed data.
        """
        if d.get("format") != cls.FORMAT:
            raise SymcostError(f"analysis data of format {d.get('format')!r}, expected {cls.FORMAT}")
        P = functools.lru_cache(maxsize=None)(parse_formula)  # many sizes repeat
        ops, graph = d["ops"], d["graph"]  # parsed on first use: their layout is checked now
        if not (isinstance(ops, list) and all(isinstance(r, list) and len(r) == 13 for r in ops)
                and isinstance(graph["nodes"], list) and isinstance(graph["edges"], list)):
            raise ValueError("malformed ops or graph")
        sd = d["spec"]

        def _gone(*args, **kwargs):
            raise SymcostError(f"{sd['name']}: this analysis was read from the trace cache and cannot "
                               "build the model; trace it again (symcost --no-cache, or symcost.trace)")

        more = {k: dict(sd[k]) for k in ("moduli", "follows") if sd.get(k) and k in ModelSpec.__dataclass_fields__}
        spec = ModelSpec(name=sd["name"], symbols=tuple(sd["symbols"]), defaults=dict(sd["defaults"]),
                         build=_gone, make_inputs=_gone, loss=_gone,
                         constraints=tuple(Constraint(*c) for c in sd["constraints"]),
                         tied=dict(sd["tied"]), layers=sd["layers"], extra=dict(sd["extra"]), **more)
        an = cls.__new__(cls)
        for f in dataclasses.fields(cls):  # every field with a default first (fields added later too)
            if f.default is not dataclasses.MISSING:
                an.__dict__[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                an.__dict__[f.name] = f.default_factory()
        plan = d.get("plan")
        an.__dict__.update(
            model=d["model"], spec=spec, symbols=dict(d["symbols"]),
            param_shapes={n: (tuple(P(x) for x in sh), dtype, P(rep)) for n, (sh, dtype, rep) in d["param_shapes"].items()},
            matmul_params=set(d["matmul_params"]),
            unsupported={k: P(v) for k, v in d["unsupported"].items()},
            saved=[(m, P(nb), dtype, P(rep)) for m, nb, dtype, rep in d["saved"]],
            layer_container=d["layer_container"], timings=dict(d["timings"]), precision=d["precision"],
            tied={k: list(v) for k, v in d["tied"].items()}, recordings=[],
            plan=None if plan is None else ProbePlan(tuple(plan["symbols"]), [dict(p) for p in plan["points"]],
                                                     dict(plan["axis"])),
            fitter=None, role=None, pinned={k: int(v) for k, v in d["pinned"].items()},
            schedule=None if d.get("schedule") is None else MemorySchedule.from_dict(d["schedule"]),
            _lazy={"ops": ops, "graph": graph},
        )
        for k, v in d.get("regime", {}).items():
            if k in _REGIME_FIELDS:
                an.__dict__[k] = v
        if isinstance(d.get("module_classes"), dict):
            an.__dict__["_module_classes"] = d["module_classes"]
        if isinstance(d.get("fusion"), dict):
            an.__dict__["_fusion_data"] = d["fusion"]
        if isinstance(d.get("params_not_in_P"), dict):
            an.__dict__["_params_not_in_P"] = d["params_not_in_P"]
        tot = _load_totals(d.get("symbols", {}), d["totals"], d.get("totals_terms") or {}, P)
        an.__dict__["_formulas"] = tot
        for k in _CACHED_TOTALS:  # functools.cached_property slots
            if k in tot and hasattr(cls, k):
                an.__dict__[k] = tot[k]
        if isinstance(d.get("embedding_params"), dict) and hasattr(cls, "embedding_params"):
            an.__dict__["embedding_params"] = dict(d["embedding_params"])
        return an

    # -- totals ---------------------------------------------------------------------------------
    def _sum(self, attr: str, phase: str) -> sympy.Expr:
        phases = PHASES if phase == "train" else (phase,)
        if phase not in ("forward", "backward", "train"):
            raise SymcostError(f"unknown phase {phase!r}; accepted: forward, backward, train")
        pre = self._formula(f"{attr}.{phase}")
        if pre is not None:  # read back with the analysis (from_dict)
            return pre
        return sympy.expand(
            sympy.Add(*[op.repeat * getattr(op.cost, attr) for op in self.ops if op.phase in phases])
        )

    @functools.cache
    def flops(self, phase: str = "train", kind: str = "model") -> sympy.Expr:
        """Total FLOPs of ``phase`` (forward|backward|train) as a polynomial in the symbols.

        ``kind="model"``: matmul-class FLOPs, FlopCounterMode's convention (torch/utils/
        flop_counter.py); ``kind="all"``: plus the per-element counts of :mod:`symcost.rules`.
        """
        if kind not in ("model", "all"):
            raise SymcostError(f"unknown FLOP kind {kind!r}; accepted: model, all")
        return self._sum("flops" if kind == "model" else "flops_all", phase)

    @functools.cache
    def transcendentals(self, phase: str = "train") -> sympy.Expr:
        """Transcendental function evaluations (exp, log, erf, tanh, sin, sqrt, all together)
        of ``phase``, a polynomial: XLA's ``transcendentals`` count (:func:`symcost.rules.transcendentals`)."""
        return self._sum("transcendental_total", phase)

    @functools.cache
    def bytes(self, phase: str = "train") -> sympy.Expr:
        """Bytes read + written by all ops of ``phase`` (unfused lower bound), a polynomial."""
        return self._sum("bytes", phase)

    def _param_total(self, names) -> sympy.Expr:
        return sympy.expand(sympy.Add(*[
            rep * sympy.Mul(*shape) for n, (shape, _, rep) in self.param_shapes.items() if n in names
        ]))

    @functools.cached_property
    def params(self) -> sympy.Expr:
        """Parameter count (tied parameters once), a polynomial in the symbols."""
        return self._param_total(set(self.param_shapes))

    @functools.cached_property
    def params_matmul(self) -> sympy.Expr:
        """P of 6·N·P: parameters used as a matmul operand in the forward (tied weights once)."""
        return self._param_total(self.matmul_params)

    @functools.cached_property
    def params_active(self) -> sympy.Expr:
        """Parameters one token uses (:func:`symcost.moe.params_active`): ``params`` with each
        stack of E routed experts counted R/E; equal to ``params`` for a dense model."""
        from .moe import params_active

        return params_active(self)

    @functools.cached_property
    def params_active_matmul(self) -> sympy.Expr:
        """P_active of 6·N·P_active: ``params_matmul`` with routed expert stacks counted R/E
        (:func:`symcost.moe.params_active_matmul`); equal to ``params_matmul`` for a dense model."""
        from .moe import params_active_matmul

        return params_active_matmul(self)

    @functools.cached_property
    def attention_flops(self) -> sympy.Expr:
        """Model FLOPs (train) of matmul-class ops with no parameter operand (attention)."""
        return sympy.expand(sympy.Add(*[
            op.repeat * op.cost.flops for op in self.ops if op.attention
        ]))

    # -- quantities papers use (issue 6, item 9) ------------------------------------------------
    #: how attention matmuls are counted: "full" (S_q·S_k score pairs, FlopCounterMode) or
    #: "causal" (S·(S+1)/2 pairs); see :meth:`with_attention_flops`
    attention_count = "full"

    def _param_sources(self, node) -> set[str]:
        """Folded names of the parameters feeding op ``node`` directly or through views/casts."""
        g = self.graph
        out, stack, seen = set(), list(g.predecessors(node)), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            d = g.nodes[n]
            if d.get("kind") == "param":
                out.add(str(n).partition(":")[2])
            elif opsets.same_tensor(d):
                stack.extend(g.predecessors(n))
        return out

    @functools.cached_property
    def embedding_params(self) -> dict[str, str]:
        """Parameters Kaplan et al. (2020, "Scaling Laws for Neural Language Models", section 2.1)
        leave out of N, by folded name -> why, derived from the traced forward graph:

        - ``"lookup"``: read by an embedding lookup (``embedding``, ``index_select``, ``index``,
          ``gather``, through views and dtype casts): token, position and token-type tables;
        - ``"position slice"``: a table of fixed size sliced to the sequence length (``slice`` or
          ``narrow`` whose output has S where the parameter has none: ``x + pos[:S]``);
        - ``"output projection"``: an operand (weight or bias) of a forward matmul-class op whose
          output has the vocabulary V in its last dimension — the final projection to the
          vocabulary (the "de-embedding"); when it is tied to the token table it is that table,
          counted once.

        Models without V (``mlp``) have no output projection; models without a lookup have none.
        """
        g = self.graph
        out: dict[str, str] = {}
        lookups = ("aten.embedding", "aten.index_select", "aten.index", "aten.gather", "aten._embedding_bag")
        V = SYMS["V"]
        for n, d in g.nodes(data=True):
            if d.get("kind") != "op" or d.get("phase") != "forward":
                continue
            packet = d["op"].rsplit(".", 1)[0]
            if packet in lookups:
                for name in self._param_sources(n):
                    out.setdefault(name, "lookup")
            elif packet in ("aten.slice", "aten.narrow") and d["out_shapes"]:
                cut = {str(x) for e in d["out_shapes"][0] if isinstance(e, sympy.Basic) for x in e.free_symbols}
                for name in self._param_sources(n):
                    own = {str(x) for e in self.param_shapes[name][0] if isinstance(e, sympy.Basic)
                           for x in e.free_symbols}
                    if "S" in cut and "S" not in own:
                        out.setdefault(name, "position slice")
            elif d.get("family") == "model" and d["out_shapes"] and d["out_shapes"][0]:
                last = d["out_shapes"][0][-1]
                if isinstance(last, sympy.Basic) and V in last.free_symbols:
                    for name in self._param_sources(n):
                        out.setdefault(name, "output projection")
        return {k: out[k] for k in self.param_shapes if k in out}

    @functools.cached_property
    def params_embedding(self) -> sympy.Expr:
        """Embedding parameters (see :attr:`embedding_params`), tied ones once, a polynomial."""
        return self._param_total(set(self.embedding_params))

    @functools.cached_property
    def params_nonembedding(self) -> sympy.Expr:
        """Kaplan et al.'s N: every parameter (tied once) but the embedding ones — the blocks'
        weights, biases and norms and the final norm (Kaplan's 12·n_layer·d_model² leaves biases
        and norms out as small; this count keeps them, exactly)."""
        return sympy.expand(self.params - self.params_embedding)

    def causal_attention_cost(self, op: "SymOp") -> rules.Cost | None:
        """The causal count of one attention matmul, or None when it does not apply.

        An attention op (``op.attention``, or a fused attention kernel) whose model FLOPs are
        ``a·S²`` — S queries against S keys, S_q·S_k = S² score pairs — costs ``a·S·(S+1)/2``
        under a causal mask: query i meets keys 0..i, S·(S+1)/2 pairs in all, for every product
        over the score matrix (Q·Kᵀ, P·V and their gradients; the recomputed scores of a fused
        backward). The formula is derived from the op's own formula, never typed per model.
        All-FLOPs drop by the same amount; bytes stay (the unfused lower bound moves the full
        score matrix). Ops whose FLOPs are not of that form (S pinned, cross-attention with other
        key lengths) keep their count.
        """
        fused = op.family == "model" and "attention" in op.name
        if not (op.attention or fused) or "S" in self.pinned:
            return None
        S = SYMS["S"]
        f = sympy.expand(op.cost.flops)
        if not isinstance(f, sympy.Basic) or S not in f.free_symbols:
            return None
        poly = sympy.Poly(f, S)
        if poly.monoms() != [(2,)]:
            return None
        causal = sympy.expand(poly.coeffs()[0] * S * (S + 1) / 2)
        return rules.Cost(causal, sympy.expand(op.cost.flops_all - f + causal), op.cost.bytes,
                          op.cost.transcendentals)

    def with_attention_flops(self, count: str = "full") -> "Analysis":
        """This analysis with the attention matmuls counted ``"full"`` (S_q·S_k score pairs, as
        FlopCounterMode; the default) or ``"causal"`` (S·(S+1)/2 pairs, see
        :meth:`causal_attention_cost`). Only those ops change; ``attention_count`` says which.

        Raises:
            SymcostError: ``count`` is neither "full" nor "causal".
        """
        import dataclasses

        if count not in ("full", "causal"):
            raise SymcostError(f"unknown attention FLOP count {count!r}; accepted: full, causal")
        if count == self.attention_count:
            return self
        base = getattr(self, "_full", self)
        if count == "full":
            return base
        ops, graph = [], base.graph.copy()
        for op in base.ops:
            c = base.causal_attention_cost(op)
            if c is not None:
                op = dataclasses.replace(op, cost=c)
                if op.index in graph:
                    graph.nodes[op.index].update(flops=c.flops, flops_all=c.flops_all, intensity=(
                        sympy.cancel(c.flops_all / c.bytes) if c.bytes != 0 else 0))
            ops.append(op)
        new = dataclasses.replace(base, ops=ops, graph=graph)
        new.pinned = dict(base.pinned)
        new.timings = dict(base.timings)
        new.attention_count = count
        new._full = base
        if base.__dict__.get("_fusion_data") is not None:  # fused bytes do not change with the count
            new.__dict__["_fusion_data"] = base.__dict__["_fusion_data"]
        return new

    def train_simplified_str(self) -> str:
        """``"6*B*S*(P) + remainder"`` as text, 6·N·P first (sympy would reorder the terms).

        Parses with :func:`symcost.parse_formula` (or ``sympy.sympify`` with those locals) to
        ``flops("train")``.
        """
        P, rem, _ = self.train_simplified()
        n = "*".join(str(x) for x in ("B", "S") if x not in self.pinned)
        head = f"6*{n}*({P})" if n else f"6*({P})"
        if rem == 0:
            return head
        text = str(rem)
        return f"{head} - {text[1:]}" if text.startswith("-") and "+" not in text and " - " not in text \
            else f"{head} + {text}"

    def train_simplified(self) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
        """``(P, remainder, unevaluated 6*B*S*P + remainder)`` with remainder exact.

        P is ``params_active_matmul``: for a mixture of experts the parameters one token uses
        (R of E experts), else ``params_matmul``."""
        P = self.params_active_matmul
        B, S = (sympy.Integer(self.pinned[n]) if n in self.pinned else SYMS[n] for n in ("B", "S"))
        rem = sympy.expand(self.flops("train") - 6 * B * S * P)
        factors = [f for f in (sympy.Integer(6), B, S, sympy.factor_terms(P)) if f != 1]
        form = sympy.Add(sympy.Mul(*factors, evaluate=False),
                         sympy.factor_terms(rem), evaluate=False)
        return P, rem, form

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
                raise SymcostError(f"unknown symbol {k!r} for {self.model}; accepted: {known}")
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SymcostError(f"{k} must be a positive integer, got {v!r}")
            if k in self.residues and v % self.residues[k][0] != self.residues[k][1]:
                m, r = self.residues[k]
                raise SymcostError(
                    f"{k}={v} lies outside the regime {k} = {r} mod {m} this trace holds for (its sizes are "
                    f"polynomial in {k} only there); trace again for {k}={v} (--set {k}={v})")
            values[k] = v
        for a, b in self.spec.follows.items():  # K = H where the config leaves K unset
            if a not in sizes and a in values and b in values:
                values[a] = values[b]
        values.update(self.pinned)
        missing = [s for s in self.symbols if s not in values]
        if missing:
            raise SymcostError(f"no value for {', '.join(missing)}; set it with --set")
        msg = self.spec.check(values)
        if msg:
            raise SymcostError(msg)
        return {SYMS[k]: v for k, v in values.items()}

    def subs(self, **sizes: int) -> dict[str, int]:
        """Every total as an integer at the given sizes (others at the model's defaults)."""
        env = self.bind(**sizes)
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731  (xreplace: no re-simplifying)
        out = {"params": ev(self.params), "params_matmul": ev(self.params_matmul)}
        out["params_active"] = ev(self.params_active)
        for ph in PHASES + ("train",):
            out[f"flops.{ph}"] = ev(self.flops(ph))
            out[f"flops_all.{ph}"] = ev(self.flops(ph, "all"))
            out[f"bytes.{ph}"] = ev(self.bytes(ph))
            out[f"transcendentals.{ph}"] = ev(self.transcendentals(ph))
        return out

    def quantity(self, name: str) -> sympy.Expr:
        """A total by its JSON name: ``params``, ``params_matmul``, ``flops.<phase>``,
        ``flops_all.<phase>``, ``bytes.<phase>``, ``attention_flops``."""
        if name in ("params", "params_matmul", "attention_flops", "params_active", "params_active_matmul"):
            return getattr(self, name)
        kind, _, phase = name.partition(".")
        if kind == "flops":
            return self.flops(phase)
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


def _totals_terms(symbols, totals: Mapping[str, str]) -> dict:
    """The totals that are polynomials in the symbols as ``memory.Terms`` (read back about ten
    times faster than parsing their text); others (a ratio such as H/K) are left to the text."""
    from .memory import Algebra

    alg = Algebra(tuple(symbols))
    out = {}
    for k, text in totals.items():
        try:
            out[k] = alg.terms(alg.from_expr(parse_formula(text)))
        except Exception:  # noqa: BLE001 - not a polynomial in the symbols: kept as text only
            continue
    return out


def _load_totals(symbols, totals: Mapping[str, str], terms: Mapping[str, list], parse) -> dict:
    """Totals from :meth:`Analysis.to_dict`: from their terms where kept, else parsed."""
    from .memory import Algebra

    alg = Algebra(tuple(symbols))
    out = {}
    for k, text in totals.items():
        out[k] = alg.expr(alg.from_terms(terms[k])) if k in terms else parse(text)
    return out


def _data(v):
    """A graph attribute as JSON data: sympy values and dtypes as strings, lists kept."""
    if isinstance(v, (list, tuple)):
        return [_data(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v).removeprefix("torch.")


def _jsonable(x):
    import json

    return json.loads(json.dumps(x, default=str))


#: Totals that are functools.cached_property of Analysis, kept by to_dict as formulas.
_CACHED_TOTALS = ("params", "params_matmul", "attention_flops", "params_embedding", "params_nonembedding")

#: Analysis attributes that say which regime it was traced in (plain data), kept by to_dict.
_REGIME_FIELDS = ("request_facts", "regime_ties", "pin_reasons", "residues", "signature")

_GRAPH_FORMULAS = {"repeat", "flops", "flops_all", "bytes", "intensity"}
_GRAPH_SHAPES = {"in_shapes", "out_shapes", "shape"}


class _Dtypes(list):
    """A list of dtype names (``"float32"``) that reads as torch dtypes: torch is imported on the
    first read, so a cached analysis' ops load without it."""

    @staticmethod
    def _dtype(x):
        return getattr(torch, x) if isinstance(x, str) else x

    def __iter__(self):
        return (self._dtype(x) for x in list.__iter__(self))

    def __getitem__(self, i):
        v = list.__getitem__(self, i)
        return [self._dtype(x) for x in v] if isinstance(i, slice) else self._dtype(v)


def _load_ops(rows) -> list:
    """SymOps from :meth:`Analysis.to_dict` rows (dtypes read as torch dtypes, see _Dtypes)."""
    import sys

    P = functools.lru_cache(maxsize=None)(parse_formula)
    Cost = rules.Cost if "symcost.rules" in sys.modules else _Cost
    return [SymOp(index=i, name=name, family=fam, module=mod, phase=ph, repeat=P(rep),
                  in_shapes=[tuple(P(x) for x in sh) for sh in ins], in_dtypes=_Dtypes(ind),
                  out_shapes=[tuple(P(x) for x in sh) for sh in outs], out_dtypes=_Dtypes(outd),
                  cost=Cost(*(P(c) for c in cost[:3]),
                            {k: P(n) for k, n in (cost[3] if len(cost) > 3 else {}).items()}),
                  layer=layer, attention=attn)
            for i, name, fam, mod, ph, rep, ins, ind, outs, outd, cost, layer, attn in rows]


def _load_graph(data):
    """The networkx graph from :meth:`Analysis.to_dict` data, formulas parsed."""
    P = functools.lru_cache(maxsize=None)(parse_formula)

    def attrs(d):
        out = {}
        for k, v in d.items():
            if k in _GRAPH_FORMULAS and isinstance(v, str):
                v = P(v)
            elif k in _GRAPH_SHAPES and isinstance(v, list):
                v = [tuple(P(x) for x in sh) for sh in v] if k != "shape" else tuple(P(x) for x in v)
            out[k] = v
        return out

    g = nx.DiGraph()
    for n, d in data["nodes"]:
        g.add_node(n, **attrs(d))
    for u, v, d in data["edges"]:
        g.add_edge(u, v, **attrs(d))
    return g


@dataclass
class _Cost:
    """``rules.Cost``'s fields, for ops read back without importing torch."""

    flops: Any = 0
    flops_all: Any = 0
    bytes: Any = 0
    transcendentals: dict = dataclasses.field(default_factory=dict)

    @property
    def transcendental_total(self):
        return sum(self.transcendentals.values())



def _layer_roles(spec: ModelSpec, ref: Recording, container: str | None, precision: str):
    """How each layer of the L=2 fit recordings folds: ``role(module, name=None)``.

    Returns a function giving ``(keep, repeat, folded_name)`` for a module path (and an optional
    parameter name). When both blocks run the same ops, block 0 stands for all L. When they
    differ (the first block needs no input gradient, say), one more recording at L = 3 tells
    which end block is special: it is kept with repeat 1 and the other stands for the L - 1
    generic blocks.

    Raises:
        SymcostError: both end blocks differ from the middle one.
    """
    L = SYMS["L"]
    one = sympy.Integer(1)

    def seqs(rec):
        out: dict[int, list[str]] = {}
        for op in rec.ops:
            layer = _layer_of(op.module, container)
            if layer is not None:
                out.setdefault(layer, []).append(op.name)
        return out

    generic, special, repeat = 0, None, L
    if container is not None:
        s2 = seqs(ref)
        if len(s2) >= 2 and s2[0] != s2[1]:
            s3 = seqs(record(spec, dict(ref.values, L=FIT_L + 1), precision))
            if s3[1] == s3[2] and s3[0] != s3[1]:
                generic, special = 1, 0
            elif s3[0] == s3[1] and s3[2] != s3[1]:
                generic, special = 0, 1
            else:
                differ = sorted(i for i in s3 if s3[i] != s3[0])
                raise Unvariable("L", (
                    f"the blocks of {container} run different ops (block{'s' if len(differ) > 1 else ''} "
                    f"{', '.join(map(str, differ))} of 3 differ{'s' if len(differ) == 1 else ''} from block 0), "
                    "so L is not folded"))
            repeat = L - 1

    def role(module: str, name: str | None = None):
        layer = _layer_of(module, container)
        full = module if name is None else name
        if layer is None:
            return True, one, full
        if layer == generic:
            return True, repeat, _fold_name(full, container)
        if layer == special:
            if special == 0:
                return True, one, full
            return True, one, _rename_block(full, container, "{L-1}")
        return False, one, full

    return role


def _align(recs: list[Recording], spec: ModelSpec) -> None:
    ref = recs[0]
    for r in recs[1:]:
        if len(r.ops) != len(ref.ops) or any(a.name != b.name for a, b in zip(r.ops, ref.ops)):
            i = next((i for i, (a, b) in enumerate(zip(r.ops, ref.ops)) if a.name != b.name),
                     min(len(r.ops), len(ref.ops)))
            a = ref.ops[i].name if i < len(ref.ops) else "<end>"
            b = r.ops[i].name if i < len(r.ops) else "<end>"
            raise SymcostError(
                f"{spec.name}: the ops it runs change with the sizes ({a} at {ref.values} but {b} "
                f"at {r.values}, op #{i}); size-dependent control flow cannot get one formula"
            )
        if len(r.saved) != len(ref.saved) or set(r.params) != set(ref.params):
            raise SymcostError(f"{spec.name}: saved tensors or parameters change with the sizes")


def _digest(sig: tuple) -> str:
    import hashlib

    return hashlib.sha256(repr(sig).encode()).hexdigest()


def regime_signature(rec: Recording) -> tuple:
    """What a regime is made of: the aten op sequence, the number of storages autograd saves,
    and the number of storages the step allocates (copies that became views change it)."""
    return (tuple(op.name for op in rec.ops), len(rec.saved), sum(1 for e in rec.events if e.nbytes > 0))


def trace(model: str | ModelSpec = "cs336-lm", config: Mapping[str, str] | None = None,
          attention: str | None = None, sizes: Mapping[str, int] | None = None,
          precision: str = "bf16-mixed", n_random: int = 6, seed: int = 0) -> Analysis:
    """Trace a model's training step into a symbolic cost graph, in the regime of ``sizes``.

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
        precision: a name of :data:`symcost.precision.PRECISIONS`: ``bf16-mixed`` (autocast
            over fp32 weights; the default), ``fp16-mixed``, ``fp32``, ``bf16-true``,
            ``fp16-true`` (model cast), ``bf16-true-fp32-state``, ``bf16-true-fp32-master``;
            decides dtypes, hence bytes and activations.
        n_random: random probes in the fit (besides base and one per symbol).
        seed: probe sampling seed.

    Returns:
        An :class:`Analysis` (``pinned``, ``pin_reasons``, ``regime_ties``, ``request_facts``,
        ``residues`` say which regime) whose totals were checked against fresh recordings at
        sizes not used in the fit.

    Raises:
        SymcostError: bad model/config, sizes PyTorch rejects (the spec's constraints), an
            untraceable model.
    """
    spec = model if isinstance(model, ModelSpec) else resolve(model, config, attention)
    sizes = dict(sizes or {})
    values = spec.values(sizes, inputs=False)
    why = spec.check({k: v for k, v in values.items() if k in spec.symbols or k in INPUT_SYMBOLS})
    if why:
        raise SymcostError(f"{spec.name}: {why}")
    facts = request_facts(values, spec.all_symbols)
    pins = {s: 1 for s in facts["ones"]}
    reasons = {s: "size 1 runs other kernels (copies become views)" for s in pins}
    recordings: dict = {}
    for _ in range(len(SYMS) + 1):
        try:
            return _trace_regime(spec, values, facts, pins, reasons, precision, n_random, seed, recordings)
        except Unvariable as e:
            if e.symbol in pins or e.symbol not in values:
                raise
            pins[e.symbol] = values[e.symbol]
            reasons[e.symbol] = ("no other value of it runs the same ops as the requested one"
                                 if e.symbol != "L" else str(e))
        except FitError as e:
            deps = [d for d in e.deps if d not in pins and d in values]
            new = [d for d in deps if d not in INPUT_SYMBOLS] or deps
            if not new:
                raise
            for d in new:
                pins[d] = values[d]
                reasons[d] = "no polynomial in it fits the sizes of its regime"
    raise SymcostError(f"{spec.name}: could not find a regime to trace {values} in")


def _trace_regime(spec: ModelSpec, values: Mapping[str, int], facts: dict, pins: Mapping[str, int],
                  reasons: Mapping[str, str], precision: str, n_random: int, seed: int,
                  recordings: dict) -> Analysis:
    """One attempt of :func:`trace` with ``pins`` fixed; raises Unvariable / FitError to pin more."""
    import dataclasses
    import time

    t0 = time.perf_counter()
    pinned = dict(pins)
    base_syms = tuple(s for s in spec.all_symbols if s not in pinned)
    fixed = dict(pinned, **({"L": FIT_L} if "L" in base_syms else {}))
    request = {**{k: v for k, v in values.items() if k in spec.all_symbols or k in spec.tied},
               **{s: v for s, v in fixed.items()}}
    for s in INPUT_SYMBOLS:  # B, S not requested: the regime of any size other than 1
        request.setdefault(s, {"B": 2, "S": 16}[s])

    def rec_at(p):
        key = tuple(sorted(p.items()))
        if key not in recordings:
            try:
                recordings[key] = record(spec, p, precision)
            except SymcostError as e:
                recordings[key] = e
        return recordings[key]

    req = rec_at(request)
    if isinstance(req, SymcostError):  # PyTorch itself rejects the requested sizes
        raise SymcostError(f"{req} (at the requested sizes, before any probe)") from req
    want_sig = regime_signature(req)

    def accept(p):
        r = rec_at(p)
        return not isinstance(r, SymcostError) and regime_signature(r) == want_sig

    moduli = {s: m for s, m in spec.moduli.items() if s in base_syms}
    # equal pairs: tied while a probe that breaks the equality runs other ops
    ties: dict[str, str] = {}
    for a, b in facts["equal"]:
        if a in base_syms and b in base_syms and b not in ties and a not in ties and b not in ties.values():
            ties[b] = a
    syms = tuple(s for s in base_syms if s not in ties)
    base = find_base(syms, spec.probe_ok, seed, fixed, accept=accept, request=request, ties=ties, moduli=moduli)
    for follower, leader in list(ties.items()):
        for v in probe_pool(follower, request.get(follower), moduli.get(follower))[:8]:
            p = dict(base, **{follower: v})
            if v != base[leader] and spec.probe_ok(p) is None:
                if accept(p):
                    del ties[follower]
                    base = p  # the untied pair keeps distinct values in the base probe
                break
    syms = tuple(s for s in base_syms if s not in ties)
    plan = plan_probes(syms, spec.probe_ok, n_random=n_random, seed=seed, fixed=fixed, accept=accept,
                       request=request, ties=ties, moduli=moduli, base=base)
    symbols = syms
    spec = dataclasses.replace(spec, tied={**spec.tied, **ties})
    recs = [rec_at(p) for p in plan.points]
    t1 = time.perf_counter()
    _align(recs, spec)
    fitter = Fitter(plan)
    ref = recs[0]
    container = ref.layer_container

    def fit_shape(getter, what):
        shapes0 = getter(ref)
        return [
            tuple(fitter(tuple(getter(r)[k][d] for r in recs), what) for d in range(len(s)))
            for k, s in enumerate(shapes0)
        ]

    # with L pinned (blocks that differ), every block is traced on its own: nothing is folded
    role = _layer_roles(spec, ref, None if "L" in pinned else container, precision)

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
        ints = [fitter(tuple(r.ops[i].ints[k] for r in recs), f"size argument of {op.name}")
                for k in range(len(op.ints))]
        family = rules.classify(op.op)
        key = (op.name, tuple(in_shapes), tuple(out_shapes), tuple(ints),
               tuple(t.dtype for t in op.inputs + op.outputs))
        c = cost_cache.get(key)
        if c is None:
            try:
                c = rules.cost(_op_view(op, in_shapes, out_shapes, ints), family)
                c = rules.Cost(*(rules.expand_flops(x) for x in (c.flops, c.flops_all, c.bytes)),
                               c.transcendentals)
            except (AssertionError, TypeError, ValueError):
                # A registry formula that cannot take symbols (e.g. asserts H % K == 0): fit
                # its concrete values at the probes instead.
                cs = [concrete_cost(r.ops[i]) for r in recs]
                c = rules.Cost(*(fitter(tuple(int(getattr(x, a)) for x in cs), f"cost of {op.name}")
                                 for a in ("flops", "flops_all", "bytes")),
                               {k: fitter(tuple(int(x.transcendentals.get(k, 0)) for x in cs), f"cost of {op.name}")
                                for k in sorted({k for x in cs for k in x.transcendentals})})
            cost_cache[key] = c
        if family == "unsupported":
            unsupported[op.name] = unsupported.get(op.name, 0) + repeat
        ops.append(SymOp(
            index=i, name=op.name, family=family, module=module,
            phase=op.phase, repeat=repeat, in_shapes=in_shapes,
            in_dtypes=[t.dtype for t in op.inputs], out_shapes=out_shapes,
            out_dtypes=[t.dtype for t in op.outputs], cost=c, layer=layer,
            attention=family == "model" and op.phase == "forward" and i not in ops_with_param,
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
    for k, s in enumerate(ref.saved):
        keep, repeat, module = role(s.module)
        layers = {_layer_of(m, container) for m in s.also | {s.module}}
        if len(layers) > 1:  # one storage saved by several blocks (e.g. rotary cos/sin): once
            keep, repeat, module = True, sympy.Integer(1), "(shared by blocks)"
        if not keep:
            continue
        nb = fitter(tuple(r.saved[k].nbytes for r in recs), f"saved tensor of {s.module or 'the root'}")
        saved.append((module, nb, s.dtype, repeat))

    t2 = time.perf_counter()
    graph = _build_graph(ref, ops, role)
    syms = {s: SYMBOL_MEANINGS[s] for s in symbols}
    if "D" in syms and "H" not in syms and "H" not in spec.tied and "H" not in pinned:
        syms["D"] = "model width (the model has no attention heads)"
    an = Analysis(
        model=spec.name, spec=spec, graph=graph, ops=ops, symbols=syms, param_shapes=param_shapes,
        matmul_params=matmul_params, unsupported=unsupported, saved=saved, layer_container=container,
        precision=precision, tied={folded_name.get(k, k): v for k, v in ref.tied.items()},
        recordings=recs, plan=plan, fitter=fitter, role=role,
        schedule=fit_schedule(recs, fitter, role, container, symbols, spec.name),
    )
    an.pinned = pinned
    an.pin_reasons = {k: reasons[k] for k in pinned}
    an.regime_ties = dict(ties)
    an.request_facts = facts
    an.residues = {s: [m, values[s] % m] for s, m in moduli.items() if s in symbols and s in values}
    an.signature = _digest(want_sig)
    pools = random_pools([s for s in symbols if s not in fixed], plan.points[0], request, moduli)
    # sizes that are no probe (an MoE's fractional N·R/E slots per expert) are answered by the
    # formulas, not recorded exactly: they are checked at the probes only
    _validate(an, spec, symbols, seed, pinned, pools=pools, ties=ties, accept=accept,
              request=(request, req) if spec.probe_ok(request) is None else None)
    an.timings = {"record": t1 - t0, "fit": t2 - t1, "check": time.perf_counter() - t2}
    return an


def concrete_totals(rec: Recording) -> dict[str, int]:
    """Totals of one concrete recording by the same rules: the oracle for the symbolic fit."""
    out = {f"{k}.{p}": 0 for k in ("flops", "flops_all", "bytes", "transcendentals") for p in PHASES}
    for op in rec.ops:
        c = concrete_cost(op)
        out[f"flops.{op.phase}"] += int(c.flops)
        out[f"flops_all.{op.phase}"] += int(c.flops_all)
        out[f"bytes.{op.phase}"] += int(c.bytes)
        out[f"transcendentals.{op.phase}"] += int(c.transcendental_total)
    out["params"] = sum(rules.numel(s) for s, _ in rec.params.values())
    out["saved"] = sum(s.nbytes for s in rec.saved)
    return out


def _validate(an: Analysis, spec: ModelSpec, symbols, seed: int, pinned: Mapping[str, int],
              pools=None, ties=None, accept=None, request=None) -> None:
    """Check the formulas against fresh recordings: two random probes (L = 3) of the regime and,
    given ``request = (values, recording)``, the requested sizes themselves.

    Raises:
        FitError: a formula disagrees with a recording in the regime (the caller pins symbols).
    """
    import random

    rng = random.Random(seed + 1000)
    fixed = dict(pinned, **({"L": CHECK_L} if "L" in symbols else {}))
    config_syms = [s for s in symbols if s not in INPUT_SYMBOLS and s != "L"]

    def compare(p, rec):
        want = concrete_totals(rec)
        env = {SYMS[k]: v for k, v in p.items() if k in symbols}
        got = {f"{k}.{ph}": None for k in ("flops", "flops_all", "bytes") for ph in PHASES}
        for ph in PHASES:
            got[f"flops.{ph}"] = an.flops(ph).subs(env)
            got[f"flops_all.{ph}"] = an.flops(ph, "all").subs(env)
            got[f"bytes.{ph}"] = an.bytes(ph).subs(env)
            got[f"transcendentals.{ph}"] = an.transcendentals(ph).subs(env)
        got["params"] = an.params.subs(env)
        got["saved"] = sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]).subs(env)
        bad = {k: (int(got[k]), want[k]) for k in want if int(got[k]) != want[k]}
        if bad:
            k, (g, w) = next(iter(bad.items()))
            return (f"{spec.name}: the recovered formula for {k} gives {g} but a fresh trace at {p} "
                    f"measures {w}; the model's costs are not polynomial in {', '.join(symbols)}")
        return None

    if request is not None:
        msg = compare(*request)
        if msg:
            raise FitError(msg + " at the requested sizes", config_syms or symbols)
    checked = 0
    for _ in range(6):
        p = random_point(symbols, spec.probe_ok, rng, fixed, pools, ties)
        try:
            rec = record(spec, p, an.precision)
        except SymcostError:
            continue
        msg = compare(p, rec)
        if msg and accept is not None and "L" in p and not accept(dict(p, L=FIT_L)):
            continue  # the random point left the regime: draw another
        if msg:
            raise FitError(msg, config_syms or symbols)
        checked += 1
        if checked == 2:
            return
    if checked == 0:
        raise SymcostError(f"{spec.name}: no fresh probe of this regime could be recorded to check the formulas")


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
            flops=sop.cost.flops, flops_all=sop.cost.flops_all, bytes=sop.cost.bytes,
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

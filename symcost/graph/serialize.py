"""The op graph as plain data (JSON, no pickle): what the trace cache keeps and reads back without
importing torch. :class:`Serialized` is mixed into :class:`~symcost.graph.analysis.Analysis`
(``to_dict`` / ``from_dict``); ``ops`` and ``graph`` of an analysis read back are parsed on first
use.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

from typing import TYPE_CHECKING

from symcost._lazy import LazyModule
from symcost.errors import SymcostError
from symcost.frontends.spec import Constraint, ModelSpec
from symcost.tracing.fit import SYMS, ProbePlan, parse_formula
from symcost.tracing.poly import Algebra
from symcost.tracing.schedule import MemorySchedule
from symcost.graph.ops import PHASES, SymOp

nx = LazyModule("networkx")
torch = LazyModule("torch")
rules = LazyModule("symcost.graph.rules")

if TYPE_CHECKING:  # pragma: no cover
    from symcost.graph.analysis import Analysis


class Serialized:
    """``to_dict`` / ``from_dict`` of an :class:`~symcost.graph.analysis.Analysis`."""

    # -- as data (the trace cache) -------------------------------------------------------------
    #: Bumped whenever the layout of :meth:`to_dict` changes (older cache entries are rebuilt).
    #: 2: hardware FLOPs (``flops_hw``) per op (a fifth cost entry) and in the totals.
    #: 3: data-parallel traces: each op's collective (a 16th entry) and ``parallel`` (the strategy
    #: and each parameter's shard on one rank).
    FORMAT = 3

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
        kinds = {"flops": "model", "flops_hw": "hardware", "flops_all": "all"}
        totals = {f"{k}.{ph}": s(self.flops(ph, kinds[k]) if k != "bytes" else self.bytes(ph))
                  for k in ("flops", "flops_hw", "flops_all", "bytes") for ph in PHASES + ("train",)}
        totals.update({f"transcendental_total.{ph}": s(self.transcendentals(ph)) for ph in PHASES + ("train",)})
        totals.update({k: s(getattr(self, k)) for k in _CACHED_TOTALS if hasattr(type(self), k)})
        dt = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        ops = [[op.index, op.name, op.family, op.module, op.phase, s(op.repeat),
                [[s(x) for x in sh] for sh in op.in_shapes], [dt(d) for d in op.in_dtypes],
                [[s(x) for x in sh] for sh in op.out_shapes], [dt(d) for d in op.out_dtypes],
                [s(op.cost.flops), s(op.cost.flops_all), s(op.cost.bytes),
                 {k: s(n) for k, n in op.cost.transcendentals.items()}, s(op.cost.flops_hw)],
                op.layer, op.attention, list(getattr(op, "kv_reads", ())), list(getattr(op, "kv_writes", ())),
                None if getattr(op, "comm", None) is None else [op.comm[0]] + [s(x) for x in op.comm[1:3]]
                + list(op.comm[3:4])] + ([list(op.attn_flags)] if getattr(op, "attn_flags", None) is not None else [])
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
                     **({"pads": dict(spec.pads)} if getattr(spec, "pads", None) else {}),
                     "follows": dict(getattr(spec, "follows", {})),
                     "lead_blocks": int(getattr(spec, "lead_blocks", 0) or 0),
                     "constraints": [[c.kind, c.a, c.b, c.why] for c in spec.constraints],
                     "step": getattr(spec, "step", "train"), "kv_cache": getattr(spec, "kv_cache", "dynamic"),
                     "extra": _jsonable(spec.extra)},
            "param_shapes": {n: [[s(x) for x in sh], dt(d), s(rep)] for n, (sh, d, rep) in self.param_shapes.items()},
            "matmul_params": sorted(self.matmul_params),
            **({"frozen": sorted(self.frozen)} if getattr(self, "frozen", None) else {}),
            "unsupported": {k: s(v) for k, v in self.unsupported.items()},
            "saved": [[m, s(nb), dt(d), s(rep)] for m, nb, d, rep in self.saved],
            "layer_container": self.layer_container, "timings": dict(self.timings),
            **({"stacks": dict(self.stacks), "stack_blocks": dict(getattr(self, "stack_blocks", {}) or {})}
               if getattr(self, "stacks", None) else {}),
            "tied": {k: list(v) for k, v in self.tied.items()}, "pinned": dict(self.pinned),
            "plan": None if plan is None else {"symbols": list(plan.symbols), "points": plan.points,
                                               "axis": plan.axis},
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "totals": totals, "totals_terms": _totals_terms(self.symbols, totals),
            "ops": ops, "graph": graph, "params_not_in_P": self.params_not_in_P(),
            "embedding_params": dict(self.embedding_params) if hasattr(type(self), "embedding_params") else None,
            "fusion": self._fusion_data(), "dataflow": self.dataflow(),
            "module_classes": self._module_classes(),
            # the regime's data (plain dicts), where the tracer records it
            "regime": {k: _jsonable(getattr(self, k)) for k in _REGIME_FIELDS
                       if hasattr(self, k) and (k != "bounds" or self.bounds)},  # (bounds: padded sizes only)
            # a data-parallel trace (symcost.frontends.parallel): the strategy and the rank's shards
            "parallel": None if getattr(self, "parallel", None) is None else {
                "shard": self.parallel, "tensor_parallel": getattr(self, "tensor_parallel", None),
                "param_shards": {n: [[s(x) for x in sh], dt(d), s(rep)]
                                 for n, (sh, d, rep) in (self.param_shards or {}).items()}},
            "inference": {"step": getattr(self, "step", "train"), "kv_cache": getattr(self, "kv_cache", None),
                          "kv_layers": [[n, s(nb), s(rep)] for n, nb, rep in getattr(self, "kv_layers", [])]},
        }

    def _module_classes(self) -> dict | None:
        """Module path -> class name (:func:`symcost.tracing.modules.module_classes`), kept for the report
        of a cached analysis; None when unavailable."""
        if "_stored_module_classes" in self.__dict__:
            return self.__dict__["_stored_module_classes"]
        from symcost.tracing.modules import module_classes

        return module_classes(self) or None

    def dataflow(self) -> dict | None:
        """Which tensor each op of the reference probe reads, as data: ``{"inputs": [[[op, k],
        ...] per op], "outputs": [n per op], "n_forward", "n_backward"}`` (``[op, k]``: output k
        of op; inputs no op made, such as parameters and the model's inputs, left out). Taken
        from the recording (kept with a cached analysis, which has none); None without either.
        Used where a pass needs the data flow, e.g. the op-level checkpoint plan."""
        if "_dataflow" in self.__dict__:
            return self.__dict__["_dataflow"]
        if not self.recordings:
            return None
        rec = self.recordings[0]
        made: dict = {}
        ins, outs = [], []
        for i, op in enumerate(rec.ops):
            ins.append([list(made[t.tid]) for t in op.inputs if t.tid in made])
            for k, t in enumerate(op.outputs):
                made[t.tid] = (i, k)
            outs.append(len(op.outputs))
        flow = {"inputs": ins, "outputs": outs, "n_forward": rec.n_forward, "n_backward": rec.n_backward}
        self.__dict__["_dataflow"] = flow
        return flow

    def _fusion_data(self) -> dict | None:
        """The fused-bytes estimate (:func:`symcost.graph.fusion.estimate`, which needs the probe
        recordings) as data, so a cached analysis gives the same fused bytes; None without
        recordings."""
        if "_stored_fusion" in self.__dict__:
            return self.__dict__["_stored_fusion"]
        if not self.recordings:
            return None
        try:
            from symcost.graph import fusion
        except ImportError:
            return None
        fe = fusion.estimate(self)
        return {"node_bytes": [[i, str(v)] for i, v in fe.node_bytes.items()],
                "node_written": [[i, str(v)] for i, v in fe.node_written.items()],
                "region_of": [[i, r] for i, r in fe.region_of.items()],
                "regions": [[r, list(ids)] for r, ids in fe.regions.items()], "exact": bool(fe.exact),
                "charged": [[i, list(a), list(b)] for i, (a, b) in (fe.charged or {}).items()]}

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
        from symcost.tracing.symbols import declare

        declare([k for k in list(d["spec"]["symbols"]) + list(d.get("symbols") or {}) if k not in SYMS])  # (a model's own sizes)
        P = functools.lru_cache(maxsize=None)(parse_formula)  # many sizes repeat
        ops, graph = d["ops"], d["graph"]  # parsed on first use: their layout is checked now
        if not (isinstance(ops, list) and all(isinstance(r, list) and len(r) in (13, 15, 16, 17) for r in ops)
                and isinstance(graph["nodes"], list) and isinstance(graph["edges"], list)):
            raise ValueError("malformed ops or graph")
        sd = d["spec"]

        def _gone(*args, **kwargs):
            raise SymcostError(f"{sd['name']}: this analysis was read from the trace cache and cannot "
                               "build the model; trace it again (symcost --no-cache, or symcost.trace(..., use_cache=False))")

        more = {k: dict(sd[k]) for k in ("moduli", "follows", "pads") if sd.get(k) and k in ModelSpec.__dataclass_fields__}
        if sd.get("lead_blocks"):
            more["lead_blocks"] = int(sd["lead_blocks"])
        more.update({k: sd[k] for k in ("step", "kv_cache") if sd.get(k) and k in ModelSpec.__dataclass_fields__})
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
            matmul_params=set(d["matmul_params"]), frozen=set(d.get("frozen") or ()),
            unsupported={k: P(v) for k, v in d["unsupported"].items()},
            saved=[(m, P(nb), dtype, P(rep)) for m, nb, dtype, rep in d["saved"]],
            layer_container=d["layer_container"], timings=dict(d["timings"]), precision=d["precision"],
            stacks=dict(d.get("stacks") or {}), stack_blocks=dict(d.get("stack_blocks") or {}),
            tied={k: list(v) for k, v in d["tied"].items()}, recordings=[],
            plan=None if plan is None else ProbePlan(tuple(plan["symbols"]), [dict(p) for p in plan["points"]],
                                                     dict(plan["axis"])),
            fitter=None, role=None, pinned={k: int(v) for k, v in d["pinned"].items()},
            schedule=None if d.get("schedule") is None else MemorySchedule.from_dict(d["schedule"]),
            _lazy={"ops": ops, "graph": graph},
        )
        par = d.get("parallel")
        if par is not None:
            an.__dict__.update(parallel=str(par["shard"]), tensor_parallel=par.get("tensor_parallel"), param_shards={
                n: (tuple(P(x) for x in sh), dtype, P(rep)) for n, (sh, dtype, rep) in par["param_shards"].items()})
        inf = d.get("inference") or {}
        an.__dict__.update(step=inf.get("step", "train"), kv_cache=inf.get("kv_cache"),
                           kv_layers=[(n, P(nb), P(rep)) for n, nb, rep in inf.get("kv_layers", [])])
        for k, v in d.get("regime", {}).items():
            if k in _REGIME_FIELDS:
                an.__dict__[k] = v
        if isinstance(d.get("module_classes"), dict):
            an.__dict__["_stored_module_classes"] = d["module_classes"]
        if isinstance(d.get("fusion"), dict):
            an.__dict__["_stored_fusion"] = d["fusion"]
        if isinstance(d.get("dataflow"), dict):
            an.__dict__["_dataflow"] = d["dataflow"]
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


def _totals_terms(symbols, totals: Mapping[str, str]) -> dict:
    """The totals that are polynomials in the symbols as ``symcost.tracing.poly.Terms`` (read back about ten
    times faster than parsing their text); others (a ratio such as H/K) are left to the text."""
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
_REGIME_FIELDS = ("request_facts", "regime_ties", "pin_reasons", "residues", "bounds", "signature", "request_sizes")

_GRAPH_FORMULAS = {"repeat", "flops", "flops_hw", "flops_all", "bytes", "intensity"}
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

    def names(self) -> list[str]:
        """The dtype names, without importing torch (``symcost.graph.opsets.dtype_names``)."""
        return [x if isinstance(x, str) else str(x).removeprefix("torch.") for x in list.__iter__(self)]


def _load_ops(rows) -> list:
    """SymOps from :meth:`Analysis.to_dict` rows (dtypes read as torch dtypes, see _Dtypes)."""
    import sys

    P = functools.lru_cache(maxsize=None)(parse_formula)
    Cost = rules.Cost if "symcost.graph.rules" in sys.modules else _Cost
    return [SymOp(index=i, name=name, family=fam, module=mod, phase=ph, repeat=P(rep),
                  in_shapes=[tuple(P(x) for x in sh) for sh in ins], in_dtypes=_Dtypes(ind),
                  out_shapes=[tuple(P(x) for x in sh) for sh in outs], out_dtypes=_Dtypes(outd),
                  cost=Cost(*(P(c) for c in cost[:3]),
                            {k: P(n) for k, n in (cost[3] if len(cost) > 3 else {}).items()},
                            P(cost[4]) if len(cost) > 4 else None),
                  layer=layer, attention=attn, kv_reads=tuple(more[0]) if more else (),
                  kv_writes=tuple(more[1]) if len(more) > 1 else (),
                  comm=None if len(more) < 3 or more[2] is None else
                  (more[2][0],) + tuple(P(x) for x in more[2][1:3]) + tuple(more[2][3:4]),
                  attn_flags=tuple(bool(x) for x in more[3]) if len(more) > 3 and more[3] is not None else None)
            for i, name, fam, mod, ph, rep, ins, ind, outs, outd, cost, layer, attn, *more in rows]


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
    flops_hw: Any = None

    def __post_init__(self):
        if self.flops_hw is None:
            self.flops_hw = self.flops

    @property
    def transcendental_total(self):
        return sum(self.transcendentals.values())

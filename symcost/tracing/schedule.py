"""The storage schedule of a traced step: every allocation and free, fitted and folded over L.

At trace time the probe recordings' memory events (``symcost.tracing.record``: weak references on
every storage) are aligned, each size fitted as a polynomial (:mod:`symcost.tracing.fit`), and the
schedule cut into units that fold over the L repeated blocks (docs/memory.md, "Folding over L").
The result, a :class:`MemorySchedule` of plain data, travels with the analysis (and the trace
cache) so that the memory and checkpointing passes need no recordings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS, FitError
from symcost.tracing.modules import _layer_of, _rename_block
from symcost.tracing.poly import Algebra, NotIntegral, Terms, terms_expr
from symcost.tracing.stacks import kv_stack, stack_of, stack_units

@dataclass
class ScheduleEvent:
    """One storage allocated (``bytes`` > 0) or freed (< 0) during the traced step.

    ``bytes``: signed size as :data:`Terms` in ``MemorySchedule.gens`` (a free of a storage every
    pass of a repeated block allocates but that is freed once for all passes carries that
    repeat); ``alloc``: position of the allocation it frees (its own position if an
    allocation); ``grad``: a gradient (allocated by the backward, live at the end of the step);
    ``op``, ``module`` (folded: ``layers.{i}``), ``phase``: the op that allocated it, or the op
    before which it was freed. ``once``: ``"first"`` or ``"last"`` for a free in a repeated unit
    of a storage allocated once, before the unit (rotary tables every block saves, freed with
    the backward of block 0): it happens in that pass of the unit only, not in every pass;
    ``""`` otherwise. ``kv``: a storage of an inference step's KV cache (a DynamicCache's
    concatenation allocating the tensor the cache then holds, or the free of the tensor it
    replaced, paired with that allocation: ``MemoryEvent.kv``); its bytes are the cache's dtype.
    """

    bytes: Terms
    alloc: int
    grad: bool
    op: str
    module: str
    phase: str
    once: str = ""
    kv: bool = False


@dataclass
class ScheduleUnit:
    """Events ``[start, stop)`` of the schedule, run ``repeat`` times (``"1"``, ``"L - 1"``: a
    formula string) in a row; valid only for ``sym >= min_L`` (``sym``: ``L``, or the length
    symbol of the unit's stack where several stacks fold, ``"L_dec"``)."""

    start: int
    stop: int
    repeat: str
    min_L: int
    label: str
    sym: str = "L"


@dataclass
class MemorySchedule:
    """The step's storage schedule as plain data, fitted at trace time (:func:`fit_schedule`).

    Everything the memory pass (and the checkpointing pass) needs without the probe
    recordings: the events in order with symbolic sizes, the fold over L as units, gradient
    element size, parameter sizes in the optimizer's order (elements and Adafactor's rows +
    columns), buffers and the step's inputs (bytes). ``kv_start``: an inference step's KV cache
    before the step minus after it, over the storages the step replaces (``Recording.kv_start``,
    folded over L; empty for a training step or a cache written in place): the running total of
    the events starts there, since the static part counts the cache after the step.
    ``error``: why the schedule has no formula (then only the peak is unavailable; static
    memory and activations still are). ``inverses``: the model's own divisors among ``gens``
    whose inverse is a generator of the ring the sizes are written in (a [G, W/G, W/G] weight's
    W²/G elements; :class:`symcost.tracing.poly.Algebra`), empty for most models.
    """

    gens: list[str]
    events: list[ScheduleEvent] = field(default_factory=list)
    units: list[ScheduleUnit] = field(default_factory=list)
    grad_itemsize: int = 4
    params: list[tuple[Terms, Terms]] = field(default_factory=list)
    buffers: Terms = field(default_factory=list)
    inputs: Terms = field(default_factory=list)
    error: str | None = None
    kv_start: Terms = field(default_factory=list)
    inverses: list[str] = field(default_factory=list)

    def algebra(self, domain=None) -> Algebra:
        """The ring the schedule's :data:`Terms` are written in (``QQ`` unless ``domain``)."""
        return Algebra(tuple(self.gens), *(() if domain is None else (domain,)), inverses=tuple(self.inverses))

    def expr(self, terms: Terms) -> sympy.Expr:
        """``terms`` of this schedule as a sympy expression (:func:`symcost.tracing.poly.terms_expr`)."""
        return terms_expr(self.gens, terms, tuple(self.inverses))

    def to_dict(self) -> dict:
        """JSON-ready data (:meth:`from_dict` reads it back)."""
        return {
            "gens": list(self.gens), "grad_itemsize": self.grad_itemsize, "error": self.error,
            "events": [[e.bytes, e.alloc, e.grad, e.op, e.module, e.phase]
                       + ([e.once, True] if e.kv else [e.once] if e.once else [])
                       for e in self.events],
            "units": [[u.start, u.stop, u.repeat, u.min_L, u.label] + ([u.sym] if u.sym != "L" else [])
                      for u in self.units],
            "params": [[a, b] for a, b in self.params], "buffers": self.buffers, "inputs": self.inputs,
            **({"kv_start": self.kv_start} if self.kv_start else {}),
            **({"inverses": list(self.inverses)} if self.inverses else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "MemorySchedule":
        """The schedule :meth:`to_dict` wrote."""
        return cls(
            gens=list(d["gens"]), grad_itemsize=int(d["grad_itemsize"]), error=d.get("error"),
            events=[ScheduleEvent(*e) for e in d["events"]], units=[ScheduleUnit(*u) for u in d["units"]],
            params=[(a, b) for a, b in d["params"]], buffers=d["buffers"], inputs=d["inputs"],
            kv_start=d.get("kv_start", []), inverses=list(d.get("inverses", [])),
        )


def _normalized(rec, keep_event: bool = False) -> list[tuple]:
    """The step's memory events as ``(op index, signed bytes, position of the allocation)``.

    Frees that happen together (between the same two allocations, stamped with the same op) may
    come in an order that depends on addresses (e.g. autocast's cast cache is a hash map); they
    are sorted by the position of the allocation they free, which is the same at every size.
    Their order does not change any live set seen at an allocation. ``keep_event``: each tuple
    also carries the index of its event in ``rec.events``.
    """
    n = rec.events_end if rec.events_end >= 0 else len(rec.events)
    pos: dict[int, int] = {}
    out: list[tuple[int, int, int]] = []
    run: list[tuple[int, int, int]] = []

    def flush():
        run.sort(key=lambda t: (t[0], t[2]))
        out.extend(run)
        run.clear()

    for j, e in enumerate(rec.events[:n]):
        if e.nbytes > 0:
            flush()
            pos[e.storage] = len(out)
            out.append((e.index, e.nbytes, len(out)) + ((j,) if keep_event else ()))
        elif e.storage in pos:
            run.append((e.index, e.nbytes, pos.pop(e.storage)) + ((j,) if keep_event else ()))
        # else: a free whose allocation was not seen as one (a storage swapped under a tensor,
        # e.g. by set_); it cannot be placed, so it is left out (the peak errs high)
    flush()
    return out


def _hosts(rec) -> dict[int, str]:
    """Position in :func:`_normalized`'s order -> the module where a free happened, for the
    events that carry one (``MemoryEvent.host``: data-parallel recordings)."""
    n = rec.events_end if rec.events_end >= 0 else len(rec.events)
    if not any(getattr(e, "host", None) is not None for e in rec.events[:n]):
        return {}
    order = _normalized(rec, keep_event=True)
    return {k: rec.events[j].host for k, (*_, j) in enumerate(order)
            if rec.events[j].nbytes < 0 and rec.events[j].host is not None}


def fit_schedule(recs, fitter, role, container: str | None, gens: tuple[str, ...], name: str,
                 lead: int = 0, middle: bool = False, stacks: Mapping[str, str] | None = None,
                 special: Mapping[str, int | None] | None = None) -> MemorySchedule:
    """Fit the probe recordings' memory events into a :class:`MemorySchedule` (at trace time).

    Args:
        recs: the probe recordings (``symcost.tracing.record.Recording``), aligned op by op.
        fitter: ``symcost.tracing.fit.Fitter`` over those probes.
        role: ``role(module, name=None) -> (keep, repeat, folded name)`` of the L = 2 fold.
        container: the blocks' container (None without repeated blocks).
        gens: the symbols of the trace, in order.
        name: the model's name (for messages).
        lead: n >= 2 leading blocks of another kind (``ModelSpec.lead_blocks``; the probes hold
            n + 2 blocks): blocks 0..n-1 are kept as they ran, block n is the first of the
            L - n others and block n + 1 stands for the remaining L - n - 1.
        middle: the probes hold three blocks (a data-parallel trace): block 0 and block 2 are
            kept as they ran (the first and the last, forward and backward), block 1 stands for
            the L - 2 blocks between them. FSDP2 holds a unit's all-gather and reduce-scatter
            buffers until the next unit's collective, so the first and last blocks of each
            direction differ from the others in what they free. Valid for L >= 2.
        stacks: several stacks folded each under its own symbol (container -> symbol,
            :func:`symcost.tracing.stacks.find_stacks`; ``container`` is then None): each stack's
            two probe blocks give units of their own in the stack's symbol
            (:func:`symcost.tracing.stacks.stack_units`), with ``special`` (container -> the end
            block that stands apart, 0, 1 or None: ``graph.stacks.stack_roles``).

    Each event's size is fitted across the probes (a polynomial); the schedule is cut into units
    folded over L (docs/memory.md, "Folding over L"). A schedule whose events change order with
    the sizes, or whose blocks interleave, gets ``error`` set instead of raising: FLOPs and
    activations do not need it.
    """
    # a model's own divisors (G of W/G channels) have inverse generators: a [G, W/G, W/G] weight
    # holds W²/G elements, a polynomial in W, G and 1/G (tracing/poly.py)
    inverses = [g for g in getattr(fitter.plan, "divisors", ()) if g in gens]
    alg = Algebra(gens, inverses=tuple(inverses))
    has_L = "L" in gens
    ref = recs[0]
    sched = MemorySchedule(gens=list(gens), inverses=inverses)
    # buffers, inputs, parameter sizes (static memory)
    buf = alg.R.zero
    for bname in ref.buffers:
        keep, rep, _ = role(bname.rpartition(".")[0], bname)
        if not keep:
            continue
        sig = tuple(math.prod(r.buffers[bname][0]) * r.buffers[bname][1].itemsize for r in recs)
        buf += alg.from_expr(rep) * alg.from_expr(fitter(sig, f"size of buffer {bname}"))
    sched.buffers = alg.terms(buf)
    sched.inputs = alg.terms(alg.from_expr(fitter(tuple(r.input_nbytes for r in recs), "size of the inputs")))
    # a tensor-parallel rank's optimizer steps its local shards (DTensor's local tensors): their
    # shapes; a data-parallel trace keeps the whole shapes (the memory pass takes 1/DP of each),
    # and on the 2-D mesh (DP, TP) the TP-local ones, which the data-parallel engine shards
    local = (ref.parallel or "").startswith("tp")
    engine = _engine_share(ref)
    frozen = getattr(ref, "frozen", ()) or ()
    for pname, (shape, _) in ref.params.items():
        if pname in frozen:  # (requires_grad=False: no gradient, so torch.optim steps it not)
            continue
        shapes = [r.param_shards[pname] if local or engine else r.params[pname][0] for r in recs]
        numel = fitter(tuple(math.prod(sh) * (engine(r) if engine else 1) for sh, r in zip(shapes, recs)),
                       f"size of {pname}")
        fac = sympy.Integer(0)
        if len(shape) >= 2 and not engine:  # (a factored optimizer is not modelled with --dp)
            sig = tuple(math.prod(sh[:-1]) + math.prod(sh[:-2]) * sh[-1] for sh in shapes)
            fac = fitter(sig, f"factored size of {pname}")
        sched.params.append((alg.terms(_poly(alg, numel, f"size of {pname}")),
                             alg.terms(_poly(alg, fac, f"factored size of {pname}"))))
    pdtypes = {d for _, d in ref.params.values() if d.is_floating_point}
    sched.grad_itemsize = max((d.itemsize for d in pdtypes), default=4)
    try:
        _fit_events(sched, alg, recs, fitter, role, container if has_L else None, name, lead, middle,
                    stacks=stacks or {}, special=special or {})
        sched.kv_start = _fit_kv_start(alg, recs, fitter, role, container if has_L else None, stacks)
    except SymcostError as e:
        sched.events, sched.units, sched.error, sched.kv_start = [], [], str(e), []
    return sched


def _poly(alg, expr, what: str):
    """``expr`` in ``alg``'s polynomial ring.

    Raises:
        FitError: the fit's formula has a term no polynomial holds (a Laurent term such as H/K that
            the probes could not rule out): the tracer fits on more probes, then pins the symbols
            it names, as for any signature no polynomial reproduces.
    """
    try:
        return alg.from_expr(expr)
    except NotIntegral as e:
        syms = sorted(str(x) for x in sympy.sympify(expr).free_symbols)
        raise FitError(f"the {what} fitted as {expr}, which is no polynomial in the symbols", syms) from e


def _fit_kv_start(alg, recs, fitter, role, container: str | None, stacks: Mapping[str, str] | None = None) -> Terms:
    """``Recording.kv_start`` fitted per cache layer and folded over L as the cache's bytes are
    (cache layer i belongs to block i, as in ``symcost.graph.kv_fit._fit_kv``; where several
    stacks fold, block i of the stack that reads the cache, :func:`symcost.tracing.stacks.kv_stack`,
    folded under its symbol): the KV cache before an inference step minus after it, over the
    storages the step replaces (bytes, :data:`Terms`; empty where no probe replaces any).

    Raises:
        SymcostError: the probes hold different numbers of cache layers; a size no polynomial fits.
    """
    ref = recs[0]
    if not any(any(getattr(r, "kv_start", ())) for r in recs):
        return []
    n = len(ref.kv_start)
    if any(len(r.kv_start) != n for r in recs):
        raise SymcostError("the number of KV-cache layers changes with the sizes")
    if stacks:
        container = kv_stack(ref, stacks)
        if container is None:
            raise SymcostError("the KV cache is read by the blocks of no one stack")
    total = alg.R.zero
    for i in range(n):
        keep, repeat, _ = role(f"{container}.{i}") if container else (True, 1, None)
        if keep:
            size = fitter(tuple(r.kv_start[i] for r in recs), f"KV-cache bytes replaced in layer {i}")
            total += alg.from_expr(repeat) * alg.from_expr(size)
    return alg.terms(total)


def _fit_events(sched, alg, recs, fitter, role, container, name, lead: int = 0, middle: bool = False,
                stacks: Mapping[str, str] | None = None, special: Mapping[str, int | None] | None = None) -> None:
    ref = recs[0]
    norm = [_normalized(r) for r in recs]
    n = len(norm[0])
    for r in norm[1:]:
        if len(r) != n or any((a[0] != b[0] or (a[1] > 0) != (b[1] > 0) or a[2] != b[2])
                              for a, b in zip(r, norm[0])):
            raise SymcostError(
                f"{name}: the storages allocated and freed change order with the sizes; the "
                "peak memory has no single formula"
            )
    events = norm[0]  # (op index, signed bytes, alloc position)
    hosts = _hosts(ref)
    kv = ({k for k, (*_, j) in enumerate(_normalized(ref, keep_event=True)) if getattr(ref.events[j], "kv", False)}
          if ref.step != "train" else set())
    # gradients: storages the backward allocates that are still live when the step ends
    live: dict[int, int] = {}
    for k, (_, nb, pos) in enumerate(events):
        if nb > 0:
            live[k] = k
        else:
            live.pop(pos, None)
    n_ops = len(ref.ops)
    grad_events = {k for k in live.values() if ref.ops[min(events[k][0], n_ops - 1)].phase != "forward"}
    # one polynomial per event (bytes, signed)
    evpolys = []
    for k, (_, nb, _) in enumerate(events):
        p = alg.from_expr(fitter(tuple(abs(r[k][1]) for r in norm), "storage size"))
        evpolys.append(p if nb > 0 else -p)

    def where(k):
        i, nb, _ = events[k]
        i = i if nb > 0 else i - 1
        op = ref.ops[max(0, min(i, n_ops - 1))]
        # the block where it happened (FSDP2's prefetch of another unit happens in this one; a
        # free in a hook after the block's last op where the hook runs)
        host = hosts.get(k)
        if host is None:
            host = op.host if getattr(op, "host", None) is not None else op.module
        return op, (stack_of(host, stacks) if stacks else _layer_of(host, container))

    info = [where(k) for k in range(n)]
    units: list[tuple[int, int, Any, int, str]] = []  # (start, stop, repeat, min_L, label)
    siblings: list[tuple[range, range]] = []
    probe_first = False  # the repeated units' probe block is block 0 (the last block differs)
    firsts: dict[int, bool] = {}  # (several stacks) unit -> its probe_first
    middles: dict[int, range] = {}  # (several stacks) siblings of a three-block stack -> the block after it
    if stacks:
        units, siblings, firsts, middles = stack_units(info, n, stacks, special or {}, name)
    elif container is not None:
        spans = {}
        for k in range(n):
            op, layer = info[k]
            if layer is None:
                continue
            key = (op.phase if op.phase == "forward" else "backward", layer)
            a, b = spans.get(key, (k, k))
            spans[key] = (min(a, k), max(b, k))
        # the blocks' spans must follow each other: forward 0, 1, ..., then backward in reverse
        # (with n leading blocks: n + 2 blocks, of which n and n + 1 are the two compared); a
        # forward-only step (inference) has no backward spans: its blocks fold the same way
        forward_only = not any(k[0] == "backward" for k in spans)
        nb = lead + 2 + (1 if middle else 0)
        order = [("forward", i) for i in range(nb)]
        if not forward_only:
            order += [("backward", i) for i in reversed(range(nb))]
        ok = all(k in spans for k in order) and len(spans) == len(order)
        if ok:
            ok = all(spans[a][1] < spans[b][0] for a, b in zip(order, order[1:]))
        if not ok:
            raise SymcostError(
                f"{name}: the memory events of the blocks of {container} interleave; the peak "
                "cannot be folded over L"
            )
        f0, f1 = spans[("forward", lead)], spans[("forward", lead + 1)]
        if forward_only:
            b1 = b0 = (n, n - 1)  # empty: the units below end with the forward
        else:
            b1, b0 = spans[("backward", lead + 1)], spans[("backward", lead)]
        pre = f"{container}." if container else ""
        rep0, rep1 = role(f"{pre}0")[1], role(f"{pre}1")[1]
        special = 0 if (rep0 == 1 and rep1 != 1) else 1 if (rep1 == 1 and rep0 != 1) else None
        if lead:
            special = None
        probe_first = special == 1 and not middle
        F0, F1 = range(f0[0], f0[1] + 1), range(f1[0], f1[1] + 1)
        B1, B0 = range(b1[0], b1[1] + 1), range(b0[0], b0[1] + 1)
        if middle and not forward_only:
            # blocks 0, 1, 2: each pass runs from its block's first event to the next block's first
            # (a unit's hooks after its last op, e.g. FSDP2's reshard, belong to its pass)
            f2, b2 = spans[("forward", 2)], spans[("backward", 2)]
            siblings = [(range(f1[0], f2[0]), range(f0[0], f1[0])), (range(b1[0], b0[0]), range(b2[0], b1[0]))]
            units = [(0, f0[0], 1, 2, "forward, before the blocks"),
                     (f0[0], f1[0], 1, 2, "forward, first block"),
                     (f1[0], f2[0], "L - 2", 3, "forward, block"),
                     (f2[0], f2[1] + 1, 1, 2, "forward, last block"),
                     (f2[1] + 1, b2[0], 1, 2, "end of forward / start of backward"),
                     (b2[0], b1[0], 1, 2, "backward, last block"),
                     (b1[0], b0[0], "L - 2", 3, "backward, block"),
                     (b0[0], n, 1, 2, "backward, first block and after")]
        elif forward_only and lead:  # blocks 0..n-1 as they ran; block n first of the others
            siblings = [(F1, F0)]
            more = f"L - {lead + 1}"
            units = [(0, f0[0], 1, 1, f"forward, before the blocks and the {lead} leading blocks"),
                     (f0[0], f0[1] + 1, 1, 1, f"forward, block {lead}"),
                     (f0[1] + 1, f1[1] + 1, more, lead + 2, "forward, block"),
                     (f1[1] + 1, n, 1, 1, "forward, after the blocks")]
        elif forward_only:
            siblings = [(F0, F1)] if special == 1 else [(F1, F0)]
            units = ([(0, f0[0], 1, 1, "forward, before the blocks"),
                      (f0[0], f1[0], "L - 1", 2, "forward, block"),
                      (f1[0], f1[1] + 1, 1, 1, "forward, last block")] if special == 1 else
                     [(0, f0[0], 1, 1, "forward, before the blocks"),
                      (f0[0], f0[1] + 1, 1, 1, "forward, first block"),
                      (f0[1] + 1, f1[1] + 1, "L - 1", 2, "forward, block")])
            units.append((f1[1] + 1, n, 1, 1, "forward, after the blocks"))
        elif special == 1:  # the last block differs: blocks 0..L-2 are like block 0
            siblings = [(F0, F1), (B0, B1)]
            units = [(0, f0[0], 1, 1, "forward, before the blocks"),
                     (f0[0], f1[0], "L - 1", 2, "forward, block"),
                     (f1[0], f1[1] + 1, 1, 1, "forward, last block"),
                     (f1[1] + 1, b1[0], 1, 1, "end of forward / start of backward"),
                     (b1[0], b1[1] + 1, 1, 1, "backward, last block"),
                     (b1[1] + 1, b0[1] + 1, "L - 1", 2, "backward, block"),
                     (b0[1] + 1, n, 1, 1, "backward, after the blocks")]
        elif lead:  # blocks 0..n-1 as they ran; block n first of the others, n + 1 repeated
            siblings = [(F1, F0), (B1, B0)]
            more = f"L - {lead + 1}"
            units = [(0, f0[0], 1, 1, f"forward, before the blocks and the {lead} leading blocks"),
                     (f0[0], f0[1] + 1, 1, 1, f"forward, block {lead}"),
                     (f0[1] + 1, f1[1] + 1, more, lead + 2, "forward, block"),
                     (f1[1] + 1, b1[0], 1, 1, "end of forward / start of backward"),
                     (b1[0], b0[0], more, lead + 2, "backward, block"),
                     (b0[0], b0[1] + 1, 1, 1, f"backward, block {lead}"),
                     (b0[1] + 1, n, 1, 1, f"backward, the {lead} leading blocks and after")]
        else:
            siblings = [(F1, F0), (B1, B0)]
            units = [(0, f0[0], 1, 1, "forward, before the blocks"),
                     (f0[0], f0[1] + 1, 1, 1, "forward, first block"),
                     (f0[1] + 1, f1[1] + 1, "L - 1", 2, "forward, block"),
                     (f1[1] + 1, b1[0], 1, 1, "end of forward / start of backward"),
                     (b1[0], b0[0], "L - 1", 2, "backward, block"),
                     (b0[0], b0[1] + 1, 1, 1, "backward, first block"),
                     (b0[1] + 1, n, 1, 1, "backward, after the blocks")]
    else:
        units = [(0, n, 1, 1, "step")]
    # A storage allocated in every pass of a repeated block and freed once for all of them,
    # outside (e.g. autocast's cast cache, emptied when the forward leaves autocast), is freed
    # repeat times there. It is told apart from a storage of the last pass only (the last block's
    # output, freed by the head) by its sibling: the storage the other block of the L = 2 trace
    # allocated at the same place is freed at the same place too.
    unit_of = {}
    for u, (a, b, *_) in enumerate(units):
        for k in range(a, b):
            unit_of[k] = u
    freed_in = {events[k][2]: unit_of[k] for k in range(n) if events[k][1] < 0}
    sibling_of: dict[int, int] = {}

    def generic(module: str, label: str) -> str:  # a module's name with its block's index replaced
        if stacks:
            where = stack_of(module, stacks)
            return module if where is None else _rename_block(module, where[0], label)
        return _rename_block(module, container, label)

    def key(k):  # what an allocation is, wherever its block is
        op, _ = info[k]
        return op.name, generic(op.module, "#"), tuple(sorted(evpolys[k].items()))

    for rep_ids, sib_ids in siblings:
        # match the repeated block's allocations, in order, to the sibling's (greedy: the
        # sibling may have a few more, e.g. block 0 casting the model's input)
        sa = [k for k in sib_ids if events[k][1] > 0]
        j = 0
        for a in (k for k in rep_ids if events[k][1] > 0):
            ka = key(a)
            for jj in range(j, len(sa)):
                if key(sa[jj]) == ka:
                    sibling_of[a] = sa[jj]
                    j = jj + 1
                    break
    L = SYMS["L"]
    for k in range(n):
        if events[k][1] < 0:
            ua, uf = unit_of[events[k][2]], unit_of[k]
            rep_a = units[ua][2]
            sib = sibling_of.get(events[k][2])
            if (ua != uf and rep_a != 1 and units[uf][2] == 1 and sib is not None
                    and freed_in.get(sib) == uf):
                times = (sympy.sympify(rep_a) if stacks else L - 2 if middle else L - 1 - lead)
                evpolys[k] = evpolys[k] * alg.from_expr(times)
    # A free in a repeated unit of a storage allocated once, in a unit run once before it (the
    # rotary tables every block saves, freed with the backward of block 0), happens in one pass of
    # the unit, not in every pass. It is told apart from a free each pass makes of a storage the
    # pass before it allocated (a block frees its input; the first pass's input comes from the
    # unit before) by its sibling: the other block of the L = 2 trace frees a storage of the same
    # size at the same op in that case. The pass is the one the probe block stands for: block 0
    # is the first pass of the forward and the last of the backward.
    once: dict[int, str] = {}
    if not middle:
        def fkey(k):
            op, _ = info[k]
            return op.name, generic(op.module, "#"), tuple(sorted(evpolys[k].items()))

        for j, (rep_ids, sib_ids) in enumerate(siblings):
            # (a three-block stack's middle block: told apart by the block after it, whose frees
            # of what the middle's last pass allocated are the middle's per-pass ones)
            sib_ids = middles.get(j, sib_ids)
            sib_frees = {fkey(k) for k in sib_ids if events[k][1] < 0}
            for k in rep_ids:
                if events[k][1] > 0 or k not in unit_of:
                    continue
                u, ua = unit_of[k], unit_of[events[k][2]]
                if units[u][2] == 1 or ua == u or units[ua][2] != 1 or fkey(k) in sib_frees:
                    continue
                forward = units[u][4].startswith("forward")
                once[k] = "first" if forward == firsts.get(u, probe_first) else "last"
    for k in range(n):
        op, _ = info[k]
        keep, _, module = role(op.module)
        layer = info[k][1]
        if lead and layer is not None and layer < lead:
            module = op.module  # a leading block, kept as it ran
        elif not keep:  # a probe block that stands for the generic one: name it as folded
            module = generic(op.module, "{i}")
        sched.events.append(ScheduleEvent(
            alg.terms(evpolys[k]), events[k][2], k in grad_events, op.name.removeprefix("aten."),
            module, op.phase, once.get(k, ""), k in kv))
    sched.units = [ScheduleUnit(a, b, str(rep), mL, label, *rest) for a, b, rep, mL, label, *rest in units]


def _engine_share(ref):
    """On the 2-D mesh (``Recording.tensor_parallel``): ``recording -> k`` such that a parameter's
    TP-local elements are ``k`` times its rank-local ones (``DP`` where FSDP2 shards the TP-local
    rows again, 1 for ``replicate``); None on a 1-D mesh."""
    if ref.tensor_parallel is None:
        return None
    from symcost.frontends.parallel import SHARDS

    if SHARDS[ref.parallel][0] == "fully_shard":
        return lambda r: r.values["DP"]
    return lambda r: 1

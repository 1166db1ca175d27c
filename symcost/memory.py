"""Memory of one training step: static memory by precision policy, activations, peak, max batch.

Everything here is derived from a traced :class:`~symcost.analysis.Analysis`; nothing is typed in
per architecture. The accounting (see docs/memory.md and ../shared/conventions.md):

* **Static memory** (bytes, live for the whole step): parameters, optimizer state and master
  weights, each ``bytes per element x elements`` of the precision policy (:data:`POLICIES`) and
  the optimizer (:data:`OPTIMIZERS`), over the parameters of the trace (tied ones once), plus the
  model's buffers and the step's input tensors. Gradients follow the same policy; they are static
  in the sense of the JSON contract (``memory.grads``) but in the peak they are allocated where
  the backward really allocates them (``optimizer.zero_grad(set_to_none=True)`` between steps).
* **Activations**: what autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
  parameters and buffers excluded, deduplicated by storage: ``Analysis.saved`` fitted and folded.
* **Peak** of a *steady-state* step (optimizer state already allocated, gradients set to None by
  the previous ``zero_grad``): static memory plus the largest live set over the traced schedule:
  every storage the forward and the backward allocate and free, in the order they did (the
  recording's memory events), folded to any L (block 0, then L-1 blocks like block 1 in forward;
  L-1 blocks like block 1, then block 0 in backward), then the optimizer step's transient buffers.
  The candidates for the maximum are polynomials; those dominated for all sizes are dropped, so
  the peak is one polynomial where the maximiser does not depend on the sizes, else ``Max(...)``
  of the few that can win (``Piecewise`` on L = 1 when a candidate needs two blocks).

The schedule is fitted once, at trace time (:func:`fit_schedule` -> ``Analysis.schedule``, a
:class:`MemorySchedule` of plain data), so the pass needs the analysis only, not the probe
recordings (a cached analysis has none). Polynomials are elements of sympy's sparse polynomial
rings (``sympy.polys.rings``, exact ``ZZ``/``QQ`` coefficients).

Public entry points: :func:`parse_memory`, :func:`memory_model` (-> :class:`MemoryModel` with
``peak``, ``solve``, ``plan_accumulation``), :func:`report_section`, :func:`default_impl`,
:func:`fit_schedule`.
"""
from __future__ import annotations

import math
import re
import time
import weakref
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping

import sympy
from sympy.polys.domains import QQ, ZZ
from sympy.polys.rings import ring as _ring

from .errors import SymcostError
from .fit import SYMS, parse_formula

GiB = 2**30

# --------------------------------------------------------------------------------------------
# memory caps
# --------------------------------------------------------------------------------------------

_UNITS = {
    "B": 1,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_CAP_RE = re.compile(r"^\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_memory(text: str | int) -> int:
    """A memory cap in bytes: ``"85899345920"``, ``"80GiB"``, ``"80GB"``, ``"1.5 TiB"``.

    Units: KiB, MiB, GiB, TiB are binary (2**10 ...), KB, MB, GB, TB decimal (10**3 ...), B bytes;
    unit letters are case-insensitive. A fractional result is rounded down to whole bytes.

    Raises:
        SymcostError: an unknown unit (``80XB``), a number without a unit that is not an
            integer, a negative or zero cap, or anything else that is not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise SymcostError(f"memory cap must be positive, got {text}")
        return text
    s = str(text)
    m = _CAP_RE.match(s)
    accepted = "bytes as an integer, or a number with a unit: KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal), e.g. 80GiB"
    if not m:
        raise SymcostError(f"bad memory cap {s!r}: expected {accepted}")
    sign, num, unit = m.groups()
    if unit and unit.upper() not in _UNITS:
        raise SymcostError(f"bad memory cap {s!r}: unknown unit {unit!r}; expected {accepted}")
    if not unit and "." in num:
        raise SymcostError(f"bad memory cap {s!r}: a number without a unit must be whole bytes; expected {accepted}")
    value = Fraction(num) * _UNITS[unit.upper() if unit else "B"]
    if sign == "-" or value <= 0:
        raise SymcostError(f"memory cap must be positive, got {s.strip()!r}")
    out = math.floor(value)
    if out <= 0:
        raise SymcostError(f"memory cap {s.strip()!r} is less than one byte")
    return out


def dominant_text(name: str, nbytes: int, cap: int) -> str:
    """Name what dominates: 'optimizer state alone is 84.000 GiB' when it exceeds ``cap``, else
    'the largest part is ...'."""
    if nbytes > cap:
        return f"{name} alone is {gib(nbytes)}"
    return f"the largest part is {name}, {gib(nbytes)}"


def gib(nbytes: int | float) -> str:
    """``nbytes`` in GiB with three decimals (binary units, as the conventions ask)."""
    return f"{nbytes / GiB:.3f} GiB"


def binary(nbytes: int | float) -> str:
    """``nbytes`` in the largest binary unit it reaches (GiB, MiB, KiB), three decimals; plain
    bytes below 1 KiB (``1.000 MiB`` where :func:`gib` would print ``0.001 GiB``)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{int(nbytes)} bytes"


# --------------------------------------------------------------------------------------------
# policies and optimizers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Bytes per element of each static component under a precision policy.

    Attributes:
        name: the policy (= the ``--precision`` the model is traced with).
        param: bytes per parameter of the weights the forward reads.
        grad: bytes per gradient element.
        state: bytes per element of optimizer state (moments, momentum, factored variance).
        master: bytes per parameter of master weights (0: no master copy).
        note: one line on what the policy is.
    """

    name: str
    param: int
    grad: int
    state: int
    master: int
    note: str


#: The precision policies (conventions.md "Memory of a training step"; names and what is traced in
#: :mod:`symcost.precision`). Activations always come from the trace at the same precision: the
#: model cast to bf16/fp16 for ``*-true`` and ``bf16-true-fp32-*``, the fp32 model under
#: ``torch.autocast`` for ``*-mixed`` (whose bf16/fp16 weight copies are activations, not static).
POLICIES: dict[str, Policy] = {
    "fp32": Policy("fp32", 4, 4, 4, 0, "fp32 weights, gradients and optimizer state"),
    "bf16-mixed": Policy("bf16-mixed", 4, 4, 4, 0,
                         "autocast over fp32 weights (Lightning/Accelerate bf16-mixed): fp32 weights, "
                         "gradients and optimizer state"),
    "fp16-mixed": Policy("fp16-mixed", 4, 4, 4, 0,
                         "autocast over fp32 weights (Lightning 16-mixed): fp32 weights, gradients and "
                         "optimizer state"),
    "bf16-true": Policy("bf16-true", 2, 2, 2, 0, "every tensor bf16: weights, gradients and optimizer state"),
    "fp16-true": Policy("fp16-true", 2, 2, 2, 0, "every tensor fp16: weights, gradients and optimizer state"),
    "bf16-true-fp32-state": Policy("bf16-true-fp32-state", 2, 2, 4, 0,
                                   "bf16 weights and gradients, fp32 optimizer state, no master copy "
                                   "(the conventions' 12P)"),
    "bf16-true-fp32-master": Policy("bf16-true-fp32-master", 2, 2, 4, 4,
                                    "bf16 weights and gradients, fp32 master weights and optimizer state "
                                    "(Megatron-LM / DeepSpeed bf16; 16P)"),
}


@dataclass(frozen=True)
class Optimizer:
    """The state an optimizer keeps per parameter tensor (as torch.optim 2.x does).

    Attributes:
        name: ``adamw``, ``adam``, ``sgd``, ``sgd-nomomentum`` or ``adafactor``.
        full: state tensors of the parameter's full shape (Adam: exp_avg, exp_avg_sq; SGD with
            momentum: momentum_buffer).
        factored: Adafactor's factored second moment: for a tensor of >= 2 dims, ``row_var``
            (last dim reduced to 1) plus ``col_var`` (second-to-last dim reduced to 1); for a
            vector, one full ``variance``.
        step: a 0-d fp32 ``step`` tensor per parameter tensor (4 bytes; torch's Adam, AdamW and
            Adafactor keep it on the CPU unless ``capturable``/``fused``).
        torch: the class it models.
    """

    name: str
    full: int
    factored: bool
    step: bool
    torch: str


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer("adamw", 2, False, True, "torch.optim.AdamW"),
    "adam": Optimizer("adam", 2, False, True, "torch.optim.Adam"),
    "sgd": Optimizer("sgd", 1, False, False, "torch.optim.SGD(momentum>0)"),
    "sgd-nomomentum": Optimizer("sgd-nomomentum", 0, False, False, "torch.optim.SGD(momentum=0)"),
    "adafactor": Optimizer("adafactor", 0, True, True, "torch.optim.Adafactor"),
}

#: How the optimizer step runs: ``foreach`` (one list op per update, temporaries for all tensors
#: at once), ``for-loop`` (one tensor at a time), ``fused`` (no temporaries), or ``default``:
#: what ``torch.optim`` picks itself when ``foreach`` is left None, which depends on the device
#: (:func:`default_impl`).
IMPLS = ("default", "foreach", "for-loop", "fused")
#: Devices the step may run on, for ``impl="default"``.
DEVICES = ("cuda", "cpu", "xpu", "mtia")
#: torch/utils/_foreach_utils.py ``_get_foreach_kernels_supported_devices()`` (torch 2.x): the
#: device types whose tensors ``torch.optim`` steps with foreach kernels by default.
FOREACH_DEVICES = ("cuda", "xpu", "mtia")
STEP_BYTES = 4  # torch.tensor(0.0, dtype=_get_scalar_dtype()): fp32, 0-d


def default_impl(device: str = "cuda") -> str:
    """The optimizer implementation ``torch.optim`` runs when ``foreach`` is left None.

    torch/optim/optimizer.py ``_default_to_fused_or_foreach``: foreach when every parameter lies
    on a device with foreach kernels (CUDA, XPU, MTIA), else the per-tensor for-loop (the CPU);
    fused only when asked for. So the same ``AdamW(params)`` keeps a state-sized temporary of
    every tensor at once on a GPU and two temporaries of one tensor at a time on the CPU.

    Raises:
        SymcostError: unknown device.
    """
    if device not in DEVICES:
        raise SymcostError(f"unknown device {device!r}; accepted: {', '.join(DEVICES)}")
    return "foreach" if device in FOREACH_DEVICES else "for-loop"


def resolve_impl(impl: str, device: str = "cuda") -> str:
    """``impl`` itself, or for ``"default"`` what ``torch.optim`` picks on ``device``.

    Raises:
        SymcostError: unknown implementation or device.
    """
    if impl not in IMPLS:
        raise SymcostError(f"unknown optimizer implementation {impl!r}; accepted: {', '.join(IMPLS)}")
    return default_impl(device) if impl == "default" else impl


def policy(name: str) -> Policy:
    """The :class:`Policy` called ``name``.

    Raises:
        SymcostError: unknown or renamed policy (the message names the new one).
    """
    from .precision import check_precision

    return POLICIES[check_precision(name)]


def optimizer(name: str) -> Optimizer:
    """The :class:`Optimizer` called ``name`` (case-insensitive).

    Raises:
        SymcostError: unknown optimizer.
    """
    try:
        return OPTIMIZERS[str(name).lower()]
    except KeyError:
        raise SymcostError(f"unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}") from None


# --------------------------------------------------------------------------------------------
# polynomials: sympy's polynomial rings over QQ (exact), plus what the peak needs
# --------------------------------------------------------------------------------------------

#: A polynomial as plain data (JSON): ``[[e_1, ..., e_n, "p/q"], ...]``, exponents in the order
#: of the symbols it is written in (``MemorySchedule.gens``).
Terms = list


class NotIntegral(ValueError):
    """A coefficient that the integer ring ``ZZ`` cannot hold (use ``QQ``)."""


class Algebra:
    """The polynomial ring ``ZZ[gens]`` or ``QQ[gens]`` (``sympy.polys.rings.ring``) of a
    model's symbols.

    Elements are ``PolyElement``s (exact coefficients; with ``ZZ``, the usual case of byte
    counts, plain Python integers, which keeps the arithmetic fast); besides the ring's own
    operations this gives the conversions to and from sympy expressions and plain
    :data:`Terms`, and the shift ``p(x) -> p(x + 1)`` that decides signs over positive integers.
    Converting a non-integer coefficient into ``ZZ`` raises :class:`NotIntegral`.
    """

    def __init__(self, gens: tuple[str, ...], domain=QQ):
        self.gens = tuple(gens)
        self.domain = domain
        syms = [SYMS[g] for g in self.gens] or [sympy.Symbol("_one")]
        self.R, *self.x = _ring(syms, domain)
        self.n = len(syms)
        self._shifted: dict[tuple, Any] = {}
        self._from_expr: dict = {}

    def gen(self, name: str):
        return self.x[self.gens.index(name)]

    def from_expr(self, expr):
        """A sympy polynomial in the symbols (or a number) as a ring element."""
        got = self._from_expr.get(expr)
        if got is None:
            try:
                got = self._from_expr[expr] = self.R(sympy.sympify(expr))
            except ValueError as e:  # a rational coefficient in ZZ
                raise NotIntegral(str(e)) from e
        return got

    def from_terms(self, terms: Terms):
        d = {}
        for t in terms:
            d[tuple(t[:-1]) if self.gens else (0,)] = self._coeff(Fraction(t[-1]))
        return self.R.from_dict(d) if d else self.R.zero

    def _coeff(self, f: Fraction):
        if self.domain == ZZ:
            if f.denominator != 1:
                raise NotIntegral(f"{f} is not an integer")
            return int(f)
        return QQ(f.numerator, f.denominator)

    def terms(self, p) -> Terms:
        out = []
        for m, c in sorted(p.items()):
            out.append([*(m if self.gens else ()), str(c)])
        return out

    def expr(self, p) -> sympy.Expr:
        return p.as_expr() if self.gens else sympy.Rational(str(p.coeff(1)) if p else 0)

    def scale(self, p, k):
        """``k * p`` for a rational ``k`` (int or Fraction)."""
        k = Fraction(k)
        if self.domain == ZZ:
            return self.R.from_dict({m: self._coeff(Fraction(int(c)) * k) for m, c in p.items()}) if p else p
        return p * QQ(k.numerator, k.denominator)

    def shift(self, p):
        """``p(x + 1)``, a polynomial in y = x - 1 >= 0: when all its coefficients are >= 0, p >= 0
        at every positive integer point (a sufficient test). Shifted monomials are cached."""
        out = self.R.zero
        for m, c in p.items():
            s = self._shifted.get(m)
            if s is None:
                s = self.R.one
                for x, e in zip(self.x, m):
                    if e:
                        s = s * (x + 1) ** e
                self._shifted[m] = s
            out += s * c
        return out


def terms_expr(gens, terms: Terms) -> sympy.Expr:
    """:data:`Terms` in the symbols ``gens`` as a sympy expression."""
    return sympy.Add(*[sympy.Rational(str(t[-1])) * sympy.Mul(*[SYMS[g] ** e for g, e in zip(gens, t[:-1]) if e])
                       for t in terms])


def _nonneg(p) -> bool:
    return all(c >= 0 for c in p.values())


def _geq(a, b) -> bool:
    """Every coefficient of ``a - b`` is >= 0 (without building ``a - b``)."""
    for m, c in b.items():
        if a.get(m, 0) < c:
            return False
    return all(c >= 0 or m in b for m, c in a.items())


def _peval(p, values: tuple) -> int | Fraction:
    """``p`` at integer ``values`` (in the ring's symbol order), exactly."""
    tot = 0
    for m, c in p.items():
        t = c
        for v, e in zip(values, m):
            if e:
                t *= v**e
        tot += t
    if isinstance(tot, int):
        return tot
    return int(tot.numerator) if tot.denominator == 1 else Fraction(int(tot.numerator), int(tot.denominator))


def _sign(alg: Algebra, p) -> int:
    """+1 if ``p >= 0`` for all positive integer symbols, -1 if ``<= 0``, 0 if it depends (or the
    shift cannot tell)."""
    s = alg.shift(p)
    if _nonneg(s):
        return 1
    if all(c <= 0 for c in s.values()):
        return -1
    return 0


@dataclass
class Candidate:
    """One point of the schedule where the live set may peak: ``poly`` bytes (dynamic part) as a
    ring element, ``shifted`` = ``poly(x + 1)``."""

    poly: Any
    shifted: Any
    min_L: int  # valid for L >= min_L only (needs that many blocks)
    label: str


def _pareto(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that another one dominates for every positive integer size."""
    kept: list[Candidate] = []
    for c in cands:
        if any(k.min_L <= c.min_L and _geq(k.shifted, c.shifted) for k in kept):
            continue
        kept = [k for k in kept if not (c.min_L <= k.min_L and _geq(c.shifted, k.shifted))]
        kept.append(c)
    return kept

def _feasible_sup(p: sympy.Expr, X: sympy.Symbol):
    """Supremum of the interval of ``{X >= 1 : p(X) <= 0}`` that starts at 1 (0 when p(1) > 0).

    The real roots of the polynomial come from sympy exactly (radicals or ``CRootOf``); the sign
    of ``p`` between consecutive roots decides where the interval ends (``oo`` if never).
    """
    poly = sympy.Poly(p, X)
    if poly.eval(1) > 0:
        return sympy.Integer(0)
    roots = sorted({r for r in poly.real_roots() if r >= 1}, key=lambda r: sympy.N(r, 30))
    for i, r in enumerate(roots):
        after = (roots[i + 1] + r) / 2 if i + 1 < len(roots) else r + 1
        if poly.eval(sympy.Rational(sympy.N(after, 40))) > 0:  # an exact rational near ``after``
            return r
    return sympy.oo


# --------------------------------------------------------------------------------------------
# the memory model
# --------------------------------------------------------------------------------------------


class NothingFits(SymcostError):
    """Not even a batch (micro-batch) of 1 fits under the cap: an answer, not bad input (the CLI
    exits with status 3)."""


@dataclass
class Solution:
    """The largest ``var`` (B or S) whose peak fits under ``cap`` at the other sizes.

    ``value`` is 0 when even ``var = 1`` does not fit (``dominant`` then names the component
    that dominates at 1). ``memory_at`` / ``memory_next`` are M(value) and M(value + 1) in bytes,
    ``bound`` the real root sympy found (the inequality's supremum), ``limited_by`` a reason
    other than memory that capped the value (the model's own limits, e.g. S <= n_positions).
    """

    var: str
    value: int
    cap: int
    memory_at: int | None
    memory_next: int | None
    sizes: dict[str, int]
    bound: Any = None
    inequality: str = ""
    dominant: tuple[str, int] | None = None
    limited_by: str | None = None
    seconds: float = 0.0
    checked: bool = False
    adjusted: int = 0


@dataclass
class AccumulationPlan:
    """Gradient accumulation: B_global = micro_batch x accumulation_steps x devices.

    Memory is the peak per device; FLOPs are model FLOPs (forward + backward) per device per
    optimizer step. ``exact`` is False when no divisor of the per-device batch is as large as the
    largest micro-batch that fits (``note`` says what was done).
    """

    global_batch: int
    devices: int
    per_device_batch: int
    micro_batch: int
    accumulation_steps: int
    max_micro_batch: int
    exact: bool
    memory: int
    memory_without: int
    flops_per_device: int
    flops_total: int
    cap: int
    note: str = ""


_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def memory_model(an, precision: str | None = None, optimizer_name: str = "adamw",
                 impl: str = "default", device: str = "cuda") -> "MemoryModel":
    """The :class:`MemoryModel` of a traced step (cached per analysis and options).

    Args:
        an: a :class:`~symcost.analysis.Analysis`.
        precision: the policy (default: the precision ``an`` was traced with; another one
            changes the static bytes and the gradients, the activations stay the trace's).
        optimizer_name: one of :data:`OPTIMIZERS`.
        impl: how the optimizer step runs, one of :data:`IMPLS` (decides its temporaries);
            ``default`` is what ``torch.optim`` runs on ``device`` (:func:`default_impl`).
        device: the device the step runs on (only decides ``impl="default"``).

    Raises:
        SymcostError: unknown policy / optimizer / impl; a trace whose memory events differ
            between probes (then no formula exists).
    """
    pol = policy(precision or an.precision)
    opt = optimizer(optimizer_name)
    impl = resolve_impl(impl, device)
    per = _CACHE.setdefault(an, {})
    key = (pol.name, opt.name, impl)
    if key not in per:
        per[key] = MemoryModel(an, pol, opt, impl)
    return per[key]


@dataclass
class ScheduleEvent:
    """One storage allocated (``bytes`` > 0) or freed (< 0) during the traced step.

    ``bytes``: signed size as :data:`Terms` in ``MemorySchedule.gens`` (a free of a storage every
    pass of a repeated block allocates but that is freed once for all passes carries that
    repeat); ``alloc``: position of the allocation it frees (its own position if an
    allocation); ``grad``: a gradient (allocated by the backward, live at the end of the step);
    ``op``, ``module`` (folded: ``layers.{i}``), ``phase``: the op that allocated it, or the op
    before which it was freed.
    """

    bytes: Terms
    alloc: int
    grad: bool
    op: str
    module: str
    phase: str


@dataclass
class ScheduleUnit:
    """Events ``[start, stop)`` of the schedule, run ``repeat`` times (``"1"``, ``"L - 1"``: a
    formula string) in a row; valid only for ``L >= min_L``."""

    start: int
    stop: int
    repeat: str
    min_L: int
    label: str


@dataclass
class MemorySchedule:
    """The step's storage schedule as plain data, fitted at trace time (:func:`fit_schedule`).

    Everything the memory pass (and the checkpointing pass) needs without the probe
    recordings: the events in order with symbolic sizes, the fold over L as units, gradient
    element size, parameter sizes in the optimizer's order (elements and Adafactor's rows +
    columns), buffers and the step's inputs (bytes). ``error``: why the schedule has no formula
    (then only the peak is unavailable; static memory and activations still are).
    """

    gens: list[str]
    events: list[ScheduleEvent] = field(default_factory=list)
    units: list[ScheduleUnit] = field(default_factory=list)
    grad_itemsize: int = 4
    params: list[tuple[Terms, Terms]] = field(default_factory=list)
    buffers: Terms = field(default_factory=list)
    inputs: Terms = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        """JSON-ready data (:meth:`from_dict` reads it back)."""
        return {
            "gens": list(self.gens), "grad_itemsize": self.grad_itemsize, "error": self.error,
            "events": [[e.bytes, e.alloc, e.grad, e.op, e.module, e.phase] for e in self.events],
            "units": [[u.start, u.stop, u.repeat, u.min_L, u.label] for u in self.units],
            "params": [[a, b] for a, b in self.params], "buffers": self.buffers, "inputs": self.inputs,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "MemorySchedule":
        return cls(
            gens=list(d["gens"]), grad_itemsize=int(d["grad_itemsize"]), error=d.get("error"),
            events=[ScheduleEvent(*e) for e in d["events"]], units=[ScheduleUnit(*u) for u in d["units"]],
            params=[(a, b) for a, b in d["params"]], buffers=d["buffers"], inputs=d["inputs"],
        )


def _normalized(rec) -> list[tuple[int, int, int]]:
    """The step's memory events as ``(op index, signed bytes, position of the allocation)``.

    Frees that happen together (between the same two allocations, stamped with the same op) may
    come in an order that depends on addresses (e.g. autocast's cast cache is a hash map); they
    are sorted by the position of the allocation they free, which is the same at every size.
    Their order does not change any live set seen at an allocation.
    """
    n = rec.events_end if rec.events_end >= 0 else len(rec.events)
    pos: dict[int, int] = {}
    out: list[tuple[int, int, int]] = []
    run: list[tuple[int, int, int]] = []

    def flush():
        run.sort(key=lambda t: (t[0], t[2]))
        out.extend(run)
        run.clear()

    for e in rec.events[:n]:
        if e.nbytes > 0:
            flush()
            pos[e.storage] = len(out)
            out.append((e.index, e.nbytes, len(out)))
        elif e.storage in pos:
            run.append((e.index, e.nbytes, pos.pop(e.storage)))
        # else: a free whose allocation was not seen as one (a storage swapped under a tensor,
        # e.g. by set_); it cannot be placed, so it is left out (the peak errs high)
    flush()
    return out


def fit_schedule(recs, fitter, role, container: str | None, gens: tuple[str, ...], name: str) -> MemorySchedule:
    """Fit the probe recordings' memory events into a :class:`MemorySchedule` (at trace time).

    Args:
        recs: the probe recordings (``symcost.record.Recording``), aligned op by op.
        fitter: ``symcost.fit.Fitter`` over those probes.
        role: ``role(module, name=None) -> (keep, repeat, folded name)`` of the L = 2 fold.
        container: the blocks' container (None without repeated blocks).
        gens: the symbols of the trace, in order.
        name: the model's name (for messages).

    Each event's size is fitted across the probes (a polynomial); the schedule is cut into units
    folded over L (docs/memory.md, "Folding over L"). A schedule whose events change order with
    the sizes, or whose blocks interleave, gets ``error`` set instead of raising: FLOPs and
    activations do not need it.
    """
    from .modules import _layer_of, _rename_block

    alg = Algebra(gens)
    has_L = "L" in gens
    ref = recs[0]
    sched = MemorySchedule(gens=list(gens))
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
    for pname, (shape, _) in ref.params.items():
        numel = fitter(tuple(math.prod(r.params[pname][0]) for r in recs), f"size of {pname}")
        fac = sympy.Integer(0)
        if len(shape) >= 2:
            sig = tuple(math.prod(r.params[pname][0][:-1]) + math.prod(r.params[pname][0][:-2]) * r.params[pname][0][-1]
                        for r in recs)
            fac = fitter(sig, f"factored size of {pname}")
        sched.params.append((alg.terms(alg.from_expr(numel)), alg.terms(alg.from_expr(fac))))
    pdtypes = {d for _, d in ref.params.values() if d.is_floating_point}
    sched.grad_itemsize = max((d.itemsize for d in pdtypes), default=4)
    try:
        _fit_events(sched, alg, recs, fitter, role, container if has_L else None, name, _layer_of, _rename_block)
    except SymcostError as e:
        sched.events, sched.units, sched.error = [], [], str(e)
    return sched


def _fit_events(sched, alg, recs, fitter, role, container, name, _layer_of, _rename_block) -> None:
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
        return op, _layer_of(op.module, container)

    info = [where(k) for k in range(n)]
    units: list[tuple[int, int, Any, int, str]] = []  # (start, stop, repeat, min_L, label)
    siblings: list[tuple[range, range]] = []
    if container is not None:
        spans = {}
        for k in range(n):
            op, layer = info[k]
            if layer is None:
                continue
            key = (op.phase if op.phase == "forward" else "backward", layer)
            a, b = spans.get(key, (k, k))
            spans[key] = (min(a, k), max(b, k))
        need = [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]
        ok = all(k in spans for k in need) and len(spans) == 4
        if ok:
            f0, f1, b1, b0 = (spans[k] for k in need)
            ok = f0[1] < f1[0] and f1[1] < b1[0] and b1[1] < b0[0]
        if not ok:
            raise SymcostError(
                f"{name}: the memory events of the blocks of {container} interleave; the peak "
                "cannot be folded over L"
            )
        pre = f"{container}." if container else ""
        rep0, rep1 = role(f"{pre}0")[1], role(f"{pre}1")[1]
        special = 0 if (rep0 == 1 and rep1 != 1) else 1 if (rep1 == 1 and rep0 != 1) else None
        F0, F1 = range(f0[0], f0[1] + 1), range(f1[0], f1[1] + 1)
        B1, B0 = range(b1[0], b1[1] + 1), range(b0[0], b0[1] + 1)
        if special == 1:  # the last block differs: blocks 0..L-2 are like block 0
            siblings = [(F0, F1), (B0, B1)]
            units = [(0, f0[0], 1, 1, "forward, before the blocks"),
                     (f0[0], f1[0], "L - 1", 2, "forward, block"),
                     (f1[0], f1[1] + 1, 1, 1, "forward, last block"),
                     (f1[1] + 1, b1[0], 1, 1, "end of forward / start of backward"),
                     (b1[0], b1[1] + 1, 1, 1, "backward, last block"),
                     (b1[1] + 1, b0[1] + 1, "L - 1", 2, "backward, block"),
                     (b0[1] + 1, n, 1, 1, "backward, after the blocks")]
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
    for u, (a, b, _, _, _) in enumerate(units):
        for k in range(a, b):
            unit_of[k] = u
    freed_in = {events[k][2]: unit_of[k] for k in range(n) if events[k][1] < 0}
    sibling_of: dict[int, int] = {}

    def key(k):  # what an allocation is, wherever its block is
        op, _ = info[k]
        return op.name, _rename_block(op.module, container, "#"), tuple(sorted(evpolys[k].items()))

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
                evpolys[k] = evpolys[k] * alg.from_expr(L - 1)
    for k in range(n):
        op, _ = info[k]
        keep, _, module = role(op.module)
        if not keep:  # a probe block that stands for the generic one: name it as folded
            module = _rename_block(op.module, container, "{i}")
        sched.events.append(ScheduleEvent(
            alg.terms(evpolys[k]), events[k][2], k in grad_events, op.name.removeprefix("aten."),
            module, op.phase))
    sched.units = [ScheduleUnit(a, b, str(rep), mL, label) for a, b, rep, mL, label in units]


class MemoryModel:
    """Training memory of a traced step under a precision policy and an optimizer.

    Attributes (sympy polynomials in the model's symbols, bytes):
        params: ``policy.param * P`` (P: all parameters, tied ones once).
        grads: ``policy.grad * P``.
        optimizer: the optimizer's state: ``full * policy.state * P`` plus, for Adafactor,
            ``policy.state * sum(rows + cols)`` over tensors of >= 2 dims and ``numel`` over
            vectors (the shapes of the trace), plus 4 bytes per parameter tensor for a ``step``.
        master_weights: ``policy.master * P``.
        buffers: the model's buffers (their traced dtypes, shared storages once).
        inputs: the step's input tensors (e.g. token ids and labels, int64).
        activations: bytes autograd saves for backward (``Analysis.saved``, folded over L).
        activations_per_layer: those of one generic block (None without repeated blocks).
        static: params + optimizer + master_weights + buffers + inputs (live all step).
        candidates: the :class:`Candidate` live sets (bytes on top of ``static``) of a normal
            step; ``candidates_accum`` those of an accumulation micro-step (gradients live from
            the start, each new gradient a transient).
        schedule: the analysis' :class:`MemorySchedule` (all the pass reads besides the
            parameter shapes and saved tensors); ``alg`` the polynomial ring of its candidates.
        impl, device: the optimizer implementation assumed (``impl="default"`` resolved by
            :func:`default_impl` for ``device``).
    """

    def __init__(self, an, pol: Policy, opt: Optimizer, impl: str = "default", device: str = "cuda"):
        self.an, self.policy, self.opt = an, pol, opt
        self.impl, self.device = resolve_impl(impl, device), device
        self.gens = tuple(an.symbols)
        self._syms = [SYMS[s] for s in self.gens]
        self.schedule: MemorySchedule = an.schedule
        if self.schedule is None:
            raise SymcostError(f"{an.model}: this analysis has no memory schedule (trace it with symcost.trace)")
        self.has_L = "L" in self.gens
        P = an.params
        self.P = P
        self.params = sympy.expand(pol.param * P)
        self.grads = sympy.expand(pol.grad * P)
        self.master_weights = sympy.expand(pol.master * P)
        self.n_tensors = sympy.expand(sympy.Add(*[rep for _, (_, _, rep) in an.param_shapes.items()]))
        self.optimizer = self._optimizer_state()
        self.buffers, self.inputs = self._buffers_inputs()
        self.activations = sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
        per_layer = [nb for _, nb, _, rep in an.saved if rep != 1 and sympy.sympify(rep).has(SYMS["L"])]
        self.activations_per_layer = sympy.expand(sympy.Add(*per_layer)) if per_layer else None
        self.static = sympy.expand(self.params + self.optimizer + self.master_weights + self.buffers
                                   + self.inputs)
        for domain in (ZZ, QQ):  # integer coefficients (fast) unless a size needs fractions
            self.alg = Algebra(self.gens, domain)
            try:
                self._load_schedule()
                break
            except NotIntegral:
                continue

    # -- static ----------------------------------------------------------------------------------
    def _optimizer_state(self) -> sympy.Expr:
        an, pol, opt = self.an, self.policy, self.opt
        total = opt.full * pol.state * self.P
        if opt.factored:
            fac = []
            for _, (shape, _, rep) in an.param_shapes.items():
                if len(shape) >= 2:
                    rows = sympy.Mul(*shape[:-1])
                    cols = sympy.Mul(*shape[:-2]) * shape[-1]
                    fac.append(rep * (rows + cols))
                else:
                    fac.append(rep * sympy.Mul(*shape))
            total += pol.state * sympy.Add(*fac)
        if opt.step:
            total += STEP_BYTES * self.n_tensors
        return sympy.expand(total)

    def _buffers_inputs(self) -> tuple[sympy.Expr, sympy.Expr]:
        sched = self.schedule
        return terms_expr(sched.gens, sched.buffers), terms_expr(sched.gens, sched.inputs)

    def bytes_per_param(self) -> int:
        """params + grads + full-size optimizer state + master weights, bytes per parameter
        (the "12" of 12P for bf16-mixed Adam). Adafactor's factored state and Adam's 4-byte step
        counters are not per parameter and are listed apart."""
        p = self.policy
        return p.param + p.grad + self.opt.full * p.state + p.master

    # -- polynomials -------------------------------------------------------------------------------
    def _poly(self, expr):
        """A sympy polynomial in the symbols as an element of the ring ``self.alg.R``."""
        return self.alg.from_expr(expr)

    def _expr(self, p) -> sympy.Expr:
        return self.alg.expr(p)

    # -- schedule ----------------------------------------------------------------------------------
    def _load_schedule(self) -> None:
        """The trace's :class:`MemorySchedule` as ring elements, gradients in the policy's bytes."""
        sched, alg = self.schedule, self.alg
        if sched.error:
            raise SymcostError(sched.error)
        if tuple(sched.gens) != self.gens:
            raise SymcostError(f"{self.an.model}: the memory schedule's symbols {sched.gens} are not the "
                               f"trace's {list(self.gens)}")
        grad_ratio = Fraction(self.policy.grad, sched.grad_itemsize)
        cache: dict = {}
        evpolys = []
        for e in sched.events:
            key = (tuple(map(tuple, e.bytes)), e.grad)
            p = cache.get(key)
            if p is None:
                p = alg.from_terms(e.bytes)
                if e.grad and grad_ratio != 1:
                    p = alg.scale(p, grad_ratio)
                cache[key] = p
            evpolys.append(p)
        self._evpolys = evpolys
        self.grad_events = {k for k, e in enumerate(sched.events) if e.grad}
        self.units = [(range(u.start, u.stop), alg.from_expr(parse_formula(u.repeat)), u.min_L, u.label)
                      for u in sched.units]
        self._poly(self.static)  # (in the same ring: raises NotIntegral here, not in solve)
        self.candidates = self._candidates(accumulate=False)
        self.candidates_accum = self._candidates(accumulate=True)

    def _label(self, k: int, unit_label: str) -> str:
        e = self.schedule.events[k]
        return f"{unit_label}: {e.module or '(top level)'} {e.op}"

    def _candidates(self, accumulate: bool) -> list[Candidate]:
        """Live sets at each allocation along the folded schedule (+ the optimizer step).

        Within one pass of a unit the live set after each allocation is a prefix sum of the
        events; its shift (x -> x + 1, for the dominance test) is the same prefix sum of the
        events' shifts, so both are accumulated together.
        """
        alg = self.alg
        R = alg.R
        base = self._poly(self.grads) if accumulate else R.zero
        out: list[Candidate] = []
        shifted = {}

        def sh(k):
            s = shifted.get(k)
            if s is None:
                s = shifted[k] = alg.shift(self._evpolys[k])
            return s

        for ids, rep, min_L, ulabel in self.units:
            # prefix sums within one pass of the unit; only allocations can raise the maximum
            local: list[Candidate] = []
            pre, pre_s = R.zero, R.zero
            for k in ids:
                p = self._evpolys[k]
                if accumulate and k in self.grad_events:
                    # a new gradient, added in place, then freed
                    local.append(Candidate(pre + p, pre_s + sh(k), 1, str(k)))
                    continue
                pre, pre_s = pre + p, pre_s + sh(k)
                if self.schedule.events[k].alloc == k:
                    local.append(Candidate(pre, pre_s, 1, str(k)))
            delta = pre
            locs = _pareto(local)
            if rep == 1:
                offsets = [(base, 1)]
            else:
                s = _sign(alg, delta)
                offsets = []
                if s >= 0:  # the last pass can be the highest: base + (rep - 1)·delta
                    offsets.append((base + (rep - 1) * delta, min_L))
                if s <= 0:  # the first pass can be the highest
                    offsets.append((base, min_L))
            for off, mL in offsets:
                off_s = alg.shift(off)
                for c in locs:
                    out.append(Candidate(off + c.poly, off_s + c.shifted, mL, self._label(int(c.label), ulabel)))
            base = base + rep * delta
        # optimizer step: gradients (and whatever else is live) plus its temporaries
        base_s = alg.shift(base)
        for t, what in self._optimizer_transients():
            out.append(Candidate(base + t, base_s + alg.shift(t), 1, f"optimizer step ({what})"))
        if not out:
            out.append(Candidate(R.zero, R.zero, 1, "step"))
        self.end_live = base
        return _pareto(out)

    def _param_numels(self) -> list[tuple[Any, Any]]:
        """(elements, Adafactor's rows + columns) of the parameter tensors in the optimizer's
        order (that of the L = 2 trace, which has every kind of neighbour), ring elements."""
        return [(self.alg.from_terms(a), self.alg.from_terms(b)) for a, b in self.schedule.params]

    def _optimizer_transients(self) -> list[tuple[Any, str]]:
        """Temporaries of one optimizer step (bytes), modelled on torch.optim 2.x's code.

        Adam/AdamW: foreach ``exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)`` (a state-sized copy
        of every tensor); for-loop ``denom = (exp_avg_sq.sqrt() / bc).add_(eps)`` (two
        temporaries of the tensor while the previous tensor's ``denom`` is still referenced).
        Adafactor: foreach ``var_estimates`` of every tensor; for-loop ``var_estimate`` (row_var @
        col_var, plus row and column means; ``grad * grad`` and a clone for vectors) while the
        previous tensor's is still referenced. SGD updates in place; fused kernels keep none.
        """
        opt, st, impl, alg = self.opt, self.policy.state, self.impl, self.alg
        if impl == "fused" or opt.name in ("sgd", "sgd-nomomentum"):
            return []
        if impl == "foreach":
            return [(self._poly(self.P) * st, "foreach temporaries of all tensors")]
        out = []
        prev = alg.R.zero
        for numel, fac in self._param_numels():
            if opt.name == "adafactor":
                cur = numel + fac if fac else numel * 2
            else:
                cur = numel * 2
            q = (prev + cur) * st
            out.append(Candidate(q, alg.shift(q), 1, "for-loop temporaries"))
            prev = cur if opt.name == "adafactor" else numel
        return [(c.poly, c.label) for c in _pareto(out)]

    # -- evaluation ------------------------------------------------------------------------------------
    def _values(self, env: Mapping) -> tuple:
        return tuple(int(env[s]) for s in self._syms) if self._syms else (1,)

    def _env(self, sizes: Mapping[str, int]) -> dict:
        return self.an.bind(**dict(sizes))

    def full_values(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """Every value a check of the model needs, by name: the model's defaults, ``sizes`` over
        them, the pinned symbols (B = 1, S = 1) and the tied ones (K = H). No check raises."""
        an = self.an
        vals = {**an.spec.defaults, **dict(getattr(an, "pinned", {}) or {}), **{k: int(v) for k, v in sizes.items()}}
        vals.update({a: vals[b] for a, b in an.spec.tied.items() if b in vals})
        return vals

    def _cands(self, L: int | None, accumulate: bool) -> list[Candidate]:
        cs = self.candidates_accum + self.candidates if accumulate else self.candidates
        return [c for c in cs if L is None or c.min_L <= L]

    def peak(self, accumulate: bool = False, **sizes: int) -> int:
        """Peak bytes of a steady-state step at ``sizes`` (others at the model's defaults).

        ``accumulate=True``: a gradient-accumulation micro-step (gradients live from the start).

        Raises:
            SymcostError: bad sizes (see ``Analysis.bind``).
        """
        env = self._env(sizes)
        vals = self._values(env)
        L = env.get(SYMS["L"])
        dyn = max(_peval(c.poly, vals) for c in self._cands(L, accumulate))
        return int(sympy.sympify(self.static).xreplace(env)) + int(dyn)

    def peak_where(self, **sizes: int) -> str:
        """Where in the schedule the peak is reached at ``sizes`` (a label)."""
        env = self._env(sizes)
        vals = self._values(env)
        L = env.get(SYMS["L"])
        return max(self._cands(L, False), key=lambda c: _peval(c.poly, vals)).label

    def peak_terms(self, accumulate: bool = False) -> list[tuple[sympy.Expr, int, str]]:
        """The live sets that can be the largest at some sizes: ``(bytes on top of static,
        valid for L >= min_L, where in the step)``; the peak is static + the largest valid one."""
        return [(self._expr(c.poly), c.min_L, c.label) for c in _pareto(self._cands(None, accumulate))]

    def peak_expr(self, accumulate: bool = False) -> sympy.Expr:
        """The peak as a formula: static + the live set's polynomial, or ``Max`` of those that
        can win at some sizes; ``Piecewise`` on L where some need two blocks."""
        cs = self._cands(None, accumulate)

        def mx(cands):
            exprs = [self._expr(c.poly) for c in _pareto(cands)]
            inner = exprs[0] if len(exprs) == 1 else sympy.Max(*exprs, evaluate=False)
            return sympy.Add(self.static, inner, evaluate=False) if self.static != 0 else inner

        if self.has_L and any(c.min_L > 1 for c in cs):
            one = [c for c in cs if c.min_L <= 1]
            return sympy.Piecewise((mx(cs), SYMS["L"] >= 2), (mx(one), True))
        return mx(cs)

    def components(self, **sizes: int) -> dict[str, int]:
        """Every component in bytes at ``sizes`` (JSON names: params, grads, optimizer,
        master_weights, buffers, inputs, activations, peak)."""
        env = self._env(sizes)
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        out = {k: ev(getattr(self, k)) for k in
               ("params", "grads", "optimizer", "master_weights", "buffers", "inputs", "activations")}
        if self.activations_per_layer is not None:
            out["activations_per_layer"] = ev(self.activations_per_layer)
        out["peak"] = self.peak(**sizes)
        return out

    # -- solving -------------------------------------------------------------------------------------
    def solve(self, cap: int | str, var: str = "B", accumulate: bool = False, **sizes: int) -> Solution:
        """Largest integer ``var`` (``B`` or ``S``) with peak <= ``cap`` at the other ``sizes``.

        Each candidate live set, with the other sizes substituted, is a polynomial in ``var``
        (non-decreasing: a sum of storage sizes); sympy solves ``static + c(var) <= cap`` for each
        that can win (``solve_univariate_inequality``) and the answer is the floor of the smallest
        supremum. Then M(value) <= cap < M(value + 1) is checked by exact integer evaluation.

        Raises:
            SymcostError: ``var`` not a symbol of the model, or set in ``sizes``; bad sizes/cap.
        """
        t0 = time.perf_counter()
        cap = parse_memory(cap)
        if var not in self.gens:
            raise SymcostError(f"cannot solve for {var!r}: not a symbol of {self.an.model} "
                               f"(symbols: {', '.join(self.gens)})")
        sizes = dict(sizes)
        if var in sizes:
            raise SymcostError(f"--set {var}=... conflicts with solving for {var}")
        env = self._env({**sizes, var: 1})
        fixed = {s: env[s] for s in self._syms if str(s) != var}
        L = fixed.get(SYMS["L"])
        X = sympy.Symbol(var, positive=True)
        vi = self.gens.index(var)

        Ru, xu = _ring([X], QQ)
        vals = [int(fixed[sy]) if j != vi else None for j, sy in enumerate(self._syms)]

        def univariate(p):
            """``p`` with the other sizes substituted: a polynomial in ``var`` (ring ``Ru``)."""
            out: dict = {}
            for m, c in p.items():
                t = c
                for j, e in enumerate(m):
                    if j != vi and e:
                        t *= vals[j] ** e
                out[(m[vi],)] = out.get((m[vi],), 0) + t
            return Ru.from_dict({k: v for k, v in out.items() if v})

        static_u = univariate(self._poly(self.static))
        cands = [univariate(c.poly) + static_u for c in self._cands(L, accumulate)]
        # univariate dominance on var >= 1
        sh = [(u.compose(xu, xu + 1), u) for u in cands]
        kept = []
        for s_, u in sh:
            if any(_geq(k[0], s_) for k in kept):
                continue
            kept = [k for k in kept if not _geq(s_, k[0])]
            kept.append((s_, u))

        def M(x: int) -> int:
            return int(max(_peval(u, (x,)) for u in cands))

        bounds = []
        ineqs = []
        for _, u in kept:
            expr = u.as_expr()
            ineqs.append(expr)
            if not expr.has(X):
                bounds.append(sympy.oo if expr <= cap else sympy.Integer(0))
                continue
            bounds.append(_feasible_sup(expr - cap, X))
        sup = min(bounds, key=lambda b: float("inf") if b is sympy.oo else float(b)) if bounds else sympy.oo
        shown = " and ".join(f"{sympy.sstr(e)} <= {cap}" for e in ineqs[:3]) + (" ..." if len(ineqs) > 3 else "")
        limited_by = None
        if sup is sympy.oo:
            raise SymcostError(f"the peak memory of {self.an.model} does not grow with {var}; no largest {var}")
        value = int(sympy.floor(sup))
        # exact integer check (the floor of an exact root needs no mending; if it ever did, the
        # mending is counted in Solution.adjusted)
        adjusted = 0
        while value >= 1 and M(value) > cap:
            value -= 1
            adjusted += 1
        while M(value + 1) <= cap:
            value += 1
            adjusted += 1
        # the model's own limits (e.g. S <= n_positions), checked on the full set of values:
        # pinned (B = 1), defaulted and tied symbols included
        check = self.an.spec.check
        def valid(x):
            return check(self.full_values({**{str(s): int(v) for s, v in fixed.items()}, var: x}))
        if value >= 1 and valid(value):
            lo, hi = 0, value
            why = valid(value)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if valid(mid) is None:
                    lo = mid
                else:
                    hi = mid - 1
            limited_by = f"{why}; memory alone would allow {var} = {value}"
            value = lo
        sol = Solution(var=var, value=value, cap=cap,
                       memory_at=M(value) if value >= 1 else None,
                       memory_next=M(value + 1),
                       sizes={**dict(getattr(self.an, "pinned", {}) or {}), **{str(s): int(v) for s, v in fixed.items()}},
                       bound=sup, inequality=shown, limited_by=limited_by, adjusted=adjusted)
        sol.checked = (value == 0 or sol.memory_at <= cap) and (limited_by is not None or sol.memory_next > cap)
        if value == 0:
            sol.dominant = self.dominant(**{**{str(s): int(v) for s, v in fixed.items()}, var: 1})
        sol.seconds = time.perf_counter() - t0
        return sol

    def dominant(self, **sizes: int) -> tuple[str, int]:
        """The largest component at ``sizes``: (name, bytes)."""
        comp = self.components(**sizes)
        names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
                 "master_weights": "master weights", "activations": "activations"}
        name = max(names, key=lambda k: comp[k])
        return names[name], comp[name]

    def no_fit_reason(self, sol: Solution, **sizes: int) -> str | None:
        """Why no ``sol.var`` fits under ``sol.cap`` (None when one does), with the numbers in
        bytes: the model's own limit (``sol.limited_by``); else the static memory at ``var = 1``
        (parameters + optimizer state + master weights + buffers + inputs, as :attr:`static`)
        when it alone exceeds the cap; else the peak at ``var = 1``, static + its largest live
        set (activations, gradients, temporaries). ``sizes``: the other sizes, as given to
        :meth:`solve`.
        """
        if sol.value >= 1:
            return None
        v = sol.var
        if sol.limited_by:
            return f"no {v} >= 1 is valid: {sol.limited_by}"
        at1 = {**{k: x for k, x in sizes.items() if k != v}, v: 1}
        comp = self.components(**at1)
        parts = {"parameters": comp["params"], "optimizer state": comp["optimizer"],
                 "master weights": comp["master_weights"], "buffers": comp["buffers"], "inputs": comp["inputs"]}
        static = sum(parts.values())
        cap = f"the cap {sol.cap:,} bytes ({binary(sol.cap)})"
        if static > sol.cap:
            shown = " + ".join(f"{name} {b:,}" for name, b in parts.items() if b or name == "parameters")
            return (f"the static memory alone exceeds {cap}: {shown} = {static:,} bytes ({binary(static)}) "
                    f"at {v} = 1")
        peak = comp["peak"]
        name, nbytes = self.dominant(**at1)
        return (f"the peak at {v} = 1, {peak:,} bytes ({binary(peak)}), exceeds {cap}: static memory "
                f"{static:,} bytes + the largest live set {peak - static:,} bytes (activations, gradients, "
                f"temporaries); {dominant_text(name, nbytes, sol.cap)}")

    def plan_accumulation(self, global_batch: int, devices: int, cap: int | str,
                          **sizes: int) -> AccumulationPlan:
        """Micro-batch and accumulation steps K for ``global_batch`` over ``devices``.

        B_global = B_micro x K x N_devices (conventions.md), with B_micro the largest divisor of
        the per-device batch whose accumulation micro-step fits under ``cap`` (K = 1 if the whole
        per-device batch fits without accumulation).

        Raises:
            SymcostError: non-positive numbers, ``global_batch`` not divisible by ``devices``,
                B set in ``sizes``, or not even B = 1 fits (the message names the dominant part).
        """
        cap = parse_memory(cap)
        for what, v in (("global batch", global_batch), ("devices", devices)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SymcostError(f"{what} must be a positive integer, got {v!r}")
        if global_batch % devices:
            raise SymcostError(
                f"global batch {global_batch} is not divisible by {devices} devices "
                f"(B_global = B_micro x K x N_devices); use a multiple of {devices}"
            )
        b = global_batch // devices
        sizes = dict(sizes)
        sizes.pop("B", None)
        full = self.peak(B=b, **sizes)
        F = lambda B: int(sympy.sympify(self.an.flops("train")).xreplace(self._env({**sizes, "B": B})))  # noqa: E731
        if full <= cap:
            return AccumulationPlan(global_batch, devices, b, b, 1, b, True, full, full, F(b),
                                    F(b) * devices, cap, "the per-device batch fits without accumulation")
        sol = self.solve(cap, "B", accumulate=True, **sizes)
        if sol.value < 1:
            name, nbytes = sol.dominant
            raise NothingFits(
                f"not even a micro-batch of 1 fits under {gib(cap)} (peak {gib(sol.memory_next)}); "
                f"{dominant_text(name, nbytes, cap)}"
            )
        bmax = min(sol.value, b)
        micro = max(d for d in range(1, bmax + 1) if b % d == 0)
        K = b // micro
        exact = micro == bmax
        note = ""
        if not exact:
            k2 = -(-b // bmax)
            note = (f"no exact split of the per-device batch {b} uses the largest micro-batch that fits "
                    f"({bmax}); using its largest divisor B_micro = {micro} (K = {K}); the nearest inexact "
                    f"split is B_micro × K × N_devices = {bmax} × {k2} × {devices} = {bmax * k2 * devices}")
        mem = self.peak(accumulate=True, B=micro, **sizes)
        return AccumulationPlan(global_batch, devices, b, micro, K, sol.value, exact, mem, full,
                                K * F(micro), K * F(micro) * devices, cap, note)


# --------------------------------------------------------------------------------------------
# report section
# --------------------------------------------------------------------------------------------


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
    ``max_batch`` is 0: :meth:`MemoryModel.no_fit_reason`; None otherwise).

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
        "buffers": "buffers",
        "inputs": "inputs",
        "activations": "activations (saved for backward)",
        "activations_per_layer": "  per layer (one block)",
        "peak": "peak (steady-state step)",
    }
    formulas = {
        "params": mm.params, "grads": mm.grads, "optimizer": mm.optimizer,
        "master_weights": mm.master_weights, "buffers": mm.buffers, "inputs": mm.inputs,
        "activations": mm.activations, "activations_per_layer": mm.activations_per_layer,
        "peak": peak_f,
    }
    live_sets = _pareto(mm._cands(None, False))  # what peak_terms() lists, as ring elements
    env = mm._env(vsizes)
    static_v = int(mm.static.xreplace(env))
    L = env.get(SYMS["L"])
    vals = mm._values(env)
    win = max((c for c in live_sets if L is None or c.min_L <= L), key=lambda c: _peval(c.poly, vals))
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
            rows.append((STATIC_LABEL, _Text(str, mm.static), gib(static_v)))
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
    if opt.step:
        lines.append(f"  + {STEP_BYTES} bytes of {opt.torch} step counter per parameter tensor × {mm.n_tensors} tensors")
    if opt.factored:
        lines.append("  + Adafactor's factored second moment (rows + columns per matrix, full vectors), in the optimizer row")
    at = "at the sizes above" if sizes else "at the model's defaults"
    keys = ("params", "grads", "optimizer") + (("master_weights",) if pol.master else ())
    lines.append(f"{named} {at}: {' + '.join(f'{comp[k]:,}' for k in keys)} = {sum(comp[k] for k in keys):,} bytes "
                 f"({gib(sum(comp[k] for k in keys))}); the static row leaves the gradients out (the backward "
                 "allocates them: the peak counts them in its live sets)")
    where = mm.peak_where(**vsizes)
    lines.append(f"peak {at}: {gib(comp['peak'])}, reached at {where}")
    if "B" not in mm.gens:
        sol = None
        lines.append(f"B is pinned to {an.pinned.get('B', 1)} in this trace: run max-batch without --set B to solve for it")
    else:
        sol = mm.solve(capb, "B", **{s: v for s, v in vsizes.items() if s != "B"})
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
    js["optimizer_name"] = opt.name
    js["optimizer_impl"] = mm.impl
    js["device"] = device
    return {
        "title": f"Memory: precision {pol.name}, optimizer {opt.name} ({mm.impl}"
                 + (f", torch.optim's default on {device}" if impl == "default" else "") + "), steady-state step "
                 f"(values {at})",
        "rows": rows,
        "lines": lines,
        "json": js,
    }

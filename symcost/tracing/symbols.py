"""The symbols of the formulas and the probe values each takes.

The conventions' alphabet (B, S, H, D, L, V, F, K, M, E, R, T and the mesh sizes; N is the
conventions' token count) is fixed; any other model declares its own sizes under its own names
(``C``, ``IMG``, ``N_state``, ``L_enc``: ``ModelSpec.symbols``), and :func:`declare` makes them
symbols here: a sympy symbol (positive integer, as the canonical ones), a small probe pool, a base
value. Declared names live for the process (a cached analysis declares its own when read back:
``symcost.graph.serialize``). Formulas of the JSON are read back by :func:`parse_formula`.
"""
from __future__ import annotations

import keyword
import re
import zlib
from typing import TYPE_CHECKING, Iterable

import sympy

from symcost.errors import SymcostError

if TYPE_CHECKING:  # pragma: no cover
    from symcost.frontends.spec import ModelSpec

#: the conventions' symbols (shared/conventions.md), mesh sizes included
CANONICAL = ("B", "S", "H", "D", "L", "V", "F", "K", "M", "E", "R", "N", "T", "DP", "TP", "EP", "CP")

SYMS = {name: sympy.Symbol(name, positive=True, integer=True) for name in CANONICAL}

#: the mesh sizes among the symbols: each divides a size (a shard, a rank's share) or multiplies
#: one, at most once (``fit.LINEAR_ONLY``); probes draw them from their own pools
MESH_SYMBOLS = ("DP", "TP", "EP", "CP")

# Base probe values and one alternate per symbol. L is fixed while fitting (layers fold).
BASE = {"B": 3, "S": 7, "H": 6, "D": 8, "L": 2, "V": 53, "F": 40, "K": 2, "M": 36, "E": 7, "R": 2, "T": 13, "DP": 2, "TP": 2, "EP": 2, "CP": 2}
ALTS = {
    "B": (5, 4, 2),
    "S": (11, 9, 5),
    "H": (10, 8, 4),
    "D": (12, 10, 6),
    "V": (61, 47, 59),
    "F": (44, 52, 36),
    "K": (3, 1),
    "M": (44, 28, 52),
    "E": (7, 4, 6),
    "R": (3, 4),
    "T": (17, 10, 6),
    "DP": (4, 3, 8, 6),
    "TP": (4, 8),
    "EP": (4, 8),
    "CP": (4, 8),
}
POOLS = {
    "B": range(2, 10),
    "S": range(5, 25),
    "H": range(2, 13),
    "D": range(4, 17, 2),
    "V": range(31, 98),
    "F": range(20, 73),
    "K": range(2, 9),
    "M": range(20, 65, 4),
    "E": range(3, 10),
    "R": range(2, 5),
    "T": range(5, 30),
    "DP": range(2, 9),
    "TP": (2, 4, 8),  # powers of two: the sizes TP splits are kept multiples of 8 (tensor_parallel)
    "EP": (2, 4, 8),  # powers of two: E is kept a multiple of 8 (expert_parallel)
    "CP": (2, 4, 8),  # powers of two: S is kept a multiple of 16 = 2·8 (context_parallel)
}

#: probe values of a model's own size: small, never 0 or 1; a size the model keeps a multiple of
#: n (``Constraint("multiple", a, n)``) is probed at multiples of n (``ModelSpec.moduli``), one
#: with a lower bound above the pool around the requested value (``fit.probe_pool``)
OWN_POOL = range(2, 25)
#: base values of own sizes, one chosen by the name (so two sizes rarely share a base value)
OWN_BASES = (5, 6, 7, 9, 10, 11)

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model's own size symbol, or None: a Python identifier starting
    with a letter, no keyword, not N (the conventions' token count) nor a mesh size (set by
    ``--dp``, ``--tp``, ...), nor a name sympy reads as its own (``I``, ``O``, ``Q``, ``pi``,
    ``floor``: a formula would not read back)."""
    if not isinstance(name, str) or not _NAME.match(name) or keyword.iskeyword(name):
        return f"{name!r} is not a symbol name (a letter, then letters, digits or '_')"
    if name == "N" or name in MESH_SYMBOLS:
        return (f"{name!r} is reserved (N: the tokens of 6·N·P; DP, TP, EP, CP: mesh sizes, set by "
                "--dp/--tp/--ep/--cp); name the size otherwise")
    if name not in SYMS and hasattr(sympy, name):
        return f"{name!r} is a name sympy reads as its own (formulas would not read back); name the size otherwise"
    return None


def declare(names: Iterable[str]) -> None:
    """Make each of ``names`` that is not yet one a symbol: a positive-integer sympy symbol in
    :data:`SYMS`, probe values in :data:`POOLS` (:data:`OWN_POOL`) and :data:`BASE`.

    Raises:
        SymcostError: a name :func:`name_problem` refuses (one line saying why).
    """
    for name in names:
        if name in SYMS:
            continue
        why = name_problem(name)
        if why:
            raise SymcostError(why)
        SYMS[name] = sympy.Symbol(name, positive=True, integer=True)
        POOLS[name] = OWN_POOL
        BASE[name] = OWN_BASES[zlib.crc32(name.encode()) % len(OWN_BASES)]


def parse_formula(text: str) -> sympy.Expr:
    """Parse a formula string of symcost's JSON into a sympy expression in symcost's symbols.

    Plain ``sympy.sympify("B*S")`` reads ``S`` as ``sympy.S`` and ``N`` as ``sympy.N``; this
    passes the canonical symbols, and every declared own size (:func:`declare`), as locals. Only
    use it on symcost's own output: sympify evaluates code.
    """
    return sympy.sympify(text, locals=dict(SYMS))


def own_sizes(spec: "ModelSpec") -> "ModelSpec":
    """``spec`` with its own sizes (symbols outside the conventions' alphabet: ``C``, ``IMG``)
    declared as symbols (:func:`symcost.tracing.symbols.declare`), and each that a constraint
    keeps a multiple of n (``Constraint("multiple", IMG, 8)``) probed at multiples of n
    (``moduli``), so its probes have values enough to fit (multiples of 8 in 2..24 are two).

    Raises:
        SymcostError: an own size's name cannot be a symbol (one line saying why).
    """
    import dataclasses

    own = spec.own_symbols
    declare(own)
    moduli = dict(spec.moduli)
    for c in spec.constraints:
        if c.kind == "multiple" and c.a in own and isinstance(c.b, int) and c.b > 1 and c.a not in moduli:
            moduli[c.a] = c.b
    return spec if moduli == spec.moduli else dataclasses.replace(spec, moduli=moduli)

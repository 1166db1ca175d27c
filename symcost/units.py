"""Sizes in bytes as people write and read them (conventions: binary units; "80GiB" is
80·2^30 bytes, "80GB" 80·10^9). Used by the passes (memory caps) and by every renderer.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

from symcost.errors import SymcostError

GiB = 2**30

_UNITS = {
    "B": 1,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
#: A number without a unit below this is refused as a memory cap: "--memory 80" means 80 bytes,
#: which no training step fits in, so it is almost surely 80GiB without its unit. Whole bytes from
#: 1 MiB up (``85899345920``) are read as bytes; below it, write the unit (``100B``).
BARE_MIN = 2**20
_CAP_RE = re.compile(r"^\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_memory(text: str | int) -> int:
    """A memory cap in bytes: ``"85899345920"``, ``"80GiB"``, ``"80GB"``, ``"1.5 TiB"``, ``"512B"``.

    Units: KiB, MiB, GiB, TiB are binary (2**10 ...), KB, MB, GB, TB decimal (10**3 ...), B bytes;
    unit letters are case-insensitive (conventions.md: "80GiB" is 80·2^30 bytes, "80GB"
    80·10^9). A fractional result is rounded down to whole bytes. Text without a unit is bytes
    and must be at least :data:`BARE_MIN` (1 MiB): ``"80"`` is refused with a hint to write
    ``80GiB`` (or ``80B`` for bytes). An ``int`` is bytes as it is (the Python API).

    Raises:
        SymcostError: an unknown unit (``80XB``), a number without a unit that is not an
            integer or is below 1 MiB, a negative or zero cap, or anything else that is not a size.
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
    if not unit and value < BARE_MIN:
        raise SymcostError(f"memory cap {s.strip()!r} has no unit, so it is {num} bytes (less than 1 MiB); "
                           f"write the unit: {num}GiB (binary), {num}GB (decimal) or {num}B (bytes)")
    out = math.floor(value)
    if out <= 0:
        raise SymcostError(f"memory cap {s.strip()!r} is less than one byte")
    return out


def dominant_text(name: str, nbytes: int, cap: int) -> str:
    """Name what dominates: 'optimizer state alone is 84.000 GiB' when it exceeds ``cap``, else
    'the largest part is ...' (in the largest binary unit it reaches, :func:`binary`)."""
    if nbytes > cap:  # (a plural name takes "are": "activations alone are ...")
        return f"{name} alone {'are' if name.endswith('s') else 'is'} {binary(nbytes)}"
    return f"the largest part is {name}, {binary(nbytes)}"


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

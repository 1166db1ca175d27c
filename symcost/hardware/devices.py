"""Devices: peak FLOP/s per precision, memory bandwidth and capacity, from data files.

The catalogue is ``symcost/hardware/devices.toml`` (package data, every figure with its datasheet URL and
date; see that file and docs/roofline.md). Users add devices with a file of the same shape (TOML
or JSON, ``--devices-file``; ``symcost calibrate`` writes one) or with ``--peak-flops`` and
``--bandwidth``.

A device's ridge point at a precision is peak FLOP/s / bandwidth (FLOP/byte): an op whose
arithmetic intensity lies below it is memory-bound there (Williams, Waterman & Patterson,
"Roofline", CACM 52(4), 2009).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

from symcost.errors import SymcostError
from symcost.hardware.efficiency import parse_efficiency

#: Precision keys of a device entry, in the catalogue's order.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: Where a device lists no figure for a precision, the next key tried (first listed wins).
FALLBACK = {
    "fp32": ("fp32", "tf32", "bf16"),
    "tf32": ("tf32", "fp32", "bf16"),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "fp8": ("fp8", "bf16", "fp16", "fp32"),
}
#: symcost's training precisions (``--precision``) -> the device precision of their matmuls.
TRAINING_PRECISION = {  # every --precision of symcost.frontends.precision.PRECISIONS
    "fp32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16-true-fp32-state": "bf16",
    "bf16-true-fp32-master": "bf16", "fp16-mixed": "fp16", "fp16-true": "fp16",
    "megatron-bf16": "bf16", "megatron-fp16": "fp16", "megatron-fp32": "fp32", "megatron-bf16-moments": "bf16",
    "deepspeed-bf16": "bf16", "deepspeed-fp16": "fp16",
}
_DTYPE_KEY = {
    "float32": "fp32", "float": "fp32", "float64": "fp32", "double": "fp32", "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
}


def op_time(t_compute: float, t_memory: float, t_transcendental: float = 0.0,
            serial: bool = False, pack_seconds: float = 0.0) -> tuple[float, str]:
    """``(seconds, resource)``: the roofline time bound of one op from its three times — FLOPs /
    peak, memory time, transcendental evaluations / rate — and the resource that binds
    (``compute``, ``memory`` or ``transcendental``: the largest term; ties go to compute, then
    memory).

    The bound is the largest of the three (they overlap: Williams, Waterman & Patterson,
    "Roofline", CACM 52(4), 2009, with the special-function units as one more ceiling). Two
    passes that do not overlap on a CPU core (a device with ``serial_passes``) add up instead —
    the non-overlapping transfer time of the Execution-Cache-Memory model (Treibig & Hager,
    "Introducing a performance model for bandwidth-limited loop kernels", PPAM 2009, LNCS 6067):

    - ``serial`` (a row-normalising op): memory time + max(compute, transcendental);
    - ``pack_seconds`` (a GEMM's packing of its [k, n] operand, :func:`symcost.graph.rules.packed_operand`:
      reading and writing it once): max(memory time, compute + packing).
    """
    t_in = max(t_compute, t_transcendental)
    inner = "compute" if t_compute >= t_transcendental else "transcendental"
    if serial:
        return t_memory + t_in, ("memory" if t_memory > t_in else inner)
    if pack_seconds:
        t_in += pack_seconds
    return max(t_memory, t_in), ("memory" if t_memory > t_in else inner)


def dtype_key(dtype: Any) -> str | None:
    """The device precision key of a torch dtype (or its name): ``torch.bfloat16`` -> ``"bf16"``;
    None for integer and boolean dtypes (they take the training precision)."""
    return _DTYPE_KEY.get(str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Device:
    """One device.

    Attributes:
        key: catalogue key (``h100-sxm``).
        name: readable name.
        peak: precision key -> dense peak FLOP/s.
        bandwidth: memory bandwidth, byte/s.
        memory: capacity in bytes (None if unknown).
        write_bandwidth: byte/s for bytes written, where it differs from reading (a calibrated
            CPU: a written cache line is first read, write-allocate); None: ``bandwidth``.
        source, date: where the figures come from.
        aliases: other names accepted by ``--device``.
        notes: free text (e.g. how dense figures were derived).
        transcendental_rate: transcendental function evaluations per second by function class
            (``exp``, ``log``, ``erf``, ``tanh``, ``sin``, ``sqrt``; :data:`TRANSCENDENTAL_CLASSES`),
            ``all`` for a figure that holds for every class (a GPU's special-function units);
            empty: the device gives none, and transcendental work is not timed on it.
        serial_passes: passes of one op that a CPU core runs one after the other add up: the
            dependent passes of a row-normalising op (softmax, norms;
            :data:`symcost.graph.opsets.ROW_NORMALISING`: read and reduce, then evaluate and write) and
            a BLAS GEMM's packing of its [k, n] operand before the multiply (``symcost
            calibrate`` sets it on a CPU). False: work in flight hides one another, the
            roofline's max (a GPU).
    """

    key: str
    name: str
    peak: Mapping[str, float]
    bandwidth: float
    memory: float | None = None
    source: str = ""
    date: str = ""
    aliases: tuple[str, ...] = ()
    notes: str = ""
    measured: Mapping[str, Any] = field(default_factory=dict)
    write_bandwidth: float | None = None
    transcendental_rate: Mapping[str, float] = field(default_factory=dict)
    serial_passes: bool = False
    #: byte/s (read plus written) of a CPU BLAS packing a GEMM's [k, n] operand (``symcost
    #: calibrate``: a skinny GEMM of its own, less its multiply); None: read at ``bandwidth`` and
    #: written at ``write_bandwidth``. The packing gathers short column panels from rows a full
    #: row apart, so on a machine whose TLB misses are dear (a VM over small host pages) it runs
    #: far below the streaming rate
    pack_bandwidth: float | None = None
    #: how far a calibrated entry's figures can be trusted (:func:`symcost.hardware.calibrate.calibrate`):
    #: ``contended`` (the machine stayed busy while it was measured) and why; empty for catalogue figures
    quality: Mapping[str, Any] = field(default_factory=dict)
    #: how the device talks to its peers (data-parallel step time, docs/parallel.md): ``link``
    #: and ``link_bandwidth`` (scale-up, per device and per direction, byte/s: NVLink's
    #: bidirectional aggregate halved), ``devices_per_node`` (devices on that link),
    #: ``network`` and ``network_bandwidth`` (scale-out NIC per device, per direction, byte/s)
    #: and ``source``; empty where the catalogue gives none
    interconnect: Mapping[str, Any] = field(default_factory=dict)
    #: the performance model's parameters (:class:`symcost.hardware.efficiency.Efficiency`: GEMM
    #: efficiency by shape, achievable bandwidth, launch overhead, optimizer step, collective
    #: latency; docs/performance-model.md); None: the defaults of that module, labelled so
    efficiency: Any = None

    @property
    def contended(self) -> bool:
        """Whether this entry was measured on a busy machine (its rates may be far too low)."""
        return bool(self.quality.get("contended"))

    def op_seconds(self, flops_seconds: float, read: float, written: float, transcendental_seconds: float = 0.0,
                   row_normalising: bool = False, packed_bytes: float = 0.0) -> tuple[float, str]:
        """``(time bound in seconds, binding resource)`` of one op execution on this device:
        :func:`op_time` of compute (``flops_seconds`` = FLOPs / peak), memory
        (:meth:`memory_seconds` of ``read`` and ``written`` bytes) and transcendental time; on a
        device with ``serial_passes``, serial for a ``row_normalising`` op and with the packing
        of ``packed_bytes`` (a GEMM's [k, n] operand, read and written once) before a GEMM."""
        pack = self.pack_seconds(packed_bytes) if self.serial_passes and packed_bytes else 0.0
        return op_time(flops_seconds, self.memory_seconds(read, written), transcendental_seconds,
                       row_normalising and self.serial_passes, pack)

    def pack_seconds(self, packed_bytes: float) -> float:
        """Seconds a CPU BLAS takes to pack ``packed_bytes`` of a GEMM's [k, n] operand (read and
        written once): 2·bytes / ``pack_bandwidth`` where calibrated, else :meth:`memory_seconds`
        of the bytes read and written (Goto & van de Geijn, "Anatomy of high-performance matrix
        multiplication", ACM TOMS 34(3), 2008, sec. 4: the packed copy of B)."""
        if self.pack_bandwidth:
            return 2 * packed_bytes / self.pack_bandwidth
        return self.memory_seconds(packed_bytes, packed_bytes)

    def transcendental_seconds(self, counts: Mapping[str, float]) -> float:
        """Seconds the device's special-function throughput needs for ``counts`` (``{class:
        evaluations}``, :func:`symcost.graph.rules.transcendentals`): the sum of count / rate over the
        classes (a class without its own rate takes ``all``; none at all: 0, not timed)."""
        return sum(float(n) / r for k, n in counts.items() if n and (r := self.rate_for(k)))

    def rate_for(self, cls: str) -> float | None:
        """Evaluations per second of the transcendental class ``cls`` (its own rate, else
        ``all``); None where the device gives neither."""
        return self.transcendental_rate.get(cls, self.transcendental_rate.get("all"))

    def memory_seconds(self, read: float, written: float) -> float:
        """Seconds to move ``read`` + ``written`` bytes: read / bandwidth + written /
        write_bandwidth (= (read + written) / bandwidth for a device with one bandwidth)."""
        return read / self.bandwidth + written / (self.write_bandwidth or self.bandwidth)

    def peak_for(self, precision: str) -> tuple[float, str]:
        """``(peak FLOP/s, key used)`` at ``precision`` (a key of :data:`PRECISIONS`).

        Falls back along :data:`FALLBACK` where the device lists no figure (a TPU's fp32 work at
        its bf16 figure); the key used tells which.

        Raises:
            SymcostError: unknown precision, or none of the fallbacks listed.
        """
        if precision not in FALLBACK:
            raise SymcostError(f"unknown precision {precision!r}; accepted: {', '.join(PRECISIONS)}")
        for k in FALLBACK[precision]:
            if k in self.peak:
                return float(self.peak[k]), k
        raise SymcostError(f"device {self.key} lists no peak FLOP/s for {precision}; add one or pass --peak-flops")

    def ridge(self, precision: str) -> float:
        """Ridge point at ``precision``: peak FLOP/s / bandwidth, in FLOP/byte."""
        return self.peak_for(precision)[0] / self.bandwidth

    def to_json(self) -> dict:
        """Plain data: key, name, peak (FLOP/s per precision), bandwidth (byte/s), memory (bytes),
        ridge (FLOP/byte per precision), source, date; where set: write_bandwidth (byte/s),
        transcendentals, serial_passes, pack_bandwidth (byte/s), aliases, notes, measured, quality."""
        out = {
            "key": self.key, "name": self.name, "peak_flops": dict(self.peak), "bandwidth": self.bandwidth,
            "memory": self.memory, "ridge": {k: v / self.bandwidth for k, v in self.peak.items()},
            "source": self.source, "date": self.date,
        }
        if self.write_bandwidth:
            out["write_bandwidth"] = self.write_bandwidth
        if self.transcendental_rate:
            out["transcendentals"] = dict(self.transcendental_rate)
        if self.serial_passes:
            out["serial_passes"] = True
        if self.pack_bandwidth:
            out["pack_bandwidth"] = self.pack_bandwidth
        if self.aliases:
            out["aliases"] = list(self.aliases)
        if self.notes:
            out["notes"] = self.notes
        if self.measured:
            out["measured"] = dict(self.measured)
        if self.quality:
            out["quality"] = dict(self.quality)
        if self.interconnect:
            out["interconnect"] = dict(self.interconnect)
        if self.efficiency is not None:
            out["efficiency"] = self.efficiency.to_json()
        return out


# -- parsing ------------------------------------------------------------------------------------
_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGTPE]?)\s*"
                   r"(flop/?s|flops|b/s|byte/s|bytes/s|tokens/s)?\s*$", re.IGNORECASE)


def parse_rate(text: str | float, what: str) -> float:
    """``"989e12"``, ``"989T"``, ``"3.35TB/s"``, ``"989 TFLOP/s"`` -> a positive float (decimal SI
    prefixes k, M, G, T, P, E).

    Raises:
        SymcostError: not a positive number with an optional prefix.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RATE.match(str(text))
        if not m:
            raise SymcostError(f"{what} takes a positive number with an optional k/M/G/T/P prefix "
                               f"(e.g. 989e12, 989T, 3.35TB/s), got {text!r}")
        value = float(m.group(1)) * _SI[m.group(2)]
    if not value > 0 or value == float("inf"):
        raise SymcostError(f"{what} must be positive, got {text!r}")
    return value


def _number(entry: Mapping, key: str, where: str) -> float:
    v = entry[key]
    if isinstance(v, str):
        return parse_rate(v, f"{where}: {key}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise SymcostError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _device(key: str, entry: Mapping, where: str) -> Device:
    if not isinstance(entry, Mapping):
        raise SymcostError(f"{where}: device {key!r} must be a table of figures")
    peak = {p: _number(entry, p, f"{where} [{key}]") for p in PRECISIONS if p in entry}
    if not peak:
        raise SymcostError(f"{where} [{key}]: no peak FLOP/s; give at least one of {', '.join(PRECISIONS)}")
    if "bandwidth" not in entry:
        raise SymcostError(f"{where} [{key}]: no bandwidth (byte/s)")
    known = set(PRECISIONS) | {"name", "bandwidth", "write_bandwidth", "memory", "source", "date", "notes", "aliases",
                               "measured", "transcendentals", "serial_passes", "pack_bandwidth", "quality", "interconnect",
                               "efficiency"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise SymcostError(f"{where} [{key}]: unknown field {unknown[0]!r}; accepted: {', '.join(sorted(known))}")
    return Device(
        key=key, name=str(entry.get("name", key)), peak=peak,
        bandwidth=_number(entry, "bandwidth", f"{where} [{key}]"),
        memory=_number(entry, "memory", f"{where} [{key}]") if "memory" in entry else None,
        source=str(entry.get("source", "")), date=str(entry.get("date", "")),
        aliases=tuple(entry.get("aliases", ())), notes=str(entry.get("notes", "")),
        measured=dict(entry.get("measured", {})),
        write_bandwidth=_number(entry, "write_bandwidth", f"{where} [{key}]") if "write_bandwidth" in entry else None,
        transcendental_rate=_transcendentals(entry.get("transcendentals"), f"{where} [{key}]"),
        serial_passes=_flag(entry, "serial_passes", f"{where} [{key}]"),
        pack_bandwidth=_number(entry, "pack_bandwidth", f"{where} [{key}]") if "pack_bandwidth" in entry else None,
        quality=_quality(entry.get("quality", {}), f"{where} [{key}]"),
        interconnect=_interconnect(entry.get("interconnect", {}), f"{where} [{key}.interconnect]"),
        efficiency=parse_efficiency(entry.get("efficiency"), f"{where} [{key}]"),
    )


def _interconnect(value, where: str) -> dict:
    """A device's ``interconnect`` table (:attr:`Device.interconnect`), checked."""
    if not isinstance(value, Mapping):
        raise SymcostError(f"{where}: must be a table (link, link_bandwidth, devices_per_node, network, "
                           "network_bandwidth, host_link, host_bandwidth, source)")
    known = {"link", "link_bandwidth", "devices_per_node", "network", "network_bandwidth", "source",
             "host_link", "host_bandwidth"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise SymcostError(f"{where}: unknown field {unknown[0]!r}; accepted: {', '.join(sorted(known))}")
    out = {k: str(value[k]) for k in ("link", "network", "source", "host_link") if k in value}
    for k in ("link_bandwidth", "network_bandwidth", "host_bandwidth"):
        if k in value:
            out[k] = _number(value, k, where)
    if "devices_per_node" in value:
        n = value["devices_per_node"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SymcostError(f"{where}: devices_per_node must be a positive integer, got {n!r}")
        out["devices_per_node"] = n
    return out


def _quality(value, where: str) -> dict:
    """A calibrated entry's ``quality`` table (``contended`` true or false, and why)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("contended", False), bool):
        raise SymcostError(f"{where}: quality must be a table with contended = true or false")
    return dict(value)


def _flag(entry: Mapping, key: str, where: str) -> bool:
    v = entry.get(key, False)
    if not isinstance(v, bool):
        raise SymcostError(f"{where}: {key} must be true or false, got {v!r}")
    return v


#: Function classes of transcendental rates (see :data:`symcost.graph.rules.TRANSCENDENTAL_OUT`).
TRANSCENDENTAL_CLASSES = ("exp", "log", "erf", "tanh", "sin", "sqrt")


def _transcendentals(value, where: str) -> dict[str, float]:
    """``transcendentals = 3.9e12`` (every class) or a table ``{exp = ..., erf = ..., all = ...}``
    (evaluations per second) -> ``{class: rate}``; absent -> ``{}``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        return {"all": _number({"transcendentals": value}, "transcendentals", where)}
    accepted = TRANSCENDENTAL_CLASSES + ("all",)
    bad = sorted(set(value) - set(accepted))
    if bad:
        raise SymcostError(f"{where}: unknown transcendental class {bad[0]!r}; accepted: {', '.join(accepted)}")
    return {k: _number(value, k, f"{where} transcendentals") for k in value}


def _load_toml(text: str, where: str) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SymcostError(f"{where} is not valid TOML: {e}") from e


def parse_devices(text: str, where: str, fmt: str = "toml") -> dict[str, Device]:
    """Devices from the text of a TOML or JSON file: ``{key: {fp32: ..., bandwidth: ...}}``.

    Raises:
        SymcostError: malformed file, missing or non-positive figures, unknown fields.
    """
    if fmt == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SymcostError(f"{where} is not valid JSON: {e}") from e
    else:
        data = _load_toml(text, where)
    if not isinstance(data, dict) or not data:
        raise SymcostError(f"{where}: expected a table of devices {{name: {{bf16: ..., bandwidth: ...}}}}")
    return {k: _device(k, v, where) for k, v in data.items()}


_CATALOGUE: dict[str, Device] | None = None


def catalogue() -> dict[str, Device]:
    """The built-in devices (``symcost/hardware/devices.toml``), key -> :class:`Device`."""
    global _CATALOGUE
    if _CATALOGUE is None:
        text = resources.files("symcost.hardware").joinpath("devices.toml").read_text(encoding="utf-8")
        _CATALOGUE = parse_devices(text, "symcost/hardware/devices.toml")
    return _CATALOGUE


#: Short names accepted by --device besides the catalogue keys.
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200", "tpu-v5": "tpu-v5p",
           "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p"}


def load_file(path: str) -> dict[str, Device]:
    """Devices of a user file (``.toml`` or ``.json``, same shape as the catalogue).

    Raises:
        SymcostError: missing file or malformed content.
    """
    if not os.path.isfile(path):
        raise SymcostError(f"devices file {path!r} not found")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    fmt = "json" if path.endswith(".json") or text.lstrip().startswith("{") else "toml"
    return parse_devices(text, path, fmt)


def get_device(name: str | None = None, devices_file: str | None = None, peak_flops: str | float | None = None,
               bandwidth: str | float | None = None) -> Device:
    """The device the user asked for.

    Args:
        name: a catalogue key or alias, or a key of ``devices_file``; with only one device in the
            file, None picks it.
        devices_file: a TOML/JSON file of extra devices (they win over the catalogue).
        peak_flops: FLOP/s; replaces the device's peak at every precision (alone, with
            ``bandwidth``, it defines a device "custom").
        bandwidth: byte/s; replaces the device's bandwidth.

    Raises:
        SymcostError: unknown name (the accepted ones listed), or a custom device missing a figure.
    """
    devices = dict(catalogue())
    extra = load_file(devices_file) if devices_file else {}
    devices.update(extra)
    if name is None and len(extra) == 1:
        name = next(iter(extra))
    if name is None:
        if extra:
            raise SymcostError(f"{devices_file} holds {len(extra)} devices ({', '.join(extra)}): "
                               "pick one with --device NAME")
        if peak_flops is None or bandwidth is None:
            raise SymcostError("no device: pass --device NAME (see `symcost devices`), --devices-file, "
                               "or both --peak-flops and --bandwidth")
        dev = Device(key="custom", name="custom (--peak-flops, --bandwidth)",
                     peak={p: parse_rate(peak_flops, "--peak-flops") for p in PRECISIONS},
                     bandwidth=parse_rate(bandwidth, "--bandwidth"), source="command line")
        return dev
    key = name.lower()
    if key not in devices:
        key = ALIASES.get(key, key)
    if key not in devices:
        for d in devices.values():
            if name.lower() in (a.lower() for a in d.aliases):
                key = d.key
                break
    if key not in devices:
        raise SymcostError(f"unknown device {name!r}; accepted: {', '.join(devices)} "
                           f"(aliases {', '.join(ALIASES)}), or --devices-file / --peak-flops with --bandwidth")
    dev = devices[key]
    if peak_flops is not None or bandwidth is not None:
        dev = Device(
            key=dev.key, name=dev.name + " (overridden)",
            peak={p: parse_rate(peak_flops, "--peak-flops") for p in PRECISIONS} if peak_flops is not None else dev.peak,
            bandwidth=parse_rate(bandwidth, "--bandwidth") if bandwidth is not None else dev.bandwidth,
            memory=dev.memory, source=dev.source + " + command line", date=dev.date, notes=dev.notes,
            write_bandwidth=None if bandwidth is not None else dev.write_bandwidth,
            transcendental_rate=dev.transcendental_rate, serial_passes=dev.serial_passes,
            pack_bandwidth=None if bandwidth is not None else dev.pack_bandwidth,
            efficiency=dev.efficiency,
        )
    return dev


def write_file(devices: Mapping[str, Mapping[str, Any]], path: str) -> None:
    """Write device entries (plain dicts in the catalogue's shape) as JSON that :func:`load_file`
    reads back."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dict(devices), f, indent=1)
        f.write("\n")

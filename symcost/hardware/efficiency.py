"""A device's efficiency parameters: how far below its datasheet peaks real kernels run.

The roofline (:mod:`symcost.passes.roofline`) bounds a step with the device's peaks; the
performance model (:mod:`symcost.passes.performance`) predicts it with the figures here, a few per
device, each measured on microbenchmarks (``symcost calibrate`` on a CPU,
``benchmarks/gpu_check.sh`` on a GPU) or taken from a stated source, never fitted on the training
steps it is validated against (docs/performance-model.md). A device file's ``efficiency`` table::

    [this-machine.efficiency]
    compute_units = 1            # units a GEMM's output tiles are spread over (GPU: SMs; CPU: threads)
    tile = [1, 1]                # output tile (m, n) of one unit (GPU: CUTLASS/cuBLAS 128 x 128)
    gemm_max = {fp32 = 0.93, bf16 = 0.80}   # fraction of the peak a large GEMM reaches
    gemm_half = 24.0             # a GEMM dimension d runs at d / (d + gemm_half) of it
    memory = 0.9                 # fraction of the bandwidth memory-bound ops reach
    copy_bandwidth = 2e10        # byte/s (read + written) of a layout-changing copy (copy_, clone)
    launch_eager = 6e-6          # seconds per aten op in eager mode (dispatch, autograd), each
    host_forward = 2.2e-6        # host seconds per traced aten op of an eager forward (Python, nn.Module,
    host_backward = 2.3e-6       #   dispatcher, autograd; the backward's in autograd's engine): replace launch_eager
    host_launch = 3e-6           # host seconds of a kernel launch per op that runs a kernel (a GPU: cuLaunchKernel)
    host_async = true            # the host issues ops ahead of the device (a GPU): a stretch is max(host, device)
    kernel_gap = 2.1e-6          # device seconds per kernel beyond its own time (launch, teardown), stream launches
    launch_compiled = 2e-6       # seconds per kernel of a compiled step
    optimizer_per_tensor = 4e-5  # AdamW (foreach) step: seconds per parameter tensor
    optimizer_per_byte = 2e-10   #   ... and per byte of fp32 parameter
    collective_latency = 5e-6    # alpha of one collective step (seconds), per link hop
    compute_capability = "9.0"   # a CUDA GPU's: its fused attention kernels (symcost.hardware.attention)
    source = "measured by symcost calibrate ..."

Every key is optional; :data:`DEFAULTS` fills the rest (and says so in ``defaulted``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from symcost.errors import SymcostError

#: Values of keys a device's table leaves out. The GEMM tile and the launch figures are those of
#: a GPU (a CUTLASS 128 x 128 threadblock tile, NVIDIA's "Matrix Multiplication Background" user
#: guide, sec. "Wave quantization"; ~5 us per eager op and ~3 us per kernel launch, PyTorch's
#: performance tuning guide, "CUDA graphs"); gemm_max 0.8 and memory 0.8 are the fractions
#: cuBLAS GEMMs and streaming kernels typically reach (nccl-tests / STREAM-style sweeps); a
#: device whose file measures them replaces every one. kernel_gap 0: a device without a measured or
#: published figure pays no time per kernel boundary on the device (not priced, and listed as defaulted).
DEFAULTS: dict[str, Any] = {
    "compute_units": 1, "tile": (1, 1), "gemm_max": {}, "gemm_max_default": 0.8, "gemm_half": 16.0,
    "memory": 0.8, "launch_eager": 5e-6, "launch_compiled": 3e-6,
    "optimizer_per_tensor": 2e-5, "optimizer_per_byte": 0.0, "collective_latency": 5e-6,
    "copy_bandwidth": None, "kernel_gap": 0.0,
}

#: What "defaulted" means beside a prediction (docs/performance-model.md): some efficiency
#: figure of the device's table is the catalogue's default, not a measurement on that device.
DEFAULTED = ("efficiency parameters defaulted: not measured on this device (`symcost calibrate` "
             "measures this CPU; benchmarks/gpu_check.sh measures a GPU)")

_NUMBERS = ("gemm_half", "memory", "copy_bandwidth", "launch_eager", "launch_compiled", "optimizer_per_tensor",
            "optimizer_per_byte", "collective_latency", "host_forward", "host_backward", "host_launch", "kernel_gap")
KNOWN = set(_NUMBERS) | {"compute_units", "tile", "gemm_max", "source", "fit", "compute_capability",
                         "defaulted", "host_async"}  # (what to_json writes back: ignored on reading, recomputed)


@dataclass(frozen=True)
class Efficiency:
    """The parsed ``efficiency`` table of a device (see the module docstring; seconds, fractions).

    Attributes:
        compute_units, tile: wave quantisation of a GEMM's output tiles (:meth:`gemm`).
        gemm_max: precision key -> fraction of the peak a large GEMM reaches.
        gemm_half: the small-dimension constant (elements).
        memory: fraction of the bandwidth memory-bound ops reach.
        copy_bandwidth: byte/s (read + written) of an op that copies a tensor into another layout
            (``aten.copy_``, ``clone``, ``contiguous``: a permuted or transposed source gathers
            with strides); None: such ops are memory-bound ops like the others.
        launch_eager, launch_compiled: seconds per op (eager) or kernel (compiled).
        host_forward, host_backward: host seconds per traced aten op of an eager step's forward and
            backward (Python, ``nn.Module`` calls, the dispatcher, autograd's recording and engine),
            measured on tiny tensors (:func:`symcost.hardware.calibrate_perf.host_per_op`); None:
            ``launch_eager`` per op (the older single figure). :meth:`host_per_op` reads them.
        host_launch: host seconds of launching a kernel, per op that runs one (moves bytes or does
            FLOPs: views do not) on a device whose kernels the host launches (a GPU's
            ``cuLaunchKernel``); 0 on a CPU, whose kernel runs inside the op (its time is the
            device term) — docs/performance-model.md, "Host overhead".
        host_async: the host issues the ops asynchronously ahead of the device (a CUDA GPU's
            stream): each stretch between synchronisations takes max(host, device), not their sum
            (:func:`symcost.passes.performance.host_stretches`); False (a CPU): one thread runs both.
        kernel_gap: seconds the device spends per kernel of an eager step beyond the kernel's own
            time — the launch and teardown at a kernel boundary, when kernels are launched one by
            one on a stream and the host has already queued the next one (a GPU); added to the
            device's time of each phase per op that runs a kernel
            (:func:`symcost.passes.performance.predict`, docs/performance-model.md, "Kernel
            boundaries on the device"). 0 (the default, and a CPU's, whose kernel runs inside the
            op): not priced. The catalogue's H100 and H200: 2.1 us (Hazy Research 2025, a dummy
            kernel on an H100, CUDA stream); ``benchmarks/gpu_check.sh`` measures it
            (:func:`symcost.hardware.calibrate_perf.kernel_gap`).
        optimizer_per_tensor, optimizer_per_byte: the AdamW (foreach) step's cost.
        collective_latency: the alpha (seconds) of one step of a ring or tree collective.
        compute_capability: ``(major, minor)`` of a CUDA GPU (NVIDIA's "CUDA C++ Programming
            Guide", "Compute Capabilities"): its fused attention kernels are priced by the kernel
            PyTorch's SDPA dispatcher picks there (:mod:`symcost.hardware.attention`); None (a CPU,
            a device without one): priced at ``gemm_max`` like any op with model FLOPs.
        source: where the figures come from; defaulted: the keys taken from :data:`DEFAULTS`.
    """

    compute_units: int = 1
    tile: tuple[int, int] = (1, 1)
    gemm_max: Mapping[str, float] = field(default_factory=dict)
    gemm_half: float = DEFAULTS["gemm_half"]
    memory: float = DEFAULTS["memory"]
    copy_bandwidth: float | None = None
    launch_eager: float = DEFAULTS["launch_eager"]
    launch_compiled: float = DEFAULTS["launch_compiled"]
    optimizer_per_tensor: float = DEFAULTS["optimizer_per_tensor"]
    optimizer_per_byte: float = DEFAULTS["optimizer_per_byte"]
    collective_latency: float = DEFAULTS["collective_latency"]
    host_forward: float | None = None
    host_backward: float | None = None
    host_launch: float | None = None
    kernel_gap: float = DEFAULTS["kernel_gap"]
    host_async: bool = False
    compute_capability: tuple[int, int] | None = None
    source: str = "defaults (symcost.hardware.efficiency.DEFAULTS)"
    defaulted: tuple[str, ...] = ()
    fit: Mapping[str, Any] = field(default_factory=dict)

    def gemm_max_for(self, precision: str) -> float:
        """Fraction of the peak a large GEMM reaches at ``precision`` (``fp32``, ``bf16``, ...):
        its own figure, else the highest-precision one listed, else 0.8."""
        if precision in self.gemm_max:
            return float(self.gemm_max[precision])
        for k in ("bf16", "fp16", "fp32", "tf32", "fp8"):
            if k in self.gemm_max:
                return float(self.gemm_max[k])
        return DEFAULTS["gemm_max_default"]

    def host_per_op(self, phase: str) -> float:
        """Host seconds per traced aten op of ``phase`` (``forward``; anything else: the backward's
        figure) of an eager step: ``host_forward``/``host_backward``, else ``launch_eager``."""
        own = self.host_forward if phase == "forward" else self.host_backward
        return float(own) if own is not None else float(self.launch_eager)

    def gemm(self, m: int, n: int, k: int, batch: int = 1, precision: str = "fp32") -> float:
        """Fraction of the peak one GEMM ``[batch] [m, k] x [k, n]`` reaches (0 < e <= 1).

        e = gemm_max · wave · pad · s(m) · s(n) · s(k), with

        - tiles = batch · ceil(m / tm) · ceil(n / tn) output tiles over ``compute_units`` units run
          in ceil(tiles / units) waves; wave = tiles / (waves · units) (wave quantisation: NVIDIA,
          "Matrix Multiplication Background User's Guide", sec. 2.2);
        - pad = m · n / (ceil(m / tm) · tm · ceil(n / tn) · tn): the tiles' padding (tile
          quantisation, same guide, sec. 2.1); a dimension shorter than the tile runs on a tile of
          its next power of two (the libraries carry smaller tiles and GEMV kernels for skinny
          problems, the guide's tile-size choice; without it a decode step's [1, k] x [k, n] would
          pad one row to 128);
        - s(d) = d / (d + gemm_half): a short dimension amortises a tile's loads, stores and loop
          set-up over fewer multiply-adds (Goto & van de Geijn 2008, sec. 6: the micro-kernel's
          fixed cost per k-panel; a CPU's calibrated constant, a GPU's default 16).
        """
        m, n, k, batch = max(1, int(m)), max(1, int(n)), max(1, int(k)), max(1, int(batch))
        tm, tn = (min(t, 1 << (d - 1).bit_length()) for t, d in zip(self.tile, (m, n)))
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        units = max(1, int(self.compute_units))
        wave = tiles / (math.ceil(tiles / units) * units)
        pad = m * n / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn)
        h = self.gemm_half
        s = (m / (m + h)) * (n / (n + h)) * (k / (k + h))
        return max(1e-6, min(1.0, self.gemm_max_for(precision) * wave * pad * s))

    def collective_seconds(self, nbytes: float, ranks: int, bandwidth: float, algorithm: str = "ring",
                           kind: str = "all_reduce") -> float:
        """Seconds of one collective of ``nbytes`` (the per-rank buffer) over ``ranks`` ranks on a
        link of ``bandwidth`` byte/s per direction: the alpha-beta model (Hockney 1994; Thakur,
        Rabenseifner & Gropp 2005, "Optimization of collective communication operations in
        MPICH", Table 1; NCCL's bus bandwidth, nccl-tests doc/PERFORMANCE.md):

        - ring all-reduce: 2(n-1) steps, 2(n-1)/n · bytes moved per rank;
        - ring all-gather / reduce-scatter: n-1 steps, (n-1)/n · bytes;
        - tree all-reduce: 2·ceil(log2 n) steps, 2 · bytes (pipelined, the bandwidth term of NCCL's
          double binary tree);
        - all-to-all: n-1 steps, (n-1)/n · bytes.

        Returns 0 for one rank. Raises SymcostError for an unknown algorithm or kind.
        """
        n = int(ranks)
        if n <= 1:
            return 0.0
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            raise SymcostError(f"unknown collective {kind!r}")
        if algorithm == "tree" and kind == "all_reduce":
            steps, moved = 2 * math.ceil(math.log2(n)), 2.0 * nbytes
        elif algorithm in ("ring", "tree"):
            factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
            steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
            moved = factor * nbytes
        else:
            raise SymcostError(f"unknown collective algorithm {algorithm!r}; accepted: ring, tree")
        return steps * self.collective_latency + moved / bandwidth

    def to_json(self) -> dict:
        """The table as plain data (what a device file's ``efficiency`` holds; :func:`parse_efficiency`
        reads it back)."""
        out = {"compute_units": self.compute_units, "tile": list(self.tile), "gemm_max": dict(self.gemm_max),
               **{k: getattr(self, k) for k in _NUMBERS if getattr(self, k) is not None}, "source": self.source}
        if self.host_async:
            out["host_async"] = True
        if self.compute_capability is not None:
            out["compute_capability"] = "%d.%d" % self.compute_capability
        if self.defaulted:
            out["defaulted"] = list(self.defaulted)
        if self.fit:
            out["fit"] = dict(self.fit)
        return out


def _positive(v, key: str, where: str, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if allow_zero else v > 0) \
            or v == float("inf"):
        raise SymcostError(f"{where}: efficiency.{key} must be a {'non-negative' if allow_zero else 'positive'} "
                           f"number, got {v!r}")
    return float(v)


def parse_efficiency(value: Any, where: str) -> Efficiency | None:
    """An :class:`Efficiency` from a device entry's ``efficiency`` table (None where absent).

    Raises:
        SymcostError: not a table, an unknown key, a figure out of range (fractions in (0, 1],
            times and sizes positive), a ``compute_capability`` that is not ``"major.minor"``.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SymcostError(f"{where}: efficiency must be a table ({', '.join(sorted(KNOWN))})")
    bad = sorted(set(value) - KNOWN)
    if bad:
        raise SymcostError(f"{where}: unknown efficiency field {bad[0]!r}; accepted: {', '.join(sorted(KNOWN))}")
    kw: dict[str, Any] = {}
    for key in _NUMBERS:
        if key in value:
            kw[key] = _positive(value[key], key, where, allow_zero=key in ("optimizer_per_byte", "optimizer_per_tensor",
                                                                            "collective_latency", "launch_eager",
                                                                            "launch_compiled", "host_forward",
                                                                            "host_backward", "host_launch",
                                                                            "kernel_gap"))
    if "host_async" in value:
        if not isinstance(value["host_async"], bool):
            raise SymcostError(f"{where}: efficiency.host_async must be true or false, got {value['host_async']!r}")
        kw["host_async"] = value["host_async"]
    if "memory" in kw and kw["memory"] > 1:
        raise SymcostError(f"{where}: efficiency.memory is a fraction of the bandwidth, at most 1, got {kw['memory']}")
    if "compute_units" in value:
        u = value["compute_units"]
        if isinstance(u, bool) or not isinstance(u, int) or u < 1:
            raise SymcostError(f"{where}: efficiency.compute_units must be a positive integer, got {u!r}")
        kw["compute_units"] = u
    if "tile" in value:
        t = value["tile"]
        if not isinstance(t, (list, tuple)) or len(t) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                                                    for x in t):
            raise SymcostError(f"{where}: efficiency.tile must be two positive integers [m, n], got {t!r}")
        kw["tile"] = (int(t[0]), int(t[1]))
    if "gemm_max" in value:
        g = value["gemm_max"]
        if not isinstance(g, Mapping):
            g = {"fp32": g}
        gm = {}
        for k, v in g.items():
            f = _positive(v, f"gemm_max.{k}", where)
            if f > 1:
                raise SymcostError(f"{where}: efficiency.gemm_max.{k} is a fraction of the peak, at most 1, got {f}")
            gm[str(k)] = f
        kw["gemm_max"] = gm
    if "compute_capability" in value:
        cc = value["compute_capability"]
        major, dot, minor = str(cc).partition(".")
        if isinstance(cc, bool) or not (major.isdigit() and (not dot or minor.isdigit())):
            raise SymcostError(f"{where}: efficiency.compute_capability must be a CUDA compute capability "
                               f"\"major.minor\" (e.g. \"9.0\"), got {cc!r}")
        kw["compute_capability"] = (int(major), int(minor or 0))
    if "source" in value:
        kw["source"] = str(value["source"])
    if "fit" in value and isinstance(value["fit"], Mapping):
        kw["fit"] = dict(value["fit"])
    said = value.get("defaulted", ())  # a table written by to_json: its defaults stay defaults
    said = said if isinstance(said, (list, tuple)) else ()
    kw["defaulted"] = tuple(k for k in (*_NUMBERS, "compute_units", "tile", "gemm_max") if k not in value or k in said)
    return Efficiency(**kw)


def default_efficiency(device) -> Efficiency:
    """The efficiency a device without an ``efficiency`` table is predicted with: every figure from
    :data:`DEFAULTS` (``defaulted`` lists them all), the GPU tile 128 x 128 over the device's
    ``compute_units`` unknown (1) — so a catalogue GPU's prediction says it is uncalibrated."""
    return Efficiency(source="defaults (no efficiency table for this device: symcost.hardware.efficiency.DEFAULTS)",
                      defaulted=tuple(sorted(KNOWN - {"source", "fit", "defaulted"})))

"""Plots (matplotlib, the optional ``plot`` extra): the roofline with every op, and a validation
sweep's measured vs predicted times. Each function returns the points it drew (so tests can
check the picture shows the JSON's numbers)."""
from __future__ import annotations

from symcost.errors import SymcostError

PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange"}


def require_matplotlib():
    """Import matplotlib with the Agg backend, or say how to install it.

    Raises:
        SymcostError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SymcostError("--plot needs matplotlib: pip install 'symcost[plot]'") from None
    return plt


def check_plot_path(path: str) -> None:
    """Refuse a plot path that cannot be written, before any work: its folder must exist and be
    writable, and the name must end in .png.

    Raises:
        SymcostError: the folder is missing or not writable; another extension.
    """
    import os

    if not str(path).lower().endswith(".png"):
        raise SymcostError(f"--plot {path}: the plot is a PNG; give a FILE.png")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SymcostError(f"--plot {path}: no folder {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise SymcostError(f"--plot {path}: cannot write there (permission denied)")


def _save(fig, plt, path: str) -> None:
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise SymcostError(f"--plot {path}: cannot write it: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def token_rate_plot(curve: dict, path: str, title: str = "") -> dict:
    """Draw :func:`symcost.passes.inference.token_rate`'s ``curve`` to ``path`` (PNG): against the
    batch B (log x, 1 to the largest that fits), the tokens/s bound (left axis, log) and the time
    per output token bound (right axis, ms, log), both from the per-op roofline of the decode step,
    with the aggregate memory bound (weights + KV)/bandwidth dotted; the batch where the aggregate
    turns compute-bound is a vertical line where it lies in range, else the plot says "never" or
    where it lies.

    Returns:
        ``points`` (the (batch, tokens/s, seconds per token) points drawn), ``crossing_line`` (the
        batch marked by the vertical line, or None), ``note`` (the text drawn instead, or "").

    Raises:
        SymcostError: matplotlib missing; the file cannot be written.
    """
    plt = require_matplotlib()
    rows = curve["rows"]
    bs = [r["batch"] for r in rows]
    tps = [r["tokens_per_second"] for r in rows]
    spt = [r["seconds_per_token"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(bs, tps, "o-", color="tab:blue", ms=3, label="tokens/s bound (B / time per step)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences B (decode batch)")
    ax.set_ylabel("tokens/s bound", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(bs, [s * 1e3 for s in spt], "s-", color="tab:red", ms=3, label="time per output token bound")
    ax2.plot(bs, [r["memory_seconds"] * 1e3 for r in rows], ":", color="tab:red",
             label="(weights + KV) / bandwidth")
    ax2.set_yscale("log")
    ax2.set_ylabel("time per output token (ms)", color="tab:red")
    cr = curve.get("crossing") or {}
    v = cr.get("value")
    line, where = None, ""
    if v is not None and bs[0] <= v <= bs[-1]:
        line = v
        ax.axvline(v, color="k", ls="--", lw=1, label=f"decode compute-bound from B ≈ {v:.4g}")
    else:
        state = cr.get("compute_bound")
        where = ("never compute-bound (KV bytes grow with B as fast as the FLOPs)" if state == "never"
                 else "compute-bound at every batch" if state == "always"
                 else f"crossing at B ≈ {v:.4g}, beyond the largest batch ({cr.get('compute_bound')})"
                 if v is not None and v > bs[-1]
                 else f"crossing at B ≈ {v:.4g}, below B = 1 ({cr.get('compute_bound')})" if v is not None else "")
        if where:
            ax.text(0.02, 0.02, f"decode: {where}", transform=ax.transAxes, fontsize=8)
    kvd = curve.get("kv_dtype")
    extra = f", KV {kvd['dtype']} (modelled)" if kvd and kvd.get("modelled") else ""
    ax.set_title((title or "decode token rate") + extra, fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    fig.tight_layout()
    _save(fig, plt, path)
    return {"points": list(zip(bs, tps, spt)), "crossing_line": line, "note": where}


def roofline_plot(r: dict, path: str, title: str = "", label_top: int = 8) -> list[tuple[float, float]]:
    """Draw the roofline of :func:`symcost.passes.roofline.roofline`'s result ``r`` to ``path``.

    Log-log axes: x = arithmetic intensity (FLOP/byte), y = attainable FLOP/s
    (min(peak, bandwidth x I)), one roof per precision used; every op with FLOPs is a point
    coloured by phase, the ``label_top`` slowest labelled by module. Ops with no FLOPs (pure data
    movement) or no bytes (fused away entirely) have no place on a log x axis and are left out.

    Returns:
        The (intensity, attainable FLOP/s) points drawn, in ``r["nodes"]`` order.
    """
    import numpy as np

    plt = require_matplotlib()
    dev = r["device"]
    bw = dev["bandwidth"]
    pts = [(n["intensity"], n["attainable"], n) for n in r["nodes"] if n["flops"] > 0 and n["intensity"] is not None]
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [p[0] for p in pts] or [1.0]
    lo, hi = min(xs) / 4, max(max(xs), *dev["ridge"].values()) * 4
    grid = np.logspace(np.log10(lo), np.log10(hi), 200)
    for prec in sorted({n["precision"] for _, _, n in pts}):
        peak = dev["peak_flops"].get(prec) or max(dev["peak_flops"].values())
        ax.plot(grid, np.minimum(peak, bw * grid), "k-" if prec == r["precision"] else "k--", lw=1,
                label=f"roof {prec}: {peak / 1e12:.3g} TFLOP/s, {bw / 1e12:.3g} TB/s")
    for phase, color in PHASE_COLORS.items():
        sel = [(x, y) for x, y, n in pts if n["phase"] == phase]
        if sel:
            ax.scatter([p[0] for p in sel], [p[1] for p in sel], s=18, c=color, label=phase, alpha=0.8)
    for x, y, n in sorted(pts, key=lambda p: -p[2]["seconds"])[:label_top]:
        ax.annotate(n["module"] or n["op"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title or "roofline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [(x, y) for x, y, _ in pts]


def validation_plot(rows: list[dict], path: str, title: str = "") -> list[tuple[float, float]]:
    """Measured vs predicted time (seconds, log-log) of a validation sweep, one point per kernel,
    with the y = x line (on it: the kernel runs at its bound) and y = 2x.

    Returns:
        The (predicted, measured) points drawn, in ``rows`` order.
    """
    import numpy as np

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 6))
    pts = [(r["predicted"], r["measured"]) for r in rows]
    fams = sorted({r["family"] for r in rows})
    cmap = plt.get_cmap("tab10")
    for i, fam in enumerate(fams):
        sel = [(r["predicted"], r["measured"]) for r in rows if r["family"] == fam]
        ax.scatter([p[0] for p in sel], [p[1] for p in sel], color=cmap(i % 10), label=fam, s=25)
    allv = [v for p in pts for v in p]
    g = np.logspace(np.log10(min(allv) / 2), np.log10(max(allv) * 2), 10)
    ax.plot(g, g, "k-", lw=1, label="measured = predicted bound")
    ax.plot(g, 2 * g, "k:", lw=1, label="2x the bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted time bound (s)")
    ax.set_ylabel("measured time (s)")
    ax.set_title(title or "validation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pts

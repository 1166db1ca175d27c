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

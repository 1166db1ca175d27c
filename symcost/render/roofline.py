"""The text of ``symcost roofline``: what :func:`symcost.passes.roofline.roofline` returns, as
header lines and per-phase, per-module, top-ops and crossing tables (rich), readable at 80 columns.
"""
from __future__ import annotations

from rich import box
from rich.table import Table

from symcost.render.report import human, short

#: phase names in the narrow top-ops table
_PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
#: bound names shortened in that table ("transcendental" would widen it by half a name)
_BOUND = {"transcendental": "transc"}


def _fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.2f} us"
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"



def render_text(c, an, dev, r: dict, tc: dict, n_tokens=None, top: int = 15, unfused: bool = False,
                crossing_symbol: str | None = None) -> None:
    """Print the roofline report on the rich console ``c``: header lines, per-phase, per-module and
    top-ops tables (and the crossings of ``crossing_symbol``), readable at 80 columns and wider:
    numbers never wrap; only module and op names fold.

    Args:
        an: the traced :class:`~symcost.graph.analysis.Analysis`; dev: the :class:`~symcost.hardware.devices.Device`.
        r: :func:`symcost.passes.roofline.roofline` of them; tc: :func:`symcost.passes.roofline.tokens_compute`.
        top: ops listed (largest time bound first); unfused: the bytes timed are unfused.
    """
    c.print(f"[bold]symcost roofline[/bold]: {an.model} on {dev.name}   precision {an.precision} "
            f"({r['precision']} peak {dev.peak_for(r['precision'])[0] / 1e12:.4g} TFLOP/s"
            + (f" (its {dev.peak_for(r['precision'])[1]} figure)" if dev.peak_for(r['precision'])[1] != r['precision'] else "")
            + ", "
            f"bandwidth {dev.bandwidth / 1e12:.4g} TB/s, ridge {dev.ridge(r['precision']):.1f} FLOP/byte)")
    c.print("sizes: " + " ".join(f"{k}={v}" for k, v in r["sizes"].items()))
    c.print(f"step time lower bound: {_fmt_s(r['step_seconds_fused'])} fused (compiled), "
            f"{_fmt_s(r['step_seconds_unfused'])} unfused (eager); used: {'unfused' if unfused else 'fused'}")
    c.print(f"MFU ceiling: {100 * r['mfu_ceiling']:.1f}%  (model FLOPs {human(r['model_flops'], 'FLOP')} per step)")
    c.print(f"flops.per_token: {tc['flops.per_token']:.6g} = {tc['flops.per_token_formula']}")
    if n_tokens:
        c.print(f"compute.total for {n_tokens:.4g} tokens: {float(tc['compute.total']):.4g} FLOP "
                f"({'6·N·P' if 'six_np.groups' in tc else '6·P·tokens'}: {float(tc['compute.6NP']):.4g})")
    narrow = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True,
              "title_justify": "left"}
    pt = Table(title="Per phase (mem-bound: the time in memory-bound ops)", **narrow)
    for col in ("phase", "time bound", "mem-bound", "all FLOPs", "bytes", "fused bytes"):
        pt.add_column(col, no_wrap=True, justify="left" if col == "phase" else "right")
    for ph, d in r["per_phase"].items():
        pt.add_row(ph, _fmt_s(d["seconds"]), f"{100 * d['memory_bound_seconds'] / d['seconds']:.0f}%" if d["seconds"] else "-",
                   human(d["flops"], "FLOP"), human(d["bytes"], "B"), human(d["fused_bytes"], "B"))
    c.print(pt)
    mt = Table(title="Per module (largest time bounds)", **narrow)
    mt.add_column("module", overflow="fold")
    for col in ("time bound", "share", "mem-bound", "all FLOPs", "fused bytes"):
        mt.add_column(col, no_wrap=True, justify="right")
    mods = sorted(r["per_module"].items(), key=lambda kv: -kv[1]["seconds"])
    for mod, d in mods[:max(top, 1)]:
        mt.add_row(mod, _fmt_s(d["seconds"]), f"{100 * d['seconds'] / r['step_seconds']:.1f}%" if r["step_seconds"] else "-",
                   f"{100 * d['memory_bound_seconds'] / d['seconds']:.0f}%" if d["seconds"] else "-",
                   human(d["flops"], "FLOP"), human(d["fused_bytes"], "B"))
    c.print(mt)
    used = "unfused" if unfused else "fused"
    nt = Table(title=f"Top {top} ops by time bound", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
               pad_edge=False, collapse_padding=True,
               caption=f"module: op (aten, .default left out); ×: runs per step; FLOP and bytes ({used}, "
                       "those timed): one run, in k/M/G (10³…) and Ki/Mi/Gi (2¹⁰…); time and share: all runs; "
                       "bound: the ceiling that binds (memory, compute, or transc: the transcendental "
                       "units)", caption_justify="left")
    nt.add_column("module: op", overflow="fold")  # the one column that wraps
    for col in ("ph", "×", "FLOP", "bytes", "FLOP/B", "bound", "time", "share"):
        nt.add_column(col, justify="left" if col in ("ph", "bound") else "right", no_wrap=True)
    for n in sorted(r["nodes"], key=lambda n: -n["seconds"])[:top]:
        op = n["op"].removeprefix("aten.").removesuffix(".default")
        nt.add_row(f"{n['module'] or '(top)'}: {op}", _PHASE.get(n["phase"], n["phase"][:3]), str(n["repeat"]),
                   short(n["flops"], "FLOP"), short(n["fused_bytes" if not unfused else "bytes"], "B"),
                   f"{n['intensity']:.3g}" if n["intensity"] is not None else "-", _BOUND.get(n["bound"], n["bound"]),
                   _fmt_s(n["seconds"]),
                   f"{100 * n['share']:.1f}%")
    c.print(nt)
    if crossing_symbol:
        ct = Table(title=f"Ridge crossings in {crossing_symbol} (others at the sizes above)", **narrow)
        ct.add_column("module: op", overflow="fold")
        ct.add_column("ph", no_wrap=True)
        for col in ("FLOP/byte", "crossing", "compute-bound when"):
            ct.add_column(col, overflow="fold")
        for x in r["crossings"]:
            op = x["op"].removeprefix("aten.").removesuffix(".default")
            ct.add_row(f"{x['module'] or '(top)'}: {op}", _PHASE.get(x["phase"], x["phase"][:3]), x["intensity_formula"],
                       " or ".join(x["solution"]) if x["solution"] else "-", x["compute_bound"])
        c.print(ct)
    for note in r["notes"]:
        c.print(f"note: {note}")


def _count(n: int) -> str:
    for u, f in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.4g}{u}"
    return str(n)


def model_lines(an, sizes, tc: dict) -> list[str]:
    """What ``mfu``/``time`` counted, as short lines: every size used, which of them are the
    model's defaults (not given with ``--set``), and the parameter counts.

    Args:
        an: the Analysis; sizes: the ``--set`` values; tc: :func:`symcost.passes.roofline.tokens_compute`.
    """
    used = tc["sizes"]
    given = [k for k in used if k in sizes]
    default = [k for k in used if k not in sizes and k not in an.pinned]
    note = ("all from --set" if not default else
            f"{' '.join(default)}: the model's defaults" + (f"; {' '.join(given)}: --set" if given else ""))
    P, P_all = tc.get("params_active_matmul", tc["params_matmul"]), tc["params_matmul"]
    lines = [f"sizes: {' '.join(f'{k}={v}' for k, v in used.items())}", f"  ({note})",
             f"parameters: {tc['params']:,} ({_count(tc['params'])}); matmul operands"
             + (f" (P of 6·N·P) {_count(P_all)}" if P == P_all else f" {_count(P_all)}")]
    if P != P_all:  # a mixture of experts: 6·N·P counts what one token runs through
        lines.append(f"  P of 6·N·P: {_count(P)} active matmul operands (R of the E experts per token)")
    if "six_np.groups" in tc:  # an encoder-decoder: each stack's weights on the tokens it processes
        lines.append("  6·N·P per stack: " + ", ".join(f"N = {g['tokens']} = {g['N']:,} tokens on P = {_count(g['P'])}"
                                                       for g in tc["six_np.groups"]))
    return lines

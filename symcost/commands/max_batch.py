"""``symcost max-batch``: the largest batch (or sequence) under a memory cap, and accumulation plans.

Registered in :data:`symcost.cli.COMMANDS`. The solving is
:meth:`symcost.passes.memory.MemoryModel.solve` (sympy, on the symbolic peak) and
:meth:`~symcost.passes.memory.MemoryModel.plan_accumulation`; this module parses and prints.
"""
from __future__ import annotations

import json
import time

from typing import TYPE_CHECKING

import click

from symcost.errors import SymcostError
from ._optimizer import optimizer_impl_option
from ._options import common, early_checks, every_layer_trace, parallel_options, parallel_request, trace_model
from ._pipeline import max_batch_pipeline, pipeline_options, pipeline_request

if TYPE_CHECKING:  # pragma: no cover - annotations only; sympy and torch load with the trace
    from symcost.passes import memory as mem


def _solution_json(an, sol: mem.Solution, mm: mem.MemoryModel, seconds: float) -> dict:
    out = {
        "model": an.model,
        "precision": mm.policy.name,
        "optimizer": mm.opt.name,
        "optimizer_impl": mm.impl,
        "solve": sol.var,
        "sizes": sol.sizes,
        "memory_cap": sol.cap,
        "max": sol.value,
        "memory_at_max": sol.memory_at,
        "memory_at_next": sol.memory_next,
        "check": sol.checked,
        "seconds": round(seconds, 4),
    }
    if sol.var == "B":
        out["max_batch"] = sol.value
    else:
        out[f"max_{sol.var}"] = sol.value
    if sol.modulus > 1:  # (formulas in a residue class of var: the answer and the next are of that class)
        out["residue_class"] = {"modulus": sol.modulus, "residue": sol.value % sol.modulus if sol.value
                                 else sol.next_value % sol.modulus}
        out["next_admissible"] = sol.next_value
    if sol.limited_by:
        out["limited_by"] = sol.limited_by
    if sol.dominant:
        out["dominant"] = {"component": sol.dominant[0], "bytes": sol.dominant[1]}
    if sol.value >= 1:  # what the peak at the answer is made of (the parts add up to memory_at_max)
        out["peak_parts"] = mm.peak_parts(**{**sol.sizes, sol.var: sol.value})
        host = _activation_host_bytes(an, {**sol.sizes, sol.var: sol.value})
        if host is not None:
            out["activation_offload_host"] = host
    return out


def _activation_host_bytes(an, at) -> int | None:
    """Pinned host bytes ``--offload-activations`` holds at the sizes ``at`` (the packed saved
    tensors at the end of the forward: :func:`symcost.passes.offload.activation_summary`), None
    without the option."""
    from symcost.frontends.layout import layout_of

    if not layout_of(an).offload_activations:
        return None
    from symcost.passes.offload import activation_summary

    return int(activation_summary(an, at)["values"]["host"]["total"])


#: exit status when not even B = 1 (S = 1, a micro-batch of 1) fits under the cap; the output says
#: what dominates (bad input exits with 2)
NOTHING_FITS = 3


@click.command(name="max-batch")
@click.argument("model", default="cs336-lm")
@common
@click.option("--memory", "memory", default="80GiB", show_default=True,
              help="memory cap per device: a number with KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal) or B; "
                   "a bare number is bytes and must be at least 1 MiB (80 alone is refused: write 80GiB)")
@click.option("--optimizer", default="adamw", show_default=True,
              help="adamw, adam, sgd (momentum), sgd-nomomentum, adafactor")
@optimizer_impl_option
@click.option("--torch-device", "device", default="cuda", show_default=True,
              help="cuda, cpu, xpu, mtia: the device type the step runs on (decides the default optimizer implementation)")
@click.option("--solve", "var", default="B", show_default=True,
              help="B (largest batch), S (longest sequence at --set B) or a size of the model, such as a vision "
                   "model's image side IMG (largest side at --set B, within the residue class its formulas hold in)")
@click.option("--global-batch", type=int, default=None, help="plan gradient accumulation for this global batch")
@click.option("--devices", type=int, default=None,
              help="data-parallel devices (with --global-batch) [default: --dp N, else 1]")
@click.option("--checkpoint", "ckpt", default="none", show_default=True,
              help="activation checkpointing: none, every-layer, sqrt, optimal (the step is traced with "
                   "the plan applied; see docs/checkpoint.md)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@parallel_options
@pipeline_options
def max_batch(model, sets, config, attention, precision, debug, memory, optimizer, impl, device, var,
              global_batch, devices, ckpt, as_json):
    """Largest B with peak memory <= --memory, solved from the symbolic peak with sympy.

    MODEL: cs336-lm (default), gpt2, mlp, megatron-gpt, hf:MODEL_TYPE or path/file.py:factory.
    The peak is that of a steady-state training step (see docs/memory.md). With --global-batch
    and --devices: the micro-batch and accumulation steps K, B_global = B_micro x K x N_devices.
    With --dp N [--shard ...]: per rank of N data-parallel ranks (B is the rank's batch; the peak
    is the rank's, docs/parallel.md); --devices is then N. With --tp N [--sp]: per rank of N
    tensor-parallel ranks (Megatron plan), each running the whole batch. --solve IMG: the largest
    image side of a vision model whose side is a formula (hf:convnext, tv:, a factory's IMG), in
    the residue class mod the strides its formulas hold in (checked: M(IMG) <= cap < M(IMG + m));
    a side the trace pins (ViT's) is traced side by side, doubling then bisecting.
    Exit status 3 when not even 1 fits under --memory (the output names what dominates and what
    would fit: another precision or optimizer, checkpointing, the least cap).
    """
    early_checks(model, sets, config, attention, precision)  # no sympy or torch needed: answers at once
    from symcost.passes import memory as mem

    cap = mem.parse_memory(memory)
    mem.optimizer(optimizer)
    mem.resolve_impl(impl, device)
    import re

    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", var or "") or var in ("DP", "TP", "PP", "CP", "EP", "T"):
        raise SymcostError(f"--solve takes B, S or a size of the model (a vision model's image side IMG), got {var!r}")
    ctx = click.get_current_context(silent=True)
    preq = pipeline_request(ctx) if ctx is not None else None
    if preq is not None:
        for what, given in (("--solve S", var != "B"), ("--global-batch", global_batch is not None),
                            ("--checkpoint", ckpt != "none"), ("--devices", devices is not None)):
            if given:
                hint = " (--ac full|selective checkpoints every block under the pipeline)" if what == "--checkpoint" else ""
                raise SymcostError(f"max-batch --pp solves the micro-batch B alone: {what} with --pp is not modelled "
                                   f"yet{hint}")
        if any(s.partition("=")[0].strip() == "B" for s in sets):
            raise SymcostError("--set B conflicts with solving for B; leave B out")
        best = max_batch_pipeline(preq, model, sets, config, attention, precision, as_json, optimizer, cap)
        if best < 1:
            raise SystemExit(NOTHING_FITS)
        return
    dp, shard = parallel_request(click.get_current_context(silent=True))
    mem.check_layout(precision, dp, shard)  # a policy its framework runs only sharded: before the trace
    if dp is not None and devices is not None and devices != dp:
        raise SymcostError(f"--devices {devices} and --dp {dp} disagree: with --dp the devices are the DP ranks; "
                           "give one")
    ctx = click.get_current_context(silent=True)
    tp = ctx.find_root().meta.get("symcost.tp") if ctx is not None else None
    if tp is not None and global_batch is not None:
        raise SymcostError("--global-batch with --tp is not modelled yet (the plan counts data-parallel devices, "
                           "not TP groups); solve the rank's batch without it")
    if var not in ("B", "S") and ckpt != "none":
        raise SymcostError(f"--checkpoint with --solve {var} is not modelled yet (the plans are searched over B and S); "
                           f"solve for B at --set {var}=... instead")
    ck_layout = None
    if (dp is not None or tp is not None) and ckpt != "none":
        ck_layout = _checkpoint_layout(ctx, ckpt)
    explicit_devices = devices is not None
    devices = devices if devices is not None else (dp or 1)
    if global_batch is not None:
        if global_batch <= 0 or devices <= 0:
            raise SymcostError("--global-batch and --devices must be positive integers")
        if global_batch % devices:
            raise SymcostError(
                f"global batch {global_batch} is not divisible by {devices} devices "
                f"(B_global = B_micro x K x N_devices); use a multiple of {devices}"
            )
        if var != "B":
            raise SymcostError("--global-batch plans the batch; it cannot be combined with --solve S")
    elif explicit_devices and dp is None and devices != 1:
        raise SymcostError("--devices applies with --global-batch")
    from symcost.passes.checkpoint import KINDS, plan_memory

    if ckpt not in KINDS:
        raise SymcostError(f"unknown --checkpoint {ckpt!r}; accepted: {', '.join(KINDS)}")
    sets_b = [s for s in sets if s.partition("=")[0].strip() == var]
    if sets_b:
        raise SymcostError(f"--set {sets_b[0]} conflicts with solving for {var}; leave {var} out")
    an, sizes = trace_model(model, sets, config, attention, precision, quiet=as_json)
    t0 = time.perf_counter()
    mm = mem.memory_model(an, precision, optimizer, impl, device)
    if ckpt != "none":  # the step with the plan chosen at each size: its memory replaces the plain one
        ck = None
        if ck_layout is not None:  # a data-parallel rank: planned over the rank's step (docs/checkpoint.md)
            if getattr(an, "stacks", None):
                raise SymcostError(f"--checkpoint with --dp on a model of several stacks ({an.model}: "
                                   f"{', '.join(an.stacks)}) is not modelled yet; --ac full checkpoints every block "
                                   "of every stack under the layout")
            from .checkpoint import _stack_every_layer

            ck = _stack_every_layer(model, config, attention, precision, sizes, as_json, layout=ck_layout)
            t0 = time.perf_counter()
        elif getattr(an, "stacks", None):  # several stacks: planned per stack (docs/checkpoint.md)
            from symcost.passes.checkpoint.stacks import PLANS as STACK_PLANS

            if ckpt not in STACK_PLANS:  # (before the second trace)
                raise SymcostError(f"--checkpoint {ckpt} is not planned on a model of several stacks ({an.model}: "
                                   f"{', '.join(an.stacks)}; each checkpoint holds one block there); accepted: "
                                   f"{', '.join(p for p in STACK_PLANS if p != 'none')}")
            from .checkpoint import _stack_every_layer

            ck = _stack_every_layer(model, config, attention, precision, sizes, as_json)
            t0 = time.perf_counter()
        elif "L" in an.symbols and an.layer_container is not None:
            every_layer_trace(an, model, config, attention, precision, sizes, quiet=as_json)
            t0 = time.perf_counter()
        mm, sizes = plan_memory(an, ckpt, sizes, optimizer, impl, device, ck=ck)
    if global_batch is not None:
        try:
            plan = mm.plan_accumulation(global_batch, devices, cap, **sizes)
        except mem.NothingFits as e:
            click.echo(f"symcost: {e}", err=True)
            raise SystemExit(NOTHING_FITS) from None
        seconds = time.perf_counter() - t0
        _print_plan(an, mm, plan, seconds, as_json, sizes)
        return
    if var in (getattr(an, "pinned", {}) or {}) and var not in ("B", "S") and global_batch is None:
        # a size the trace pinned (ViT's image side): no formula in it, so the sides are traced
        an, mm, sol = _solve_by_traces(an, var, cap, sizes, model, sets, config, attention, precision, as_json,
                                       optimizer, impl, device)
    else:
        sol = mm.solve(cap, var, **sizes)
    seconds = time.perf_counter() - t0
    ck_plan = mm.plan(**{**sizes, var: max(sol.value, 1)}) if ckpt != "none" else None
    # nothing fits: what would, from the same trace (other policies, optimizers, checkpointing, cap)
    alts = mem.alternatives(mm, cap, var, sizes, checkpointing=ck_plan is None and an.parallel is None,
                            least=sol.next_value or 1) \
        if sol.value < 1 and not sol.limited_by else None
    if as_json:
        js = _solution_json(an, sol, mm, seconds)
        if an.parallel is not None and an.parallel.startswith("tp"):
            js["parallel"] = {"tp": sol.sizes.get("TP"), "sp": an.parallel == "tp+sp", "per_rank": True}
        elif an.parallel is not None:
            js["parallel"] = {"dp": sol.sizes.get("DP"), "shard": an.parallel, "per_rank": True}
        if ck_plan is not None and hasattr(ck_plan, "blocks"):  # (several stacks: the plan per stack)
            js["checkpoint"] = {"kind": ckpt, "plan": ck_plan.modules(), "several_stacks": True,
                                "blocks": ck_plan.blocks, "lengths": ck_plan.lengths,
                                "recompute_flops": mm.recompute(**{**sizes, var: max(sol.value, 1)})}
        elif ck_plan is not None:
            js["checkpoint"] = {"kind": ckpt, "plan": ck_plan.modules(), "L": ck_plan.L,
                                "segments": [list(x) for x in ck_plan.segments]}
        if alts is not None:
            js["alternatives"] = alts
        click.echo(json.dumps(js, indent=1))
    else:
        line = None
        if ck_plan is not None and hasattr(ck_plan, "blocks"):
            line = (f"  checkpoint {ckpt} at {var} = {max(sol.value, 1)}, per stack: "
                    + "; ".join(f"{c}: {len(ck_plan.blocks[c])} of {n} blocks" for c, n in ck_plan.lengths.items())
                    + f" ({', '.join(ck_plan.modules()) or 'none'})")
        elif ck_plan is not None:  # (under the title, which _print_solution prints)
            line = (f"  checkpoint {ckpt} at {var} = {max(sol.value, 1)}: {len(ck_plan.segments)} segment(s) "
                    f"of L = {ck_plan.L} blocks: {', '.join(ck_plan.modules()) or 'none'}")
        _print_solution(an, mm, sol, seconds, sizes, alts, line)
    if sol.value < 1:
        raise SystemExit(NOTHING_FITS)


def _checkpoint_layout(ctx, ckpt: str):
    """The layout of the step with every block checkpointed that ``--checkpoint`` plans a
    data-parallel rank from: the run's layout (``--dp N --shard ...``) with ``ac="full"``
    (torchtitan's per-block checkpoint, :class:`~symcost.passes.checkpoint.memory.RankCheckpointedMemory`).

    Raises:
        SymcostError: in one line, before any trace: a kind not planned there, ``--ac`` given too,
            a layout with other dimensions than data parallelism (``--tp``, ``--cp``, ``--ep``) or
            options that change the checkpoint (``--compile``, ``--offload-activations``)."""
    import dataclasses

    from symcost.passes.checkpoint.memory import RankCheckpointedMemory

    from ._options import layout_request

    from symcost.passes.checkpoint import KINDS

    layout, _ = layout_request(ctx)
    other = [flag for flag, on in (("--tp", layout.tp), ("--cp", layout.cp), ("--ep", layout.ep),
                                   ("--compile", layout.compile),
                                   ("--offload-activations", layout.offload_activations)) if on]
    if layout.shard is None or other:
        raise SymcostError(f"--checkpoint is not modelled with {', '.join(other) or '--tp'} yet (the planning pass "
                           "plans a data-parallel rank: --dp N --shard ...); --ac full traces every block "
                           "checkpointed under the layout")
    if ckpt not in KINDS:
        raise SymcostError(f"unknown --checkpoint {ckpt!r}; accepted: {', '.join(KINDS)}")
    if ckpt not in RankCheckpointedMemory.KINDS:
        raise SymcostError(f"--checkpoint {ckpt} is not planned on a data-parallel rank (segments of several "
                           "blocks; each checkpoint holds one block there, as --ac full); accepted: "
                           f"{', '.join(k for k in RankCheckpointedMemory.KINDS if k != 'none')}")
    if layout.ac is not None:
        raise SymcostError(f"--checkpoint {ckpt} chooses which blocks to checkpoint and --ac {layout.ac} checkpoints "
                           "every block: give one")
    return dataclasses.replace(layout, ac="full")


def _solve_by_traces(an, var, cap, sizes, model, sets, config, attention, precision, quiet, optimizer, impl, device):
    """The largest ``var`` whose traced peak fits under ``cap``, for a size the trace pinned (a
    ViT's image side: its (IMG/P)^4 attention-score terms are above the fit's cubes, so no formula
    in IMG exists): each candidate is traced at its own value (its own regime, pinned there) and
    its memory model's peak taken at ``sizes``; the peak does not decrease as the side grows, so
    the answer is found by doubling from the traced value, then bisection, over the sides the
    model accepts (``spec.check``; its "multiple" limits make them periodic, period m). Returns
    ``(analysis at the answer, its memory model, Solution)``, the Solution checked M(x) <= cap <
    M(x + m) from the traces at x and x + m (``inequality`` says how many sides were traced).

    Raises:
        SymcostError: as the trace (a side PyTorch refuses is skipped as not admissible)."""
    from symcost.passes import memory as mem

    others = {k: v for k, v in sizes.items() if k != var}
    traced: dict[int, tuple] = {}

    def admissible(x):
        vals = {**an.spec.defaults, **dict(getattr(an, "pinned", {}) or {}), **others, var: x}
        vals.update({a: vals[b] for a, b in an.spec.tied.items() if b in vals})
        return x >= 1 and an.spec.check(vals) is None

    def M(x):
        if x not in traced:
            a, _ = trace_model(model, tuple(sets) + (f"{var}={x}",), config, attention, precision, quiet=quiet)
            m = mem.memory_model(a, precision, optimizer, impl, device)
            traced[x] = (a, m, m.peak(**others))
        return traced[x][2]

    # the admissible sides repeat every period (the model's "multiple" limits on var); among them
    # the peak does not decrease, so: doubling from the traced side, then bisection, over k in
    # x_k = least + k * period
    import math

    period = 1
    for c in getattr(an.spec, "constraints", ()) or ():
        if c.kind == "multiple" and c.a == var and isinstance(c.b, int):
            period = math.lcm(period, c.b)
    x0 = int(an.pinned[var])
    least = next((y for y in range(1, x0 + period + 1) if admissible(y)), x0)

    def x(k):
        return least + k * period

    def fits(k):
        return k >= 0 and admissible(x(k)) and M(x(k)) <= cap

    k0 = max(0, (x0 - least) // period)
    if not fits(0):
        lo, hi = -1, 0
    elif fits(k0):
        lo, hi = k0, max(2 * k0, 1)
        while fits(hi):
            lo, hi = hi, 2 * hi
    else:
        lo, hi = 0, k0
    while hi - lo > 1:  # fits(lo) (lo = -1: nothing), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    lo = x(lo) if lo >= 0 else 0
    value = lo
    at = value if value >= 1 else least
    M(at)
    a, m, _ = traced[at]
    nxt = value + period if value >= 1 else least
    limited = None if admissible(nxt) else an.spec.check({**an.spec.defaults, **others, var: nxt})
    sol = mem.Solution(var=var, value=value, cap=cap, memory_at=M(value) if value >= 1 else None,
                       memory_next=M(nxt) if admissible(nxt) else None,
                       sizes={**{k: v for k, v in a.pinned.items() if k != var}, **others},
                       inequality=f"peak({var}) <= {cap}, {var} traced at {len(traced)} sides ({var} is pinned in "
                                  f"each trace: {a.pin_reasons.get(var, 'its regime')})",
                       limited_by=limited, next_value=nxt, modulus=period)
    sol.checked = (value == 0 or sol.memory_at <= cap) and (limited is not None or sol.memory_next > cap)
    if value == 0:
        sol.dominant = m.dominant(**others)
    return a, m, sol


def _sizes_line(sol_sizes: dict, given: dict) -> str:
    return ", ".join(f"{k}={v}" + ("" if k in given else " (default)") for k, v in sol_sizes.items())


#: the max-batch table's rows: what the peak is made of (they add up to it), and their labels
PEAK_ROWS = (
    ("params", "parameters"), ("optimizer", "optimizer state"), ("master_weights", "master weights"),
    ("grad_buffer", "gradient buffer (persistent)"), ("buffers", "buffers"), ("inputs", "inputs"),
    ("gradients", "gradients allocated so far"),
    ("forward", "forward tensors still live (activations saved for backward, ...)"),
    ("backward", "backward temporaries (activation gradients, ...)"),
    ("optimizer_step", "optimizer-step temporaries"),
    ("checkpointed", "live set of the checkpointed step (gradients so far, kept inputs, recomputed activations, temporaries)"),
)


def _print_solution(an, mm: mem.MemoryModel, sol: mem.Solution, seconds: float, given: dict,
                    alts: list | None = None, checkpoint_line: str | None = None) -> None:
    import sympy
    from rich.table import Table

    from symcost.passes import memory as mem
    from symcost.render.report import console, human, provenance

    c = console()
    v = sol.var
    att = an.spec.extra.get("attention")
    c.print(f"[bold]symcost max-batch[/bold] {an.model}: precision {mm.policy.name} ({mm.bytes_per_param()} "
            f"bytes/param), optimizer {mm.opt.name} ({mm.impl})" + (f", attention {att}" if att else "")
            + f", steady-state step ({provenance(an)})")
    if checkpoint_line:
        c.print(checkpoint_line)
    pinned = getattr(an, "pinned", {}) or {}
    if pinned:
        why = getattr(an, "pin_reasons", None) or {}  # (the trace's reason for each; size 1 where it kept none)
        c.print("  pinned: " + ", ".join(f"{k} = {v} ({why.get(k, 'size 1 runs other kernels')})"
                                         for k, v in pinned.items()))
    if an.parallel is not None and an.parallel.startswith("tp"):
        c.print(f"  per rank: one of TP = {sol.sizes.get('TP')} tensor-parallel ranks (Megatron plan"
                + (", sequence parallel" if an.parallel == "tp+sp" else "")
                + f"; every rank runs the whole batch {v}, the peak is the rank's, docs/parallel.md §11)")
    elif an.parallel == "ep":
        c.print(f"  per rank: one of EP = {sol.sizes.get('EP')} expert-parallel ranks (E/EP experts each, tokens by "
                f"all-to-all; {v} is the rank's, the peak is the rank's, docs/parallel.md §14)")
    elif an.parallel is not None:
        from symcost.frontends.layout import layout_of

        off = (", --offload: parameters, gradients and optimizer state on the host, the peak is the device's"
               if layout_of(an).offload else "")
        if layout_of(an).ep_fsdp:  # (docs/parallel.md §14.6)
            dp, ep = sol.sizes.get("DP"), sol.sizes.get("EP")
            c.print(f"  per rank: one of DP x EP = {dp} x {ep} ranks, --shard {an.parallel} (the dense parameters over "
                    f"all of them, the rank's E/EP experts over DP; {v} is the rank's, the peak is the rank's, "
                    "docs/parallel.md " + ("§14.11)" if layout_of(an).ep_replicate else "§14.6)"))
        else:
            c.print(f"  per rank: one of DP = {sol.sizes.get('DP')} ranks, --shard {an.parallel}{off} ({v} is the rank's; "
                    "the peak is the rank's, docs/parallel.md)")
    from symcost.frontends.layout import layout_of

    if layout_of(an).compile:
        c.print("  --compile: every block compiled as torchtitan's apply_compile (AOTAutograd, inductor's partition): "
                "the saved tensors and the peak are the compiled step's (docs/memory.md)")
    if layout_of(an).offload_activations:
        c.print("  --offload-activations: every saved tensor in pinned host memory between forward and backward "
                "(save_on_cpu(pin_memory=True)); the peak is the device's, with each copy back while its backward "
                "node runs (docs/memory.md)")
    c.print(f"  sizes: {_sizes_line(sol.sizes, given)}")
    c.print(f"  memory cap: {human(sol.cap, 'B')} ({sol.cap:,} bytes)")
    if sol.bound is not None:
        c.print(f"  solved with sympy: {sol.inequality}  →  {v} ≤ {sympy.N(sol.bound, 12)}")
    else:
        c.print(f"  solved: {sol.inequality}")
    if sol.modulus > 1:
        r = (sol.value or sol.next_value) % sol.modulus
        c.print(f"  {v} ≡ {r} (mod {sol.modulus}): the values this trace's formulas hold for (its strides floor {v}) "
                f"and the model accepts; the answer is the largest of them, checked against the next, {v} + "
                f"{sol.modulus} (another class: trace with --set {v}=... and solve for B)")
    if sol.value >= 1:
        c.print(f"[bold]  largest {v} = {sol.value}[/bold]")
        ok = "✓" if sol.checked else "✗ (check failed)"
        nxt = f"< M({sol.next_value}) = {human(sol.memory_next, 'B')}" if not sol.limited_by else ""
        c.print(f"  check: M({sol.value}) = {human(sol.memory_at, 'B')} ({sol.memory_at:,} B) ≤ cap {nxt} {ok}")
        if sol.limited_by:
            c.print(f"  limited by the model: {sol.limited_by}")
        at = {**sol.sizes, v: sol.value}
        parts = mm.peak_parts(**at)
        comp = mm.components(**at)
        t = Table(title=f"What the peak at {v} = {sol.value} is made of (static parts, then the live set at the "
                        "peak)", title_justify="left")
        t.add_column("part")
        t.add_column("bytes", justify="right")
        t.add_column("")
        for k, label in PEAK_ROWS:
            if k in parts:
                t.add_row(label, f"{parts[k]:,}", human(parts[k], "B"))
        t.add_row("[bold]peak (the sum)[/bold]", f"{parts['peak']:,}", human(parts["peak"], "B"))
        c.print(t)
        c.print(f"  peak reached at: {parts['where']}")
        c.print(f"  over the whole step (not all live at once): gradients {human(comp['grads'], 'B')}, "
                f"activations saved for backward {human(comp['activations'], 'B')}")
        host = _activation_host_bytes(an, at)
        if host is not None:
            c.print(f"  --offload-activations at {v} = {sol.value}: {human(host, 'B')} of pinned host memory "
                    "(the saved tensors packed by the end of the forward; not in the device's peak)")
    else:
        name, nbytes = sol.dominant
        c.print(f"[bold red]  even {v} = {sol.next_value} does not fit[/bold red]: M({sol.next_value}) = "
                f"{human(sol.memory_next, 'B')} > cap; "
                f"{mem.dominant_text(name, nbytes, sol.cap)}")
        if alts:
            c.print("  what would fit (same model and sizes, from this trace's memory model):")
            for line in mem.alternatives_text(alts, v, sol.cap):
                c.print(f"    {line}")
    c.print(f"  solved in {seconds:.3f} s after tracing")


def _print_plan(an, mm, plan: mem.AccumulationPlan, seconds: float, as_json: bool, sizes) -> None:
    from symcost.render.report import console, human

    if as_json:
        click.echo(json.dumps({
            "model": an.model, "precision": mm.policy.name, "optimizer": mm.opt.name,
            "optimizer_impl": mm.impl, "memory_cap": plan.cap,
            "global_batch": plan.global_batch, "devices": plan.devices,
            **({"parallel": {"dp": plan.devices, "shard": an.parallel, "per_rank": True}} if an.parallel else {}),
            "per_device_batch": plan.per_device_batch, "micro_batch": plan.micro_batch,
            "accumulation_steps": plan.accumulation_steps, "max_micro_batch": plan.max_micro_batch,
            "exact_split": plan.exact, "note": plan.note,
            "memory_per_device": plan.memory, "memory_without_accumulation": plan.memory_without,
            "memory_saved": plan.memory_without - plan.memory,
            "flops_per_device_per_step": plan.flops_per_device, "flops_per_step": plan.flops_total,
            "seconds": round(seconds, 4),
        }, indent=1))
        return
    c = console()
    c.print(f"[bold]symcost max-batch[/bold] {an.model}: accumulation plan, precision {mm.policy.name}, "
            f"optimizer {mm.opt.name} ({mm.impl})")
    c.print(f"  global batch {plan.global_batch} over {plan.devices} device(s): {plan.per_device_batch} per device; "
            f"memory cap {human(plan.cap, 'B')}")
    c.print(f"[bold]  B_global = B_micro × K × N_devices = {plan.micro_batch} × {plan.accumulation_steps} × "
            f"{plan.devices} = {plan.micro_batch * plan.accumulation_steps * plan.devices}[/bold]   "
            f"(micro-batch B_micro = {plan.micro_batch}, accumulation steps K = {plan.accumulation_steps})")
    if plan.accumulation_steps > 1:
        plain = mm.solve(plan.cap, "B", **{k: v for k, v in sizes.items() if k != "B"}).value
        if plain > plan.max_micro_batch:
            b = plan.max_micro_batch + 1
            extra = mm.peak(accumulate=True, B=b, **sizes) - mm.peak(B=b, **sizes)
            grads = mm.components(B=b, **sizes)["grads"]
            c.print(f"  the largest micro-batch under accumulation is {plan.max_micro_batch}, one step alone fits "
                    f"B = {plain} (max-batch): the gradient buffers ({human(grads, 'B')}) stay live across the "
                    f"K micro-batches, so at B = {b} a micro-step needs {human(extra, 'B')} more than a plain "
                    f"step and passes the cap")
    if plan.note:
        c.print(f"  {plan.note}")
    c.print(f"  peak per device: {human(plan.memory, 'B')} (without accumulation, B = {plan.per_device_batch}: "
            f"{human(plan.memory_without, 'B')}; saved {human(plan.memory_without - plan.memory, 'B')})")
    c.print(f"  model FLOPs per optimizer step: {human(plan.flops_per_device, 'FLOP')} per device, "
            f"{human(plan.flops_total, 'FLOP')} in all (the same as without accumulation: K micro-steps of "
            f"B_micro = one step of B_micro × K)")
    c.print(f"  solved in {seconds:.3f} s after tracing")

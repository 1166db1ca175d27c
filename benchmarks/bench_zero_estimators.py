"""DeepSpeed's ZeRO model-state estimators side by side with symcost's per-rank model states
(issue 15; docs/parallel.md, "Peers: DeepSpeed's estimator and FSDPMemTracker").

The peer is DeepSpeed's own code, called in this run:
``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold`` and
``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold`` (their printed
tables are captured and parsed, and checked against the exact bytes of the functions they call,
``estimate_zero{2,3}_model_states_mem_needs``). symcost's side is
``symcost.passes.parallel.model_state_bytes`` (ZeRO Table 1 per rank) on the parameter count of
the traced model and, for ZeRO-3, the parameter shard FSDP2 gives rank 0 in the trace (padding
included, ``summary(an, sizes=...)["values"]``), precision ``bf16-true-fp32-master`` (bf16
weights and gradients, fp32 master weights and Adam moments: the paper's 2 + 2 + 12 bytes and
DeepSpeed's mixed-precision training).

Configurations: the ZeRO paper's Table 1 (7.5B parameters, 64 devices; DeepSpeed's ZeRO-3 needs
a largest layer, which the paper does not give: ``--paper-largest``, default a 4·d² MLP matrix of
d = 4096) and the real configs of tests/data/configs at DP 8 (one node of 8) and 64 (8 nodes).
DeepSpeed has no DDP or ZeRO-1 estimator; those rows show symcost alone.

DeepSpeed prints "GB" but divides by 2**30 (GiB); every size here is GiB.

Usage: ``python benchmarks/bench_zero_estimators.py [--configs llama-3-8b ...] [--dp 8 64]
[--show-deepspeed]``. Needs deepspeed (CPU-only is enough, no ops built)::

    python -m venv /tmp/dsvenv --system-site-packages
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed
    PYTHONPATH=$PWD /tmp/dsvenv/bin/python benchmarks/bench_zero_estimators.py

(or ``pip install -e .[bench]``). Without deepspeed it says so and exits 2. Asserts nothing
about the ratios; the differences are explained in docs/parallel.md.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("llama-3-8b", "llama-2-70b", "mistral-7b")
GPUS_PER_NODE = 8
PRECISION = "bf16-true-fp32-master"
INSTALL = ("deepspeed is not importable: this benchmark compares against DeepSpeed's own estimators "
           "and shows no results without them. Install it (CPU-only, no ops built), e.g.\n"
           "  python -m venv /tmp/dsvenv --system-site-packages\n"
           "  DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed\n"
           "  PYTHONPATH=$PWD /tmp/dsvenv/bin/python benchmarks/bench_zero_estimators.py\n"
           "or: pip install -e '.[bench]'")
GiB = 2 ** 30


def import_deepspeed():
    """DeepSpeed's two estimator modules, or exit 2 with how to install it."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import deepspeed
            from deepspeed.runtime.zero import stage3, stage_1_and_2
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
        print(f"{INSTALL}\n({type(e).__name__}: {e})", file=sys.stderr)
        sys.exit(2)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return deepspeed.__version__, stage_1_and_2, stage3


ROW = re.compile(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.*)$")


def deepspeed_rows(s12, s3, total: int, largest: int, dp: int) -> dict[str, list[dict]]:
    """DeepSpeed's printed rows per stage: ``{"zero2": [...], "zero3": [...]}``, each row
    ``{"options", "cpu", "gpu"}`` in bytes (the exact values of the function the printing one
    calls, checked against what it printed to 0.01 GiB) plus ``printed`` (its text)."""
    nodes = max(1, dp // GPUS_PER_NODE)
    per_node = dp // nodes
    out = {}
    for stage, cold, exact, extra in (
            ("zero2", s12.estimate_zero2_model_states_mem_needs_all_cold,
             s12.estimate_zero2_model_states_mem_needs, {}),
            ("zero3", s3.estimate_zero3_model_states_mem_needs_all_cold,
             s3.estimate_zero3_model_states_mem_needs, {"largest_layer_params": largest})):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cold(total_params=total, num_gpus_per_node=per_node, num_nodes=nodes, **extra)
        rows = []
        for line in buf.getvalue().splitlines():
            m = ROW.match(line)
            if not m:
                continue
            # "offload_optimizer=cpu " (or "=OffloadDeviceEnum.cpu", as Python 3.11+ formats the enum)
            opts = {k: v.rpartition(".")[2] for k, v in
                    (kv.split("=") for kv in m.group(3).replace(" ", "").split(","))}
            if stage == "zero2":
                kw = {"cpu_offload": opts["offload_optimizer"] == "cpu"}
            else:
                kw = {"cpu_offload": opts["offload_optimizer"] == "cpu",
                      "cpu_offload_params": opts["offload_param"] == "cpu", "zero_init": opts["zero_init"] == "1"}
            cpu, gpu = exact(total_params=total, num_gpus_per_node=per_node, num_nodes=nodes, **extra, **kw)[:2]
            assert abs(cpu / GiB - float(m.group(1))) < 0.006 and abs(gpu / GiB - float(m.group(2))) < 0.006, line
            rows.append({"options": opts, "cpu": cpu, "gpu": gpu, "printed": line})
        out[stage] = rows
        out[stage + "_text"] = buf.getvalue()
    return out


def symcost_states(P: int, dp: int, zero3_shard: int | None = None) -> dict[str, dict]:
    """symcost's per-rank model states (bytes) per strategy: DDP, ZeRO-1, ZeRO-2 (DeepSpeed's flat
    partition, ceil(P/DP) each) and ZeRO-3 (the traced FSDP2 shard when given, else P/DP)."""
    from symcost.passes.parallel import model_state_bytes

    flat = -(-P // dp)
    out = {s: {k: int(v) for k, v in model_state_bytes(P, dp, s, PRECISION, "adamw", flat).items()}
           for s in ("ddp", "zero1", "zero2")}
    out["zero3"] = {k: int(v) for k, v in model_state_bytes(
        P, dp, "zero3", PRECISION, "adamw", zero3_shard if zero3_shard is not None else flat).items()}
    return out


def largest_layer(spec, values) -> tuple[int, int]:
    """(total parameters, largest layer) by DeepSpeed's rule (``stage3.model_to_params``: the module
    with the most parameters of its own, ``parameters(recurse=False)``), on the model built on the
    meta device; tied parameters once (DeepSpeed dedups by ``data_ptr``, which meta tensors lack:
    by identity here)."""
    import torch

    with torch.device("meta"):
        m = spec.build(values)
    total = sum({id(p): p.numel() for p in m.parameters()}.values())
    return total, max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())


def fmt(b) -> str:
    return "—" if b is None else f"{b / GiB:.2f}"


def ratio(a, b) -> str:
    return f"{a / b:.3f}" if a is not None and b else "—"


def table(name: str, P: int, largest: int, dp: int, ds: dict, sym: dict, seconds: str) -> None:
    """One configuration: DeepSpeed's rows (its per-GPU and per-CPU bytes, and the formula its source
    computes the GPU bytes with) beside symcost's per-rank model states for the same strategy, the
    ratio, and for ZeRO-3 the ratio without DeepSpeed's largest-layer term 4·LL."""
    nodes = max(1, dp // GPUS_PER_NODE)
    print(f"\n{name}: P = {P:,} parameters, DeepSpeed's largest layer LL = {largest:,}; DP = {dp} "
          f"({nodes} node(s) x {dp // nodes}); {seconds}")
    print(f"  {'strategy  DeepSpeed options':<50}{'DS GPU':>8}{'DS CPU':>9}  {'DS GPU formula':<15}"
          f"{'symcost':>8}  {'symcost formula':<16}{'DS/sym':>7}{'(DS-4LL)/sym':>13}")
    for label, s, what in (("DDP (no DeepSpeed estimator)", "ddp", "16P"),
                           ("ZeRO-1 (no DeepSpeed estimator)", "zero1", "4P+12P/DP")):
        print(f"  {label:<50}{'—':>8}{'—':>9}  {'—':<15}{fmt(sym[s]['total']):>8}  {what:<16}{'—':>7}{'—':>13}")
    for stage, label in (("zero2", "ZeRO-2"), ("zero3", "ZeRO-3")):
        for r in ds[stage]:
            o = r["options"]
            off_opt = o.get("offload_optimizer") == "cpu"
            off_par = o.get("offload_param") == "cpu"
            short = {"offload_optimizer": "opt", "offload_param": "param", "zero_init": "zero_init"}
            opts = " ".join(f"{short[k]}={v}" for k, v in o.items())
            ll = 4 * largest if stage == "zero3" else 0
            if stage == "zero2":
                dsf = "2P" if off_opt else "2P+18P/DP"
            else:
                dsf = "4LL" if off_par else ("4LL+2P/DP" if off_opt else "4LL+18P/DP")
            if off_par:  # no model state stays on the device: nothing of symcost's to compare
                mine, what = None, "(no offload)"
            elif off_opt:  # on the device: the bf16 parameters (ZeRO-2 whole, ZeRO-3 the shard)
                mine, what = sym[stage]["params"], "params: " + ("2P" if stage == "zero2" else "2P/DP")
            else:
                mine, what = sym[stage]["total"], "2P+14P/DP" if stage == "zero2" else "16P/DP"
            print(f"  {label + '  ' + opts:<50}{fmt(r['gpu']):>8}{fmt(r['cpu']):>9}  {dsf:<15}{fmt(mine):>8}  "
                  f"{what:<16}{ratio(r['gpu'], mine):>7}{ratio(r['gpu'] - ll, mine) if ll else '':>13}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS),
                    help="names of tests/data/configs/*.json (default: %(default)s)")
    ap.add_argument("--dp", nargs="*", type=int, default=[8, 64])
    ap.add_argument("--paper-largest", type=int, default=4 * 4096 ** 2,
                    help="largest layer of the ZeRO paper's 7.5B model for DeepSpeed's ZeRO-3 (not in the paper)")
    ap.add_argument("--show-deepspeed", action="store_true", help="also print DeepSpeed's own tables verbatim")
    args = ap.parse_args()

    version, s12, s3 = import_deepspeed()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.join(HERE, ".."))
    import sympy

    import symcost
    from symcost.passes.parallel import padded

    print(f"DeepSpeed {version} estimators vs symcost per-rank model states, {PRECISION}, AdamW; sizes in GiB")

    # the ZeRO paper, Table 1: a hypothetical 7.5B model on 64 devices (no trace: P is given)
    psi, nd = 7_500_000_000, 64
    t = time.perf_counter()
    ds = deepspeed_rows(s12, s3, psi, args.paper_largest, nd)
    t_ds = time.perf_counter() - t
    sym = symcost_states(psi, nd)
    table("ZeRO paper Table 1 (7.5B, 64 devices)", psi, args.paper_largest, nd, ds, sym,
          f"DeepSpeed {t_ds:.3f} s")
    print("  symcost in decimal GB (the paper's Table 1: 120, 31.4, 16.6, 1.88): "
          + ", ".join(f"{s} {sym[s]['total'] / 1e9:.3g}" for s in ("ddp", "zero1", "zero2", "zero3")))
    if args.show_deepspeed:
        print(ds["zero2_text"] + ds["zero3_text"])

    for name in args.configs:
        path = os.path.join(HERE, "..", "tests", "data", "configs", f"{name}.json")
        t = time.perf_counter()
        an = symcost.trace(path, sizes={"DP": min(args.dp)}, precision=PRECISION, shard="fsdp", use_cache=False)
        t_trace = time.perf_counter() - t
        spec = symcost.resolve(path)
        P_meta, largest = largest_layer(spec, dict(spec.defaults))
        for dp in args.dp:
            t = time.perf_counter()
            env = an.bind(DP=dp)
            P = int(sympy.sympify(an.params).xreplace(env))
            sym = symcost_states(P, dp, int(padded(an, env)["params_shard"]))  # rank 0's FSDP2 shard
            t_sym = time.perf_counter() - t
            assert P == P_meta, (P, P_meta)
            t = time.perf_counter()
            ds = deepspeed_rows(s12, s3, P, largest, dp)
            t_ds = time.perf_counter() - t
            table(name, P, largest, dp, ds, sym,
                  f"symcost trace {t_trace:.1f} s once, then {t_sym:.3f} s; DeepSpeed {t_ds:.3f} s")
            if args.show_deepspeed:
                print(ds["zero2_text"] + ds["zero3_text"])


if __name__ == "__main__":
    main()

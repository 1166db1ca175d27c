"""``symcost plan`` against Narayanan et al. 2021, Table 1, and the time of a 70B plan on 64 devices.

    python benchmarks/bench_plan.py [--rows 1.7B 18.4B ...] [--skip-70b]

For each row of Table 1 (D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021, arXiv:2104.04473: GPT, V = 51200, s = 2048, A100-80GB,
fp16 with fp32 master weights and Adam, full activation recomputation), it plans megatron-gpt at the
row's heads, width and layers on the row's GPU count and batch (a100-80gb, 80 GiB, both 1F1B and
interleaved 1F1B, micro-batch 1, 2, 4, 8), and prints:

* the published layout (t, p, d) and symcost's top layout;
* the published layout as Megatron-LM ran it (DDP, every block recomputed; the fastest micro-batch
  and schedule under symcost's model: Table 1 does not list them), its rank in symcost's list,
  and symcost's predicted MFU for it beside the published MFU;
* why symcost's top layout is faster, if it is: the step-time components that differ.

Published MFU here is model FLOPs (no recomputation, shared/conventions.md) per second over the
A100's 312 TFLOP/s: the paper's per-GPU TFLOP/s count F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
per iteration (recomputation included), so MFU = TFLOP/s × F_model / F / 312e12, with F_model
symcost's traced model FLOPs of the same batch.
"""
from __future__ import annotations

import argparse
import time

#: (name, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU): Table 1 of arXiv:2104.04473
TABLE1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
PREC = "bf16-true-fp32-master"
A100_PEAK = 312e12


def _lay(r):
    x = r["layout"]
    return (f"d{x['dp']} t{x['tp']} p{x['pp']} b{x['micro_batch']} m{x['microbatches']} {x['shard']} "
            f"ckpt={x['checkpoint']} {x['schedule']}")


def _why(top, pub):
    parts = []
    for k, label in (("compute", "compute"), ("tp_comm", "TP comm"), ("pp_comm", "PP p2p"),
                     ("bubble", "bubble"), ("dp_exposed", "exposed DP comm")):
        d = pub["time"][k] - top["time"][k]
        if abs(d) > 0.01 * pub["step_seconds"]:
            parts.append(f"{label} {'−' if d > 0 else '+'}{abs(d):.2f} s")
    lt, lp = top["layout"], pub["layout"]
    notes = []
    if lt["checkpoint"] == "none" and lp["checkpoint"] == "full":
        notes.append("fits without recomputation" + (f" ({lt['shard']} states)" if lt["shard"] != "ddp" else ""))
    if lt["tp"] < lp["tp"]:
        notes.append(f"less TP ({lt['tp']} < {lp['tp']}): fewer all-reduces on the critical path")
    return "; ".join(notes + parts)


def run_rows(names=None):
    from symcost.hardware.devices import get_device
    from symcost.passes.plan import plan, trace_for_plan

    dev = get_device("a100-80gb")
    out = []
    for name, a, h, l, t, p, n, G, tflops in TABLE1:
        if names and name not in names:
            continue
        sz = {"H": a, "D": h // a, "L": l, "V": 51200, "S": 2048}
        t0 = time.perf_counter()
        an = trace_for_plan("megatron-gpt", sz, PREC)
        res = plan(an, sz, dev, n, 80 * 2**30, G, PREC, schedules=("1f1b", "interleaved-1f1b"),
                   micro_batches=(1, 2, 4, 8), keep_all=True)
        secs = time.perf_counter() - t0
        d = n // (t * p)
        rows = res["layouts"]
        same = [i for i, r in enumerate(rows) if (r["layout"]["dp"], r["layout"]["tp"], r["layout"]["pp"]) == (d, t, p)]
        meg = [i for i in same if rows[i]["layout"]["shard"] == "ddp" and rows[i]["layout"]["checkpoint"] == "full"]
        F_paper = 96 * G * 2048 * l * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * l * h))
        F_model = res["model_flops_per_sequence"] * G
        pub_mfu = tflops * 1e12 * F_model / F_paper / A100_PEAK
        top = rows[0] if rows else None
        pub = rows[meg[0]] if meg else None
        out.append({"name": name, "params": res["params"], "published": (t, p, d, n, G), "pub_mfu": pub_mfu,
                    "pub_hfu": tflops * 1e12 / A100_PEAK, "top": top, "pub": pub,
                    "rank_layout": (same[0] + 1) if same else None, "rank_megatron": (meg[0] + 1) if meg else None,
                    "fits": len(rows), "considered": res["considered"], "seconds": secs})
    return out


def print_rows(out):
    print("| model | published t, p, d (GPUs, batch) | symcost top layout | published layout as run "
          "(DDP, full recompute) | its rank (any shard/ckpt; as run) | MFU published | MFU predicted "
          "(as run) | published/predicted | MFU predicted (top) | why the top is faster | plan s |")
    print("| --- " * 11 + "|")
    for r in out:
        t, p, d, n, G = r["published"]
        pub, top = r["pub"], r["top"]
        pm = pub["mfu"] if pub else float("nan")
        print(f"| {r['name']} ({r['params'] / 1e9:.1f}B traced) | t{t} p{p} d{d} ({n}, {G}) | "
              f"{_lay(top) if top else 'none fits'} | {_lay(pub) if pub else 'does not fit'} | "
              f"{r['rank_layout']}; {r['rank_megatron']} of {r['fits']} | {r['pub_mfu']:.1%} | {pm:.1%} | "
              f"{r['pub_mfu'] / pm:.2f} | {top['mfu']:.1%} | {_why(top, pub) if pub and top is not pub else '—'} | "
              f"{r['seconds']:.1f} |")


def bench_70b():
    """megatron-gpt at Llama-2-70B's width and depth (h 8192 = 64 × 128, L 80, V 32000, S 2048 (its 2048 learned positions): 65B
    parameters in Megatron's dense GPT layer) on 64 × h100-sxm, 80 GiB, global batch 512."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "symcost.cli", "plan", "megatron-gpt", "--devices", "64", "--device", "h100-sxm",
           "--memory", "80GiB", "--global-batch", "512", "--set", "H=64", "D=128", "L=80", "V=32000", "S=2048"]
    import os
    import tempfile

    env = {**os.environ, "COLUMNS": "160", "SYMCOST_CACHE_DIR": tempfile.mkdtemp(prefix="bench-plan-")}
    times = []
    for label in ("cold (trace + plan, empty trace cache)", "warm (the trace read from the cache)"):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        print(f"70B-class plan on 64 devices, {label}: {times[-1]:.1f} s wall (a fresh process)")
    print(f"\n$ symcost plan megatron-gpt --devices 64 --device h100-sxm --memory 80GiB --global-batch 512 "
          f"--set H=64 D=128 L=80 V=32000 S=2048\n{p.stdout}{p.stderr}")
    secs = times
    return secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=None)
    ap.add_argument("--skip-70b", action="store_true")
    args = ap.parse_args()
    if not args.skip_70b:
        bench_70b()
    t0 = time.perf_counter()
    out = run_rows(args.rows)
    print_rows(out)
    print(f"\n{len(out)} rows in {time.perf_counter() - t0:.1f} s (one --tp trace serves them all)")


if __name__ == "__main__":
    main()

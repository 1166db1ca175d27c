"""Data-parallel report from the trace cache: ``report --dp`` cold and warm against the same
model's single-device report, measured in the same run.

    python benchmarks/bench_parallel.py [CONFIG] [--dp 8] [--shard fsdp] [--set S=8192] [--repeat 3]

Each call is a fresh ``symcost`` process (interpreter start, imports, reading the entry,
evaluating, printing) in a temporary ``SYMCOST_CACHE_DIR``: first cold (the cache is empty: it
traces one rank on the fake process group), then warm (reads the entry) ``--repeat`` times. The
peer is the single-device ``report`` of the same model and sizes, cold and warm, in the same
cache folder. Prints wall and CPU seconds (CPU: user + system of the child, which a loaded
machine inflates less than wall time), the ratios data-parallel / single-device, and checks that
warm calls print what the cold call printed. Where ``max-batch`` takes ``--dp`` it is measured
the same way. Target (issue 15): warm ``report ... --dp 8 --shard fsdp --set S=8192 --memory
80GiB`` under 5 s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "tests", "data", "configs", "llama-3-8b.json")
sys.path.insert(0, HERE)
from bench_cache import run  # noqa: E402  (wall and CPU seconds of a command, as the cache benchmark times it)




def _answer(stdout: str):
    """The command's JSON without its own timings (``seconds``: how long the solve took)."""
    import json

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("seconds", "timings")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    try:
        return strip(json.loads(stdout))
    except ValueError:
        return stdout


def measure(cmd: list[str], env: dict, repeat: int) -> dict:
    cold = run(cmd, env)
    warm = [run(cmd, env) for _ in range(repeat)]
    return {"cold": cold[:2], "warm": (min(w for w, _, _ in warm), min(c for _, c, _ in warm)),
            "same": all(_answer(o) == _answer(cold[2]) for _, _, o in warm)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=os.path.normpath(DEFAULT))
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--shard", default="fsdp")
    ap.add_argument("--set", nargs="*", default=["S=8192"])
    ap.add_argument("--memory", default="80GiB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cli = [sys.executable, "-m", "symcost.cli"]
    common = [args.model, "--set", *args.set, "--memory", args.memory, "--json"]
    dp = ["--dp", str(args.dp), "--shard", args.shard]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="symcost-bench-parallel-") as d:
        env = dict(os.environ, SYMCOST_CACHE_DIR=d)
        rows["report (one device)"] = measure(cli + ["report", *common], env, args.repeat)
        rows[f"report --dp {args.dp} --shard {args.shard}"] = measure(cli + ["report", *common, *dp], env, args.repeat)
        helptext = subprocess.run(cli + ["max-batch", "--help"], env=env, capture_output=True, text=True).stdout
        if "--dp" in helptext:
            rows["max-batch (one device)"] = measure(cli + ["max-batch", *common], env, args.repeat)
            rows[f"max-batch --dp {args.dp} --shard {args.shard}"] = measure(cli + ["max-batch", *common, *dp], env,
                                                                            args.repeat)
    print(f"{args.model} --set {' '.join(args.set)} --memory {args.memory}")
    print(f"{'':38}{'cold wall':>10}{'cold cpu':>10}{'warm wall':>10}{'warm cpu':>10}  same")
    for name, r in rows.items():
        print(f"{name:38}{r['cold'][0]:10.2f}{r['cold'][1]:10.2f}{r['warm'][0]:10.2f}{r['warm'][1]:10.2f}  "
              f"{'yes' if r['same'] else 'NO'}")
    names = list(rows)
    ok = True
    for single, par in zip(names[0::2], names[1::2]):
        a, b = rows[single], rows[par]
        print(f"{par}: warm / one-device warm = {b['warm'][0] / a['warm'][0]:.2f} (wall), "
              f"{b['warm'][1] / a['warm'][1]:.2f} (cpu); cold / one-device cold = "
              f"{b['cold'][0] / a['cold'][0]:.2f} (wall), {b['cold'][1] / a['cold'][1]:.2f} (cpu)")
        under = b["warm"][0] < 5
        ok = ok and under and b["same"]
        print(f"  warm under 5 s: {'yes' if under else 'NO'} ({b['warm'][0]:.2f} s wall)")
    if not ok or not all(r["same"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Trace cache: the same ``symcost`` command cold (empty cache: traces) and warm (reads the entry).

    python benchmarks/bench_cache.py [MODEL] [--set B=8 S=4096] [--command eval] [--repeat 3]

Each run is a fresh ``symcost`` process (what a user's shell loop pays: interpreter start, imports,
reading the entry, evaluating, printing), in a temporary ``SYMCOST_CACHE_DIR``. Prints wall and
CPU seconds (CPU: user + system of the child, which a loaded machine inflates less than wall
time) of the cold call and of the warm calls side by side, the ratio, whether the warm process
imported torch, and checks that warm and cold print the same numbers. Target (issue 6): warm
``eval hf:llama --set B=8 S=4096`` under 1.5 s end to end. A warm ``serve`` of Llama-2-70B:

    python benchmarks/bench_cache.py tests/data/configs/llama-2-70b.json --command serve \
        --args '--device mi300x --context 8192' --set
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time


def run(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """Wall and CPU seconds of ``cmd`` and its stdout; exits on a failure (exit status 3 is an
    answer: ``max-batch`` when not even B = 1 fits under the cap)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode not in (0, 3):
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, cpu, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="hf:llama")
    ap.add_argument("--set", nargs="*", default=["B=8", "S=4096"])
    ap.add_argument("--command", default="eval")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--args", default="", help="more options for the command, one quoted string "
                    "(e.g. serve's: --args '--device mi300x --context 8192' --set)")
    args = ap.parse_args()
    cli = [sys.executable, "-m", "symcost.cli", args.command, args.model, *shlex.split(args.args)]
    if args.set:
        cli += ["--set", *args.set]
    if args.precision:
        cli += ["--precision", args.precision]
    probe = ("import sys, runpy; sys.argv = ['symcost'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('symcost.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED', file=sys.stderr)")
    with tempfile.TemporaryDirectory(prefix="symcost-bench-cache-") as d:
        env = dict(os.environ, SYMCOST_CACHE_DIR=d, SYMCOST_GRAPHS_DIR="")  # (cold: traced, not the graph library)
        cold_wall, cold_cpu, cold_out = run(cli, env)
        warm = [run(cli, env) for _ in range(args.repeat)]
        imported = subprocess.run([sys.executable, "-c", probe, *cli[3:]], env=env, capture_output=True,
                                  text=True).stderr.strip().splitlines()[-1]
    w_wall = min(w for w, _, _ in warm)
    w_cpu = min(c for _, c, _ in warm)
    same = all(o == cold_out for _, _, o in warm)
    print("symcost " + " ".join(cli[3:]))
    print(f"{'':12}{'wall s':>10}{'cpu s':>10}")
    print(f"{'cold':12}{cold_wall:10.2f}{cold_cpu:10.2f}")
    print(f"{'warm (best)':12}{w_wall:10.2f}{w_cpu:10.2f}   (of {args.repeat})")
    print(f"ratio cold/warm: wall {cold_wall / w_wall:.1f}x, cpu {cold_cpu / w_cpu:.1f}x")
    print(f"warm under 1.5 s: wall {'yes' if w_wall < 1.5 else 'NO'}, cpu {'yes' if w_cpu < 1.5 else 'NO'}; "
          f"warm process: {imported.lower().replace('_', ' ')}; same output: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()

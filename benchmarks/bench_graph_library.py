"""Graph library: ``symcost report CONFIG --set B=1 S=8192`` with an empty trace cache, answered
from graphs/ (the library), against the same command traced afresh (``--no-cache``, a cold trace).

    python benchmarks/bench_graph_library.py [--configs llama-3-8b qwen3-4b ...] [--cold llama-3-8b] [--repeat 2]

Each run is a fresh ``symcost`` process in a new empty ``SYMCOST_CACHE_DIR`` (what a newcomer's
first call pays: interpreter start, imports, reading the graph, evaluating, printing). Prints wall
and CPU seconds (user + system of the child) of the library answer for each config, of the cold
trace for those named by ``--cold`` (default: the first config; cold traces take tens of seconds
each), their ratio, whether the answer says it came from the library, and whether ``eval --json``
gives the same numbers from the library as from the cold trace. Target (issue 32): every config
under 2 s from the library (judged on CPU seconds, which a loaded machine inflates less than wall
time; both are printed).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("llama-3-8b", "qwen3-4b", "mistral-7b", "mixtral-8x7b", "deepseek-v3", "gemma-2b")


def run(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of ``cmd`` in a new empty trace cache, and its stdout."""
    with tempfile.TemporaryDirectory(prefix="symcost-bench-lib-") as d:
        env = dict(os.environ, SYMCOST_CACHE_DIR=d)
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--cold", nargs="*", default=None, help="configs also traced cold (default: the first)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    cold = args.configs[:1] if args.cold is None else args.cold
    sym = [sys.executable, "-m", "symcost.cli"]
    sets = ["--set", "B=1", "S=8192"]
    print(f"{'config':16}{'library wall':>14}{'cpu':>8}{'cold wall':>11}{'cpu':>8}{'ratio':>8}  labelled  same numbers")
    ok, ok_wall = True, True
    for c in args.configs:
        path = f"tests/data/configs/{c}.json"
        lib = [run(sym + ["report", path, *sets]) for _ in range(args.repeat)]
        wall, cpu = min(w for w, _, _ in lib), min(u for _, u, _ in lib)
        labelled = "from the graph library" in " ".join(lib[0][2].split())
        ok &= labelled and cpu < 2.0
        ok_wall &= wall < 2.0
        row = f"{c:16}{wall:14.2f}{cpu:8.2f}"
        if c in cold:
            cw, cc, _ = run(sym + ["report", path, *sets, "--no-cache"])
            a = run(sym + ["eval", path, *sets, "--json"])[2]
            b = run(sym + ["eval", path, *sets, "--json", "--no-cache"])[2]
            ok &= a == b
            row += f"{cw:11.2f}{cc:8.2f}{cw / wall:7.1f}x  {'yes' if labelled else 'NO':8}  {'yes' if a == b else 'NO'}"
        else:
            row += f"{'-':>11}{'-':>8}{'-':>8}  {'yes' if labelled else 'NO':8}  -"
        print(row)
    print(f"every config labelled, under 2 s CPU from the library, numbers equal: {'yes' if ok else 'NO'}; "
          f"under 2 s wall: {'yes' if ok_wall else 'NO (a loaded machine inflates wall time: see the cpu column)'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

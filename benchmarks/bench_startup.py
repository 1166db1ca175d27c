"""Fast start (issue 7): ``symcost --help`` and an argument error, beside ``python -c "import torch"``.

The CLI imports torch, transformers and sympy only when a command traces, so ``--help`` and
argument errors (a bad ``--set``, an option that does not apply) must answer in under 0.5 s.
Each command runs in a fresh interpreter, as a user's shell runs it; the best of ``--repeats``
runs is kept, and the peer (importing torch alone) is measured in the same run.

Run: ``python benchmarks/bench_startup.py [--repeats N]``. Prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

CASES = {
    "symcost --help": [sys.executable, "-m", "symcost.cli", "--help"],
    "symcost max-batch --help": [sys.executable, "-m", "symcost.cli", "max-batch", "--help"],
    "symcost eval gpt2 --set B 8 (error)": [sys.executable, "-m", "symcost.cli", "eval", "gpt2", "--set", "B", "8"],
    "symcost report --precision bf16 (error)": [sys.executable, "-m", "symcost.cli", "report", "--precision", "bf16"],
    "symcost report gpt2 --attention sdpa (error)": [sys.executable, "-m", "symcost.cli", "report", "gpt2",
                                                     "--attention", "sdpa"],
    'python -c "import torch" (peer)': [sys.executable, "-c", "import torch"],
}


def best(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="runs per command; the best is kept")
    a = ap.parse_args()
    res = {name: best(cmd, a.repeats) for name, cmd in CASES.items()}
    peer = res['python -c "import torch" (peer)']
    width = max(map(len, res))
    for name, t in res.items():
        mark = "" if "peer" in name else ("  ok (< 0.5 s)" if t < 0.5 else "  SLOW (target < 0.5 s)")
        print(f"{name:<{width}}  {t:6.3f} s   {t / peer:5.2f} x import torch{mark}")


if __name__ == "__main__":
    main()

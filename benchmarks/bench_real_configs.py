"""Cold time of ``symcost eval`` on the real configs of tests/data/configs (issue 6: the twelve
dense ones each under 30 s cold on the 2-core machine; issue 14: the seven mixture-of-experts ones
too, whose peer runs transformers' ``batched_mm`` experts), side by side with a peer measured in the same run:
one FlopCounterMode pass (forward + backward, fake tensors, the file's full width and L) of the
same model, which gives one size's FLOPs where symcost gives the formulas for every size.

Each symcost run is a fresh process (``python -m symcost.cli eval CONFIG --set B=2 S=64 --json``),
so it pays the imports as a user does. Run: ``python benchmarks/bench_real_configs.py
[CONFIG ...]``. Prints one line per config; asserts nothing.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = sorted(glob.glob(os.path.join(HERE, "..", "tests", "data", "configs", "*.json")))
PEER = """
import sys, time, torch, symcost
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
t = time.perf_counter()
spec = symcost.resolve(sys.argv[1])
v = dict(spec.defaults, B=2, S=64)
with torch.device("meta"):
    m = spec.build(v)
if "E" in spec.symbols:
    m.set_experts_implementation("batched_mm")  # transformers' own experts code, fake-tensor safe
with FakeTensorMode(allow_non_fake_inputs=True):
    m = m.to_empty(device="cpu")
    ids = torch.randint(0, v["V"], (2, 64))
    with FlopCounterMode(display=False) as fc:
        m(input_ids=ids, labels=ids).loss.backward()
print(fc.get_total_flops())
"""


def run(cmd: list[str]) -> tuple[float, int, str]:
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - t, res.returncode, (res.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    configs = sys.argv[1:] or CONFIGS
    print(f"{'config':<18} {'symcost eval (cold)':>20} {'FlopCounterMode (cold)':>23} {'ratio':>6}")
    for path in configs:
        t_sym, rc, err = run([sys.executable, "-m", "symcost.cli", "eval", path, "--set", "B=2", "S=64",
                              "--json", "--precision", "fp32"])
        t_peer, rc2, err2 = run([sys.executable, "-c", PEER, path])
        name = os.path.basename(path)[:-5]
        note = "" if rc == 0 and rc2 == 0 else f"  (failed: {err or err2})"
        print(f"{name:<18} {t_sym:>18.1f} s {t_peer:>21.1f} s {t_sym / t_peer:>6.1f}{note}", flush=True)


if __name__ == "__main__":
    main()

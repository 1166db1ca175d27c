"""hf:t5 under data parallelism: the rank's activations are one device's (docs/memory.md,
"Policies": autocast's bf16 weight copies are activations).

``report hf:t5 --dp 2 --shard ddp`` lists parameter-sized terms under ``activations``
(144·D·H·M + 48·F·M + 2·M·V at t5-small's L = 6). They are not the data-parallel engine's: they
are the bf16 copies of the matmul weights that ``torch.autocast`` makes in the forward and each
linear saves for its input gradient, 2 bytes per element of every weight a matmul reads (the
encoder's and decoder's projections and the head tied to ``shared``: ``params_matmul``), on one
device as under DDP. Oracle: ``saved_tensors_hooks`` on one device's real step (tests/
memory_oracle.py ``saved_bytes``: every saved storage that is no parameter or buffer) at random
sizes the trace never saw, and the trace's ``params_matmul`` (a meta-device count of the
matmul weights is checked elsewhere)."""
from __future__ import annotations

import random

import pytest
import sympy

import symcost
from memory_oracle import saved_bytes

pytest.importorskip("transformers")


@pytest.mark.heavy
def test_t5_ddp_activations_are_one_devices_saved_tensors():
    """One DDP rank of hf:t5 under bf16-mixed (DP 2; L pinned where the trace keeps T5 unfolded
    under --dp): its activations equal the bytes ``saved_tensors_hooks`` sees in one device's
    step at the rank's sizes, and their part without B (what reads as parameter-sized) is exactly
    2 bytes per matmul weight element, autocast's bf16 copies. (~60 CPU-s: one cold trace)"""
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    spec = resolve("hf:t5", attention="eager")
    sizes = {"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "M": 12, "F": 10, "V": 37, "L": 2, "DP": 2}
    an = symcost.trace(spec, layout=Layout(shard="ddp"), sizes=sizes, precision="bf16-mixed", torch_device="cpu")
    acts = sympy.expand(sum(rep * nb for _, nb, _, rep in an.saved))
    per_token = {s for s in acts.free_symbols if s.name in ("B", "S", "S_enc")}
    weights = sympy.Add(*[t for t in sympy.Add.make_args(acts) if t.free_symbols and not t.free_symbols & per_token])
    assert sympy.expand(weights - 2 * an.params_matmul) == 0, (weights, an.params_matmul)
    rng = random.Random("t5-ddp")
    for _ in range(2):
        v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 4),
             "D": rng.choice((4, 6, 8)), "M": rng.randint(6, 24), "F": rng.randint(6, 30), "V": rng.randint(20, 80),
             "L": an.pinned.get("L", rng.randint(2, 4))}
        env = {s: v[s.name] for s in acts.free_symbols}
        assert int(acts.subs(env)) == saved_bytes(spec, v, "bf16-mixed"), v

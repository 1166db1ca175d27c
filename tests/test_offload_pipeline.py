"""FSDP2's CPU offload on a pipeline stage (issue 27 item 2: ``--offload --pp``, refused before):
``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on each stage module's units after the
pipeline split, as torchtitan applies ``training.enable_cpu_offload`` under PP.

Oracle: a real ``torchrun`` + gloo run of PP 2 × FSDP 2 on this CPU (tests/data/pp_mesh_rank.py
with ``offload``: ``PipelineStage`` + ``Schedule1F1B``, the accelerator's two copies made as
tests/data/offload_rank.py makes them, PyTorch's ``MemTracker`` with the host's storages taken
out): each rank's FLOPs, collective and p2p bytes, host parameter and gradient bytes and the bytes
copied each way per step equal symcost's; the device peak within 5%.
"""
from __future__ import annotations

import json
import os
import random
import sys

import pytest

from symcost.frontends.layout import Layout

sys.path.insert(0, os.path.dirname(__file__))
from test_pipeline_mesh import M, PP, _check, _gloo  # noqa: E402


def test_offload_pp_report_json():
    """``report --pp 2 --dp 2 --shard fsdp --offload --json`` answers (it was refused): each rank
    row has its model states on the host and the copies per step; the device peak of each rank is
    below the same layout's without offload by at least the parameter and gradient shards, and
    the optimizer state is not added to it."""
    from click.testing import CliRunner

    from symcost.cli import main

    base = ["report", "mlp", "--pp", "2", "--dp", "2", "--shard", "fsdp", "--microbatches", "2",
            "--set", "B=2", "S=8", "D=32", "L=2", "--json", "--gpu", "h100-sxm"]
    runs = {}
    for off in (False, True):
        r = CliRunner().invoke(main, base + (["--offload"] if off else []))
        assert r.exit_code == 0, r.output
        runs[off] = json.loads(r.output)
    assert runs[True]["layout"]["offload"] is True
    for on, off in zip(runs[True]["pipeline"]["ranks"], runs[False]["pipeline"]["ranks"]):
        host, mem = on["host"], on["memory"]
        assert mem["params"] == mem["grads"] == 0 and on["peak_with_optimizer"] == mem["peak"]
        assert host["params"] == off["memory"]["params"] and host["grads"] == off["memory"]["grads"]
        assert host["total"] == off["model_states"] and host["optimizer"] > 0
        assert on["transfer"]["h2d"] >= host["params"] and on["transfer"]["d2h"] == host["grads"]
        assert on["transfer_seconds"] == pytest.approx(on["transfer"]["h2d"] / 64e9)
        assert on["peak_with_optimizer"] <= off["peak_with_optimizer"] - host["params"] - host["grads"] \
            - host["optimizer"]


@pytest.mark.heavy
def test_real_gloo_pp_by_fsdp_offload(tmp_path):
    """PP 2 × FSDP 2 with CPU offload and activation offload (``--offload --offload-activations``;
    4 processes, random sizes; the gloo run under save_on_cpu(pin_memory=True)'s hooks, as
    tests/data/pp_mesh_rank.py says): per rank FLOPs, collective bytes per group and
    kind, p2p bytes, the host's parameter and gradient shards, H2D and D2H bytes per step equal
    the gloo run's, and so do the bytes packed and unpacked per step and the most pinned bytes the
    packed tensors of the micro-batches in flight hold at once; the device peak within 5% (gloo's threads release a collective's tensors at
    varying times: up to 2% seen at these sizes, 5% at B = 1, where the activations are smaller)."""
    from symcost.passes.pipeline import summary

    rng = random.Random(2720)
    v = {"B": 2, "S": 16 * rng.randint(3, 5), "H": 4, "D": rng.choice((8, 16)), "L": rng.randint(PP, PP + 1),
         "V": 16 * rng.randint(4, 8), "F": 32 * rng.randint(2, 4)}
    r = summary("cs336-lm", PP, "1f1b", M, precision="fp32", sizes=dict(v, DP=2),
                inner=Layout(shard="fsdp", offload=True, offload_activations=True))
    got = _gloo(tmp_path, v, 2, 1, "fsdp", False, "none", offload=True, offload_activations=True)
    for g in got:
        row = r["ranks"][g["pp_rank"]]
        host = row["memory"]["host"]
        assert (g["params"], g["grads"], g["host_buffers"]) == (host["params"], host["grads"], host["grads"]), (g, host)
        assert g["transfers"] == row["transfer"], (g["pp_rank"], g["transfers"], row["transfer"])
        assert row["host"]["params"] == host["params"]  # the policy's bytes of the shards (fp32)
        assert g["activation_offload"] == row["activation_offload"], (g["pp_rank"], g["activation_offload"],
                                                                      row["activation_offload"])
        # (the device holds no parameter or gradient between steps: _check compares 0 with 0)
        g.update(params=0, grads=0)
    _check(r, got, 0.05)

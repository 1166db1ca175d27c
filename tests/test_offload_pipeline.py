"""FSDP2's CPU offload on a pipeline stage (issue 27 item 2: ``--offload --pp``, refused before):
``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on each stage module's units after the
pipeline split, as torchtitan applies ``training.enable_cpu_offload`` under PP.

Its oracle, a real ``torchrun`` + gloo run of PP 2 × FSDP 2 on this CPU, is
tests/test_pipeline_mesh.py ``test_real_gloo_pp_by_fsdp_offload`` (in the same launch as that
file's other 4-rank runs); here the report's contract.
"""
from __future__ import annotations

import json

import pytest


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

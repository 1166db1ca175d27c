"""The priced step of a ``--ep N --tp M`` and a ``--cp N --tp M`` rank without ``--dp`` (issues 28
and 29: ``report --gpu`` and ``time``; symcost.passes.parallel.step_time and
symcost.passes.performance.predict_dp, docs/performance-model.md).

Each process group is priced over its own link as torchtitan's mesh places it: under ``--ep
--tp`` the mesh ``(ep_rest, tp)`` = (EP/TP, TP), a TP group TP consecutive ranks, the EP group all
EP ranks (docs/parallel.md §14.8); under ``--cp --tp`` the mesh ``(cp, tp)``, a TP group TP
consecutive ranks, a CP group CP ranks TP apart (CP·TP consecutive, §15). Closed forms, with the
links chosen so that one term at a time is non-zero:

* the bound: the roofline's compute plus each group's bytes per rank over its link's bandwidth
  (the all-to-all bytes by hand from the routing: L·(EP−1)/EP·(16·(N/TP)·R·M + 8·E), fp32; the TP
  all-reduce bytes the graph's, which test_ep_tp and test_context_parallel check against real gloo
  ranks); the CP ring as PyTorch schedules it (per layer x/bw − c0 forward, 3·x/bw − b0 − b1
  backward, x = 2·B·(K/TP)·(S/CP)·D·4 by hand);
* the prediction: Hockney's alpha per ring step of each collective (2(n−1) an all-reduce, n−1 an
  all-gather or all-to-all, n its group's ranks), counted from the graph's collective nodes and,
  for the all-to-alls, by hand (torchtitan's dispatcher: the counts, the dispatch and the combine
  forward, their gradients backward: 5 per MoE layer).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import pytest
from click.testing import CliRunner

import symcost
from symcost.cli import main

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from test_ep_tp import REQUEST, _trace as _trace_ep_tp  # noqa: E402  (the same trace as test_ep_tp's)


def _device(link: float, network: float, alpha: float | None = None):
    """The H100 with the links (byte/s per direction) and alpha (s) given."""
    from symcost.hardware.devices import get_device

    h100 = get_device("h100")
    d = dataclasses.replace(h100, interconnect=dict(h100.interconnect, link_bandwidth=link, network_bandwidth=network))
    return d if alpha is None else dataclasses.replace(
        d, efficiency=dataclasses.replace(h100.efficiency, collective_latency=alpha))


def _compute(an, sizes) -> float:
    """The roofline's compute of the rank's step (fused bytes, as step_time's bound)."""
    from symcost.hardware.devices import get_device
    from symcost.passes.roofline import roofline

    env = an.bind(**sizes)
    r = roofline(an, get_device("h100"), {str(k): x for k, x in env.items()}, with_formulas=False)
    return sum(r["per_phase"].get(ph, {}).get("seconds", 0.0) for ph in ("forward", "backward"))


def _count(an, sizes, kind: str, group: str) -> int:
    """Collective nodes of ``kind`` over ``group`` in the graph, their repeats counted."""
    from symcost.graph.totals import comm_group

    env = an.bind(**sizes)
    return sum(int(op.repeat.subs(env)) if hasattr(op.repeat, "subs") else int(op.repeat)
               for op in an.ops if getattr(op, "comm", None) and op.comm[0] == kind and comm_group(an, op) == group)


@pytest.mark.heavy
def test_ep_tp_step_priced_per_group(monkeypatch):
    """``--ep 4 --tp 2`` (4 ranks: two TP pairs, one EP group of all four), nodes of 2 devices: the
    TP pair on the node's link, the EP group's all-to-all 1/3 over the link and 2/3 over the network
    (its peers on and off the node); then nodes of 4: both on the link.
    ``report --gpu --json`` and ``time --gpu --json`` answer with it: 4 ranks (EP borrows the TP
    ranks), B·S·EP/TP tokens per step (each TP pair its own micro-batch), device-hours × 4."""
    from symcost.passes.parallel import step_time
    from symcost.passes.performance import predict_dp

    an = _trace_ep_tp()
    v = REQUEST
    sizes = {k: x for k, x in v.items() if k in an.symbols}
    compute = _compute(an, sizes)
    N, M, L, EP, TP = v["B"] * v["S"], v["H"] * v["D"], v["L"], v["EP"], v["TP"]
    a2a = L * (EP - 1) / EP * (16 * N / TP * v["R"] * M + 8 * v["E"])  # fp32, by hand
    tp_bytes = float(sum(float(an.comm_bytes("all_reduce", ph, group="TP").subs(an.bind(**sizes)))
                         for ph in ("forward", "backward")))
    # the EP group's 4 consecutive ranks on nodes of 2: each rank's 1 on-node peer over the link, its 2
    # other-node peers over the network (each peer 1/EP of the buffer: NCCL's per-peer sends), the
    # all-to-all as long as its slower tier (passes.parallel.all_to_all_tiers)
    off, on = (EP - 2) / (EP - 1), 1 / (EP - 1)
    st = step_time(an, _device(1e30, 1.0), sizes, "none", devices_per_node=2)
    assert st["ranks"] == 4 and st["nodes"] == 2 and st["groups"]["EP"]["ranks"] == 4
    assert st["groups"]["EP"]["bandwidth"] == 1.0 and st["groups"]["TP"]["bandwidth"] == 1e30
    assert st["step_seconds"] == pytest.approx(compute + a2a * off, rel=1e-9)
    st = step_time(an, _device(1.0, 1e30), sizes, "none", devices_per_node=2)
    assert st["step_seconds"] == pytest.approx(compute + tp_bytes + a2a * on, rel=1e-9)
    st = step_time(an, _device(1.0, 1e30), sizes, "none", devices_per_node=4)  # (EP inside a node now)
    assert st["nodes"] == 1 and st["step_seconds"] == pytest.approx(compute + tp_bytes + a2a, rel=1e-9)
    # the prediction: alpha per ring step, links free
    alpha = 10.0
    pd = predict_dp(an, _device(1e30, 1e30, alpha), sizes, "none", devices_per_node=2)
    assert _count(an, sizes, "all_to_all", "EP") == 5 * L
    n_ar = _count(an, sizes, "all_reduce", "TP")
    assert sum(pd["exposed"].values()) == pytest.approx(alpha * (5 * L * (EP - 1) + n_ar * 2 * (TP - 1)), rel=1e-9)
    assert pd["latency_seconds"] == pytest.approx(sum(pd["exposed"].values()), rel=1e-9)
    # the commands
    from symcost.commands import report as report_cmd, time as time_cmd

    monkeypatch.setattr(report_cmd, "trace_model", lambda *a, **k: (an, sizes))
    monkeypatch.setattr(time_cmd, "trace_model", lambda *a, **k: (an, sizes))
    flags = ["--ep", "4", "--tp", "2", "--gpu", "h100", "--precision", "fp32", "--devices-per-node", "2"]
    r = CliRunner().invoke(main, ["report", "moe", *flags, "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    js = json.loads(r.output[r.output.index("{"):])["parallel"]["step"]
    from symcost.hardware.devices import get_device

    want = step_time(an, get_device("h100"), sizes, devices_per_node=2)
    assert js["step_seconds"] == pytest.approx(want["step_seconds"]) and js["predicted"]["step_seconds"] > 0
    assert js["groups"]["EP"]["link"] != js["groups"]["TP"]["link"]  # (the network, the node's link)
    r = CliRunner().invoke(main, ["time", "moe", *flags, "--tokens", "1e9", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    js = json.loads(r.output[r.output.index("{"):])
    assert (js["ranks"], js["tokens_per_step"]) == (4, v["B"] * v["S"] * EP // TP)
    assert js["steps"] == pytest.approx(1e9 / (v["B"] * v["S"] * EP // TP))
    assert js["time.device_hours"] == pytest.approx(js["time.seconds"] * 4 / 3600)
    flops = int(an.flops("train").subs(an.bind(**sizes)))
    assert js["compute.total"] == pytest.approx(flops * 4 * 1e9 / (v["B"] * v["S"] * EP // TP))
    assert js["predicted"]["time.seconds"] == pytest.approx(js["steps"] * js["predicted"]["step_seconds"])
    r = CliRunner().invoke(main, ["report", "moe", *flags])
    assert r.exit_code == 0 and "predicted step (performance model" in r.output, r.output[-2000:]


#: hf:llama's sizes of the CP × TP rank (K/TP = 1 key/value head per rank)
V_CP = {"H": 4, "K": 2, "D": 8, "L": 2, "V": 64, "F": 32, "B": 2, "S": 16}


@functools.lru_cache(maxsize=1)
def _trace_cp_tp():
    from cp_rank import config

    from symcost.frontends.layout import Layout

    v = V_CP
    return symcost.trace("hf:llama", config=config(v), layout=Layout(cp=True, tp=True),
                         sizes={"B": v["B"], "S": v["S"], "CP": 2, "TP": 2}, precision="fp32")


@pytest.mark.heavy
def test_cp_tp_step_priced_per_group(monkeypatch):
    """``--cp 2 --tp 2`` (4 ranks, mesh (cp, tp)): nodes of 2 devices put the TP pair on the node's
    link and the CP ring (2·2 consecutive ranks) on the network. A free network and a slow link:
    the step is the compute plus the TP bytes over the link; a free link and a network slower than
    every kernel: the compute plus, per layer, the ring's x/bw − c0 forward and 3·x/bw − b0 − b1
    backward (all-gather rotation, CP = 2: the gather, then the two dK/dV passes queued behind it),
    x the rank's K/V bytes 2·B·(K/TP)·(S/CP)·D·4 by hand, c and b the roofline's attention kernels.
    The prediction with free links and alpha far above the kernels: the TP collectives' alphas
    (2(TP−1) an all-reduce, TP−1 an all-gather) plus the ring's schedule with a pass at (CP−1)·alpha
    and the performance model's blocks. ``report``/``time`` ``--gpu --json``: 4 ranks, B·S tokens
    per step (the CP group shares its sequences, the TP pair its tokens)."""
    from symcost.hardware.devices import get_device
    from symcost.passes.parallel import step_time
    from symcost.passes.performance import predict, predict_dp
    from symcost.passes.roofline import roofline

    an = _trace_cp_tp()
    v = V_CP
    sizes = {k: x for k, x in dict(v, TP=2).items() if k in an.symbols}
    env = an.bind(**sizes)
    compute = _compute(an, sizes)
    r = roofline(an, get_device("h100"), {str(k): x for k, x in env.items()}, with_formulas=False)
    (c0, _), (b0, b1) = ([n["seconds"] / v["L"] for n in r["nodes"] if n["phase"] == ph and "attention" in n["op"]]
                         for ph in ("forward", "backward"))
    x = 2 * v["B"] * (v["K"] // 2) * (v["S"] // 2) * v["D"] * 4
    tp_bytes = sum(float(an.comm_bytes(k, ph, group="TP").subs(env)) for k in ("all_reduce", "all_gather")
                   for ph in ("forward", "backward"))
    st = step_time(an, _device(1.0, 1e30), sizes, "none", devices_per_node=2)
    assert st["ranks"] == 4 and not st["cp"]["inside"] and st["groups"]["TP"]["bandwidth"] == 1.0
    assert st["step_seconds"] == pytest.approx(compute + tp_bytes, rel=1e-9)
    st = step_time(an, _device(1e30, 1.0), sizes, "none", devices_per_node=2)
    assert st["step_seconds"] == pytest.approx(compute + v["L"] * ((x - c0) + (3 * x - b0 - b1)), rel=1e-9)
    st = step_time(an, _device(1e30, 1.0), sizes, "none", devices_per_node=4)  # (the ring inside a node: free)
    assert st["cp"]["inside"] and st["step_seconds"] == pytest.approx(compute, rel=1e-9)
    alpha = 10.0
    dev = _device(1e30, 1e30, alpha)
    p = predict(an, dev, sizes)
    (c0, _), (b0, b1) = ([n["seconds"] / v["L"] for n in p["nodes"] if n["phase"] == ph and "attention" in n["op"]]
                         for ph in ("forward", "backward"))
    tp_steps = 2 * _count(an, sizes, "all_reduce", "TP") + _count(an, sizes, "all_gather", "TP")
    pd = predict_dp(an, dev, sizes, "none", devices_per_node=2)
    assert sum(pd["exposed"].values()) == pytest.approx(
        alpha * tp_steps + v["L"] * ((alpha - c0) + (3 * alpha - b0 - b1)), rel=1e-9)
    from symcost.commands import report as report_cmd, time as time_cmd

    monkeypatch.setattr(report_cmd, "trace_model", lambda *a, **k: (an, sizes))
    monkeypatch.setattr(time_cmd, "trace_model", lambda *a, **k: (an, sizes))
    flags = ["--cp", "2", "--tp", "2", "--gpu", "h100", "--precision", "fp32"]
    r = CliRunner().invoke(main, ["report", "hf:llama", *flags, "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    js = json.loads(r.output[r.output.index("{"):])["parallel"]["step"]
    assert js["step_seconds"] == pytest.approx(step_time(an, get_device("h100"), sizes)["step_seconds"])
    r = CliRunner().invoke(main, ["time", "hf:llama", *flags, "--tokens", "1e9", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    js = json.loads(r.output[r.output.index("{"):])
    assert (js["ranks"], js["tokens_per_step"]) == (4, v["B"] * v["S"])
    assert js["time.device_hours"] == pytest.approx(js["time.seconds"] * 4 / 3600)

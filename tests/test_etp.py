"""Expert-tensor parallelism (``--ep N --tp M --etp M``, docs/parallel.md §14.10): torchtitan's
``ExpertTensorParallel`` (etp = tp; torchtitan/distributed/expert_parallel.py at c4b409af2^), EP·TP
ranks on the mesh ``(ep, tp)``, each rank's E/EP experts split over TP along their hidden width,
every TP rank dispatching all of its micro-batch's tokens over its EP group
(symcost/frontends/expert_parallel.py ``apply`` with ``experts_mesh``).

Oracles, independent of symcost's recorder, rules and fit: a real ``torchrun`` + gloo run of
4 ranks (EP 2 × TP 2: two TP groups, each its own tokens; two EP groups, one per TP coordinate)
measuring the step with PyTorch's own tools (tests/data/ep_rank.py ``measure``), after checking on
every rank that the laid-out model's loss and router gradient equal the same model's on one
device; formulas by hand; DeepSeek-V3's published shapes against a meta-device count of the
rank's shard.
"""
from __future__ import annotations

import functools
import json
import os
import re
from fractions import Fraction

import pytest

import symcost

from test_ep_tp import _cli, _run

PRECISION = "fp32"
#: the traced request: EP 2 × TP 2, E/EP = 8 experts per rank, each F/TP wide (H = 8: TP = 4
#: leaves two heads per rank, so the probes vary TP alone)
REQUEST = {"EP": 2, "TP": 2, "B": 2, "S": 16, "H": 8, "D": 4, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}


@functools.lru_cache(maxsize=None)
def _trace():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("moe"), layout=Layout(ep=True, tp=True, etp=True), sizes=REQUEST,
                         precision=PRECISION)


@pytest.mark.heavy
def test_etp_formulas_by_hand():
    """EP and TP both symbols (not pinned). Each TP rank routes all N = B·S tokens of its
    micro-batch (no N/TP split, unlike etp = 1), so the all-to-all bytes are --ep's alone,
    L·(EP-1)/EP·(16·N·R·M + 8·E), on every TP rank (torchtitan's "redundant all-to-all" of ETP);
    the routed experts' FLOPs (three GEMMs of 2·N·R·M·F/TP, forward and backward) are 1/TP of one
    device's; the router runs on all N tokens (6·N·M·E per layer); the rank holds E/EP experts of
    F/TP each (3·E·F·M/(EP·TP) per layer), 1/TP of the attention projections and head, the
    router, norms and embedding whole; the router's gradient (E·M fp32 per layer) is all-reduced
    over TP."""
    import sympy

    from symcost.tracing.fit import SYMS

    an = _trace()
    assert {"EP", "TP"} <= set(an.symbols) and not an.pinned, an.pinned
    B, S, H, D, L, E, R, F, V, EP, TP = (SYMS[k] for k in ("B", "S", "H", "D", "L", "E", "R", "F", "V", "EP", "TP"))
    M, N = H * D, B * S
    assert sympy.expand(an.comm_bytes("all_to_all", group="EP") - L * (EP - 1) / EP * (16 * N * R * M + 8 * E)) == 0
    flops = an.flops("train")
    assert sympy.expand(flops.coeff(F) - 18 * N * R * M * L / TP) == 0
    assert sympy.expand(flops.coeff(E) - 6 * N * M * L) == 0
    want = (4 * M * M / TP + M * E + 3 * E * F * M / (EP * TP) + 2 * M) * L + M + V * M + V * M / TP
    assert sympy.expand(an.params_shard - want) == 0
    assert sympy.expand(an.comm_bytes("all_reduce", group="TP").coeff(E) - 8 * M * L * (TP - 1) / TP) == 0


@pytest.mark.heavy
def test_real_gloo_ep2_tp2_etp2(tmp_path):
    """``torchrun --nproc-per-node 4`` with gloo: EP 2 × TP 2 × etp 2 (ranks {0,1} and {2,3} the TP
    groups, each its own tokens; {0,2} and {1,3} the EP groups), the routers balanced. On every
    rank the laid-out model's loss and router gradient equal the same model's on one device, and
    the rank's FLOPs, saved bytes, parameter elements, all-to-all bytes over EP and all-reduce
    bytes over TP equal symcost's, its peak within 5% of MemTracker's."""
    from symcost.passes.memory import memory_model

    v = {**REQUEST, "B": 3, "S": 16, "V": 64, "F": 16}
    got = _run(tmp_path, 4, v, ["tp=2", "etp"])
    an = _trace()
    env = an.bind(**v)
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank, g in enumerate(got):
        assert g["world"] == 4 and g["checks"]["loss"] < 1e-5 and g["checks"]["router_grad"] < 1e-5, (rank, g["checks"])
        assert int(an.flops("train").subs(env)) == g["flops"], rank
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == g["saved"], rank
        assert int(an.params_shard.subs(env)) == g["shard"], rank
        assert Fraction(g["comm"]["other"]) == 0
        for group, kind in (("EP", "all_to_all"), ("TP", "all_reduce")):
            assert Fraction(str(an.comm_bytes(kind, group=group).subs(env))) == Fraction(g["by_group"][group][kind]) > 0
        assert Fraction(str(an.comm_bytes("total").subs(env))) == sum(
            Fraction(x) for d in g["by_group"].values() for x in d.values())
        assert abs(want - g["memtracker"]) <= 0.05 * g["memtracker"], (rank, want, g["memtracker"])


@pytest.mark.parametrize("args, words", [
    (["report", "moe", "--ep", "4", "--tp", "2", "--etp", "4"], "1 or the tensor-parallel one"),
    (["report", "moe", "--ep", "4", "--etp", "2"], "give both"),
    (["report", "moe", "--ep", "4", "--tp", "2", "--etp", "2", "--sp"], "--sp"),
    (["report", "moe", "--ep", "4", "--tp", "2", "--etp", "2", "--dp", "2", "--shard", "fsdp"], "--etp with --dp"),
])
def test_etp_refusals_are_one_line(args, words):
    """What --etp does not take is one line before any trace: a degree other than 1 or --tp (as
    torchtitan's ParallelDims), --etp without --ep and --tp, --etp with --sp or --dp (not modelled yet)."""
    r = _cli(args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.heavy
def test_report_deepseek_v3_etp_parameters_per_rank():
    """``report tests/data/configs/deepseek-v3.json --ep 8 --tp 2 --etp 2`` at the published
    per-layer shapes (MLA, 256 routed experts of width 2048, one shared expert) with L = 5 (the 3
    dense layers and 2 MoE ones): the rank's parameter elements equal transformers' model on the
    meta device cut as the layout cuts a rank's shard: each routed expert stack ``[256, …]`` to
    256/8 experts of half their width (EP · TP = 16); over TP = 2 (transformers' ``tp_plan``: colwise
    and rowwise projections, the vocabulary-parallel embedding and head, and the shared experts as
    torchtitan's apply_moe_ep_tp) half; whole the router, the norms, q_a and kv_a. fp32: 4 bytes
    a parameter.

    Traced with ``--attention eager``: a rank's parameters do not depend on the attention kernel,
    and under SDPA (CUDA's memory-efficient kernel, whose logsumexp is padded to whole multiples of
    32 positions: no polynomial in S) the check at the requested sizes failed (bytes.forward
    40,960 B off: 32 more positions of the padded logsumexp), so the trace refitted on twice the
    probes, failed again and pinned every width (H, D, V, F, E, R, EP), then S and K, in five or
    more attempts; eager passes at the second (TP pinned), the widths symbols of the formulas.
    69 CPU-s before, 46 after (2026-12-06, machine at load 10)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "deepseek-v3.json")
    layers, ep, tp = 5, 8, 2
    r = _cli(["report", path, "--ep", str(ep), "--tp", str(tp), "--etp", str(tp), "--precision", "fp32",
              "--attention", "eager", "--set", "B=1", "S=64", f"L={layers}", "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    got = json.loads(r.output[r.output.index("{"):])
    assert got["layout"]["etp"] is True
    cfg = AutoConfig.from_pretrained(path, num_hidden_layers=layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    plan = model.tp_plan
    want = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if ".mlp.experts." in name and p.shape[0] == cfg.n_routed_experts:
            n //= ep * tp
        elif ".mlp.shared_experts." in name or any(
                plan[k] in ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output")
                and re.fullmatch(k.replace(".", r"\.").replace("*", r"\d+"), name.rpartition(".")[0]) for k in plan):
            n //= tp
        want += n
    assert got["parallel"]["memory_per_rank"]["params"] == 4 * want

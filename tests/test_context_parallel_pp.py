"""Context parallelism inside pipeline stages (``--cp N --pp P``, issue 28: CP composed with PP,
docs/parallel.md §15.6): every stage module traced as one rank of its ``cp`` group (its inputs the
rank's load-balanced S/CP tokens, its received activation S/CP tokens, its attention PyTorch's
ring attention with the ring's collectives as graph nodes), the schedule run per rank on the
composed ``(pp, cp)`` mesh under PyTorch's CP dispatcher, as torchtitan runs it (each
micro-batch's inputs sharded over ``cp`` before ``pp_schedule.step``, the step inside the CP
train context).

Oracle: real ``torchrun`` + gloo, CP 2 × PP 2 on a tiny causal ``transformers`` Llama
(tests/data/pp_cp_rank.py: PyTorch's ``context_parallel`` over cp, ``PipelineStage`` +
``Schedule1F1B`` over pp); and a meta-device count of each stage's parameters for Llama-3-8B at
128k tokens.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from fractions import Fraction

import pytest

from symcost.frontends.layout import Layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from cp_rank import config  # noqa: E402

PP, CP, M = 2, 2, 2


def _draw(seed: int) -> dict:
    rng = random.Random(seed)
    H = rng.choice((2, 4))
    return {"H": H, "K": rng.choice([k for k in (1, 2) if H % k == 0 and k < H]), "D": rng.choice((8, 16)),
            "L": rng.choice((2, 3)), "V": 2 * rng.randrange(20, 50), "F": 4 * rng.randrange(6, 16), "B": 2,
            "S": 2 * CP * rng.randrange(3, 6)}


def _gloo(tmp_path, v: dict, rotate: str = "allgather") -> list[dict]:
    script = os.path.join(os.path.dirname(__file__), "data", "pp_cp_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(PP * CP), script, str(tmp_path), str(PP), str(CP), str(M), rotate,
                        *(str(v[k]) for k in "HKDLVFBS")], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines() if "rror" in line)[-4000:]
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(PP * CP)]


@pytest.mark.heavy
def test_real_gloo_cp2_pp2(tmp_path):
    """CP 2 × PP 2 (4 gloo ranks, mesh (pp, cp)), 1F1B over M = 2 micro-batches, fp32, at random
    sizes: every rank's model FLOPs, CP all-gather and all-to-all bytes, p2p bytes (the boundary of
    S/CP tokens), parameter elements, parameter, buffer and gradient bytes equal symcost's row of
    its pipeline rank; saved bytes equal M × the stage's on the first rank of each cp group and
    less by M·(blocks)·B·(S/CP)·H·D·4 on the last (its attention outputs' copies:
    tests/test_context_parallel.py ``test_real_gloo_cp2``); peaks within 5% (MemTracker); each
    rank computes on S/CP tokens; the ring's attention equals one device's; the bubble is 1F1B's
    (PP − 1)/M."""
    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import summary

    v = _draw(2861)
    spec = resolve("hf:llama", config=config(v))
    r = summary(spec, PP, "1f1b", M, precision="fp32", sizes={"B": v["B"], "S": v["S"], "CP": CP},
                inner=Layout(cp=True))
    assert r["bubble"] == pytest.approx((PP - 1) / M)
    got = _gloo(tmp_path, v)
    for g in got:
        row, mem = r["ranks"][g["pp_rank"]], r["ranks"][g["pp_rank"]]["memory"]
        what = (g["pp_rank"], g["cp_rank"], v)
        assert g["ring_error"] < 1e-5 and g["tokens"] == v["S"] // CP, what
        assert g["flops"] == row["flops"], (what, g["flops"], row["flops"])
        real = {grp: {k: Fraction(b) for k, b in d.items()} for grp, d in g["comm"].items()}
        assert real == {grp: {k: Fraction(b) for k, b in d.items()} for grp, d in row["comm"].items()}, (what, real)
        assert real["PP"] == {"send": row["send"], "recv": row["recv"]}, what
        assert real["CP"]["all_gather"] > 0 and real["CP"]["all_to_all"] > 0, what
        assert row["send"] == M * v["B"] * (v["S"] // CP) * v["H"] * v["D"] * 4, row
        assert g["params"] == row["params"], what
        assert (g["params_bytes"], g["buffers"], g["grads"]) == (mem["params"], mem["buffers"], mem["grads"]), what
        stage = r["stages"][g["pp_rank"]]
        less = 0 if g["cp_rank"] == 0 else M * r["blocks"][g["pp_rank"]] * v["B"] * (v["S"] // CP) * v["H"] * v["D"] * 4
        assert g["saved"] == M * stage["saved"] - less, (what, g["saved"], M * stage["saved"], less)
        assert abs(mem["peak"] - g["peak"]) <= 0.05 * g["peak"], (what, mem["peak"], g["peak"])


@pytest.mark.heavy
@pytest.mark.hf
def test_llama_3_8b_cp4_pp2_at_128k_parameters_per_rank():
    """Issue 28's acceptance shape with a pipeline: ``report tests/data/configs/llama-3-8b.json --cp 4
    --pp 2 --set S=131072`` (at L = 2: one block a stage, for speed) answers; each pipeline rank's
    parameters equal a meta-device count of its stage (transformers' model from the file: the
    embedding and block 0 on the first, block 1, the final norm and the head on the last; CP shards
    no parameter), and the stage boundary each rank sends is its S/CP tokens: B·(S/4)·d_model
    bf16 values per micro-batch (``bf16-true``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import summary

    path = os.path.join(os.path.dirname(__file__), "data", "configs", "llama-3-8b.json")
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_hidden_layers = 2
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    count = {0: 0, 1: 0}
    for name, p in model.named_parameters():
        count[0 if name.startswith(("model.embed_tokens", "model.layers.0.")) else 1] += p.numel()
    assert sum(count.values()) == sum(p.numel() for p in model.parameters())
    spec = resolve(path)
    S = 131072
    r = summary(spec, 2, "1f1b", 2, precision="bf16-true", sizes={"L": 2, "S": S, "B": 1, "CP": 4},
                inner=Layout(cp=True), peak=False)
    assert [row["params"] for row in r["ranks"]] == [count[0], count[1]], (r["ranks"], count)
    d = cfg.hidden_size
    for row in r["ranks"]:
        assert row["send"] == row["recv"] == 2 * 1 * (S // 4) * d * 2, row
    for st in r["stages"].values():
        assert st["comm"]["CP"] > 0, st


def test_cp_pp_gpu_refused_in_one_line():
    """``--gpu`` with ``--cp --pp`` (report and time): the pipeline's priced step adds no ring
    exposure and places no CP ranks in its links yet, so it is refused in one line that says what
    ``report --cp N --pp P`` answers, before any trace."""
    from click.testing import CliRunner

    from symcost.cli import main

    for cmd in (["report", "hf:llama"], ["time", "hf:llama", "--tokens", "1e9"]):
        r = CliRunner().invoke(main, [*cmd, "--cp", "2", "--pp", "2", "--gpu", "h100"])
        assert r.exit_code == 2 and "--gpu with --cp and --pp" in r.output and "Traceback" not in r.output, r.output

"""Expert parallelism inside pipeline stages (issue 28 item 1: ``--ep N --pp M``): each stage module
of the built-in ``moe`` traced as one rank of its EP group, as torchtitan composes them
(``pipeline_llm`` splits the model, then ``apply_moe_ep_tp`` shards each stage's experts over the
``ep`` mesh of that stage; symcost/passes/pipeline.py with ``inner=Layout(ep=True)``).

Oracles, independent of symcost's recorder, rules and fit: a real ``torchrun`` + gloo run of
PP 2 × EP 2 (4 ranks, tests/data/pp_ep_rank.py: PyTorch's ``PipelineStage`` + ``Schedule1F1B`` over
stage modules whose experts are ``Shard(0)`` DTensors, the routers forced to the balanced
assignment; FLOPs by ``flop_counter``'s registry, ``saved_tensors_hooks``, all-to-all bytes
(n-1)/n of their input, p2p bytes, the local shards' elements), and the stage modules built on the
meta device with each ``[E, ...]`` expert tensor cut to E/EP rows. The stages are traced once at a
small request; their formulas are evaluated at random sizes of its regime.
"""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from fractions import Fraction

import pytest

from symcost.frontends.layout import Layout

PP, M = 2, 2
#: the traced request (E a multiple of 8: every EP of 2, 4, 8 divides it; E/EP >= 2)
REQUEST = {"EP": 2, "B": 2, "S": 16, "H": 4, "D": 8, "L": 4, "V": 96, "F": 24, "E": 8, "R": 2}


@functools.lru_cache(maxsize=None)
def _stages():
    from symcost.passes.pipeline import trace_stages

    return trace_stages("moe", PP, precision="fp32", sizes=REQUEST, inner=Layout(ep=True))[1]


def _draw(rng: random.Random, ep: int) -> dict:
    """Random sizes of the traced regime: E a multiple of 8 with E/EP >= 2, B·S·R a multiple of E
    (balanced routing gives every expert whole slots), R >= 2, L >= PP."""
    e = rng.choice((8, 16))
    return {"EP": ep, "E": e, "R": rng.choice((2, 3)), "B": rng.randint(1, 2), "S": e * rng.randint(1, 2),
            "H": 2 * rng.randint(1, 3), "D": 4 * rng.randint(1, 2), "L": rng.randint(PP, PP + 2),
            "V": rng.randint(40, 120), "F": 8 * rng.randint(1, 3)}


def _rank(ans, v: dict, r: int) -> dict:
    """Pipeline rank ``r``'s step (M micro-batches) from its stage trace's formulas at ``v``."""
    from symcost.frontends.pipeline import stage_blocks

    an = ans["first" if r == 0 else "last"]
    env = an.bind(**{**{k: x for k, x in v.items() if k in an.symbols or k in ("B", "S")},
                     "L": stage_blocks(v["L"], PP)[r]})

    def ev(e):
        return Fraction(str(e.subs(env) if hasattr(e, "subs") else e))

    return {"flops": M * ev(an.flops("train")), "saved": M * ev(sum(rep * nb for _, nb, _, rep in an.saved)),
            "all_to_all": M * ev(an.comm_bytes("all_to_all", group="EP")),
            "send": M * ev(an.comm_bytes("send")), "recv": M * ev(an.comm_bytes("recv")),
            "shard": ev(an.params_shard), "whole": ev(an.params)}


@pytest.mark.heavy
def test_ep_is_a_symbol_of_every_stage():
    """Each stage kind is one EP rank: EP a symbol (not pinned), the all-to-all in the EP group
    only, and the rank's parameters the stage's with (1 - 1/EP) of its experts taken away."""
    import sympy

    from symcost.passes.expert_parallel import expert_params
    from symcost.tracing.fit import SYMS

    for part, an in _stages().items():
        assert "EP" in an.symbols and not an.pinned, (part, an.pinned)
        whole, rank = expert_params(an)
        assert sympy.expand(rank - whole / SYMS["EP"]) == 0 and whole != 0, part
        assert sympy.expand(an.params - an.params_shard - whole * (1 - 1 / SYMS["EP"])) == 0, part
        assert sympy.expand(an.comm_bytes("all_to_all") - an.comm_bytes("all_to_all", group="EP")) == 0, part


@pytest.mark.heavy
def test_real_gloo_pp2_ep2(tmp_path):
    """``torchrun --nproc-per-node 4``, gloo on this CPU: mesh ``(pp, ep) = (2, 2)``, 1F1B over
    2 micro-batches, each EP rank its own tokens. On every rank its FLOPs, saved bytes over the
    step, all-to-all bytes (the EP group), p2p bytes sent and received and parameter elements
    (the stage's dense ones and E/EP experts) equal the stage trace's formulas at random sizes."""
    v = _draw(random.Random(2805), 2)
    script = os.path.join(os.path.dirname(__file__), "data", "pp_ep_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        script, str(tmp_path), str(PP), "2", str(M), *(str(v[k]) for k in "HDLVFERBS")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines() if "rror" in line)[-4000:]
    ans = _stages()
    for i in range(PP * 2):
        got = json.loads((tmp_path / f"rank{i}.json").read_text())
        want = _rank(ans, v, got["pp_rank"])
        assert "other" not in got["comm"], got["comm"]
        real = {"flops": got["flops"], "saved": got["saved"], "all_to_all": Fraction(got["comm"]["EP"]["all_to_all"]),
                "send": Fraction(got["comm"]["PP"]["send"]), "recv": Fraction(got["comm"]["PP"]["recv"]),
                "shard": got["shard"], "whole": got["whole"]}
        assert real == want, (i, v, real, want)
        assert want["all_to_all"] > 0 and want["shard"] < want["whole"]


@pytest.mark.heavy
def test_report_pp_ep_parameters_per_rank_against_meta():
    """``report --pp 2 --ep N`` (``summary``) at random sizes of the traced regime, EP 2, 4 or 8:
    each rank's parameter elements equal the stage module built on the meta device (the other
    stages' blocks deleted, the embedding on the first stage, the final norm and head on the
    last) with every ``[E, ...]`` expert tensor cut to E/EP rows; its model states are 16 bytes
    (fp32 AdamW) per element of them plus torch.optim's 4-byte step counter per parameter tensor
    of the stage module, and its all-to-all bytes per step M times its stage's."""
    import torch

    from symcost.frontends.builtin.moe import MoELM
    from symcost.frontends.pipeline import stage_blocks
    from symcost.passes.pipeline import summary

    ans = _stages()
    rng = random.Random(2806)
    for ep in (2, 4, 8):
        v = _draw(rng, ep)
        v["E"] = max(v["E"], 2 * ep)
        blocks = stage_blocks(v["L"], PP)
        with torch.device("meta"):
            model = MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"])
        lo = 0
        for rank in range(PP):
            layers = list(model.layers)[lo:lo + blocks[rank]]
            lo += blocks[rank]
            n = 0
            for block in layers:
                for name, p in block.named_parameters():
                    n += p.numel() // ep if name.startswith("moe.experts.") else p.numel()
            # (the embedding runs before the blocks: the first stage's; the final norm and the
            # head after them: the last stage's)
            outside = {0: (model.token_embeddings,), PP - 1: (model.ln_final, model.lm_head)}[rank]
            n += sum(p.numel() for m in outside for p in m.parameters())
            assert _rank(ans, v, rank)["shard"] == n, (ep, rank, v)
    # the report's rows (the traces above): the rank's EP-local parameters, 16 bytes of fp32 AdamW
    # states each, and M micro-batches' all-to-alls of its stage
    r = summary("moe", PP, "1f1b", M, precision="fp32", sizes=REQUEST, inner=Layout(ep=True), peak=False)
    v = {**_stages()["first"].spec.defaults, **REQUEST}
    with torch.device("meta"):
        model = MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"])
    blocks = stage_blocks(v["L"], PP)
    tensors = {0: list(model.token_embeddings.parameters()), PP - 1: list(model.ln_final.parameters())
               + list(model.lm_head.parameters())}
    for rank in range(PP):
        tensors[rank] = len(tensors[rank]) + sum(len(list(b.parameters()))
                                                 for b in list(model.layers)[sum(blocks[:rank]):sum(blocks[:rank + 1])])
    for row in r["ranks"]:
        want = _rank(ans, REQUEST, row["rank"])
        assert row["params"] == want["shard"] < want["whole"], row
        assert row["model_states"] == 16 * row["params"] + 4 * tensors[row["rank"]], row
        assert row["flops"] == want["flops"], row


@pytest.mark.parametrize("args, words", [
    (["report", "moe", "--ep", "2", "--pp", "2", "--tp", "2", "--sp"], "without sequence parallelism"),
    (["report", "moe", "--ep", "2", "--pp", "2", "--dp", "2"], "modelled without pipeline and tensor parallelism for now"),
])
def test_pp_ep_refusals_are_one_line(args, words):
    """What ``--ep --pp`` does not model yet is refused in one line before any trace."""
    from click.testing import CliRunner

    from symcost.cli import main

    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output

"""``--pp`` on a model with several stacks of blocks (issue 30 item 6; docs/parallel.md §1.1 and
"Several stacks under --pp"): the guide's encoder-decoder (``encdec.py``) with its encoder and
decoder blocks cut as one list into pipeline stages, the encoder's output carried through the
decoder's stages.

The oracle is PyTorch running the stages as a user writes them for ``torch.distributed.pipelining``
(tests/data/encdec_stage.py: each stage a module with several inputs and outputs, written by hand
from the model's parts): FlopCounterMode's FLOPs, saved_tensors_hooks' bytes, the parameters each
stage holds and the bytes crossing its boundaries, at random sizes (and at sizes never traced for
the formulas), and one real 2-rank gloo run of ``PipelineStage`` + ``Schedule1F1B``.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import symcost
from test_own_symbols import examples  # noqa: F401 - the fixture
from test_own_symbols import _spec as _factory
from test_pipeline_parallel import _measure

sys.path.insert(0, str(Path(__file__).parent / "data"))


def _draw(rng: random.Random) -> dict:
    H = rng.choice([2, 4])
    return {"B": rng.randint(1, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": H,
            "D": rng.choice([2, 4, 6]), "V": rng.randint(11, 40), "F": rng.randint(5, 20)}


def _oracle(spec, values: dict, pp: int, stage: int) -> dict:
    """One micro-batch through stage ``stage`` of ``pp`` written by hand (encdec_stage.Stage), on
    fake tensors: FLOPs, saved bytes, parameters, and the bytes it receives and sends forward (each
    crossing backward as its gradient)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from encdec_stage import Stage, cut

    Le, Ld = values["L_enc"], values["L_dec"]
    with torch.device("meta"):
        whole = spec.build(values)
    st = Stage(whole, Le, Ld, pp, stage)
    B, S, Se, w = values["B"], values["S"], values["S_enc"], values["H"] * values["D"]
    e0, e1, d0, d1 = cut(Le, Ld, pp, stage)
    # what it receives: the encoder's hidden state where it starts inside the encoder, else the
    # decoder's (where it starts inside the decoder) and the encoder's output
    recv = [(B, Se, w)] if e0 > 0 and e1 > e0 else ([(B, S, w)] if d0 > 0 else []) + ([(B, Se, w)] if e1 == e0 else [])
    with FakeTensorMode(allow_non_fake_inputs=True):
        st.to_empty(device="cpu")
        (src, tgt), _ = spec.make_inputs(values, torch.device("cpu"))
        got = [torch.empty(s, requires_grad=True) for s in (recv if stage else [])]
        sent = []

        def run():
            out = st(*got, src=src, tgt=tgt)
            if st.last:
                spec.loss(out, ((src, tgt), {})).backward()
                return
            outs = out if isinstance(out, tuple) else (out,)
            sent.extend(outs)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        flops, saved = _measure(st, run)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"flops": flops, "saved": saved, "params": sum(p.numel() for p in st.parameters()),
            "p2p": nbytes(got) + nbytes(sent)}


@pytest.mark.heavy
def test_encdec_stages_against_pytorch(examples):  # noqa: F811 - the fixture
    """--pp 3 on encdec.py at random stack lengths whose cut mixes the stacks (a stage ending the
    encoder and starting the decoder, or one ending with the encoder and sending its output): each
    stage's FLOPs, saved bytes, parameters and p2p bytes (the received tensors and their gradients,
    the sent ones and theirs) equal the hand-written stage's at the request and, from the
    formulas (the stacks' lengths pinned), at random sizes never traced; per rank, m times the
    stage and 1F1B's micro-batches in flight."""
    import sympy

    from symcost.passes.pipeline import summary

    rng = random.Random(30)
    spec = _factory(examples["encdec.py"], "spec")
    Le, Ld = rng.choice([(3, 2), (2, 3), (3, 3), (4, 2)])
    pp, m = 3, rng.randint(3, 4)
    sizes = {**_draw(rng), "L_enc": Le, "L_dec": Ld}
    r = summary(spec, pp, "1f1b", m, precision="fp32", sizes=sizes, peak=False)
    assert [st["held"] for st in r["stacks"]] and sum(r["blocks"]) == Le + Ld, r["stacks"]
    other = {**_draw(rng), "L_enc": Le, "L_dec": Ld}
    for s in range(pp):
        want = _oracle(spec, {**spec.defaults, **sizes}, pp, s)
        st = r["stages"][s]
        assert (st["flops"], st["saved"], st["params"]) == (want["flops"], want["saved"], want["params"]), (s, sizes)
        assert st["send"] == st["recv"] == want["p2p"], (s, st["send"], st["recv"], want["p2p"])
        row = r["ranks"][s]
        assert row["flops"] == m * want["flops"] and row["send"] == m * want["p2p"], s
        assert row["activations"] == min(pp - s, m) * want["saved"], s
        assert set(r["pinned"][f"stage{s}"]) == {"L_enc", "L_dec"}, r["pinned"]
        # the formulas at sizes never traced (the stacks' lengths pinned)
        f = r["formulas"][f"stage{s}"]
        want = _oracle(spec, {**spec.defaults, **other}, pp, s)
        got = {k: int(sympy.sympify(f[k]).xreplace({x: other[x.name] for x in sympy.sympify(f[k]).free_symbols}))
               for k in ("flops", "saved", "send", "params")}
        assert got == {"flops": want["flops"], "saved": want["saved"], "send": want["p2p"],
                       "params": want["params"]}, (s, other)


def test_hf_encoder_decoders_refused_in_one_line(examples):  # noqa: F811 - the fixture
    """hf:t5 under --pp (keyword inputs: its masks and the position bias of each stack's block 0
    would cross the boundaries too), and encdec.py under --pp with --dp or interleaved stages: one
    line each, before any trace, saying what is staged and what is accepted."""
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import trace_stages

    encdec = _factory(examples["encdec.py"], "spec")
    small = {"L_enc": 2, "L_dec": 3, "H": 2, "D": 4}
    for call, words in ((lambda: trace_stages(resolve("hf:t5"), 2, sizes={"L": 2, "H": 2, "D": 4}), "keyword inputs"),
                        (lambda: trace_stages(encdec, 2, sizes=small, inner=Layout(shard="fsdp")),
                         "another mesh dimension or --ac beside --pp"),
                        (lambda: trace_stages(encdec, 2, virtual=2, sizes=small), "interleaved stages")):
        with pytest.raises(symcost.SymcostError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "several stacks of blocks" in msg and words in msg, msg
        assert "accepted for this model: --dp" in msg, msg


@pytest.mark.heavy
def test_real_gloo_encdec_pp2(examples, tmp_path):  # noqa: F811 - the fixture
    """torchrun, 2 processes, gloo on CPU: the hand-written stages of encdec.py (L_enc = 2,
    L_dec = 3: stage 0 ends the encoder and starts the decoder, sending (x, memory)) in
    PipelineStage + Schedule1F1B over 4 micro-batches: each rank's FLOPs, send/receive bytes and
    parameters equal symcost's, its peak (torch.profiler) within 5% of the schedule's run."""
    from symcost.passes.pipeline import summary

    rng = random.Random(31)
    spec = _factory(examples["encdec.py"], "spec")
    m = 4
    # (sizes where activations, not the allocator's few-byte scalars, make the peak)
    sizes = {"B": rng.randint(2, 3), "S": rng.randint(12, 20), "S_enc": rng.randint(12, 24), "H": rng.choice([2, 4]),
             "D": 8, "V": rng.randint(40, 80), "F": rng.randint(16, 40), "L_enc": 2, "L_dec": 3}
    from symcost.hardware.devices import get_device

    # (priced on a GPU too: the bound and the performance model's step over the stages' traces)
    r = summary(spec, 2, "1f1b", m, precision="fp32", sizes=sizes, device=get_device("h100"))
    assert r["step"]["predicted"]["step_seconds"] >= r["step"]["step_seconds"] > 0, r["step"]
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    args = [str(sizes[k]) for k in ("B", "S", "S_enc", "H", "D", "V", "F", "L_enc", "L_dec")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tests/data/pp_stacks_rank.py", str(tmp_path), str(examples["encdec.py"]), str(m), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = r["ranks"][rank]
        assert got["flops"] == want["flops"], rank
        assert got["p2p"] == {"send": want["send"], "recv": want["recv"]}, rank
        assert got["params"] == want["params"], rank
        real = 4 * got["params"] + got["grads"] + got["kept"] + got["top"]
        assert want["memory"]["peak"] == pytest.approx(real, rel=0.05), (rank, want["memory"], got, sizes)

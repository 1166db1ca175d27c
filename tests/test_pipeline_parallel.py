"""Pipeline parallelism (issue 16 item 2): stage modules of the block list traced per micro-batch,
composed by torch.distributed.pipelining's own schedules.

Oracles, independent of symcost's recorder and rules: ``FlopCounterMode`` and a
``saved_tensors_hooks`` pair on each stage module cut from the whole model (the other blocks
deleted, as torchtitan's pipeline_llm does), the boundary activation's bytes counted by hand,
Narayanan et al. 2021 (PTD-P) §2.2 for the bubble ((p−1)/m, interleaved (p−1)/(v·m)) and the
micro-batches in flight (1F1B: min(p − rank, m); GPipe: m; interleaved first rank: v·p + p − 1
model chunks, Korthikanti et al. 2022 §4.2.3), and a real torchrun + gloo run of
``PipelineStage`` + ``Schedule1F1B`` (tests/data/pp_rank.py). Sizes are drawn at random (seeded).
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

from symcost.errors import SymcostError
from symcost.frontends.pipeline import schedule_order, simulate


SEED = 7  # one draw of the sizes for every traced test here: the stage traces are shared
CACHE = ("cs336-lm", {}, None)  # through the trace cache, as `report --pp` traces them


def _draw(rng: random.Random) -> dict:
    return {"B": rng.randint(1, 3), "S": rng.randint(3, 24), "H": rng.choice((1, 2, 3)), "D": rng.choice((2, 4, 8)),
            "V": rng.randint(8, 80), "F": rng.randint(4, 40)}


@functools.lru_cache(maxsize=None)
def _summary(pp: int, schedule: str, m: int, L: int, seed: int):
    from symcost.passes.pipeline import summary

    sizes = dict(_draw(random.Random(seed)), L=L)
    return sizes, summary("cs336-lm", pp, schedule, m, sizes=sizes, cache=CACHE)


def test_schedule_bubble_and_in_flight_vs_ptdp():
    """Bubble and in-flight counts of PyTorch's action lists (run on a dependency clock) against
    PTD-P's formulas, at random PP, m and v."""
    rng = random.Random(16)
    cases = [("gpipe", rng.randint(2, 5), rng.randint(1, 9), 1) for _ in range(3)]
    cases += [("1f1b", p, rng.randint(p, 3 * p), 1) for p in (rng.randint(2, 5) for _ in range(3))]
    cases += [("interleaved-1f1b", p, p * rng.randint(1, 3), rng.randint(2, 3)) for p in (rng.randint(2, 4) for _ in range(3))]
    for schedule, p, m, v in cases:
        order = schedule_order(schedule, p, m, v)
        assert sorted(order) == list(range(p))
        # every micro-batch through every stage once forward and once backward
        for r, acts in order.items():
            assert sorted(a for a in acts if a[0] == "F") == sorted(("F", s, i) for s in range(r, p * v, p) for i in range(m))
        sim = simulate(order, t_f=1.0, t_b=rng.choice((1.0, 2.0, 3.0)))
        assert sim["bubble"] == pytest.approx((p - 1) / (v * m)), (schedule, p, m, v)
        for r in range(p):
            want = {"gpipe": m, "1f1b": min(p - r, m)}.get(schedule)
            if want is not None:
                assert sim["in_flight"][r] == want, (schedule, p, m, r)
        if schedule == "interleaved-1f1b" and m >= p:
            assert sim["in_flight"][0] == min(v * p + p - 1, v * m), (p, m, v)


def test_refused_pipelines_say_why():
    for args in (("zb", 2, 4, 1), ("1f1b", 1, 4, 1), ("1f1b", 2, 4, 2), ("interleaved-1f1b", 2, 4, 1), ("gpipe", 2, 0, 1)):
        with pytest.raises(SymcostError):
            schedule_order(*args)
    with pytest.raises(SymcostError, match="refuses"):  # PyTorch: 1F1B needs m >= PP
        schedule_order("1f1b", 4, 2, 1)


def _cut(L: int, pp: int, stage: int) -> tuple[int, int, str]:
    """The blocks ``[lo, hi)`` of stage ``stage`` of ``pp`` over L (the first L mod pp stages one
    more, as torchtitan splits) and its kind."""
    per = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]
    lo = sum(per[:stage])
    return lo, lo + per[stage], "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def _cpu_flash(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the CPU flash-attention kernel, which FlopCounterMode leaves out
    (docs/conventions.md): Q·Kᵀ and P·V, 2·B·H·S_q·S_k·(D + D_v), torch's ``sdpa_flop_count``
    written out (it asserts as many key as query heads; grouped-query attention has fewer)."""
    b, h, s_q, d = q
    return 2 * b * h * s_q * k[2] * (d + v[3])


def _cpu_flash_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    """Its backward's model FLOPs: the four gradient products, twice the forward (the scores it
    recomputes are hardware FLOPs, docs/conventions.md)."""
    return 2 * _cpu_flash(q, k, v)


def _measure(model, run) -> tuple[int, int]:
    """FLOPs (FlopCounterMode, the CPU flash-attention kernel added: :func:`_cpu_flash`) and saved
    bytes (saved_tensors_hooks: each storage once, the model's parameters and buffers left out)
    of ``run()``, one forward and backward of ``model`` (on real tensors, or fake ones inside the
    caller's FakeTensorMode)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten

    static = {StorageWeakRef(t.untyped_storage()).cdata for t in list(model.parameters()) + list(model.buffers())}
    seen, saved, refs = set(), [0], []

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in seen and ref.cdata not in static:
            seen.add(ref.cdata)
            refs.append(ref)
            saved[0] += t.untyped_storage().nbytes()
        return t

    fc = FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward})
    with fc, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return fc.get_total_flops(), saved[0]


def _oracle_stage(sizes: dict, L: int, pp: int, stage: int):
    """FLOPs (FlopCounterMode), saved bytes (saved_tensors_hooks) and boundary bytes of one
    micro-batch through stage ``stage`` of ``pp``, cut from the whole cs336-lm at L blocks."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.models import resolve
    from symcost.frontends.pipeline import make_stage, probe_boundary

    spec = resolve("cs336-lm")
    values = dict(sizes, L=L)
    with torch.device("meta"):
        meta = spec.build(values)
        model = spec.build(values)
    pre, post, templates, x_meta = probe_boundary(meta, "layers", *spec.make_inputs(values, torch.device("meta")))
    lo, hi, part = _cut(L, pp, stage)
    model.layers = torch.nn.ModuleList(list(model.layers)[lo:hi])
    make_stage(model, "layers", part, pre, post, templates)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        (tokens,), _ = spec.make_inputs(values, torch.device("cpu"))

        def run():
            if part == "first":
                out = model(tokens)
            else:
                x = torch.empty(x_meta.shape, dtype=x_meta.dtype, requires_grad=True)
                out = model(x, _in0=tokens)
            if part == "last":
                spec.loss(out, ((tokens,), {})).backward()
            else:
                out.backward(torch.empty_like(out))
        flops, saved = _measure(model, run)
        boundary = x_meta.numel() * x_meta.element_size()
    return flops, saved, boundary


@pytest.mark.heavy
def test_stage_flops_saved_and_p2p_vs_oracles():
    """Three stages (first, middle, last) with an uneven split of a random L: each stage's FLOPs,
    saved bytes and point-to-point bytes per micro-batch, and each rank's per-step totals."""
    rng = random.Random(2)
    pp, m = 3, rng.randint(3, 5)
    L = rng.randint(4, 7)
    sizes, r = _summary(pp, "1f1b", m, L, SEED)
    for s in range(pp):
        flops, saved, boundary = _oracle_stage(sizes, L, pp, s)
        st = r["stages"][s]
        assert st["flops"] == flops, s
        assert st["saved"] == saved, s
        links = (s > 0) + (s < pp - 1)  # activation one way, its gradient the other, per neighbour
        assert st["send"] == st["recv"] == links * boundary, s
        rank = r["ranks"][s]
        assert rank["flops"] == m * flops and rank["send"] == m * links * boundary
        assert rank["in_flight"] == min(pp - s, m)
        assert rank["activations"] == rank["in_flight"] * saved
    assert r["bubble"] == pytest.approx((pp - 1) / m)
    # the formulas in PP: at PP = 3 and L = 3k they give the stage's numbers (here L/PP blocks each)
    import sympy

    from symcost.tracing.fit import SYMS

    env = {SYMS[k]: v for k, v in sizes.items()}
    env[sympy.Symbol("PP", positive=True, integer=True)] = pp
    for s, part in ((0, "first"), (1, "middle"), (2, "last")):
        f = r["formulas"][part]["flops"].xreplace({**env, SYMS["L"]: pp * r["blocks"][s]})
        assert f == r["stages"][s]["flops"]
    # by hand: the last stage adds the head's matmul (2·B·S·d·V forward, twice that backward), the
    # first one an embedding gather (no model FLOPs)
    f = {p: r["formulas"][p]["flops"] for p in ("first", "middle", "last")}
    B, S, H, D, V = (SYMS[k] for k in "BSHDV")
    assert sympy.expand(f["last"] - f["middle"] - 6 * B * S * H * D * V) == 0
    assert sympy.expand(f["first"] - f["middle"]) == 0


#: precision -> (parameter dtype, autocast dtype or None): Lightning's names, as symcost reads them
_PRECISIONS = {"fp32": ("float32", None), "bf16-mixed": ("float32", "bfloat16"), "bf16-true": ("bfloat16", None)}


def _oracle_hf_stage(spec, values: dict, pp: int, stage: int, precision: str):
    """FLOPs (FlopCounterMode), saved bytes (saved_tensors_hooks) and boundary bytes of one
    micro-batch through stage ``stage`` of ``pp`` of a transformers causal LM in ``precision``,
    cut from the whole model by hand (none of symcost's stage code): the model keeps the stage's
    decoder layers; a stage before the last runs the base model with its final norm removed (its
    output is the last layer's); a stage after the first runs the model on the micro-batch's
    ``input_ids`` with the embedding computed without gradients (its output only feeds what the
    model's own code builds before the layers: positions, the causal mask, the rotary cos/sin in
    the embeddings' dtype, as a real stage rebuilds them), and the received activation (the
    embeddings' shape and dtype, requiring grad) takes the first layer's ``hidden_states``.

    The step runs on real CPU tensors (zeros), as PyTorch runs it: on fake ones transformers
    cannot read the position ids and builds a packed-sequence mask the real step never builds."""
    import contextlib

    import torch

    weights, cast = _PRECISIONS[precision]
    dtype = getattr(torch, weights)
    with torch.device("meta"):
        model = spec.build(values).to(dtype)
    base = model.model
    lo, hi, part = _cut(values["L"], pp, stage)
    base.layers = torch.nn.ModuleList(list(base.layers)[lo:hi])
    if part != "last":
        base.norm = torch.nn.Identity()
    autocast = (lambda: torch.autocast("cpu", dtype=getattr(torch, cast))) if cast else contextlib.nullcontext
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.zero_()
    _, inputs = spec.make_inputs(values, torch.device("cpu"))
    ids = inputs["input_ids"]
    x = torch.zeros(*ids.shape, model.config.hidden_size, dtype=dtype, requires_grad=True)
    if part != "first":
        embed = base.embed_tokens.forward
        base.embed_tokens.forward = lambda *a, **k: torch.no_grad()(embed)(*a, **k)
        base.layers[0].register_forward_pre_hook(
            lambda m, a, k: ((x,) + tuple(a[1:]), k) if a else (a, dict(k, hidden_states=x)), with_kwargs=True)

    def run():
        with autocast():
            out = model(input_ids=ids, labels=ids).loss if part == "last" else base(input_ids=ids).last_hidden_state
        if part == "last":
            out.backward()
        else:
            out.backward(torch.zeros_like(out))
    flops, saved = _measure(model, run)
    return flops, saved, x.numel() * x.element_size()


def _stage_at(an, values: dict, blocks: int) -> dict:
    """A stage trace's FLOPs, saved bytes and p2p bytes per micro-batch at ``values`` with
    ``blocks`` blocks, as :func:`symcost.passes.pipeline.summary` evaluates them."""
    import sympy

    from symcost.passes.pipeline import _saved

    env = an.bind(**{**{k: v for k, v in values.items() if k != "L"}, "L": blocks})
    ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
    return {"flops": ev(an.flops("train")), "saved": ev(_saved(an)), "send": ev(an.comm_bytes("send")),
            "recv": ev(an.comm_bytes("recv"))}


def _check_stage(spec, an, values: dict, pp: int, stage: int, precision: str):
    """The stage trace ``an`` against :func:`_oracle_hf_stage` at ``values``: FLOPs, saved bytes,
    and a boundary's bytes each way per neighbour."""
    lo, hi, _ = _cut(values["L"], pp, stage)
    got = _stage_at(an, values, hi - lo)
    flops, saved, boundary = _oracle_hf_stage(spec, values, pp, stage, precision)
    assert (got["flops"], got["saved"]) == (flops, saved), (spec.name, precision, values, stage)
    links = (stage > 0) + (stage < pp - 1)
    assert got["send"] == got["recv"] == links * boundary, (spec.name, values, stage)


@pytest.mark.heavy
def test_llama3_8b_pp4_answers_and_its_stages_vs_oracle():
    """Issue 27: ``report tests/data/configs/llama-3-8b.json --config num_hidden_layers=4 --pp 4
    --set B=1 S=512 --precision bf16-true`` failed with sdpa's "Expected query, key, and value to
    have the same dtype": a stage after the first replaces the embedding by a stand-in that
    returned the outputs of a boundary probe run in fp32, so transformers' rotary embedding made
    its cos/sin (and q, k with them) fp32 beside a bf16 v. Now the boundary is probed in the
    step's precision. At the real shape every rank answers: one block each, the boundary's bytes
    counted by hand (B·S·4096 bf16 elements, each way, per micro-batch and neighbour), 1F1B's
    PP − rank micro-batches in flight, equal middle ranks. Then the three stage kinds' formulas
    (that trace, regime B = 1, 1 < K < H) at random small sizes of the same regime (checked
    with ``in_regime``) against PyTorch on the stages cut by hand from the same config
    (:func:`_oracle_hf_stage`), an uneven split of L over the 4 stages included."""
    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import summary, trace_stages

    precision, pp, m = "bf16-true", 4, 4
    spec = resolve("tests/data/configs/llama-3-8b.json", {"num_hidden_layers": "4"})
    request = {"B": 1, "S": 512}
    r = summary(spec, pp, "1f1b", m, precision=precision, sizes=request, peak=False)
    boundary = 1 * 512 * 4096 * 2
    for row in r["ranks"]:
        links = (row["rank"] > 0) + (row["rank"] < pp - 1)
        assert row["blocks"] == 1 and row["in_flight"] == pp - row["rank"], row
        assert row["send"] == row["recv"] == m * links * boundary, row
        assert row["flops"] > 0 and row["activations"] > 0
    assert r["ranks"][1]["flops"] == r["ranks"][2]["flops"] < r["ranks"][3]["flops"]
    _, ans = trace_stages(spec, pp, 1, precision, request)  # (the traces summary made)
    rng = random.Random(f"{SEED}:llama-3-8b")
    H = rng.choice((4, 6, 8))
    values = {"B": 1, "S": rng.randint(3, 12), "H": H, "K": rng.choice([k for k in range(2, H) if H % k == 0]),
              "D": rng.choice((4, 8)), "F": rng.randint(4, 32), "V": rng.randint(16, 80),
              "L": rng.randint(pp, pp + 2)}
    small = resolve("tests/data/configs/llama-3-8b.json", {"num_hidden_layers": str(values["L"])})
    checked = set()
    for stage in range(pp):
        _, _, part = _cut(values["L"], pp, stage)
        if part not in checked:  # (one regime check per stage kind)
            checked.add(part)
            assert ans[part].in_regime(**{k: v for k, v in values.items() if k != "L"}), (part, values)
        _check_stage(small, ans[part], values, pp, stage, precision)


#: the other transformers families with rotary position embeddings, each in one precision
HF_ROPE = {"mistral": "bf16-mixed", "qwen2": "fp32", "qwen3": "bf16-true", "gemma": "bf16-mixed"}


@pytest.mark.heavy
@pytest.mark.parametrize("family", sorted(HF_ROPE))
def test_hf_rope_last_stage_vs_oracle(family):
    """``--pp`` on the other transformers RoPE families (their stages after the first failed like
    Llama's under bf16-true; the first stage, which keeps the embedding, is Llama's case above):
    the last stage of PP = 2 traced in the family's precision at random small sizes (grouped
    query attention, Qwen3's and Gemma's model width M apart from H·D), its FLOPs and saved bytes
    per micro-batch against PyTorch on the stage cut by hand (:func:`_oracle_hf_stage`), its
    point-to-point bytes the boundary's."""
    import symcost
    from symcost.frontends.models import resolve
    from symcost.frontends.pipeline import stage_spec

    rng = random.Random(f"{SEED}:{family}")
    precision, pp = HF_ROPE[family], 2
    L = rng.randint(pp, pp + 2)
    spec = resolve(f"hf:{family}", {"num_hidden_layers": str(L)})
    H = rng.choice((2, 4))
    values = {"B": rng.randint(1, 2), "S": rng.randint(3, 12), "H": H,
              "K": rng.choice([k for k in (1, 2, 4) if H % k == 0]), "D": rng.choice((4, 8)),
              "F": rng.randint(4, 32), "V": rng.randint(16, 80), "L": L}
    if "M" in spec.symbols:
        values["M"] = rng.choice((8, 12, 16))
    an = symcost.trace(stage_spec(spec, "last", "model.layers", precision=precision),
                       sizes={k: v for k, v in values.items() if k != "L"}, precision=precision)
    _check_stage(spec, an, values, pp, pp - 1, precision)


@pytest.mark.heavy
def test_real_gloo_run_1f1b_pp2(tmp_path):
    """torchrun, 2 processes, gloo on CPU: PipelineStage + Schedule1F1B over 4 micro-batches;
    each rank's FLOPs, saved bytes, send/receive bytes and parameters equal symcost's."""
    rng = random.Random(5)
    m, L = 4, rng.randint(2, 5)
    sizes, r = _summary(2, "1f1b", m, L, SEED)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    args = [str(x) for x in (m, sizes["B"], sizes["S"], sizes["H"], sizes["D"], L, sizes["V"], sizes["F"])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tests/data/pp_rank.py", str(tmp_path), "1f1b", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = r["ranks"][rank]
        assert got["flops"] == want["flops"], rank
        assert got["saved"] == m * r["stages"][rank]["saved"], rank  # every micro-batch's saved storages
        assert got["p2p"] == {"send": want["send"], "recv": want["recv"]}, rank
        assert got["params"] == want["params"], rank
        # peak of the step (no optimizer), profiler vs PyTorch's schedule run on fake tensors:
        # fp32 parameters, the stage's buffers (a rotary table), gradients, what the warm-up left
        assert got["buffers"] == want["memory"]["buffers"], rank
        real = 4 * got["params"] + got["buffers"] + got["grads"] + got["kept"] + got["top"]
        assert want["memory"]["peak"] == pytest.approx(real, rel=0.05), (rank, want["memory"], got)


@pytest.mark.heavy
def test_real_gloo_run_torchtitan_split_pp3(tmp_path):
    """torchrun, 3 processes, gloo on CPU, the blocks split as torchtitan's default splits them
    (the embedding and the output weigh a block each: the oracle is torchtitan's own function,
    tests/data/torchtitan_split.py, whose module lists the real run's stages get): each rank's
    FLOPs, saved bytes, send/receive bytes and parameters equal symcost's under --pp-split
    torchtitan, and its peak is within 5%."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
    from torchtitan_split import _generate_llm_fqn_per_model_part

    from symcost.passes.pipeline import summary

    rng = random.Random(33)
    pp, m, L = 3, 3, rng.randint(5, 7)
    blocks = [sum(1 for n in part if n.startswith("layers.")) for part in _generate_llm_fqn_per_model_part(pp, L)]
    assert len(set(blocks)) > 1  # (an uneven split: the case the option is for)
    sizes = dict(_draw(random.Random(SEED)), L=L)
    r = summary("cs336-lm", pp, "1f1b", m, sizes=sizes, cache=CACHE, split="torchtitan")
    assert r["blocks"] == blocks and r["split"] == "torchtitan:1,1"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    args = [str(x) for x in (m, sizes["B"], sizes["S"], sizes["H"], sizes["D"], L, sizes["V"], sizes["F"])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp),
           "tests/data/pp_rank.py", str(tmp_path), "1f1b", *args, ",".join(map(str, blocks))]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in range(pp):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = r["ranks"][rank]
        assert want["blocks"] == blocks[rank]
        assert got["flops"] == want["flops"], rank
        assert got["saved"] == m * r["stages"][rank]["saved"], rank
        assert got["p2p"] == {"send": want["send"], "recv": want["recv"]}, rank
        assert got["params"] == want["params"], rank
        real = 4 * got["params"] + got["buffers"] + got["grads"] + got["kept"] + got["top"]
        assert want["memory"]["peak"] == pytest.approx(real, rel=0.05), (rank, want["memory"], got)


@pytest.mark.heavy
def test_stage_traces_round_trip_the_trace_cache(monkeypatch):
    """``report --pp`` keeps each stage kind's trace in the trace cache: a second process (here:
    the in-process traces dropped and tracing made to fail) reads them back and gives every
    rank the same FLOPs, activations, p2p bytes and bubble, at another PP and m too (L is a
    symbol of the stage)."""
    import symcost
    import symcost.passes.pipeline as P

    sizes = dict(_draw(random.Random(SEED)), L=6)
    cache = CACHE  # (the other tests' stage traces, when they ran first in this process)
    want = {pp: P.summary("cs336-lm", pp, "1f1b", m, sizes=sizes, peak=False, cache=cache) for pp, m in ((2, 4), (3, 5))}
    monkeypatch.setattr(P, "_TRACES", {})

    def no_trace(*a, **k):
        raise AssertionError("traced again: the cache was not read")
    monkeypatch.setattr(symcost, "trace", no_trace)
    for (pp, m), w in zip(((2, 4), (3, 5)), want.values()):
        got = P.summary("cs336-lm", pp, "1f1b", m, sizes=sizes, peak=False, cache=cache)
        assert got["ranks"] == w["ranks"] and got["bubble"] == w["bubble"], pp
        assert got["formulas"] == w["formulas"]


def test_rank_peaks_round_trip_the_trace_cache(monkeypatch):
    """Each rank's peak (its schedule run on fake tensors, tens of seconds at 70B) is kept in
    the trace cache: the same request reads it back without running the schedule, to the byte
    and with the same collectives; another micro-batch size runs it again."""
    import symcost.passes.pipeline as P
    import symcost.tracing.pipeline as T

    # (the file's sizes, whose stage traces the tests before this one keep in the trace cache,
    # at another B than theirs: a schedule run of this request is not in the cache yet)
    sizes = dict(_draw(random.Random(SEED)), L=4)
    sizes["B"] += 1
    runs = []
    real = T.rank_memory

    def counted(*a, **k):
        runs.append(a[6])
        return real(*a, **k)
    monkeypatch.setattr(T, "rank_memory", counted)
    first = P.summary("cs336-lm", 2, "1f1b", 4, sizes=sizes, cache=CACHE)
    assert sorted(runs) == [0, 1]
    again = P.summary("cs336-lm", 2, "1f1b", 4, sizes=sizes, cache=CACHE)
    assert sorted(runs) == [0, 1], "ran the schedule again: the cache was not read"
    assert [r["memory"] for r in again["ranks"]] == [r["memory"] for r in first["ranks"]]
    assert [r["comm"] for r in again["ranks"]] == [r["comm"] for r in first["ranks"]]
    P.summary("cs336-lm", 2, "1f1b", 4, sizes=dict(sizes, B=sizes["B"] + 1), cache=CACHE)
    assert sorted(runs) == [0, 0, 1, 1]


def test_cli_pipeline_options_need_pp():
    from click.testing import CliRunner

    from symcost.cli import main

    for extra in (["--schedule", "gpipe"], ["--microbatches", "4"], ["--virtual-stages", "2"]):
        r = CliRunner().invoke(main, ["report", "cs336-lm", *extra])
        assert r.exit_code == 2 and "needs --pp N" in r.output, r.output
    r = CliRunner().invoke(main, ["report", "cs336-lm", "--pp", "4", "--microbatches", "2", "--precision", "fp32"])
    assert r.exit_code == 2 and "refuses" in r.output and r.output.count("\n") <= 2, r.output
    for extra, said in ((["--devices-per-node", "4"], "needs --gpu"), (["--gpu", "h100", "--nodes", "2"], "--nodes"),
                        (["--gpu", "h100", "--device", "a100"], "two devices"), (["--gpu", "tpu9"], "tpu9")):
        r = CliRunner().invoke(main, ["report", "cs336-lm", "--pp", "2", *extra])
        assert r.exit_code == 2 and said in r.output and r.output.count("\n") <= 2, (extra, r.output)


@pytest.mark.heavy
def test_cli_report_pp_json():
    """``report --pp 2 --schedule gpipe --microbatches m --gpu h100 --json``: per rank the bubble
    and the micro-batches in flight of GPipe (Huang et al. 2019: all m), and the boundary's bytes
    counted by hand (B·S·H·D fp32 elements forward, the same backward, per micro-batch).

    The priced step: GPipe's makespan for identical micro-batches through stages of unequal
    times is the flow shop's Σ_s t_s + (m − 1)·max_s t_s, forward and then backward (every
    forward ends on the last rank before its first backward); each stage's p2p seconds are the
    boundary's bytes over the H100's NVLink (450 GB/s per direction, both ranks in one node); a
    rank is busy m·(t_f + t_b) of its stage; MFU = Σ ranks' FLOPs / (PP · peak · step).

    The predicted step (issue 29, ``step.predicted``): the same flow shop with the performance
    model's stage times, each at least the stage's roofline time; each stage's p2p time is α (the
    efficiency's collective latency) + the boundary's bytes over NVLink, one send per micro-batch
    (the activation forward from stage 0, its gradient backward from stage 1); no data
    parallelism, so nothing exposed; the step ends when the last rank's AdamW step does, whose
    per-byte part is the rank's fp32 parameters."""
    from click.testing import CliRunner

    from symcost.cli import main
    from symcost.hardware.devices import get_device

    rng = random.Random(3)
    m = rng.randint(2, 6)
    sizes = dict(_draw(random.Random(SEED)), L=rng.randint(2, 6))
    args = ["report", "cs336-lm", "--pp", "2", "--schedule", "gpipe", "--microbatches", str(m), "--precision", "fp32",
            "--gpu", "h100", "--set"] + [f"{k}={v}" for k, v in sizes.items()]
    r = CliRunner().invoke(main, args + ["--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])["pipeline"]
    assert d["bubble"] == pytest.approx(1 / m)
    boundary = 4 * sizes["B"] * sizes["S"] * sizes["H"] * sizes["D"]
    for row in d["ranks"]:
        assert row["in_flight"] == m
        assert row["send"] == row["recv"] == m * boundary
        assert row["blocks"] == sizes["L"] // 2 + (row["rank"] < sizes["L"] % 2)
    st = d["step"]
    t = {int(s): v for s, v in st["stage_seconds"].items()}
    fwd, bwd = [t[s]["forward"] for s in (0, 1)], [t[s]["backward"] for s in (0, 1)]
    assert st["step_seconds"] == pytest.approx(sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd))
    for s in (0, 1):
        assert t[s]["p2p"] == pytest.approx(boundary / 450e9)
        assert st["busy"][str(s)] == pytest.approx(m * (fwd[s] + bwd[s]))
        assert st["idle"][str(s)] == pytest.approx(st["step_seconds"] - m * (fwd[s] + bwd[s]))
    assert st["model_flops"] == sum(row["flops"] for row in d["ranks"])
    peak = get_device("h100").peak_for("fp32")[0]
    assert st["mfu"] == pytest.approx(st["model_flops"] / (2 * peak * st["step_seconds"]))
    from symcost.passes.performance import efficiency_of

    eff = efficiency_of(get_device("h100"))
    pr = st["predicted"]
    q = {int(s): v for s, v in pr["stage_seconds"].items()}
    pf, pb = [q[s]["forward"] for s in (0, 1)], [q[s]["backward"] for s in (0, 1)]
    finish = {int(k): v for k, v in pr["finish"].items()}
    assert max(finish.values()) == pytest.approx(sum(pf) + (m - 1) * max(pf) + sum(pb) + (m - 1) * max(pb))
    for s in (0, 1):
        assert q[s]["p2p"] == pytest.approx(boundary / 450e9 + eff.collective_latency)
        assert pf[s] > fwd[s] and pb[s] > bwd[s]  # the prediction above the bound, stage by stage
        assert pr["dp_exposed"][str(s)] == 0
    opt = {int(k): v for k, v in pr["optimizer"].items()}
    for row in d["ranks"]:
        tensors = (opt[row["rank"]] - eff.optimizer_per_byte * 4 * row["params"]) / eff.optimizer_per_tensor
        assert tensors == pytest.approx(round(tensors), abs=1e-6) and round(tensors) >= 1
    assert pr["step_seconds"] == pytest.approx(max(finish[r] + opt[r] for r in finish))
    assert pr["step_seconds"] > st["step_seconds"]
    assert pr["mfu_predicted"] == pytest.approx(st["model_flops"] / (2 * peak * pr["step_seconds"]))
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0 and "step on h100-sxm: predicted" in text.output and "step bound" in text.output \
        and "idle" in text.output, text.output


@pytest.mark.heavy
@pytest.mark.hf
def test_real_gloo_hf_model_rank_peaks(tmp_path):
    """Issue 27 (the pipeline's per-rank peak was left out for transformers models: keyword
    inputs, the model's own loss): torchrun, 2 processes, gloo on CPU, a 4-block ``hf:llama``
    (GQA) at a random size split into two stages, every stage given ``input_ids`` and ``labels``,
    the last returning the model's loss, Schedule1F1B over 4 micro-batches
    (tests/data/pp_hf_rank.py): each rank's peak of the step (torch.profiler) is within 5% of
    the one symcost reports, which runs PyTorch's schedule on fake tensors."""
    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import summary

    rng = random.Random(27)
    hid, heads = 16 * rng.randint(3, 6), 4
    cfg = {"num_hidden_layers": "4", "hidden_size": str(hid), "num_attention_heads": str(heads),
           "num_key_value_heads": "2", "intermediate_size": str(8 * rng.randint(12, 24)),
           "vocab_size": str(8 * rng.randint(24, 48))}
    m, B, S = 4, rng.randint(1, 3), 8 * rng.randint(4, 10)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    args = [str(x) for x in (m, B, S, 4, hid, heads, 2, cfg["intermediate_size"], cfg["vocab_size"])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tests/data/pp_hf_rank.py", str(tmp_path), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = summary(resolve("hf:llama", cfg), 2, "1f1b", m, precision="fp32", sizes={"B": B, "S": S, "L": 4})
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = r["ranks"][rank]
        assert got["params"] == want["params"], rank
        real = 4 * got["params"] + got["grads"] + got["kept"] + got["top"]
        assert want["memory"]["peak"] == pytest.approx(real, rel=0.05), (rank, want["memory"], got)


def test_max_batch_pp_exact_at_the_boundary():
    """Issue 27 (``max-batch`` had no ``--pp``): the largest micro-batch B under a random cap fits
    and B + 1 does not, by the peaks ``report --pp`` gives (the most loaded rank's, optimizer
    state included), both run at those B."""
    from click.testing import CliRunner

    from symcost.cli import main
    from symcost.passes.pipeline import summary

    rng = random.Random(2727)
    cap = rng.randint(40, 80) * 2**20  # (B of a few sequences: each B a short fake run)
    # (S = 512: about 15 MiB a sequence, so the cap holds a few (B = 3 here); at S = 64 it held
    # 102 and the search ran fake steps up to B = 178)
    sizes = ["H=4", "D=16", "L=2", "V=256", "S=512"]
    r = CliRunner().invoke(main, ["max-batch", "megatron-gpt", "--pp", "2", "--memory", f"{cap}B", "--json",
                                  "--set", *sizes])
    assert r.exit_code == 0, r.output
    js = json.loads(r.output)
    b = js["value"]
    assert b >= 1
    values = {k: int(v) for k, v in (s.split("=") for s in sizes)}
    for bb, fits in ((b, True), (b + 1, False)):
        s = summary("megatron-gpt", 2, "1f1b", 2, precision="bf16-mixed", sizes={**values, "B": bb})
        top = max(row["peak_with_optimizer"] for row in s["ranks"])
        assert top == js["peaks"][str(bb)]["peak"]
        assert (top <= cap) == fits, (bb, top, cap)
    parts = js["peak_parts"]
    assert parts["B"] == b and sum(v for k, v in parts.items() if k not in ("B", "rank", "peak")) == parts["peak"] \
        == js["peaks"][str(b)]["peak"]
    # the text says it as the one-device max-batch does: M(B) ≤ cap < M(B + 1), not "<="
    text = CliRunner().invoke(main, ["max-batch", "megatron-gpt", "--pp", "2", "--memory", f"{cap}B", "--set", *sizes],
                              env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    assert f"largest micro-batch B = {b}" in text.output and "<=" not in text.output, text.output
    assert f"check: M({b}) = " in text.output and f"≤ cap < M({b + 1}) = " in text.output, text.output
    assert f"What the peak at B = {b} is made of" in text.output, text.output


def test_max_batch_pp_nothing_fits_says_what_to_try():
    """Issue 27 (newcomer walkthrough): ``max-batch --pp`` exited 3 with one line when not even
    B = 1 fits. As the one-device max-batch, it shows what the smallest case's peak is made of
    (the parts add up to the most loaded rank's peak at B = 1) and what to try: the least cap
    (that peak), an optimizer without state (run: its peak is the same ranks' runs with no
    optimizer state, below the AdamW one by the state), checkpointing and sharding."""
    from click.testing import CliRunner

    from symcost.cli import main

    sizes = ["H=4", "D=16", "L=2", "V=256", "S=64"]
    r = CliRunner().invoke(main, ["max-batch", "megatron-gpt", "--pp", "2", "--memory", "1MiB", "--json",
                                  "--set", *sizes])
    assert r.exit_code == 3, r.output
    js = json.loads(r.output)
    assert js["value"] == 0
    at1 = js["peaks"]["1"]["peak"]
    parts = js["peak_parts"]
    assert parts["B"] == 1 and parts["rank"] == js["peaks"]["1"]["rank"]
    assert sum(v for k, v in parts.items() if k not in ("B", "rank", "peak")) == parts["peak"] == at1
    alts = {a["option"]: a for a in js["alternatives"]}
    assert alts[f"--memory {at1}B or more"]["peak"] == at1 and alts[f"--memory {at1}B or more"]["fits"] is True
    sgd = alts["--optimizer sgd-nomomentum"]
    # (the most loaded rank may change without the state: its peak is at least rank X's without it)
    assert at1 - parts["optimizer"] <= sgd["peak"] < at1 and sgd["fits"] is (sgd["peak"] <= 2**20)
    assert any(o.startswith("--ac") for o in alts) and any("--shard fsdp" in o for o in alts)
    text = CliRunner().invoke(main, ["max-batch", "megatron-gpt", "--pp", "2", "--memory", "1MiB", "--set", *sizes],
                              env={"COLUMNS": "200"})
    assert text.exit_code == 3, text.output
    assert "even B = 1 does not fit" in text.output and "What the peak at B = 1 is made of" in text.output
    assert "what to try" in text.output and f"--memory {at1}B or more: fits B = 1" in text.output, text.output


def test_pipeline_peak_with_ac_alone_checkpoints_the_blocks():
    """``--pp N --ac full`` without another mesh dimension: the per-rank peak's run checkpoints
    each stage's blocks (it ran them uncheckpointed: the peak of ``--pp --ac`` was that of
    ``--pp``). With every block recomputed, the first rank's highest live set is below the
    plain step's, by at least one micro-batch's saved activations of a block."""
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.tracing.pipeline import rank_memory

    spec = resolve("cs336-lm")
    v = spec.values(dict(_draw(random.Random(SEED + 1)), L=4))
    plain = rank_memory(spec, v, "layers", 2, "1f1b", 2, 0, 1, "fp32", None)
    ac = rank_memory(spec, v, "layers", 2, "1f1b", 2, 0, 1, "fp32", Layout(ac="full"))
    assert ac["params"] == plain["params"]
    assert ac["top"] < plain["top"], (ac, plain)


def test_pipeline_peak_counts_the_policy_model_states():
    """The pipeline peak with the optimizer adds, beside what the schedule's run holds (its
    parameters and traced gradients), the rest of the precision policy's model states: under
    Megatron's bf16 policy 18 bytes per parameter (bf16 weights, the fp32 main-gradient buffer,
    fp32 master weights and Adam moments: Megatron-LM's table, docs/memory.md), so 14 more than
    the run's 2 + 2; the fp32 buffer was counted at the traced gradients' 2 bytes (12P: MG8's
    last stage short by 2P, docs/validation.md)."""
    from symcost.passes.pipeline import summary

    r = summary("megatron-gpt", 2, "1f1b", 2, precision="megatron-bf16",
                sizes={"H": 4, "D": 16, "L": 2, "V": 256, "S": 64, "B": 2})
    for row in r["ranks"]:
        m = row["memory"]
        assert m["params"] == m["grads"] == 2 * row["params"]  # (bf16 weights and their traced gradients)
        assert row["model_states"] == 18 * row["params"]
        assert row["peak_with_optimizer"] - m["peak"] == 14 * row["params"], row


def test_cli_report_pp_json_keeps_the_report_contract():
    """Issue 27 (newcomer walkthrough): ``report --pp --json`` held only ``model`` and ``pipeline``,
    not the keys README.md gives as ``report --json``'s contract, and its mesh was prose. Every
    key of the one-device report at the same sizes is there: ``params*`` the whole model's (the
    stages' sum), ``flops`` and the other totals the most loaded rank's step, each rank's under
    ``pipeline.ranks[i].totals``, whose model FLOPs over the ranks add up to m micro-batches of
    the one-device step. ``layout.mesh`` is ``{dimension: size}``. With ``--memory`` between the
    two ranks' peaks, the rank above it is flagged (JSON ``fits``, the text's ``does not fit``)
    and the text opens with the one-device report's precision and optimizer rows."""
    from click.testing import CliRunner

    from symcost.cli import main

    sizes = dict(_draw(random.Random(SEED)), L=2)
    m = 2
    sets = ["--precision", "fp32", "--set"] + [f"{k}={v}" for k, v in sizes.items()]
    one = CliRunner().invoke(main, ["report", "cs336-lm", "--json", *sets])
    assert one.exit_code == 0, one.output
    one = json.loads(one.output)
    args = ["report", "cs336-lm", "--pp", "2", "--microbatches", str(m), *sets]
    r = CliRunner().invoke(main, args + ["--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(one) <= set(d), set(one) - set(d)
    for k in ("flops_hw", "flops_all", "bytes", "transcendentals"):
        assert set(d[k]) == set(one[k]), k
    assert set(d["flops"]) == set(one["flops"]) - {"remainder"}  # (the 6·N·P form's: the one-device report's)
    for k in ("params", "params_embedding", "params_nonembedding", "params_active", "params_matmul", "precision",
              "attention", "attention_flops_count", "tied_symbols", "moe"):
        assert d[k] == one[k], k
    assert {s: x["value"] for s, x in d["symbols"].items()} == {s: sizes[s] for s in d["symbols"]}
    ranks = d["pipeline"]["ranks"]
    for kind in ("flops", "flops_hw"):
        for ph in ("forward", "backward", "train"):
            assert sum(row["totals"][kind][ph] for row in ranks) == m * one[kind][ph], (kind, ph)
    assert sum(row["totals"]["attention_flops"] for row in ranks) == m * one["attention_flops"]
    for row in ranks:
        assert row["totals"]["flops"]["train"] == row["flops"]
    busiest = max(ranks, key=lambda row: row["totals"]["flops_hw"]["train"])
    assert d["rank"] == busiest["rank"]
    for k in ("flops_hw", "flops_all", "bytes", "transcendentals", "unsupported_ops"):
        assert d[k] == busiest["totals"][k], k
    assert d["flops"]["train"] == d["flops"]["train_simplified"] == busiest["flops"]
    assert d["layout"]["mesh"] == {"pp": 2}
    peaks = {row["rank"]: row["peak_with_optimizer"] for row in ranks}
    assert d["memory"]["peak"] == max(peaks.values()) and peaks[d["memory"]["rank"]] == d["memory"]["peak"]
    assert d["memory"]["fits"] is True and d["memory"]["memory_cap"] == 80 * 2**30
    lo, hi = sorted(peaks.values())
    assert lo < hi
    cap = (lo + hi) // 2
    r = CliRunner().invoke(main, args + ["--json", "--memory", f"{cap}B"])
    assert r.exit_code == 0, r.output
    c = json.loads(r.output)
    over = [rk for rk, pk in peaks.items() if pk > cap]
    assert c["memory"]["fits"] is False and c["memory"]["ranks_over_cap"] == over and c["memory"]["memory_cap"] == cap
    assert [row["fits"] for row in c["pipeline"]["ranks"]] == [peaks[rk] <= cap for rk in sorted(peaks)]
    text = CliRunner().invoke(main, args + ["--memory", f"{cap}B"], env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    for rk in peaks:
        assert (f"does not fit: rank {rk} peaks at" in text.output) == (rk in over), text.output
    plain = CliRunner().invoke(main, ["report", "cs336-lm", *sets, "--memory", f"{cap}B"], env={"COLUMNS": "200"})
    words = [" ".join(line.split()) for line in text.output.splitlines()]
    row = next(" ".join(line.split()) for line in plain.output.splitlines() if line.startswith("precision "))
    assert row in words, text.output  # (the one-device report's precision row, bytes per parameter included)
    assert "optimizer  adamw; memory cap" in text.output and "(--memory)" in text.output
    assert "computed in" in text.output and "each rank's step through the schedule" in text.output

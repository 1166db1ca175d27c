"""Tensor and sequence parallelism (issue 16, item 1): one rank of the Megatron plan, applied by
PyTorch's ``parallelize_module`` on the fake process group, traced with the group size as the
symbol TP.

Oracles, independent of symcost's recorder, rules and fit: Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", Table 2 and Sec. 4.2) for the activations
per layer; PyTorch itself running the parallelised model on the fake group
(tests/data/tp_rank.py ``measure``: ``torch.utils.flop_counter``'s formulas on the local ops,
``saved_tensors_hooks``, collectives seen at dispatch with nccl-tests' ring factors typed by
hand) at random sizes; and a real ``torchrun`` + gloo run of two ranks.
"""
from __future__ import annotations

import functools
import json
import os
import random
import sys
from fractions import Fraction

import pytest
import sympy

import symcost
from symcost.tracing.fit import SYMS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from tp_rank import fake_peak, fake_rank_model, measure, torchtitan_sp_rank_model, transformers_rank_model  # noqa: E402

PRECISION = "bf16-true"  # 16-bit activations, as the paper counts (2 bytes), 1-byte dropout masks


def _trace(sp: bool, model: str = "megatron-gpt"):
    # one cache key however it is called: lru_cache keys (False,) and (False, "megatron-gpt")
    # apart, and each miss is a tensor-parallel trace of 13-36 s
    return _trace_once(bool(sp), model)


@functools.lru_cache(maxsize=None)
def _trace_once(sp: bool, model: str):
    from symcost.frontends.models import resolve
    from symcost.frontends.layout import Layout

    return symcost.trace(resolve(model), layout=Layout(tp=True, sp=sp),
                         sizes={"TP": 8, "S": 64, "H": 16, "D": 8, "V": 128,
                                **({"F": 128} if model == "cs336-lm" else {})}, precision=PRECISION)


def _per_layer_saved(an):
    """Bytes one block saves for backward (the folded block's saved tensors, repeat L)."""
    L = SYMS["L"]
    return sympy.expand(sum(nb for _, nb, _, rep in an.saved if rep == L))


B, S, H, D, TP = (SYMS[k] for k in ("B", "S", "H", "D", "TP"))
s, b, h, a, t = S, B, H * D, H, TP


def test_korthikanti_table2_tensor_parallel():
    """TP row: s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer. What the paper drops, exactly:
    each LayerNorm's mean and rstd, [b, s, 1] in 16 bits, two per LayerNorm: 8·s·b."""
    an = _trace(False)
    paper = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert sympy.simplify(_per_layer_saved(an) - paper - 8 * s * b) == 0, _per_layer_saved(an)


def test_korthikanti_table2_tensor_and_sequence_parallel():
    """TP+SP row: s·b·h·(34/t + 5·a·s/(h·t)) bytes per layer, plus exactly

    * 8·s·b/t: the LayerNorms' mean and rstd, now over s/t tokens (the paper drops them);
    * 4·s·b·h·(1 - 1/t): the inputs of the QKV and the MLP's first Linear are saved as PyTorch's
      DTensor gathers them (2·s·b·h each, the whole sequence), where Megatron-LM saves each
      rank's s/t shard and gathers it again in backward (Korthikanti et al. Sec. 4.2.2); not a
      dropped term but a difference of the implementations, which the trace shows."""
    an = _trace(True)
    paper = s * b * h * (34 / t + 5 * a * s / (h * t))
    rest = 8 * s * b / t + 4 * s * b * h * (1 - 1 / t)
    assert sympy.simplify(_per_layer_saved(an) - paper - rest) == 0, _per_layer_saved(an)


def _selective_spec():
    """megatron-gpt with Korthikanti et al.'s selective recomputation (Sec. 5): the attention
    core (Q·Kᵀ, softmax, its dropout, ·V) of every layer under a non-reentrant checkpoint, the
    projections outside it. (The forward is megatron-gpt's ParallelAttention.forward split at
    the projections.)"""
    import dataclasses
    import math
    import types

    import torch

    from symcost.frontends.models import resolve
    from symcost.passes.checkpoint import traced_checkpoint

    spec = resolve("megatron-gpt")

    def forward(self, x):
        def core(qkv):
            q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            probs = self.attention_dropout(scores.softmax(dim=-1))
            return torch.matmul(probs, v).transpose(1, 2).flatten(-2)

        return self.dense(traced_checkpoint(core, self.query_key_value(x), use_reentrant=False))

    def build(values):
        model = spec.build(values)
        for layer in model.layers:
            layer.self_attention.forward = types.MethodType(forward, layer.self_attention)
        return model

    return dataclasses.replace(spec, name="megatron-gpt-selective", build=build)


@functools.lru_cache(maxsize=None)
def _trace_recompute(kind: str, sp: bool):
    from symcost.frontends.models import resolve
    from symcost.frontends.layout import Layout
    from symcost.passes.checkpoint import uniform_spec

    spec = _selective_spec() if kind == "selective" else uniform_spec(resolve("megatron-gpt"), "layers", 1)
    return symcost.trace(spec, layout=Layout(tp=True, sp=sp), sizes={"TP": 8, "S": 64, "H": 16, "D": 8, "V": 128},
                         precision=PRECISION)


def test_korthikanti_table2_selective_recompute():
    """TP + selective recomputation row: s·b·h·(10 + 24/t) per layer (the attention core's
    5·a·s²·b/t no longer saved), plus exactly the LayerNorm statistics (8·s·b) and the CPU
    generator state the checkpoint keeps to replay the attention dropout
    (``passes.checkpoint.rng_state_bytes``; 16 bytes of Philox state on a GPU)."""
    from symcost.passes.checkpoint import rng_state_bytes

    an = _trace_recompute("selective", False)
    paper = s * b * h * (10 + 24 / t)
    assert sympy.simplify(_per_layer_saved(an) - paper - 8 * s * b - rng_state_bytes()) == 0, _per_layer_saved(an)


def test_korthikanti_table2_full_recompute():
    """Full recomputation (every block under a checkpoint) with TP + SP: each layer keeps its
    input, 2·s·b·h/t (the rank's s/t tokens; the paper's no-parallelism row 2·s·b·h, divided by
    t as sequence parallelism shards it), plus the CPU generator state of the checkpoint; the
    model FLOPs grow by one forward of the blocks (per rank, /t)."""
    from symcost.passes.checkpoint import rng_state_bytes

    an = _trace_recompute("full", True)
    assert sympy.simplify(_per_layer_saved(an) - 2 * s * b * h / t - rng_state_bytes()) == 0, _per_layer_saved(an)
    L = SYMS["L"]
    block_fwd = sympy.diff(_trace(True).flops("forward"), L)
    assert sympy.simplify(sympy.diff(an.flops("train") - _trace(True).flops("train"), L) - block_fwd) == 0


def test_collectives_per_layer_follow_megatron():
    """Per layer: TP all-reduces 2·s·b·h bytes twice forward and twice backward (Shoeybi et al.
    2019, Fig. 3: f and g); SP replaces each all-reduce by an all-gather and a reduce-scatter of
    the same size (Korthikanti et al. Sec. 4.2.2), so the ring bytes per rank are equal:
    16·s·b·h·(t-1)/t per layer either way."""
    L = SYMS["L"]
    ring = 2 * s * b * h * (t - 1) / t  # (n-1)/n of a 2·s·b·h tensor
    tp, sp = _trace(False), _trace(True)
    assert sympy.simplify(sympy.diff(tp.comm_bytes("all_reduce"), L) - 4 * 2 * ring) == 0
    assert sympy.diff(tp.comm_bytes("all_gather"), L) == 0 and sympy.diff(tp.comm_bytes("reduce_scatter"), L) == 0
    assert sympy.simplify(sympy.diff(sp.comm_bytes("all_gather"), L) - 4 * ring) == 0
    assert sympy.simplify(sympy.diff(sp.comm_bytes("reduce_scatter"), L) - 4 * ring) == 0
    assert sympy.diff(sp.comm_bytes("all_reduce"), L) == 0


def _fake_rank(sp: bool, values: dict, model: str = "megatron-gpt") -> dict:
    """PyTorch's own step of rank 0 of ``values["TP"]`` on the fake group, fake tensors
    (tests/data/tp_rank.py ``measure``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.models import resolve

    spec = resolve(model)
    m, ctx = fake_rank_model(spec, values, sp)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        return measure(m, spec, values, ctx)


def _draw(rng: random.Random, sp: bool) -> dict:
    """Random sizes in the traces' regime: TP from 2, 4, 8; H, V (and S with SP) in the
    request's class mod 8, as the trace's probes (``tensor_parallel``); B, S/TP and heads per
    rank of 1 run other kernels (regimes of their own) and are not drawn."""
    tp = rng.choice((2, 4, 8))
    return {"TP": tp, "B": rng.randint(2, 5), "S": 8 * rng.randint(2, 40) if sp else rng.randint(2, 300),
            "H": max(8 * rng.randint(1, 3), 2 * tp), "D": rng.choice((4, 6, 8, 16)), "L": rng.randint(1, 4),
            "V": 8 * rng.randint(1, 30), "F": 8 * rng.randint(2, 12)}


def _assert_rank(an, v: dict, got: dict) -> None:
    """symcost's per-rank model FLOPs, saved bytes, collective bytes by kind and parameter
    elements at sizes ``v`` equal PyTorch's (``got``: tests/data/tp_rank.py ``measure``)."""
    env = an.bind(**v)
    assert int(an.flops("train").subs(env)) == got["flops"], v
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (kind, v)
    assert int(an.params_shard.subs(env)) == got["shard"], v


@pytest.mark.parametrize("model,sp,n", [("megatron-gpt", False, 4), ("megatron-gpt", True, 4), ("gpt2", True, 2),
                                         ("cs336-lm", True, 2)])
def test_per_rank_against_pytorch_on_the_fake_group(model, sp, n):
    """At random sizes (TP 2 to 8, S above 256 among the draws without SP): per-rank model
    FLOPs, saved bytes, collective bytes by kind and parameter elements of the rank equal what
    PyTorch runs on the fake group (gpt2: its head tied to the token embedding, both split by
    vocabulary rows, kept tied; cs336-lm: Linear and Embedding classes of its own, SwiGLU, RoPE)."""
    an = _trace(sp, model)
    rng = random.Random(16 + sp)
    for _ in range(n):
        v = {k: x for k, x in _draw(rng, sp).items() if k in an.symbols or k in ("B", "S", "L")}
        got = _fake_rank(sp, v, model)
        _assert_rank(an, v, got)


@pytest.mark.parametrize("model,sp,n", [("megatron-gpt", False, 2), ("megatron-gpt", True, 1), ("gpt2", True, 1),
                                         ("cs336-lm", True, 1)])
def test_rank_peak_against_memtracker_on_the_fake_group(model, sp, n):
    """The rank's peak memory of a steady-state step (bf16 model, AdamW in its for-loop form)
    at random sizes and TP equals what PyTorch's ``MemTracker`` measures on rank 0 of the fake
    group (tests/data/tp_rank.py ``fake_peak``), to the byte, with and without sequence
    parallelism; L >= 3 where the middle blocks differ from the first (cs336-lm under SP)."""
    from symcost.passes.memory import memory_model

    an = _trace(sp, model)
    mm = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu")
    rng = random.Random(1600 + 10 * sp + len(model))
    for i in range(n):
        v = {k: x for k, x in _draw(rng, sp).items() if k in an.symbols or k in ("B", "S", "L")}
        v["L"] = max(v["L"], 3 if i == 0 else 2)  # (the schedule holds for L >= 2; L = 1 is its own trace)
        sizes = {k: x for k, x in v.items() if k in an.symbols}
        assert mm.peak(**sizes) == fake_peak(resolve_spec(model), v, sp), (v, mm.peak_where(**sizes))


def resolve_spec(model: str):
    from symcost.frontends.models import resolve

    return resolve(model)


def test_rank_peak_parts_follow_the_shards():
    """The static part of the rank's peak is the precision policy applied to the rank's own
    parameter elements (``params_shard``: the column- and row-parallel shards plus what the plan
    replicates), Adam's two moments alike, plus one 4-byte step counter per tensor; the parts add
    up to the peak, whose formula is in TP. ``report --tp``'s ``memory`` (parameters and AdamW
    state with the step counters) equals rank 0's after a real AdamW step on the fake process
    group (DTensors counted by their local tensors; torch.optim's 0-d ``step`` per parameter
    tensor, a plain tensor), and the peak's static parts; its ``grads`` equal the rank's
    gradients after the backward: the shards', but the vocabulary-parallel embedding's, which
    comes back as a whole ``Replicate`` DTensor beside its ``Shard(0)`` weight (V·H·D elements,
    not V·H·D/TP, as on two real gloo ranks; docs/parallel.md §11), AdamW's moments the
    weight's ``[V/TP, h]`` shards."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Replicate, Shard

    from symcost.passes.memory import memory_model
    from symcost.passes.tensor_parallel import summary

    an = _trace(False)
    mm = memory_model(an, PRECISION, "adamw")
    assert sympy.simplify(mm.params - 2 * an.params_shard) == 0
    assert sympy.simplify(mm.optimizer - 4 * an.params_shard - 4 * mm.n_tensors) == 0
    rng = random.Random(1601)
    v = {k: x for k, x in _draw(rng, False).items() if k in an.symbols}
    v["L"] = max(v["L"], 2)
    out = summary(an, PRECISION, sizes=v, impl="for-loop")
    pk = out["peak"]
    assert pk["value"] == mm.peak(**v) and sum(pk["parts"].values()) == pk["value"] and pk["where"]
    mem = out["values"]["memory"]
    assert (int(mem["params"]), int(mem["optimizer_state"])) == (pk["parts"]["params"], pk["parts"]["optimizer"])
    spec = resolve_spec("megatron-gpt")
    model, loss_context = fake_rank_model(spec, {**spec.defaults, **v}, False)

    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        args, kwargs = spec.make_inputs({**spec.defaults, **v}, torch.device("cpu"))
        with loss_context():
            spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
        grads = sum(size(p.grad) for p in model.parameters())
        emb = model.word_embeddings.weight
        placed = (emb.placements, emb.grad.placements, tuple(emb.grad.to_local().shape))
        opt.step()
        real = {"params": sum(size(p) for p in model.parameters()), "grads": grads,
                "optimizer_state": sum(size(t) for st in opt.state.values() for t in st.values())}
        moments = {tuple(t.to_local().shape) for t in opt.state[emb].values() if t.dim()}
    assert {k: int(mem[k]) for k in real} == real, (v, mem, real)
    h, V, tp = v["H"] * v["D"], v["V"], v["TP"]
    assert placed == ((Shard(0),), (Replicate(),), (V, h)) and moments == {(V // tp, h)}, (placed, moments)
    assert int(mem["grads"]) - int(mem["params"]) == 2 * V * h * (tp - 1) // tp  # (bf16: the table's rest)
    # (report --tp's line: the gradient elements beyond the shards, as PyTorch's rank holds them)
    assert 2 * int(out["grads_beyond_shards"].xreplace(an.bind(**v))) == real["grads"] - real["params"]
    # plan's row of the same layout holds the same model states (its screen before any trace)
    from symcost.hardware.devices import get_device
    from symcost.passes.plan import Layout as Row, Planner

    row = Planner(an, v, get_device("h100"), PRECISION).evaluate(
        Row(dp=1, tp=tp, pp=1, b=v["B"], m=1, shard="ddp", checkpoint="none"))
    assert row["memory"]["model_states"] == int(mem["total"]), (row["memory"], mem)
    assert SYMS["TP"] in pk["formula"].free_symbols


def test_inverse_tp_generator_round_trips():
    """Sizes in 1/TP are ring elements (the generator for 1/TP, as for 1/DP): converting,
    evaluating and the sign test (sufficient for every TP >= 1) stay exact; so in the ring of
    the 2-D mesh, over DP and TP together (both inverses generators, DP's first)."""
    from symcost.passes.memory.live import _peval, _sign
    from symcost.tracing.poly import Algebra, terms_expr

    alg = Algebra(("B", "S", "TP"))
    Bs, Ss, TPs = (SYMS[k] for k in ("B", "S", "TP"))
    e = 6 * Bs * Ss / TPs + 2 * Bs * Ss + 3 * TPs * Ss
    p = alg.from_expr(e)
    assert sympy.simplify(alg.expr(p) - e) == 0
    assert sympy.simplify(terms_expr(alg.gens, alg.terms(p)) - e) == 0
    rng = random.Random(16)
    for _ in range(5):
        bv, sv, tv = rng.randint(1, 9), rng.randint(1, 99), rng.randint(1, 64)
        assert _peval(p, alg.values((bv, sv, tv))) == Fraction(6 * bv * sv, tv) + 2 * bv * sv + 3 * tv * sv
    assert _sign(alg, p) == 1 and _sign(alg, -p) == -1
    assert _sign(alg, alg.from_expr(Ss / TPs - 1)) == 0
    alg2 = Algebra(("B", "DP", "TP"))
    DPs = SYMS["DP"]
    e2 = 6 * Bs / (DPs * TPs) + 2 * Bs / DPs + 3 * TPs + DPs * Bs
    p2 = alg2.from_expr(e2)
    assert sympy.simplify(alg2.expr(p2) - e2) == 0
    assert sympy.simplify(terms_expr(alg2.gens, alg2.terms(p2)) - e2) == 0
    for _ in range(5):
        bv, dv, tv = rng.randint(1, 9), rng.randint(1, 16), rng.randint(1, 16)
        assert _peval(p2, alg2.values((bv, dv, tv))) == Fraction(6 * bv, dv * tv) + Fraction(2 * bv, dv) + 3 * tv + dv * bv
    assert _sign(alg2, p2) == 1 and _sign(alg2, -p2) == -1


def test_trace_cache_serves_other_tp(cache_dir):
    """A ``--tp --sp`` trace written to the trace cache (key options ``{"tp", "sp"}``) and read
    back serves another TP in the same residue classes: its rank's peak equals MemTracker's on
    the fake group (PyTorch, rank 0) at that TP; a request with another S class mod 8, one head
    per rank, or without SP does not match it."""
    from symcost.graph import cache
    from symcost.passes.memory import memory_model

    an = _trace(True)  # traced at TP = 8, S = 64, H = 16, V = 128
    k = cache.key("megatron-gpt", {}, "eager", PRECISION, {"tp": True, "sp": True})
    req = {"TP": 8, "S": 64, "H": 16, "D": 8, "V": 128}
    assert cache.store(k, req, an) is not None
    rng = random.Random(1602)
    v = {"TP": rng.choice((2, 4)), "B": 2, "S": 8 * rng.randint(2, 12), "H": 16, "D": 8, "L": rng.randint(2, 3), "V": 128}
    got = cache.load(k, v)
    assert got is not None and got.parallel == "tp+sp"
    sizes = {x: y for x, y in v.items() if x in got.symbols}
    assert memory_model(got, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**sizes) \
        == fake_peak(resolve_spec("megatron-gpt"), v, True)
    assert cache.load(k, dict(v, S=v["S"] + 4)) is None  # another class of S mod 8
    assert cache.load(k, dict(v, TP=16)) is None  # one head per rank: a regime of its own
    assert cache.load(cache.key("megatron-gpt", {}, "eager", PRECISION, {"tp": True, "sp": False}), v) is None


def test_uneven_vocabulary_against_pytorch_on_the_fake_group():
    """TP = 2 with an odd V (a newcomer's ``report hf:bart --tp 2``, V = 50265, was refused after
    ~19 s: 'no probe sizes ... stay in the regime'): PyTorch runs it, DTensor's Shard(0) giving
    rank 0 ⌈V/2⌉ vocabulary rows. The trace pins V and TP (the reason in ``pin_reasons``), the
    other symbols free: at the request and at another random point of B, S, H, D, L the rank's
    model FLOPs, saved bytes, collective bytes and parameter elements equal PyTorch's on rank 0
    of the fake group."""
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    rng = random.Random(50265)
    v0, v1 = ({**_draw(rng, False), "TP": 2, "H": 8 * rng.randint(1, 2)} for _ in range(2))
    v0["V"] = v1["V"] = 2 * rng.randint(4, 60) + 1
    sizes = {k: x for k, x in v0.items() if k != "F"}
    an = symcost.trace(resolve("megatron-gpt"), layout=Layout(tp=True), sizes=sizes, precision=PRECISION,
                       torch_device="cpu")
    assert an.pinned == {"V": v0["V"], "TP": 2}, an.pinned
    assert an.pin_reasons["V"].startswith(f"V = {v0['V']} is not a multiple of TP = 2: the rank's vocabulary "
                                          f"shard is ⌈V/TP⌉ = {(v0['V'] + 1) // 2} rows"), an.pin_reasons
    for v in (v0, v1):
        v = {k: x for k, x in v.items() if k != "F"}
        got = _fake_rank(False, v)
        _assert_rank(an, v, got)


def test_cli_report_tp_sp_json():
    """``report megatron-gpt --tp 4 --sp --json``: comm.*, model FLOPs, activations and the
    rank's parameter bytes at the sizes asked for equal what PyTorch runs on rank 0 of the fake
    group."""
    import json

    from click.testing import CliRunner

    from symcost.cli import main

    rng = random.Random(11)
    v = {"TP": 4, "B": rng.randint(2, 4), "S": 8 * rng.randint(2, 6), "H": 8, "D": rng.choice((4, 8)),
         "L": max(2, rng.randint(1, 3)), "V": 8 * rng.randint(2, 9)}
    args = ["report", "megatron-gpt", "--tp", "4", "--sp", "--precision", PRECISION, "--torch-device", "cpu",
            "--json", "--set"] + [
        f"{k}={x}" for k, x in v.items() if k != "TP"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    got = _fake_rank(True, v)
    for kind, want in got["comm"].items():
        assert Fraction(d["comm"][kind]) == Fraction(want), kind
    assert d["parallel"] == {**d["parallel"], "tp": 4, "sp": True}
    assert d["flops"]["train"] == got["flops"]
    assert d["parallel"]["memory_per_rank"]["activations"] == got["saved"]
    assert d["parallel"]["memory_per_rank"]["params"] == 2 * got["shard"]  # bf16 weights
    assert d["parallel"]["memory"]["peak"] == fake_peak(resolve_spec("megatron-gpt"), v, True)  # (L >= 2 drawn)
    assert sum(d["parallel"]["memory"]["parts"].values()) == d["parallel"]["memory"]["peak"]
    r = CliRunner().invoke(main, [a for a in args if a != "--json"])
    assert r.exit_code == 0 and "memory.peak" in r.output and "peak per rank at:" in r.output, r.output


def test_max_batch_tp_at_the_boundary_against_memtracker(capsys):
    """`max-batch --tp N [--sp]` solves the rank's peak: with the cap halfway between the peaks
    PyTorch's MemTracker measures on rank 0 of the fake group at B0 and B0 + 1 (bf16 model,
    for-loop AdamW, random sizes and TP), the answer is B0, per rank of TP."""
    from conftest import run_cli

    rng = random.Random(2026)
    sp = rng.random() < 0.5
    v = {k: x for k, x in _draw(rng, sp).items() if k in ("TP", "S", "H", "D", "L", "V")}
    v["L"] = max(v["L"], 3)  # (cs336-lm-like middle blocks aside, L >= 2 is the schedule's regime)
    b0 = rng.randint(2, 4)
    spec = resolve_spec("megatron-gpt")
    lo, hi = (fake_peak(spec, {**v, "B": b}, sp) for b in (b0, b0 + 1))
    assert hi > lo
    cap = lo + (hi - lo) // 2
    sets = [f"{k}={x}" for k, x in v.items() if k != "TP"]
    code, out, err = run_cli(capsys, "max-batch", "megatron-gpt", "--tp", str(v["TP"]), *(["--sp"] if sp else []),
                             "--set", *sets, "--precision", PRECISION, "--optimizer-impl", "for-loop",
                             "--torch-device", "cpu", "--memory", str(max(cap, 2**20)), "--json")
    assert code == 0, err
    res = json.loads(out)
    assert cap >= 2**20, (lo, hi)  # (the cap is at least 1 MiB at these sizes)
    assert res["max_batch"] == b0 and res["parallel"] == {"tp": v["TP"], "sp": sp, "per_rank": True}, (res, v, lo, hi)
    assert res["memory_at_max"] == lo and res["memory_at_next"] == hi


@pytest.mark.parametrize("args,msg", [
    (["--sp"], "--sp needs --tp N"),
    (["--tp", "3", "--set", "H=4"], "heads do not split over 3 ranks (accepted: a TP that divides 4: 2, 4)"),
    # (Megatron-LM's run pads the vocabulary to a multiple of 128·TP: _vocab_size_with_padding)
    (["--tp", "2", "--precision", "megatron-bf16", "--set", "V=51201"],
     "Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by (128) × TP = 256 "
     "(_vocab_size_with_padding), 51456 rows: ask for --set V=51456"),
])
def test_cli_refusals(args, msg):
    from click.testing import CliRunner

    from symcost.cli import main

    r = CliRunner().invoke(main, ["report", "megatron-gpt"] + args)
    assert r.exit_code == 2 and msg in r.output, r.output


def _gloo_v(sp: bool) -> dict:
    """The random size of test_real_gloo_two_ranks' run without / with SP."""
    rng = random.Random(2 + sp)
    return {"TP": 2, "H": 8, "D": rng.choice((4, 8)), "L": max(2, rng.randint(1, 3)),
            "V": 8 * rng.randint(2, 10), "B": rng.randint(2, 3), "S": 8 * rng.randint(1, 3)}


@pytest.fixture(scope="module")
def gloo_2(tmp_path_factory):
    """Both runs of test_real_gloo_two_ranks (without and with SP, :func:`_gloo_v`) on the same 2
    gloo ranks in one launch (tests/data/tp_rank.py's runs joined by ``+``: the ranks start and
    join the process group once; each run its own model and measurement): ``{sp: ranks}``."""
    import json
    import subprocess

    out = tmp_path_factory.mktemp("tp2")
    script = os.path.join(os.path.dirname(__file__), "data", "tp_rank.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               OMP_NUM_THREADS="1")
    args = []
    for sp in (False, True):
        (out / str(int(sp))).mkdir()
        args += (["+"] if sp else []) + [str(out / str(int(sp))), "1" if sp else "0"] \
            + [str(_gloo_v(sp)[k]) for k in "HDLVBS"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        script] + args, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "\n".join(line for line in r.stderr.splitlines()
                                        if any(w in line for w in ("Error", "error", "rank", "terminate", "what()", "enforce")))[-4000:]
    return {sp: [json.loads((out / str(int(sp)) / f"rank{rank}.json").read_text()) for rank in range(2)]
            for sp in (False, True)}


@pytest.mark.heavy
@pytest.mark.parametrize("sp", [False, True])
def test_real_gloo_two_ranks(sp, gloo_2):
    """``torchrun --standalone --nproc-per-node 2`` with gloo on this CPU, real bf16 tensors
    (tests/data/tp_rank.py): each rank's FLOPs, saved bytes, collective bytes and parameter
    elements equal symcost's per-rank values at a random size, and its peak memory of a
    steady-state AdamW step (torch.profiler) is within 5% of symcost's. (Both runs in one launch:
    :func:`gloo_2`.)"""
    from symcost.passes.memory import memory_model

    v = _gloo_v(sp)
    an = _trace(sp)
    env_s = an.bind(**v)
    for rank in range(2):
        got = gloo_2[sp][rank]
        assert got["world"] == 2
        assert int(an.flops("train").subs(env_s)) == got["flops"], rank
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env_s)) == got["saved"], rank
        for kind, want in got["comm"].items():
            assert Fraction(str(an.comm_bytes(kind).subs(env_s))) == Fraction(want), (kind, rank)
        assert int(an.params_shard.subs(env_s)) == got["shard"], rank
        # the rank's peak: torch.profiler's allocator level at the ends of top-level ops (aten and
        # the collectives), over the bytes live before the step
        want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
        assert abs(want - got["peak_ops"]) <= 0.05 * got["peak_ops"], (rank, want, got)


def test_hf_qwen3_replicated_norms_all_reduce_their_gradients():
    """``hf:qwen3``'s ``base_model_tp_plan`` has ``replicated_with_grad_allreduce`` for the
    per-head ``q_norm``/``k_norm`` (transformers' ``ReplicatedWithGradAllReduce``: replicated
    weights, gradients summed over the group in a post-accumulate hook). Traced (not refused),
    and at a random size and TP the rank's FLOPs, saved bytes, collective bytes (the norms'
    gradient all-reduces included) and parameter elements equal PyTorch's on the fake group."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.models import resolve
    from symcost.frontends.layout import Layout

    spec = resolve("hf:qwen3", {"num_hidden_layers": "2"}, "eager")
    an = symcost.trace(spec, layout=Layout(tp=True), sizes={"TP": 2, "B": 2, "S": 32}, precision=PRECISION)
    assert "TP" in an.symbols
    rng = random.Random(3)
    v = {"TP": rng.choice((2, 4)), "B": rng.randint(2, 4), "S": rng.randint(8, 64), "L": rng.randint(1, 3)}
    values = spec.values(v)
    m, ctx = fake_rank_model(spec, values, False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        got = measure(m, spec, values, ctx)
    _assert_rank(an, v, got)
    _assert_replicated(an, v, m, nonempty=False)  # transformers splits every matrix of a dense Qwen3
    D, L, TP = SYMS["D"], SYMS["L"], SYMS["TP"]
    # the norms' gradients: 2 tensors of D bf16 elements per block, all-reduced (ring: 2(TP-1)/TP)
    assert sympy.expand(an.comm_bytes("all_reduce", "backward")).coeff(D * L) == sympy.expand(2 * D * 2 * 2 * (TP - 1) / TP / D)


def test_six_n_p_of_one_rank():
    """One rank's model FLOPs are 6·N·P/TP + the attention's score and value matmuls per rank:
    Narayanan et al. 2021 (PTD-P), Appendix, eq. (3): 72·B·S·L·h² (1 + S/(6h)) + 6·B·S·h·V for a
    GPT forward+backward, each of the t ranks running 1/t of it (Shoeybi et al. 2019, §3), with
    the paper's 96 = 72 + 24 written as the 6·N·P part (P = 12·L·h² + h·V, the matmul
    parameters) plus 12·B·L·S²·h; the report's remainder is that attention term, never a
    negative share of the whole model (it once subtracted the whole 6·N·P from one rank's)."""
    for sp in (False, True):
        an = _trace(sp)
        P, rem, _ = an.train_simplified()
        B, S, L, V = (SYMS[k] for k in "BSLV")
        assert sympy.simplify(an.flops("train") - (6 * B * S * P + 12 * B * L * S**2 * h) / t) == 0
        assert sympy.simplify(rem - 12 * B * L * S**2 * h / t) == 0, rem


@pytest.mark.parametrize("args,msg", [
    (["time", "megatron-gpt", "--tp", "2", "--device", "h100", "--tokens", "1e9", "--mfu", "0.45"],
     "time --tp needs --gpu NAME"),
    (["max-batch", "megatron-gpt", "--tp", "2", "--memory", "80GiB", "--checkpoint", "every-layer"],
     "--checkpoint is not modelled with --tp yet"),
    (["max-batch", "megatron-gpt", "--tp", "2", "--global-batch", "64", "--devices", "8"],
     "--global-batch with --tp is not modelled yet"),
    (["report", "cs336-lm", "--pp", "2", "--gpu", "h100-sxm", "--nodes", "2"], "--pp with --nodes is not modelled yet"),
    (["report", "cs336-lm", "--pp", "2", "--gpu", "nosuchgpu"], "unknown device 'nosuchgpu'"),
    (["report", "cs336-lm", "--dp", "8", "--gpu", "nosuchgpu"], "unknown device 'nosuchgpu'"),
])
def test_refused_before_any_trace(args, msg, monkeypatch):
    """Options a command does not model are one line before the trace (a time --tp once charged one
    rank's FLOPs as the whole run's; --pp ignored --tp; an unknown --gpu came after a 30 s
    trace)."""
    from click.testing import CliRunner

    import symcost.graph.build as build
    from symcost.cli import main

    def no_trace(*a, **k):
        raise AssertionError("traced")

    monkeypatch.setattr(build, "trace", no_trace)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and msg in r.output, r.output



def _assert_replicated(an, v, m, nonempty: bool = True):
    """Issue 27 (``--tp 2`` on Mixtral left the experts whole on every rank without saying so):
    the report's list of weight matrices every rank holds whole (``passes.tensor_parallel.
    replicated``) equals PyTorch's parallelised model ``m`` (materialised on the fake group): the
    parameters of two or more dimensions whose local tensor has the global shape, by module
    (block index folded to ``{i}``) and element count at ``v``."""
    import torch

    from symcost.passes.tensor_parallel import replicated

    want: dict[str, int] = {}
    for name, p in m.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.dim() >= 2 and tuple(local.shape) == tuple(p.shape):
            module = ".".join("{i}" if part.isdigit() else part for part in name.rpartition(".")[0].split("."))
            want[module] = want.get(module, 0) + p.numel()
    assert isinstance(m, torch.nn.Module)
    env = an.bind(**v)
    got = {g["module"]: int(g["elements"].xreplace(env)) for g in replicated(an)}
    assert got == want and (bool(got) or not nonempty), (got, want)


def test_sp_with_a_sequence_tp_does_not_split_is_refused_in_one_line():
    """--sp with S no multiple of TP: PyTorch itself cannot run the step (the fake group's rank
    fails inside SequenceParallel's first norm), and symcost refuses before any recording, in one
    line without PyTorch's logged traceback (the newcomer saw 34 lines and an error at L = 3)."""
    from click.testing import CliRunner
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.cli import main

    rng = random.Random(33)
    tp = rng.choice((2, 4))
    S = tp * rng.randint(2, 6) + rng.randint(1, tp - 1)
    v = {"TP": tp, "B": 2, "S": S, "H": 8, "D": 8, "L": 2, "V": 64}
    spec = resolve_spec("megatron-gpt")
    values = spec.values(v)
    with pytest.raises(Exception):
        m, ctx = fake_rank_model(spec, values, True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            m.to_empty(device="cpu")
            measure(m, spec, values, ctx)
    sets = [f"{k}={x}" for k, x in v.items() if k != "TP"]
    r = CliRunner().invoke(main, ["report", "megatron-gpt", "--tp", str(tp), "--sp", "--set"] + sets)
    assert r.exit_code == 2 and f"S must be a multiple of TP" in r.output, r.output
    assert f"got S={S}, TP={tp}" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def _against_transformers(an, spec, v: dict, exact: bool, replicated: bool = False) -> None:
    """symcost's rank at sizes ``v`` against transformers' own tensor parallelism
    (:func:`transformers_rank_model`, materialised on fake tensors and measured as
    :func:`measure` measures): every quantity of :func:`_assert_rank` where ``exact``, else the
    collective bytes by kind and the parameter elements (and with ``replicated`` the matrices
    left whole, :func:`_assert_replicated`)."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    values = {**spec.values(v), **v}
    m = transformers_rank_model(spec, values)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        got = measure(m, spec, values, contextlib.nullcontext)
    if exact:
        _assert_rank(an, v, got)
        return
    env = an.bind(**v)
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (kind, v)
    assert int(an.params_shard.subs(env)) == got["shard"], v
    if replicated:
        _assert_replicated(an, v, m)  # the attention and the experts: whole on every rank, and said


@pytest.mark.hf
def test_hf_sequence_parallel_as_torchtitan_runs_it():
    """Issue 27 (``--sp`` on transformers models was refused: their plans have no sequence-
    parallel entries): symcost supplies torchtitan's plan for transformers models. A 2-block
    ``hf:llama`` (GQA): at random sizes and TP, the rank's FLOPs, saved bytes, collective bytes by
    kind and parameter elements equal PyTorch running torchtitan's plan, typed in the oracle
    (tests/data/tp_rank.py ``torchtitan_sp_rank_model``), on the fake group; and against the same
    model's ``--tp`` trace: the same model FLOPs, and the all-reduces of the residual stream
    become all-gathers and reduce-scatters of the same ring bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    spec = resolve("hf:llama", {"num_hidden_layers": "2"}, "eager")
    an = symcost.trace(spec, layout=Layout(tp=True, sp=True), sizes={"TP": 2, "B": 2, "S": 32}, precision=PRECISION)
    tp = symcost.trace(spec, layout=Layout(tp=True), sizes={"TP": 2, "B": 2, "S": 32}, precision=PRECISION)
    assert "TP" in an.symbols and "S" in an.symbols, an.pinned
    assert an.parallel == "tp+sp"
    rng = random.Random(270)
    for _ in range(2):
        tp_size = rng.choice((2, 4))
        v = {"TP": tp_size, "B": rng.randint(2, 4), "S": 8 * rng.randint(1, 8), "L": rng.randint(1, 3)}  # (S = 0 mod 8: the trace's regime under --sp)
        values = spec.values(v)
        m, ctx = torchtitan_sp_rank_model(spec, values)
        with FakeTensorMode(allow_non_fake_inputs=True):
            m.to_empty(device="cpu")
            got = measure(m, spec, values, ctx)
        assert Fraction(got["comm"]["reduce_scatter"]) > 0 and Fraction(got["comm"]["all_gather"]) > 0
        _assert_rank(an, v, got)
        env = an.bind(**v)
        assert an.flops("train").subs(env) == tp.flops("train").subs(tp.bind(**v))
        ring = lambda a, k: a.comm_bytes(k, "forward").subs(a.bind(**v))  # noqa: E731
        assert ring(an, "all_gather") + ring(an, "reduce_scatter") >= ring(tp, "all_reduce") > 0


@pytest.mark.hf
def test_hf_mla_tp_as_transformers_runs_it():
    """Issue 27 (the DeepSeek-V3 plan's ``mla_kv_a_proj`` refused): transformers' styles without
    a PyTorch counterpart run transformers' own style objects. A dense 2-block DeepSeek-V3 (MLA:
    the replicated compressed-KV projection whose rotary output's gradient is all-reduced, the
    vocabulary-parallel embedding transformers adds to every plan, the ``colwise_gather_output``
    head): at random sizes and TP, the rank's FLOPs, saved bytes, collective bytes by kind and
    parameter elements equal transformers' own parallelisation on the fake group. (Llama's and
    gpt-oss's plans at their published widths: :func:`test_real_config_tp_as_transformers_runs_it`.)"""
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    spec = resolve("hf:deepseek_v3", {"num_hidden_layers": "2", "first_k_dense_replace": "2", "q_lora_rank": "null"},
                   "eager")
    an = symcost.trace(spec, layout=Layout(tp=True), sizes={"TP": 2, "B": 2, "S": 32}, precision=PRECISION)
    assert "TP" in an.symbols, an.pinned
    rng = random.Random(27)
    for _ in range(2):
        v = {"TP": rng.choice((2, 4)), "B": rng.randint(2, 4), "S": rng.randint(8, 64)}
        _against_transformers(an, spec, v, exact=True)


@pytest.mark.heavy
@pytest.mark.hf
@pytest.mark.parametrize("config,tp,exact", [("llama-3-8b", 8, True), ("gpt-oss-20b", 2, False)])
def test_real_config_tp_as_transformers_runs_it(config, tp, exact):
    """Issue 27's refusals on the published configs: Llama-3-8B under ``--tp 8`` (K = TP = 8: one
    key/value head per rank, the regime ``--dp 8 --tp 8`` runs) ended in an internal
    ``NotIntegral`` (TP tied to K, a rank's shard D·H·V/K outside the formulas' ring);
    gpt-oss-20b under ``--tp 2`` was refused (``embedding_rowwise``), then fitted its
    vocabulary-parallel embedding's ``padding_idx`` (the pad id where the rank's rows hold it,
    else -1) for half an hour. Traced at the file's full width, the rank's collective bytes and
    parameter elements equal transformers' own tensor parallelism on the fake group (fake
    tensors: nothing allocated) at two sizes of B, S, L, and so do FLOPs and saved bytes for the
    dense model (gpt-oss's experts run symcost's routing model: issue 31); for gpt-oss, whose plan
    splits the embedding and the head only (its experts are for EP), the report's list of the
    matrices every rank holds whole equals the parallelised model's."""
    from symcost.frontends.layout import Layout

    path = os.path.join(os.path.dirname(__file__), "data", "configs", f"{config}.json")
    an = symcost.trace(path, layout=Layout(tp=True), sizes={"TP": tp, "B": 2, "S": 16}, precision=PRECISION,
                       attention="eager")
    for v in ({"B": 2, "S": 16, "L": 2}, {"B": 3, "S": 24, "L": 3}):
        _against_transformers(an, an.spec, {**v, "TP": tp}, exact, replicated=not exact)

"""Activation recomputation in ``mfu``/``time`` (issue 14, item 3) against FlopCounterMode of the
step PyTorch really runs with it.

``--recompute full`` counts what frameworks rerun: each block's forward under a non-reentrant
``torch.utils.checkpoint`` (up to its early stop), never the embedding, the final norm, the LM
head or the loss; the same count as ``symcost checkpoint --plan every-layer``. The oracle is a
real CPU step with every block checkpointed (``torch.utils.checkpoint(use_reentrant=False)``
around each block; for ``hf:`` models ``gradient_checkpointing_enable``) under FlopCounterMode,
less the plain step. ``--recompute selective`` (Korthikanti et al. 2022: the attention core
checkpointed) against the same step with only the attention core checkpointed, through a
``transformers`` attention function that wraps the eager one in a checkpoint. Sizes are drawn at
random (seeded); eager attention throughout (FlopCounterMode cannot count the CPU's fused
attention kernel).
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from conftest import random_sizes, run_cli
from memory_oracle import full_values
from symcost.errors import SymcostError
from symcost.passes import checkpoint as ck
from symcost.passes import roofline as rl


def _step_flops(spec, values, prepare=None) -> int:
    """FlopCounterMode of one real training step (forward, loss, backward) on CPU tensors."""
    torch.manual_seed(0)
    model = spec.build(values)
    model.train()
    if prepare is not None:
        prepare(model)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    with FlopCounterMode(display=False) as fc:
        spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
    return fc.get_total_flops()


def _checkpoint_blocks(container):
    """Wrap every block of ``model.<container>`` in a non-reentrant checkpoint."""

    def prepare(model):
        for block in model.get_submodule(container):
            fwd = block.forward
            block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(fwd)

    return prepare


def _check_full(an, sz, plain, ckpt):
    tc = rl.tokens_compute(an, sz, recompute="full")
    assert tc["flops.train_step"] == plain, sz  # model FLOPs: recomputation never changes them
    assert tc["flops.recompute_step"] == ckpt - plain, sz
    assert tc["flops.train_step_hardware"] == ckpt, sz  # eager attention: no kernel extras
    # the same count as `symcost checkpoint --plan every-layer`
    L = sz["L"]
    ch = ck.chain(an, L, an.bind(**sz))
    assert ch.cost(ck.uniform_segments(L, 1))[1] == ckpt - plain, sz
    # what the old count (one more whole forward) said: more than was rerun
    old = int(an.flops("forward").xreplace(an.bind(**sz)))
    assert old > ckpt - plain
    return tc


@pytest.mark.parametrize("model", ["gpt2", "cs336-lm"])
def test_full_recompute_equals_flopcountermode_of_the_checkpointed_step(traced, model):
    an = traced(model, "fp32")
    rng = random.Random(f"recompute:{model}")
    for sz in random_sizes(an, rng, n=2):
        sz["L"] = max(sz["L"], 2)
        v = full_values(an.spec, sz)
        plain = _step_flops(an.spec, v)
        ckpt = _step_flops(an.spec, v, _checkpoint_blocks(an.layer_container))
        _check_full(an, sz, plain, ckpt)


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_full_and_selective_recompute_hf_llama_gqa():
    """hf:llama with grouped-query attention (K < H: the regime the checkpointed step used to be
    traced in wrongly, K tied to H): full recomputation through ``gradient_checkpointing_enable``,
    selective through the attention core checkpointed."""
    import symcost
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    from transformers.models.llama import modeling_llama

    rng = random.Random(1403)
    h = rng.choice((4, 6, 8))
    sz = {"B": rng.randint(1, 3), "S": rng.randint(9, 40), "H": h, "D": rng.choice((8, 12, 16)),
          "L": rng.randint(2, 3), "V": rng.randint(40, 200), "F": rng.randint(16, 80), "K": 2}
    an = symcost.trace("hf:llama", attention="eager", sizes=sz, precision="fp32")
    assert "K" in an.symbols and "K" not in an.spec.tied
    v = full_values(an.spec, sz)
    plain = _step_flops(an.spec, v)
    ckpt = _step_flops(an.spec, v, lambda m: m.gradient_checkpointing_enable({"use_reentrant": False}))
    _check_full(an, sz, plain, ckpt)

    def core(module, q, k, val, mask, **kw):  # the attention core (Q·Kᵀ, softmax, dropout, P·V), checkpointed
        return checkpoint(lambda q, k, val: modeling_llama.eager_attention_forward(module, q, k, val, mask, **kw),
                          q, k, val, use_reentrant=False)

    AttentionInterface.register("eager_core_checkpointed", core)
    ALL_MASK_ATTENTION_FUNCTIONS.register("eager_core_checkpointed", eager_mask)

    def selective(model):
        model.config._attn_implementation = "eager_core_checkpointed"
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = "eager_core_checkpointed"

    sel = _step_flops(an.spec, v, selective)
    ts = rl.tokens_compute(an, sz, recompute="selective")
    assert ts["flops.train_step"] == plain
    assert ts["flops.recompute_step"] == sel - plain > 0
    # Q·Kᵀ once more per layer: 2·B·H·S²·D (P·V's output is saved by nothing: the early stop skips it)
    assert sel - plain == 2 * v["B"] * v["H"] * v["S"] ** 2 * v["D"] * v["L"]


def test_selective_recompute_adds_nothing_to_a_fused_kernel(traced):
    """A fused attention kernel keeps no scores (its backward recomputes them: hardware FLOPs),
    so selective recomputation adds nothing; the hardware FLOPs still exceed the model FLOPs by
    the fused backward's recomputed scores, 2·B·H·S²·D per layer."""
    an = traced("hf:llama", "fp32", "sdpa")
    sz = random_sizes(an, random.Random("selective:sdpa"), n=1)[0]
    ts = rl.tokens_compute(an, sz, recompute="selective")
    v = full_values(an.spec, sz)
    assert ts["flops.recompute_step"] == 0
    assert ts["flops.kernel_extra_step"] == 2 * v["B"] * v["H"] * v["S"] ** 2 * v["D"] * v["L"]
    assert ts["flops.train_step_hardware"] == ts["flops.train_step"] + ts["flops.kernel_extra_step"]


def test_unknown_recompute_mode_is_one_line(traced):
    with pytest.raises(SymcostError, match="--recompute takes none, selective, full"):
        rl.recompute_flops(traced("gpt2"), "some")


def test_cli_time_and_mfu_recompute_full(capsys, traced):
    """Through the CLI: `time --recompute full` and `mfu --recompute full` report the checkpointed
    step's FLOPs as hardware FLOPs (HFU) and leave the model FLOPs (MFU, --mfu's time) alone."""
    an = traced("gpt2", "fp32")
    sz = {"B": 3, "S": 20, "H": 4, "D": 8, "L": 3, "V": 97}
    v = full_values(an.spec, sz)
    plain = _step_flops(an.spec, v)
    ckpt = _step_flops(an.spec, v, _checkpoint_blocks(an.layer_container))
    sets = ["--set", *[f"{k}={x}" for k, x in sz.items()], "--precision", "fp32"]
    runs = {}
    for rec in ("none", "full"):
        code, out, err = run_cli(capsys, "time", "gpt2", *sets, "--tokens", "6e6", "--device", "h100",
                                 "--mfu", "0.02", "--recompute", rec, "--json")
        assert code == 0, err
        runs[rec] = json.loads(out)
    none, full = runs["none"], runs["full"]
    assert full["flops.train_step"] == none["flops.train_step"] == plain
    assert full["flops.train_step_hardware"] == ckpt and none["flops.train_step_hardware"] == plain
    assert full["time.seconds"] == none["time.seconds"]  # --mfu: model FLOPs, recompute or not
    assert full["hfu"] == pytest.approx(0.02 * ckpt / plain) and none["hfu"] == pytest.approx(0.02)
    code, out, err = run_cli(capsys, "mfu", "gpt2", *sets, "--tokens-per-second", "1e6", "--device", "h100",
                             "--recompute", "full", "--json")
    assert code == 0, err
    m = json.loads(out)
    assert m["hfu"] / m["mfu"] == pytest.approx(ckpt / plain)


def test_time_recompute_full_reads_both_traces_from_the_cache(capsys, cache_dir, monkeypatch):
    """`time --recompute full` keeps the plain and the every-layer (checkpointed) trace in the trace
    cache: a second run traces nothing (it re-traced both, about 20 s, every time) and answers
    the same, and its hardware FLOPs equal what FlopCounterMode counts on the checkpointed step."""
    import symcost.graph.build as build
    from symcost.frontends.models import resolve

    rng = random.Random(143)
    sz = {"B": rng.randint(2, 4), "S": rng.randint(5, 30), "D": rng.choice((8, 16, 24)), "L": rng.randint(2, 5)}
    sets = ["--set", *[f"{k}={x}" for k, x in sz.items()], "--precision", "fp32"]
    args = ("time", "mlp", *sets, "--tokens", "1e6", "--device", "h100", "--mfu", "0.0001", "--recompute", "full", "--json")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    first = json.loads(out)
    spec = resolve("mlp")
    v = full_values(spec, sz)
    assert first["flops.train_step_hardware"] == _step_flops(spec, v, _checkpoint_blocks("layers"))

    def no_trace(*a, **k):
        raise AssertionError("traced again")

    monkeypatch.setattr(build, "trace", no_trace)
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert json.loads(out) == first

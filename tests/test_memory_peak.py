"""The peak of a steady-state step of ``hf:`` models against torch.profiler, with the optimizer
implementation ``torch.optim`` really runs (issue 6).

``hf:opt`` at B=2 S=20 H=4 D=16 L=4 V=253 was predicted 18.5 % over PyTorch's profiler memory
timeline: the prediction assumed AdamW's ``foreach`` implementation (a state-sized temporary of
every tensor at once, PyTorch's default on CUDA) while ``torch.optim.AdamW(params)`` on the CPU
runs the per-tensor for-loop (two temporaries of one tensor at a time). The memory model now
takes the implementation PyTorch picks on the step's device (``impl="default"``, ``device``).
The oracle here runs the optimizer exactly as a user writes it (``foreach`` left None) on real
CPU tensors and measures with ``torch.profiler`` (tests/test_memory_oracle.py); sizes are drawn
at random, independently, never the fit's probes.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import random_sizes
from symcost.errors import SymcostError
from symcost.passes import memory
from memory_oracle import full_values, step_peak

#: Six hf: architectures (MHA with learned positions, RoPE, GQA, parallel attention, ...); the
#: first five are traced in fp32 by tests/test_memory.py too (the session fixture shares them).
ARCHS = ["hf:opt", "hf:gpt2", "hf:llama", "hf:qwen2", "hf:gpt_neox", "hf:mistral"]
TOLERANCE = 0.05


def test_default_impl_is_torch_optim_default():
    """default_impl follows torch.optim's own rule (torch/optim/optimizer.py)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    fused, foreach = _default_to_fused_or_foreach([torch.zeros(3, requires_grad=True)], False)
    assert not fused and memory.default_impl("cpu") == ("foreach" if foreach else "for-loop")
    supported = set(_get_foreach_kernels_supported_devices())
    for dev in memory.DEVICES:
        assert memory.default_impl(dev) == ("foreach" if dev in supported else "for-loop"), dev
    with pytest.raises(SymcostError):
        memory.default_impl("tpu")


def _check(an, sz, device, foreach):
    m = step_peak(an.spec, sz, "fp32", "adamw", foreach=foreach)
    mm = memory.memory_model(an, "fp32", "adamw", "default", device)
    pred = mm.peak(**sz)
    assert abs(pred - m["peak"]) <= TOLERANCE * m["peak"], (
        f"{an.model} at {sz} on {device} ({mm.impl}): predicted {pred} B, torch.profiler {m['peak']} B "
        f"({pred / m['peak'] - 1:+.2%}); predicted peak at {mm.peak_where(**sz)}")
    return pred, m["peak"]


@pytest.mark.hf
@pytest.mark.heavy
def test_opt_issue_case(traced):
    """The issue's case: AdamW(params) on the CPU (for-loop), and the foreach step CUDA runs."""
    an = traced("hf:opt", "fp32")  # positional, as tests/test_memory.py calls it: one shared trace
    sz = {"B": 2, "S": 20, "H": 4, "D": 16, "L": 4, "V": 253}
    cpu = _check(an, sz, "cpu", None)
    cuda = _check(an, sz, "cuda", True)  # what torch.optim runs with CUDA tensors
    assert cuda[1] > cpu[1]  # the two implementations really differ here (by about 18 %)


@pytest.mark.hf
@pytest.mark.heavy
@pytest.mark.parametrize("model", ARCHS)
def test_peak_within_5_percent(traced, model):
    """PyTorch's default AdamW on the CPU (for-loop) and the foreach step (CUDA's default), at
    random sizes: within 5 % of torch.profiler's peak."""
    an = traced(model, "fp32")
    rng = random.Random(100 + ARCHS.index(model))
    cpu, cuda = random_sizes(an, rng, n=2)
    _check(an, cpu, "cpu", None)
    _check(an, cuda, "cuda", True)


# ---------------------------------------------------------------------------------------------
# issue 14, item 1: the masks the real step builds, and the peak at long sequences
# ---------------------------------------------------------------------------------------------

#: Eight hf: architectures, each with the attention and precision its peak is checked in (the
#: default SDPA and eager, fp32 and bf16-mixed autocast, every pair at least twice). phi3 and
#: gemma add fused projections and an explicit head_dim (M).
FIDELITY = {
    "hf:llama": ("sdpa", "fp32"), "hf:opt": ("sdpa", "fp32"), "hf:gpt_neox": ("sdpa", "fp32"),
    "hf:mistral": ("sdpa", "bf16-mixed"), "hf:gpt2": ("sdpa", "bf16-mixed"),
    "hf:qwen2": ("eager", "bf16-mixed"), "hf:gemma": ("eager", "bf16-mixed"),
    "hf:phi3": ("eager", "fp32"),
}
TIGHT = 0.03  # the issue's acceptance: within 3 % of torch.profiler's timeline


class _DispatchLog(TorchDispatchMode):
    """The attention kernels a real step dispatches, with the shapes of their tensor inputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            flat = tree_flatten((args, kwargs or {}))[0]
            self.calls.append((str(func), [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


@pytest.mark.hf
@pytest.mark.parametrize("arch,config", [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("gemma", {}), ("phi3", {}), ("opt", {}),
    ("gpt2", {}), ("gpt_neox", {}),
    ("mistral", {"sliding_window": "16"}),  # a window shorter than S: the real step builds its mask
])
def test_sdpa_gets_the_mask_the_real_step_passes(monkeypatch, arch, config):
    """What ``F.scaled_dot_product_attention`` is given while symcost records the step (fake
    tensors) is what the real step gives it (real CPU tensors): attn_mask=None with
    is_causal=True where the real step passes no mask (no (B, 1, S, S) mask that only the fake
    run builds), the sliding-window mask where the real step builds one; and the aten kernel
    it dispatches gets the same tensor inputs (where SDPA does not decompose: no dropout)."""
    import torch.nn.functional as F

    from symcost.frontends import hf
    from symcost.tracing.record import record

    calls = []
    sdpa = F.scaled_dot_product_attention

    def logged(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), bool(is_causal)))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", logged)
    spec = hf.spec(arch, dict(config), attention="sdpa")
    rng = random.Random(f"mask:{arch}:{config}")
    v = full_values(spec, {"B": rng.randint(2, 3), "S": rng.randint(20, 40), "H": 4, "D": 16, "L": 2,
                           "V": rng.randint(60, 200), **{k: x for k, x in (("F", 64), ("K", 2), ("M", 48))
                                                         if k in spec.symbols}})
    torch.manual_seed(0)
    model = spec.build(v)
    model.train()
    args, kwargs = spec.make_inputs(v, torch.device("cpu"))
    log = _DispatchLog()
    with log:
        spec.loss(model(*args, **kwargs), (args, kwargs))
    real, calls[:] = list(calls), []
    rec = record(spec, v, "fp32")
    assert len(real) == v["L"] and calls == real, (real[:1], calls[:1])
    fake = [(o.name, [tuple(t.shape) for t in o.inputs]) for o in rec.ops[:rec.n_forward]
            if "scaled_dot_product" in o.name and "backward" not in o.name]
    assert fake == log.calls, (log.calls[:1], fake[:1])
    if config:  # the window (16) is shorter than S: a real (B, 1, S, S) mask
        assert all(m is not None and m[-2:] == (v["S"], v["S"]) for m, _ in real), real[:1]
    else:
        assert all(m is None and causal for m, causal in real), real[:1]


def _fidelity_sizes(an, rng, attention):
    """Random sizes of small width and long sequences (S up to 2048 where attention is fused: the
    eager (B, H, S, S) scores stay at S ≤ 512, where a real CPU step is cheap)."""
    hi = 2048 if attention == "sdpa" else 512
    if "S" in an.spec.defaults and an.model == "hf:gpt2":
        hi = min(hi, 1024)  # GPT-2's learned position table
    h = rng.choice((2, 4))
    v = {"B": rng.randint(1, 3), "S": rng.randint(hi // 4, hi), "H": h, "D": rng.choice((8, 16)),
         "L": rng.randint(1, 2), "V": rng.randint(40, 256), "F": rng.randint(16, 96), "K": 1 if h == 2 else 2,
         "M": rng.choice((32, 48))}
    return {s: v[s] for s in an.symbols}


@pytest.mark.hf
@pytest.mark.heavy
@pytest.mark.parametrize("model", list(FIDELITY))
def test_peak_within_3_percent_long_sequences(traced, model):
    """Eight architectures in the default SDPA and eager, fp32 and bf16-mixed, at random sizes
    with long sequences: the predicted peak within 3 % of torch.profiler's (CPU AdamW as a user
    writes it; for bf16 the level at the ends of top-level aten ops, as in tests/test_memory.py)."""
    attention, precision = FIDELITY[model]
    an = traced(model, precision, attention)
    sz = _fidelity_sizes(an, random.Random(f"fidelity:{model}"), attention)
    m = step_peak(an.spec, sz, precision, "adamw", foreach=None)
    meas = m["peak"] if precision == "fp32" else m["peak_ops"]
    mm = memory.memory_model(an, precision, "adamw", "default", "cpu")
    pred = mm.peak(**sz)
    assert abs(pred - meas) <= TIGHT * meas, (
        f"{model} {attention} {precision} at {sz}: predicted {pred} B, torch.profiler {meas} B "
        f"({pred / meas - 1:+.2%}); predicted peak at {mm.peak_where(**sz)}")


@pytest.mark.hf
@pytest.mark.heavy
@pytest.mark.parametrize("model,var", [("hf:llama", "S"), ("hf:mistral", "B")])
def test_max_batch_and_solve_S_exact_at_the_measured_boundary(traced, model, var):
    """max-batch (B) and --solve S under a cap halfway between the measured peaks of two
    neighbouring sizes: the answer is the smaller one, and the measured peaks bracket the cap."""
    attention, precision = FIDELITY[model]
    an = traced(model, precision, attention)
    rng = random.Random(f"boundary:{model}")
    sz = _fidelity_sizes(an, rng, attention)
    sz["B"] = max(sz["B"], 2)  # the formulas' regime (B = 1 is traced on its own)
    mm = memory.memory_model(an, precision, "adamw", "default", "cpu")

    def measured(value):
        m = step_peak(an.spec, {**sz, var: value}, precision, "adamw", foreach=None)
        return m["peak"] if precision == "fp32" else m["peak_ops"]

    at = sz[var]
    lo, hi = measured(at), measured(at + 1)
    assert lo < hi
    cap = (lo + hi) // 2
    sol = mm.solve(cap, var, **{k: x for k, x in sz.items() if k != var})
    assert sol.checked and sol.value == at, (sol.value, at, lo, cap, hi)


@pytest.mark.hf
@pytest.mark.heavy
@pytest.mark.parametrize("model", ["hf:llama", "hf:qwen2"])
def test_optimizer_step_peak_exact_with_tables_every_block_saves(traced, model):
    """The live set when the backward ends holds the gradients and nothing of the forward.

    Llama's blocks differ at the last one, so the fold's repeated backward unit is block 0's
    backward, which also frees the rotary cos/sin tables every block saved: that free happens
    once (in the last pass), and was replayed in each of the L - 1 passes, so the peak at the
    optimizer step fell by 8·D·S·(L - 2) bytes (-0.117 GiB for Llama-2-7B at S = 4096). Sizes
    where the foreach AdamW step is the peak (few tokens, many parameters), L >= 3, at random:
    the prediction within 64 bytes of torch.profiler's (the bug's error is at least 96 here).
    """
    an = traced(model, "fp32")
    mm = memory.memory_model(an, "fp32", "adamw", "foreach", "cuda")
    rng = random.Random(f"end-live:{model}")
    for sz in random_sizes(an, rng, n=2):
        sz.update(B=1, S=rng.randint(3, 8), L=rng.randint(3, 5), V=rng.randint(100, 130))
        pred = mm.peak(**sz)
        assert mm.peak_where(**sz).startswith("optimizer step"), (sz, mm.peak_where(**sz))
        parts = mm.peak_parts(**sz)
        assert parts["forward"] == 0 and parts["backward"] == 0, parts
        meas = step_peak(an.spec, sz, "fp32", "adamw", foreach=True)["peak"]
        assert abs(pred - meas) <= 64, (model, sz, pred, meas, pred - meas)

"""Training frameworks' own optimizer and precision policies, named after them (issue 27, item 3):
Megatron-LM's (``megatron-bf16``, ``megatron-fp16``, ``megatron-fp32``, ``megatron-bf16-moments``;
its distributed optimizer is ``--shard zero1``) and DeepSpeed's ZeRO stages (``deepspeed-fp16``,
``deepspeed-bf16`` with ``--shard zero1/zero2/zero3``).

The oracles are the published tables, typed in below with their sources, never symcost's own
output: the per-rank model states of ``report --dp N --json`` (``parallel.memory_per_rank``)
must equal them at random parameter counts P (the ``mlp`` model at random widths and depths) and
data-parallel sizes. The peak of a Megatron-LM step, whose gradients live in a persistent buffer,
is checked against a real PyTorch step that runs Megatron-LM's data flow.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner
from torch.utils._pytree import tree_flatten

from symcost.cli import main
from symcost.passes.parallel import model_state_bytes

# Megatron-LM, docs/user-guide/features/dist_optimizer.md ("Distributed Optimizer"; the same table
# in docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html), github.com/
# NVIDIA/Megatron-LM at d98e8a6 (2026-08-22): "the theoretical number of bytes per parameter ...
# (where d is the data parallel size)":
#
#   |                                  | Non-distributed optim | Distributed optim |
#   | fp16 parameters, fp16 gradients  | 20                    | 4 + 16/d          |
#   | bf16 parameters, fp32 gradients  | 18                    | 6 + 12/d          |
#   | fp32 parameters, fp32 gradients  | 16                    | 8 + 8/d           |
#
# policy -> (non-distributed, distributed: a, b of a + b/d)
MEGATRON_TABLE = {
    "megatron-fp16": (20, 4, 16),
    "megatron-bf16": (18, 6, 12),
    "megatron-fp32": (16, 8, 8),
}

# Megatron-LM's precision-aware optimizer with bf16 moments (--use-precision-aware-optimizer
# --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16, distributed optimizer only), from its source at
# the same commit (no published table): bf16 parameters 2 + fp32 main gradients 4 (main_grads_dtype
# defaults to fp32) whole; sharded over d: exp_avg 2 + exp_avg_sq 2 + the fp32 main weights stored
# as their 16-bit remainders 2 (optimizer_config.py store_param_remainders=True; distrib_optimizer.py
# allocates master_param as int16 with bf16) -> 6 + 6/d.
MEGATRON_BF16_MOMENTS = (6, 6)

# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
# section 5.1 and Table 1: mixed-precision Adam, K = 12 bytes of optimizer state per parameter
# (fp32 master weights, momentum, variance), Psi parameters, N_d data-parallel ranks:
#   baseline (2 + 2 + K)Psi; P_os (ZeRO-1) 2Psi + 2Psi + K Psi/N_d; P_os+g (ZeRO-2) 2Psi + (2 + K)Psi/N_d;
#   P_os+g+p (ZeRO-3) (2 + 2 + K)Psi/N_d.   shard -> (a, b) of (a + b/N_d) Psi:
ZERO_TABLE1 = {"ddp": (16, 0), "zero1": (4, 12), "zero2": (2, 14), "zero3": (0, 16)}
# ... and its figures for Psi = 7.5B on N_d = 64 devices (GB, decimal): 120, 31.4, 16.6, 1.88.
ZERO_TABLE1_7_5B_64 = {"ddp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.88}
# DeepSpeed's own ZeRO-2 estimator (deepspeed/runtime/zero/stage_1_and_2.py
# estimate_zero2_model_states_mem_needs, github.com/deepspeedai/DeepSpeed at edaa722: "2 * total_params
# + int(18 * total_params / total_gpus)", "18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
# 8_optimizer_states_32bit") counts the fp32 gradient partition the ZeRO optimizer makes at its step,
# which the paper's K leaves out: (a, b) of a + b/N. (Its ZeRO-3 estimator uses the same 18 for every
# sharded state with no breakdown, 2 less than 16-bit parameters, 16-bit gradients and the above:
# docs/parallel.md section 9; not an oracle here.)
DEEPSPEED_ESTIMATOR = {"zero2": (2, 18)}


def _report(precision: str, shard: str, dp: int, sizes: dict) -> dict:
    args = ["report", "mlp", "--dp", str(dp), "--shard", shard, "--precision", precision, "--json", "--set",
            *[f"{k}={v}" for k, v in sizes.items()]]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])


def _draws(rng: random.Random, n: int = 2) -> list[tuple[int, dict]]:
    """(DP, sizes of mlp) with DP dividing P = L·D·(D + 1) (D a multiple of DP: the tables' P/d exact;
    an even multiple: an fp16 FSDP2 trace at an odd width finds no probe sizes in its regime yet)."""
    out = []
    for _ in range(n):
        dp = rng.randint(2, 8)
        out.append((dp, {"B": rng.randint(2, 3), "S": rng.randint(4, 12), "D": 2 * dp * rng.randint(1, 3),
                         "L": rng.randint(2, 4)}))
    return out


def _per_param(js: dict, with_step_copy: bool) -> tuple[int, int]:
    """(bytes of the rank's model states, P) from ``report --dp --json``; with the fp32 gradient copy
    the optimizer makes at its step (``step_grad_copy``) where asked."""
    mem = js["parallel"]["memory_per_rank"]
    return mem["total"] + (mem.get("step_grad_copy", 0) if with_step_copy else 0), js["params"]


@pytest.mark.parametrize("precision", list(MEGATRON_TABLE))
def test_megatron_distributed_optimizer_table(precision):
    """``--precision megatron-* --dp d --shard zero1`` (--use-distributed-optimizer): the rank's model
    states are Megatron-LM's a + b/d bytes per parameter. Megatron's table counts the fp32 copy of the
    gradients its fp16 optimizer makes at the step; symcost keeps it apart (``step_grad_copy``:
    transient), so the table is total + step_grad_copy, and total alone is what persists."""
    _, a, b = MEGATRON_TABLE[precision]
    rng = random.Random(f"megatron-dist|{precision}")
    for dp, sizes in _draws(rng):
        js = _report(precision, "zero1", dp, sizes)
        got, P = _per_param(js, with_step_copy=True)
        assert P == sizes["L"] * sizes["D"] * (sizes["D"] + 1)
        assert got * dp == (a * dp + b) * P, (precision, dp, sizes, js["parallel"]["memory_per_rank"])
        mem = js["parallel"]["memory_per_rank"]
        assert mem["grads"] == (2 if precision == "megatron-fp16" else 4) * P  # the main-gradient buffer, whole
        assert mem["params"] == (4 if precision == "megatron-fp32" else 2) * P  # the weights, whole
        assert ("step_grad_copy" in mem) == (precision == "megatron-fp16")


def test_megatron_without_the_distributed_optimizer():
    """``--shard ddp``: Megatron-LM's non-distributed column, 18 bytes per parameter for bf16 (at any
    DP), through the CLI; the other rows from the same per-rank formula."""
    rng = random.Random("megatron-ddp")
    for dp, sizes in _draws(rng):
        js = _report("megatron-bf16", "ddp", dp, sizes)
        got, P = _per_param(js, with_step_copy=True)
        assert got == MEGATRON_TABLE["megatron-bf16"][0] * P, js["parallel"]["memory_per_rank"]
    for precision, (whole, a, b) in MEGATRON_TABLE.items():
        P, d = rng.randint(10**6, 10**10), rng.randint(2, 512)
        m = model_state_bytes(P, d, "ddp", precision)
        assert m["total"] + m.get("step_grad_copy", 0) == whole * P, precision
        m = model_state_bytes(P * d, d, "zero1", precision)  # (P·d parameters: d divides them)
        assert m["total"] + m.get("step_grad_copy", 0) == (a * d + b) * P, precision


def test_megatron_bf16_moments():
    """``megatron-bf16-moments --shard zero1``: 6 + 6/d (Megatron-LM's source, above); with
    ``--shard ddp`` it is refused in one line before any trace, as Megatron-LM refuses
    --use-precision-aware-optimizer without --use-distributed-optimizer."""
    a, b = MEGATRON_BF16_MOMENTS
    rng = random.Random("megatron-bf16-moments")
    for dp, sizes in _draws(rng):
        js = _report("megatron-bf16-moments", "zero1", dp, sizes)
        got, P = _per_param(js, with_step_copy=True)
        assert got * dp == (a * dp + b) * P, js["parallel"]["memory_per_rank"]
        assert js["parallel"]["memory_per_rank"]["optimizer_state"] * dp == 4 * P  # two bf16 moments, sharded


def test_megatron_bf16_moments_refused_without_the_distributed_optimizer(capsys):
    from test_options_refused import refused

    for cmd in (("report", "mlp"), ("max-batch", "mlp", "--memory", "1GiB")):
        line = refused(capsys, *cmd, "--dp", "4", "--precision", "megatron-bf16-moments",
                       needles=("--shard zero1", "--use-distributed-optimizer"))
        assert "megatron-bf16-moments" in line


@pytest.mark.parametrize("shard,precision", [("zero1", "deepspeed-fp16"), ("zero2", "deepspeed-bf16"),
                                             ("zero3", "deepspeed-bf16")])
def test_deepspeed_zero_stages_table1(shard, precision):
    """``--precision deepspeed-* --dp N --shard zeroK``: the ZeRO paper's Table 1 formula per rank
    (K = 12), at random P and N through the CLI; with the fp32 gradient partition DeepSpeed's ZeRO
    optimizers make at the step, DeepSpeed's own ZeRO-2 estimator (18 bytes per sharded parameter).
    (Both names keep the same bytes; zero2/zero3 are traced in bf16 here: an fp16 FSDP2 trace finds
    no probe sizes in its regime at some widths and DP, e.g. D = 10 at DP = 5, a limitation of the
    fit that bf16 does not hit.)"""
    a, b = ZERO_TABLE1[shard]
    rng = random.Random(f"zero|{shard}")
    for dp, sizes in _draws(rng):
        js = _report(precision, shard, dp, sizes)
        got, P = _per_param(js, with_step_copy=False)
        assert got * dp == (a * dp + b) * P, (shard, dp, sizes, js["parallel"]["memory_per_rank"])
        assert js["parallel"]["memory_per_rank"]["step_grad_copy"] * dp == 4 * P
        if shard in DEEPSPEED_ESTIMATOR:
            ea, eb = DEEPSPEED_ESTIMATOR[shard]
            assert _per_param(js, with_step_copy=True)[0] * dp == (ea * dp + eb) * P


@pytest.mark.parametrize("precision", ["deepspeed-fp16", "deepspeed-bf16"])
def test_deepspeed_table1_figures(precision):
    """Table 1's figures for 7.5B parameters on 64 devices, and its formulas at random P and N (the
    baseline, DDP, included)."""
    for shard, gb in ZERO_TABLE1_7_5B_64.items():
        got = model_state_bytes(7_500_000_000, 64, shard, precision)["total"] / 1e9
        assert round(float(got), 2 if gb < 2 else 1) == gb, (shard, got)
    rng = random.Random(precision)
    for shard, (a, b) in ZERO_TABLE1.items():
        P, n = rng.randint(10**6, 10**10), rng.randint(2, 1024)
        assert model_state_bytes(P * n, n, shard, precision)["total"] == (a * n + b) * P, shard


# -- the peak: Megatron-LM's gradients live in a persistent buffer ----------------------------------

class MegatronStep:
    """One rank of Megatron-LM's data flow on real CPU tensors, as megatron/core/distributed/
    distributed_data_parallel.py and megatron/core/optimizer/ run it: every parameter has a
    ``main_grad`` in a buffer allocated once and zeroed (not freed) between steps; the backward's
    gradient is added into it and dropped by a hook (``_make_backward_post_hook``:
    ``param.main_grad.add_(param.grad.data); param.grad = None``); the optimizer steps fp32 main
    weights with the main gradients (``main_param.grad = main_grad.float()``: the same tensor when the
    buffer is fp32, an fp32 copy when it is fp16), fused Adam (no temporaries), and copies them back."""

    def __init__(self, params, grad_dtype):
        self.params = list(params)
        self.main_grads = [torch.zeros(p.shape, dtype=grad_dtype) for p in self.params]
        for p, g in zip(self.params, self.main_grads):
            p.main_grad = g
            p.register_post_accumulate_grad_hook(self._hook)
        self.fp32 = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.opt = torch.optim.AdamW(self.fp32, lr=1e-3, fused=True)

    @staticmethod
    def _hook(p):
        p.main_grad.add_(p.grad.data)
        p.grad = None

    @property
    def state(self):
        # Transformer Engine's FusedAdam, which Megatron-LM runs, keeps the step per parameter
        # group, a Python int (transformer_engine/pytorch/optimizers/fused_adam.py ``step``:
        # ``group["step"] += 1``); torch's fused AdamW here keeps a 0-d tensor per parameter,
        # which Megatron's step has not: left out of the state (allocated before the step, they
        # change nothing above the baseline)
        return {p: {k: t for k, t in st.items() if k != "step"} for p, st in self.opt.state.items()}

    def zero_grad(self, set_to_none=True):
        for g in self.main_grads:
            g.zero_()

    def step(self):
        for m, g in zip(self.fp32, self.main_grads):
            m.grad = g.float()
        self.opt.step()
        for p, m in zip(self.params, self.fp32):
            p.data.copy_(m.data)
            m.grad = None


def megatron_step_peak(spec, sizes, traced_as: str, grad_dtype) -> dict:
    from memory_oracle import build, steady_peak

    model, args, kwargs, _ = build(spec, sizes, traced_as)
    opt = MegatronStep(model.parameters(), grad_dtype)

    def step():
        opt.zero_grad()
        out = model(*args, **kwargs)
        loss = spec.loss(out, (args, kwargs))
        del out
        loss.backward()
        del loss
        opt.step()

    return steady_peak(step, opt, list(model.parameters()) + list(model.buffers()) + opt.main_grads + opt.fp32
                       + tree_flatten((args, kwargs))[0])


@pytest.mark.parametrize("model", ["mlp", "cs336-lm"])
@pytest.mark.parametrize("precision,traced_as,grad_dtype", [("megatron-bf16", "bf16-true", torch.float32),
                                                            ("megatron-fp16", "fp16-true", torch.float16)])
def test_megatron_peak_is_a_real_step(traced, model, precision, traced_as, grad_dtype):
    """The peak of a Megatron-LM step (fused Adam) against a real step running its data flow
    (:class:`MegatronStep`): the gradient buffer is static, each gradient the backward makes is a
    transient, the fp16 optimizer's fp32 gradient copy lives in the optimizer step. At sizes where the
    peak is the optimizer step (small B·S, fp16) and elsewhere; the reference is the profiler's level
    at the ends of top-level aten ops (CPU bf16/fp16 matmuls allocate workspaces inside the kernel,
    docs/memory.md). What is left: a bias's or a norm's gradient that the real backward holds until
    its hook runs, up to 0.1 %."""
    from conftest import random_sizes
    from memory_oracle import full_values
    from symcost.passes import memory

    an = traced(model, traced_as)
    mm = memory.memory_model(an, precision, "adamw", "fused", "cpu")
    rng = random.Random(f"megatron-peak|{model}|{precision}")
    draws = random_sizes(an, rng, n=2 if model == "mlp" else 1)
    if model == "mlp":
        draws.append({"B": 1, "S": 2, "D": 8 * rng.randint(4, 6), "L": rng.randint(2, 4)})  # weights dominate
    wheres = set()
    for sz in draws:
        parts = mm.peak_parts(**sz)
        meas = megatron_step_peak(an.spec, sz, traced_as, grad_dtype)
        P = sum(p.numel() for p in an.spec.build(full_values(an.spec, sz)).parameters())
        assert parts["grad_buffer"] == (4 if grad_dtype == torch.float32 else 2) * P, (sz, parts)
        assert sum(parts[k] for k in mm.static_parts()) == meas["baseline"], (sz, parts, meas)
        assert 0 <= meas["peak_ops"] - parts["peak"] <= 1e-3 * meas["peak_ops"], (sz, parts, meas)
        wheres.add(parts["where"].split(" ")[0])
    if model == "mlp" and precision == "megatron-fp16":
        assert "optimizer" in wheres, wheres  # the fp32 gradient copy was where the peak is


# -- the optimizer step's temporaries: the engine's fused Adam, torch's foreach --------------------

@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_optimizer_step_transient_is_a_real_adamw_step(traced, impl):
    """The optimizer step's temporaries as symcost prices them (``fused``: none, the rule for
    Megatron-LM's and DeepSpeed's multi-tensor FusedAdam; ``foreach``: a state-sized copy of every
    tensor) against a real ``torch.optim.AdamW(fused=True)`` / ``(foreach=True)`` step on CPU
    tensors (PyTorch runs its fused Adam kernel on the CPU since 2.4): torch.profiler's allocator
    level above what is live when ``step()`` starts (gradients, state, weights), at random sizes:
    equal at the ends of aten ops (``_levels``), a few scalar bytes more inside the kernels.
    The bf16 model of the Megatron peak test (its trace shared); the state is in the weights' dtype.
    And ``impl="default"`` follows the engine each policy names: fused Adam under ``megatron-*`` and
    ``deepspeed-*`` on CUDA, torch.optim's own rule otherwise (foreach on CUDA, the CPU's for-loop;
    Megatron-LM's fallback where neither Transformer Engine nor Apex imports)."""
    from conftest import random_sizes
    from memory_oracle import _levels, build, profiled
    from symcost.passes import memory

    an = traced("mlp", "bf16-true")
    mm = memory.memory_model(an, "bf16-true", "adamw", impl, "cpu")
    rng = random.Random(f"optimizer-transient|{impl}")
    for sz in random_sizes(an, rng, n=2):
        model, args, kwargs, ctx = build(an.spec, sz, "bf16-true")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{impl: True})

        def backward():
            opt.zero_grad(set_to_none=True)
            an.spec.loss(model(*args, **kwargs), (args, kwargs)).backward()

        backward()
        opt.step()  # the state exists from here on
        backward()
        with profiled() as prof:
            opt.step()
        top, top_ops = _levels(prof)
        P = sum(p.numel() for p in model.parameters())
        pred = mm.optimizer_step_transient(**sz)
        assert pred == (0 if impl == "fused" else 2 * P), (sz, pred, P)
        # exact at the ends of top-level aten ops; inside them a few 0-d scalars (the CPU step
        # counters' increment, the kernel's lr and bias corrections: 12 bytes, whatever the size)
        assert top_ops == pred and 0 <= top - pred <= 16, (impl, sz, top, top_ops, pred)
    for policy, device, expect in [("megatron-bf16", "cuda", "fused"), ("megatron-fp16", "cuda", "fused"),
                                   ("deepspeed-bf16", "cuda", "fused"), ("megatron-bf16", "cpu", "for-loop"),
                                   ("bf16-true", "cuda", "foreach"), ("bf16-true", "cpu", "for-loop")]:
        assert memory.memory_model(an, policy, "adamw", "default", device).impl == expect, (policy, device)
    assert memory.memory_model(an, "megatron-bf16", "adafactor", "default", "cuda").impl == "foreach"
    meg = memory.memory_model(an, "megatron-bf16", "adamw")
    sz = random_sizes(an, rng, n=1)[0]
    assert meg.optimizer_step_transient(**sz) == 0
    assert memory.memory_model(an, "megatron-bf16", "adamw", "foreach").optimizer_step_transient(**sz) == 4 * _meta_params(an, sz)


def _meta_params(an, sz) -> int:
    """The parameters of ``an``'s model at ``sz``, counted on the meta device."""
    from memory_oracle import full_values

    with torch.device("meta"):
        return sum(p.numel() for p in an.spec.build(full_values(an.spec, sz)).parameters())

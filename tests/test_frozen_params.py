"""Frozen parameters (``requires_grad=False``; issue 30, model states per rank): a parameter that
does not require grad gets no gradient and no optimizer state in PyTorch (torch.optim's
``_init_group`` skips a parameter whose ``grad`` is None: no ``exp_avg``, ``exp_avg_sq`` or
``step``; DDP and FSDP2 reduce only the parameters that require grad), and Megatron-LM keeps main
parameters and gradient buffers only for those that require grad. symcost's memory paths follow.

The model: tests/data/frozen.py, a LoRA-style language model (a frozen token table, a frozen
position table of S rows as Whisper's encoder has, each block's frozen base projections; trained
adapters, norms and head). Oracles: the real step on fake tensors (one device, and rank 0 of
PyTorch's fake process group under DDP/FSDP2 wrapped per block): AdamW's state bytes after its
step (the 0-d ``step`` tensors included), the ``.grad`` bytes, and
``torch.distributed._tools.mem_tracker.MemTracker``'s peak of a steady-state step, at random
sizes; the frozen and trained element counts of the meta-built model for the closed forms
(ZeRO-1's shard, Megatron-LM's main parameters).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import sympy

import symcost
from symcost.frontends.layout import Layout
from symcost.tracing.fit import SYMS

MODEL = str(Path(__file__).resolve().parent / "data" / "frozen.py") + ":spec"


def _frozen_hooks_skipped():
    """MemTracker installs a gradient hook on every parameter of a module it enters and fails on a
    frozen one ('cannot register a hook on a tensor that doesn't require gradient', torch 2.13
    mem_tracker.py ``_track_module_params_and_buffers``): such a parameter gets no gradient, so a
    no-op handle stands in for its hooks here; every storage is still tracked."""
    import contextlib

    import torch

    class _Handle:
        def remove(self):
            pass

    @contextlib.contextmanager
    def patched():
        orig = {k: getattr(torch.Tensor, k) for k in ("register_hook", "register_post_accumulate_grad_hook")}

        def make(f):
            return lambda self, hook: f(self, hook) if self.requires_grad else _Handle()
        try:
            for k, f in orig.items():
                setattr(torch.Tensor, k, make(f))
            yield
        finally:
            for k, f in orig.items():
                setattr(torch.Tensor, k, f)
    return patched()


def _real(values: dict, shard: str | None = None, foreach: bool = False, precision: str = "fp32") -> dict:
    """One device (``shard`` None) or rank 0 of ``values["DP"]`` ranks (every block a unit, then the
    root): model states after a steady-state step (``params``, ``grads``, ``optimizer_state`` with
    the step tensors, each rank's local tensors) and MemTracker's peak of that step; also the
    meta-built model's ``trained`` and ``frozen`` elements and ``tensors`` that require grad."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from symcost.frontends.parallel import fake_group, wrap

    spec = symcost.resolve(MODEL)
    with torch.device("meta"):
        m = spec.build(values)
    counts = {"trained": sum(p.numel() for p in m.parameters() if p.requires_grad),
              "frozen": sum(p.numel() for p in m.parameters() if not p.requires_grad),
              "tensors": sum(1 for p in m.parameters() if p.requires_grad)}
    if shard is not None:
        wrap(m, "blocks", shard, fake_group(values["DP"]))

    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    mixed = precision == "bf16-mixed"
    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        opt = torch.optim.AdamW(m.parameters(), foreach=foreach)

        def step(keep=False):
            args, kwargs = spec.make_inputs(values, torch.device("cpu"))
            with torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
                loss = spec.loss(m(*args, **kwargs), (args, kwargs))
            loss.backward()
            del loss
            opt.step()
            if not keep:
                opt.zero_grad(set_to_none=True)

        step()  # warm-up: the optimizer state exists from here on
        mt = MemTracker()
        with _frozen_hooks_skipped():
            mt.track_external(m, opt)
            with mt:
                step()
        peak = max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
        step(keep=True)
        states = {"params": sum(size(p) for p in m.parameters()),
                  "grads": sum(size(p.grad) for p in m.parameters() if p.grad is not None),
                  "optimizer_state": sum(size(t) for st in opt.state.values() for t in st.values())}
    return {**states, "peak": peak, **counts}


def _draw(rng: random.Random, dp: int = 1) -> dict:
    return {"B": rng.randint(2, 4), "S": dp * rng.randint(2, 6), "H": dp, "D": rng.choice((2, 4)),
            "F": dp * rng.randint(2, 6), "L": rng.choice((2, 3, 5)), "V": dp * rng.randint(4, 12),
            "R_lora": dp * rng.randint(1, 3), **({"DP": dp} if dp > 1 else {})}


def test_one_device_states_and_peak_against_pytorch():
    """One device, fp32 and bf16-mixed: parameters (frozen ones held), gradients and AdamW state
    (moments and step tensors of the trained parameters only) equal the real step's at random sizes
    (L never traced), the frozen bytes a term of their own (the formulas stay symbolic); the peak
    equals MemTracker's with the CPU's for-loop AdamW and with foreach. Before: every parameter got
    a gradient and AdamW state in symcost (12 bytes per frozen element over in fp32)."""
    from symcost.passes.memory import memory_model

    an = symcost.trace(MODEL, precision="fp32", torch_device="cpu")
    assert not an.pinned and {"S", "L", "R_lora"} <= set(an.symbols), an.pin_reasons
    # the frozen elements: the token and position tables and the blocks' base projections, a formula
    H, D, F, L, S, V = (SYMS[k] for k in "HDFLSV")
    assert sympy.expand(an.params_frozen - (V * H * D + S * H * D + L * (2 * H * D * F + F))) == 0
    rng = random.Random("frozen-one-device")
    for i, precision in enumerate(("fp32", "bf16-mixed")):
        v = _draw(rng)
        sizes = {k: x for k, x in v.items() if k in an.symbols}
        for foreach in (False, True):
            got = _real({**symcost.resolve(MODEL).defaults, **v}, foreach=foreach, precision=precision)
            mm = memory_model(an, precision, "adamw", impl="foreach" if foreach else "for-loop", device="cpu")
            comp = mm.components(**sizes)
            assert comp["params"] == got["params"] and comp["grads"] == got["grads"], (v, comp, got)
            assert comp["optimizer"] == got["optimizer_state"] == 8 * got["trained"] + 4 * got["tensors"], (v, comp)
            if precision == "fp32":  # (the bf16-mixed trace's activations are the fp32 trace's here)
                assert comp["peak"] == got["peak"], (v, foreach, comp["peak"], got["peak"])
        env = an.bind(**sizes)
        assert int(an.params_frozen.xreplace(env)) == got["frozen"]
        # Megatron-LM (--bf16): bf16 weights of every parameter; its fp32 main-gradient buffer,
        # main parameters and Adam moments only for those that require grad (distributed_data_parallel.py
        # and optimizer/__init__.py skip ``not param.requires_grad``; optimizer/optimizer.py copies
        # main params ``if param.requires_grad``), no per-tensor step (TE's FusedAdam: group["step"])
        meg = memory_model(an, "megatron-bf16", "adamw", impl="fused", device="cpu").components(**sizes)
        assert meg["params"] == 2 * (got["trained"] + got["frozen"]), meg
        assert meg["grad_buffer"] == meg["master_weights"] == 4 * got["trained"], meg
        assert meg["optimizer"] == 8 * got["trained"], meg


@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
def test_data_parallel_rank_states_and_peak_against_pytorch(shard):
    """--dp N --shard fsdp|ddp: one rank's parameters, gradients and AdamW state (``report --dp``'s
    ``memory``: :func:`symcost.passes.parallel.summary`) equal rank 0's on PyTorch's fake process
    group (fully_shard / replicate on every block, then the root; DTensor shards counted locally)
    at random sizes and DP; the rank's peak equals MemTracker's. ZeRO-1 (the same DDP trace) is
    DeepSpeed's: its optimizer steps one flat fp32 partition of the trainable parameters only
    (deepspeed/runtime/zero/stage_1_and_2.py: ``trainable_parameters`` are those that require
    grad; ``param_group['params'] = [single_partition_of_fp32_groups[i]]``), padded to a multiple
    of DP: a real AdamW stepping such a partition (P_train counted on the meta-built model) keeps
    the bytes symcost gives (two moments and one step tensor, not one per parameter tensor)."""
    from symcost.passes.memory import memory_model
    from symcost.passes.parallel import summary

    an = symcost.trace(MODEL, layout=Layout(shard=shard), precision="fp32", torch_device="cpu",
                       sizes={"B": 2, "S": 4, "H": 2, "D": 2, "F": 8, "L": 3, "V": 8, "R_lora": 2, "DP": 2})
    assert "DP" in an.symbols and not an.pinned, an.pin_reasons
    rng = random.Random(f"frozen-{shard}")
    dp = rng.choice((2, 4))
    v = _draw(rng, dp)
    sizes = {k: x for k, x in v.items() if k in an.symbols}
    got = _real({**symcost.resolve(MODEL).defaults, **v}, shard=shard)
    out = summary(an, "fp32", "adamw", sizes=sizes)
    for k in ("params", "grads", "optimizer_state"):
        assert int(out["values"]["memory"][k]) == got[k], (v, k, out["values"]["memory"][k], got[k])
    assert memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu").peak(**sizes) == got["peak"], v
    if shard == "ddp":
        an1 = symcost.trace(MODEL, layout=Layout(shard="zero1"), precision="fp32", torch_device="cpu",
                            sizes={"B": 2, "S": 4, "H": 2, "D": 2, "F": 8, "L": 3, "V": 8, "R_lora": 2, "DP": 2})
        mem = summary(an1, "fp32", "adamw", sizes=sizes)["values"]["memory"]
        import torch

        flat = torch.zeros(-(-got["trained"] // dp), requires_grad=True)  # (this rank's partition)
        opt = torch.optim.AdamW([flat])
        flat.grad = torch.zeros_like(flat)
        opt.step()
        want = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
        assert int(mem["optimizer_state"]) == want == 8 * -(-got["trained"] // dp) + 4, (v, mem)
        assert int(mem["grads"]) == got["grads"] and int(mem["params"]) == got["params"]


@pytest.mark.heavy
def test_pipeline_rank_states_against_the_stage_modules():
    """--pp 2: each rank's model states are the policy over its stage's parameters (fp32: 4 bytes
    each, frozen ones included) plus gradients and AdamW state of those that require grad only (12
    bytes each) and a 4-byte step per such tensor, counted on the meta-built model's stage modules
    (the embedding on the first, the final norm and head on the last, the root's position table on
    both); the
    gradients PyTorch's schedule leaves on the rank (its run on fake tensors) are those 4 bytes per
    trained element."""
    import torch

    from symcost.frontends.pipeline import stage_blocks
    from symcost.passes.pipeline import summary

    rng = random.Random("frozen-pp")
    v = {**_draw(rng), "L": rng.choice((4, 6))}
    r = summary(MODEL, 2, "1f1b", 2, precision="fp32", sizes=v)
    spec = symcost.resolve(MODEL)
    with torch.device("meta"):
        m = spec.build({**spec.defaults, **v})
    blocks = stage_blocks(v["L"], 2)
    stages = [[m.embed, *list(m.blocks)[:blocks[0]]], [*list(m.blocks)[blocks[0]:], m.norm, m.head]]
    for row, mods in zip(r["ranks"], stages):
        # (the position table, a parameter of the root module, stays on every stage: stages
        # replace other stages' child modules, as torchtitan's manual split deletes modules)
        ps = [p for mod in mods for p in mod.parameters()] + [m.pos]
        trained = [p for p in ps if p.requires_grad]
        assert row["params"] == sum(p.numel() for p in ps), row
        assert row["model_states"] == 4 * row["params"] + 12 * sum(p.numel() for p in trained) + 4 * len(trained), row
        assert row["memory"]["grads"] == 4 * sum(p.numel() for p in trained), row


def test_blocks_frozen_differently_are_not_folded():
    """Blocks that differ in which parameters are frozen (tests/data/frozen_bottom.py
    ``spec_top``: the blocks from index 3 on ``requires_grad_(False)``, none of them in the
    probes' 2 or 3 blocks) are traced unfolded at the requested L, with the reason said
    (tracing/probes.py ``frozen_blocks_differ``). Before, the fold applied block 0's status to
    every block, silently: nothing pinned, gradients and AdamW state of every block (at L = 5,
    B=3 S=5 H=2 D=4 F=12 V=20: optimizer 11,604 B vs the real step's 8,044). Now parameters,
    gradients and AdamW state equal a real AdamW step's at random sizes (the for-loop AdamW on
    real CPU tensors: moments and 0-d step tensors of the parameters that got a gradient)."""
    import torch

    from symcost.passes.memory import memory_model

    model = str(Path(__file__).resolve().parent / "data" / "frozen_bottom.py") + ":spec_top"
    rng = random.Random("frozen-blocks-differ")
    L = rng.randint(4, 6)
    an = symcost.trace(model, precision="fp32", torch_device="cpu", sizes={"L": L})
    assert an.pinned == {"L": L} and "differ in which parameters are frozen" in an.pin_reasons["L"], an.pin_reasons
    spec = symcost.resolve(model)
    for _ in range(2):
        v = {"B": rng.randint(2, 4), "S": rng.randint(2, 6), "H": rng.randint(2, 3), "D": rng.choice((2, 4)),
             "F": rng.randint(4, 16), "V": rng.randint(8, 24)}
        comp = memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu").components(**v)
        m = spec.build({**spec.defaults, **v, "L": L})
        opt = torch.optim.AdamW(m.parameters(), foreach=False)
        args, kwargs = spec.make_inputs({**spec.defaults, **v}, torch.device("cpu"))
        spec.loss(m(*args, **kwargs), (args, kwargs)).backward()
        opt.step()
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        assert comp["params"] == sum(size(p) for p in m.parameters()), v
        assert comp["grads"] == sum(size(p.grad) for p in m.parameters() if p.grad is not None), v
        assert comp["optimizer"] == sum(size(t) for st in opt.state.values() for t in st.values()), v
        assert any(not p.requires_grad for p in m.parameters())

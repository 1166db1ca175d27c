"""Parallel layouts of a model with several stacks of blocks (issue 30 item 6): an encoder-decoder
under data parallelism (``--dp``, every ``--shard``), with ``--ac``, and under ``--tp``, each
stack folded under its own length symbol and checked at lengths never traced; the layouts that
refuse it in one line (docs/parallel.md §1.1, "Several block stacks").

PyTorch runs these steps: DDP over the whole model, FSDP2 with ``fully_shard`` on every block of
every stack and then the root (torchtitan's ``apply_fsdp`` does it per block). The oracle here is
that step, wrapped by hand (``fully_shard``/``replicate`` on ``encoder.{i}`` and ``decoder.{i}``,
then the root) on a meta-device build, on PyTorch's fake process group under ``FakeTensorMode``:
FlopCounterMode's FLOPs, ``saved_tensors_hooks``' bytes, the collectives PyTorch dispatches (ring
factors), the DTensor shards rank 0 holds and its AdamW state, at random sizes and DP.
"""
from __future__ import annotations

import random
from fractions import Fraction

import pytest
import sympy

import symcost
from symcost.frontends.layout import Layout
from symcost.tracing.fit import SYMS
from test_own_symbols import examples  # noqa: F401 - the fixture
from test_own_symbols import _spec as _factory

STACKS = ("encoder", "decoder")  # (the guide's encdec.py: two nn.Sequential of L_enc, L_dec blocks)


def _rank(spec, shard: str, values: dict, stacks=STACKS) -> dict:
    """Rank 0 of ``values["DP"]`` ranks of one fp32 training step of ``spec``'s model, every block
    of every stack (``stacks``: their containers) a unit of its own (wrapped here by hand), then
    the root."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from symcost.frontends.parallel import fake_group

    n = values["DP"]
    mesh = fake_group(n)
    with torch.device("meta"):
        m = spec.build(values)
    for c in stacks:
        for block in m.get_submodule(c).children():
            fully_shard(block, mesh=mesh) if shard == "fsdp" else replicate(block, mesh=mesh)
    fully_shard(m, mesh=mesh, reshard_after_forward=False) if shard == "fsdp" else replicate(m, mesh=mesh)
    comm = {"all_gather": Fraction(0), "reduce_scatter": Fraction(0), "all_reduce": Fraction(0)}

    def size(t):
        return t.numel() * t.element_size()

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == "c10d._allgather_base_":
                comm["all_gather"] += Fraction(n - 1, n) * size(args[0])
            elif name == "c10d._reduce_scatter_base_":
                comm["reduce_scatter"] += Fraction(n - 1, n) * size(args[1])
            elif name == "c10d.allreduce_":
                comm["all_reduce"] += Fraction(2 * (n - 1), n) * sum(size(t) for t in args[0])
            return func(*args, **(kwargs or {}))

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    seen, saved = set(), [0]

    def pack(t):
        key = StorageWeakRef(t.untyped_storage()).cdata
        # a parameter, or a tensor on a parameter's storage as it is now (the transposed weight a
        # matmul keeps; FSDP2's unsharded parameters are the module's while it runs): no activation
        if isinstance(t, torch.nn.Parameter) or key in {
                StorageWeakRef(getattr(p, "_local_tensor", p).untyped_storage()).cdata for p in m.parameters()}:
            return t
        if key not in seen:
            seen.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        args, kwargs = spec.make_inputs(values, torch.device("cpu"))
        fc = FlopCounterMode(display=False)
        with fc, Collectives():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = spec.loss(m(*args, **kwargs), (args, kwargs))
            loss.backward()
        opt = torch.optim.AdamW(m.parameters(), foreach=False)
        opt.step()
        states = {"params": sum(size(local(p)) for p in m.parameters()),
                  "grads": sum(size(local(p.grad)) for p in m.parameters() if p.grad is not None),
                  # (each parameter's 0-d fp32 step tensor included: torch.optim keeps it unsharded per rank)
                  "optimizer_state": sum(size(local(t)) for st in opt.state.values() for k, t in st.items())}
    return {"flops": fc.get_total_flops(), "saved": saved[0], "comm": comm, "states": states,
            "units": sum(1 for c in stacks for _ in m.get_submodule(c).children()) + 1}


@pytest.mark.heavy
@pytest.mark.parametrize("shard", ["fsdp"])
def test_encdec_data_parallel_every_block_of_both_stacks(examples, shard):  # noqa: F811 - the fixture
    """The guide's encdec.py (L_enc, L_dec) under --dp --shard fsdp, folded per stack: the stack
    lengths stay symbols (the probes hold a first, a middle and a last block of each stack, as
    the one block list's fold under --dp). One rank's FLOPs, saved bytes, collective bytes and
    model states (parameters, gradients, AdamW state) equal PyTorch's on the rank wrapped block by
    block in both stacks, at random sizes and DP and at stack lengths never traced (the probes
    hold 3, the fit's check 4; here L_enc = 2, where the first and last blocks meet, with L_dec =
    5, then 6 and 2); its peak equals MemTracker's (which sees the units: one block's parameters
    gathered at a time). (--shard ddp, zero1, zero2, zero3 passed the same checks when written;
    one trace here: ~30 CPU-s.)"""
    from test_parallel_memory import _measure

    from symcost.passes.memory import memory_model
    from symcost.passes.parallel import summary

    spec = _factory(examples["encdec.py"], "spec")
    an = symcost.trace(spec, layout=Layout(shard=shard), precision="fp32", torch_device="cpu",
                       sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "V": 38, "F": 12,
                              "L_enc": 2, "L_dec": 3, "DP": 2})
    assert {"DP", "L_enc", "L_dec"} <= set(an.symbols) and not an.pinned, (an.symbols, an.pin_reasons)
    assert an.stacks == {"encoder": "L_enc", "decoder": "L_dec"}, an.stacks
    rng = random.Random(f"dp-stacks-{shard}")
    mem = summary(an, "fp32", "adamw")["memory"]
    for lengths in ({"L_enc": 2, "L_dec": 5}, {"L_enc": 6, "L_dec": 2}):
        dp = rng.choice((2, 4))
        v = {"B": rng.randint(2, 4), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": dp,
             "D": rng.choice((2, 4, 6)), "V": dp * rng.randint(5, 20), "F": dp * rng.randint(2, 8), "DP": dp,
             **lengths}
        got = _rank(spec, shard, {**spec.defaults, **v})
        env = {SYMS[k]: x for k, x in v.items() if k in an.symbols}
        assert int(an.flops("train").subs(env)) == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
        for kind, want in got["comm"].items():
            assert sympy.Rational(an.comm_bytes(kind).subs(env)) == sympy.Rational(want.numerator, want.denominator), \
                (v, kind)
        for k, want in got["states"].items():
            assert int(sympy.sympify(mem[k]).subs(env)) == want, (v, k)
        peak = _measure(str(examples["encdec.py"]) + ":spec", shard, {**spec.defaults, **v}, "fp32",
                        stacks=list(STACKS))
        sizes = {k: x for k, x in v.items() if k in an.symbols}
        assert memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu").peak(**sizes) == peak, v


@pytest.mark.heavy
def test_whisper_fsdp_folds_both_stacks_over_L():
    """hf:whisper --dp --shard fsdp (was refused at whisper-tiny's sizes: 'no probe sizes for B, S,
    F, DP stay in the regime'; --shard ddp pinned H, D, V and N_mel besides L): the root unit's
    buffer sums the conv stem's, the token and position tables' and the norms' sizes, H·D and
    448·H·D among them, which the fit's parameter-size hints held as two collinear columns (no
    rational split), so those sizes were pinned, and with V = 51865 pinned no probe had every first
    dimension a multiple of lcm(DP, 4). Now nothing is pinned, L included (both stacks follow it
    and fold under it, L was pinned before the fold per stack under --dp); at an L never traced, one rank's
    FLOPs, saved bytes, collective bytes and parameter shard bytes equal PyTorch's on the rank
    wrapped by hand (fully_shard on every block of both stacks, then the root) at random sizes and
    DP; so do its gradients and AdamW state (moments and step counters): the encoder's position
    table is frozen (``requires_grad_(False)`` in transformers' WhisperEncoder), so the rank holds
    its shard but no gradient or optimizer state for it (symcost gave it both before: 12·H·D·S_enc/DP
    bytes and one step counter over, tests/test_frozen_params.py). (~45 CPU-s: one trace)"""
    from symcost.frontends.models import resolve
    from symcost.passes.parallel import summary

    # (eager attention: FlopCounterMode counts no FLOPs for CPU SDPA's flash kernel)
    spec = resolve("hf:whisper", attention="eager")
    an = symcost.trace(spec, layout=Layout(shard="fsdp"), precision="fp32", torch_device="cpu",
                       sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "F": 10, "V": 37, "L": 2, "N_mel": 6,
                              "DP": 2})
    assert not an.pinned and "L" in an.symbols, an.pin_reasons
    assert set(an.stacks.values()) == {"L"}, an.stacks
    rng = random.Random("whisper-fsdp")
    dp = rng.choice((2, 4))
    # (every first dimension a multiple of DP: FSDP2 pads the others, docs/parallel.md)
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": dp * rng.randint(2, 4), "H": dp,
         "D": rng.choice((2, 4, 6)), "F": dp * rng.randint(2, 6), "V": dp * rng.randint(5, 15),
         "N_mel": rng.randint(2, 9), "L": rng.choice((2, 5)), "DP": dp}
    got = _rank(spec, "fsdp", {**spec.defaults, **v}, stacks=("model.encoder.layers", "model.decoder.layers"))
    env = {SYMS[k]: x for k, x in v.items() if k in an.symbols}
    assert int(an.flops("train").subs(env)) == got["flops"], v
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
    for kind, want in got["comm"].items():
        assert sympy.Rational(an.comm_bytes(kind).subs(env)) == sympy.Rational(want.numerator, want.denominator), \
            (v, kind)
    mem = summary(an, "fp32", "adamw")["memory"]
    assert an.frozen == {"model.encoder.embed_positions.weight"}, an.frozen
    for k, want in got["states"].items():
        assert int(sympy.sympify(mem[k]).subs(env)) == want, (v, k)


@pytest.mark.heavy
def test_bart_tensor_parallel_both_stacks():
    """hf:bart --tp, both stacks folded over L (pinned before the fold per stack under a layout):
    the Megatron plan over every block of both stacks (q/k/v_proj, fc1
    column-parallel; out_proj, fc2 row-parallel; the shared embedding and the tied encoder and
    decoder embed_tokens vocabulary-parallel; the head gathers its logits, as transformers'
    ``colwise_gather_output``, since BART adds final_logits_bias to them). One rank's model FLOPs,
    saved bytes, collective bytes and parameter shard equal PyTorch's on the fake group running
    that plan (tests/data/tp_rank.py ``measure``) at random sizes, L never traced (4 or 5)."""
    import os
    import sys

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
    from tp_rank import measure

    from symcost.frontends.models import resolve
    from symcost.frontends.parallel import fake_group
    from symcost.frontends.tensor_parallel import apply

    spec = resolve("hf:bart", attention="eager")
    an = symcost.trace(spec, layout=Layout(tp=True), precision="bf16-true", torch_device="cpu",
                       sizes={"B": 2, "S": 5, "S_enc": 7, "H": 4, "D": 4, "F": 16, "V": 64, "L": 2, "TP": 2})
    assert set(an.pinned) <= {"TP"} and set(an.stacks.values()) == {"L"}, (an.pin_reasons, an.stacks)
    rng = random.Random("bart-tp")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": 4,
         "D": rng.choice((2, 4, 6)), "F": 8 * rng.randint(1, 4), "V": 8 * rng.randint(4, 12), "L": rng.choice((4, 5)),
         "TP": 2}
    values = {**spec.defaults, **v}
    with torch.device("meta"):
        model = spec.build(values).to(torch.bfloat16)
    ctx = apply(model, ["model.encoder.layers", "model.decoder.layers"], fake_group(2), False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        got = measure(model, spec, values, ctx)
    env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
    assert int(an.flops("train").subs(env)) == got["flops"], v
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (kind, v)
    assert int(an.params_shard.subs(env)) == got["shard"], v


def test_pp_refused_in_plain_words():
    """--pp on an encoder-decoder that is not staged yet (hf:t5, two stacks of L, keyword inputs;
    the guide's encdec.py is staged: tests/test_pipeline_stacks.py): one line saying so, with what
    is accepted, before any trace (was: 'has no symbol L' / 'set ModelSpec.layers')."""
    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import trace_stages

    for spec, sizes in ((resolve("hf:t5"), {"L": 2, "H": 2, "D": 4}),):
        with pytest.raises(symcost.SymcostError) as e:
            trace_stages(spec, 2, sizes=sizes)
        msg = str(e.value)
        assert "\n" not in msg and "ModelSpec.layers" not in msg, msg
        assert "several stacks of blocks" in msg and "accepted for this model: --dp" in msg, msg


def test_no_one_block_list_message_is_grammatical_and_actionable():
    """find_layer_container's refusal: 'several containers (...) have length L' (was 'has'); an
    hf: model's says what runs instead of asking for ModelSpec.layers, which its user cannot set."""
    import dataclasses

    from symcost.frontends.models import resolve
    from symcost.tracing.record import find_layer_container

    spec = resolve("hf:t5")
    values = {**spec.defaults, "L": 2, "H": 2, "D": 4}
    with pytest.raises(symcost.SymcostError) as e:
        find_layer_container(spec, spec.build_meta(values), values)
    msg = str(e.value)
    assert "several containers (decoder.block, encoder.block) have length L" in msg, msg
    assert "ModelSpec.layers" not in msg and "traced unfolded" in msg, msg
    own = dataclasses.replace(spec, name="mine")
    with pytest.raises(symcost.SymcostError, match="set ModelSpec.layers"):
        find_layer_container(own, own.build_meta(values), values)


@pytest.mark.parametrize("layout, words", [(Layout(tp=True, sp=True), "under sequence parallelism the blocks"),
                                           (Layout(shard="fsdp"), "under a data-parallel layout the blocks"),
                                           (Layout(shard="ddp", tp=True, sp=True),
                                            "under a data-parallel layout with sequence parallelism the blocks")])
def test_unfolded_stack_reason_names_the_requested_layout(layout, words, monkeypatch):
    """A stack whose first block differs from the middle one under a three-block layout (hf:t5's
    block 0, 4df6198) pins its length with a reason that names the layout asked for: --tp --sp
    alone is sequence parallelism, not a data-parallel layout (the reason said so before). The
    blocks' op sequences are planted (block 0 apart), no recording."""
    import dataclasses

    from symcost.graph import stacks as gs
    from symcost.tracing.fit import Unvariable

    spec = symcost.resolve("hf:t5")
    laid = dataclasses.replace(spec, extra={**spec.extra, "layout": layout.to_dict()})
    monkeypatch.setattr(gs, "_block_seqs", lambda req, stacks: {("encoder.block", 0): "first",
                                                                 ("encoder.block", 1): "middle",
                                                                 ("encoder.block", 2): "middle"})
    with pytest.raises(Unvariable) as e:
        gs.probe_blocks(laid, {"encoder.block": "L"}, None, None, {})
    assert words in str(e.value) and "encoder.block are not folded" in str(e.value), str(e.value)
    if not layout.shard:
        assert "data-parallel" not in str(e.value), str(e.value)


@pytest.mark.heavy
def test_encdec_activation_checkpointing_under_data_parallel(examples):  # noqa: F811 - the fixture
    """--dp 2 (ddp) --ac selective on the guide's encdec.py (was refused): every block of both
    stacks checkpointed under torchtitan's op-level policy, then each a DDP unit (torchtitan's
    order), each stack folded under its length (the probes' first, middle and last block). One
    rank's hardware FLOPs (the recomputation included), saved bytes and all-reduce bytes equal
    PyTorch's step with each block in ``checkpoint_wrapper`` and then ``replicate``, at random
    sizes and DP and stack lengths never traced; the model FLOPs leave the recomputation out.
    (~40 CPU-s)"""
    from test_checkpoint_stacks import _checkpointed

    spec = _factory(examples["encdec.py"], "spec")
    an = symcost.trace(spec, layout=Layout(shard="ddp", ac="selective"), precision="fp32", torch_device="cpu",
                       sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "V": 38, "F": 12,
                              "L_enc": 2, "L_dec": 2, "DP": 2})
    assert {"DP", "L_enc", "L_dec"} <= set(an.symbols) and not an.pinned, an.pin_reasons
    rng = random.Random("dp-ac-stacks")
    v = {"B": rng.randint(2, 4), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 3),
         "D": rng.choice((2, 4, 6)), "V": rng.randint(10, 40), "F": rng.randint(4, 16), "DP": rng.choice((2, 4)),
         "L_enc": rng.choice((5, 6)), "L_dec": 2}
    got = _rank(_checkpointed(spec, STACKS, "selective"), "ddp", {**spec.defaults, **v})
    plain = _rank(spec, "ddp", {**spec.defaults, **v})
    env = {SYMS[k]: x for k, x in v.items() if k in an.symbols}
    assert int(an.flops("train", "hardware").subs(env)) == got["flops"] > plain["flops"], v
    assert int(an.flops("train").subs(env)) == plain["flops"], v
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"] < plain["saved"], v
    assert sympy.Rational(an.comm_bytes("all_reduce").subs(env)) == sympy.Rational(
        got["comm"]["all_reduce"].numerator, got["comm"]["all_reduce"].denominator), v


@pytest.mark.heavy
def test_encdec_hsdp_folds_the_stacks(examples):  # noqa: F811 - the fixture
    """--dp 4 --dp-replicate 2 --shard fsdp (HSDP) on encdec.py: nothing pinned, L_enc and L_dec
    folded per stack (they were pinned before the fold per stack under a layout; a fit check once
    drew DP = R, a dp_shard group of one rank whose bytes differ, and every size was pinned); one
    rank's FLOPs, saved bytes, each group's collective bytes and parameter shard equal PyTorch's
    HSDP on the fake 2-D mesh with every block of both stacks a unit (tests/data/tp_rank.py
    ``hsdp_mesh``, ``measure``), at random sizes with shard groups of 2 and 4 and stack lengths
    never traced. (~25 CPU-s)"""
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
    from tp_rank import check_rank, hsdp_mesh, measure

    from symcost.frontends.parallel import wrap

    spec = _factory(examples["encdec.py"], "spec")
    an = symcost.trace(spec, layout=Layout(shard="fsdp", replicate=2), precision="bf16-true", torch_device="cpu",
                       sizes={"B": 2, "S": 8, "S_enc": 8, "H": 4, "D": 8, "V": 64, "F": 32,
                              "L_enc": 2, "L_dec": 2, "DP": 4})
    assert not an.pinned and {"L_enc", "L_dec"} <= set(an.symbols), an.pin_reasons
    rng = random.Random("hsdp-stacks")
    dp = 2 * rng.choice((2, 4))
    v = {"DP": dp, "B": rng.randint(1, 3), "S": rng.randint(2, 12), "S_enc": rng.randint(2, 12),
         "H": 4 * rng.randint(1, 2), "D": 4 * rng.randint(1, 3), "V": 8 * dp * rng.randint(1, 2),
         "F": 8 * dp * rng.randint(1, 2), "L_enc": 2, "L_dec": rng.choice((5, 6))}
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    mesh, groups = hsdp_mesh(dp, 2)
    with torch.device("meta"):
        model = spec.build({**spec.defaults, **v}).to(torch.bfloat16)
    wrap(model, list(STACKS), "fsdp", mesh)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        got = measure(model, spec, {**spec.defaults, **v}, __import__("contextlib").nullcontext, groups=groups)
    check_rank(an, {k: x for k, x in v.items() if k in an.symbols}, got, v)

"""Tensor parallelism on encoder-decoders (issue 30): T5 under the Megatron plan, and ``--tp --sp``
on several stacks (docs/parallel.md §1.1 and §11).

The oracle is PyTorch running Megatron-LM's T5 layout, typed here from its source
(megatron/core/models/T5/t5_model.py and megatron/core/transformer: the attention's q, k, v
``ColumnParallelLinear`` and its output ``RowParallelLinear``; the MLP's ``linear_fc1`` (T5's
``wi``, or ``wi_0``/``wi_1`` gated) column-parallel, ``linear_fc2`` (``wo``) row-parallel; the
embedding ``VocabParallelEmbedding``; each rank computes its heads' relative position bias),
written with ``torch.distributed.tensor.parallel``'s styles and applied by
``parallelize_module`` on PyTorch's fake process group: FlopCounterMode's registry on the local
ops, ``saved_tensors_hooks``, the collectives PyTorch dispatches and the local shards
(tests/data/tp_rank.py ``measure``), at random sizes. For ``--tp --sp`` on BART the oracle is
torchtitan's sequence-parallel plan for a transformers model over both stacks, typed the same way
(:func:`_sp_rank`; Whisper's too). That the plans compute the untouched model's loss and gradients is
checked on 2 ranks with real collectives, threads over PyTorch's threaded process group
(:func:`_two_threads`).
"""
from __future__ import annotations

import os
import random
import sys
from fractions import Fraction

import pytest

import symcost
from symcost.frontends.layout import Layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))

#: T5's projections as Megatron-LM's T5 layout splits them (weight dim split: 0 column-, 1 row-parallel)
T5_COLWISE = ("q", "k", "v", "wi", "wi_0", "wi_1")
T5_ROWWISE = ("o", "wo")


def _t5_megatron_rank(spec, values: dict):
    """Rank 0 of ``values["TP"]`` on the fake process group: ``spec``'s T5 built on the meta device
    in bf16 and split as Megatron-LM splits T5 (module docstring), the plan typed here:
    ``ColwiseParallel`` on q, k, v, wi (wi_0, wi_1), ``RowwiseParallel`` on o, wo; the relative
    position bias tables ``nn.Embedding(num_buckets, H)`` ``ColwiseParallel`` (weight split over
    its columns, the heads: the rank looks up its own heads' bias; Megatron computes the whole
    bias and scatters it over the heads, the same values); the shared token table and the
    encoder's and decoder's ``embed_tokens`` on it vocabulary-parallel (``RowwiseParallel``), the
    head column-parallel with its logits gathered (as transformers' ``colwise_gather_output``),
    the tied weights tied again; every attention's ``n_heads`` divided by TP. Returns the model;
    the caller materialises it (``to_empty``) under its FakeTensorMode."""
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from symcost.frontends.parallel import fake_group

    mesh = fake_group(values["TP"])
    with torch.device("meta"):
        m = spec.build(values).to(torch.bfloat16)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for n in ("shared", "encoder.embed_tokens", "decoder.embed_tokens"):
        plan[n] = RowwiseParallel(input_layouts=Replicate())
    for n, mod in m.named_modules():
        last = n.rpartition(".")[2]
        if not n.startswith(("encoder.block.", "decoder.block.")):
            continue
        if last in T5_COLWISE or last == "relative_attention_bias":
            plan[n] = ColwiseParallel()
        elif last in T5_ROWWISE:
            plan[n] = RowwiseParallel()
        if type(mod).__name__ == "T5Attention":
            mod.n_heads //= values["TP"]
    parallelize_module(m, mesh, plan)
    for n in ("encoder.embed_tokens", "decoder.embed_tokens", "lm_head"):
        m.get_submodule(n).weight = m.shared.weight
    return m


def _placements(model) -> dict:
    """``{parameter name: 'S0' | 'S1' | 'R' | 'whole'}`` of a parallelised model's parameters
    (a DTensor's placement; 'whole': a plain tensor the plan left alone, the norms)."""
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        (pl,) = getattr(p, "placements", (None,))
        out[n] = "whole" if pl is None else f"S{pl.dim}" if pl.is_shard() else "R"
    return out


@pytest.mark.hf
@pytest.mark.parametrize("ffn", ["relu", "gated-gelu"])
def test_t5_plan_is_megatrons_layout(ffn):
    """symcost's plan for hf:t5 (and T5 v1.1's gated feed-forward) splits every parameter as
    Megatron-LM's T5 layout does (the plan typed in :func:`_t5_megatron_rank`): the same
    placement of every parameter, the same local shapes, the same heads per rank. (Was refused:
    'DenseReluDense.wi (Linear) has no tensor-parallel style'.) Meta device, no trace: ~2 s."""
    import torch

    from symcost.frontends.models import resolve
    from symcost.frontends.parallel import fake_group
    from symcost.frontends.tensor_parallel import apply

    spec = resolve("hf:t5", {"feed_forward_proj": ffn}, "eager")
    rng = random.Random(f"t5-plan-{ffn}")
    tp = rng.choice((2, 4))
    values = {**spec.defaults, "H": 2 * tp * rng.randint(1, 2), "D": rng.choice((2, 4)), "F": 8 * rng.randint(1, 3),
              "V": 8 * rng.randint(2, 6), "M": 8 * rng.randint(1, 3), "L": 2, "TP": tp}
    want = _t5_megatron_rank(spec, values)
    with torch.device("meta"):
        got = spec.build(values).to(torch.bfloat16)
    apply(got, ["encoder.block", "decoder.block"], fake_group(tp), False)
    assert _placements(got) == _placements(want)
    def local(model):
        return {n: tuple(getattr(p, "_local_tensor", p).shape) for n, p in model.named_parameters()}

    assert local(got) == local(want)
    heads = {n: m.n_heads for n, m in got.named_modules() if type(m).__name__ == "T5Attention"}
    assert heads and set(heads.values()) == {values["H"] // tp}, heads
    wi = "wi_0" if ffn.startswith("gated") else "wi"
    assert _placements(got)[f"decoder.block.1.layer.2.DenseReluDense.{wi}.weight"] == "S0"
    assert _placements(got)["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == "S1"


@pytest.mark.heavy
@pytest.mark.hf
def test_t5_tensor_parallel_against_pytorch():
    """hf:t5 --tp (was refused): one rank's model FLOPs, saved bytes, collective bytes by kind and
    parameter elements equal PyTorch's running Megatron-LM's T5 layout (:func:`_t5_megatron_rank`)
    on the fake group, at random sizes (B, S, S_enc, D, F, V, M) never traced, and at a depth never
    traced where the stacks fold over L."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tp_rank import measure

    from symcost.frontends.models import resolve

    spec = resolve("hf:t5", attention="eager")
    an = symcost.trace(spec, layout=Layout(tp=True), precision="bf16-true", torch_device="cpu",
                       sizes={"B": 2, "S": 5, "S_enc": 7, "H": 4, "D": 4, "F": 16, "V": 64, "M": 16, "L": 2,
                              "TP": 2})
    assert set(an.pinned) <= {"L", "TP"}, an.pin_reasons
    assert {"B", "S", "S_enc", "D", "F", "V", "M"} <= set(an.symbols), an.symbols
    rng = random.Random("t5-tp")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": 4,
         "D": rng.choice((2, 4, 6)), "F": 8 * rng.randint(1, 4), "V": 8 * rng.randint(4, 12),
         "M": 8 * rng.randint(1, 4), "L": rng.choice((3, 4, 5)) if "L" in an.symbols else 2, "TP": 2}
    values = {**spec.defaults, **v}
    model = _t5_megatron_rank(spec, values)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        got = measure(model, spec, values, __import__("contextlib").nullcontext)
    env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
    assert int(an.flops("train").subs(env)) == got["flops"], v
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
    assert Fraction(got["comm"]["all_reduce"]) > 0
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (kind, v)
    assert int(an.params_shard.subs(env)) == got["shard"], v


def test_stacks_with_an_unplanned_linear_refused_in_one_line():
    """Several stacks under the Megatron plan where a block's Linear matches no column- or
    row-parallel name (``mix`` here, between q and o): one line naming it and what is accepted
    (a row-parallel projection would otherwise read a whole activation)."""
    import torch
    from torch import nn

    from symcost.frontends.parallel import fake_group
    from symcost.frontends.tensor_parallel import apply

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.mix, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return x + self.o(self.mix(self.q(x)))

    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList([Block(), Block()])
            self.dec = nn.ModuleList([Block(), Block()])

    with torch.device("meta"):
        m = EncDec()
    with pytest.raises(symcost.SymcostError) as e:
        apply(m, ["enc", "dec"], fake_group(2), False)
    msg = str(e.value)
    assert "\n" not in msg and "enc.0.mix (Linear) has no tensor-parallel style" in msg and "accepted:" in msg, msg


def _sp_rank(spec, values: dict):
    """Rank 0 of ``values["TP"]`` on the fake process group: ``spec``'s BART or Whisper built on the
    meta device in bf16 under tensor and sequence parallelism, the plan typed here as torchtitan
    writes sequence parallelism for a transformers model (torchtitan/experiments/
    transformers_modeling_backend/parallelize.py, ``apply_non_moe_tp``), over both stacks: the
    token tables (BART's shared one and the encoder's and decoder's ``embed_tokens`` on it;
    Whisper's decoder's) vocabulary-parallel, reduce-scattered over the sequence; a stack's learned
    position table replicated, its output split over the sequence where the stack starts at a token
    table (``PrepareModuleOutput(Replicate -> Shard(1))``: a slice forward, an all-gather of its
    gradient backward); a stack that starts elsewhere (Whisper's encoder: a Conv1d stem over the mel
    frames, then its position table added) runs that part whole on every rank and its first layer
    takes its hidden states split over the sequence (``PrepareModuleInput(Replicate -> Shard(1))``:
    the same slice and all-gather, after the add, where Megatron-LM scatters its embedding); every
    LayerNorm ``SequenceParallel``; each attention's input all-gathered (``PrepareModuleInput``),
    and a cross-attention's ``key_value_states`` (the encoder's output, sharded over S_enc) too;
    q/k/v and fc1 column-parallel, fc1 gathering its own input (it sits in the layer, whose input
    is the residual stream); out_proj and fc2 row-parallel, reduce-scattering; the head on the
    gathered sequence with its logits gathered (BART adds final_logits_bias to them). The residual
    stream stays a DTensor (``use_local_output=False``), as for any transformers model (the
    forward reads sequence lengths from it); head counts divided by TP; the tied tables tied
    again."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    from symcost.frontends.parallel import fake_group

    mesh = fake_group(values["TP"])
    with torch.device("meta"):
        m = spec.build(values).to(torch.bfloat16)
    names = dict(m.named_modules())
    seq, rep = Shard(1), Replicate()
    tables = [n for n in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens") if n in names]
    head = "lm_head" if "lm_head" in names else "proj_out"
    plan = {head: ColwiseParallel(input_layouts=seq, output_layouts=rep)}
    for n in tables:
        plan[n] = RowwiseParallel(input_layouts=rep, output_layouts=seq, use_local_output=False)
    for stack in ("encoder", "decoder"):
        p = f"model.{stack}."
        if p + "embed_tokens" in names:
            plan[p + "embed_positions"] = PrepareModuleOutput(output_layouts=rep, desired_output_layouts=seq,
                                                              use_local_output=False)
        else:  # (called as layer(hidden_states, None): the mask argument left alone)
            plan[p + "layers.0"] = PrepareModuleInput(input_layouts=(rep, None), desired_input_layouts=(seq, None),
                                                      use_local_output=False)
        for n, mod in m.get_submodule(f"model.{stack}").named_children():
            if isinstance(mod, nn.LayerNorm):  # (BART's layernorm_embedding, Whisper's final layer_norm)
                plan[p + n] = SequenceParallel()
        for i, layer in enumerate(m.get_submodule(f"model.{stack}.layers")):
            q = f"{p}layers.{i}."
            attns = ("self_attn",) + (("encoder_attn",) if stack == "decoder" else ())
            for a in attns:
                kv = {"input_kwarg_layouts": {"key_value_states": seq},
                      "desired_input_kwarg_layouts": {"key_value_states": rep}} if a == "encoder_attn" else {}
                if head == "proj_out" and stack == "encoder":
                    # (WhisperEncoderLayer calls self_attn(hidden_states=...) by keyword)
                    plan[q + a] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                     desired_input_kwarg_layouts={"hidden_states": rep})
                else:
                    plan[q + a] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,), **kv)
                for proj in ("q_proj", "k_proj", "v_proj"):
                    plan[f"{q}{a}.{proj}"] = ColwiseParallel()
                plan[f"{q}{a}.out_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=False)
                plan[f"{q}{a}_layer_norm"] = SequenceParallel()
                getattr(layer, a).num_heads //= values["TP"]
            plan[q + "fc1"] = ColwiseParallel(input_layouts=seq)
            plan[q + "fc2"] = RowwiseParallel(output_layouts=seq, use_local_output=False)
            plan[q + "final_layer_norm"] = SequenceParallel()
    parallelize_module(m, mesh, plan)
    for n in tables[1:] + [head]:
        m.get_submodule(n).weight = m.get_submodule(tables[0]).weight
    return m


def _bf16_inputs(spec):
    """``spec`` with its floating inputs (Whisper's mel features) in bf16, as the recorder casts
    them under ``bf16-true`` (the oracle's model is bf16)."""
    import dataclasses

    import torch
    from torch.utils._pytree import tree_map

    def make_inputs(values, device):
        return tree_map(lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        spec.make_inputs(values, device))

    return dataclasses.replace(spec, make_inputs=make_inputs)


@pytest.mark.heavy
@pytest.mark.hf
@pytest.mark.parametrize("model", ["hf:bart", "hf:whisper"])
def test_sequence_parallel_stacks_against_pytorch(model):
    """hf:bart --tp --sp (was refused: 'a plan crashed on fake tensors', fc1 sat in the layer and
    the whole layer's input was gathered) and hf:whisper --tp --sp (was refused: its encoder's
    stream starts at a Conv1d stem, whose whole output met the sequence-split position table in
    one add, 'aten.add.Tensor got mixed torch.Tensor and DTensor'; now split at the encoder's first
    layer): one rank's model FLOPs, saved bytes, collective bytes by kind and parameter elements
    equal PyTorch's running torchtitan's sequence-parallel plan over both stacks
    (:func:`_sp_rank`) on the fake group, at random sizes never traced (S and S_enc multiples of
    TP, as SequenceParallel splits both streams evenly), and at a depth never traced where the
    stacks fold over L (Whisper's split runs outside block 0: its stacks fold)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tp_rank import measure

    from symcost.frontends.models import resolve

    spec = resolve(model, attention="eager")
    mel = {"N_mel": 8} if model == "hf:whisper" else {}
    an = symcost.trace(spec, layout=Layout(tp=True, sp=True), precision="bf16-true", torch_device="cpu",
                       sizes={"B": 2, "S": 8, "S_enc": 16, "H": 4, "D": 4, "F": 16, "V": 64, "L": 4, "TP": 2, **mel})
    assert set(an.pinned) <= {"L", "TP"}, an.pin_reasons
    assert {"B", "S", "S_enc", "D", "F", "V"} <= set(an.symbols), an.symbols
    if model == "hf:whisper":
        assert "L" in an.symbols, an.pin_reasons
    rng = random.Random(f"{model}-sp")
    v = {"B": rng.randint(2, 3), "S": 8 * rng.randint(1, 3), "S_enc": 8 * rng.randint(1, 3), "H": 4,
         "D": rng.choice((2, 4, 6)), "F": 8 * rng.randint(1, 4), "V": 8 * rng.randint(4, 12),
         "L": rng.choice((2, 3, 5)) if "L" in an.symbols else 4, "TP": 2,
         **({"N_mel": 8 * rng.randint(1, 3)} if mel else {})}
    values = {**spec.defaults, **v}
    rank = _sp_rank(spec, values)
    with FakeTensorMode(allow_non_fake_inputs=True):
        rank.to_empty(device="cpu")
        got = measure(rank, _bf16_inputs(spec), values, __import__("contextlib").nullcontext)
    env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
    assert Fraction(got["comm"]["reduce_scatter"]) > 0 and Fraction(got["comm"]["all_gather"]) > 0
    assert int(an.flops("train").subs(env)) == got["flops"], v
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (kind, v)
    assert int(an.params_shard.subs(env)) == got["shard"], v


@pytest.mark.hf
def test_sp_refused_where_a_block_flattens_the_sequence():
    """hf:opt --tp --sp (was: a DataDependentOutputException inside the step): OPT's decoder layer
    reshapes the sequence-sharded hidden states to (-1, h) before its MLP, a ``_StridedShard(0)``
    DTensor that the sequence-parallel styles lay out again over the hidden dimension (not the
    sequence-parallel step; frontends/tensor_parallel_stacks.py ``refuse_flattened_sequence``): one
    line naming the module and what is accepted, at the request's recording, before any probe."""
    from symcost.frontends.models import resolve

    with pytest.raises(symcost.SymcostError) as e:
        symcost.trace(resolve("hf:opt", attention="eager"), layout=Layout(tp=True, sp=True), precision="bf16-true",
                      torch_device="cpu", sizes={"B": 2, "S": 16, "H": 4, "D": 4, "F": 32, "V": 64, "L": 2, "TP": 2})
    msg = str(e.value)
    assert "\n" not in msg and "final_layer_norm receives the sequence-sharded hidden states flattened" in msg, msg
    assert "_StridedShard(0)" in msg and "accepted for this model: --tp without --sp" in msg, msg


def _two_threads(fn) -> list:
    """``fn(mesh)`` on each of 2 ranks run as threads of this process over PyTorch's threaded
    process group (torch.testing._internal.distributed.multi_threaded_pg, as PyTorch's own
    ``spawn_threads_and_init_comms`` runs DTensor tests: real collectives between the threads,
    no process started); the results in rank order. The process's own process-group state
    (the fake group of other tests) is restored after."""
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    out: list = [None, None]
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        _install_threaded_pg()
        store = dist.HashStore()

        def run(rank):
            try:
                dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
                out[rank] = fn(init_device_mesh("cpu", (2,)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out[rank] = e
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


@pytest.mark.hf
@pytest.mark.parametrize("model,sp", [("hf:t5", False), ("hf:t5", True), ("hf:bart", True), ("hf:whisper", True)])
def test_loss_and_gradients_equal_the_untouched_model(model, sp):
    """The plans compute what the untouched model computes: 2 ranks with real collectives (threads
    over PyTorch's threaded process group), fp32, dropout off, the plan applied by
    ``parallelize_module`` to copies of one model at random sizes: each rank's loss equals the
    untouched model's within 1e-5, and every parameter's gradient (a DTensor's whole tensor)
    within 1e-5 of its gradient there (T5's split relative position bias included; Whisper's conv
    stem, whole on every rank, whose stream is split at the encoder's first layer). A few
    seconds; a torchrun over gloo would cost well over 30 s here."""
    import copy

    import torch

    from symcost.frontends.models import resolve
    from symcost.frontends.tensor_parallel import apply

    over = {"dropout_rate": "0"} if model == "hf:t5" else {"dropout": "0", "attention_dropout": "0",
                                                          "activation_dropout": "0"}
    spec = resolve(model, over, "eager")
    rng = random.Random(f"{model}-{sp}-numeric")
    v = {**spec.defaults, "B": rng.randint(1, 3), "S": 2 * rng.randint(2, 5), "S_enc": 2 * rng.randint(2, 6), "H": 4,
         "D": rng.choice((2, 4)), "F": 4 * rng.randint(2, 4), "V": 8 * rng.randint(4, 8), "L": rng.randint(2, 3),
         **({"M": 8 * rng.randint(1, 3)} if "M" in spec.symbols else {}),
         **({"N_mel": 8} if "N_mel" in spec.symbols else {})}
    layers = ["encoder.block", "decoder.block"] if model == "hf:t5" else ["model.encoder.layers", "model.decoder.layers"]
    torch.manual_seed(rng.randint(0, 2**31))
    ref = spec.build(v).float()
    args, kwargs = spec.make_inputs(v, torch.device("cpu"))
    want = spec.loss(ref(*args, **kwargs), (args, kwargs))
    want.backward()

    def rank(mesh):
        m = copy.deepcopy(ref)
        m.zero_grad(set_to_none=True)
        with apply(m, layers, mesh, sp)():
            loss = spec.loss(m(*args, **kwargs), (args, kwargs))
            loss.backward()
        whole = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)  # noqa: E731
        return float(whole(loss).detach()), {n: whole(p.grad) for n, p in m.named_parameters() if p.grad is not None}

    grads = dict(ref.named_parameters())
    for loss, got in _two_threads(rank):
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (loss, want.item(), v)
        assert set(got) == {n for n, p in grads.items() if p.grad is not None}
        for n, g in got.items():
            assert torch.allclose(g, grads[n].grad, atol=1e-5, rtol=1e-4), (n, v)

"""What a Megatron-LM run does under ``--precision megatron-*`` (symcost/frontends/megatron.py):
its vocabulary-parallel cross entropy, and its data-parallel engine that uses the parameters in
place.

Oracles: ``F.cross_entropy`` (the loss and its gradient, numerically); two real gloo processes
holding half the vocabulary each (the tensor-parallel loss against the whole-vocabulary one);
``torch.profiler`` and ``saved_tensors_hooks`` measuring the same loss on real CPU tensors
(tests/memory_oracle.py) against the trace's saved bytes and peak.
"""
from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symcost
from memory_oracle import saved_bytes, step_peak
from symcost.errors import SymcostError
from symcost.frontends.layout import Layout
from symcost.frontends.megatron import for_run, vocab_parallel_cross_entropy
from symcost.frontends.spec import ModelSpec
from symcost.passes import memory


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_loss_and_gradient_equal_cross_entropy(dtype, tol):
    """Per-position loss and the logits' gradient equal ``F.cross_entropy``'s (computed in fp32
    on the same values); the gradient comes back in the logits' dtype."""
    torch.manual_seed(1)
    x = (3 * torch.randn(3, 7, 50)).to(dtype).requires_grad_()
    t = torch.randint(0, 50, (3, 7))
    ref_x = x.detach().float().clone().requires_grad_()  # (fp32 logits are worked on in place, as Megatron does)
    ref = F.cross_entropy(ref_x.flatten(0, 1), t.flatten(), reduction="none").view(3, 7)
    got = vocab_parallel_cross_entropy(x, t)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=tol, rtol=tol)
    w = torch.rand(3, 7)
    g, = torch.autograd.grad((got * w).sum(), x)
    g_ref, = torch.autograd.grad((ref * w).sum(), ref_x)
    assert g.dtype == dtype and torch.allclose(g.float(), g_ref, atol=tol, rtol=tol)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        full = (4 * torch.randn(2, 5, 12)).requires_grad_()
        t = torch.randint(0, 12, (2, 5))
        mesh = init_device_mesh("cpu", (world,))
        shard = distribute_tensor(full.detach(), mesh, [Shard(2)]).requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, t)
        loss.mean().backward()
        ref = F.cross_entropy(full.flatten(0, 1), t.flatten(), reduction="none").view(2, 5)
        ref.mean().backward()
        mine = full.grad.chunk(world, dim=2)[rank]
        out[rank] = (torch.allclose(loss, ref, atol=1e-5),
                     torch.allclose(shard.grad.to_local(), mine, atol=1e-6))
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
        from gloo_teardown import finish

        finish()  # every rank past its last collective before any closes (pytorch/gloo#155)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_tensor_parallel_loss_on_two_gloo_ranks():
    """Logits sharded on the vocabulary over two real gloo ranks: each rank's loss equals the
    whole-vocabulary cross entropy, and its gradient shard equals that slice of the whole one."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_tp_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    assert dict(out) == {0: (True, True), 1: (True, True)}


class Head(nn.Module):
    """Embedding and an untied output head: ``ids [B, S]`` -> logits ``[B, S, V]``."""

    def __init__(self, v, d):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.out = nn.Linear(d, v, bias=False)

    def forward(self, ids):
        return self.out(self.emb(ids))


def head_spec():
    return ModelSpec(name="head", symbols=("D", "V"), defaults={"B": 2, "S": 16, "D": 32, "V": 96},
                     build=lambda v: Head(v["V"], v["D"]),
                     make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
                     loss=lambda out, inputs: F.cross_entropy(out.flatten(0, 1), inputs[0][0].flatten()))


@pytest.fixture(scope="module")
def megatron_head():
    spec = for_run(head_spec(), "bf16-true", loss="megatron")
    return spec, symcost.trace(spec, sizes={"B": 3, "S": 40, "D": 24, "V": 200}, precision="bf16-true")


@pytest.mark.parametrize("sizes", [{"B": 3, "S": 40, "D": 24, "V": 200}, {"B": 5, "S": 28, "D": 40, "V": 328}])
def test_saved_and_peak_against_real_cpu(megatron_head, sizes):
    """The trace of the Megatron loss over a bf16 head keeps what ``saved_tensors_hooks`` sees a
    real CPU step keep (the fp32 softmax, the target mask, the local targets, the head's input),
    byte for byte, and its step peak is torch.profiler's within 3 %."""
    spec, an = megatron_head
    mm = memory.memory_model(an, "bf16-true", "adamw", "default", "cpu")
    saved = mm.components(**sizes)["activations"]
    assert saved == saved_bytes(spec, sizes, "bf16-true")
    meas = step_peak(spec, sizes, "bf16-true", "adamw", foreach=None)["peak_ops"]
    pred = mm.peak(**sizes)
    assert abs(pred - meas) <= 0.03 * meas, (pred, meas, sizes)
    # the fp32 softmax, 4 bytes per logit (B·S·V of them), is kept once
    logits = sizes["B"] * sizes["S"] * sizes["V"]
    assert 4 * logits <= saved < 5 * logits


def test_for_run_choices():
    """``megatron-*`` takes Megatron's loss and data-parallel engine; ``--loss model`` keeps the
    model's own; other precisions keep the model's loss unless ``--loss megatron``; a model
    without a vocabulary keeps its own; a bad name is one line."""
    spec = head_spec()
    assert for_run(spec, "megatron-bf16").extra["loss_choice"] == "megatron"
    assert for_run(spec, "megatron-bf16").extra["dp_engine"] == "megatron-ddp"
    assert for_run(spec, "megatron-bf16", loss="model").loss is spec.loss
    assert for_run(spec, "bf16-true").loss is spec.loss
    assert for_run(spec, "bf16-true", loss="megatron").loss is not spec.loss
    once = for_run(spec, "bf16-true", "cuda", loss="model")
    assert for_run(once, "megatron-bf16").loss is spec.loss  # (the first choice stays)
    assert once.extra["torch_device"] == "cuda"
    with pytest.raises(SymcostError, match="unknown --loss"):
        for_run(spec, "fp32", loss="mine")
    mlp = symcost.resolve("mlp")  # (no vocabulary: not a language model's loss)
    assert for_run(mlp, "megatron-bf16").loss is mlp.loss
    with pytest.raises(SymcostError, match="no symbol V"):
        for_run(mlp, "megatron-bf16", loss="megatron")


def test_megatron_ddp_uses_parameters_in_place():
    """Under ``megatron-bf16 --shard ddp`` the rank keeps what one device keeps, its peak
    included (no second copy of the weights: PyTorch's ``replicate`` all-gathers each one into a
    new buffer), and all-reduces every gradient once (ring: 2·(DP−1)/DP times the gradient
    bytes)."""
    sizes = {"B": 2, "S": 16, "H": 2, "D": 8, "L": 2, "V": 64}
    one = symcost.trace("megatron-gpt", sizes=sizes, precision="megatron-bf16", use_cache=False)
    dp = symcost.trace("megatron-gpt", sizes={**sizes, "DP": 4}, precision="megatron-bf16",
                       layout=Layout(shard="ddp"), use_cache=False)
    v = {**sizes, "DP": 4}
    m1 = memory.memory_model(one, "megatron-bf16", "adamw", "default", "cuda")
    md = memory.memory_model(dp, "megatron-bf16", "adamw", "default", "cuda")
    assert md.components(**v)["activations"] == m1.components(**sizes)["activations"]
    grads = 2 * one.subs(**sizes)["params"]
    ar = dp.comm_bytes("all_reduce")
    assert int(ar.xreplace({s: v[s.name] for s in ar.free_symbols})) == grads * 2 * 3 // 4
    # (nothing allocated for the reduction: the rank's peak is one device's, DDP sharding no state)
    assert md.peak(**v) == m1.peak(**sizes)
    # the report names the engine that ran (was PyTorch's replicate)
    from symcost.passes.parallel import summary

    assert summary(dp, "megatron-bf16", sizes=v)["engine"].startswith("Megatron-LM's DistributedDataParallel")


def test_interleaved_pipeline_ranks_under_megatron_ddp(capsys):
    """Every rank of an interleaved pipeline under ``--dp`` has its peak (ranks 1 to PP − 1 ran
    rank 0's actions and failed before), and with Megatron's DDP, which shards nothing and
    reduces in place, each rank's peak and activations are those of the same pipeline without
    data parallelism (the pipeline-only path, whose process is the rank itself).

    Three ranks (first, middle, last: every kind of rank; 6 blocks in 6 chunks, 3 micro-batches,
    a multiple of PP as the interleaved schedule needs) rather than four with a second middle rank:
    the two commands alone 30 CPU-s at PP = 4, 26.5 at PP = 3 (2026-12-06, loaded machine)."""
    import json

    from conftest import run_cli

    base = ["report", "megatron-gpt", "--pp", "3", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
            "--microbatches", "3", "--precision", "megatron-bf16", "--set", "H=2", "D=8", "L=6", "V=64", "B=1",
            "S=16", "--json"]
    rows = {}
    for extra in ((), ("--dp", "2", "--shard", "ddp")):
        code, out, err = run_cli(capsys, *base, *extra)
        assert code == 0, err
        rows[extra] = [(r.get("peak_with_optimizer"), r.get("memory", {}).get("top"), r.get("memory_note"))
                       for r in json.loads(out)["pipeline"]["ranks"]]
    assert all(p is not None and note is None for p, _, note in rows[()]), rows
    assert rows[("--dp", "2", "--shard", "ddp")] == rows[()]

"""How often the data-parallel engines reduce the gradients in one optimizer step of K micro-batches
(symcost.passes.accumulation.reductions_per_step), counted on the engines themselves on PyTorch's fake
process group: DDP with ``no_sync()`` over the first K-1 micro-batches (Megatron's
``forward_backward_no_pipelining`` runs them inside ``no_sync_func()`` the same way) reduces once,
FSDP2 in torchtitan's loop (``forward_backward_step`` per micro-batch, no
``set_requires_gradient_sync(False)``) every micro-batch."""
import random

import pytest
import torch

from symcost.passes.accumulation import accumulated, reductions_per_step


def _fake(world):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _model(width):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def _ddp_reductions(K, width, world):
    """DDP's bucket reductions in one optimizer step (its comm hook's calls)."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _fake(world)
    try:
        m = DDP(_model(width))
        calls = []

        def hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        m.register_comm_hook(None, hook)
        for i in range(K):
            ctx = m.no_sync() if i < K - 1 else contextlib.nullcontext()
            with ctx:
                m(torch.randn(2, width)).sum().backward()
        return len(calls)
    finally:
        dist.destroy_process_group()


def _fsdp_reductions(K, width, world):
    """FSDP2's gradient reduce-scatters in one optimizer step of torchtitan's loop (the calls of
    ``torch.distributed``'s reduce-scatter that FSDP2's ``foreach_reduce`` issues)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _fake(world)
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}
    calls = []

    def counting(name):
        def call(*a, **k):
            calls.append(name)
            return saved[name](*a, **k)
        return call

    try:
        mesh = init_device_mesh("cpu", (world,))
        m = _model(width)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        for n in names:
            setattr(dist, n, counting(n))
        for _ in range(K):
            m(torch.randn(2, width)).sum().backward()
        return len(calls)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        dist.destroy_process_group()


def test_reductions_per_step_are_the_engines():
    rng = random.Random(2913)
    for _ in range(2):
        K, width, world = rng.randint(2, 5), 8 * rng.randint(1, 4), rng.choice((2, 4))
        one = _ddp_reductions(1, width, world)
        assert one > 0 and _ddp_reductions(K, width, world) == one * reductions_per_step("ddp", K) == one
        one = _fsdp_reductions(1, width, world)
        assert one > 0 and _fsdp_reductions(K, width, world) == one * reductions_per_step("fsdp", K) == one * K
    assert reductions_per_step("zero1", 7) == 1 and reductions_per_step(None, 7) == 0


def test_accumulated_step_is_k_micro_batches_and_one_reduction():
    """The composition (docs/performance-model.md): a replicating engine pays the reduction and the
    optimizer once, under the last micro-batch's backward; FSDP2 its collectives every micro-batch."""
    step = {"compute": {"forward": 1.0, "backward": 2.5}, "comm": {"forward": 0.0, "backward": 3.0},
            "exposed": {"forward": 0.25, "backward": 0.25}}
    opt = 0.5
    last = 1.0 + max(2.5, 3.0) + 0.5
    assert accumulated(step, 4, "ddp", "backward", opt)["step_seconds"] == pytest.approx(3 * (1.0 + 2.0 + 0.5) + last)
    assert accumulated(step, 4, "fsdp", "backward", opt)["step_seconds"] == pytest.approx(3 * (1.0 + 3.0 + 0.5) + last)
    assert accumulated(step, 1, "ddp", "none", opt)["step_seconds"] == pytest.approx(1.0 + 2.5 + 3.0 + 0.5)
    with pytest.raises(Exception, match="positive integer"):
        accumulated(step, 0, "ddp", "none")


def test_report_accumulate_refusals():
    """--accumulate prices a parallel layout's optimizer step on a GPU: without --gpu, or with --pp
    (whose --microbatches compose the step), one line before any trace."""
    from click.testing import CliRunner

    from symcost.cli import main

    for extra in ([], ["--pp", "2", "--gpu", "h100-sxm"]):
        r = CliRunner().invoke(main, ["report", "mlp", "--dp", "2", "--accumulate", "2", *extra])
        assert r.exit_code == 2 and "--accumulate K" in r.output, r.output

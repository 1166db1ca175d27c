"""Activation offload to host (issue 27 item 2; ``--offload-activations``,
``Layout(offload_activations=True)``; docs/memory.md "Activation offload"): every tensor autograd
saves is packed to pinned host memory in the forward and copied back when the backward unpacks
it, as ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward does.

Oracles, independent of symcost's recorder, rules and fit:

* host bytes: PyTorch's own ``save_on_cpu(pin_memory=True)`` on real CPU tensors (megatron-gpt in
  bf16, random sizes), its ``pack_hook`` and ``unpack_hook`` wrapped to add up the bytes of what
  they return (on a CPU-only build ``pack_to_cpu`` still makes its ``torch.empty`` + ``copy_``
  copy: pinning is skipped, the copy is not);
* device peak: PyTorch's ``MemTracker`` over a steady-state step (forward, backward, AdamW step)
  on fake tensors, with the pack hook placing each packed tensor on the ``meta`` device (a device
  the tracker counts apart: the host) and the unpack hook allocating the device copy that
  ``tensor.to(device)`` makes on an accelerator.
"""
from __future__ import annotations

import functools
import random

import pytest

import symcost

PRECISION = "bf16-true"


@functools.lru_cache(maxsize=None)
def _trace():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("megatron-gpt"), layout=Layout(offload_activations=True),
                         sizes={"S": 64, "H": 16, "D": 8, "V": 128}, precision=PRECISION, torch_device="cpu")


def _draw(rng) -> dict:
    return {"B": rng.randint(1, 4), "S": rng.randint(8, 48), "H": 2 * rng.randint(1, 4), "D": 4 * rng.randint(1, 3),
            "L": rng.randint(2, 4), "V": 8 * rng.randint(2, 8)}


def _packed_bytes(spec, v: dict) -> dict:
    """``{"d2h", "h2d"}``: bytes ``save_on_cpu(pin_memory=True)``'s pack hook returned in the
    forward and its unpack hook returned in the backward, on a real bf16 step at ``v``."""
    import torch

    torch.manual_seed(0)
    model = spec.build(v).to(torch.bfloat16)
    args, kwargs = spec.make_inputs(v, torch.device("cpu"))
    got = {"d2h": 0, "h2d": 0}
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def counted_pack(t):
        out = pack(t)
        got["d2h"] += out[1].numel() * out[1].element_size()
        return out

    def counted_unpack(p):
        out = unpack(p)
        got["h2d"] += out.numel() * out.element_size()
        return out

    hooks.pack_hook, hooks.unpack_hook = counted_pack, counted_unpack
    with hooks:
        loss = spec.loss(model(*args, **kwargs), (args, kwargs))
    loss.backward()
    return got


def test_host_bytes_equal_save_on_cpu():
    """At random sizes the host bytes (every save's numel × element size, parameters and
    repeated saves included) and the bytes copied back in the backward equal what PyTorch's
    ``save_on_cpu(pin_memory=True)`` packs and unpacks on the real step; the device's schedule
    holds none of the packed tensors (its peak is below the trace without offload)."""
    from symcost.frontends.models import resolve
    from symcost.passes.offload import activation_bytes, activation_summary

    an = _trace()
    assert not an.pinned
    spec = resolve("megatron-gpt")
    rng = random.Random(2730)
    for _ in range(3):
        v = _draw(rng)
        got = _packed_bytes(spec, v)
        env = an.bind(**v)
        assert int(activation_bytes(an, "d2h", "forward").xreplace(env)) == got["d2h"], v
        assert int(activation_bytes(an, "h2d", "backward").xreplace(env)) == got["h2d"], v
        assert activation_bytes(an, "d2h", "backward") == 0 and activation_bytes(an, "h2d", "forward") == 0
        summ = activation_summary(an, v)
        assert summ["values"]["host"]["total"] == got["d2h"]
        # more than the activations (shared/conventions.md: storages, parameters excluded): the
        # parameters autograd saves are packed too
        assert got["d2h"] > int(sum(rep * nb for _, nb, _, rep in an.saved).xreplace(env))


def _fake_peak(spec, v: dict) -> int:
    """MemTracker's peak on the step's device (module docstring) with activation offload."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def pack(t):  # pack_to_cpu: a new tensor of the saved one's size, on the host (here: meta)
        return t.device, torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="meta")

    def unpack(packed):  # unpack_from_cpu: ``tensor.to(device)``, a new device tensor
        device, t = packed
        return torch.empty(t.size(), dtype=t.dtype, device=device)

    with torch.device("meta"):
        model = spec.build(v).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=False)

        def step():
            args, kwargs = spec.make_inputs(v, torch.device("cpu"))
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = spec.loss(model(*args, **kwargs), (args, kwargs))
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            step()
        return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_device_peak_against_memtracker():
    """At random sizes the device peak of the step under activation offload (bf16, AdamW
    for-loop) equals, to the byte, PyTorch's ``MemTracker`` on the step with save_on_cpu's hooks
    (module docstring)."""
    from symcost.frontends.models import resolve
    from symcost.passes.memory import memory_model

    an = _trace()
    mm = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu")
    spec = resolve("megatron-gpt")
    rng = random.Random(2731)
    for _ in range(3):
        v = _draw(rng)
        want = _fake_peak(spec, v)
        got = mm.peak(**v)
        assert got == want, (v, got, want, mm.peak_where(**v))


@pytest.mark.heavy
def test_offload_activations_under_the_layouts():
    """``--offload-activations`` composes with every layout: under ``--dp 2 --shard fsdp`` and
    ``--tp 2 --sp`` the rank's report carries the host bytes and its device peak is below the same
    layout's without offload; under ``--pp 2`` each rank's step copies to the host, per step, m
    times its stages' packed bytes of one micro-batch (the stage traces' formulas; the schedule
    run counts them), and holds at most that on the host."""
    import json

    from click.testing import CliRunner

    from symcost.cli import main
    from symcost.passes.offload import activation_bytes
    from symcost.passes.pipeline import trace_stages

    sets = ["--set", "B=2", "S=16", "D=32", "L=2"]
    for layout in (["--dp", "2", "--shard", "fsdp"], ["--tp", "2", "--sp"]):
        model = "mlp" if layout[0] == "--dp" else "megatron-gpt"
        s = sets if model == "mlp" else ["--set", "B=4", "S=64", "H=4", "D=8", "L=2", "V=64"]
        runs = {}
        for off in (False, True):
            r = CliRunner().invoke(main, ["report", model, *layout, *s, "--json"] + (["--offload-activations"] if off else []))
            assert r.exit_code == 0, r.output
            runs[off] = json.loads(r.output)
        act = runs[True]["offload_activations"]
        assert act["host"]["total"] == act["d2h"]["forward"] == act["h2d"]["backward"] > 0, (layout, act)
        assert runs[True]["parallel"]["memory"]["peak"] < runs[False]["parallel"]["memory"]["peak"], layout
    m = 4
    r = CliRunner().invoke(main, ["report", "mlp", "--pp", "2", "--microbatches", str(m), "--offload-activations",
                                  *sets, "--json"])
    assert r.exit_code == 0, r.output
    js = json.loads(r.output)
    from symcost.frontends.layout import Layout

    _, ans = trace_stages("mlp", 2, 1, "bf16-mixed", {"B": 2, "S": 16, "D": 32, "L": 2},
                          inner=Layout(offload_activations=True))
    for row, part in zip(js["pipeline"]["ranks"], ("first", "last")):
        an = ans[part]
        per_mb = int(activation_bytes(an, "d2h", "forward").xreplace(an.bind(B=2, S=16, D=32, L=1)))
        a = row["activation_offload"]
        assert a["d2h"] == m * per_mb and 0 < a["host"] <= a["d2h"], (row["rank"], a, per_mb)


def test_max_batch_at_the_boundary_against_memtracker():
    """``max-batch --offload-activations`` solves the device's peak: with the cap halfway between
    MemTracker's peaks of the step with save_on_cpu's hooks at B0 and B0 + 1 (random other sizes),
    the largest B is B0."""
    from symcost.frontends.models import resolve
    from symcost.passes.memory import memory_model

    an = _trace()
    mm = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu")
    rng = random.Random(2732)
    v = {k: x for k, x in _draw(rng).items() if k != "B"}
    b0 = rng.randint(3, 9)
    spec = resolve("megatron-gpt")
    lo, hi = _fake_peak(spec, dict(v, B=b0)), _fake_peak(spec, dict(v, B=b0 + 1))
    assert lo < hi
    sol = mm.solve((lo + hi) // 2, "B", **v)
    assert sol.value == b0, (v, b0, lo, hi, sol)


def test_max_batch_prints_the_host_bytes_at_its_answer():
    """``max-batch --offload-activations --json``: ``activation_offload_host`` at the largest B
    == the bytes PyTorch's ``save_on_cpu(pin_memory=True)`` packs on the real step at that B."""
    import json

    from click.testing import CliRunner

    from symcost.cli import main
    from symcost.frontends.models import resolve
    from symcost.passes.memory import memory_model

    an = _trace()
    v = {"S": 64, "H": 16, "D": 8, "V": 128, "L": 2}
    b0 = random.Random(2733).randint(2, 5)
    cap = int(memory_model(an, PRECISION, "adamw", impl="foreach", device="cpu").peak(**v, B=b0)) + 1
    r = CliRunner().invoke(main, ["max-batch", "megatron-gpt", "--offload-activations", "--precision", PRECISION,
                                  "--torch-device", "cpu", "--set", *[f"{k}={x}" for k, x in v.items()],
                                  "--memory", str(cap), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["max_batch"] >= b0
    assert out["activation_offload_host"] == _packed_bytes(resolve("megatron-gpt"), dict(v, B=out["max_batch"]))["d2h"]

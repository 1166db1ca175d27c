"""``symcost checkpoint`` on a model of several stacks of blocks (issue 30 item 6): the plan per
stack (symcost/passes/checkpoint/stacks.py, docs/checkpoint.md "Several stacks").

The oracle is PyTorch's real step (CPU, real fp32 tensors) with exactly the blocks the plan chooses
wrapped in PyTorch's own ``checkpoint_wrapper`` (non-reentrant, ``preserve_rng_state=False``, as
``--ac full`` wraps every block): its peak by torch.profiler's memory timeline
(tests/memory_oracle.py ``step_peak``) and its FLOPs by FlopCounterMode (the recomputation
included: the guide's encdec.py runs explicit matmuls, so model and hardware FLOPs agree)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
import torch

from test_own_symbols import examples  # noqa: F401 - the fixture
from test_own_symbols import _spec as _factory
from conftest import run_cli

STACKS = ("encoder", "decoder")
#: the sizes tests/test_own_symbols.py traces the guide's encoder-decoder at (one trace-cache entry)
TRACE = {"B": 2, "S": 6, "S_enc": 9, "H": 3, "D": 4, "V": 37, "F": 12, "L_enc": 2, "L_dec": 3}


def _wrapped(spec, blocks: dict):
    """``spec`` whose model has the blocks ``blocks`` (container -> indices) each in PyTorch's
    ``checkpoint_wrapper`` (what a user checkpointing a subset of each stack writes)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    def build(values):
        model = spec.build(values)
        for c, idx in blocks.items():
            held = model.get_submodule(c)
            for name, block in list(held.named_children()):
                if int(name) in idx:
                    held.register_module(name, checkpoint_wrapper(
                        block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False))
        return model

    return dataclasses.replace(spec, build=build)


def _flops(spec, values: dict) -> int:
    """FlopCounterMode's FLOPs of one real fp32 training step (forward, loss, backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    from memory_oracle import build

    model, args, kwargs, _ = build(spec, values, "fp32")
    with FlopCounterMode(display=False) as fc:
        spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
    return fc.get_total_flops()


def _plan(capsys, path, v: dict, *extra) -> dict:
    code, out, err = run_cli(capsys, "checkpoint", f"{path}:spec", "--set", *(f"{k}={x}" for k, x in v.items()),
                             "--precision", "fp32", "--torch-device", "cpu", "--optimizer-impl", "foreach",
                             "--json", *extra)
    assert code == 0, err
    return json.loads(out)["checkpoint"]


@pytest.mark.heavy
def test_encdec_plan_per_stack_against_pytorch(examples, capsys):  # noqa: F811 - the fixture
    """The guide's encdec.py (L_enc, L_dec): ``symcost checkpoint`` plans each stack (was: refused).
    At random sizes and depths never traced, the plan's predicted peak is within 0.5% of the
    profiler's peak of PyTorch running exactly the chosen blocks in ``checkpoint_wrapper``, and its
    train FLOPs equal FlopCounterMode's; the least-peak plan measures no higher than checkpointing
    no block or every block; under a cap at every block's measured peak the plan fits and reruns
    no more than every block does; the search equals the best of every subset of blocks."""
    from memory_oracle import step_peak

    path = examples["encdec.py"]
    spec = _factory(path, "spec")
    _plan(capsys, path, TRACE)  # (traces the plain and the every-block step once; the depths below are served)
    rng = random.Random("checkpoint per stack")
    # (activations well above the parameters and optimizer state: the plans' peaks differ)
    v = {"B": rng.randint(3, 4), "S": rng.randint(12, 16), "S_enc": rng.randint(12, 16), "H": 2,
         "D": 4, "V": rng.randint(20, 30), "F": rng.randint(8, 12),
         "L_enc": rng.randint(3, 4), "L_dec": rng.randint(3, 4)}
    full = {**spec.defaults, **v}
    best = _plan(capsys, path, v)
    assert set(best["stacks"]) == set(STACKS) and best["stacks"]["encoder"]["symbol"] == "L_enc"
    assert best["composition_gap"] == 0  # (the composed no-block and every-block steps are the traced ones)
    measured = {}
    for name, blocks in (("optimal", best["blocks"]), ("none", {c: [] for c in STACKS}),
                         ("every", {"encoder": list(range(v["L_enc"])), "decoder": list(range(v["L_dec"]))})):
        measured[name] = step_peak(_wrapped(spec, blocks), v, "fp32")["peak"]
    assert abs(best["peak"] / measured["optimal"] - 1) < 0.005, (best["peak"], measured, v)
    assert abs(best["peak_none"] / measured["none"] - 1) < 0.005, (best["peak_none"], measured)
    assert abs(best["peak_every_layer"] / measured["every"] - 1) < 0.005, (best["peak_every_layer"], measured)
    assert measured["optimal"] <= min(measured["none"], measured["every"]) and measured["every"] < measured["none"]
    assert best["train_flops"] == _flops(_wrapped(spec, best["blocks"]), full), v
    # under a cap: the least recompute that fits (here: every block's measured peak)
    capped = _plan(capsys, path, v, "--memory", str(max(measured["every"], 2**20)))
    every_rec = capped["tradeoff"][-1]["recompute_flops"]
    assert capped["peak"] <= max(measured["every"], 2**20) and capped["recompute_flops"] <= every_rec
    # a mixed plan (some blocks of each stack, not the first ones), measured
    mixed = {"encoder": sorted(rng.sample(range(v["L_enc"]), 2)), "decoder": sorted(rng.sample(range(v["L_dec"]), 2))}
    from symcost.passes.checkpoint.stacks import search, stack_costs, stack_schedule

    an = __import__("symcost").trace(f"{path}:spec", sizes=TRACE, precision="fp32", torch_device="cpu")
    from symcost.commands import checkpoint as cmd  # (the every-block step, from the trace cache)

    ck = _every_block(cmd, path)
    env = an.bind(**v)
    sched = stack_schedule(an, ck, env)
    got = sched.simulate(mixed)[0]
    want = step_peak(_wrapped(spec, mixed), v, "fp32")["peak"]
    assert abs(got / want - 1) < 0.005, (mixed, got, want)
    # the search against every subset of every stack's blocks (the composed step of each)
    costs = stack_costs(an, ck)
    roles = {c: set(r) - {"generic"} for c, r in costs.items()}
    from symcost.passes.checkpoint.stacks import _recompute

    subsets = {c: [s for k in range(n + 1) for s in itertools.combinations(range(n), k)]
               for c, n in sched.lengths.items()}
    rows = []
    for combo in itertools.product(*subsets.values()):
        plan = dict(zip(subsets, combo))
        rows.append((sched.simulate(plan)[0], _recompute(costs, plan, sched.lengths, env)))
    assert search(sched, costs, env, roles)[1:] == min(rows)
    cap = sorted(p for p, _ in rows)[len(rows) // 2]
    assert search(sched, costs, env, roles, cap)[2] == min(r for p, r in rows if p <= cap)
    _max_batch_per_stack(capsys, path, spec, an, ck, v, rng)


def _max_batch_per_stack(capsys, path, spec, an, ck, v: dict, rng) -> None:
    """``max-batch --checkpoint optimal`` on the guide's encdec.py (was refused: "this planner plans
    one chain of L blocks"): the largest B whose step, with the least-peak plan per stack at that B,
    fits the cap. The cap is put halfway between symcost's peaks at a random B and B + 1 (far from
    either, beside the profiler's ~100-byte offset); the answer is that B, the profiler's peak of
    PyTorch's step with exactly the answer's plan in ``checkpoint_wrapper`` fits the cap, and with
    the plan chosen at B + 1 it does not. A gradient-accumulation micro-step of the plan (what
    ``--global-batch`` plans with) within 0.5% of the profiler's (memory_oracle.accumulation_peak);
    ``--checkpoint sqrt`` (segments of several blocks) refused in one line."""
    from memory_oracle import accumulation_peak, step_peak
    from symcost.passes.checkpoint import plan_memory

    rest = {k: x for k, x in v.items() if k != "B"}
    mm, _ = plan_memory(an, "optimal", rest, "adamw", "foreach", "cpu", ck=ck)
    target = rng.randint(80, 100)  # (peaks above the 1 MiB a cap takes)
    lo, hi = mm.peak(B=target, **rest), mm.peak(B=target + 1, **rest)
    assert 2**20 < lo < hi, (lo, hi)
    cap = (lo + hi) // 2
    code, out, err = run_cli(capsys, "max-batch", f"{path}:spec", "--memory", str(cap), "--checkpoint", "optimal",
                             "--set", *(f"{k}={x}" for k, x in rest.items()), "--precision", "fp32",
                             "--torch-device", "cpu", "--optimizer-impl", "foreach", "--json")
    assert code == 0, err
    js = json.loads(out)
    assert js["max"] == target and js["check"] and js["memory_at_next"] > cap, js
    plan, nxt = mm.plan(B=target, **rest), mm.plan(B=target + 1, **rest)
    assert js["checkpoint"]["blocks"] == plan.blocks and js["checkpoint"]["several_stacks"], js["checkpoint"]
    fits = step_peak(_wrapped(spec, plan.blocks), {**rest, "B": target}, "fp32")["peak"]
    over = step_peak(_wrapped(spec, nxt.blocks), {**rest, "B": target + 1}, "fp32")["peak"]
    assert fits <= cap < over, (fits, cap, over, plan.blocks, nxt.blocks)
    from test_cli import assert_one_line_error

    assert_one_line_error(*run_cli(capsys, "max-batch", f"{path}:spec", "--checkpoint", "sqrt", "--set",
                                   *(f"{k}={x}" for k, x in rest.items()), "--precision", "fp32", "--torch-device",
                                   "cpu"), "not planned on a model of several stacks")
    b = rng.randint(3, 6)
    acc = mm.at(True, B=b, **rest)[0]  # (the plan of an accumulation micro-step)
    got = mm.peak(True, B=b, **rest)
    want = accumulation_peak(_wrapped(spec, acc.blocks), {**rest, "B": b}, "fp32")["peak"]
    assert abs(got / want - 1) < 0.005, (acc.blocks, got, want)


def _every_block(cmd, path):
    """The step with every block of both stacks checkpointed, as ``symcost checkpoint`` reads it."""
    import click

    with click.Context(click.Command("checkpoint"), obj=None) as ctx:
        ctx.params["device"] = "cpu"
        return cmd._stack_every_layer(f"{path}:spec", (), None, "fp32", dict(TRACE), True)


def test_stack_plan_apply_checkpoints_the_chosen_blocks(examples):  # noqa: F811 - the fixture
    """``StackPlan.apply`` wraps exactly the plan's blocks (each a checkpoint of its own): the
    FLOPs of a real step grow by the forward of those blocks only (FlopCounterMode), the outputs
    and gradients are unchanged, and the module names stay the model's."""
    from symcost.passes.checkpoint.stacks import StackPlan

    spec = _factory(examples["encdec.py"], "spec")
    v = {**spec.defaults, "B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "V": 23, "F": 10, "L_enc": 3, "L_dec": 2}
    plan = StackPlan({"encoder": [1], "decoder": [0, 1]}, {"encoder": 3, "decoder": 2})
    assert plan.modules() == ["encoder.1", "decoder.0", "decoder.1"]
    torch.manual_seed(0)
    ref = spec.build(v)
    mine = spec.build(v)
    mine.load_state_dict(ref.state_dict())
    plan.apply(mine)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in ref.named_parameters()]
    args, kwargs = spec.make_inputs(v, torch.device("cpu"))
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    for m in (ref, mine):
        with FlopCounterMode(display=False) as fc:
            loss = spec.loss(m(*args, **kwargs), (args, kwargs))
            loss.backward()
        counts.append((fc.get_total_flops(), loss.item(), [p.grad.clone() for p in m.parameters()]))
    with torch.no_grad():  # the inputs of the chosen blocks
        x = ref.embed(args[0])
        enc = [x := b(x) for b in ref.encoder]
        y, mem = ref.embed(args[1]), enc[-1]
    with FlopCounterMode(display=False) as fe:
        ref.encoder[1](enc[0])
    with FlopCounterMode(display=False) as fd:
        out0 = ref.decoder[0]((y, mem))
        ref.decoder[1](out0)
    rerun = fe.get_total_flops() + fd.get_total_flops()
    assert counts[0][0] < counts[1][0] <= counts[0][0] + rerun, (counts[0][0], counts[1][0], rerun)
    assert counts[0][1] == pytest.approx(counts[1][1], rel=1e-6)
    for g, h in zip(counts[0][2], counts[1][2]):
        torch.testing.assert_close(g, h)


@pytest.mark.heavy
def test_encdec_max_batch_over_b_and_own_sizes(examples, capsys):  # noqa: F811 - the fixture
    """``symcost max-batch`` on the guide's encdec.py (two stacks, L_enc and L_dec) answers for B
    and for the model's own sizes (S_enc, L_enc): the answer's peak fits the cap and the next
    value's does not, by torch.profiler's peak of PyTorch's real step (within its 0.1 % offset:
    the cap is put halfway between symcost's two peaks, far from either)."""
    from memory_oracle import step_peak

    path = examples["encdec.py"]
    spec = _factory(path, "spec")
    rng = random.Random("max-batch stacks")
    # (peaks above the 1 MiB a cap takes)
    base = {"B": 8, "S": rng.randint(28, 36), "S_enc": rng.randint(28, 36), "H": 4, "D": 8, "V": rng.randint(40, 64),
            "F": rng.randint(48, 64), "L_enc": rng.randint(3, 4), "L_dec": rng.randint(3, 4)}
    an = __import__("symcost").trace(f"{path}:spec", sizes=TRACE, precision="fp32", torch_device="cpu")
    from symcost.passes.memory import memory_model

    mm = memory_model(an, "fp32", "adamw", "foreach")
    for var, target in (("B", rng.randint(8, 10)), ("S_enc", rng.randint(36, 44)), ("L_enc", rng.randint(4, 6))):
        at = {**base, var: target}
        lo, hi = mm.peak(**at), mm.peak(**{**at, var: target + 1})
        assert hi > lo, (var, lo, hi)
        cap = (lo + hi) // 2
        others = [f"{k}={x}" for k, x in base.items() if k != var]
        code, out, err = run_cli(capsys, "max-batch", f"{path}:spec", "--memory", str(cap), "--solve", var, "--set",
                                 *others, "--precision", "fp32", "--torch-device", "cpu", "--optimizer-impl", "foreach",
                                 "--json")
        assert code == 0, err
        got = json.loads(out)["max"]
        assert got == target, (var, got, target)
        fits = step_peak(spec, {**base, var: got}, "fp32")["peak"]
        over = step_peak(spec, {**base, var: got + 1}, "fp32")["peak"]
        assert fits <= cap < over, (var, fits, cap, over)


@pytest.mark.heavy
def test_t5_plan_per_stack_against_pytorch():
    """hf:t5 (eager attention, fp32, tiny widths pinned as in tests/test_checkpoint_stacks.py):
    the plan per stack composes for every subset of blocks of both stacks (was refused: "the
    composed step of the plan {'encoder.block': (), 'decoder.block': (1,)} leaves ... bytes,
    another plan ...": the position bias block 0 computes, which the checkpoints of the later
    blocks keep as their input, and the cross-attention's zero bias, which every plain block's
    attention saves, were freed twice or never). At random B, S, S_enc and L never traced: the
    chosen plan, no block, every block and a random subset of each stack within 0.5% of the
    profiler's peak of PyTorch's step with exactly those blocks in ``checkpoint_wrapper``, the
    subset's train FLOPs equal to FlopCounterMode's, the search equal to the best subset."""
    import symcost
    from memory_oracle import step_peak
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.passes.checkpoint.stacks import _recompute, analyse_stacks, search, stack_costs, stack_schedule

    widths = {"H": 2, "D": 4, "M": 12, "F": 10, "V": 37}
    spec = resolve("hf:t5", attention="eager")
    pinned = dataclasses.replace(spec, pin={k: "the test's fixed width" for k in widths})
    sizes = {"B": 2, "S": 5, "S_enc": 7, "L": 2, **widths}
    an = symcost.trace(pinned, precision="fp32", torch_device="cpu", sizes=sizes)
    ck = symcost.trace(pinned, layout=Layout(ac="full"), precision="fp32", torch_device="cpu", sizes=sizes)
    rng = random.Random("t5 plan per stack")
    v = {"B": rng.randint(3, 4), "S": rng.randint(12, 16), "S_enc": rng.randint(12, 16), "L": rng.randint(3, 4)}
    best = analyse_stacks(an, ck, v)
    assert best["composition_gap"] == 0 and set(best["blocks"]) == {"encoder.block", "decoder.block"}, best
    env = an.bind(**v)
    sched, costs = stack_schedule(an, ck, env), stack_costs(an, ck)
    n = v["L"]
    subsets = [s for k in range(n + 1) for s in itertools.combinations(range(n), k)]
    rows = [(sched.simulate({"encoder.block": e, "decoder.block": d})[0],
             _recompute(costs, {"encoder.block": e, "decoder.block": d}, sched.lengths, env))
            for e in subsets for d in subsets]  # (each composes: the step leaves the same bytes)
    roles = {c: set(r) - {"generic"} for c, r in costs.items()}
    assert search(sched, costs, env, roles)[1:] == min(rows) == (best["peak"], best["recompute_flops"])
    mixed = {c: sorted(rng.sample(range(n), rng.randint(1, n - 1))) for c in ("encoder.block", "decoder.block")}
    for blocks in (best["blocks"], {c: [] for c in mixed}, {c: list(range(n)) for c in mixed}, mixed):
        got = sched.simulate(blocks)[0]
        want = step_peak(_wrapped(spec, blocks), {**v, **widths}, "fp32")["peak"]
        assert abs(got / want - 1) < 0.005, (blocks, got, want, v)
    train = int(an.flops("train").xreplace(env)) + _recompute(costs, mixed, sched.lengths, env)
    assert train == _flops(_wrapped(spec, mixed), {**spec.defaults, **v, **widths}), (mixed, v)


@pytest.mark.heavy
def test_encdec_bf16_no_block_composes_to_the_plain_step(examples):  # noqa: F811 - the fixture
    """The guide's encdec.py in bf16-mixed: the composition of no block checkpointed equals the
    plain step's own folded peak at stack lengths never traced, and that is within 0.5 % of the
    profiler's level at the ends of aten ops of PyTorch's step (was up to 832 bytes over where the
    loss holds the peak: a free before the forward's last allocation was taken for a block's
    autocast cast freed at the forward's end). (Every block's composition stays 1-2 % over at some
    lengths: the fold's running sum of the encoder output's gradient, docs/checkpoint.md.)"""
    import symcost
    from memory_oracle import step_peak
    from symcost.frontends.layout import Layout
    from symcost.passes.checkpoint.stacks import stack_schedule
    from symcost.passes.memory import memory_model

    path = examples["encdec.py"]
    spec = _factory(path, "spec")
    P = "bf16-mixed"
    an = symcost.trace(f"{path}:spec", sizes=TRACE, precision=P, torch_device="cpu")
    ck = symcost.trace(f"{path}:spec", sizes=TRACE, precision=P, torch_device="cpu", layout=Layout(ac="full"))
    mP = memory_model(an, P, "adamw", "foreach")
    rng = random.Random("encdec bf16 composition")
    for L_enc, L_dec in ((rng.randint(2, 3), rng.randint(5, 7)), (rng.randint(4, 5), 2)):
        v = {"B": 2, "S": rng.randint(12, 16), "S_enc": rng.randint(12, 16), "H": 2, "D": 4,
             "V": rng.randint(20, 30), "F": rng.randint(8, 12), "L_enc": L_enc, "L_dec": L_dec}
        sched = stack_schedule(an, ck, an.bind(**v), "adamw", "foreach")
        assert sched.simulate({c: () for c in sched.lengths})[0] == mP.peak(**v), v
        want = step_peak(spec, v, P)["peak_ops"]
        assert abs(mP.peak(**v) / want - 1) < 0.005, (v, mP.peak(**v), want)

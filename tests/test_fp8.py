"""FP8 training as torchao's float8 recipes run it (``--fp8``, ``Layout(fp8=...)``; issue 27).

Oracles, independent of symcost's recorder and rules: the real torchao-converted model
(``convert_to_float8_training`` with torchtitan's ``module_filter_fn`` and its ``filter_fqns =
["output"]``, written here from torchtitan/components/quantization/{float8,utils}.py) run by PyTorch
for one training step: ``FlopCounterMode`` (model FLOPs: it counts the ``mm`` of torchao's float8
tensors, 2·M·N·K, the formula of its ``_scaled_mm`` entry too), a ``saved_tensors_hooks`` pair
(bytes autograd saves, parameters excluded, storages once), the parameters and gradients
PyTorch holds, and under FSDP2 (fake process group) every collective PyTorch dispatches with
nccl-tests' ring factors (all-gather (n-1)/n·size, all-reduce 2(n-1)/n·size) and the rank's
DTensor shards. Sizes are drawn at random (seeded) in the trace's regime (linear features
multiples of 16).
"""
from __future__ import annotations

import functools
import random
from fractions import Fraction

import pytest
import sympy

pytest.importorskip("torchao.float8", reason="FP8 training needs torchao (pip install 'symcost[fp8]')")

import symcost  # noqa: E402
from symcost.errors import SymcostError  # noqa: E402
from symcost.frontends.layout import Layout  # noqa: E402
from symcost.tracing.fit import SYMS  # noqa: E402

#: the request each trace is fitted at (D a multiple of 16: every linear of the blocks converts)
REQUEST = {"B": 2, "S": 16, "H": 2, "D": 16, "L": 2, "V": 64}


@functools.lru_cache(maxsize=None)
def _trace(recipe: str, precision: str, shard: str | None = None, all_gather: bool = False):
    sizes = dict(REQUEST, **({"DP": 2} if shard else {}))
    # (the CPU's kernels, as the oracle runs them: its dropout)
    return symcost.trace("megatron-gpt", sizes=sizes, precision=precision, torch_device="cpu",
                         layout=Layout(shard=shard, fp8=recipe, fp8_all_gather=all_gather))


def _torchtitan_filter(module, fqn: str) -> bool:
    """torchtitan's ``module_filter_fn(config, fqn, filter_fqns=["output"])``: both feature counts
    multiples of 16 and no filtered name in the fqn."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0 and "output" not in fqn


def _convert(model, recipe: str, all_gather: bool = False):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather) if recipe == "tensorwise"
              else Float8LinearConfig.from_recipe_name(recipe))
    convert_to_float8_training(model, config=config, module_filter_fn=_torchtitan_filter)
    # every linear of the blocks (4 per megatron-gpt block), the head not
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 4 * len(model.layers)


def _size(t):
    return t.numel() * t.element_size()


def _step(spec, values: dict, model, dtype, fake: bool, collectives=None) -> dict:
    """One training step of ``model`` (built at ``values``): FLOPs, saved bytes, parameter and
    gradient bytes (and the rank's shards: DTensor local tensors)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.flop_counter import FlopCounterMode

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731

    def storage(t):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        return StorageWeakRef((t._data if isinstance(t, Float8TrainingTensor) else t).untyped_storage()).cdata
    seen, saved = set(), [0]

    def pack(t):
        if isinstance(t, torch.nn.Parameter):
            return t
        key = storage(t)
        # a view of a parameter (the transposed weight torchao saves; under the fp8 all-gather the
        # unsharded parameter is a Float8TrainingTensor, whose data is its storage) is a
        # parameter, not an activation (shared/conventions.md)
        if storage(t) in {storage(getattr(p, "_local_tensor", p)) for p in model.parameters()}:
            return t
        if key not in seen:
            seen.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if fake:
            model.to_empty(device="cpu")
        args, kwargs = spec.make_inputs(values, torch.device("cpu"))
        args = [a.to(dtype) if a.is_floating_point() else a for a in args]
        fc = FlopCounterMode(display=False)
        with fc, collectives or contextlib.nullcontext(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
            loss.backward()
        out = {"flops": fc.get_total_flops(), "saved": saved[0],
               "params": sum(_size(local(p)) for p in model.parameters()),
               "grads": sum(_size(local(p.grad)) for p in model.parameters())}
    return out


def _meta_model():
    """megatron-gpt at two blocks on the meta device (its module names)."""
    import torch

    from symcost.frontends.models import resolve

    with torch.device("meta"):
        return resolve("megatron-gpt").build(dict(REQUEST))


def _draw(rng: random.Random, dp: int | None = None) -> dict:
    v = {"B": rng.randint(2, 5), "S": rng.randint(3, 24), "H": rng.randint(1, 3), "D": 16 * rng.randint(1, 3),
         "L": rng.randint(2, 4), "V": rng.randint(20, 90)}
    if dp:
        v.update(DP=dp, V=dp * rng.randint(10, 40))
    return v


def _env(an, v):
    return {SYMS[k]: x for k, x in v.items() if k in an.symbols}


@pytest.mark.heavy
@pytest.mark.parametrize("recipe,precision", [("tensorwise", "fp32"), ("rowwise", "bf16-true")])
def test_one_device_matches_torchao(recipe, precision):
    """FLOPs, saved bytes, parameter and gradient bytes of the real torchao-converted model on
    CPU real tensors, at random sizes; the fp8 matmuls are aten._scaled_mm on fp8 operands."""
    import torch

    from symcost.frontends.models import resolve

    an = _trace(recipe, precision)
    assert not an.pinned, an.pin_reasons
    scaled = [op for op in an.ops if "_scaled_mm" in op.name]
    assert scaled and all(str(d).startswith("torch.float8") for op in scaled for d in op.in_dtypes[:2])
    # 6·N·P: the weights cast to fp8 are matmul operands (P), as every linear's weight of the model
    linears = {f"{n}.weight" for n, m in _meta_model().named_modules() if type(m).__name__ == "Linear"}
    assert {n.replace("{i}", "0") for n in an.matmul_params} == {n for n in linears if ".1." not in n}
    spec = resolve("megatron-gpt")
    dtype = getattr(torch, "float32" if precision == "fp32" else "bfloat16")
    rng = random.Random(27 + len(recipe))
    for _ in range(2):
        v = _draw(rng)
        torch.manual_seed(0)
        model = spec.build(v).to(dtype)
        _convert(model, recipe)
        got = _step(spec, v, model, dtype, fake=False)
        env = _env(an, v)
        assert int(an.flops("train").subs(env)) == got["flops"], (v, "FLOPs")
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], (v, "saved bytes")
        itemsize = torch.tensor([], dtype=dtype).element_size()
        assert int(an.params.subs(env)) * itemsize == got["params"] == got["grads"], (v, "params")


@pytest.mark.heavy
def test_fsdp_fp8_all_gather_matches_torchao():
    """One FSDP2 rank with torchao's fp8 all-gather (tensorwise) on the fake process group:
    FLOPs, saved bytes, all-gather bytes (1 byte per weight element of the converted linears),
    the amax all-reduces, and the rank's parameter and gradient shards."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from symcost.frontends.models import resolve
    from symcost.frontends.parallel import fake_group, wrap
    from symcost.passes.parallel import summary

    an = _trace("tensorwise", "fp32", "fsdp", True)
    assert "DP" in an.symbols and not an.pinned, an.pin_reasons
    spec = resolve("megatron-gpt")
    rng = random.Random(2727)
    for _ in range(2):
        v = _draw(rng, rng.choice((2, 4)))
        n = v["DP"]
        comm = {"all_gather": Fraction(0), "reduce_scatter": Fraction(0), "all_reduce": Fraction(0)}

        class Collectives(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                if name == "c10d._allgather_base_":
                    comm["all_gather"] += Fraction(n - 1, n) * _size(args[0])
                elif name == "c10d._reduce_scatter_base_":
                    comm["reduce_scatter"] += Fraction(n - 1, n) * _size(args[1])
                elif name in ("c10d.allreduce_", "_c10d_functional.all_reduce"):
                    ts = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                    comm["all_reduce"] += Fraction(2 * (n - 1), n) * sum(_size(t) for t in ts)
                return func(*args, **(kwargs or {}))

        with torch.device("meta"):
            model = spec.build(v)
        _convert(model, "tensorwise", all_gather=True)  # torchtitan: converters before FSDP2
        wrap(model, spec.layers, "fsdp", fake_group(n))
        got = _step(spec, v, model, torch.float32, fake=True, collectives=Collectives())
        env = _env(an, v)
        assert int(an.flops("train").subs(env)) == got["flops"], (v, "FLOPs")
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], (v, "saved bytes")
        for kind, want in comm.items():
            assert sympy.Rational(an.comm_bytes(kind).subs(env)) == sympy.Rational(want.numerator, want.denominator), \
                (v, kind)
        mem = summary(an, "fp32", "adamw")["memory"]
        assert int(sympy.sympify(mem["params"]).subs(env)) == got["params"], (v, "parameter shards")
        assert int(sympy.sympify(mem["grads"]).subs(env)) == got["grads"], (v, "gradient shards")


@pytest.mark.heavy
def test_fp8_all_gather_halves_fp32_gathers_of_the_blocks():
    """The fp8 all-gather moves 1 byte per weight element of the converted linears where the
    plain one moves 4 (fp32): the difference of the two traces' all-gather bytes is 3 bytes per
    such element (the blocks' linear weights: 12·h² per block, (DP-1)/DP of them per gather,
    gathered in the forward and again in the backward under reshard_after_forward)."""
    plain, fp8 = _trace("tensorwise", "fp32", "fsdp", False), _trace("tensorwise", "fp32", "fsdp", True)
    DP, H, D, L = (SYMS[s] for s in ("DP", "H", "D", "L"))
    diff = sympy.expand(plain.comm_bytes("all_gather") - fp8.comm_bytes("all_gather"))
    assert sympy.simplify(diff - 2 * 3 * 12 * (H * D) ** 2 * L * (DP - 1) / DP) == 0, diff


def test_bad_requests_are_one_line():
    with pytest.raises(SymcostError, match="unknown --fp8 recipe"):
        Layout(fp8="e4m3")
    with pytest.raises(SymcostError, match="tensorwise recipe only"):
        Layout(shard="fsdp", fp8="rowwise", fp8_all_gather=True)
    with pytest.raises(SymcostError, match="--shard fsdp"):
        Layout(shard="ddp", fp8="tensorwise", fp8_all_gather=True)
    with pytest.raises(SymcostError, match="needs --fp8 tensorwise"):
        Layout(shard="fsdp", fp8_all_gather=True)
    with pytest.raises(SymcostError, match="nn.Linear"):  # cs336-lm's linears are its own modules
        symcost.trace("cs336-lm", sizes={"B": 2, "S": 8, "L": 2}, layout=Layout(fp8="tensorwise"), use_cache=False)


@pytest.mark.parametrize("args,msg", [
    (["--fp8", "rowwise", "--dp", "2", "--shard", "fsdp", "--fp8-all-gather"], "tensorwise recipe only"),
    (["--fp8-all-gather", "--dp", "2", "--shard", "fsdp"], "needs --fp8 tensorwise"),
    (["--fp8", "tensorwise", "--fp8-all-gather"], "--shard fsdp"),
    (["--fp8", "tensorwise", "--dp", "2", "--fp8-all-gather"], "(not ddp)"),
])
def test_cli_refusals_before_any_trace(args, msg, monkeypatch):
    from click.testing import CliRunner

    import symcost.graph.build as build
    from symcost.cli import main

    def no_trace(*a, **k):
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(build, "_trace_regime", no_trace)
    r = CliRunner().invoke(main, ["report", "megatron-gpt", *args])
    assert r.exit_code == 2 and msg in r.output and r.output.strip().count("\n") == 0, r.output


def test_missing_torchao_is_one_line(monkeypatch):
    """Without torchao, --fp8 says how to install it (pip install 'symcost[fp8]'), in one line."""
    import sys

    from symcost.frontends import fp8

    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(SymcostError, match=r"pip install 'symcost\[fp8\]'") as e:
        fp8.torchao()
    assert "\n" not in str(e.value)


def test_layout_keys_the_cache_and_round_trips():
    a, b = Layout(fp8="tensorwise"), Layout(shard="fsdp", fp8="tensorwise", fp8_all_gather=True)
    assert a.cache_options() != Layout().cache_options() != b.cache_options() != a.cache_options()
    assert Layout(fp8="rowwise").cache_options() != a.cache_options()
    for lay in (a, b):
        assert Layout.from_dict(lay.to_dict()) == lay
    assert bool(a) and "fp8 tensorwise" in a.describe()


def test_scaled_mm_runs_at_the_fp8_peak():
    """The roofline prices aten._scaled_mm on fp8 operands at the device's fp8 peak, and MFU
    divides by it where the fp8 matmuls carry most model FLOPs."""
    from symcost.hardware.devices import get_device
    from symcost.passes.roofline import op_precision, training_precision

    an = _trace("tensorwise", "fp32")
    op = next(op for op in an.ops if "_scaled_mm" in op.name)
    assert op_precision(op, "fp32") == "fp8"
    assert training_precision(an, {**_env(an, {**REQUEST, "D": 128, "H": 32}), SYMS["V"]: 64}) == "fp8"
    h100 = get_device("h100")
    assert h100.peak_for("fp8")[0] > h100.peak_for("bf16")[0]


@pytest.mark.heavy
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_float8_styles_match_pytorch(sp):
    """One rank of the Megatron plan with torchao's float8 styles (torchtitan's apply_tp under
    the tensorwise recipe: Float8ColwiseParallel / Float8RowwiseParallel on every converted
    linear of the blocks) run by PyTorch on the fake group (tests/data/tp_rank.py ``measure``):
    model FLOPs, saved bytes (the fp8 inputs the styles cast), collective bytes by kind (the
    backward's fp8 gradient all-gathers under --sp) and parameter elements, at random sizes."""
    import os
    import sys

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.fp8 import float8_tp_styles
    from symcost.frontends.models import resolve
    from symcost.frontends.parallel import fake_group
    from symcost.frontends.tensor_parallel import apply, plan

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
    from tp_rank import measure

    # (the tensor-parallel probes keep H and V in the request's class mod 8, S too under --sp)
    an = symcost.trace("megatron-gpt", sizes=dict(REQUEST, H=8, TP=2), precision="bf16-true",
                       layout=Layout(tp=True, sp=sp, fp8="tensorwise"))
    assert "TP" in an.symbols and not an.pinned, an.pin_reasons
    spec = resolve("megatron-gpt")
    rng = random.Random(2716 + sp)
    for _ in range(2):
        tp = rng.choice((2, 4))
        v = {"TP": tp, "B": rng.randint(2, 4), "S": 8 * rng.randint(2, 5), "H": 8 * rng.randint(1, 2),
             "D": 16 * rng.randint(1, 2), "L": rng.randint(1, 3), "V": 8 * rng.randint(2, 10)}
        with torch.device("meta"):
            model = spec.build(v).to(torch.bfloat16)
        _convert(model, "tensorwise")  # torchtitan: the converter before apply_tp
        styles = float8_tp_styles(model, plan(model, spec.layers, sp)[0])
        linears = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
        assert linears and all(type(styles[n]).__name__ in ("Float8ColwiseParallel", "Float8RowwiseParallel")
                               for n in linears)
        ctx = apply(model, spec.layers, fake_group(tp), sp, fp8="tensorwise")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            got = measure(model, spec, v, ctx)
        env = _env(an, v)
        assert int(an.flops("train").subs(env)) == got["flops"], (v, "FLOPs")
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], (v, "saved bytes")
        for kind, want in got["comm"].items():
            assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (v, kind)
        assert int(an.params_shard.subs(env)) == got["shard"], (v, "parameter elements")


@pytest.mark.heavy
@pytest.mark.hf
def test_hf_llama_one_device_matches_torchao():
    """A transformers Llama (SwiGLU: F its own symbol, kept in the request's class mod 16) under
    the tensorwise recipe, eager attention (FlopCounterMode does not see the CPU SDPA kernel),
    against the real torchao-converted model on CPU, at random sizes: FLOPs, saved bytes,
    parameter and gradient bytes. The head is filtered as torchtitan filters ``output``
    (transformers names it ``lm_head``)."""
    pytest.importorskip("transformers")
    import torch

    from symcost.frontends.models import resolve
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    request = {"B": 2, "S": 16, "H": 2, "D": 16, "L": 2, "V": 64, "F": 48}
    an = symcost.trace("hf:llama", attention="eager", sizes=request, precision="fp32", torch_device="cpu",
                       layout=Layout(fp8="tensorwise"))
    assert not an.pinned, an.pin_reasons
    assert {"F", "D"} <= set(an.symbols) and sum("_scaled_mm" in op.name for op in an.ops) == 3 * 7
    spec = resolve("hf:llama", attention="eager")
    rng = random.Random(2744)
    for _ in range(2):
        v = {"B": rng.randint(2, 4), "S": rng.randint(3, 24), "H": rng.randint(2, 4), "D": 16 * rng.randint(1, 2),
             "L": rng.randint(2, 3), "V": rng.randint(20, 90), "F": 16 * rng.randint(2, 6)}
        v = spec.values(v)  # (K follows H: the request's regime, K = H)
        torch.manual_seed(0)
        model = spec.build(v)
        convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=lambda m, fqn: (
            m.in_features % 16 == 0 and m.out_features % 16 == 0 and "lm_head" not in fqn))
        assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 7 * v["L"]  # q k v o gate up down
        got = _step(spec, v, model, torch.float32, fake=False)
        env = _env(an, v)
        assert int(an.flops("train").subs(env)) == got["flops"], (v, "FLOPs")
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], (v, "saved bytes")
        assert int(an.params.subs(env)) * 4 == got["params"] == got["grads"], (v, "params")

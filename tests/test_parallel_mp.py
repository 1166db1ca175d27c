"""FSDP2's ``MixedPrecisionPolicy`` with ``--dp`` (``--fsdp-mp PARAM[,REDUCE]``, issue 15).

Oracle: rank 0 run by PyTorch on fake tensors (``tests/test_parallel.py``'s ``_run_rank``: the
bytes of every collective seen at dispatch with nccl-tests' ring factors typed by hand,
``FlopCounterMode``, a ``saved_tensors_hooks`` pair), the model wrapped here by calling
``fully_shard`` / ``replicate`` with ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)``
directly (not through symcost's wrapping). Sizes and DP drawn at random (seeded).
"""
from __future__ import annotations

import functools
import json
import random

import pytest
import sympy
import torch

import symcost
import symcost.frontends.parallel as parallel
from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS

from test_parallel import _draw, _run_rank

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _oracle_wrap(param: str, reduce: str):
    """Per block, then the root (reshard_after_forward=False), as torchtitan wraps; the policy
    built here from torch's own class."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])

    def wrap(model, layers, shard, mesh, mp=None):
        blocks = list(model.get_submodule(layers).children()) if layers else []
        if shard in ("ddp", "zero1"):
            for m in blocks + [model]:
                replicate(m, mesh=mesh, mp_policy=policy)
        else:
            for m in blocks:
                fully_shard(m, mesh=mesh, reshard_after_forward=shard != "zero2", mp_policy=policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        return model

    return wrap


@functools.lru_cache(maxsize=None)
def _trace(shard, mp, precision):
    return symcost.trace("mlp", sizes={"DP": 8}, precision=precision, shard=shard, fsdp_mp=mp, use_cache=False)


@pytest.mark.parametrize("shard,mp,precision", [("fsdp", "bf16", "fp32"), ("zero2", "bf16,bf16", "bf16-mixed"),
                                                ("ddp", "fp16,fp32", "fp32")])
def test_collectives_match_pytorch_under_policy(shard, mp, precision, monkeypatch):
    an = _trace(shard, mp, precision)
    param, reduce = parallel.parse_fsdp_mp(mp)
    monkeypatch.setattr(parallel, "wrap", _oracle_wrap(param, reduce))
    rng = random.Random(2023 + len(shard) + len(mp))
    for _ in range(2):
        v = _draw(an, rng)
        got = _run_rank("mlp", shard, v, precision)
        env = {SYMS[k]: x for k, x in v.items() if k in an.symbols}
        for kind, want in got["comm"].items():
            assert sympy.Rational(an.comm_bytes(kind).subs(env)) == sympy.Rational(want.numerator, want.denominator), \
                (v, kind)
        assert int(an.flops("train").subs(env)) == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v


def test_policy_halves_the_all_gathers():
    """fp32 parameters all-gathered as bf16 move half the bytes; gradients reduced in fp32 move
    what they moved without the policy (formulas: every size and DP)."""
    plain, mp = _trace("fsdp", None, "fp32"), _trace("fsdp", "bf16", "fp32")
    assert sympy.simplify(mp.comm_bytes("all_gather") * 2 - plain.comm_bytes("all_gather")) == 0
    assert sympy.simplify(mp.comm_bytes("reduce_scatter") - plain.comm_bytes("reduce_scatter")) == 0
    assert sympy.simplify(plain.comm_bytes("all_gather")) != 0


def test_cli_option_and_refusals(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from symcost.cli import main

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    base = ["report", "mlp", "--set", "B=2", "S=8", "D=32", "L=2", "--precision", "fp32", "--json"]
    r = CliRunner().invoke(main, base + ["--fsdp-mp", "bf16"])
    assert r.exit_code == 2 and "--fsdp-mp needs --dp N" in r.output
    r = CliRunner().invoke(main, base + ["--dp", "4", "--shard", "fsdp", "--fsdp-mp", "bf8"])
    assert r.exit_code == 2 and "--fsdp-mp takes PARAM[,REDUCE]" in r.output
    with pytest.raises(SymcostError, match="give shard"):
        symcost.trace("mlp", fsdp_mp="bf16", use_cache=False)
    out = {}
    for flag in ([], ["--fsdp-mp", "bf16"]):  # two cache entries: the policy is part of the key
        r = CliRunner().invoke(main, base + ["--dp", "4", "--shard", "fsdp"] + flag)
        assert r.exit_code == 0, r.output
        out[bool(flag)] = json.loads(r.output)
    assert out[True]["comm"]["all_gather"] * 2 == out[False]["comm"]["all_gather"]
    assert out[True]["comm"]["reduce_scatter"] == out[False]["comm"]["reduce_scatter"]
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in out[True]["parallel"]["engine"]
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2

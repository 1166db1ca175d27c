"""The layouts' probe checks share one meta-device build per candidate's sizes
(:func:`symcost.frontends.memo.meta_model`): on the 2-D mesh (FSDP over TP) the tensor-parallel
check and the data-parallel one each built the model at every candidate of a probe search, the
same sizes twice in a row. Their answers must be those of a model built afresh."""
from __future__ import annotations

import random


def _count_builds(monkeypatch):
    """``(builds, real)``: every size set ``ModelSpec.build_meta`` is called with from now on (the
    test's monkeypatch), and the unpatched method (the oracle's fresh build)."""
    from symcost.frontends.spec import ModelSpec

    builds: list = []
    real = ModelSpec.build_meta

    def counting(self, values):
        builds.append(tuple(sorted(values.items())))
        return real(self, values)

    monkeypatch.setattr(ModelSpec, "build_meta", counting)
    return builds, real


def test_fsdp_over_tp_check_builds_each_candidate_once_with_the_same_answers(monkeypatch):
    import symcost.frontends.parallel as parallel
    import symcost.frontends.tensor_parallel as tensor_parallel
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.frontends.tensor_parallel import sharded_dims

    spec = Layout(shard="fsdp", tp=True).spec(resolve("cs336-lm"))
    builds, real = _count_builds(monkeypatch)
    rng = random.Random(7)
    for _ in range(6):
        h = rng.choice((4, 8))
        v = {"B": 2, "S": 16, "H": h, "K": h, "D": rng.choice((8, 16, 24)), "V": rng.choice((64, 96, 100)),
             "F": rng.choice((32, 64, 72)), "L": 2, "DP": rng.choice((2, 4)), "TP": rng.choice((2, 4))}
        v = {k: x for k, x in v.items() if k in spec.all_symbols}
        n = len(builds)
        spec.probe_ok(v)
        new = builds[n:]
        # each distinct set of sizes built once (was twice: once by each check)
        assert len(new) == len(set(new)), new
        fresh = real(spec, {k: x for k, x in v.items() if k not in ("DP", "TP")})
        # the answers the checks memoised equal those of the model built afresh (the oracle)
        assert parallel._dims0(spec, v) == tuple(sorted({int(p.shape[0]) for p in fresh.parameters() if p.dim()}))
        assert tensor_parallel._sharded_dims(spec, v) == sharded_dims(fresh, spec.layers)


def test_experts_per_token_is_left_out_of_the_tp_check_memo(monkeypatch):
    """An MoE's R (experts per token) sizes no parameter: the tensor-parallel check builds the
    model once for candidates that differ only in R (gpt-oss-20b's --tp trace: 1,310 builds, 755
    since), and its answers equal those of the model built afresh at each R."""
    import symcost.frontends.tensor_parallel as tensor_parallel
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.frontends.tensor_parallel import sharded_dims

    spec = Layout(tp=True).spec(resolve("moe"))
    assert "R" in spec.all_symbols
    builds, real = _count_builds(monkeypatch)
    rng = random.Random(11)
    base = {k: v for k, v in spec.values({}).items() if k in spec.all_symbols}
    base.update(TP=2, L=2, E=rng.choice((4, 8)))
    tensor_parallel._sharded_dims(spec, {**base, "R": 1})  # (the memo's first call tests B, S and R)
    n = len(builds)
    rs = rng.sample(range(2, base["E"] + 1), 3)
    for r in rs:
        got = tensor_parallel._sharded_dims(spec, {**base, "R": r})
        assert got == sharded_dims(real(spec, {**base, "R": r}), spec.layers)
    assert len(builds) == n, builds[n:]  # no build for another R
    # a size that does shape parameters (E: the expert stacks) is still built anew
    tensor_parallel._sharded_dims(spec, {**base, "E": base["E"] * 2, "R": rs[0]})
    assert len(builds) == n + 1


def test_first_sizes_at_r_equal_e_keep_r_in_the_memo():
    """The memo's first sizes at R = E (R + 1 refused by transformers' Mixtral): no error, R kept
    in the key, answers equal a fresh build's (a data-parallel Mixtral trace raised 'R must not
    exceed E' from the memo's own R + 1 build, 2026-12-06)."""
    import symcost.frontends.parallel as parallel
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    spec = Layout(shard="fsdp").spec(resolve("hf:mixtral"))
    v = {k: x for k, x in spec.values({}).items() if k in spec.all_symbols}
    v.update(L=2, E=2, R=2, DP=2)
    for r in (2, 1):
        got = parallel._dims0(spec, {**v, "R": r})
        fresh = spec.build_meta({k: x for k, x in {**v, "R": r}.items() if k != "DP"})
        assert got == tuple(sorted({int(p.shape[0]) for p in fresh.parameters() if p.dim()}))

"""The FSDP probe check of a pipeline stage (frontends/parallel.py ``_first_bad``) answers from the
stage's parameter bounds (``stage_spec``'s ``build.param_bounds``, no boundary probe) exactly what
the stage module itself says: its parameters' first dimensions read off the built stage (the
boundary probed, the other stages' modules deleted), at random sizes, for the first, middle and
last stage kinds (cs336-lm: V sizes only the embedding and the head, which one stage or the
other deletes, so both the bounds' answer and the stage build's are exercised)."""
import random

from symcost.frontends import parallel
from symcost.frontends.models import resolve
from symcost.frontends.pipeline import stage_spec


def test_stage_probe_check_bounds_equal_the_built_stage():
    spec = resolve("cs336-lm")
    rng = random.Random(5)
    seen = set()
    for part in ("first", "middle", "last"):
        stage = stage_spec(spec, part, spec.layers, probes={})
        for _ in range(3):
            v = dict(spec.defaults, B=2, S=8, L=rng.choice((1, 2)), H=rng.choice((2, 4)), D=rng.choice((4, 8, 12)),
                     V=rng.choice((24, 30, 64)), F=rng.choice((8, 16, 20)))
            v["D"] *= v["H"]
            dims = sorted({int(p.shape[0]) for p in stage.build_meta(v).parameters() if p.dim()})  # the oracle
            for m in (8, 16):
                want = next((d for d in dims if d % m), None)
                assert parallel._first_bad(stage, v, m) == want, (part, v, m)
                seen.add((part, want is None))
    assert {p for p, _ in seen} == {"first", "middle", "last"} and {ok for _, ok in seen} == {True, False}

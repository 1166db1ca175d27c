"""The probes of a fit run on real CPU tensors; the request on fake ones (symcost.tracing.record).

The oracle is PyTorch's FakeTensorMode itself: at the same sizes, a recording on real tensors must
equal the fake one op for op (name, module, phase, input and output shapes and dtypes, integer
arguments), storage for storage saved for backward, and event for event in memory. Drawn per
model: the probe plan of a fit at a random seed (its base, one probe per symbol, random probes),
so every symbol of every model varies, K and E in their regimes included (the plan keeps K | H and
an MoE's E | B·S·R as the model's constraints ask). Then whole traces: the analysis of a trace
with real probes equals, as data, the one of a trace with fake probes only.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

import symcost
import symcost.tracing.record as record_mod
from symcost.frontends.models import resolve
from symcost.frontends.spec import request_facts
from symcost.frontends.spec import ModelSpec
from symcost.tracing.fit import FIT_L, POOLS, find_base
from symcost.tracing.schedule import _normalized

CONFIGS = Path(__file__).parent / "data" / "configs"

MODELS = ("cs336-lm", "gpt2", "megatron-gpt", "mlp", "moe", "hf:llama", "hf:gpt2", "hf:falcon", "hf:bloom",
          "hf:gemma", "hf:phi", "hf:mixtral", "hf:qwen3_moe", str(CONFIGS / "deepseek-v3.json"),
          str(CONFIGS / "gpt-oss-20b.json"), str(CONFIGS / "gpt-j-6b.json"))

#: GPT-J rotates its first 64 dimensions of a head: probes need D >= 64 (found by walking down
#: from the 6B config's sizes, minutes of fake recordings); a rotary dimension of 8 keeps the
#: partial rotation (D > 8) at probe sizes
CONFIG = {"gpt-j-6b": {"rotary_dim": "8"}}


def _record(spec, values, precision, real: bool, monkeypatch):
    # real: on real tensors whatever the rule says, without the fall-back to fake tensors
    with monkeypatch.context() as m:
        m.setattr(record_mod, "real_tensors_suffice", lambda values, model, step="train": real)
        return record_mod._record(spec, values, precision, None, real_ok=real)


def _edges(rec):
    """Each op's inputs by their producer: an earlier op's index, a leaf's source, or "ext" (a
    tensor made outside the recorded ops); the graph's edges without the recording's ids."""
    producer, out = {}, []
    for i, o in enumerate(rec.ops):
        out.append([producer.get(t.tid, t.source or "ext") for t in o.inputs])
        for t in o.outputs:
            producer[t.tid] = i
    return out


def _as_data(rec):
    return {
        "edges": _edges(rec),
        "ops": [(o.name, o.module, o.phase, [(i.shape, i.dtype) for i in o.inputs],
                 [(t.shape, t.dtype) for t in o.outputs], o.ints) for o in rec.ops],
        "saved": [(s.nbytes, s.dtype, s.module, s.shape, sorted(s.also)) for s in rec.saved],
        # storages that die together are finalised in an order of Python's, not the step's: the
        # events at one op as a multiset, and in the order the memory schedule reads them
        "events": sorted((e.index, e.nbytes) for e in rec.events),
        "schedule": _normalized(rec),  # the events as the memory schedule's fit reads them
        "rest": (rec.n_forward, rec.n_backward, rec.params, rec.param_module, rec.buffers, rec.input_nbytes,
                 rec.events_end, rec.tied, rec.layer_container),
    }


def _points(spec, rng: random.Random, runs):
    """Three probe points: a fit's base probe, then one with two symbols drawn at random from the
    probe pools, and one with a symbol at 1 besides (B = 1, S = 1, K = 1, one block, top-1: a
    regime of its own, whose probes have it pinned) (``runs(point)``: PyTorch runs the step
    there, as a probe must)."""
    syms = [s for s in spec.all_symbols if s != "L"]
    fixed = {"L": FIT_L + spec.lead_blocks} if "L" in spec.all_symbols else {}
    request = {**spec.values({}, inputs=False), "B": 2, "S": 16}
    ties = {b: a for a, b in request_facts(request, spec.all_symbols)["equal"]}  # K = H stays (as a trace starts)
    syms = [s for s in syms if s not in ties]
    base = find_base(tuple(syms), spec.probe_ok, rng.randrange(1000), fixed, accept=runs, request=request,
                     moduli={s: m for s, m in spec.moduli.items() if s in syms}, ties=ties)
    out = [base]
    for _ in range(60):
        p = dict(base)
        for s in rng.sample(syms, k=min(2, len(syms))):
            p[s] = rng.choice(list(POOLS[s]))
        if len(out) == 2:
            p[rng.choice(sorted(set(syms) | set(fixed)))] = 1
        p.update({b: p[a] for b, a in ties.items()})
        if p not in out and spec.probe_ok(p) is None and runs(p):
            out.append(p)
            if len(out) == 3:
                break
    return out


@pytest.mark.parametrize("model", MODELS, ids=lambda m: Path(m).stem)
def test_real_recording_equals_the_fake_one(model, monkeypatch):
    rng = random.Random(f"{model}-real-probes")
    attention = "eager" if model.startswith("hf:") or model.endswith(".json") else None
    config = CONFIG.get(Path(model).stem, {})
    if attention and rng.random() < 0.5:
        try:  # sdpa where transformers has it for the architecture
            resolve(model, config, "sdpa")
            attention = "sdpa"
        except symcost.SymcostError:
            pass
    spec = resolve(model, config, attention)
    precision = rng.choice(("fp32", "bf16-mixed", "bf16-true", "fp16-mixed"))
    fakes = {}

    def runs(values):  # the fit's accept: the fake step runs there (kept as the oracle)
        key = tuple(sorted(values.items()))
        if key not in fakes:
            try:
                fakes[key] = _as_data(_record(spec, values, precision, False, monkeypatch))
            except symcost.SymcostError:
                fakes[key] = None
        return fakes[key] is not None

    compared = 0
    for values in _points(spec, rng, runs):
        fake = fakes[tuple(sorted(values.items()))]
        real = _as_data(_record(spec, values, precision, True, monkeypatch))
        for part in fake:
            assert real[part] == fake[part], f"{model} {attention} {precision} at {values}: {part} differ"
        compared += 1
    assert compared == 3, f"{model}: only {compared} probe points run"


#: data and tensor parallelism on the fake process group (symcost.frontends.parallel,
#: symcost.frontends.tensor_parallel): every engine and both TP plans, builtin and transformers models
#: (zero1 records the ddp step; a tp+sp step the tp one's ops and more)
PARALLEL = [("gpt2", "fsdp"), ("megatron-gpt", "ddp"), ("cs336-lm", "zero2"), ("hf:mixtral", "zero3"),
            ("megatron-gpt", "tp+sp"), ("hf:llama", "tp"), ("cs336-lm", "tp")]


@pytest.mark.parametrize("model,layout", PARALLEL)
def test_a_parallel_recording_on_real_tensors_equals_the_fake_one(model, layout, monkeypatch):
    """One rank of a data- or tensor-parallel step: on real tensors the same ops (collectives
    included), the same graph, saved storages and memory events as on fake ones, at two probe
    points drawn at random where the layout can be probed (TP divides the sharded dimensions, DP
    the first dimension of every parameter: ``probe_ok``)."""
    from symcost.frontends.layout import Layout

    rng = random.Random(f"{model}-{layout}-real-parallel")
    base = resolve(model, {}, "eager" if model.startswith("hf:") else None)
    if layout.startswith("tp"):
        spec = Layout(tp=True, sp=layout == "tp+sp").spec(base)
    else:
        spec = Layout(shard=layout, fsdp_mp=rng.choice((None, ("bf16", "fp32")))).spec(base)
    precision = rng.choice(("fp32", "bf16-mixed", "bf16-true", "fp16-mixed"))
    pools = {**POOLS, "TP": (2, 4, 8)}
    compared = 0
    for _ in range(2000):
        values = {}
        for s in (s for s in spec.all_symbols if s != "L"):
            m = spec.moduli.get(s, 1)
            values[s] = m * rng.randint(1, 3) if m > 1 else rng.choice(list(pools[s]))
        values["L"] = rng.choice((2, 3))
        if "K" in values and values["H"] % values["K"]:
            continue
        if spec.probe_ok(values) is not None:
            continue
        fake = _as_data(_record(spec, values, precision, False, monkeypatch))
        real = _as_data(_record(spec, values, precision, True, monkeypatch))
        for part in fake:
            assert real[part] == fake[part], f"{model} {layout} {precision} at {values}: {part} differ"
        compared += 1
        if compared == 2:
            break
    assert compared == 2, f"{model} {layout}: {compared} probe points drawn"


@pytest.mark.parametrize("model,precision", [("gpt2", "bf16-mixed")])
def test_a_trace_on_real_probes_equals_one_on_fake_probes(model, precision, monkeypatch):
    rng = random.Random(f"{model}-trace")
    sizes = {"B": rng.randint(1, 8), "S": rng.randint(16, 512)}  # B = 1 drawn too: its own regime

    def trace():
        an = symcost.trace(model, {}, None, sizes=sizes, precision=precision, use_cache=False)
        d = an.to_dict()
        d.pop("timings", None)
        return d

    with_real = trace()
    with monkeypatch.context() as m:
        m.setattr(record_mod, "real_tensors_suffice", lambda values, model, step="train": False)
        with_fake = trace()
    assert with_real.keys() == with_fake.keys()
    for k in with_fake:
        assert with_real[k] == with_fake[k], f"{model} {sizes}: {k} differs"


def test_only_small_steps_run_on_real_tensors():
    small = nn.Linear(8, 8, device="meta")
    big = nn.Linear(2048, 2048, device="meta")  # 4.2M parameters
    huge = nn.Embedding(2 ** 16, 2 ** 10, device="meta")  # 67M
    assert record_mod.real_tensors_suffice({"B": 3, "S": 7}, small)
    assert not record_mod.real_tensors_suffice({"B": 3, "S": 4096}, small)
    assert record_mod.real_tensors_suffice({"B": 3, "S": 7}, big)  # 0.5 GFLOP of real work
    assert not record_mod.real_tensors_suffice({"B": 16, "S": 128}, big)  # 52 GFLOP
    assert not record_mod.real_tensors_suffice({"B": 2, "S": 2}, huge)  # 268 MB of fp32 parameters
    # a size 1 in a training step runs the same ops either way (drawn in the tests above); in an
    # inference step fake kernels stride a size-1 dimension otherwise than real ones, and matmul
    # then dispatches bmm on one and mm on the other (falcon's decode step, S = 1)
    assert record_mod.real_tensors_suffice({"B": 1, "S": 7}, small)
    assert not record_mod.real_tensors_suffice({"B": 1, "S": 7}, small, "prefill")
    assert not record_mod.real_tensors_suffice({"B": 3, "S": 1, "T": 9}, small, "decode")


@pytest.mark.parametrize("model,cache", [("hf:llama", "dynamic"), ("hf:mistral", "static"), ("hf:falcon", "dynamic"),
                                         ("hf:mixtral", "dynamic")])
def test_a_prefill_step_on_real_tensors_equals_the_fake_one(model, cache, monkeypatch):
    """An inference step through the model's own KV cache: the same ops, the same reads and writes
    of the cache, the same bytes it holds per layer."""
    spec = resolve(model, {}, "eager").for_step("prefill", cache)
    rng = random.Random(f"{model}-{cache}-prefill")
    values = {s: rng.choice(list(POOLS[s])) for s in spec.all_symbols if s != "L"}
    values.update(L=2, B=rng.randint(2, 5), S=rng.randint(5, 24))
    if "K" in values:
        values["H"] = values["K"] * rng.randint(2, 4)
    recs = [_record(spec, values, "bf16-mixed", real, monkeypatch) for real in (False, True)]
    fake, real = ([(o.name, [i.shape for i in o.inputs], [t.shape for t in o.outputs], o.ints, o.kv_reads, o.kv_writes)
                   for o in r.ops] for r in recs)
    assert real == fake
    assert sorted((e.index, e.nbytes) for e in recs[1].events) == sorted((e.index, e.nbytes) for e in recs[0].events)
    assert _normalized(recs[1]) == _normalized(recs[0])
    assert (recs[1].kv_layers, recs[1].kv_evicted) == (recs[0].kv_layers, recs[0].kv_evicted)


class _Sampler(nn.Module):
    """A step whose real kernel checks values a fake tensor does not have: ``multinomial`` of an
    all-zero distribution (zero-filled parameters) raises on real tensors only."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n))

    def forward(self, x):
        h = x @ self.w
        idx = torch.multinomial(torch.relu(self.w[0]), x.shape[0], replacement=True)
        return h.index_select(0, idx)


def test_a_step_real_tensors_cannot_run_is_recorded_on_fake_ones():
    spec = ModelSpec(name="sampler", symbols=("D",), defaults={"D": 8}, build=lambda v: _Sampler(v["D"]),
                     make_inputs=lambda v, device: ((torch.randn(v["B"], v["D"], device=device),), {}),
                     loss=lambda out, batch: out.sum())
    values = {"B": 3, "S": 2, "D": 8}
    rec = record_mod.record(spec, values)
    assert "aten.multinomial.default" in [o.name for o in rec.ops]
    with pytest.raises(symcost.SymcostError, match="multinomial"):
        record_mod._record(spec, values, "fp32", None, real_ok=True)


class _Reads(nn.Module):
    """A step that reads tensor values three ways: a branch on a value (``aten._local_scalar_dense``),
    ``Tensor.tolist`` (no op at all), boolean indexing (an output shape set by values)."""

    def __init__(self, n: int, how: str):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n))
        self.how = how

    def forward(self, x):
        h = x @ self.w
        if self.how == "branch":
            return h * 2 if h.sum() > 0 else h
        if self.how == "tolist":
            return h[: 1 + len([v for v in h[:, 0].tolist() if v >= 0])]
        return h[h >= 0]


@pytest.mark.parametrize("how", ["branch", "tolist", "mask"])
def test_a_strict_recording_that_reads_values_gives_way_to_fake_tensors(how):
    """The request of a trace is recorded strict: on real tensors (it is small) until it reads a
    value, then on fake ones, which have none to read (PyTorch raises: such a model is refused,
    as it was when every request was fake). A recording that is not strict reads the zero-filled
    weights and runs: the reason the request must be strict."""
    spec = ModelSpec(name=f"reads-{how}", symbols=("D",), defaults={"D": 8}, build=lambda v: _Reads(v["D"], how),
                     make_inputs=lambda v, device: ((torch.randn(v["B"], v["D"], device=device),), {}),
                     loss=lambda out, batch: out.sum())
    values = {"B": 3, "S": 2, "D": 8}
    assert record_mod.real_tensors_suffice(values, spec.build(values))
    record_mod.record(spec, values)  # probes are not strict: it runs (on real tensors)
    with pytest.raises(symcost.SymcostError):
        record_mod.record(spec, values, strict=True)
    with pytest.raises(symcost.SymcostError):
        record_mod._record(spec, values, "fp32", None, real_ok=False)  # fake tensors: PyTorch raises

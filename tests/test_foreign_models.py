"""Issue 30, the defects under "Why": symcost is never silently wrong on models nobody here wrote.
Each defect on its smallest input, against an independent oracle (PyTorch measuring the same
quantity: a meta-device parameter count, FlopCounterMode, saved_tensors_hooks on real tensors, a
hand count of the bytes an op reads and writes)."""
from __future__ import annotations

import json
import random
import textwrap

import pytest
import torch
from torch import nn

import symcost
from conftest import run_cli

# ------------------------------------------------------------------------------------------------
# a model that prints while it is built and run (nanoGPT prints its parameter count in __init__)
PRINTING_MODEL = """
import torch
from torch import nn
from symcost import ModelSpec

class Chatty(nn.Module):
    def __init__(self, d, n_layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        print("number of parameters: %.2fM" % (sum(p.numel() for p in self.parameters()) / 1e6,))

    def forward(self, x):
        print("forward", tuple(x.shape))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

print("loading the model file")

def chatty(D=16, L=2):
    return Chatty(D, L)

def chatty_spec():
    print("making the spec")
    return ModelSpec(name="chatty", symbols=("D", "L"), defaults={"B": 2, "S": 4, "D": 16, "L": 2},
                     build=lambda v: Chatty(v["D"], v["L"]),
                     make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["D"], device=device),), {}),
                     loss=lambda out, inputs: out.pow(2).mean(), layers="layers")
"""


@pytest.fixture(scope="module")
def chatty_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatty") / "chatty.py"
    path.write_text(textwrap.dedent(PRINTING_MODEL))
    return str(path)


@pytest.mark.parametrize("factory", ["chatty", "chatty_spec"])
def test_printing_model_keeps_json_clean(chatty_file, factory, capsys, tmp_path, monkeypatch):
    """The model's prints (at import, in the factory, in __init__, in forward) go to stderr; stdout
    is the JSON object alone, and its parameter count is the meta-device count."""
    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    d, n_layers = random.Random(factory).choice((8, 12, 24)), 3
    code, out, err = run_cli(capsys, "eval", f"{chatty_file}:{factory}", "--set", f"D={d}", f"L={n_layers}",
                             "B=2", "S=5", "--json")
    assert code == 0, err
    js = json.loads(out)  # the whole of stdout is one JSON object
    with torch.device("meta"):
        meta = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
    assert js["params"] == sum(p.numel() for p in meta.parameters())
    assert "number of parameters" in err and "number of parameters" not in out


# ------------------------------------------------------------------------------------------------
# pooling, nearest resampling, mse_loss, softplus' backward: rules, no longer 0 bytes
class PoolUp(nn.Module):
    """conv 1×1 -> max-pool 2 -> softplus -> nearest upsample ×2 -> avg-pool 2 -> nearest ×2, on
    [B, D, 2S, 2S] images (the side 2S keeps every size a polynomial); trained on mse_loss."""

    def __init__(self, d):
        super().__init__()
        self.conv = nn.Conv2d(d, d, 1)

    def forward(self, x):
        y = torch.nn.functional.softplus(torch.nn.functional.max_pool2d(self.conv(x), 2))
        y = torch.nn.functional.avg_pool2d(torch.nn.functional.interpolate(y, scale_factor=2, mode="nearest"), 2)
        return torch.nn.functional.interpolate(y, scale_factor=2, mode="nearest")


#: what the image model says its S is (ModelSpec.extra["meanings"]), for the 6·N·P line
POOL_MEANINGS = {"S": "half the image side (pixels)", "B": "images per step"}


def pool_spec():
    return symcost.ModelSpec(
        name="poolup", symbols=("D",), defaults={"B": 2, "S": 4, "D": 3}, extra={"meanings": POOL_MEANINGS},
        build=lambda v: PoolUp(v["D"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["D"], 2 * v["S"], 2 * v["S"], device=device),), {}),
        loss=lambda out, inputs: torch.nn.functional.mse_loss(out, inputs[0][0]))


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.fixture(scope="module")
def pool_an():
    return symcost.trace(pool_spec(), precision="fp32")


def test_pool_upsample_mse_softplus_rules_against_the_step(pool_an):
    """At random sizes, every op the step runs is counted (none unsupported); model FLOPs equal
    FlopCounterMode's; each of the new ops' bytes equals the bytes of the real tensors PyTorch
    hands it and returns (those it reads: a pooling backward reads ``self``'s sizes only), and
    its all-FLOPs the hand count of rules_special's table."""
    import sympy
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    an = pool_an
    assert not an.unsupported, an.unsupported
    names = {op.name.rsplit(".", 1)[0] for op in an.ops}
    new = {"aten.max_pool2d_with_indices", "aten.max_pool2d_with_indices_backward", "aten.avg_pool2d",
           "aten.avg_pool2d_backward", "aten.upsample_nearest2d", "aten.upsample_nearest2d_backward",
           "aten.mse_loss", "aten.mse_loss_backward", "aten.softplus_backward"}
    assert new <= names, new - names

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func.overloadpacket) in new:
                self.calls.append((str(func.overloadpacket), _tensors((args, kwargs)), _tensors(out)))
            return out

    unread = {"aten.max_pool2d_with_indices_backward": 1, "aten.avg_pool2d_backward": 1}
    rng = random.Random("poolup")
    syms = {s: sympy.Symbol(s, positive=True, integer=True) for s in ("B", "S", "D")}
    for _ in range(2):
        v = {"B": rng.randint(1, 3), "S": rng.randint(2, 6), "D": rng.randint(2, 5)}
        spec = pool_spec()
        model = spec.build(v)
        (x,), _ = spec.make_inputs(v, torch.device("cpu"))
        seen = Seen()
        with FlopCounterMode(display=False) as fc, seen:
            spec.loss(model(x), ((x,), {})).backward()
        got = an.subs(**v)
        assert got["flops.train"] == fc.get_total_flops(), v
        side, n_small = 2 * v["S"], v["B"] * v["D"] * v["S"] ** 2
        n_big = 4 * n_small
        hand_flops = {  # rules_special's table, at these sizes
            "aten.max_pool2d_with_indices": 4 * n_small, "aten.max_pool2d_with_indices_backward": n_small,
            "aten.avg_pool2d": 4 * n_small, "aten.avg_pool2d_backward": 5 * n_small,
            "aten.upsample_nearest2d": 0, "aten.upsample_nearest2d_backward": n_big,
            "aten.mse_loss": 3 * n_big, "aten.mse_loss_backward": 3 * n_big, "aten.softplus_backward": n_small,
        }
        assert side * side * v["B"] * v["D"] == n_big
        symbolic = {}
        for op in an.ops:
            packet = op.name.rsplit(".", 1)[0]
            if packet in new:
                at = {syms[k]: val for k, val in v.items()}
                symbolic.setdefault(packet, []).append(
                    (int(sympy.sympify(op.cost.bytes).subs(at)), int(sympy.sympify(op.cost.flops_all).subs(at))))
        oracle = {}
        for packet, ins, outs in seen.calls:
            ins = [t for i, t in enumerate(ins) if i != unread.get(packet)]
            oracle.setdefault(packet, []).append(
                (sum(t.numel() * t.element_size() for t in ins + outs), hand_flops[packet]))
        assert {k: sorted(c) for k, c in symbolic.items()} == {k: sorted(c) for k, c in oracle.items()}, v


# ------------------------------------------------------------------------------------------------
# the 6·N·P line names N by what the model declares, "tokens" only for a step that looks them up
class TinyLM(nn.Module):
    def __init__(self, v, d):
        super().__init__()
        self.emb, self.out = nn.Embedding(v, d), nn.Linear(d, v)

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_six_n_p_line_names_s_as_the_model_declares(pool_an, capsys):
    from symcost.frontends.spec import SYMBOL_MEANINGS
    from symcost.render import report as rep

    def text(an):
        capsys.readouterr()
        rep.render(an, {"B": 2, "S": 4, "D": 3}, table=False, width=200)
        return capsys.readouterr().out

    assert pool_an.symbols["S"] == POOL_MEANINGS["S"] and pool_an.symbols["B"] == POOL_MEANINGS["B"]
    assert rep.to_json(pool_an, None)["symbols"]["S"]["meaning"] == POOL_MEANINGS["S"]
    line = rep.n_per_step(pool_an)
    assert POOL_MEANINGS["S"] in line and "token" not in line
    assert POOL_MEANINGS["S"] in text(pool_an)
    undeclared = pool_an.symbols
    try:  # the same image model without a declaration: no tokens, and it says the model declared none
        pool_an.symbols = {**undeclared, "S": SYMBOL_MEANINGS["S"]}
        assert "token" not in rep.n_per_step(pool_an).replace("no tokens", "")
    finally:
        pool_an.symbols = undeclared
    lm = symcost.ModelSpec(
        name="tinylm", symbols=("V", "D"), defaults={"B": 2, "S": 4, "V": 11, "D": 6},
        build=lambda v: TinyLM(v["V"], v["D"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: out.float().pow(2).mean())
    assert rep.n_per_step(symcost.trace(lm, precision="fp32")) == "N = B·S tokens per step"


# ------------------------------------------------------------------------------------------------
# torchtitan's Llama: blocks in an nn.ModuleDict keyed "0".."L-1"
def _titan():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "torchtitan_llama.py")
    s = importlib.util.spec_from_file_location("torchtitan_llama", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def titan_an():
    return symcost.trace(_titan().spec(), precision="fp32", torch_device="cpu")


def test_torchtitan_moduledict_blocks(titan_an):
    """The L blocks are found in the ModuleDict and folded; at random sizes (dim = H·D up to 590,
    where the FFN width is 1024) parameters equal a meta-device count and model FLOPs equal
    FlopCounterMode's (attention on SDPA's math path, which it sees as matmuls); a checkpointed
    segment model keeps the ModuleDict the model's forward iterates."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from symcost.passes.checkpoint.traces import uniform_spec

    t = _titan()
    an = titan_an
    assert an.layer_container == "layers" and "L" in an.symbols and not an.pinned
    rng = random.Random("titan")
    for _ in range(2):
        h = rng.choice((2, 4, 6))
        v = {"B": rng.randint(1, 3), "S": rng.randint(3, 12), "H": h, "D": rng.choice((4, 6, 8)),
             "L": rng.randint(1, 3), "K": rng.choice([k for k in (1, 2, 3) if h % k == 0 and k < h]),
             "V": rng.randint(17, 90)}
        got = an.subs(**v)
        with torch.device("meta"):
            meta = t.build(v)
        assert got["params"] == sum(p.numel() for p in meta.parameters()), v
        model = t.build(v)
        (ids,), _ = t.spec().make_inputs(v, torch.device("cpu"))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            t.spec().loss(model(ids), ((ids,), {})).backward()
        assert got["flops.train"] == fc.get_total_flops(), v
    seg = uniform_spec(t.spec(), "layers", 2).build_meta({**t.spec().defaults, "L": 2})
    assert isinstance(seg.layers, nn.ModuleDict) and len(seg.layers) == 2
    with torch.device("meta"):
        seg(torch.zeros(2, 5, dtype=torch.long, device="meta"))


def test_step_function_width_at_llama3_8b_sizes(titan_an):
    """torchtitan's SwiGLU width is 1024 at every probe (dim <= 590) and 14336 at Llama-3-8B's
    dim 4096. ``subs`` at the 8B sizes finds the fitted width wrong there (the model built on the
    meta device), says so, traces again with only H and D (the symbols that move the width)
    pinned, and answers the meta-device parameter count (8.03B) and FlopCounterMode's FLOPs of
    the step run on meta tensors; a trace asked for those sizes pins the same two at once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    t = _titan()
    sizes = dict(t.LLAMA3_8B)
    with pytest.warns(UserWarning, match=r"step function.*pinned: H=32, D=128\)"):
        got = titan_an.subs(**sizes)
    v = {**sizes, "B": titan_an.spec.defaults["B"], "S": titan_an.spec.defaults["S"]}
    with torch.device("meta"):
        model = t.build(v)
    assert got["params"] == sum(p.numel() for p in model.parameters()) == 8_030_261_248
    (ids,), _ = t.spec().make_inputs(v, torch.device("meta"))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        t.spec().loss(model(ids), ((ids,), {})).backward()
    assert got["flops.train"] == fc.get_total_flops()
    again = titan_an.__dict__["_traced_again"][tuple(sorted(sizes.items()))]
    assert set(again.pinned) == {"H", "D"} and "step function" in again.pin_reasons["D"]
    with torch.device("meta"):  # V and K stay symbols of the new trace
        other = t.build({**sizes, "V": 1000, "K": 4, "L": 3})
    assert again.subs(V=1000, K=4, L=3)["params"] == sum(p.numel() for p in other.parameters())


def test_factory_module_compiles_under_a_checkpoint():
    """A factory file's module is registered in ``sys.modules`` as an import registers it: Dynamo's
    checkpoint higher-order op (``--compile --ac``) looks the module of the code it captures up by
    name (``ModuleNotFoundError: No module named 'symcost_user_...'`` before). Dynamo is the
    oracle: torchtitan's block (with its rotary embedding), loaded through symcost and wrapped as
    ``--compile --ac selective`` wraps it, is captured in one graph and runs, equal to eager."""
    import functools
    import os

    from symcost.frontends.compile import _checkpointed

    spec = symcost.resolve(os.path.join(os.path.dirname(__file__), "data", "torchtitan_llama.py") + ":rope_spec")
    v = dict(spec.defaults)
    model = spec.build(v)
    block, freqs = model.layers["0"], model.freqs_cis
    torch._dynamo.reset()
    compiled = torch.compile(_checkpointed(type(block).forward, "selective"), backend="eager", fullgraph=True)
    x = torch.randn(v["B"], v["S"], v["H"] * v["D"])
    torch.testing.assert_close(functools.partial(compiled, block)(x, freqs), block(x, freqs))


# ------------------------------------------------------------------------------------------------
# nn.LSTM on the CPU: oneDNN's workspace, saved for backward, is empty on fake tensors
class LSTMLM(nn.Module):
    def __init__(self, v, d, layers):
        super().__init__()
        self.emb, self.lstm, self.out = nn.Embedding(v, d), nn.LSTM(d, d, num_layers=layers, batch_first=True), nn.Linear(d, v)

    def forward(self, ids):
        return self.out(self.lstm(self.emb(ids))[0])


def lstm_spec():
    return symcost.ModelSpec(
        name="lstm-lm", symbols=("V", "D"), defaults={"B": 2, "S": 3, "V": 11, "D": 4},
        build=lambda v: LSTMLM(v["V"], v["D"], 2),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: out.float().pow(2).mean())


def test_lstm_workspace_saved_bytes_on_fake_tensors():
    """The smallest input: the step recorded on fake tensors saves what saved_tensors_hooks sees
    on real ones (oneDNN's workspace of each layer included: 0 bytes before, activations −84%),
    at two sizes in fp32 and one under bf16 autocast; and the workspace formula equals the real
    kernel's at random sizes (two layers, both directions, batch first or not, fp32 and bf16)."""
    from memory_oracle import saved_bytes

    from symcost.tracing.onednn_rnn import workspace_bytes
    from symcost.tracing.record import _record

    spec = lstm_spec()
    for v, precision in (({"B": 1, "S": 1, "V": 5, "D": 1}, "fp32"), ({"B": 3, "S": 7, "V": 29, "D": 20}, "fp32"),
                         ({"B": 3, "S": 7, "V": 29, "D": 20}, "bf16-mixed")):
        fake = _record(spec, v, precision, None, real_ok=False)
        assert sum(s.nbytes for s in fake.saved) == saved_bytes(spec, v, precision), (v, precision)
    rng = random.Random("lstm")
    for k in range(4):
        b, s, i, h = rng.randint(1, 9), rng.randint(1, 30), rng.randint(1, 300), rng.randint(1, 300)
        bi, first = rng.random() < 0.5, rng.random() < 0.5
        dtype, ctx = ("bfloat16", torch.autocast("cpu", dtype=torch.bfloat16)) if k % 2 else ("float32", torch.autocast("cpu", enabled=False))
        lstm = nn.LSTM(i, h, num_layers=2, bidirectional=bi, batch_first=first)
        x = torch.randn((b, s, i) if first else (s, b, i), requires_grad=True)
        seen = []
        with ctx, torch.autograd.graph.saved_tensors_hooks(
                lambda t: seen.append(t.numel()) or t if t.dtype == torch.uint8 else t, lambda t: t):
            lstm(x)
        dirs = 2 if bi else 1
        assert seen == ([workspace_bytes(s, b, i, h, dtype=dtype)] * dirs
                        + [workspace_bytes(s, b, dirs * h, h, dtype=dtype)] * dirs), (b, s, i, h, bi, dtype)


class _Norms(nn.Module):
    """Linear → LayerNorm, conv → GroupNorm, conv → BatchNorm2d: under bf16 autocast on the CPU the
    linear and convolutions hand bf16 to normalisations whose weights are fp32 (the mixed-type
    kernels)."""

    def __init__(self, c: int, d: int):
        super().__init__()
        self.conv1, self.gn = nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(2, c)
        self.conv2, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.fc, self.ln = nn.Linear(c, d), nn.LayerNorm(d)

    def forward(self, x):
        h = self.bn(self.conv2(torch.relu(self.gn(self.conv1(x)))))
        return self.ln(self.fc(h.mean((2, 3))))


def norms_spec():
    return symcost.ModelSpec(
        name="norms", symbols=("C", "D", "IMG"), defaults={"B": 2, "S": 1, "C": 4, "D": 6, "IMG": 5},
        meanings={"C": "channels", "IMG": "image side", "S": "unused"},
        build=lambda v: _Norms(2 * v["C"], v["D"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], 3, v["IMG"], v["IMG"], device=device),), {}),
        loss=lambda out, inputs: out.float().pow(2).mean())


def test_mixed_type_norm_statistics_on_fake_tensors():
    """The smallest input: LayerNorm, GroupNorm and BatchNorm2d fed bf16 by autocast with fp32
    weights keep their statistics in fp32 on the real CPU kernels; the meta kernels said bf16, so a
    step recorded on fake tensors (every request above the probes' sizes) saved less than the real
    one and BERT-base under bf16-mixed pinned H, D, V and F for 128 bytes. At random sizes: the
    fake recording's saved bytes equal saved_tensors_hooks on real tensors, and every op's output
    dtypes equal the real recording's, under bf16-mixed and fp32."""
    from memory_oracle import saved_bytes

    from symcost.tracing.record import _record

    spec = norms_spec()
    rng = random.Random("mixed-norms")
    for precision in ("bf16-mixed", "fp32", "bf16-mixed"):
        v = {"B": rng.randint(2, 4), "S": 1, "C": rng.randint(1, 4), "D": rng.randint(2, 9), "IMG": rng.randint(2, 7)}
        fake = _record(spec, v, precision, None, real_ok=False)
        real = _record(spec, v, precision, None, real_ok=True)
        assert [[t.dtype for t in op.outputs] for op in fake.ops] == [[t.dtype for t in op.outputs] for op in real.ops]
        assert sum(s.nbytes for s in fake.saved) == saved_bytes(spec, v, precision), (v, precision)

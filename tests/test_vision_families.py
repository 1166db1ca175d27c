"""Issue 30, items 4 and 5: vision families and models by name.

- ``tv:NAME`` / ``timm:NAME`` (symcost/frontends/zoo.py): neither package is installed here (PyPI's
  torchvision does not load beside torch 2.13.0 CPU), so the tests put a stand-in module in
  ``sys.modules`` exposing the package's own entry points (``torchvision.models.get_model``,
  ``list_models``; ``timm.create_model``, ``is_model``) built from a tiny CNN. symcost's side is
  real: the name resolves through the zoo frontend, the step is traced with IMG a symbol, and the
  formulas are checked at random other sizes (in the request's residue class mod 32) against
  FlopCounterMode, saved_tensors_hooks and a meta-device parameter count (test_own_symbols'
  ``_check``). Without the package: one line naming it.
- ``--task`` on the CLI (symcost/commands/_options.py): threaded to the resolver, one line for a
  task the family has no head for or for a model that is not ``hf:``.
"""
from __future__ import annotations

import random
import sys
import types

import pytest
import torch
from torch import nn

import symcost
from conftest import run_cli
from test_own_symbols import _check


class TinyNet(nn.Module):
    """A stride-32 CNN as the zoos' classifiers are: a 7x7 stride-2 stem, a 3x3 stride-2 max-pool
    (padded), three stride-2 3x3 stages with batch norm and a residual 1x1 projection, global
    average pooling, a linear head (its floors: ⌊(IMG - 1)/2⌋ + 1 and so on)."""

    def __init__(self, num_classes=10, width=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, c = [], width
        for _ in range(3):
            stages.append(nn.ModuleDict({"conv": nn.Conv2d(c, 2 * c, 3, 2, 1, bias=False), "bn": nn.BatchNorm2d(2 * c),
                                         "proj": nn.Conv2d(c, 2 * c, 1, 2, bias=False)}))
            c *= 2
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for st in self.stages:
            x = torch.relu(st["bn"](st["conv"](x)) + st["proj"](x))
        return self.fc(x.mean(dim=(2, 3)))


def _torchvision_stand_in(monkeypatch) -> list:
    """``torchvision.models`` with ``get_model``/``list_models`` building :class:`TinyNet`; the
    calls' keyword arguments are recorded."""
    calls: list = []
    tv, models = types.ModuleType("torchvision"), types.ModuleType("torchvision.models")
    models.list_models = lambda: ["tinynet"]

    def get_model(name, weights=None, **kw):
        calls.append((name, weights, kw))
        return TinyNet(**kw)

    models.get_model = get_model
    tv.models = models
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    return calls


def test_tv_name_traced_exact_at_random_sizes(monkeypatch):
    """tv:tinynet: B and IMG symbols, num_classes the model's (10), random weights (weights=None);
    never pinned, exact against the oracles at random sizes of the request's class mod 32; the
    unknown name and the refused --config are one line each."""
    calls = _torchvision_stand_in(monkeypatch)
    spec = symcost.resolve("tv:tinynet")
    assert spec.symbols == ("IMG",) and spec.moduli == {"IMG": 32} and spec.defaults["IMG"] == 224
    assert calls and all(c[:2] == ("tinynet", None) for c in calls) and "image_size" not in calls[-1][2]
    an = symcost.trace(spec, sizes={"B": 2, "IMG": 40}, precision="fp32", torch_device="cpu")
    assert not an.pinned and "IMG" in an.symbols, an.pinned
    rng = random.Random("tv")
    for _ in range(2):
        _check(an, spec, {"B": rng.randint(2, 4), "IMG": 8 + 32 * rng.randint(1, 3)})
    with pytest.raises(symcost.SymcostError, match="torchvision has no model 'nosuch'"):
        symcost.resolve("tv:nosuch")
    with pytest.raises(symcost.SymcostError, match="--config applies to hf: models only"):
        symcost.resolve("tv:tinynet", config={"a": "1"})


def test_timm_name_takes_img_size_where_the_model_does(monkeypatch):
    """timm:NAME builds by timm.create_model(name, pretrained=False), passing img_size where the
    model takes it (a ViT's), its default side from the pretrained config's input_size."""
    calls: list = []
    timm = types.ModuleType("timm")
    timm.is_model = lambda name: name in ("tinynet", "sized")
    timm.get_pretrained_cfg = lambda name: types.SimpleNamespace(input_size=(3, 96, 96))

    def create_model(name, pretrained=True, **kw):
        calls.append((name, pretrained, dict(kw)))
        if name == "tinynet" and kw:
            raise TypeError(f"TinyNet.__init__() got an unexpected keyword argument {next(iter(kw))!r}")
        kw.pop("img_size", None)
        return TinyNet(**kw)

    timm.create_model = create_model
    monkeypatch.setitem(sys.modules, "timm", timm)
    spec = symcost.resolve("timm:tinynet")
    assert spec.defaults["IMG"] == 96 and all(not c[1] for c in calls)
    calls.clear()
    spec.build_meta({**spec.defaults})
    assert calls == [("tinynet", False, {})]
    sized = symcost.resolve("timm:sized")
    calls.clear()
    sized.build_meta({**sized.defaults, "IMG": 128})
    assert calls == [("sized", False, {"img_size": 128})]
    with pytest.raises(symcost.SymcostError, match="timm has no model 'nosuch'"):
        symcost.resolve("timm:nosuch")


def test_zoo_without_package_and_task_errors_one_line(capsys, tmp_path, monkeypatch):
    """Without torchvision / timm a zoo name is one line naming the package to install; --task on
    a model that is not hf: and a task the family has no head for are one line each (the task
    reaches the resolver: hf:bert's default head, masked LM, would trace)."""
    from test_cli import assert_one_line_error

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    for mod in ("torchvision", "torchvision.models", "timm"):
        monkeypatch.setitem(sys.modules, mod, None)  # (import raises ImportError)
    assert_one_line_error(*run_cli(capsys, "eval", "tv:resnet50"), "pip install torchvision")
    assert_one_line_error(*run_cli(capsys, "eval", "timm:resnet50", "--set", "IMG=224"), "pip install timm")
    assert_one_line_error(*run_cli(capsys, "eval", "cs336-lm", "--task", "causal-lm"),
                          "--task applies to hf: models and config.json files only")
    pytest.importorskip("transformers")
    assert_one_line_error(*run_cli(capsys, "report", "hf:bert", "--task", "image-classification"),
                          "hf:bert has no image-classification head", "masked-lm")
    assert_one_line_error(*run_cli(capsys, "max-batch", "hf:bert", "--task", "mlm"), "unknown task 'mlm'",
                          "masked-lm", "image-classification")


# ------------------------------------------------------------------------------------------------
# hf:convnext, hf:swin (symcost/frontends/hf_vision.py)
def _split_grouped_convs():
    """A context in which every grouped ``nn.Conv2d`` runs as ``groups`` separate convolutions
    with the same weights (test_kernels.split_any): FlopCounterMode then counts a grouped
    convolution's true weight-gradient FLOPs, which its formula over-counts groups times
    (docs/conventions.md, "Divergences from FlopCounterMode")."""
    from unittest import mock

    from test_kernels import split_any

    plain = nn.Conv2d._conv_forward

    def forward(self, x, weight, bias):
        return split_any(self, x) if self.groups > 1 else plain(self, x, weight, bias)

    return mock.patch.object(nn.Conv2d, "_conv_forward", forward)


def _check_exact(an, spec, v: dict) -> None:
    """test_own_symbols' oracles at ``v``: a meta-device parameter count, FlopCounterMode on the
    real step (grouped convolutions split), saved_tensors_hooks' bytes."""
    from torch.utils.flop_counter import FlopCounterMode

    from memory_oracle import saved_bytes
    from symcost.passes import memory

    got = an.subs(**v)
    values = {**spec.defaults, **v}
    assert got["params"] == sum(p.numel() for p in spec.build_meta(values).parameters()), v
    torch.manual_seed(0)
    model = spec.build(values)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    with _split_grouped_convs(), FlopCounterMode(display=False) as fc:
        spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
    assert got["flops.train"] == fc.get_total_flops(), v
    assert memory.memory_model(an).components(**v)["activations"] == saved_bytes(spec, v, "fp32"), v


def _forward_flops_meta(model, side: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        model(pixel_values=torch.empty(1, 3, side, side, device="meta"))
    return fc.get_total_flops()


@pytest.mark.heavy
def test_convnext_exact_and_convnext_t_published():
    """hf:convnext at ConvNeXt-T's stages (depths 3, 3, 9, 3; widths W, 2W, 4W, 8W): W, IMG, C,
    NCLS symbols, none pinned (IMG probed in its class mod 32); exact at random tiny sizes;
    ConvNeXt-T at 224² from the formulas: 28,589,128 parameters (= a meta count; "28M" in Liu et
    al. 2022, Table 10 of the paper, 28.6M on timm's convnext_tiny card) and 4.5 GFLOPs forward,
    which are multiply-accumulates (the paper counts a MAC as a FLOP, as fvcore does; timm's card:
    "GMACs: 4.5"): symcost's forward model FLOPs / 2 = 4.47e9 (= FlopCounterMode's on the meta model)."""
    pytest.importorskip("transformers")
    spec = symcost.resolve("hf:convnext")
    assert spec.symbols == ("W", "IMG", "C", "NCLS") and spec.moduli == {"IMG": 32}
    an = symcost.trace(spec, sizes={"B": 2, "W": 4, "IMG": 64, "C": 3, "NCLS": 5}, precision="fp32",
                       torch_device="cpu")
    assert not an.pinned, an.pin_reasons
    rng = random.Random("convnext")
    _check_exact(an, spec, {"B": rng.randint(2, 3), "W": rng.randint(2, 6), "IMG": 32 * rng.randint(1, 3),
                            "C": rng.randint(1, 4), "NCLS": rng.randint(2, 9)})
    t = {"W": 96, "IMG": 224, "C": 3, "NCLS": 1000}
    got = an.subs(B=1, **t)
    model = spec.build_meta({**spec.defaults, **t, "B": 1})
    assert got["params"] == sum(p.numel() for p in model.parameters()) == 28_589_128
    assert got["flops.forward"] == _forward_flops_meta(model, 224)
    assert round(got["flops.forward"] / 2 / 1e8) / 10 == 4.5, got["flops.forward"]
    with pytest.raises(symcost.SymcostError, match="IMG must be at least 32"):
        symcost.trace(spec, sizes={"IMG": 31}, precision="fp32", torch_device="cpu")


@pytest.mark.heavy
def test_swin_tiny_exact_off_the_modulus():
    """hf:swin, a tiny config (patches of 2, windows of 2, two stages of two blocks: a shifted
    window in each): H, D, IMG, C, NCLS symbols; a request IMG = 36, off the class 0 mod 8 (its
    second stage, 9x9, padded to whole windows), traced in its own class, none pinned; exact at
    random sizes of that class."""
    pytest.importorskip("transformers")
    cfg = {"patch_size": "2", "window_size": "2", "depths": "[2, 2]", "num_heads": "[2, 4]", "embed_dim": "8",
           "drop_path_rate": "0.0"}
    spec = symcost.resolve("hf:swin", config=cfg, attention="eager")  # (FlopCounterMode counts no CPU flash attention)
    assert spec.symbols == ("H", "D", "IMG", "C", "NCLS") and spec.moduli == {"IMG": 8}
    an = symcost.trace(spec, sizes={"B": 2, "H": 2, "D": 4, "IMG": 36, "C": 3, "NCLS": 5}, precision="fp32",
                       torch_device="cpu")
    assert not an.pinned, an.pin_reasons
    rng = random.Random("swin")
    _check_exact(an, spec, {"B": rng.randint(2, 3), "H": rng.randint(2, 3), "D": rng.choice((2, 4)),
                            "IMG": 4 + 8 * rng.randint(2, 5), "C": rng.randint(1, 4), "NCLS": rng.randint(2, 9)})


@pytest.mark.heavy
def test_swin_t_published():
    """hf:swin (SwinConfig's defaults are Swin-T's: patches of 4, windows of 7, depths 2, 2, 6, 2,
    3-24 heads of 32) at 224²: its last stage (7x7) is one window, which no other IMG of the class
    mod 224 runs (larger images shift it), so IMG is pinned at 224, said; H and D are formulas.
    Swin-T: 28,288,354 parameters with 1000 classes (= a meta count; "28M" in Liu et al. 2021,
    Table 1; 28.3M on timm's swin_tiny_patch4_window7_224 card) and "4.5G" FLOPs, which are
    multiply-accumulates (timm's card: "GMACs: 4.5"): symcost's forward model FLOPs / 2 (= the
    meta model's under FlopCounterMode, attention's matmuls included)."""
    pytest.importorskip("transformers")
    spec = symcost.resolve("hf:swin", attention="eager")
    assert spec.moduli == {"IMG": 224}
    an = symcost.trace(spec, sizes={"B": 2, "H": 2, "D": 4, "IMG": 224, "C": 3, "NCLS": 5}, precision="fp32",
                       torch_device="cpu")
    assert an.pinned == {"IMG": 224}, an.pin_reasons
    t = {"H": 3, "D": 32, "IMG": 224, "C": 3, "NCLS": 1000}
    got = an.subs(B=1, **t)
    model = spec.build_meta({**spec.defaults, **t, "B": 1})
    assert got["params"] == sum(p.numel() for p in model.parameters()) == 28_288_354
    assert got["flops.forward"] == _forward_flops_meta(model, 224)
    assert round(got["flops.forward"] / 2 / 1e8) / 10 == 4.5, got["flops.forward"]


@pytest.mark.heavy
def test_vit_side_off_the_patch_multiples_is_traced():
    """hf:vit at an image side that is no multiple of the patch side (PyTorch's patch convolution
    floors: ⌊10/4⌋² + 1 = 5 tokens) is traced, IMG pinned at it (said), not refused; exact there
    against the oracles at random other sizes."""
    pytest.importorskip("transformers")
    spec = symcost.resolve("hf:vit", config={"patch_size": "4"}, attention="eager")
    req = {"B": 2, "H": 2, "D": 4, "L": 1, "F": 8, "IMG": 10, "C": 3, "NCLS": 3}
    an = symcost.trace(spec, sizes=req, precision="fp32", torch_device="cpu")
    assert an.pinned == {"IMG": 10} and "IMG" in an.pin_reasons, an.pinned
    rng = random.Random("vit-off")
    _check_exact(an, spec, {"B": rng.randint(2, 3), "H": rng.randint(2, 3), "D": rng.choice((2, 4)), "L": 1,
                            "F": rng.randint(4, 12), "IMG": 10, "C": rng.randint(1, 3), "NCLS": rng.randint(2, 6)})


def test_fitter_reaches_stride_floors():
    """The fitter's two additions for strided image sizes, on signatures computed by hand from the
    floors themselves at random probe points: a stride-32 map's area (⌊(IMG-1)/2⌋ + 1, ...)^2 in
    the class 0 mod 32 is IMG^2/1024 (a denominator above the 720 tried first), and a Swin stage
    padded to whole windows in the class 4 mod 8, B·H·D·(2·⌈⌈⌈IMG/2⌉/2⌉/2⌉)^2, a dense quadratic in
    IMG times B·H·D (three terms: more than the sparse search tries over four symbols). Each
    formula holds at every side of its class, beyond the probes."""
    import sympy

    from symcost.tracing.fit import Fitter, ProbePlan
    from symcost.tracing.symbols import SYMS, declare

    declare(["IMG"])
    rng = random.Random("floors")

    def side32(img):  # conv 7/2 p3, max-pool 3/2 p1, three 3x3/2 p1: floors
        x = (img + 6 - 7) // 2 + 1
        x = (x + 2 - 3) // 2 + 1
        for _ in range(3):
            x = (x + 2 - 3) // 2 + 1
        return x

    def swin_tokens(img, ws=2):  # patches of 2 (padded), a merge (padded), the stage padded to windows
        g = -(-img // 2)
        s = -(-g // 2)
        return (-(-s // ws) * ws) ** 2

    syms = ("B", "H", "D", "IMG")
    for residue, mod, size, want in (
            (0, 32, lambda p: side32(p["IMG"]) ** 2, lambda IMG: IMG ** 2 / 1024),
            (4, 8, lambda p: p["B"] * p["H"] * p["D"] * swin_tokens(p["IMG"]), None)):
        base = {"B": 3, "H": 5, "D": 4, "IMG": residue + mod * 3}
        points = [base] + [dict(base, **{s: v}) for s, v in (("B", 4), ("H", 6), ("D", 6), ("IMG", residue + mod * 5))]
        points += [{"B": rng.randint(2, 9), "H": rng.randint(2, 9), "D": rng.randint(2, 9),
                    "IMG": residue + mod * rng.randint(2, 12)} for _ in range(6)]
        plan = ProbePlan(syms, points, {s: i + 1 for i, s in enumerate(syms)})
        got = Fitter(plan)(tuple(size(p) for p in points), "size")
        at = {"B": 2, "H": 3, "D": 5}
        for img in (residue + mod * k for k in range(1, 20)):  # every side of the class, beyond the probes
            assert got.subs({SYMS[k]: v for k, v in {**at, "IMG": img}.items()}) == size({**at, "IMG": img}), (got, img)
        if want is not None:
            assert sympy.expand(got - want(SYMS["IMG"])) == 0, got

"""Image models by name from the model zoos: ``tv:NAME`` (torchvision's ``models.get_model``) and
``timm:NAME`` (``timm.create_model``), each built with random weights (never downloaded) and
trained on the cross entropy of its logits against class labels.

Symbols: B (images per step) and IMG (the image side in pixels: inputs ``[B, 3, IMG, IMG]``;
timm's ``in_chans`` and the model's ``num_classes`` stay the model's own, no symbol). A CNN's
feature maps are ⌊(IMG + 2p − k)/s⌋ + 1 after each stride, no polynomial in IMG; within a residue
class of IMG mod 32 (the total stride of torchvision's and timm's classifiers) every one of them
is affine in IMG, so the probes keep the request's residue (``ModelSpec.moduli``) and the formulas
hold for every IMG in that class (224 and 256 are both 0 mod 32; 225 is its own class, traced in
its own regime). No symbol scales a zoo model's widths, so every probe runs the full network:
probe image sides stay at most :data:`PROBE_MAX_SIDE` (six values of each class; the request
may be any size). A size the model's own code refuses (a ViT built for one image size) is pinned
by the tracer at the requested value, with the reason.

Neither package is a dependency of symcost: without it a ``tv:``/``timm:`` name is one line
saying which package to install.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

import torch

from symcost.errors import SymcostError
from symcost.frontends.spec import ModelSpec

#: prefix -> (the package to import, what to install, the default image side)
ZOOS = {"tv": ("torchvision.models", "torchvision", 224), "timm": ("timm", "timm", 224)}
#: the total stride of the zoos' image classifiers: the probes keep IMG's residue mod this
STRIDE = 32

#: the largest image side of a probe (the request may be any): 6 values of each class mod 32
PROBE_MAX_SIDE = 6 * STRIDE + STRIDE - 1

_MEANINGS = {"IMG": "image side (pixels; inputs [B, 3, IMG, IMG])", "B": "images per step",
             "S": "unused (the model reads images)"}


def _package(prefix: str):
    module, install, _ = ZOOS[prefix]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SymcostError(f"{prefix}: models need the {install} package (pip install {install}, a build "
                           f"matching torch {torch.__version__}); it cannot be imported here: {e}") from e


def _builder(prefix: str, name: str) -> tuple[Callable[..., torch.nn.Module], int]:
    """``(build(**kwargs) -> nn.Module, default image side)`` of ``prefix:name``.

    Raises:
        SymcostError: the package is missing, or it has no model of that name.
    """
    pkg = _package(prefix)
    side = ZOOS[prefix][2]
    if prefix == "tv":
        names = set(pkg.list_models()) if hasattr(pkg, "list_models") else None
        if names is not None and name not in names:
            raise SymcostError(f"torchvision has no model {name!r}; its names: torchvision.models.list_models() "
                               f"(e.g. {', '.join(sorted(names)[:4])})")
        return (lambda **kw: pkg.get_model(name, weights=None, **kw)), side
    # timm: its own check of the name (timm.is_model), its default input size (pretrained_cfg)
    if hasattr(pkg, "is_model") and not pkg.is_model(name):
        raise SymcostError(f"timm has no model {name!r}; its names: timm.list_models()")
    try:
        cfg = pkg.get_pretrained_cfg(name) if hasattr(pkg, "get_pretrained_cfg") else None
        got = getattr(cfg, "input_size", None) or (cfg or {}).get("input_size") if cfg is not None else None
        side = int(got[-1]) if got else side
    except Exception:  # noqa: BLE001 - a timm version without it: the common 224
        pass
    return (lambda **kw: pkg.create_model(name, pretrained=False, **kw)), side


def _logits(out: Any) -> torch.Tensor:
    """The logits of a classifier's output: the tensor itself, or the first of a tuple or named
    tuple (torchvision's Inception and GoogLeNet return auxiliary logits beside them in training)."""
    while not isinstance(out, torch.Tensor):
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        elif hasattr(out, "logits"):
            out = out.logits
        else:
            raise SymcostError(f"the model returned {type(out).__name__}, not logits; symcost trains zoo models "
                               "on the cross entropy of a logits tensor")
    return out


def image_spec(name: str, make: Callable[..., torch.nn.Module], default_side: int = 224,
               size_kw: str | None = None, extra: Mapping[str, Any] | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of an image classifier built by ``make(**kw)``: inputs
    ``images [B, 3, IMG, IMG]`` (float32) and ``labels [B]`` (int64, class 0: every label runs the
    same ops), loss ``cross_entropy(logits, labels)`` (mean over the batch). ``size_kw`` is the
    keyword by which ``make`` takes the image side (a ViT's ``image_size``/``img_size``), or None
    (a CNN takes any side as it is).

    No constraint on IMG: the model's own code decides which sides it runs (a ResNet runs any,
    its maps floored to 1x1; a side it refuses is one line at the request). Probes keep IMG's
    residue mod 32 and stay in 32..:data:`PROBE_MAX_SIDE` (module docstring); a request whose ops
    no probe of its class runs has IMG pinned there (the tracer says so)."""

    def build(values: Mapping[str, int]) -> torch.nn.Module:
        kw = {size_kw: int(values["IMG"])} if size_kw else {}
        try:
            return make(**kw).train()
        except Exception as e:  # noqa: BLE001 - the zoo's code can raise anything
            raise SymcostError(f"{name}: building the model failed: {type(e).__name__}: {' '.join(str(e).split())}") from e

    def make_inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
        b, side = int(values["B"]), int(values["IMG"])
        return (torch.randn(b, 3, side, side, device=device),), {}

    def loss(out, inputs) -> torch.Tensor:
        logits = _logits(out)
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return torch.nn.functional.cross_entropy(logits, labels)

    def probe_check(values: Mapping[str, int]) -> str | None:
        # no symbol scales a zoo model's widths: every probe is the full network, so its image
        # side is kept small (six values of a class mod 32 fit IMG's quadratic terms with two to
        # spare); the request itself may be any size
        # (and at least 32: below, a stride-32 network's last maps are 1x1, a regime of its own)
        side = values["IMG"]
        return None if STRIDE <= side <= PROBE_MAX_SIDE else f"probe image sides stay in {STRIDE}..{PROBE_MAX_SIDE}"

    return ModelSpec(
        name=name, symbols=("IMG",), defaults={"B": 8, "S": 1, "IMG": default_side}, probe_check=probe_check,
        build=build, make_inputs=make_inputs, loss=loss, moduli={"IMG": STRIDE}, meanings=dict(_MEANINGS),
        extra={"image_side_note": f"formulas hold for IMG in the request's residue class mod {STRIDE}",
               **dict(extra or {})})


def _size_keyword(make: Callable[..., torch.nn.Module], side: int) -> str | None:
    """The keyword the model's constructor takes the image side by (torchvision's ViT and Swin
    ``image_size``, timm's ``img_size``), or None for a model that takes none (a CNN: its
    constructor refuses the keyword with a TypeError). Tried on the meta device (no weights)."""
    from symcost.frontends.spec import _skip_init

    for kw in ("image_size", "img_size"):
        try:
            with torch.device("meta"), _skip_init():
                make(**{kw: side})
            return kw
        except TypeError:
            continue
        except Exception:  # noqa: BLE001 - it took the keyword and failed otherwise: not ours to judge here
            return kw
    return None


def spec(model: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``tv:NAME`` or ``timm:NAME`` (module docstring).

    Raises:
        SymcostError: the package is missing (one line naming it), or it has no such model.
    """
    prefix, _, name = model.partition(":")
    if prefix not in ZOOS or not name:
        raise SymcostError(f"unknown model {model!r}; accepted: tv:NAME (torchvision), timm:NAME (timm)")
    make, side = _builder(prefix, name)
    return image_spec(model, make, side, _size_keyword(make, side), extra={"zoo": ZOOS[prefix][1]})

"""``hf:`` image classifiers built of stages: ConvNeXt (``hf:convnext``) and Swin (``hf:swin``),
trained with the cross entropy their ``transformers`` head computes from ``labels``
(``single_label_classification``). :func:`symcost.frontends.hf_tasks.any_spec` sends them here;
ViT, whose config has ``num_attention_heads``, stays in :mod:`symcost.frontends.hf_tasks`.

Their configs list one width, depth and head count per stage (``hidden_sizes``, ``depths``,
``num_heads``), no ``num_attention_heads``/``hidden_size``. Symbols:

====== ===================================================================================
symbol config attribute
====== ===================================================================================
IMG    ``image_size``: the image side in pixels (inputs ``pixel_values [B, C, IMG, IMG]``)
C      ``num_channels``: input channels
NCLS   ``num_labels``: classes
W      ConvNeXt: ``hidden_sizes[0]``, the first stage's channels; stage i has
       ``W * hidden_sizes[i] / hidden_sizes[0]`` (every published ConvNeXt doubles: 96, 192,
       384, 768). A config whose widths are no whole multiples of the first keeps them.
H, D   Swin: ``num_heads[0]`` and ``embed_dim / num_heads[0]``; stage i has
       ``H * num_heads[i] / num_heads[0]`` heads of D (Swin-T: 3, 6, 12, 24 heads of 32) and
       ``embed_dim * 2^i`` channels, ``embed_dim = H*D``.
====== ===================================================================================

Depths (``--config depths=[3,3,27,3]``), the patch side, the window side and Swin's
``mlp_ratio`` stay config values: the model is traced with its stages as they are.

Image side. Each stride floors: ConvNeXt's feature map after stage i is ⌊IMG/(P·2^i)⌋ (patchify
convolution of side P, 2x2 stride-2 downsampling), Swin's ⌈IMG/(P·2^i)⌉ padded up to whole
windows of side ws. Within a residue class of IMG mod P·2^(n-1) (ConvNeXt, n stages) or
P·2^(n-1)·ws (Swin) every one of them is affine in IMG, so the probes keep the request's residue
(``ModelSpec.moduli``) and the formulas hold for every IMG of that class, any class PyTorch runs
(ConvNeXt-T: IMG ≡ 224 mod 32 covers 224, 256, 288, ...; IMG = 100 is traced in its own class). A
Swin stage no larger than its window runs other ops (the window shrinks to the stage, no shift):
where no other IMG of the class runs the request's ops, IMG is pinned at the request (the
tracer says so). ConvNeXt needs IMG >= P·2^(n-1) (a downsampling convolution of side 2 on a
1x1 map fails in PyTorch); Swin pads any side.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from symcost.errors import SymcostError
from symcost.frontends import hf
from symcost.frontends.spec import Constraint, ModelSpec

#: model types built here (image classification only)
FAMILIES = ("convnext", "swin")
#: verified against FlopCounterMode (grouped convolutions split), saved_tensors_hooks and a meta
#: count at random tiny sizes, and the published figures (tests/test_vision_families.py)
VERIFIED = FAMILIES

_MEANINGS = {"IMG": "image side (pixels)", "C": "input channels", "NCLS": "classes", "B": "images per step",
             "S": "unused (the model reads images)"}


def handles(model_type: str, task: str) -> bool:
    """Whether ``hf:model_type`` trained on ``task`` is built here."""
    return task == "image-classification" and model_type in FAMILIES


def _ratios(values) -> list[int] | None:
    """``values[i] / values[0]`` as integers, or None where one is no whole multiple."""
    if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, int) and v > 0 for v in values):
        return None
    return [v // values[0] for v in values] if all(v % values[0] == 0 for v in values) else None


def spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
         base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``hf:convnext`` or ``hf:swin`` trained on image classification
    (module docstring), from the config's defaults, a config file's values (``base_kwargs``) and
    ``--config`` overrides.

    Raises:
        SymcostError: a model type not in :data:`FAMILIES`, an unknown or rejected config key,
            an attention implementation for ConvNeXt (it has none) or other than eager/sdpa (Swin).
    """
    from transformers.models.auto import modeling_auto

    if model_type not in FAMILIES:
        raise SymcostError(f"hf:{model_type}: not a staged image classifier; accepted: {', '.join(FAMILIES)}")
    shown = name or f"hf:{model_type}"
    AutoConfig, base_kwargs, ov, cfg = hf.configs(model_type, overrides, base_kwargs)
    model_cls = modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(cfg)]
    if model_type == "convnext" and attention is not None:
        raise SymcostError(f"{shown} ({model_cls.__name__}) has no attention; leave --attention out")
    if model_type == "swin":  # (transformers' attention interface: eager or sdpa, as hf_tasks' ViT)
        if attention is None:
            attention = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
        elif attention not in hf.ATTENTION:
            raise SymcostError(f"unknown attention implementation {attention!r}; accepted: {', '.join(hf.ATTENTION)}")
    patch, image, stages = cfg.patch_size, cfg.image_size, len(cfg.depths)
    if not all(isinstance(v, int) and v >= 1 for v in (patch, image)):
        raise SymcostError(f"{shown}: {type(cfg).__name__} gives image_size={image!r}, patch_size={patch!r}; symcost "
                           "binds IMG to the side of square images of square patches: set --config image_size=N "
                           "patch_size=N")

    # (symbol, default) and how a value sets the config
    defaults: dict[str, int] = {"B": 8, "S": 1, "IMG": image, "C": cfg.num_channels,
                                "NCLS": cfg.num_labels if cfg.num_labels > 1 else 1000}
    constraints = [Constraint("min", "NCLS", 2, "NCLS must be at least 2 (one class is regression)")]
    meanings = dict(_MEANINGS)
    widths = heads = None
    if model_type == "convnext":
        widths = _ratios(cfg.hidden_sizes)
        if widths:
            defaults["W"] = cfg.hidden_sizes[0]
            meanings["W"] = (f"channels of the first stage (hidden_sizes[0]; the stages have "
                             f"{', '.join(f'{r}W' if r > 1 else 'W' for r in widths)})")
        stride = patch * 2 ** (stages - 1)
        constraints.append(Constraint("min", "IMG", stride, f"IMG must be at least {stride} (patches of {patch}, "
                                      f"then {stages - 1} 2x2 stride-2 downsamplings: PyTorch refuses a smaller map)"))
        modulus = stride
    else:  # swin
        heads = _ratios(cfg.num_heads)
        if heads and cfg.embed_dim % cfg.num_heads[0] == 0:
            defaults.update(H=cfg.num_heads[0], D=cfg.embed_dim // cfg.num_heads[0])
            meanings.update(H=f"attention heads of the first stage (num_heads[0]; the stages have "
                              f"{', '.join(f'{r}H' if r > 1 else 'H' for r in heads)})",
                            D="per-head dimension (embed_dim = H*D; stage i has H*D*2^i channels)")
        else:
            heads = None
        modulus = patch * 2 ** (stages - 1) * cfg.window_size
    meanings["IMG"] = (f"image side (pixels; formulas for IMG in the request's class mod {modulus}: "
                       f"patch {patch}, {stages} stages" + (f", windows of {cfg.window_size}" if model_type == "swin"
                                                            else "") + ")")
    symbols = tuple(s for s in ("H", "D", "W", "IMG", "C", "NCLS") if s in defaults)

    def config_for(values: Mapping[str, int]):
        i = lambda k: operator.index(values[k])  # noqa: E731
        kw = dict(ov, image_size=i("IMG"), num_channels=i("C"), num_labels=i("NCLS"))
        kw.pop("id2label", None), kw.pop("label2id", None)  # (num_labels sets them)
        if widths:
            kw["hidden_sizes"] = [i("W") * r for r in widths]
        if heads:
            kw.update(embed_dim=i("H") * i("D"), num_heads=[i("H") * r for r in heads])
        c = hf._make_config(AutoConfig, model_type, kw)
        if attention is not None:
            c._attn_implementation = attention
        return c

    build = hf.head_builder(shown, constraints, symbols, model_cls, config_for, attention)

    def make_inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
        """``pixel_values [B, C, IMG, IMG]`` float32, ``labels [B]`` int64 in ``[0, NCLS)``."""
        i = lambda k: operator.index(values[k])  # noqa: E731
        return (), {"pixel_values": torch.randn(i("B"), i("C"), i("IMG"), i("IMG"), device=device),
                    "labels": torch.randint(0, i("NCLS"), (i("B"),), dtype=torch.long, device=device)}

    def loss(out, inputs) -> torch.Tensor:
        """The head's own loss: mean cross entropy of the images' classes."""
        return out.loss

    extra = {"config_class": type(cfg).__name__, "model_type": model_type, "task": "image-classification",
             "model_class": model_cls.__name__, "depths": list(cfg.depths), "attention": attention,
             "config_overrides": {k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                                  for k, v in ov.items() if k not in base_kwargs or base_kwargs[k] != v}}
    if base_kwargs:
        extra["config_file"] = shown
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=make_inputs,
                     loss=loss, constraints=tuple(constraints), moduli={"IMG": modulus}, meanings=meanings,
                     extra=extra, record_context=hf.unpacked_masks)

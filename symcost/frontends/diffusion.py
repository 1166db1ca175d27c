"""Diffusion models from ``diffusers`` by class name or config file: ``diffusers:UNet2DModel``
(DDPM's pixel-space U-Net), ``diffusers:UNet2DConditionModel`` (Stable Diffusion's latent U-Net
with text cross-attention), ``diffusers:DiTTransformer2DModel`` (DiT, class-conditional), or a
diffusers ``config.json`` (the ``unet/`` or ``transformer/`` folder of a pipeline; its
``_class_name`` picks the class, the legacy ``Transformer2DModel`` of DiT's published configs
included). Built with random weights (never downloaded), the class's defaults under a file's
values and ``--config key=value`` overrides.

The training step (Ho et al. 2020, "Denoising Diffusion Probabilistic Models", Algorithm 1; the
same for latent diffusion and DiT): a clean image or latent x0 ``[B, C, IMG, IMG]``, Gaussian
noise ε of the same shape and timesteps t ``[B]`` (int64 in 0..999) are the inputs; the step
noises x_t = √ᾱ_t·x0 + √(1−ᾱ_t)·ε (ᾱ of DDPM's linear schedule, β from 1e-4 to 0.02 over 1000
steps: ``DDPMScheduler``'s default; the gather and four elementwise ops are part of the traced
step), runs ``model(x_t, t, ...)`` and trains on ``mse_loss(ε̂, ε)``, the noise-prediction loss. A
model whose output has twice the input channels (DiT's learned variance, ``out_channels = 2C``)
has its first C channels trained on that loss; the variance channels' VLB term (Nichol & Dhariwal
2021) is left out. Conditioning: class labels ``[B]`` (DiT; a U-Net with ``num_class_embeds``),
text-encoder states ``encoder_hidden_states [B, S, XD]`` (``UNet2DConditionModel``).

Symbols (each from the config attribute named; absent attributes give no symbol):

======= ==========================================================================================
symbol  meaning (config attribute)
======= ==========================================================================================
IMG     image or latent side (``sample_size``): inputs ``[B, C, IMG, IMG]``
C       input channels (``in_channels``; ``out_channels`` follows as C, or 2C, where it is so)
W       U-Nets: channels of the first level (``block_out_channels[0]``); level i has
        ``W * block_out_channels[i] / block_out_channels[0]`` (DDPM CIFAR-10: 128, 256, 256, 256 =
        W, 2W, 2W, 2W). A config whose widths are no whole multiples of the first keeps them.
G       U-Nets: groups of every group norm (``norm_num_groups``; G divides W)
XD      ``UNet2DConditionModel``: width of the text-encoder states (``cross_attention_dim``)
S       ``UNet2DConditionModel``: text tokens per image (77 for CLIP); else unused
H, D, L DiT: attention heads, per-head dimension, transformer blocks (``num_attention_heads``,
        ``attention_head_dim``, ``num_layers``)
NCLS    classes of the label embedding (DiT: ``num_embeds_ada_norm``; a U-Net's ``num_class_embeds``)
======= ==========================================================================================

``layers_per_block``, the block types, the attention head layout of the U-Nets and DiT's patch
side stay config values (``--config layers_per_block=3``): the model is traced with its levels as
they are.

Sizes that are no polynomials. A U-Net halves IMG at each of its n − 1 downsamplings (a stride-2
convolution: ⌊(IMG − 1)/2⌋ + 1) and doubles it back; within a residue class of IMG mod 2^(n−1)
each map is affine in IMG, so the probes keep the request's residue (``ModelSpec.moduli``).
``UNet2DModel`` concatenates each up level with its skip, so its IMG must be a multiple of
2^(n−1) (PyTorch refuses the concatenation otherwise: a constraint); ``UNet2DConditionModel``
upsamples to the skip's size and runs any side. W keeps its class mod 2 (an odd sinusoidal
timestep embedding is zero-padded) and mod the per-head dimension of a U-Net's attention
(heads = ⌊channels/head_dim⌋). DiT's tokens (IMG/P)² enter the attention scores' storage to the
fourth power, above the fit's cubes: IMG is pinned at the request (as a ViT's, stated), and IMG
must be a multiple of P (the model returns (IMG//P)·P pixels, which the loss compares with the
noise).

``diffusers`` is no dependency of symcost (it is in the ``test`` extra): without it a
``diffusers:`` name is one line saying to install it.
"""
from __future__ import annotations

import importlib
import json
import math
import operator
import os
from typing import Any, Mapping

import torch
from torch import nn

from symcost.errors import SymcostError
from symcost.frontends.spec import Constraint, ModelSpec, check_constraints

#: class name -> module under ``diffusers.models`` that defines it
CLASSES = {"UNet2DModel": "unets.unet_2d", "UNet2DConditionModel": "unets.unet_2d_condition",
           "DiTTransformer2DModel": "transformers.dit_transformer_2d"}
#: timesteps of the noise schedule (DDPM's T = 1000) and its linear betas (DDPMScheduler's defaults)
TIMESTEPS, BETA_START, BETA_END = 1000, 1e-4, 0.02

_MEANINGS = {
    "IMG": "image or latent side (sample_size; inputs [B, C, IMG, IMG])", "C": "input channels (in_channels)",
    "W": "channels of the first U-Net level (block_out_channels[0])", "G": "groups of each group norm (norm_num_groups)",
    "XD": "width of the text-encoder states (cross_attention_dim)", "H": "attention heads (num_attention_heads)",
    "D": "per-head dimension (attention_head_dim)", "L": "transformer blocks (num_layers)",
    "NCLS": "classes of the label embedding", "B": "images per step", "S": "unused (the model reads images)",
}


def _diffusers():
    try:
        return importlib.import_module("diffusers")
    except ImportError as e:
        raise SymcostError(f"diffusers: models need the diffusers package (pip install diffusers); it cannot be "
                           f"imported here: {e}") from e


def model_class(name: str):
    """The ``diffusers`` model class named ``name`` (one of :data:`CLASSES`).

    Raises:
        SymcostError: diffusers is missing, or the name is not a class symcost trains."""
    if name not in CLASSES:
        raise SymcostError(f"diffusers:{name}: not a diffusion model symcost trains; accepted: "
                           f"{', '.join('diffusers:' + c for c in CLASSES)} or a diffusers config.json")
    _diffusers()
    mod = importlib.import_module(f"diffusers.models.{CLASSES[name]}")
    return getattr(mod, name)


def is_config_file(path: str) -> bool:
    """Whether ``path`` is a diffusers model ``config.json`` (it has ``_class_name``; a
    transformers config has ``model_type`` instead). Torch-free; False for an unreadable file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "_class_name" in data and "model_type" not in data


def _parse(text: str) -> Any:
    """One ``--config`` value: JSON (numbers, lists of strings or numbers, true/false/null), else
    :func:`symcost.frontends.hf.parse_value`'s reading (``none``, ``True``, a bare string)."""
    from symcost.frontends.hf import parse_value

    try:
        return json.loads(text)
    except ValueError:
        return parse_value(text)


def _ratios(values) -> list[int] | None:
    """``values[i] / values[0]`` as integers, or None where one is no whole multiple."""
    if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, int) and v > 0 for v in values):
        return None
    return [v // values[0] for v in values] if all(v % values[0] == 0 for v in values) else None


def _side(value, shown: str) -> int | None:
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and value[0] == value[1]:
            value = value[0]
        else:
            raise SymcostError(f"{shown}: sample_size={list(value)} is no square; symcost binds IMG to the side of "
                               "square images: set --config sample_size=N")
    return value if isinstance(value, int) and value > 0 else None


class NoisePrediction(nn.Module):
    """One diffusion training step's model: noise the clean sample at timesteps t, predict the
    noise (module docstring). ``forward(sample [B, C, IMG, IMG], noise [B, C, IMG, IMG],
    timesteps [B] int64, **conditioning) -> ε̂ [B, C_out, IMG, IMG]``. The wrapped model is
    ``self.model``; ᾱ_t is a buffer (no parameter)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        betas = torch.linspace(BETA_START, BETA_END, TIMESTEPS, dtype=torch.float32)
        self.register_buffer("alphas_cumprod", torch.cumprod(1.0 - betas, dim=0), persistent=False)

    def forward(self, sample, noise, timesteps, **conditioning):
        a = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        noisy = a.sqrt() * sample + (1.0 - a).sqrt() * noise
        return self.model(noisy, timesteps, return_dict=False, **conditioning)[0]


def _loss(out, inputs) -> torch.Tensor:
    """Mean square error of the predicted noise (the first C output channels) against the noise."""
    noise = inputs[1]["noise"]
    if out.shape[1] != noise.shape[1]:
        out = out[:, :noise.shape[1]]
    return torch.nn.functional.mse_loss(out, noise)


def spec(name: str, overrides: Mapping[str, str] | None = None, base_kwargs: Mapping[str, Any] | None = None,
         shown: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of the diffusers class ``name`` (:data:`CLASSES`) trained on the
    noise-prediction loss (module docstring), from the class's defaults, a config file's values
    (``base_kwargs``) and ``--config`` overrides (``overrides``: key -> text).

    Raises:
        SymcostError: diffusers missing, an unknown class, a config key the class does not take,
            a non-square sample size, a config the class refuses (one line each).
    """
    import inspect

    shown = shown or f"diffusers:{name}"
    cls = model_class(name)
    params = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in dict(base_kwargs or {}).items() if k in params}
    for k, text in dict(overrides or {}).items():
        if k not in params or k == "self":
            raise SymcostError(f"{shown}: {cls.__name__} takes no config key {k!r}; its keys: "
                               f"{', '.join(p for p in params if p != 'self')}")
        kw[k] = _parse(str(text))
    cfg = {k: p.default for k, p in params.items() if k != "self" and p.default is not inspect.Parameter.empty}
    cfg.update(kw)

    dit = name == "DiTTransformer2DModel"
    cond = name == "UNet2DConditionModel"
    side = _side(cfg.get("sample_size"), shown)
    defaults: dict[str, int] = {"B": 8, "S": 1, "IMG": side or (32 if dit else 64), "C": cfg["in_channels"]}
    constraints: list[Constraint] = []
    moduli: dict[str, int] = {}
    pin: dict[str, str] = {}
    meanings = dict(_MEANINGS)
    c_out = cfg.get("out_channels")
    out_of = None  # out_channels as a function of C, where it follows C
    if c_out in (None, cfg["in_channels"]):
        out_of = 1
    elif c_out == 2 * cfg["in_channels"]:
        out_of = 2
    widths = None
    if dit:
        patch = cfg["patch_size"]
        if cfg.get("norm_type") != "ada_norm_zero" or not cfg.get("num_embeds_ada_norm"):
            raise SymcostError(f"{shown}: DiT trains class-conditionally (norm_type='ada_norm_zero' with "
                               f"num_embeds_ada_norm classes); got norm_type={cfg.get('norm_type')!r}, "
                               f"num_embeds_ada_norm={cfg.get('num_embeds_ada_norm')!r}")
        defaults.update(H=cfg["num_attention_heads"], D=cfg["attention_head_dim"], L=cfg["num_layers"],
                        NCLS=cfg["num_embeds_ada_norm"])
        moduli["IMG"] = patch
        pin["IMG"] = (f"the attention scores' storage holds (IMG/{patch})^4 terms, above the fit's cubes: formulas "
                      "for this image side (another: --set IMG=...)")
        constraints.append(Constraint("multiple", "IMG", patch, f"IMG must be a multiple of the patch side {patch} "
                                      f"(DiT returns (IMG//{patch})*{patch} pixels, the loss compares them with the "
                                      "noise; another patch: --config patch_size=N)"))
        meanings["IMG"] = f"latent side (sample_size; patches of {patch}x{patch}: --config patch_size=N)"
    else:
        chans = cfg["block_out_channels"]
        widths = _ratios(chans)
        levels = len(chans)
        if widths:
            defaults["W"] = chans[0]
            meanings["W"] = (f"channels of the first U-Net level (block_out_channels[0]; the levels have "
                             f"{', '.join(f'{r}W' if r > 1 else 'W' for r in widths)})")
        groups = cfg.get("norm_num_groups")
        if isinstance(groups, int) and widths:
            defaults["G"] = groups
            constraints.append(Constraint("divides", "G", "W", "G must divide W (each group norm splits the "
                                          "channels into G groups)"))
        head = cfg.get("attention_head_dim")
        # (UNet2DModel: heads = channels // attention_head_dim; UNet2DConditionModel's
        # attention_head_dim is the head count: head_dim = channels // heads)
        per = head if isinstance(head, int) else (max(head) if isinstance(head, (list, tuple)) and head else 1)
        if widths:
            moduli["W"] = math.lcm(2, per or 1)
        stride = 2 ** (levels - 1)
        if stride > 1:
            moduli["IMG"] = stride
            if not cond:  # (UNet2DConditionModel upsamples to its skip's size: any side)
                constraints.append(Constraint("multiple", "IMG", stride, f"IMG must be a multiple of {stride} "
                                              f"({levels - 1} stride-2 downsamplings whose maps the up path "
                                              "concatenates with its own: PyTorch refuses other sides)"))
        if cfg.get("num_class_embeds") and cfg.get("class_embed_type") is None:
            defaults["NCLS"] = cfg["num_class_embeds"]
        if cond:
            xd = cfg.get("cross_attention_dim")
            if not isinstance(xd, int) or cfg.get("encoder_hid_dim_type") or cfg.get("addition_embed_type"):
                raise SymcostError(f"{shown}: symcost trains a UNet2DConditionModel on text states of one width "
                                   f"(cross_attention_dim an integer, no encoder_hid_dim_type or addition_embed_type); "
                                   f"got cross_attention_dim={xd!r}")
            defaults.update(XD=xd, S=77)
            meanings["S"] = "text tokens per image (encoder_hidden_states [B, S, XD])"
    if "NCLS" in defaults:
        constraints.append(Constraint("min", "NCLS", 2, "NCLS must be at least 2 (one class conditions nothing)"))
    # probes only (a request may be any size): a U-Net's deepest map at least 2x2 and G at least 2,
    # so that a probe breaking a coincidence of the request (IMG = W = 64, G = W = 32) runs the
    # request's ops (a 1x1 map or one group is a regime of its own) and the pair is not tied
    min_side = 0 if dit else 2 ** len(cfg["block_out_channels"])

    def probe_check(values: Mapping[str, int]) -> str | None:
        if values.get("IMG", min_side) < min_side:
            return f"probe image sides stay at least {min_side} (the deepest map at least 2x2)"
        if "G" in defaults and values.get("G", 2) < 2:
            return "probes keep at least 2 groups"
        return None
    symbols = tuple(s for s in ("H", "D", "L", "W", "G", "IMG", "C", "XD", "NCLS") if s in defaults)
    meanings = {k: v for k, v in meanings.items() if k in symbols or k in ("B", "S")}

    def config_for(values: Mapping[str, int]) -> dict:
        i = lambda k: operator.index(values[k])  # noqa: E731
        out = dict(cfg, sample_size=i("IMG"), in_channels=i("C"))
        if out_of:
            out["out_channels"] = out_of * i("C")
        if dit:
            out.update(num_attention_heads=i("H"), attention_head_dim=i("D"), num_layers=i("L"),
                       num_embeds_ada_norm=i("NCLS"))
        else:
            if widths:
                out["block_out_channels"] = tuple(i("W") * r for r in widths)
            if "G" in values and "G" in defaults:
                out["norm_num_groups"] = i("G")
            if "NCLS" in defaults:
                out["num_class_embeds"] = i("NCLS")
            if cond:
                out["cross_attention_dim"] = i("XD")
        return out

    def build(values: Mapping[str, int]) -> nn.Module:
        """The noise-prediction step's model at these sizes, in train mode (current default device)."""
        why = check_constraints(constraints, {k: values.get(k) for k in ("B", "S", *symbols)})
        if why:
            raise SymcostError(f"{shown}: {why}")
        try:
            model = cls(**config_for(values))
        except Exception as e:  # noqa: BLE001 - diffusers raises many types
            raise SymcostError(f"{shown}: building the model failed: {type(e).__name__}: "
                               f"{' '.join(str(e).split())}") from e
        return NoisePrediction(model).train()

    def make_inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
        """``sample``, ``noise`` ``[B, C, IMG, IMG]`` float32, ``timesteps [B]`` int64 in
        ``[0, 1000)``; ``class_labels [B]`` in ``[0, NCLS)``; ``encoder_hidden_states [B, S, XD]``."""
        i = lambda k: operator.index(values[k])  # noqa: E731
        b, c, s = i("B"), i("C"), i("IMG")
        kw = {"sample": torch.randn(b, c, s, s, device=device), "noise": torch.randn(b, c, s, s, device=device),
              "timesteps": torch.randint(0, TIMESTEPS, (b,), dtype=torch.long, device=device)}
        if "NCLS" in defaults:
            kw["class_labels"] = torch.randint(0, i("NCLS"), (b,), dtype=torch.long, device=device)
        if cond:
            kw["encoder_hidden_states"] = torch.randn(b, i("S"), i("XD"), device=device)
        return (), kw

    extra = {"diffusers_class": name, "step": "noise prediction (DDPM, linear betas 1e-4..0.02, T=1000): "
             "mse(model(x_t, t), noise)", "config_overrides": {k: _parse(str(v)) for k, v in dict(overrides or {}).items()}}
    if base_kwargs:
        extra["config_file"] = shown
    if not dit:
        extra["layers_per_block"] = cfg.get("layers_per_block")
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=make_inputs,
                     loss=_loss, constraints=tuple(constraints), moduli=moduli, pin=pin, meanings=meanings,
                     probe_check=probe_check,
                     extra=extra, layers="model.transformer_blocks" if dit else None)


def spec_from_file(path: str, overrides: Mapping[str, str] | None = None, shown: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a diffusers ``config.json`` (its ``_class_name``; DiT's published
    configs name the legacy ``Transformer2DModel``, read as ``DiTTransformer2DModel`` where its
    ``norm_type`` is ``ada_norm_zero``).

    Raises:
        SymcostError: an unreadable file, a class symcost does not train (one line)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SymcostError(f"cannot read diffusers config {path!r}: {e}") from e
    name = data.get("_class_name")
    if name == "Transformer2DModel" and data.get("norm_type") == "ada_norm_zero":
        name = "DiTTransformer2DModel"
    base = {k: v for k, v in data.items() if not k.startswith("_")}
    return spec(str(name), overrides, base_kwargs=base, shown=shown or os.fspath(path))


def resolve(model: str, config: Mapping[str, str] | None = None) -> ModelSpec:
    """``diffusers:CLASS`` or a diffusers ``config.json`` path (:func:`is_config_file`)."""
    if model.startswith("diffusers:"):
        return spec(model.partition(":")[2], config)
    return spec_from_file(model, config)

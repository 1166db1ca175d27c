"""Issue 30, item 4: diffusion models from ``diffusers`` (symcost/frontends/diffusion.py), by class
name (``diffusers:UNet2DModel``) and by a published ``config.json`` (tests/data/diffusers/, each
the ``unet/`` or ``transformer/`` config of the model's Hugging Face repository), trained on the
noise-prediction loss (x_t from x0, ε and t; mse of the predicted noise).

Checked against PyTorch measuring the same quantities at random tiny sizes of the traced regime
(tests/memory_oracle.py ``exact_at``): model FLOPs of the real step == FlopCounterMode (SDPA on its
math path, which it counts), activations == the bytes saved_tensors_hooks sees, parameters == a
meta-device count. Published figures, each from the published config through symcost's formula
and a meta count:

- DDPM's CIFAR-10 U-Net (Ho et al. 2020, "Denoising Diffusion Probabilistic Models", Appendix B:
  "Our CIFAR10 model has 35.7 million parameters"; config: huggingface.co/google/ddpm-cifar10-32,
  ``config.json``): 35,746,307 (a meta count of the published config as symcost builds it; its
  trace at tiny sizes takes 165 CPU-s and pins W, too slow for the suite: the U-Net's formulas are
  checked on a two-level UNet2DModel).
- DiT-XL/2 at 256x256 (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers",
  Table 4: 675M parameters, 118.6 Gflops; config: huggingface.co/facebook/DiT-XL-2-256,
  ``transformer/config.json``). diffusers' port holds the timestep and class embedders once per
  block (28 copies of the paper's one, ``transformer_blocks.i.norm1.emb``): its module has
  749,826,464 parameters, the paper's 675M plus 27 more copies of the embedders. The paper's
  Gflops are multiply-accumulates (fvcore's convention): forward model FLOPs / 2 = 118.67e9, of
  which the embedders' 28 extra calls (27 more copies, and block 0's once more after the blocks)
  are 0.05e9: 118.6e9 without them.
- Stable Diffusion v1.5's U-Net (huggingface.co/runwayml/stable-diffusion-v1-5,
  ``unet/config.json``; "860M UNet", CompVis/stable-diffusion README): 859,520,964 (meta count
  of the published config; the class builds and resolves, see the module's docstring).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import symcost
from memory_oracle import exact_at

pytest.importorskip("diffusers")

DATA = Path(__file__).resolve().parent / "data" / "diffusers"

#: a two-level UNet2DModel (one attention level), one ResNet per level: the cheapest U-Net
TINY_UNET = {"block_out_channels": "[32,64]", "down_block_types": '["DownBlock2D","AttnDownBlock2D"]',
             "up_block_types": '["AttnUpBlock2D","UpBlock2D"]', "layers_per_block": "1",
             "attention_head_dim": "null"}


def _meta_params(spec, values) -> int:
    return sum(p.numel() for p in spec.build_meta({**spec.defaults, **values}).parameters())


@pytest.mark.heavy
def test_unet2d_declared_constraints_exact_at_random_sizes():
    """diffusers:UNet2DModel with its declared constraints (G divides W; IMG a multiple of 2 for
    its one downsampling, which the up path concatenates with its skip) answers with nothing
    pinned (issue 30's Why: a U-Net crashed while probing; one with declared constraints was
    refused after 14 minutes), exact at random sizes of W's and IMG's classes; IMG equal to W in
    the request ties nothing (a probe whose deepest map is 1x1 ran other ops and tied IMG to W)."""
    spec = symcost.resolve("diffusers:UNet2DModel", config=TINY_UNET)
    assert spec.symbols == ("W", "G", "IMG", "C") and spec.moduli == {"W": 2, "IMG": 2}
    assert {(c.kind, c.a, c.b) for c in spec.constraints} == {("divides", "G", "W"), ("multiple", "IMG", 2)}
    # (IMG = W in the request is a coincidence, no regime: the probes break it and tie nothing)
    an = symcost.trace(spec, sizes={"B": 2, "W": 4, "G": 2, "IMG": 4, "C": 3}, precision="fp32",
                       torch_device="cpu", use_cache=False)
    assert not an.pinned and not an.regime_ties, (an.pin_reasons, an.regime_ties)
    rng = random.Random("unet2d")
    for _ in range(2):
        g = rng.randint(1, 3)
        v = {"B": rng.randint(2, 3), "G": g, "W": g * 2 * rng.randint(1, 2), "IMG": 2 * rng.randint(3, 6),
             "C": rng.randint(1, 4)}
        exact_at(an, spec, v, sdpa_math=True)
    with pytest.raises(symcost.SymcostError, match="G must divide W"):
        an.subs(W=6, G=4)


#: a one-level UNet2DConditionModel: a ResNet down and up block, the mid block's text
#: cross-attention (UNetMidBlock2DCrossAttn) between them: the cheapest conditional U-Net
TINY_COND = {"block_out_channels": "[32]", "down_block_types": '["DownBlock2D"]', "up_block_types": '["UpBlock2D"]',
             "layers_per_block": "1", "attention_head_dim": "2"}


@pytest.mark.heavy
def test_unet2d_condition_exact_at_random_sizes():
    """diffusers:UNet2DConditionModel (Stable Diffusion's U-Net: text states [B, S, XD] through
    cross-attention) answers with nothing pinned: IMG, C and XD were pinned at tiny sizes (the
    inputs' bytes B*(8*C*IMG^2 + 4*S*XD + 8), three terms over five symbols, beyond the fit's
    sparse search; now B times a cofactor, fit.Fitter._fit_factored); exact at random sizes of
    every symbol against FlopCounterMode, saved_tensors_hooks and a meta count."""
    spec = symcost.resolve("diffusers:UNet2DConditionModel", config=TINY_COND)
    assert spec.symbols == ("W", "G", "IMG", "C", "XD")
    an = symcost.trace(spec, sizes={"B": 2, "S": 3, "W": 4, "G": 2, "IMG": 5, "C": 3, "XD": 5}, precision="fp32",
                       torch_device="cpu", use_cache=False)
    assert not an.pinned, an.pin_reasons
    rng = random.Random("unet2d-cond")
    for _ in range(2):
        g = rng.randint(2, 3)
        v = {"B": rng.randint(2, 3), "S": rng.randint(2, 6), "G": g, "W": 2 * g * rng.randint(1, 2),
             "IMG": rng.randint(3, 9), "C": rng.randint(1, 4), "XD": rng.randint(2, 9)}
        exact_at(an, spec, v, sdpa_math=True)

@pytest.mark.heavy
def test_dit_exact_and_dit_xl2_published():
    """DiT-XL/2's published config (legacy class name Transformer2DModel, out_channels = 2C for
    the learned variance): H, D, L, C and NCLS are symbols, IMG pinned (its tokens' scores hold
    IMG^4 terms), exact at random sizes; at DiT-XL/2's sizes the formulas give the meta count of
    diffusers' module, the paper's 675M parameters once the 27 extra copies of the embedders are
    taken off, and its 118.6 GMACs forward at 256x256 (a 32x32 latent) once the embedders' 28
    extra calls are taken off (module docstring)."""
    spec = symcost.resolve(str(DATA / "dit-xl-2-256.json"))
    assert spec.symbols == ("H", "D", "L", "IMG", "C", "NCLS")
    assert spec.defaults == {"B": 8, "S": 1, "IMG": 32, "C": 4, "H": 16, "D": 72, "L": 28, "NCLS": 1000}
    an = symcost.trace(spec, sizes={"B": 2, "H": 2, "D": 4, "L": 2, "IMG": 32, "C": 3, "NCLS": 5},
                       precision="fp32", torch_device="cpu", use_cache=False)
    assert an.pinned == {"IMG": 32}, an.pinned
    rng = random.Random("dit")
    for _ in range(2):
        h = rng.randint(1, 3)
        v = {"B": rng.randint(2, 3), "H": h, "D": 4 * rng.randint(1, 2), "L": rng.randint(1, 3), "C": rng.randint(1, 4),
             "NCLS": rng.randint(2, 9)}
        exact_at(an, spec, v, sdpa_math=True)
    xl = {"B": 1, "H": 16, "D": 72, "L": 28, "C": 4, "NCLS": 1000}
    got = an.subs(**xl)
    assert got["params"] == _meta_params(spec, xl) == 749_826_464
    meta = spec.build_meta(spec.defaults).model
    emb = sum(p.numel() for p in meta.transformer_blocks[1].norm1.emb.parameters())
    assert round((got["params"] - 27 * emb) / 1e6) == 675
    # the embedders' MACs (FlopCounterMode on one call, meta tensors) run 28 times more in diffusers'
    # module than in the paper's (once per block, once more after the blocks)
    from torch.utils.flop_counter import FlopCounterMode

    t, y = torch.zeros(1, dtype=torch.long, device="meta"), torch.zeros(1, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as fc:
        meta.transformer_blocks[1].norm1.emb(t, y, hidden_dtype=torch.float32)
    assert round((got["flops.forward"] - 28 * fc.get_total_flops()) / 2 / 1e9, 1) == 118.6


def test_names_configs_and_errors(tmp_path, monkeypatch, capsys):
    """Class names and config files resolve to the class's symbols; the published DDPM CIFAR-10
    and SD v1.5 U-Net configs build to their 35.7M and 860M parameters (meta counts); an unknown class, an unknown config key,
    --attention and --task are one line each; without diffusers, one line naming it."""
    from conftest import run_cli
    from test_cli import assert_one_line_error

    ddpm = symcost.resolve(str(DATA / "ddpm-cifar10-32.json"))
    assert ddpm.symbols == ("W", "G", "IMG", "C") and ddpm.defaults == {"B": 8, "S": 1, "IMG": 32, "C": 3, "W": 128, "G": 32}
    assert _meta_params(ddpm, {}) == 35_746_307  # "35.7 million" (Ho et al. 2020)
    sd = symcost.resolve(str(DATA / "sd-v1-5-unet.json"))
    assert sd.symbols == ("W", "G", "IMG", "C", "XD") and sd.defaults["S"] == 77 and sd.defaults["XD"] == 768
    assert _meta_params(sd, {}) == 859_520_964
    unet = symcost.resolve("diffusers:UNet2DModel")
    assert unet.defaults["W"] == 224 and unet.moduli == {"W": 8, "IMG": 8}
    with pytest.raises(symcost.SymcostError, match="accepted: diffusers:UNet2DModel"):
        symcost.resolve("diffusers:VQModel")
    with pytest.raises(symcost.SymcostError, match="takes no config key 'nosuch'"):
        symcost.resolve("diffusers:DiTTransformer2DModel", config={"nosuch": "1"})
    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    assert_one_line_error(*run_cli(capsys, "eval", "diffusers:UNet2DModel", "--attention", "eager"),
                          "--attention applies to hf: models only")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"_class_name": "UNet2DModel", "sample_size": 30,
                               "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "DownBlock2D"],
                               "up_block_types": ["UpBlock2D", "UpBlock2D"]}))
    assert_one_line_error(*run_cli(capsys, "eval", str(cfg), "--task", "causal-lm"), "leave --task out")
    assert_one_line_error(*run_cli(capsys, "eval", str(cfg), "--set", "IMG=31"), "IMG must be a multiple of 2")
    monkeypatch.setitem(__import__("sys").modules, "diffusers", None)
    assert_one_line_error(*run_cli(capsys, "eval", "diffusers:UNet2DModel"), "pip install diffusers")

"""Non-decoder models of different families, written as a user writes them: one factory per model
(``tests/data/any_models.py:resnet``), each returning a ``symcost.ModelSpec`` with the model's own
sizes as symbols (docs/user-guide.md, "The factory contract"). tests/test_any_model.py checks
symcost's formulas for each against PyTorch measuring the same quantities.

Every model here is plain PyTorch (torch.nn and torch.nn.functional only); nothing in it knows
about symcost beyond the ModelSpec it returns.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from symcost import ModelSpec
from symcost.frontends.spec import Constraint


def _images(v, device, channels=3):
    return torch.randn(v["B"], channels, v["IMG"], v["IMG"], device=device)


def _classes(logits):
    return F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device) % logits.shape[-1])


# ------------------------------------------------------------------------------------------------
# 1. ResNet-style CNN: a strided stem, a 3x3/2 max-pool, basic blocks, a strided stage with a 1x1
#    projection shortcut, global average pooling (He et al. 2016, the basic block of ResNet-18/34)
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, C, L, NCLS):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 7, 2, 3, bias=False), nn.BatchNorm2d(C), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layers = nn.ModuleList(BasicBlock(C, C) for _ in range(L))
        self.down = BasicBlock(C, 2 * C, stride=2)
        self.fc = nn.Linear(2 * C, NCLS)

    def forward(self, x):
        x = self.stem(x)
        for block in self.layers:
            x = block(x)
        return self.fc(F.adaptive_avg_pool2d(self.down(x), 1).flatten(1))


def resnet():
    return ModelSpec(
        name="resnet", symbols=("C", "IMG", "L", "NCLS"),
        defaults={"B": 8, "S": 1, "C": 64, "IMG": 224, "L": 2, "NCLS": 1000},
        meanings={"C": "channels of the first stage", "IMG": "image side (pixels)", "L": "basic blocks of stage 1",
                  "NCLS": "classes", "B": "images per step", "S": "unused"},
        # stem /2, max-pool /2, stage 2 /2: sizes are polynomial in IMG on multiples of 8
        constraints=(Constraint("multiple", "IMG", 8, "IMG must be a multiple of 8 (three stride-2 steps)"),),
        build=lambda v: ResNet(v["C"], v["L"], v["NCLS"]),
        make_inputs=lambda v, device: ((_images(v, device),), {}),
        loss=lambda out, inputs: _classes(out))


# ------------------------------------------------------------------------------------------------
# 2. U-Net (Ronneberger et al. 2015): two down steps (max-pool), a bottleneck, two up steps
#    (transposed convolution), the skip connections concatenated; per-pixel regression (mse)
def _double(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, C, CIN):
        super().__init__()
        self.inc, self.down1, self.down2 = _double(CIN, C), _double(C, 2 * C), _double(2 * C, 4 * C)
        self.up2, self.conv2 = nn.ConvTranspose2d(4 * C, 2 * C, 2, stride=2), _double(4 * C, 2 * C)
        self.up1, self.conv1 = nn.ConvTranspose2d(2 * C, C, 2, stride=2), _double(2 * C, C)
        self.out = nn.Conv2d(C, CIN, 1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(F.max_pool2d(x1, 2))
        x3 = self.down2(F.max_pool2d(x2, 2))
        y = self.conv2(torch.cat([x2, self.up2(x3)], 1))
        y = self.conv1(torch.cat([x1, self.up1(y)], 1))
        return self.out(y)


def unet():
    return ModelSpec(
        name="unet", symbols=("C", "CIN", "IMG"),
        defaults={"B": 4, "S": 1, "C": 64, "CIN": 1, "IMG": 256},
        meanings={"C": "channels of the first level", "CIN": "image channels", "IMG": "image side (pixels)",
                  "B": "images per step", "S": "unused"},
        constraints=(Constraint("multiple", "IMG", 4, "IMG must be a multiple of 4 (two 2x2 pools, two 2x up-convolutions)"),),
        build=lambda v: UNet(v["C"], v["CIN"]),
        make_inputs=lambda v, device: ((_images(v, device, v["CIN"]),), {}),
        loss=lambda out, inputs: F.mse_loss(out, inputs[0][0]))


# ------------------------------------------------------------------------------------------------
# 3. MLP-Mixer (Tolstikhin et al. 2021): patches by a strided convolution, token-mixing and
#    channel-mixing MLPs with layer norms, global average pooling
class MixerBlock(nn.Module):
    def __init__(self, tokens, C, DT, DC):
        super().__init__()
        self.norm1, self.tok1, self.tok2 = nn.LayerNorm(C), nn.Linear(tokens, DT), nn.Linear(DT, tokens)
        self.norm2, self.ch1, self.ch2 = nn.LayerNorm(C), nn.Linear(C, DC), nn.Linear(DC, C)

    def forward(self, x):  # [B, tokens, C]
        y = self.norm1(x).transpose(1, 2)
        x = x + self.tok2(F.gelu(self.tok1(y))).transpose(1, 2)
        return x + self.ch2(F.gelu(self.ch1(self.norm2(x))))


class Mixer(nn.Module):
    PATCH = 4

    def __init__(self, C, DT, DC, IMG, L, NCLS):
        super().__init__()
        tokens = (IMG // self.PATCH) ** 2
        self.patch = nn.Conv2d(3, C, self.PATCH, self.PATCH)
        self.layers = nn.ModuleList(MixerBlock(tokens, C, DT, DC) for _ in range(L))
        self.norm, self.head = nn.LayerNorm(C), nn.Linear(C, NCLS)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def mixer():
    return ModelSpec(
        name="mlp-mixer", symbols=("C", "DT", "DC", "IMG", "L", "NCLS"),
        defaults={"B": 8, "S": 1, "C": 512, "DT": 256, "DC": 2048, "IMG": 224, "L": 8, "NCLS": 1000},
        meanings={"C": "channels (hidden width)", "DT": "token-mixing MLP width", "DC": "channel-mixing MLP width",
                  "IMG": "image side (pixels; patches of 4)", "L": "mixer blocks", "NCLS": "classes",
                  "B": "images per step", "S": "unused"},
        constraints=(Constraint("multiple", "IMG", 4, "IMG must be a multiple of the patch side 4"),),
        build=lambda v: Mixer(v["C"], v["DT"], v["DC"], v["IMG"], v["L"], v["NCLS"]),
        make_inputs=lambda v, device: ((_images(v, device),), {}),
        loss=lambda out, inputs: _classes(out))


# ------------------------------------------------------------------------------------------------
# 4. A bidirectional two-layer GRU over feature sequences [B, S, FEAT], per-step classification
class GRUTagger(nn.Module):
    def __init__(self, FEAT, D, NCLS):
        super().__init__()
        self.gru = nn.GRU(FEAT, D, num_layers=2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * D, NCLS)

    def forward(self, x):
        return self.out(self.gru(x)[0])


def gru():
    return ModelSpec(
        name="gru-tagger", symbols=("FEAT", "D", "NCLS"),
        defaults={"B": 16, "S": 100, "FEAT": 80, "D": 256, "NCLS": 40},
        meanings={"FEAT": "input features per step", "D": "hidden units per direction", "NCLS": "classes",
                  "S": "time steps"},
        build=lambda v: GRUTagger(v["FEAT"], v["D"], v["NCLS"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["FEAT"], device=device),), {}),
        loss=lambda out, inputs: _classes(out.flatten(0, 1)))


# ------------------------------------------------------------------------------------------------
# 5. MobileNet-style depthwise-separable CNN (Howard et al. 2017): depthwise 3x3 (groups = C)
#    then pointwise 1x1, ReLU6, strided blocks
class Separable(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.dw, self.bn1 = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin)
        self.pw, self.bn2 = nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu6(self.bn2(self.pw(F.relu6(self.bn1(self.dw(x))))))


class MobileNet(nn.Module):
    def __init__(self, C, L, NCLS):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, 2, 1, bias=False), nn.BatchNorm2d(C), nn.ReLU6())
        self.down = Separable(C, 2 * C, 2)
        self.layers = nn.ModuleList(Separable(2 * C, 2 * C, 1) for _ in range(L))
        self.fc = nn.Linear(2 * C, NCLS)

    def forward(self, x):
        x = self.down(self.stem(x))
        for block in self.layers:
            x = block(x)
        return self.fc(x.mean((2, 3)))


def mobilenet():
    return ModelSpec(
        name="mobilenet", symbols=("C", "IMG", "L", "NCLS"),
        defaults={"B": 8, "S": 1, "C": 32, "IMG": 224, "L": 5, "NCLS": 1000},
        meanings={"C": "stem channels", "IMG": "image side (pixels)", "L": "separable blocks at stride 1",
                  "NCLS": "classes", "B": "images per step", "S": "unused"},
        constraints=(Constraint("multiple", "IMG", 4, "IMG must be a multiple of 4 (two stride-2 steps)"),),
        build=lambda v: MobileNet(v["C"], v["L"], v["NCLS"]),
        make_inputs=lambda v, device: ((_images(v, device),), {}),
        loss=lambda out, inputs: _classes(out))


# ------------------------------------------------------------------------------------------------
# 6. PointNet / DeepSets (Qi et al. 2017; Zaheer et al. 2017): a shared per-point MLP over a set
#    of S points in 3-D, a symmetric pooling (max and sum), an MLP on the pooled vector
class PointNet(nn.Module):
    def __init__(self, D, NCLS):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(3, D), nn.ReLU(), nn.Linear(D, 2 * D), nn.ReLU())
        self.rho = nn.Sequential(nn.Linear(4 * D, D), nn.ReLU(), nn.Linear(D, NCLS))

    def forward(self, points):  # [B, S, 3]
        h = self.phi(points)
        return self.rho(torch.cat([h.max(1).values, h.sum(1)], -1))


def pointnet():
    return ModelSpec(
        name="pointnet", symbols=("D", "NCLS"),
        defaults={"B": 32, "S": 1024, "D": 64, "NCLS": 40},
        meanings={"D": "per-point feature width", "NCLS": "classes", "S": "points per set", "B": "sets per step"},
        build=lambda v: PointNet(v["D"], v["NCLS"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], 3, device=device),), {}),
        loss=lambda out, inputs: _classes(out))


# ------------------------------------------------------------------------------------------------
# 7. A variational autoencoder (Kingma & Welling 2014) on flattened inputs: the reparameterised
#    sample, a reconstruction (mse) and the KL term
class VAE(nn.Module):
    def __init__(self, X, HID, Z):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(X, HID), nn.ReLU())
        self.mu, self.logvar = nn.Linear(HID, Z), nn.Linear(HID, Z)
        self.dec = nn.Sequential(nn.Linear(Z, HID), nn.ReLU(), nn.Linear(HID, X), nn.Sigmoid())

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec(z), mu, logvar


def _vae_loss(out, inputs):
    recon, mu, logvar = out
    kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return F.mse_loss(recon, inputs[0][0]) + kl


def vae():
    return ModelSpec(
        name="vae", symbols=("X", "HID", "Z"),
        defaults={"B": 128, "S": 1, "X": 784, "HID": 400, "Z": 20},
        meanings={"X": "input features (pixels)", "HID": "hidden width", "Z": "latent size",
                  "B": "samples per step", "S": "unused"},
        build=lambda v: VAE(v["X"], v["HID"], v["Z"]),
        make_inputs=lambda v, device: ((torch.rand(v["B"], v["X"], device=device),), {}),
        loss=_vae_loss)


# ------------------------------------------------------------------------------------------------
# 8. WaveNet-style temporal CNN (van den Oord et al. 2016): causal dilated 1-D convolutions with
#    gated tanh/sigmoid units, residual and skip paths, a per-step softmax over NQ levels
class GatedLayer(nn.Module):
    def __init__(self, C, dilation):
        super().__init__()
        self.pad = dilation  # kernel 2: (2 - 1) * dilation steps of the past
        self.conv = nn.Conv1d(C, 2 * C, 2, dilation=dilation)
        self.res, self.skip = nn.Conv1d(C, C, 1), nn.Conv1d(C, C, 1)

    def forward(self, pair):
        x, skip = pair
        f, g = self.conv(F.pad(x, (self.pad, 0))).chunk(2, 1)
        h = torch.tanh(f) * torch.sigmoid(g)
        return x + self.res(h), skip + self.skip(h)


class WaveNet(nn.Module):
    def __init__(self, C, NQ, L):
        super().__init__()
        self.embed = nn.Conv1d(NQ, C, 1)
        self.layers = nn.Sequential(*[GatedLayer(C, 2 ** (i % 4)) for i in range(L)])
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(C, C, 1), nn.ReLU(), nn.Conv1d(C, NQ, 1))

    def forward(self, x):  # one-hot [B, NQ, S]
        h = self.embed(x)
        _, skip = self.layers((h, torch.zeros_like(h)))
        return self.head(skip)


def _wavenet_inputs(v, device):
    levels = torch.randint(0, v["NQ"], (v["B"], v["S"]), device=device)
    return (F.one_hot(levels, v["NQ"]).transpose(1, 2).float(),), {}


def wavenet():
    return ModelSpec(
        name="wavenet", symbols=("C", "NQ", "L"),
        defaults={"B": 4, "S": 4000, "C": 64, "NQ": 256, "L": 8},
        meanings={"C": "residual channels", "NQ": "quantisation levels", "L": "gated layers (dilations 1, 2, 4, 8, ...)",
                  "S": "samples per sequence", "B": "sequences per step"},
        build=lambda v: WaveNet(v["C"], v["NQ"], v["L"]),
        make_inputs=_wavenet_inputs,
        loss=lambda out, inputs: F.cross_entropy(out, inputs[0][0].argmax(1)))


# ------------------------------------------------------------------------------------------------
# 9. torch.nn.TransformerEncoder (post-norm, ReLU, PyTorch's own layer), token classification
class Encoder(nn.Module):
    def __init__(self, V, H, D, F_, L, NCLS):
        super().__init__()
        self.embed = nn.Embedding(V, H * D)
        layer = nn.TransformerEncoderLayer(H * D, H, F_, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.head = nn.Linear(H * D, NCLS)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


def transformer_encoder():
    return ModelSpec(
        name="nn-transformer-encoder", symbols=("V", "H", "D", "F", "L", "NCLS"),
        defaults={"B": 8, "S": 128, "V": 30000, "H": 8, "D": 64, "F": 2048, "L": 6, "NCLS": 2},
        meanings={"NCLS": "classes"},
        constraints=(),
        build=lambda v: Encoder(v["V"], v["H"], v["D"], v["F"], v["L"], v["NCLS"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: _classes(out))


# ------------------------------------------------------------------------------------------------
# 10. A diffusion denoiser (Ho et al. 2020, the DDPM training objective): sinusoidal time
#     embedding through an MLP, residual blocks with GroupNorm and SiLU that add the time
#     embedding per channel, trained to predict the noise (mse)
class TimeBlock(nn.Module):
    def __init__(self, C, TEMB):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(2, C), nn.Conv2d(C, C, 3, padding=1)
        self.time = nn.Linear(TEMB, C)
        self.norm2, self.conv2 = nn.GroupNorm(2, C), nn.Conv2d(C, C, 3, padding=1)

    def forward(self, pair):
        x, t = pair
        h = self.conv1(F.silu(self.norm1(x))) + self.time(t)[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h))), t


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], -1)


class Denoiser(nn.Module):
    def __init__(self, C, TEMB, L):
        super().__init__()
        self.temb = TEMB
        self.time_mlp = nn.Sequential(nn.Linear(TEMB, TEMB), nn.SiLU(), nn.Linear(TEMB, TEMB))
        self.inp = nn.Conv2d(3, C, 3, padding=1)
        self.layers = nn.Sequential(*[TimeBlock(C, TEMB) for _ in range(L)])
        self.out = nn.Sequential(nn.GroupNorm(2, C), nn.SiLU(), nn.Conv2d(C, 3, 3, padding=1))

    def forward(self, x0, t, noise):
        """The noise predicted for x0 noised to step t of 1000 (a cosine schedule)."""
        abar = torch.cos((t.float() / 1000 + 0.008) / 1.008 * math.pi / 2)[:, None, None, None] ** 2
        noisy = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
        temb = self.time_mlp(timestep_embedding(t, self.temb))
        h, _ = self.layers((self.inp(noisy), temb))
        return self.out(h)


def denoiser():
    return ModelSpec(
        name="ddpm-denoiser", symbols=("C", "TEMB", "IMG", "L"),
        defaults={"B": 16, "S": 1, "C": 64, "TEMB": 128, "IMG": 32, "L": 4},
        meanings={"C": "channels", "TEMB": "time-embedding width", "IMG": "image side (pixels)",
                  "L": "residual blocks", "B": "images per step", "S": "unused"},
        constraints=(Constraint("multiple", "C", 2, "C must be a multiple of 2 (GroupNorm's 2 groups)"),
                     Constraint("multiple", "TEMB", 2, "TEMB must be even (sines and cosines)")),
        build=lambda v: Denoiser(v["C"], v["TEMB"], v["L"]),
        make_inputs=lambda v, device: ((_images(v, device), torch.randint(0, 1000, (v["B"],), device=device),
                                        _images(v, device)), {}),
        loss=lambda out, inputs: F.mse_loss(out, inputs[0][2]))


# ------------------------------------------------------------------------------------------------
# 11. A capsule network (Sabour et al. 2017): primary capsules from a convolution, three
#     iterations of routing by agreement, the squash non-linearity, a margin loss
def squash(s, dim=-1):
    n2 = (s * s).sum(dim, keepdim=True)
    return n2 / (1 + n2) * s / torch.sqrt(n2 + 1e-8)


class CapsNet(nn.Module):
    def __init__(self, C, IMG, PD, NCLS, OD):
        super().__init__()
        self.conv = nn.Conv2d(1, C, 3, padding=1)
        self.primary = nn.Conv2d(C, 4 * PD, 3, stride=2, padding=1)  # 4 capsule maps of PD dims
        self.pd, n_in = PD, 4 * (IMG // 2) ** 2
        self.W = nn.Parameter(0.01 * torch.randn(n_in, NCLS, OD, PD))

    def forward(self, x):
        u = self.primary(F.relu(self.conv(x)))  # [B, 4 PD, IMG/2, IMG/2]
        b = u.shape[0]
        u = squash(u.view(b, 4, self.pd, -1).permute(0, 1, 3, 2).reshape(b, -1, self.pd))  # [B, n_in, PD]
        u_hat = torch.einsum("ncop,bnp->bnco", self.W, u)  # [B, n_in, NCLS, OD]
        logits = torch.zeros(u_hat.shape[:3], device=x.device)
        for _ in range(3):
            c = logits.softmax(2)
            v = squash((c.unsqueeze(-1) * u_hat).sum(1))  # [B, NCLS, OD]
            logits = logits + (u_hat * v.unsqueeze(1)).sum(-1)
        return v.norm(dim=-1)


def _margin_loss(lengths, inputs):
    target = F.one_hot(torch.arange(lengths.shape[0], device=lengths.device) % lengths.shape[1], lengths.shape[1])
    return (target * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - target) * F.relu(lengths - 0.1) ** 2).sum(1).mean()


def capsnet():
    return ModelSpec(
        name="capsnet", symbols=("C", "IMG", "PD", "NCLS", "OD"),
        defaults={"B": 16, "S": 1, "C": 256, "IMG": 28, "PD": 8, "NCLS": 10, "OD": 16},
        meanings={"C": "convolution channels", "IMG": "image side (pixels)", "PD": "primary capsule dims",
                  "NCLS": "classes (output capsules)", "OD": "output capsule dims", "B": "images per step",
                  "S": "unused"},
        constraints=(Constraint("multiple", "IMG", 2, "IMG must be even (the primary capsules' stride 2)"),),
        build=lambda v: CapsNet(v["C"], v["IMG"], v["PD"], v["NCLS"], v["OD"]),
        make_inputs=lambda v, device: ((_images(v, device, 1),), {}),
        loss=_margin_loss)


# ------------------------------------------------------------------------------------------------
# 12. A recommender in the style of DLRM (Naumov et al. 2019): embedding-bag tables of sparse
#     features (mean of each sample's ids), a bottom MLP of the dense features, their pairwise dot
#     products, a top MLP, a click logit under binary cross-entropy
class DLRM(nn.Module):
    TABLES = 3

    def __init__(self, ROWS, DE, DENSE):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, DE, mode="mean") for _ in range(self.TABLES))
        self.bottom = nn.Sequential(nn.Linear(DENSE, 2 * DE), nn.ReLU(), nn.Linear(2 * DE, DE), nn.ReLU())
        n = self.TABLES + 1
        self.top = nn.Sequential(nn.Linear(DE + n * (n - 1) // 2, 2 * DE), nn.ReLU(), nn.Linear(2 * DE, 1))

    def forward(self, dense, ids):  # dense [B, DENSE], ids [TABLES, B, S] (S ids per sample and table)
        feats = [self.bottom(dense)] + [t(i) for t, i in zip(self.tables, ids)]
        z = torch.stack(feats, 1)  # [B, n, DE]
        dots = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], 1, device=z.device)
        return self.top(torch.cat([feats[0], dots[:, i, j]], 1)).squeeze(1)


def dlrm():
    return ModelSpec(
        name="dlrm", symbols=("ROWS", "DE", "DENSE"),
        defaults={"B": 128, "S": 4, "ROWS": 100000, "DE": 64, "DENSE": 13},
        meanings={"ROWS": "rows per embedding table", "DE": "embedding width", "DENSE": "dense features",
                  "S": "ids per sample and table", "B": "samples per step"},
        build=lambda v: DLRM(v["ROWS"], v["DE"], v["DENSE"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["DENSE"], device=device),
                                        torch.randint(0, v["ROWS"], (DLRM.TABLES, v["B"], v["S"]), device=device)), {}),
        loss=lambda out, inputs: F.binary_cross_entropy_with_logits(out, (torch.arange(out.shape[0], device=out.device) % 2).float()))

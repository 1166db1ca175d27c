"""Transcendental function evaluations (exp, log, erf, tanh, sin, sqrt) per op and per model,
against the mathematics of each op (an exp per softmax element, an erf and an exp per exact-GELU
gradient element, one exp per attention score in FlashAttention's forward and backward: Dao et
al. 2022, Alg. 1 and 4), and the roofline's special-function ceiling against FlashAttention-3's
published H100 figures (Shah et al. 2024, arXiv:2407.08608, sec. 3)."""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli as cli
from symcost.hardware import devices as dv
from symcost.passes import roofline as rl
from symcost.errors import SymcostError
from symcost.validation.validate import kernel_costs


def _counts(fn, *args, backward=False):
    """{class: evaluations} summed over the aten ops ``fn`` runs (and its backward)."""
    if backward:
        args = tuple(a.detach().requires_grad_(True) for a in args)

        def run(*a):
            out = fn(*a)
            out.backward(torch.ones_like(out))

        costs = kernel_costs(run, *args, grad=True)
    else:
        costs = kernel_costs(fn, *args)
    total: dict[str, int] = {}
    for c in costs:
        for k, n in c["transcendentals"].items():
            total[k] = total.get(k, 0) + n
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_op_counts_are_the_ops_mathematics(seed):
    rng = random.Random(seed)
    b, s, d = rng.randint(1, 5), rng.randint(2, 33), rng.randint(2, 40)
    x = torch.randn(b, s, d)
    n = x.numel()
    assert _counts(torch.exp, x) == {"exp": n}
    assert _counts(torch.sigmoid, x) == {"exp": n}
    assert _counts(torch.tanh, x) == {"tanh": n}
    assert _counts(F.gelu, x) == {"erf": n}
    assert _counts(lambda a: F.gelu(a, approximate="tanh"), x) == {"tanh": n}
    assert _counts(lambda a: torch.softmax(a, -1), x) == {"exp": n}
    # log-softmax: an exp per element and a log per row (x - max - log(sum(exp)))
    assert _counts(lambda a: torch.log_softmax(a, -1), x) == {"exp": n, "log": b * s}
    assert _counts(lambda a: a.abs().sqrt(), x) == {"sqrt": n}
    assert _counts(lambda a: a ** 2, x) == {}  # an integer power is multiplies
    assert _counts(lambda a: a.abs() ** 0.5, x) == {"sqrt": n}
    assert _counts(lambda a: a.abs() ** 1.7, x) == {"exp": n, "log": n}  # exp(1.7 log |a|)
    # layer norm: one reciprocal square root per normalised row
    assert _counts(lambda a: F.layer_norm(a, (d,)), x) == {"sqrt": b * s}
    # backward passes: d sigmoid / d x needs the output only; exact GELU's needs Φ(x) and φ(x)
    assert _counts(torch.sigmoid, x, backward=True) == {"exp": n}
    assert _counts(F.gelu, x, backward=True) == {"erf": 2 * n, "exp": n}
    assert _counts(F.silu, x, backward=True) == {"exp": 2 * n}
    assert _counts(lambda a: torch.softmax(a, -1), x, backward=True) == {"exp": n}


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_attention_has_one_exp_per_score_forward_and_backward(seed):
    rng = random.Random(seed)
    B, H, Sq, Sk, D = rng.randint(1, 3), rng.randint(1, 4), rng.randint(2, 40), rng.randint(2, 40), rng.choice((8, 16))
    q, k, v = torch.randn(B, H, Sq, D), torch.randn(B, H, Sk, D), torch.randn(B, H, Sk, D)
    fwd = _counts(F.scaled_dot_product_attention, q, k, v)
    assert fwd == {"exp": B * H * Sq * Sk}
    both = _counts(F.scaled_dot_product_attention, q, k, v, backward=True)
    assert both == {"exp": 2 * B * H * Sq * Sk}


def test_lstm_gate_activations():
    rng = random.Random(5)
    S, B, I, Hd = rng.randint(2, 6), rng.randint(1, 3), rng.randint(3, 9), rng.randint(3, 12)
    lstm = torch.nn.LSTM(I, Hd)
    with torch.no_grad():
        got = _counts(lambda a: lstm(a)[0], torch.randn(S, B, I))
    # per step and hidden unit: sigmoid input, forget and output gates, tanh cell gate, tanh(c)
    assert got == {"exp": 3 * S * B * Hd, "tanh": 2 * S * B * Hd}


def test_gpt2_totals_by_hand(capsys):
    """GPT-2 (tanh GELU on 4·d, two layer norms per block and a final one, softmax attention,
    cross-entropy): forward L·(B·H·S² + 4·B·S·d + 2·B·S) + B·S + B·S·V + B·S; backward
    L·4·B·S·d (the tanh GELU's gradient) + B·S·V (log-softmax's gradient: exp of its output)."""
    rng = random.Random(7)
    for _ in range(2):
        B, S, H, D, L, V = rng.randint(1, 4), rng.randint(3, 30), rng.choice((2, 4, 6)), rng.choice((4, 8, 16)), rng.randint(1, 4), rng.randint(20, 200)
        code, out, err = cli(capsys, "eval", "gpt2", "--set", f"B={B}", f"S={S}", f"H={H}", f"D={D}", f"L={L}",
                             f"V={V}", "--json")
        assert code == 0, err
        t = json.loads(out)["transcendentals"]
        d = H * D
        fwd = L * (B * H * S * S + 4 * B * S * d + 2 * B * S) + B * S + B * S * V + B * S
        bwd = L * 4 * B * S * d + B * S * V
        assert (t["forward"], t["backward"], t["train"]) == (fwd, bwd, fwd + bwd), (B, S, H, D, L, V)


def test_h100_attention_exp_takes_half_the_matmul_time_at_head_dim_128():
    """FlashAttention-3, sec. 3: on an H100 SXM5, 989 TFLOPS of FP16 matmul but 3.9 TFLOPS of
    special functions; at head dimension 128 the forward does 512 matmul FLOPs per exp (4·D), so
    the exps take about half the matmul time. symcost's rules and catalogue give the same ratio."""
    from symcost.graph import rules

    aten = torch.ops.aten
    h = dv.get_device("h100")
    B, H, S, D = 2, 16, 4096, 128
    v = rules.OpView(aten._scaled_dot_product_flash_attention.default, "sdpa", [(B, H, S, D)] * 3,
                     [torch.bfloat16] * 3, [(B, H, S, D)], [torch.bfloat16], ((B, H, S, D),) * 3, {})
    c = rules.cost(v)
    t_exp = h.transcendental_seconds(c.transcendentals)
    t_mm = c.flops / h.peak_for("bf16")[0]
    assert c.flops / c.transcendental_total == 4 * D
    assert t_exp / t_mm == pytest.approx(0.5, rel=0.02)
    # at head dimension 64 the two ceilings meet: the op is as much exp-bound as matmul-bound
    r = rl.bound_of(c.flops // 2, c.bytes, h.peak_for("bf16")[0], h.bandwidth,
                    transcendental_seconds=t_exp)
    assert r["bound"] in ("compute", "transcendental") and r["seconds"] == pytest.approx(max(t_exp, t_mm / 2))


def test_bound_of_ceilings_and_serial_passes():
    peak, bw = 100e9, 20e9
    # memory 1 s, compute 0.5 s, transcendentals 0.8 s
    r = rl.bound_of(50e9, 20e9, peak, bw, transcendental_seconds=0.8)
    assert r["bound"] == "memory" and r["seconds"] == pytest.approx(1.0)
    r = rl.bound_of(50e9, 20e9, peak, bw, transcendental_seconds=1.5)
    assert r["bound"] == "transcendental" and r["seconds"] == pytest.approx(1.5)
    assert r["attainable"] == pytest.approx(50e9 / 1.5)
    # dependent passes on a serial device: memory time + the larger of the others
    r = rl.bound_of(50e9, 20e9, peak, bw, transcendental_seconds=0.8, serial=True)
    assert r["seconds"] == pytest.approx(1.8) and r["bound"] == "memory"


def test_devices_file_transcendentals_and_serial_passes(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('[box]\nfp32 = "1T"\nbandwidth = "100G"\nserial_passes = true\n'
                 '[box.transcendentals]\nexp = "2G"\nerf = 1e9\nall = "4G"\n')
    d = dv.get_device("box", str(f))
    assert d.serial_passes
    assert d.transcendental_seconds({"exp": 4e9, "erf": 1e9, "tanh": 4e9}) == pytest.approx(2 + 1 + 1)
    assert d.to_json()["transcendentals"] == {"exp": 2e9, "erf": 1e9, "all": 4e9}
    back = tmp_path / "back.json"
    dv.write_file({"box": {"fp32": 1e12, "bandwidth": 1e11, "transcendentals": d.to_json()["transcendentals"],
                           "serial_passes": True}}, str(back))  # what calibrate --out writes
    assert dv.get_device("box", str(back)).transcendental_rate == d.transcendental_rate
    f.write_text('[box]\nfp32 = 1e12\nbandwidth = 1e11\n[box.transcendentals]\ncosh = 1e9\n')
    with pytest.raises(SymcostError, match="unknown transcendental class 'cosh'; accepted: exp, log"):
        dv.get_device("box", str(f))
    f.write_text('[box]\nfp32 = 1e12\nbandwidth = 1e11\nserial_passes = "yes"\n')
    with pytest.raises(SymcostError, match="serial_passes must be true or false"):
        dv.get_device("box", str(f))
    # catalogue: the NVIDIA figures are given, the others left out (not timed, and said so)
    cat = dv.catalogue()
    assert cat["h100-sxm"].transcendental_rate == {"all": 3.9e12}
    assert not cat["tpu-v4"].transcendental_rate


def test_roofline_says_when_a_device_does_not_time_transcendentals(traced):
    an = traced("mlp", "fp32")
    r = rl.roofline(an, dv.get_device("tpu-v4"), {"B": 2, "S": 16, "D": 64, "L": 2})
    assert any("no transcendental rate" in n for n in r["notes"])
    r = rl.roofline(an, dv.get_device("a100"), {"B": 2, "S": 16, "D": 64, "L": 2})
    assert not any("no transcendental rate" in n for n in r["notes"])
    gelu = [n for n in r["nodes"] if n["op"].startswith("aten.gelu")]
    assert gelu and all(n["transcendentals"] == 2 * 16 * 64 or n["transcendentals"] == 2 * 2 * 16 * 64 for n in gelu)

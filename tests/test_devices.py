"""The device catalogue and user devices: data with sources, lookups, files, flags, errors."""
from __future__ import annotations

import json
import re

import pytest

from symcost.hardware import devices as dv
from conftest import run_cli as cli
from symcost.errors import SymcostError

ISSUE_DEVICES = {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x", "tpu-v4",
                 "tpu-v5e", "tpu-v5p"}


def test_catalogue_has_the_issue_devices_with_sources():
    cat = dv.catalogue()
    assert ISSUE_DEVICES <= set(cat)
    for d in cat.values():
        assert d.source.startswith("https://"), d.key
        assert re.fullmatch(r"\d{4}-\d{2}", d.date), d.key
        assert d.bandwidth > 1e11 and d.memory > 1e10
        assert "bf16" in d.peak
        # dense figures: never above the hardware's FP8 rate, and bf16/fp16 at least the fp32 rate
        for p, v in d.peak.items():
            assert v > 1e12
        if "fp32" in d.peak:
            assert d.peak["bf16"] >= d.peak["fp32"]
        if "fp8" in d.peak:
            assert d.peak["fp8"] == pytest.approx(2 * d.peak["bf16"], rel=0.01)  # dense fp8 = 2x dense bf16


def test_dense_not_sparse_figures():
    """The catalogue holds the dense figures: NVIDIA's datasheets print H100 SXM BF16 as 1979
    TFLOPS *with sparsity*; dense is half (and A100's dense 312 is the unstarred figure)."""
    cat = dv.catalogue()
    assert cat["h100-sxm"].peak["bf16"] == pytest.approx(1979e12 / 2, rel=1e-3)
    assert cat["a100-80gb"].peak["bf16"] == 312e12
    assert cat["tpu-v4"].peak["bf16"] == 275e12  # the figure PaLM's MFU uses (Chowdhery et al. 2022, App. B)


def test_aliases_and_fallback():
    assert dv.get_device("h100").key == "h100-sxm"
    assert dv.get_device("H100-SXM").key == "h100-sxm"
    tpu = dv.get_device("tpu-v4")
    peak, used = tpu.peak_for("fp32")
    assert used == "bf16" and peak == 275e12
    h = dv.get_device("h100")
    assert h.ridge("bf16") == pytest.approx(h.peak["bf16"] / h.bandwidth)


def test_custom_device_from_flags_and_overrides():
    d = dv.get_device(None, None, "100T", "2TB/s")
    assert d.peak["bf16"] == 100e12 and d.bandwidth == 2e12
    d = dv.get_device("h100", None, None, "1e12")
    assert d.bandwidth == 1e12 and d.peak["bf16"] == dv.catalogue()["h100-sxm"].peak["bf16"]
    with pytest.raises(SymcostError, match="--peak-flops"):
        dv.get_device(None, None, "-5", "1e12")
    with pytest.raises(SymcostError, match="no device"):
        dv.get_device(None, None, "1e12", None)


def test_unknown_device_lists_accepted():
    with pytest.raises(SymcostError, match="accepted: a100-40gb"):
        dv.get_device("h900")


def test_devices_file_json_and_toml(tmp_path):
    entry = {"mybox": {"name": "my box", "fp32": 1e12, "bandwidth": "50GB/s", "source": "me", "date": "2026-01"}}
    j = tmp_path / "d.json"
    dv.write_file(entry, str(j))
    d = dv.get_device(None, str(j))
    assert d.key == "mybox" and d.bandwidth == 50e9 and d.peak == {"fp32": 1e12}
    assert d.peak_for("bf16") == (1e12, "fp32")
    t = tmp_path / "d.toml"
    t.write_text('[edge]\nbf16 = "10T"\nbandwidth = 1e11\n')
    assert dv.get_device("edge", str(t)).peak["bf16"] == 10e12
    t.write_text('[edge]\nbf16 = 10e12\n')
    with pytest.raises(SymcostError, match="no bandwidth"):
        dv.get_device("edge", str(t))
    t.write_text('[edge]\nbf16 = 10e12\nbandwidth = 1e11\nsparsity = 2\n')
    with pytest.raises(SymcostError, match="unknown field 'sparsity'"):
        dv.get_device("edge", str(t))
    with pytest.raises(SymcostError, match="not found"):
        dv.get_device("x", str(tmp_path / "missing.toml"))




def test_cli_devices_lists_catalogue_and_errors_are_one_line(tmp_path, capsys):
    code, out, err = cli(capsys, "devices", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert ISSUE_DEVICES <= set(data["devices"])
    assert data["devices"]["h100-sxm"]["ridge"]["bf16"] == pytest.approx(989.5e12 / 3.35e12)
    code, out, err = cli(capsys, "devices")
    assert code == 0 and "tpu-v5p" in out and "nvidia" in out.lower()
    bad = tmp_path / "bad.toml"
    bad.write_text("[x\n")
    code, out, err = cli(capsys, "devices", "--devices-file", str(bad))
    assert code == 2 and err.startswith("symcost: error:") and "TOML" in err
    assert len(err.strip().splitlines()) == 1


def test_a_file_of_several_devices_needs_device_and_says_which(tmp_path):
    f = tmp_path / "lab.toml"
    f.write_text('[one]\nfp32 = 1e12\nbandwidth = 1e11\n[two]\nfp32 = 2e12\nbandwidth = 1e11\n')
    with pytest.raises(SymcostError, match=r"holds 2 devices \(one, two\): pick one with --device NAME"):
        dv.get_device(None, str(f))
    assert dv.get_device("two", str(f)).peak["fp32"] == 2e12

"""``symcost explore``: the page renders in headless Chromium (Debian's chromium, driven by
playwright) without a console error or a network request, its sliders move its numbers, and every
number it shows equals the CLI's JSON (``report``, ``report --dp --shard``, ``report --ac full``,
``roofline``, ``checkpoint``) at the same sizes, formatted as the CLI's text formats it, at 5
random points per page (cs336-lm with FSDP over DP; a small hf:llama with --ac full and its KV
cache, ``serve --json``).

A browser that cannot start fails the test (CI installs chromium: .ci/run)."""
from __future__ import annotations

import json
import os
import random

import pytest
from playwright.sync_api import sync_playwright

from symcost import SYMS, parse_formula
from symcost.render.report import human

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LLAMA = ("L=2", "H=4", "D=32", "K=2", "F=256", "V=512")  # a small Llama: the traces take seconds
DEVICES = {"h100-sxm": 80e9, "a100-80gb": 80e9, "h200": 141e9, "mi300x": 192e9}


def _cli(*args: str) -> tuple[int, str]:
    """``symcost ARGS`` in-process: (exit code, stdout)."""
    import contextlib
    import io

    from symcost.cli import main

    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()


def _json(*args: str) -> dict:
    code, out = _cli(*args, "--json")
    assert code == 0, (args, out)
    return json.loads(out)


@pytest.fixture(scope="module")
def browser():
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} missing: apt-get install -y chromium (the CI does)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Two pages: cs336-lm (one device and FSDP over DP) and a small Llama (hf:llama with grouped-query
    attention; one device, with and without --ac full, and its decode step's KV cache)."""
    d = tmp_path_factory.mktemp("explore")
    out = {}
    for model, extra in (("cs336-lm", ("--layout", "none,fsdp", "--ac", "none")),
                         ("hf:llama", ("--layout", "none", "--ac", "none,full", "--set", *LLAMA))):
        path = d / f"{model.replace(':', '_')}.html"
        code, text = _cli("explore", model, *extra, "--out", str(path))
        assert code == 0 and path.exists(), text
        out[model] = path
    return out


def _open(browser, path):
    page = browser.new_page(viewport={"width": 1250, "height": 1500})
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith("file:") else None)
    page.goto(path.as_uri())
    page.wait_for_selector("#v-flops-train")
    return page, errors, requests


def _set(page, sym, value):
    page.fill(f"#in-{sym}", str(value))
    page.dispatch_event(f"#in-{sym}", "change")


def _text(page, key):
    return page.text_content(f"#v-{key}")


def test_page_is_self_contained_and_sliders_move(browser, pages):
    html = pages["cs336-lm"].read_text()
    assert "<script src" not in html and "<link" not in html and "http://" not in html.split("uPlot")[0]
    page, errors, requests = _open(browser, pages["cs336-lm"])
    before = (_text(page, "mem-peak"), _text(page, "flops-train"), page.input_value("#in-B"))
    updates = int(page.get_attribute("body", "data-updates"))
    page.focus("#ctl-B")
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    assert int(page.input_value("#in-B")) == int(before[2]) + 3  # the slider moved its number box
    assert int(page.get_attribute("body", "data-updates")) == updates + 3
    assert _text(page, "mem-peak") != before[0] and _text(page, "flops-train") != before[1]
    assert page.query_selector_all(".plot canvas"), "no plot drawn"
    assert not errors and not requests, (errors, requests)
    page.close()


def _check_point(page, model, B, S, device, layout, ac, DP, law: bool):
    page.select_option("#layout", layout)
    page.select_option("#ac", ac)
    page.select_option("#device", device)
    _set(page, "B", B)
    _set(page, "S", S)
    sets = ["--set", f"B={B}", f"S={S}"]
    if model == "hf:llama":
        sets += list(LLAMA)
    par = ["--ac", ac] if ac != "none" else []
    if layout != "none":
        _set(page, "DP", DP)
        par += ["--dp", str(DP), "--shard", layout]
        js = _json("report", model, *sets, *par)
        mem = js["parallel"]["memory_per_rank"]
        for k in ("params", "grads", "optimizer_state", "master", "activations"):
            assert _text(page, f"mem-{k}") == human(mem[k], "B"), (k, B, S, DP)
        assert _text(page, "mem-peak") == human(js["parallel"]["memory"]["peak"], "B")
        assert _text(page, "comm") == human(js["comm"]["total"], "B")
    else:
        cap = str(int(DEVICES[device]))
        js = _json("report", model, *sets, *par, "--memory", cap)
        mem = js["memory"]
        for k in ("params", "grads", "optimizer", "master_weights", "buffers", "inputs", "activations", "peak"):
            assert _text(page, f"mem-{k}") == human(mem[k], "B"), (k, B, S)
        assert _text(page, "max-batch") == str(mem["max_batch"])
    for ph in ("forward", "backward", "train"):
        assert _text(page, f"flops-{ph}") == human(js["flops"][ph], "FLOP"), ph
    rf = _json("roofline", model, *sets, "--device", device)["roofline"]
    assert _text(page, "step") == f"{rf['step_seconds'] * 1e3:.4f} ms"
    assert _text(page, "mfu") == f"{100 * rf['mfu_ceiling']:.2f}%"
    if model == "hf:llama":  # serve's KV cache (its decode step, bf16 weights) at context S
        kv = _json("serve", model, "--set", *LLAMA, "--no-prefill", "--device", device, "--context", str(S))["kv"]
        tok = kv["per_token"]
        assert _text(page, "kv-token") == (f"{tok:,} B" if isinstance(tok, int) else f"{tok:.1f} B")
        assert _text(page, "kv-sequence") == human(kv["per_sequence"], "B")
    if law:
        ck = _json("checkpoint", model, *sets, "--plan", "none")["checkpoint"]
        for k, unit in (("a", "B"), ("x", "B"), ("f", "FLOP")):
            assert _text(page, f"law-{k}") == human(ck["block"][k], unit), k
        assert _text(page, "law-kstar") == f"{ck['k_star']:.3f}"
        env = {SYMS[k]: v["value"] for k, v in js["symbols"].items()}
        mstar = float(parse_formula(ck["law"]["memory_star"]).subs(env))
        assert _text(page, "law-mstar") == human(mstar, "B")


@pytest.mark.parametrize("model", ["cs336-lm", "hf:llama"])
def test_every_number_equals_the_cli(browser, pages, model):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    page, errors, requests = _open(browser, pages[model])
    layouts = [o.get_attribute("value") for o in page.query_selector_all("#layout option")]
    acs = [o.get_attribute("value") for o in page.query_selector_all("#ac option")]
    if model == "cs336-lm":  # (a value on an exact tie: the block's x at B=19 S=96 is 3.5625 MiB, which
        # Python prints 3.562, to even, and Number.toFixed 3.563)
        _check_point(page, model, 19, 96, sorted(DEVICES)[0], layouts[0], acs[0], 2, law=True)
    for i in range(5):
        B, S = rng.randint(2, 24), rng.choice([64, 96, 128, 192, 256, 384, 512])
        device = rng.choice(sorted(DEVICES))
        layout, ac = layouts[i % len(layouts)], acs[(i // len(layouts)) % len(acs)]  # each at least once
        DP = rng.choice([2, 4, 8])
        try:
            _check_point(page, model, B, S, device, layout, ac, DP, law=i == 0)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, point {i}: B={B} S={S} {device} {layout} ac={ac} DP={DP}: {e}") from e
    assert not errors and not requests, (errors, requests)
    page.close()


def test_bad_input_is_one_line(tmp_path, capsys):
    from symcost.cli import main

    for args in (("--layout", "tp"), ("--ac", "sometimes"), ("--device", "no-such-gpu"),
                 ("--layout", "none", "--ac", "none", "--out", str(tmp_path / "no-dir" / "x.html"))):
        with pytest.raises(SystemExit) as e:
            main(["explore", "cs336-lm", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("symcost: error:") and err.count("\n") == 1, (args, err)
    assert not list(tmp_path.rglob("*.html"))


def test_repr_html_is_the_same_view():
    import symcost

    an = symcost.trace("cs336-lm")
    view = an._repr_html_()
    assert view.startswith("<iframe srcdoc=") and "uPlot" in view and "SYMCOST" in view
    assert symcost.explore(an).html.count("<script>") == 3

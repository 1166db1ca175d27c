"""The documentation's examples run as written (issue 7, item 7).

Every fenced ```python block of README.md and docs/*.md that the line before marks with
``<!-- runnable -->`` is executed, top to bottom, in a fresh namespace and a scratch directory
(the examples write files). ``symcost.trace`` is the session's cached one (same arguments, same
Analysis), so an example costs no more than the traces other tests share.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import symcost

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runnable -->"
BLOCK = re.compile(r"^" + re.escape(MARK) + r"\s*\n```python[^\n]*\n(.*?)^```", re.M | re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        blocks = BLOCK.findall(text)
        # a marker must sit right above a python block: a stray one is a mistake in the docs
        marks = sum(line.strip() == MARK for line in text.splitlines())
        assert len(blocks) == marks, f"{path.name}: a {MARK} line not followed by a ```python block"
        out += [(f"{path.name}#{i}", code) for i, code in enumerate(blocks)]
    return out


BLOCKS = runnable_blocks()


def test_docs_have_runnable_examples():
    names = {n.split("#")[0] for n, _ in BLOCKS}
    assert {"README.md", "user-guide.md"} <= names, names


@pytest.mark.parametrize("name,code", BLOCKS, ids=[n for n, _ in BLOCKS])
def test_example_runs(name, code, traced, tmp_path, monkeypatch):
    def cached_trace(model="cs336-lm", config=None, attention=None, sizes=None, precision="bf16-mixed", **kw):
        if kw or not isinstance(model, str):
            return real(model, config, attention, sizes=sizes, precision=precision, **kw)
        symcost.trace = real  # the session cache calls symcost.trace itself
        try:
            att = attention if model.startswith("hf:") else "eager"  # (ignored for other models)
            return traced(model, precision, att, tuple(sorted((config or {}).items())),
                          tuple(sorted((sizes or {}).items())))
        finally:
            symcost.trace = cached_trace

    real = symcost.trace
    monkeypatch.setattr(symcost, "trace", cached_trace)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs

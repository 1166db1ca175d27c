"""``Analysis.subs`` at a size of 1 on a step traced at sizes of 2 and more.

Size 1 is a regime of its own (shared/conventions.md, "Regimes": PyTorch turns copies into views
there and broadcasts run other kernels; the trace cache matches requests by these facts).
``subs(B=1)`` on an analysis traced at B = 2 evaluated the B >= 2 formulas silently (a torchtune
Llama's activations 192 B off); issue 30: "a formula reused outside the sizes it was checked at
... is checked there or says it was not". It now warns, naming the size and how to trace it.
"""
from __future__ import annotations

import warnings

import pytest


def test_subs_at_one_says_it_was_not_checked(traced):
    an = traced("cs336-lm")
    assert "B" in an.symbols and "B" not in an.request_facts.get("ones", [])
    with pytest.warns(UserWarning, match=r"B=1 is a regime of its own.*not at 1: trace at B=1"):
        one = an.subs(B=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sizes of 2 and more: evaluated without a word
        three = an.subs(B=3)
    assert one["params"] == three["params"]

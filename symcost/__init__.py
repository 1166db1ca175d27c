"""symcost: a symbolic cost-model compiler for PyTorch training.

``symcost.trace(model)`` traces one training step (forward and the backward autograd really runs)
into a networkx op graph whose shapes are polynomials in B, S, H, D, L, V, F, K, with closed-form
FLOPs, bytes and arithmetic intensity per op and in total.

The names below are loaded on first use (PEP 562), so ``import symcost`` (and the CLI's
``--help``) does not import torch.
"""
from __future__ import annotations

import importlib

__all__ = ["Analysis", "ModelSpec", "SYMS", "SymcostError", "parse_formula", "resolve", "trace"]
__version__ = "0.1.0"

_LAZY = {
    "Analysis": "analysis", "trace": "analysis", "SymcostError": "errors", "SYMS": "fit",
    "parse_formula": "fit", "ModelSpec": "spec", "resolve": "models",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'symcost' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))

"""symcost: a symbolic cost-model compiler for PyTorch training.

``symcost.trace(model)`` traces one training step (forward and the backward autograd really runs)
into a networkx op graph whose shapes are polynomials in B, S, H, D, L, V, F, K, with closed-form
FLOPs, bytes and arithmetic intensity per op and in total.

The package is laid out by pipeline stage (docs/architecture.md): ``frontends`` (what the user
hands over) -> ``tracing`` (record and fit) -> ``graph`` (the op graph, cost rules, totals) ->
``hardware`` (devices) -> ``passes`` (memory, checkpointing, MoE, roofline) -> ``validation`` ->
``render`` -> ``commands`` -> ``cli``. A stage imports only from stages before it.

The names below are loaded on first use (PEP 562), so ``import symcost`` (and the CLI's
``--help``) does not import torch.
"""
from __future__ import annotations

import importlib

from symcost import _compat, _quiet

__all__ = ["Analysis", "Constraint", "Layout", "ModelSpec", "SYMS", "SymcostError", "explore", "parse_formula", "resolve", "trace"]
__version__ = "0.1.0"

_LAZY = {
    "Analysis": "symcost.graph.analysis", "trace": "symcost.graph.build", "SymcostError": "symcost.errors",
    "SYMS": "symcost.tracing.fit", "parse_formula": "symcost.tracing.fit", "ModelSpec": "symcost.frontends.spec",
    "Constraint": "symcost.frontends.spec",
    "resolve": "symcost.frontends.models", "Layout": "symcost.frontends.layout",
    "explore": "symcost.render.explore",
}

_compat.install()  # the flat layout's module paths (symcost.memory, ...) still import, deprecated
_quiet.install()  # optional libraries' import-time noise (torchao's unloadable CUDA kernels)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'symcost' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))

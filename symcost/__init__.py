"""symcost: a symbolic cost-model compiler for PyTorch training.

``symcost.trace(model)`` traces one training step (forward and the backward autograd really runs)
into a networkx op graph whose shapes are polynomials in B, S, H, D, L, V, F, K, with closed-form
FLOPs, bytes and arithmetic intensity per op and in total.
"""
from .analysis import Analysis, trace
from .errors import SymcostError
from .fit import SYMS, parse_formula
from .models import ModelSpec, resolve

__all__ = ["Analysis", "ModelSpec", "SYMS", "SymcostError", "parse_formula", "resolve", "trace"]
__version__ = "0.1.0"

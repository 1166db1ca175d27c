"""Model specifications: how symcost builds a model for given symbol values.

A :class:`ModelSpec` tells the tracer three things: which canonical symbols the model's
configuration binds (a subset of H, D, L, V, F, K; B and S always come from the inputs), how to
build the ``nn.Module`` for concrete values of those symbols, and how to make the inputs and the
loss of one training step. Built-in models live in ``graphs/`` (importable as
``symcost.graphs``); ``hf:MODEL_TYPE`` builds a Hugging Face ``transformers`` model from its
default config; ``path/to/file.py:factory`` loads a user's model.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .errors import SymcostError

#: Canonical symbols and their meaning (shared/conventions.md).
SYMBOL_MEANINGS: dict[str, str] = {
    "B": "micro-batch size (sequences per device per step)",
    "S": "sequence length (tokens per sequence)",
    "H": "attention heads (query heads)",
    "D": "per-head dimension (d_model = H*D)",
    "L": "number of transformer layers (blocks)",
    "V": "vocabulary size",
    "F": "feed-forward hidden width",
    "K": "key/value heads (grouped-query attention)",
}
SYMBOL_ORDER = tuple(SYMBOL_MEANINGS)
INPUT_SYMBOLS = ("B", "S")

Inputs = tuple[tuple, dict]


@dataclass
class ModelSpec:
    """How to build and run one training step of a model for given symbol values.

    Attributes:
        name: the name the user typed (``cs336-lm``, ``hf:llama``, ``file.py:factory``).
        symbols: config symbols the model binds, a subset of ``("H","D","L","V","F","K")``.
        defaults: default value of every config symbol (and of B, S) used when the user sets none.
        build: ``build(values) -> nn.Module`` for a mapping symbol -> int. Called under
            ``torch.device("meta")``; it must not read weights from anywhere.
        make_inputs: ``make_inputs(values, device) -> (args, kwargs)`` for one micro-batch of
            ``values["B"]`` sequences of ``values["S"]`` tokens.
        loss: ``loss(output, (args, kwargs)) -> scalar Tensor`` whose ``backward()`` is the
            training step's backward.
        check: ``check(values) -> str | None``: why these values are invalid (e.g. "K must
            divide H"), or None.
        tied: symbols that equal another in this configuration's regime (e.g. ``{"K": "H"}``
            for multi-head attention), so probes keep them equal and formulas use the other.
        layers: dotted path of the ``nn.ModuleList`` holding the L repeated blocks (``None``
            lets the tracer find it).
        extra: free-form facts for the report (e.g. the config class).
    """

    name: str
    symbols: tuple[str, ...]
    defaults: dict[str, int]
    build: Callable[[Mapping[str, int]], nn.Module]
    make_inputs: Callable[[Mapping[str, int], torch.device], Inputs]
    loss: Callable[[Any, Inputs], torch.Tensor]
    check: Callable[[Mapping[str, int]], str | None] = lambda values: None
    tied: dict[str, str] = field(default_factory=dict)
    layers: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def all_symbols(self) -> tuple[str, ...]:
        """B, S and the config symbols, in canonical order, without tied ones."""
        syms = set(INPUT_SYMBOLS) | set(self.symbols)
        return tuple(s for s in SYMBOL_ORDER if s in syms and s not in self.tied)


BUILTINS = {
    "cs336-lm": "cs336_lm",
    "gpt2": "gpt2",
    "mlp": "mlp",
    "megatron-gpt": "megatron_gpt",
}


def resolve(model: str, config: Mapping[str, str] | None = None, attention: str = "eager") -> ModelSpec:
    """Return the :class:`ModelSpec` for a model name.

    Accepted: a built-in name (``cs336-lm``, ``gpt2``, ``mlp``, ``megatron-gpt``),
    ``hf:MODEL_TYPE`` (needs ``transformers``), or ``path/to/file.py:factory``.

    Raises:
        SymcostError: unknown name, missing optional dependency, bad factory.
    """
    config = dict(config or {})
    if model in BUILTINS:
        if config:
            raise SymcostError(f"--config applies to hf: models only; set sizes of {model!r} with --set")
        mod = importlib.import_module(f"symcost.graphs.{BUILTINS[model]}")
        return mod.spec()
    if model.startswith("hf:"):
        from . import hf

        return hf.spec(model[3:], config, attention)
    if ".py:" in model:
        if config:
            raise SymcostError("--config applies to hf: models only")
        return _file_spec(model)
    raise SymcostError(
        f"unknown model {model!r}; accepted: {', '.join(BUILTINS)}, hf:MODEL_TYPE (e.g. hf:llama), "
        "or path/to/file.py:factory"
    )


def _file_spec(model: str) -> ModelSpec:
    """Load ``path/to/file.py:factory``.

    Either the factory takes no arguments and returns a :class:`ModelSpec`, or it takes keyword
    arguments named by canonical symbols (``H``, ``D``, ``L``, ``V``, ``F``, ``K``, each with an
    integer default) and returns an ``nn.Module`` fed a float tensor ``[B, S, H*D]`` (``[B, S, D]``
    without H), trained on the mean square of its output.

    Raises:
        SymcostError: missing file, import error, missing or failing factory.
    """
    path, _, factory = model.rpartition(":")
    if not os.path.isfile(path):
        raise SymcostError(f"model file {path!r} not found; expected path/to/file.py:factory")
    try:
        modspec = importlib.util.spec_from_file_location(f"symcost_user_{abs(hash(path))}", path)
        mod = importlib.util.module_from_spec(modspec)
        modspec.loader.exec_module(mod)  # loaded only because the user named this file
    except Exception as e:  # noqa: BLE001 - user code can raise anything
        raise SymcostError(f"loading {path!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(mod, factory, None)
    if fn is None or not callable(fn):
        raise SymcostError(f"{path!r} has no callable {factory!r}")
    sig = inspect.signature(fn)
    if any(p in SYMBOL_MEANINGS for p in sig.parameters):
        return _spec_from_factory(model, fn, sig)
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - user code can raise anything
        raise SymcostError(f"factory {factory!r} failed: {type(e).__name__}: {e}") from e
    if isinstance(out, ModelSpec):
        out.name = model
        return out
    raise SymcostError(
        f"factory {factory!r} must return a symcost.ModelSpec, or take keyword arguments named by "
        "the symbols it uses (H, D, L, V, F, K) and return an nn.Module"
    )


def _spec_from_factory(model: str, fn: Callable, sig: inspect.Signature) -> ModelSpec:
    syms = [p for p in sig.parameters if p in SYMBOL_MEANINGS and p not in INPUT_SYMBOLS]
    defaults = {}
    for p in syms:
        d = sig.parameters[p].default
        if not isinstance(d, int):
            raise SymcostError(f"factory {fn.__name__!r}: parameter {p} needs an integer default")
        defaults[p] = d
    if "D" in syms and "H" not in syms:
        width = lambda v: v["D"]  # noqa: E731
    elif "D" in syms:
        width = lambda v: v["H"] * v["D"]  # noqa: E731
    else:
        width = None

    def build(values):
        try:
            return fn(**{p: values[p] for p in syms})
        except Exception as e:  # noqa: BLE001
            raise SymcostError(f"factory {fn.__name__!r} failed: {type(e).__name__}: {e}") from e

    def make_inputs(values, device):
        if width is None:
            raise SymcostError(
                f"factory {fn.__name__!r} must take D (and H) so symcost knows the input width, "
                "or return a symcost.ModelSpec"
            )
        return (torch.randn(values["B"], values["S"], width(values), device=device),), {}

    return ModelSpec(
        name=model,
        symbols=tuple(syms),
        defaults={"B": 8, "S": 128, **defaults},
        build=build,
        make_inputs=make_inputs,
        loss=lambda out, inputs: out.float().pow(2).mean(),
    )

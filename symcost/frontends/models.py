"""Model specifications: how symcost builds a model for given symbol values.

A :class:`ModelSpec` tells the tracer three things: which canonical symbols the model's
configuration binds (a subset of H, D, L, V, F, K; B and S always come from the inputs), how to
build the ``nn.Module`` for concrete values of those symbols, and how to make the inputs and the
loss of one training step. Built-in models live in ``graphs/`` (importable as
``symcost.frontends.builtin``); ``hf:MODEL_TYPE`` builds a Hugging Face ``transformers`` model from its
default config; ``path/to/file.py:factory`` loads a user's model.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable, Mapping

import torch
from torch import nn

from symcost.errors import SymcostError

from symcost.frontends.spec import INPUT_SYMBOLS, SYMBOL_MEANINGS, SYMBOL_ORDER, Inputs, ModelSpec  # noqa: F401
from symcost.frontends.spec import BUILTINS, check_model_name  # noqa: F401  (the torch-free registry of names)
from symcost.frontends.spec import model_stdout


def resolve(model: str, config: Mapping[str, str] | None = None, attention: str | None = None,
            task: str | None = None) -> ModelSpec:
    """Return the :class:`ModelSpec` for a model name.

    Accepted: a built-in name (``cs336-lm``, ``gpt2``, ``mlp``, ``megatron-gpt``),
    ``hf:MODEL_TYPE``, ``hf:ORG/NAME`` (a ``config.json`` in the local Hugging Face cache, never
    downloaded), ``tv:NAME`` / ``timm:NAME`` (torchvision's / timm's image classifiers, random
    weights: :mod:`symcost.frontends.zoo`), ``path/to/config.json`` (a ``transformers`` config with its ``model_type``; all
    three need ``transformers``), or ``path/to/file.py:factory``. ``attention`` (``eager`` or
    ``sdpa``) applies to ``hf:`` models and config files only; ``None`` is what ``transformers``
    uses by default (sdpa where the model has it). ``task`` (``causal-lm``, ``masked-lm``,
    ``seq2seq``, ``image-classification``) picks an ``hf:`` model's head where it has several
    (default: :func:`symcost.frontends.hf_tasks.task_of`; symcost.frontends.hf_tasks.any_spec).

    Raises:
        SymcostError: unknown name, missing optional dependency, bad factory, an attention
            implementation for a model that is not ``hf:`` (its attention is its own code).
    """
    config = dict(config or {})
    if attention is not None and not model.startswith("hf:") and not model.endswith(".json"):
        raise SymcostError(
            f"--attention applies to hf: models only; {model} runs its own attention code (leave --attention out)"
        )
    if model in BUILTINS:
        if config:
            raise SymcostError(f"--config applies to hf: models only; set sizes of {model!r} with --set")
        mod = importlib.import_module(f"symcost.frontends.builtin.{BUILTINS[model]}")
        return mod.spec()
    if model.startswith("hf:") and "/" in model:  # hf:ORG/NAME from the local Hugging Face cache
        from symcost.frontends import hf, hf_tasks

        return hf_tasks.any_spec_from_file(hf.cached_config_path(model[3:]), config, attention, name=model, task=task)
    if model.startswith("hf:"):
        from symcost.frontends import hf_tasks

        return hf_tasks.any_spec(model[3:], config, attention, task=task)
    if model.startswith(("tv:", "timm:")):  # torchvision's and timm's models by name (frontends/zoo.py)
        if config:
            raise SymcostError(f"--config applies to hf: models only; {model} takes --set IMG=... and B=...")
        from symcost.frontends import zoo

        return zoo.spec(model)
    if model.startswith("diffusers:") or (model.endswith(".json") and _diffusers_config(model)):
        if attention is not None:  # (checked above for diffusers:NAME; a diffusers config.json too)
            raise SymcostError(f"--attention applies to hf: models only; {model} runs diffusers' attention")
        if task is not None:
            raise SymcostError(f"--task: {model} has one step (noise prediction); leave --task out")
        from symcost.frontends import diffusion  # diffusers' U-Nets and DiT (frontends/diffusion.py)

        return diffusion.resolve(model, config)
    if model.endswith(".json"):
        from symcost.frontends import hf_tasks

        return hf_tasks.any_spec_from_file(model, config, attention, task=task)
    if ".py:" in model:
        if config:
            raise SymcostError("--config applies to hf: models only")
        return _file_spec(model)
    check_model_name(model)  # raises: unknown name, listing what is accepted
    raise SymcostError(f"cannot resolve model {model!r}")  # (unreachable: check_model_name accepts only the above)


def _diffusers_config(path: str) -> bool:
    """Whether ``path`` is a diffusers model config (symcost.frontends.diffusion.is_config_file)."""
    from symcost.frontends.diffusion import is_config_file

    return is_config_file(path)


def _file_spec(model: str) -> ModelSpec:
    """Load ``path/to/file.py:factory``.

    Either the factory takes no arguments and returns a :class:`ModelSpec` (whose symbols may be
    the model's own sizes under any names: docs/user-guide.md, "The factory contract"), or it takes
    keyword arguments named by canonical symbols (``H``, ``D``, ``L``, ``V``, ``F``, ``K``, each
    with an integer default; other parameters named from a capital letter with an integer default
    are the model's own sizes) and returns an ``nn.Module`` fed a float tensor ``[B, S, H*D]``
    (``[B, S, D]`` without H), trained on the mean square of its output.

    Raises:
        SymcostError: missing file, import error, missing or failing factory.
    """
    path, _, factory = model.rpartition(":")
    if not os.path.isfile(path):
        raise SymcostError(f"model file {path!r} not found; expected path/to/file.py:factory")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:  # (its own modules beside it import, as when Python runs the file)
        sys.path.insert(0, folder)
    try:
        modspec = importlib.util.spec_from_file_location(f"symcost_user_{abs(hash(path))}", path)
        mod = importlib.util.module_from_spec(modspec)
        # registered under its name, as an imported module is: torch.compile (--compile) looks the
        # module of the code it captures up in sys.modules (else ModuleNotFoundError)
        sys.modules[modspec.name] = mod
        with model_stdout():  # (its prints go to stderr, never into symcost's output)
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
        with model_stdout():
            out = fn()
    except Exception as e:  # noqa: BLE001 - user code can raise anything
        raise SymcostError(f"factory {factory!r} failed: {type(e).__name__}: {e}") from e
    if isinstance(out, ModelSpec):
        out.name = model
        lacking = [s for s in out.symbols if s not in out.defaults and s not in out.follows and s not in out.tied]
        if lacking:  # (else the model's own build fails at the first probe on a KeyError)
            raise SymcostError(
                f"factory {factory!r}: symbol{'s' if len(lacking) > 1 else ''} {', '.join(lacking)} "
                f"{'have' if len(lacking) > 1 else 'has'} no value in the ModelSpec's defaults; give every "
                f"symbol a default (defaults={{{', '.join(repr(s) + ': ...' for s in lacking)}}}), which --set overrides")
        # the model's own code, wherever a pass calls it (a meta build, a pipeline stage, the
        # validation's real step), prints to stderr
        out.build, out.make_inputs, out.loss = (_quiet(f) for f in (out.build, out.make_inputs, out.loss))
        return out
    raise SymcostError(
        f"factory {factory!r} must return a symcost.ModelSpec, or take keyword arguments named by "
        "the symbols it uses (H, D, L, V, F, K) and return an nn.Module"
    )


def _quiet(fn: Callable) -> Callable:
    """``fn`` run under :func:`model_stdout` (a user's code prints to stderr)."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with model_stdout():
            return fn(*args, **kwargs)

    return run


def _spec_from_factory(model: str, fn: Callable, sig: inspect.Signature) -> ModelSpec:
    # the conventions' symbols, and the model's own sizes: keyword parameters named from a
    # capital letter with an integer default (R_lora: int = 4)
    syms = [p for p, par in sig.parameters.items() if p not in INPUT_SYMBOLS and (
        p in SYMBOL_MEANINGS or (p[:1].isupper() and isinstance(par.default, int) and not isinstance(par.default, bool)))]
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
            with model_stdout():
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

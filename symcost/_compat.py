"""Deprecated module paths: ``symcost.memory`` and the other modules of the flat layout before the
stages (docs/architecture.md) still import, with a ``DeprecationWarning`` that names the new path.

A meta path finder answers each old name with a stand-in module that reads every attribute from
the module(s) that now hold it (the first that has the name), so ``from symcost.memory import
memory_model`` keeps working. Nothing is imported until the old name is.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module -> the modules that hold its names now (searched in order)
MOVED: dict[str, tuple[str, ...]] = {
    "symcost.spec": ("symcost.frontends.spec",),
    "symcost.precision": ("symcost.frontends.precision",),
    "symcost.models": ("symcost.frontends.models",),
    "symcost.hf": ("symcost.frontends.hf",),
    "symcost.graphs": ("symcost.frontends.builtin",),
    "symcost.record": ("symcost.tracing.record",),
    "symcost.fit": ("symcost.tracing.fit",),
    "symcost.modules": ("symcost.tracing.modules",),
    "symcost.opsets": ("symcost.graph.opsets",),
    "symcost.rules": ("symcost.graph.rules",),
    "symcost.fusion": ("symcost.graph.fusion",),
    "symcost.analysis": ("symcost.graph.analysis", "symcost.graph.build", "symcost.graph.ops",
                         "symcost.graph.serialize", "symcost.tracing.regime"),
    "symcost.cache": ("symcost.graph.cache",),
    "symcost.devices": ("symcost.hardware.devices",),
    "symcost.calibrate": ("symcost.hardware.calibrate",),
    "symcost.memory": ("symcost.passes.memory", "symcost.render.memory", "symcost.tracing.schedule",
                       "symcost.passes.memory.live", "symcost.units"),
    "symcost.checkpoint": ("symcost.passes.checkpoint",),
    "symcost.checkpoint_ops": ("symcost.passes.checkpoint_ops",),
    "symcost.moe": ("symcost.frontends.moe", "symcost.passes.moe"),
    "symcost.roofline": ("symcost.passes.roofline",),
    "symcost.validate": ("symcost.validation.validate",),
    "symcost.report": ("symcost.render.report",),
    "symcost.plots": ("symcost.render.plots",),
}
#: old built-in model modules (``symcost.graphs.gpt2``) map by prefix
PREFIXES = {"symcost.graphs.": "symcost.frontends.builtin."}


def _targets(fullname: str) -> tuple[str, ...] | None:
    if fullname in MOVED:
        return MOVED[fullname]
    for old, new in PREFIXES.items():
        if fullname.startswith(old):
            return (new + fullname[len(old):],)
    return None


class _Alias(types.ModuleType):
    """Stands for an old module: attributes come from the new ones."""

    def __getattr__(self, name: str):
        for target in self.__dict__["_symcost_targets"]:
            mod = importlib.import_module(target)
            if hasattr(mod, name):
                return getattr(mod, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self):
        out = set()
        for target in self.__dict__["_symcost_targets"]:
            out |= set(dir(importlib.import_module(target)))
        return sorted(out)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        targets = _targets(spec.name)
        mod = _Alias(spec.name)
        mod.__dict__["_symcost_targets"] = targets
        first = importlib.util.find_spec(targets[0])
        if first is not None and first.submodule_search_locations is not None:
            mod.__path__ = []  # a package: ``symcost.graphs.gpt2`` is found by PREFIXES
        return mod

    def exec_module(self, module):
        warnings.warn(f"{module.__name__} is deprecated: import {module.__dict__['_symcost_targets'][0]} "
                      "(docs/architecture.md)", DeprecationWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        targets = _targets(fullname)
        if targets is None:
            return None
        if fullname not in MOVED:  # a module below an old package: the module itself, renamed
            return importlib.util.spec_from_loader(fullname, _ModuleLoader(targets[0]))
        return importlib.util.spec_from_loader(fullname, _Loader(), is_package=True)


class _ModuleLoader(importlib.abc.Loader):
    """``symcost.graphs.gpt2`` -> the module ``symcost.frontends.builtin.gpt2`` itself."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        mod = _Alias(spec.name)
        mod.__dict__["_symcost_targets"] = (self.target,)
        return mod

    def exec_module(self, module):
        warnings.warn(f"{module.__name__} is deprecated: import {self.target}", DeprecationWarning, stacklevel=2)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())

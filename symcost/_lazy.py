"""Modules loaded on first use, so torch-free code paths (the CLI reading a cached trace) do not
import torch, transformers or networkx."""
from __future__ import annotations

import importlib


class LazyModule:
    """Stands for module ``name``; the first attribute access imports it (``importlib``)."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name
        self.__dict__["_mod"] = None

    def __getattr__(self, attr: str):
        mod = self.__dict__["_mod"]
        if mod is None:
            mod = self.__dict__["_mod"] = importlib.import_module(self.__dict__["_name"])
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_name']!r}>"

"""``method_cache``: :func:`functools.cache` for methods, kept per instance.

``functools.cache`` (or ``lru_cache``) on a method keys a cache on the class's function by
``self``: every instance it ever saw stays alive as long as the class does. An
:class:`~symcost.graph.analysis.Analysis` holds its probe recordings and op graph (hundreds of
MB for a large model), so a process that traced many models kept them all (a test worker grew
to 11.8 GB and was OOM-killed, 2026-12-06). Here each instance's results live in a
:class:`weakref.WeakKeyDictionary` entry that goes with the instance.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable


def method_cache(fn: Callable) -> Callable:
    """Decorate method ``fn`` so each (instance, arguments) is computed once while the instance lives.

    The arguments must be hashable (as for ``functools.cache``); the instance must be hashable and
    weak-referenceable. ``wrapper.cache_clear()`` forgets every instance's results.
    """
    results: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        memo = results.get(self)
        if memo is None:
            memo = results[self] = {}
        key = (args, tuple(sorted(kwargs.items()))) if kwargs else args
        try:
            return memo[key]
        except KeyError:
            out = memo[key] = fn(self, *args, **kwargs)
            return out

    wrapper.cache_clear = results.clear  # type: ignore[attr-defined]
    return wrapper

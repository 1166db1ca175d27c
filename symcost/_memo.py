"""Process-level memos that do not keep what they memoise alive for ever: ``method_cache``
(:func:`functools.cache` for methods, kept per instance), ``BoundedMemo`` (a dict of the most
recently used entries), ``per_object`` (a memo per live object); ``clear_all`` empties them all.

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
from collections import OrderedDict
from typing import Any, Callable

#: every memo made here (the containers, which live as long as their modules): :func:`clear_all`
_MEMOS: list = []


def clear_all() -> None:
    """Empty every memo of this module's kinds (the tests call it at each test file's end)."""
    for memo in _MEMOS:
        memo.clear()


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
    _MEMOS.append(results)
    return wrapper


class BoundedMemo(OrderedDict):
    """A dict that keeps its ``maxsize`` most recently read or written entries (least recently
    used dropped first): the traces the passes memoise by request (pipeline stages, checkpointed
    steps, plan's TP traces), each an :class:`~symcost.graph.analysis.Analysis` of up to hundreds
    of MB, were kept in plain module dicts for the life of the process.

    Only ``[]``, ``get``, ``in``, ``[] =`` and ``clear`` are meant to be used.
    """

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize
        _MEMOS.append(self)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


def per_object(memo: weakref.WeakKeyDictionary, obj: Any, what: str, make: Callable[[], Any]) -> Any:
    """``make()`` memoised as ``what`` of ``obj`` in ``memo`` (a :func:`object_memo`), computed once
    while ``obj`` lives (the entry goes with it, unless its value refers back to ``obj``)."""
    entries = memo.get(obj)
    if entries is None:
        entries = memo[obj] = {}
    if what not in entries:
        entries[what] = make()
    return entries[what]


def object_memo() -> weakref.WeakKeyDictionary:
    """A new memo for :func:`per_object`: live object -> {what: value}, cleared by :func:`clear_all`."""
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _MEMOS.append(memo)
    return memo

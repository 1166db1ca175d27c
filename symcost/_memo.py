"""Process-level memos that do not keep what they memoise alive for ever: ``per_object`` (a memo
kept in the object itself, gone with it), ``method_cache`` (:func:`functools.cache` for methods,
kept per instance), ``BoundedMemo`` (a dict of the most recently used entries); ``clear_all``
empties every ``BoundedMemo``.

``functools.cache`` (or ``lru_cache``) on a method keys a cache on the class's function by
``self``, and a module-level dict (or a ``WeakKeyDictionary`` whose value refers back to its key,
a memory model holding its analysis) keeps what it memoises: every instance it ever saw stays
alive as long as the module does. An :class:`~symcost.graph.analysis.Analysis` holds its probe
recordings and op graph (hundreds of MB for a large model), so a process that traced many models
kept them all (a test worker grew to 11.8 GB and was OOM-killed, 2026-12-06).
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Hashable

#: the bounded memos made here (they live as long as their modules): :func:`clear_all`
_MEMOS: list = []
#: the attribute of an object's ``__dict__`` that holds its memo: ``(id(obj), {key: value})``
_ATTR = "_symcost_memo"


def clear_all() -> None:
    """Empty every :class:`BoundedMemo` (the tests call it at each test file's end)."""
    for memo in _MEMOS:
        memo.clear()


def object_entries(obj: Any) -> dict:
    """The memo dict of ``obj`` (kept in its ``__dict__``, so it goes with ``obj``; a shallow copy
    of ``obj``, which carries its original's ``__dict__`` entries, gets a memo of its own)."""
    held = obj.__dict__.get(_ATTR)
    if held is None or held[0] != id(obj):
        held = obj.__dict__[_ATTR] = (id(obj), {})
    return held[1]


def per_object(obj: Any, key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()`` memoised as ``key`` of ``obj``: computed once while ``obj`` lives."""
    entries = object_entries(obj)
    if key not in entries:
        entries[key] = make()
    return entries[key]


def method_cache(fn: Callable) -> Callable:
    """Decorate method ``fn`` so each (instance, arguments) is computed once while the instance
    lives (its results kept in the instance: :func:`per_object`). The arguments must be hashable,
    as for ``functools.cache``."""
    name = fn.__qualname__

    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        key = (name, args, tuple(sorted(kwargs.items()))) if kwargs else (name, args)
        entries = object_entries(self)
        if key not in entries:
            entries[key] = fn(self, *args, **kwargs)
        return entries[key]

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

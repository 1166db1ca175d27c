"""The trace cache: each traced :class:`~symcost.graph.analysis.Analysis` kept on disk as data.

Tracing takes seconds (5-15 s for ``hf:`` models); evaluating an analysis takes milliseconds. The
cache keeps every analysis the CLI traces as JSON (no pickle, no code) in the user's cache
directory (``platformdirs.user_cache_dir("symcost")``; the environment variable
``SYMCOST_CACHE_DIR`` overrides it), so a second call with the same model, options and regime
reads the analysis back without importing torch or transformers.

**Key.** Everything that changes an analysis: the model's source (a built-in graph file's
contents; a user's ``file.py`` contents and factory; a ``config.json`` file's contents; an ``hf:``
model type with its ``--config`` overrides), the precision, the attention implementation, the
versions of symcost, torch and transformers (``importlib.metadata``, nothing imported) and a
digest of symcost's own sources (a changed tracer never reads an old entry). Entries with that
key live in one folder, one per traced **regime**: the sizes the user asks for choose the regime
(``symcost.frontends.spec.request_facts``: symbols set to 1, equal config-symbol pairs such as K = H), and
the trace may pin symbols at the requested value (``Analysis.pinned``). A request matches an
entry when its request facts equal the entry's, it asks the entry's pinned symbols at their
pinned values, and its config sizes (all but B, S, L, DP and TP, see :data:`FREE`) are the entry's: a
loop over batch sizes, sequence lengths, depths or data-parallel sizes reads one entry, another
head count traces. A data-parallel trace is keyed by its strategy (``options={"shard": ...}``):
a DDP and an FSDP trace of one model never share an entry. A tensor-parallel trace is keyed by
``options={"tp": True, "sp": ...}``; it serves any TP whose request keeps the sizes the probes
kept in a residue class (``Analysis.residues``: heads, sharded features, V, and S with SP, mod 8)
in that class, and the same of them at one per rank.

**Robustness.** An entry that cannot be read (corrupt JSON, another format, missing fields) is
deleted and the model traced afresh; a stale one (other versions or sources) has another key, is
never read, and is deleted when the same model and options are cached again. Writes go to a temporary file renamed into place. A model whose spec checks sizes
with code rather than declarative constraints is not cached (its check could not run from data);
nor are ``hf:ORG/NAME`` checkpoints (their config lives outside symcost's view).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from symcost.errors import SymcostError
from symcost.graph.entries import (  # noqa: F401  (the key and the matching: also cache.key, cache.FREE, ...)
    _SOURCES, FORMAT, FREE, _config_values, _digest, _facts, _matches, _per_rank_ones, _regime_facts,
    _request_values, _source_digest, _version, entry_meta, key, model_source)


def cache_dir() -> Path:
    """``$SYMCOST_CACHE_DIR`` if set, else the user's cache directory for symcost (platformdirs)."""
    env = os.environ.get("SYMCOST_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("symcost", appauthor=False))


def _folder(k: dict) -> Path:
    return cache_dir() / _digest(json.dumps(k, sort_keys=True).encode())[:32]


def load(k: dict, sizes: Mapping[str, int]):
    """The cached Analysis for key ``k`` whose regime matches ``sizes``, or None.

    Entries that cannot be read are deleted (they will be traced and written again).
    """
    from symcost.graph.analysis import Analysis

    folder = _folder(k)
    if not folder.is_dir():
        return None
    for meta_path in sorted(folder.glob("*.meta.json")):
        data_path = meta_path.with_name(meta_path.name.replace(".meta.json", ".json"))
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("key") != k or not _matches(meta, sizes):
                continue
            entry = json.loads(data_path.read_text())
            an = Analysis.from_dict(entry)
            an.__dict__["cached_from"] = str(data_path)  # the report says where it came from
            return an
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, SymcostError):
            for p in (meta_path, data_path):
                try:
                    p.unlink()
                except OSError:
                    pass
    return None


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _prune_stale(k: dict, keep: Path) -> None:
    """Delete the entries of the same model and options written by other versions or sources
    (they can never match again). Entries of other options (a routing model, the every-layer
    checkpointed step, an inference step: a decode and a prefill trace of one model differ in
    their options) are another analysis of the same model and stay."""
    same = {f: k.get(f) for f in ("source", "precision", "attention", "options")}
    root = cache_dir()
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if folder == keep or not folder.is_dir():
            continue
        for meta_path in folder.glob("*.meta.json"):
            try:
                old = json.loads(meta_path.read_text())["key"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(old, dict) and {f: old.get(f) for f in same} == same and old != k:
                for p in folder.glob("*.json"):
                    try:
                        p.unlink()
                    except OSError:
                        pass
                try:
                    folder.rmdir()
                except OSError:
                    pass
            break


def store(k: dict, sizes: Mapping[str, int], an) -> Path | None:
    """Write ``an`` (traced for a request of ``sizes``) under key ``k``; None if it cannot be
    kept as data (a spec that checks sizes with code) or the cache folder is not writable."""
    try:
        data = an.to_dict()
    except SymcostError:
        return None
    meta = entry_meta(k, sizes, an)
    if meta is None:
        return None
    regime = _digest(json.dumps([_regime_facts(meta, meta["facts"]), meta["pinned"], meta["config_values"], meta["residues"],
                                 meta["per_rank_ones"]] + ([meta["bounds"]] if meta.get("bounds") else []),
                                sort_keys=True).encode())[:16]
    folder = _folder(k)
    _prune_stale(k, folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / f"{regime}.json", json.dumps(data, separators=(",", ":")))
        _write(folder / f"{regime}.meta.json", json.dumps(meta, sort_keys=True))
    except OSError:
        return None
    return folder / f"{regime}.json"


def cached_trace(model: str, config: Mapping[str, str], attention: str, precision: str,
                 sizes: Mapping[str, int], trace: Callable[[], Any], use_cache: bool = True,
                 options: Mapping[str, Any] | None = None):
    """The analysis of ``model`` for a request of ``sizes``: read from the cache when an entry
    matches, else from the graph library when one of its graphs serves the request
    (:func:`symcost.graph.library.lookup`), else ``trace()`` (and written to the cache). ``use_cache=False`` bypasses it;
    ``options`` (e.g. ``{"routing": "capacity=1.25"}``) are part of the key."""
    k = key(model, config, attention, precision, options) if use_cache else None
    if k is not None:
        an = load(k, sizes)
        if an is not None:
            return an
    if use_cache:  # (a Hub name is not kept in the trace cache, but the library may serve it)
        from symcost.graph.library import lookup  # the graphs shipped with symcost

        an = lookup(model, config, attention, precision, sizes, options)
        if an is not None:
            return an
    an = trace()
    if k is not None:
        store(k, sizes, an)
    return an


def cached_result(model: str, config: Mapping[str, str], attention: str, precision: str,
                  request: Mapping[str, Any], compute: Callable[[], dict], use_cache: bool = True) -> dict:
    """A computed result of ``model`` that is not an analysis (a JSON-serialisable dict: one
    pipeline rank's memory from its schedule run on fake tensors,
    :func:`symcost.tracing.pipeline.rank_memory`), read from the cache when the same request
    was answered with the same sources and versions, else ``compute()`` (and written).

    ``request``: everything the result depends on besides the model and its key (the sizes, the
    layout, the schedule, the rank); it is part of the key, so an entry answers that request
    only. Entries live beside the analyses (``<cache>/results/``); one that cannot be read is
    computed again. ``use_cache=False`` or a model that is not cacheable (:func:`key`) computes."""
    k = key(model, config, attention, precision, {"result": dict(request)}) if use_cache else None
    if k is None:
        return compute()
    path = cache_dir() / "results" / (_digest(json.dumps(k, sort_keys=True, default=str).encode())[:40] + ".json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    out = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, json.dumps(out, sort_keys=True))
    except (OSError, TypeError):
        pass
    return out

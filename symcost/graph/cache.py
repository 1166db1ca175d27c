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

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from symcost.errors import SymcostError
from symcost.frontends.spec import INPUT_SYMBOLS, request_facts

#: Bumped when the entry layout changes (with ``Analysis.FORMAT``).
FORMAT = 3  # 2: flops_hw per op and in the totals (Analysis.FORMAT 2); 3: data-parallel traces
#: The stages whose sources make an analysis (every ``*.py`` below them; the built-in models are
#: keyed by their own contents, :func:`model_source`).
_SOURCES = ("frontends", "tracing", "graph")


def cache_dir() -> Path:
    """``$SYMCOST_CACHE_DIR`` if set, else the user's cache directory for symcost (platformdirs)."""
    env = os.environ.get("SYMCOST_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("symcost", appauthor=False))


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for stage in _SOURCES:
        for p in sorted((root / stage).rglob("*.py")):
            rel = p.relative_to(root)
            if rel.parts[:2] == ("frontends", "builtin"):
                continue
            h.update(str(rel).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def model_source(model: str, config: Mapping[str, str]) -> dict | None:
    """The data that defines ``model`` (file contents, model type and overrides), without
    importing the model; None for sources the cache cannot key (``hf:ORG/NAME``, unknown)."""
    config = {str(k): str(v) for k, v in dict(config or {}).items()}
    if model.startswith("hf:"):
        name = model[3:]
        if "/" in name:
            return None
        return {"kind": "hf", "model_type": name, "config": config}
    if ".py:" in model:
        path, _, factory = model.rpartition(":")
        if not os.path.isfile(path):
            return None
        return {"kind": "file", "path": os.path.abspath(path), "factory": factory,
                "file": _digest(Path(path).read_bytes()), "config": config}
    if model.endswith(".json") and os.path.isfile(model):
        return {"kind": "config.json", "path": os.path.abspath(model), "file": _digest(Path(model).read_bytes()),
                "config": config}
    # a built-in name: the contents of every built-in graph file (symcost/graphs, not imported)
    import importlib.util

    spec = importlib.util.find_spec("symcost.frontends.builtin")
    if spec is None or not spec.submodule_search_locations:
        return None
    h = hashlib.sha256()
    for path in sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return {"kind": "builtin", "name": model, "graphs": h.hexdigest(), "config": config}


def key(model: str, config: Mapping[str, str], attention: str, precision: str,
        options: Mapping[str, Any] | None = None) -> dict | None:
    """Everything but the regime that an analysis depends on (None: not cacheable).

    ``options``: other tracing choices that change the analysis (e.g. the MoE routing model)."""
    src = model_source(model, config)
    if src is None:
        return None
    return {
        "format": FORMAT, "source": src, "precision": precision, "attention": attention,
        "options": dict(options or {}),
        "symcost": _version("symcost"), "symcost_sources": _source_digest(),
        "torch": _version("torch"), "transformers": _version("transformers"),
    }


def _request_values(meta: Mapping, sizes: Mapping[str, int]) -> dict[str, int]:
    """The values a request asks for, as the tracer reads them (``ModelSpec.values(sizes,
    inputs=False)`` of the model's own spec): the config defaults (not B and S, which count only
    where the request sets them), the request's sizes, then followers the request leaves unset
    (K follows H) and the model's own ties take their leader's value."""
    values = {k: v for k, v in meta["defaults"].items() if k not in INPUT_SYMBOLS}
    values.update(sizes)
    for a, b in meta.get("follows", {}).items():
        if a not in sizes and b in values:
            values[a] = values[b]
    for a, b in meta["tied"].items():
        if b in values:
            values[a] = values[b]
    return values


def _facts(meta: Mapping, sizes: Mapping[str, int]) -> dict:
    return request_facts(_request_values(meta, sizes), meta["all_symbols"])


#: Symbols a cached regime serves at any value (with the same request facts and pins): the
#: batch, the sequence length, the number of blocks and the data-parallel size (a data-parallel
#: trace runs the same ops at every DP > 1: its formulas say /DP, exact where DP divides the
#: sharded dims, and padded values are computed from them, docs/parallel.md) and the
#: tensor-parallel size (within the residue classes the trace's probes kept, ``residues``, and
#: the same split sizes of one per rank, :func:`_per_rank_ones`). A config size
#: (H, D, K, V, F, M, E, R) is matched by value: a regime can depend on it in ways the request
#: facts do not show (BLOOM's ALiBi slopes run other ops when H is not a power of two), and only a
#: recording would tell.
FREE = ("B", "S", "L", "DP", "TP", "EP")


def _config_values(meta: Mapping, sizes: Mapping[str, int]) -> dict[str, int]:
    values = _request_values(meta, sizes)
    return {s: values[s] for s in sorted(values) if s not in FREE}


def _per_rank_ones(meta: Mapping, values: Mapping[str, int]) -> list[str]:
    """The split sizes (those with a residue class, ``Analysis.residues``) that are 1 per rank
    (``value // TP == 1``): a tensor-parallel rank with one head or one token runs other kernels,
    a regime of its own (docs/parallel.md §11); under expert parallelism ``"E/EP"`` where an EP rank
    holds one expert (its permutes' copies become views, docs/parallel.md §14.3). Empty without TP
    and EP."""
    out = []
    tp = values.get("TP")
    if tp:
        out = [s for s in (meta.get("residues") or {}) if s in values and values[s] // tp == 1]
    ep = values.get("EP")
    if ep and "E" in values and values["E"] // ep == 1:
        out.append("E/EP")
    return sorted(out)


def _regime_facts(meta: Mapping, facts: Mapping) -> dict:
    """``facts`` without the equal pairs of TP and a size it does not split (no residue class:
    D = TP is a coincidence of values, no regime; a split size equal to TP is one per rank, kept,
    and :func:`_per_rank_ones` says so too)."""
    split = set(meta.get("residues") or {})
    equal = [p for p in facts["equal"] if "TP" not in p or (set(p) - {"TP"}) <= split]
    return {**facts, "equal": equal}


def _matches(meta: Mapping, sizes: Mapping[str, int]) -> bool:
    if _regime_facts(meta, _facts(meta, sizes)) != _regime_facts(meta, meta["facts"]) \
            or _config_values(meta, sizes) != meta["config_values"]:
        return False
    values = _request_values(meta, sizes)
    # sizes the probes kept in a residue class (a tensor-parallel trace's split sizes, mod 8)
    for s, (m, r) in (meta.get("residues") or {}).items():
        if s in values and values[s] % m != r:
            return False
    if _per_rank_ones(meta, values) != meta.get("per_rank_ones", []):
        return False
    lead = meta.get("lead_blocks", 0)
    if lead and "L" not in meta["pinned"] and values.get("L", lead + 1) <= lead:
        return False  # L <= n leading blocks: all blocks of one kind, a regime of its own
    return all(values.get(s) == v for s, v in meta["pinned"].items())


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
    spec = an.spec
    # the model's own ties, not those the trace added for the request's regime (K = H)
    regime_ties = getattr(an, "regime_ties", {}) or {}
    tied = {a: b for a, b in spec.tied.items() if a not in regime_ties}
    all_symbols = sorted((set(INPUT_SYMBOLS) | set(spec.symbols) | set(an.pinned)) - set(tied))
    meta: dict[str, Any] = {"key": k, "defaults": dict(spec.defaults), "tied": tied,
                            "follows": dict(getattr(spec, "follows", {}) or {}),
                            "all_symbols": all_symbols, "pinned": dict(an.pinned),
                            "lead_blocks": int(getattr(spec, "lead_blocks", 0) or 0)}
    meta["facts"] = _facts(meta, sizes)
    meta["config_values"] = _config_values(meta, sizes)
    meta["residues"] = {s: [int(m), int(r)] for s, (m, r) in (getattr(an, "residues", None) or {}).items()}
    meta["per_rank_ones"] = _per_rank_ones(meta, _request_values(meta, sizes))
    traced = getattr(an, "request_facts", None)
    if traced and json.loads(json.dumps(traced)) != meta["facts"]:
        return None  # the tracer read this request otherwise: do not guess which requests match
    regime = _digest(json.dumps([_regime_facts(meta, meta["facts"]), meta["pinned"], meta["config_values"], meta["residues"],
                                 meta["per_rank_ones"]], sort_keys=True).encode())[:16]
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
    matches, else ``trace()`` (and written to the cache). ``use_cache=False`` bypasses it;
    ``options`` (e.g. ``{"routing": "capacity=1.25"}``) are part of the key."""
    k = key(model, config, attention, precision, options) if use_cache else None
    if k is not None:
        an = load(k, sizes)
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

"""What an entry of the trace cache (:mod:`symcost.graph.cache`) is keyed and matched on: the key
(the model's source, precision, attention, options, the versions of symcost, torch and transformers
and a digest of symcost's tracing sources), the regime a request falls in, the config sizes, and
the meta kept beside each entry. Shared by the trace cache and the graph library
(:mod:`symcost.graph.library`), which matches its shipped graphs the same way.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from symcost.frontends.spec import INPUT_SYMBOLS, request_facts

#: Bumped when the entry layout changes (with ``Analysis.FORMAT``).
FORMAT = 3  # 2: flops_hw per op and in the totals (Analysis.FORMAT 2); 3: data-parallel traces
#: The stages whose sources make an analysis (every ``*.py`` below them; the built-in models are
#: keyed by their own contents, :func:`model_source`).
_SOURCES = ("frontends", "tracing", "graph")
#: Modules of those stages that trace nothing (they serve analyses): not in the digest.
_SERVING_ONLY = frozenset({"graph/library.py"})


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
            if rel.parts[:2] == ("frontends", "builtin") or rel.as_posix() in _SERVING_ONLY:
                continue
            h.update(str(rel).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def model_source(model: str, config: Mapping[str, str]) -> dict | None:
    """The data that defines ``model`` (file contents, model type and overrides), without
    importing the model; None for sources the cache cannot key (``hf:ORG/NAME``, a ``tv:``/``timm:``
    name whose package has no installed version, unknown)."""
    config = {str(k): str(v) for k, v in dict(config or {}).items()}
    if model.startswith("hf:"):
        name = model[3:]
        if "/" in name:
            return None
        return {"kind": "hf", "model_type": name, "config": config}
    if model.startswith(("tv:", "timm:")):  # a zoo's model: its code is the installed package's version
        dist = "torchvision" if model.startswith("tv:") else "timm"
        version = _version(dist)
        return None if version is None else {"kind": "zoo", "name": model, dist: version, "config": config}
    if model.startswith("diffusers:"):  # (symcost.frontends.diffusion: the installed package's code)
        version = _version("diffusers")
        return None if version is None else {"kind": "diffusers", "name": model, "diffusers": version,
                                             "config": config}
    if ".py:" in model:
        path, _, factory = model.rpartition(":")
        if not os.path.isfile(path):
            return None
        return {"kind": "file", "path": os.path.abspath(path), "factory": factory,
                "file": _digest(Path(path).read_bytes()), "config": config}
    if model.endswith(".json") and os.path.isfile(model):
        data = Path(model).read_bytes()
        out = {"kind": "config.json", "path": os.path.abspath(model), "file": _digest(data), "config": config}
        if b'"_class_name"' in data:  # a diffusers model's config: its code is the installed package's
            out["diffusers"] = _version("diffusers")
        return out
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
    return _free_stack_facts(meta, request_facts(_request_values(meta, sizes), meta["all_symbols"]))


def _free_stacks(meta: Mapping) -> set[str]:
    """The stack lengths an entry serves at any value, as L (``Analysis.stack_blocks``: a model's own
    ``L_enc``, ``L_dec``, each folded under its symbol; docs/tracing.md §4 "Several stacks"), unless
    pinned."""
    return {s for s in (meta.get("stack_blocks") or {}) if s not in (meta.get("pinned") or {})}


def _free_stack_facts(meta: Mapping, facts: Mapping) -> dict:
    """``facts`` without the equal pairs of a free stack length (L_dec = H is a coincidence of
    values: the tracer holds every stack's length fixed in its probes and ties it to nothing)."""
    free = _free_stacks(meta)
    if not free:
        return dict(facts)
    return {**facts, "equal": [p for p in facts["equal"] if not set(p) & free]}


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
    free = _free_stacks(meta)
    return {s: values[s] for s in sorted(values) if s not in FREE and s not in free}


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


def _matches(meta: Mapping, sizes: Mapping[str, int], config: bool = True) -> bool:
    """Whether an entry of ``meta`` serves a request of ``sizes``: the same regime, and with
    ``config`` the same config sizes (the graph library, :mod:`symcost.graph.library`, checks other
    config sizes on the meta device instead)."""
    if _regime_facts(meta, _facts(meta, sizes)) != _regime_facts(meta, meta["facts"]) \
            or (config and _config_values(meta, sizes) != meta["config_values"]):
        return False
    values = _request_values(meta, sizes)
    # sizes the probes kept in a residue class (a tensor-parallel trace's split sizes, mod 8)
    for s, (m, r) in (meta.get("residues") or {}).items():
        if s in values and values[s] % m != r:
            return False
    # sizes padded to whole chunks (Analysis.bounds: Mamba-2's S below one chunk, or two and more)
    for s, (lo, hi) in (meta.get("bounds") or {}).items():
        if s in values and not (lo <= values[s] and (hi is None or values[s] <= hi)):
            return False
    if _per_rank_ones(meta, values) != meta.get("per_rank_ones", []):
        return False
    lead = meta.get("lead_blocks", 0)
    if lead and "L" not in meta["pinned"] and values.get("L", lead + 1) <= lead:
        return False  # L <= n leading blocks: all blocks of one kind, a regime of its own
    for s, n in (meta.get("stack_blocks") or {}).items():  # (a stack probed with 3 blocks: X >= 2)
        if n > 2 and s not in meta["pinned"] and values.get(s, 2) < 2:
            return False
    return all(values.get(s) == v for s, v in meta["pinned"].items())


def entry_meta(k: dict, sizes: Mapping[str, int], an) -> dict | None:
    """What an entry of ``an`` (traced for a request of ``sizes``) keeps beside it to match later
    requests (its regime, config sizes, pins, residues); None where the tracer read the request
    otherwise than the cache would (no entry is kept)."""
    spec = an.spec
    # the model's own ties, not those the trace added for the request's regime (K = H)
    regime_ties = getattr(an, "regime_ties", {}) or {}
    tied = {a: b for a, b in spec.tied.items() if a not in regime_ties}
    all_symbols = sorted((set(INPUT_SYMBOLS) | set(spec.symbols) | set(an.pinned)) - set(tied))
    meta: dict[str, Any] = {"key": k, "defaults": dict(spec.defaults), "tied": tied,
                            "follows": dict(getattr(spec, "follows", {}) or {}),
                            "all_symbols": all_symbols, "pinned": dict(an.pinned),
                            "lead_blocks": int(getattr(spec, "lead_blocks", 0) or 0)}
    if getattr(an, "stack_blocks", None):
        meta["stack_blocks"] = dict(an.stack_blocks)
    meta["facts"] = _facts(meta, sizes)
    meta["config_values"] = _config_values(meta, sizes)
    meta["residues"] = {s: [int(m), int(r)] for s, (m, r) in (getattr(an, "residues", None) or {}).items()}
    meta["per_rank_ones"] = _per_rank_ones(meta, _request_values(meta, sizes))
    if getattr(an, "bounds", None):
        meta["bounds"] = {s: list(b) for s, b in an.bounds.items()}
    traced = getattr(an, "request_facts", None)
    if traced and _free_stack_facts(meta, json.loads(json.dumps(traced))) != meta["facts"]:
        return None  # the tracer read this request otherwise: do not guess which requests match
    return meta

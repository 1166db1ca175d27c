"""``symcost graphs build [--only NAME]``: trace the graph library again (the top-level
``graphs/``: :data:`symcost.graph.library.CATALOGUE`), writing each ``<name>.json`` (the analysis
as the trace cache holds it), ``<name>.md`` (its formulas and their LaTeX) and the index
(``index.json``, ``index.md`` with the versions traced with). Run from a source checkout: the real
configs it traces are the test data's (``tests/data/configs``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click

from symcost.errors import SymcostError


def _root() -> Path:
    return Path(__file__).resolve().parent.parent.parent


@click.group(name="graphs", help="The graph library shipped with symcost (graphs/): regenerate it.")
def graphs():
    """The ``graphs`` command group."""


@graphs.command(name="build", help="Trace the graph library again and write graphs/<name>.json, <name>.md and "
                                   "the index.")
@click.option("--only", "only", multiple=True, metavar="NAME", help="only this graph (repeatable); the index keeps the others")
@click.option("--out", "out", default=None, metavar="DIR", help="the folder (default: graphs/ of this checkout)")
@click.option("--no-cache", "no_cache", is_flag=True, help="trace afresh rather than read the trace cache")
def build(only, out, no_cache):
    """Regenerate the library's graphs (all, or ``--only`` those) and its index."""
    from symcost.graph.library import CATALOGUE

    unknown = [n for n in only if n not in CATALOGUE]
    if unknown:
        raise SymcostError(f"no graph {unknown[0]!r} in the library; known: {', '.join(CATALOGUE)}")
    root = _root()
    if not (root / "tests" / "data" / "configs").is_dir():
        raise SymcostError("symcost graphs build runs in a source checkout of symcost (it traces tests/data/configs)")
    folder = Path(out).resolve() if out else root / "graphs"
    folder.mkdir(parents=True, exist_ok=True)
    use_cache = not no_cache  # (the trace cache's key holds the sources and versions: an entry is what a trace gives)
    cwd = os.getcwd()
    os.chdir(root)  # (config paths as the catalogue gives them, relative to the checkout)
    try:
        names = list(only) or list(CATALOGUE)
        entries = {e["name"]: e for e in _old_index(folder) if e.get("name") in CATALOGUE}
        failed = {}
        for i, name in enumerate(names, 1):
            click.echo(f"[{i}/{len(names)}] {name}", err=True)
            try:
                entries[name] = build_one(name, folder, use_cache)
            except SymcostError as e:  # (the others are still built; this one keeps its old graph, if any)
                failed[name] = str(e)
                click.echo(f"[{i}/{len(names)}] {name} failed: {e}", err=True)
                continue
            write_index(folder, [entries[n] for n in CATALOGUE if n in entries])  # (after each: a stop keeps the rest)
        if failed:
            raise SymcostError(f"{len(failed)} of {len(names)} graph(s) could not be traced ({', '.join(failed)}; "
                               "each keeps its previous graph, if any): " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
        if not only:  # (graphs no longer in the catalogue)
            for p in folder.iterdir():
                if p.suffix in (".json", ".md") and p.stem not in CATALOGUE and p.stem != "index":
                    p.unlink()
    finally:
        os.chdir(cwd)
    click.echo(f"{len(names)} graph(s) written to {folder}; the index lists {len(entries)}")


def _old_index(folder: Path) -> list[dict]:
    from symcost.graph.library import index

    return index(folder)


def build_one(name: str, folder: Path, use_cache: bool = True) -> dict:
    """Trace (or read from the trace cache: its key holds the sources and versions) the catalogue's
    ``name`` and write ``<name>.json`` and ``<name>.md``; returns its index entry."""
    from symcost.commands._options import _trace_fresh
    from symcost.graph import cache
    from symcost.graph.analysis import Analysis
    from symcost.graph.library import CATALOGUE, FORMAT, PRECISION, library_key, versions
    from symcost.render.graphs import page

    model, cfg, attention, sizes = CATALOGUE[name]
    k = cache.key(model, cfg, attention, PRECISION, None)
    an = cache.load(k, sizes) if use_cache and k is not None else None
    path = Path(an.__dict__["cached_from"]) if an is not None else None
    if an is None:
        an = _trace_fresh(model, cfg, attention, PRECISION, dict(sizes), quiet=True)
        path = cache.store(k, sizes, an) if k is not None else None
    if path is not None:
        data = json.loads(path.read_text())
        meta = json.loads(path.with_name(path.name.replace(".json", ".meta.json")).read_text())
    else:
        data, meta = an.to_dict(), cache.entry_meta(k, sizes, an)
        if meta is None:
            raise SymcostError(f"{name}: the tracer read the request {sizes} otherwise than the cache would")
    src = dict(meta["key"]["source"])
    src.pop("path", None)  # (this machine's absolute path)
    meta["key"] = {**meta["key"], "source": src}
    tw = {**versions(), "kind": src.get("kind")}
    entry = {"name": name, "file": f"{name}.json", "model": model, "config": dict(cfg), "attention": attention,
             "precision": PRECISION, "sizes": dict(sizes), "library_key": library_key(model, cfg, attention, PRECISION),
             "sizes_traced": cache._request_values(meta, sizes), "traced_with": tw, "meta": meta}
    if model.endswith(".json"):
        import hashlib

        entry["file_sha256"] = hashlib.sha256(Path(model).read_bytes()).hexdigest()
    (folder / f"{name}.json").write_text(json.dumps({"format": FORMAT, **entry, "analysis": data},
                                                    separators=(",", ":")) + "\n")
    (folder / f"{name}.md").write_text(page(name, entry, Analysis.from_dict(data)))
    return entry


def write_index(folder: Path, entries: list[dict]) -> None:
    """``index.json`` (what :func:`symcost.graph.library.lookup` reads) and ``index.md``."""
    from symcost.graph.library import FORMAT
    from symcost.render.graphs import index_page

    (folder / "index.json").write_text(json.dumps({"format": FORMAT, "graphs": entries}, indent=1, sort_keys=True) + "\n")
    (folder / "index.md").write_text(index_page(entries))

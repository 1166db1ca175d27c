"""The package is laid out by pipeline stage and no import points back up the pipeline.

The import graph is read from the sources (``ast``: every ``import``/``from ... import`` at any
depth, relative ones resolved, plus ``LazyModule("symcost....")`` stand-ins; imports under ``if
TYPE_CHECKING:`` are annotations, not imports) into a ``networkx.DiGraph`` of modules. Stages are
ranked as docs/architecture.md lists them; an edge from a module to one of a later stage is a back
arrow, and the module graph must have no cycle.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "symcost"

#: the stages in pipeline order (docs/architecture.md); a module may import its own stage and earlier ones
STAGES = ["foundation", "frontends", "tracing", "graph", "hardware", "passes", "validation", "render",
          "commands", "cli"]
FOUNDATION = {"symcost.errors", "symcost._lazy", "symcost.units", "symcost._compat", "symcost._quiet", "symcost._memo"}
#: packages a pass or the op graph must not use: printing is rendering's job
RENDERING_LIBS = {"rich", "click", "matplotlib"}


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def stage_of(mod: str) -> str | None:
    if mod in FOUNDATION:
        return "foundation"
    if mod == "symcost.cli":
        return "cli"
    parts = mod.split(".")
    if len(parts) >= 2 and parts[1] in STAGES:
        return parts[1]
    return None


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Modules (symcost's and third-party top-level names) that ``path`` imports at run time."""
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _type_checking(node):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            for a in node.names:  # ``from symcost.graph import rules`` imports symcost.graph.rules
                out.add(f"{target}.{a.name}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyModule" and node.args
              and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph(root: pathlib.Path = ROOT) -> nx.DiGraph:
    """Module -> modules of the package it imports (node attribute ``third_party``: the others)."""
    g = nx.DiGraph()
    files = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    for p in files:
        m = module_name(p, root)
        g.add_node(m, third_party=set())
        for imp in imports_of(p, root):
            if imp in modules and imp != m:
                g.add_edge(m, imp)
            elif not imp.startswith("symcost"):
                g.nodes[m]["third_party"].add(imp.split(".")[0])
    return g


def back_arrows(g: nx.DiGraph) -> list[tuple[str, str]]:
    rank = {s: i for i, s in enumerate(STAGES)}
    return [(a, b) for a, b in g.edges
            if a != "symcost" and stage_of(a) and stage_of(b) and rank[stage_of(b)] > rank[stage_of(a)]]


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph()


def test_every_module_is_in_a_stage(graph):
    loose = [m for m in graph if m != "symcost" and stage_of(m) is None]
    assert not loose, f"modules outside the stages {STAGES}: {loose}"


def test_no_import_back_up_the_pipeline(graph):
    back = back_arrows(graph)
    assert not back, "imports from an earlier stage to a later one: " + ", ".join(f"{a} -> {b}" for a, b in back)


def test_no_import_cycle(graph):
    # a package imports its own submodules (``from . import x``) by design; cycles among modules
    # would mean two modules need each other at run time
    g = graph.copy()
    g.remove_edges_from([(a, b) for a, b in graph.edges if b.startswith(a + ".") or a.startswith(b + ".")])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_passes_form_a_dag(graph):
    """The passes, each package taken as one concept (``symcost.passes.memory`` with its modules),
    import one another without a cycle at any depth (function-level imports included): issue 29's
    "the passes form a DAG". ``test_no_import_cycle`` lets a package import its own submodules,
    which would hide parallel -> memory -> memory.model -> parallel."""
    def concept(m):
        parts = m.split(".")
        return ".".join(parts[:3]) if parts[:2] == ["symcost", "passes"] and len(parts) > 2 else None

    g = nx.DiGraph()
    for a, b in graph.edges:
        ca, cb = concept(a), concept(b)
        if ca and cb and ca != cb:
            g.add_edge(ca, cb)
    assert g.number_of_edges() > 5  # the check sees the passes' imports
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"cycles among the passes: {cycles[:5]}"


def test_passes_and_graph_do_not_render(graph):
    bad = {m: sorted(graph.nodes[m]["third_party"] & RENDERING_LIBS) for m in graph
           if stage_of(m) in ("frontends", "tracing", "graph", "hardware", "passes")
           and graph.nodes[m]["third_party"] & RENDERING_LIBS}
    assert not bad, f"rendering libraries imported before the render stage: {bad}"


def test_the_check_sees_a_back_arrow(tmp_path):
    """The walk is not vacuous: in a copy of the package, a function-level import of a pass planted
    in the op graph is a back arrow, and one planted the other way round makes a cycle."""
    import shutil

    root = tmp_path / "symcost"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    rules = root / "graph" / "rules.py"
    rules.write_text(rules.read_text() + "\n\ndef _planted():\n    from symcost.passes import memory\n")
    g = import_graph(root)
    assert ("symcost.graph.rules", "symcost.passes.memory") in back_arrows(g)
    assert "symcost.graph.build" in imports_of(root / "commands" / "_options.py", root)


@pytest.mark.parametrize("old,new,name", [
    ("symcost." + "memory", "symcost.passes.memory", "memory_model"),
    ("symcost." + "memory", "symcost.render.memory", "report_section"),
    ("symcost." + "analysis", "symcost.graph.build", "trace"),
    ("symcost." + "analysis", "symcost.graph.analysis", "Analysis"),
    ("symcost." + "moe", "symcost.frontends.moe", "dispatch"),
    ("symcost." + "moe", "symcost.passes.moe", "summary"),
    ("symcost." + "report", "symcost.render.report", "render"),
    ("symcost." + "graphs.gpt2", "symcost.frontends.builtin.gpt2", "spec"),
])  # (old paths written in two parts so that a rewrite of imports leaves them alone)
def test_old_module_paths_still_import(old, new, name):
    """No public name is removed: the flat layout's paths import with a DeprecationWarning that
    names the new module, and give the same objects (run in a fresh interpreter)."""
    code = (f"import warnings, importlib\nwarnings.simplefilter('error')\n"
            f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as e:\n    print('warned', e)\n"
            f"warnings.simplefilter('ignore')\nimport {new} as n\nm = importlib.import_module({old!r})\n"
            f"print(getattr(m, {name!r}) is getattr(n, {name!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "warned symcost." in out and "is deprecated: import symcost." in out, out
    assert out.strip().endswith("True"), out


def test_help_does_not_import_torch():
    code = ("import sys\nfrom symcost.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False False"

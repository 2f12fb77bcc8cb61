"""gdskit's import graph: no cycles among its modules, and the engine core importing nothing above it.

The graph is read from the source with ``ast``, not by importing: every ``import`` counts,
at the top of a module or inside a function (a lazy import is a dependency all the same,
only paid later), and ``from gdskit import x`` is an edge to the submodule ``x`` when there
is one, else to the package.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from repo_paths import SRC

#: The ground floor every layer may use.
GROUND = ("gdskit.settings", "gdskit.errors", "gdskit.vocabulary", "gdskit.threads", "gdskit.durable", "gdskit.shutdown")

#: The engine core: the engine package and the ground floor under it.
CORE = ("gdskit.engine",) + GROUND

#: What the engine reads facts through besides itself: the machine's plain readers of /proc,
#: /sys and /etc (not the check's verdicts, reports or live probes).
FACT_READERS = ("gdskit.machine",)

#: Beside the engine: digests and their manifests (``gdskit.verify``). The engine checks reads
#: with it, the layers above use it; it imports only the ground floor.
BESIDE_ENGINE = ("gdskit.verify",)

#: The layers over the engine: they reach it through its door, ``gdskit.engine``, only.
FORMATS = ("gdskit.formats", "gdskit.data", "gdskit.dcp", "gdskit.torch", "gdskit.safetensors",
           "gdskit.transformers", "gdskit.vllm", "gdskit.group")
#: ``gdskit check``'s findings: the engine through its door too (the package face is theirs to use).
FINDINGS = ("gdskit.probe",)
ENGINE_DOOR = "gdskit.engine"
#: What of the core every layer may use directly: the ground floor and pure arithmetic.
SHARED_CORE = GROUND + ("gdskit.engine.plan",)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` stands for: itself, or the nearest enclosing module that exists."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def imports_of(name: str, path: Path, modules: dict[str, Path], package: str) -> dict[str, int]:
    """The modules of ``package`` that module ``name`` imports, anywhere in it, with the first line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != name:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    add(_known(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != package:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else _known(base, modules), node.lineno)
    return found


def import_graph(src: Path = SRC, package: str = "gdskit") -> dict[str, dict[str, int]]:
    modules = module_files(src, package)
    return {name: imports_of(name, path, modules, package) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    members = set(comp)
    edges = [f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in graph[a] if b in members]
    return " / ".join(comp) + ":\n    " + "\n    ".join(edges)


def core_violations(graph: dict[str, dict[str, int]], core: tuple[str, ...] = CORE,
                    allowed: tuple[str, ...] = FACT_READERS + BESIDE_ENGINE) -> list[str]:
    """Imports that take the core (directly, or through a fact reader it uses) outside itself."""
    out = []
    for name, targets in sorted(graph.items()):
        if not (_within(name, core) or _within(name, allowed)):
            continue
        for target, line in sorted(targets.items()):
            if not (_within(target, core) or _within(target, allowed)):
                out.append(f"{name} imports {target} (line {line})")
    return out


def engine_doors(graph: dict[str, dict[str, int]], layers: tuple[str, ...] = FORMATS, door: str = ENGINE_DOOR,
                 core: tuple[str, ...] = CORE, shared: tuple[str, ...] = SHARED_CORE) -> list[str]:
    """Imports by which ``layers`` reach the engine core other than through ``door``."""
    out = []
    for name, targets in sorted(graph.items()):
        if name == door or not _within(name, layers):
            continue
        for target, line in sorted(targets.items()):
            if target != door and (target == "gdskit" or _within(target, core)) and not _within(target, shared):
                out.append(f"{name} imports {target} (line {line})")
    return out


# -- the checker itself ------------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_checker_sees_lazy_relative_and_from_package_imports(tmp_path):
    src = _tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "def f():\n    from pkg import b  # lazy, and b is a submodule\n    return b\n",
        "pkg/b.py": "from . import c\n",
        "pkg/c.py": "import pkg.sub.d\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from ..a import f  # a name in pkg.a: an edge to pkg.a\nimport os\n",
        "pkg/e.py": "from pkg import VERSION  # not a submodule: the package\n",
    })
    graph = import_graph(src, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 2}
    assert graph["pkg.b"] == {"pkg.c": 1}
    assert graph["pkg.c"] == {"pkg.sub.d": 1}
    assert graph["pkg.sub.d"] == {"pkg.a": 1}
    assert graph["pkg.e"] == {"pkg": 1}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]


def test_checker_finds_a_core_module_reaching_up(tmp_path):
    src = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core.py": "def g():\n    from pkg.top import h\n",
        "pkg/reader.py": "import pkg.top\n",
        "pkg/top.py": "import pkg.core\n",
    })
    graph = import_graph(src, "pkg")
    assert core_violations(graph, ("pkg.core",), ()) == ["pkg.core imports pkg.top (line 2)"]
    assert core_violations(graph, ("pkg.core",), ("pkg.top",)) == []
    # A fact reader the core may use is held to the same rule.
    assert core_violations({"pkg.core": {"pkg.reader": 1}, "pkg.reader": {"pkg.top": 1}},
                           ("pkg.core",), ("pkg.reader",)) == ["pkg.reader imports pkg.top (line 1)"]


# -- gdskit ------------------------------------------------------------------------------

def test_the_graph_covers_gdskit():
    graph = import_graph()
    assert "gdskit.engine.read_route" in graph["gdskit.engine.file"]
    assert "gdskit.engine.backends.base" in graph["gdskit.engine.read_route"]
    assert len(graph) > 80


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n  " + "\n  ".join(_describe(graph, c) for c in found)


def test_the_engine_core_imports_nothing_above_it():
    found = core_violations(import_graph())
    assert not found, "the engine core reaches up:\n  " + "\n  ".join(found)


def test_machine_facts_import_only_the_ground_floor():
    found = core_violations(import_graph(), FACT_READERS, GROUND)
    assert not found, "machine facts reach up:\n  " + "\n  ".join(found)


def test_digests_import_only_the_ground_floor():
    graph = import_graph()
    assert "gdskit.verify.manifest" in graph
    found = core_violations(graph, BESIDE_ENGINE, GROUND)
    assert not found, "gdskit.verify reaches past the ground floor:\n  " + "\n  ".join(found)


#: What the format layer may import: parsing and planning over the engine, never a user API
#: (``gdskit.data``, ``gdskit.safetensors``, ...) or a tool above it.
BELOW_FORMATS = ("gdskit.formats",) + CORE + FACT_READERS + BESIDE_ENGINE


def test_the_formats_import_no_user_api_above_them():
    found = core_violations(import_graph(), ("gdskit.formats",), BELOW_FORMATS)
    assert not found, "the formats reach up to a user API:\n  " + "\n  ".join(found)


def test_the_layers_above_reach_the_engine_through_its_door():
    graph = import_graph()
    assert "gdskit.engine.buffers" in graph[ENGINE_DOOR]  # the door itself may
    assert engine_doors({"gdskit.torch": {"gdskit.engine.buffers": 3, "gdskit.errors": 4}}) == [
        "gdskit.torch imports gdskit.engine.buffers (line 3)"]
    found = engine_doors(graph)
    found += [f for f in engine_doors(graph, FINDINGS) if not f.endswith(" imports gdskit") and " imports gdskit (" not in f]
    assert not found, "a layer reaches the engine past gdskit.engine:\n  " + "\n  ".join(found)


def private_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports of a private (``_x``) module from outside the package that holds it."""
    out = []
    for name, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            parent, _, leaf = target.rpartition(".")
            if leaf.startswith("_") and not _within(name, (parent,)):
                out.append(f"{name} imports {target} (line {line})")
    return out


def test_no_module_imports_another_packages_private_module():
    assert private_imports({"gdskit.torch": {"gdskit.dcp._reader": 2}, "gdskit.dcp": {"gdskit.dcp._reader": 1}}) == [
        "gdskit.torch imports gdskit.dcp._reader (line 2)"]
    found = private_imports(import_graph())
    assert not found, "private modules used from outside their package:\n  " + "\n  ".join(found)

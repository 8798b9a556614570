"""Repository hygiene, checked from the files alone (nothing is imported or run):

- no tracked file points at the maintainers' private notes (a folder named `shared` next to the
  repository, and the notes kept there), which users of the repository do not have;
- no import cycle among the project's own modules.

The import graph is read with `ast`. Every `import`/`from ... import` that runs when its code runs is an
edge: those at module level (including inside `try`/`if` there) and those inside functions and methods
(a deferred import still closes a cycle, it only postpones it). Imports under `if TYPE_CHECKING:` are
left out (they never run). Importing `a.b.c` is an edge to the module `a.b.c` only, not to its parent
packages' `__init__` (Python runs those too, but a package that re-exports its submodules would then
be a cycle with each of them); `from pkg import name` is an edge to `pkg.name` when that is a module
of the project, else to `pkg` itself. Files in a folder without `__init__.py` (scripts/, experiments/)
import their siblings by bare name (they run with their own folder on `sys.path`), so a bare name
that matches a sibling file resolves to it. `importlib.import_module(...)` and other dynamic imports
are not edges. tests/ is not checked (its helpers are imported by bare name from the test files only).
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The project's code: packages and entry-point folders (those that do not exist are skipped).
CODE_DIRS = ("runtime", "builder", "plugins", "serving", "deploy", "bench", "scripts", "experiments")

# The needles are assembled so that this file does not contain them.
_RECIPES = "RECI" + "PES"
_NOTES = tuple(name + ".md" for name in (_RECIPES, "DESI" + "GN", "STY" + "LE"))
_RECIPES_WORD = re.compile(rf"\b{_RECIPES}\b")      # it is cited without its suffix too
_SHARED = ("../" + "shared", "/work/" + "shared", "shared" + "/")


# ---------------------------------------------------------------------------------------------------
# References to the private notes


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def note_references(text: str) -> list[str]:
    """The needles found in `text`, one entry per offending line (`line N: ...`)."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        found = [s for s in _NOTES if s in line] or _RECIPES_WORD.findall(line)[:1]
        # the folder name is a citation only as a name of its own, not as the end of another one
        # (`tests/<it>/` would be one, `unshared` or `shared_prefix` followed by a slash are not).
        found += [s for s in _SHARED if _as_path(line, s)]
        if found:
            hits.append(f"line {n}: {', '.join(found)}: {line.strip()[:120]}")
    return hits


def _as_path(line: str, needle: str) -> bool:
    start = 0
    while (i := line.find(needle, start)) >= 0:
        before = line[i - 1] if i else " "
        if needle[0] in "./" or not (before.isalnum() or before in "_-"):
            return True
        start = i + 1
    return False


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:             # deleted in the work tree, not yet in the index
        return None
    if b"\0" in data[:8192]:    # binary (plots)
        return None
    return data.decode("utf-8", errors="replace")


def test_no_tracked_file_cites_the_private_notes():
    bad = {}
    for path in tracked_files():
        text = _text(path)
        if text is not None and (hits := note_references(text)):
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, ("tracked files cite notes users do not have (say the fact in the repository's own "
                     "words, e.g. in docs/INSTALL.md):\n" +
                     "\n".join(f"  {f}: {h}" for f, hits in sorted(bad.items()) for h in hits))


@pytest.mark.parametrize("line", [
    "see " + _NOTES[0], "as " + _NOTES[2] + " says", "../" + "shared" + "/x", "cat /work/" + "shared" + "/a",
    "in shared" + "/ notes", "`shared" + "/`", "(" + _RECIPES + ": the wheel)",
])
def test_note_references_catch_a_citation(line):
    assert note_references("ok\n" + line)[0].startswith("line 2:")


@pytest.mark.parametrize("line", ["shared_prefix/", "unshared" + "/x", "recipes", "MY_RECIPES_DIR", "a shared prefix",
                                  "DESIGN"])
def test_note_references_let_ordinary_words_pass(line):
    assert note_references(line) == []


# ---------------------------------------------------------------------------------------------------
# Import cycles


def module_files(root: Path = ROOT, dirs: tuple[str, ...] = CODE_DIRS) -> dict[str, Path]:
    """Module name -> file, for every .py file under `dirs` (a package's `__init__.py` is the package)."""
    mods = {}
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")) if (root / d).is_dir() else ():
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, deferred) for each import statement that can run: deferred = inside a function."""
    def walk(node, deferred):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), deferred)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, deferred
            yield from walk(child, deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                  ast.Lambda)))
    yield from walk(tree, False)


def import_graph(mods: dict[str, Path], root: Path = ROOT) -> dict[str, dict[str, tuple[int, bool]]]:
    """module -> {imported project module: (line, deferred)} (the first import of each target)."""
    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        # a file outside a package runs with its folder on sys.path: bare names are its siblings first
        siblings = package if package and not (path.parent / "__init__.py").is_file() else None

        def resolve(dotted: str, absolute: bool) -> str | None:
            """The longest project module that `dotted` names or lies in."""
            for cand in ([f"{siblings}.{dotted}"] if absolute and siblings else []) + [dotted]:
                parts = cand.split(".")
                for k in range(len(parts), 0, -1):
                    if ".".join(parts[:k]) in mods:
                        return ".".join(parts[:k])
            return None

        edges: dict[str, tuple[int, bool]] = {}
        for node, deferred in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name, True) for alias in node.names]
            else:
                if node.level:
                    base = package.split(".") if package else []
                    base = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
                    base_name = ".".join(base)
                else:
                    base_name = node.module or ""
                # `from pkg import name`: the module pkg.name if there is one, else pkg
                targets = [resolve(f"{base_name}.{alias.name}" if base_name else alias.name, not node.level)
                           for alias in node.names]
            for target in targets:
                if target is not None and target != name and target not in edges:
                    edges[target] = (node.lineno, deferred)
        graph[name] = edges
    return graph


def components(graph: dict[str, dict[str, tuple[int, bool]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(comps)


def shortest_cycle(graph: dict[str, dict[str, tuple[int, bool]]], comp: list[str]) -> list[str]:
    """A shortest cycle through the modules of `comp` (breadth-first from each back to itself)."""
    members, best = set(comp), None
    for start in comp:
        prev: dict[str, str | None] = {start: None}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        if found is not None:
            path = [found]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])
            if best is None or len(path) < len(best):
                best = path[::-1]
    assert best is not None
    return best


def cycles(graph: dict[str, dict[str, tuple[int, bool]]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component."""
    return [shortest_cycle(graph, comp) for comp in components(graph)]


def describe(comp: list[str], graph, mods, root: Path = ROOT) -> str:
    cycle = shortest_cycle(graph, comp)
    hops = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        line, deferred = graph[a][b]
        hops.append(f"    {a} -> {b} ({mods[a].relative_to(root)}:{line}{', in a function' if deferred else ''})")
    return (f"  {len(comp)} modules import each other: {', '.join(comp)}; a shortest cycle:\n" + "\n".join(hops))


def test_no_import_cycles():
    mods = module_files()
    graph = import_graph(mods)
    found = components(graph)
    assert not found, (f"{len(found)} import cycle(s) among the project's modules (each hop: importer -> "
                       "imported, where):\n" + "\n".join(describe(c, graph, mods) for c in found))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cycle_check_finds_module_level_and_deferred_cycles(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "from .b import B\nA = 1\n",
        "pkg/b.py": "def f():\n    from pkg.c import C\nB = 2\n",     # deferred edge
        "pkg/c.py": "from . import a\nC = 3\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from ..sub import y\n",
        "pkg/sub/y.py": "import pkg.sub.x\n",
        "scripts/run.py": "import helper\n",                          # bare sibling import
        "scripts/helper.py": "import run\n",
        "pkg/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.untyped import U\n",
        "pkg/untyped.py": "from pkg import typed\nU = 0\n",
    })
    mods = module_files(tmp_path, ("pkg", "scripts"))
    graph = import_graph(mods, tmp_path)
    assert graph["pkg.b"]["pkg.c"] == (2, True) and graph["pkg.a"]["pkg.b"] == (1, False)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.x", "pkg.sub.y"], ["scripts.helper", "scripts.run"]]
    assert "pkg.untyped" not in graph["pkg.typed"]        # TYPE_CHECKING imports never run


def test_cycle_check_passes_an_acyclic_package(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .a import A\nfrom . import b\n",   # a package re-exporting is no cycle
        "pkg/a.py": "from .b import B\nimport os\nA = 1\n",
        "pkg/b.py": "from pkg import c\nB = 2\n",
        "pkg/c.py": "import json\n",
    })
    mods = module_files(tmp_path, ("pkg",))
    graph = import_graph(mods, tmp_path)
    assert graph["pkg.b"] == {"pkg.c": (1, False)}
    assert cycles(graph) == []

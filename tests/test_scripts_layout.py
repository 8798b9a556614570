"""scripts/ holds only entry points, and the code they share is the `bench` package.

- no file in scripts/, bench/ or experiments/ adds to the import path (`sys.path.insert`,
  `sys.path[:0] = ...`, `site.addsitedir`, ...): they import the installed packages; writing back a
  saved copy (what bench/longctx_data.py does after RULER's scripts append to it) is no addition;
- no test puts scripts/ or experiments/ on sys.path (their names would shadow installed modules);
- no entry point is named like one of the project's packages: a script runs with its own folder
  first on sys.path, so scripts/bench.py would be what `import bench` finds for every script there;
- scripts/ has at most 16 files, every one listed in scripts/README.md; experiments/README.md
  names every experiment;
- every entry point answers `--help` with exit status 0: the scripts, the experiments, and the
  modules run as `python -m bench.x`.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("scripts", "bench", "experiments")
MAX_SCRIPTS = 16
MODULE_ENTRY_POINTS = ("bench.gpu_kernels", "bench.gpu_decode", "bench.gpu_results", "bench.llama_cpp",
                      "bench.cancel_latency", "bench.op_count", "bench.contention")
PATH_METHODS = {"insert", "append", "extend"}


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _targets_sys_path(target: ast.AST) -> bool:
    """`sys.path = ...` or `sys.path[...] = ...`."""
    return _is_sys_path(target) or (isinstance(target, ast.Subscript) and _is_sys_path(target.value))


def path_additions(source: str) -> list[tuple[int, str]]:
    """(line, code) of every statement in `source` that adds to the import path."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in PATH_METHODS and _is_sys_path(f.value)) or \
               (f.attr == "addsitedir" and isinstance(f.value, ast.Name) and f.value.id == "site"):
                found.append(node)
        elif isinstance(node, ast.AugAssign) and _targets_sys_path(node.target):
            found.append(node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple):
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else [None] * len(target.elts)
                    pairs = list(zip(target.elts, values))
                # a saved copy written back (a plain name) restores; anything else adds
                if any(_targets_sys_path(t) and not isinstance(v, ast.Name) for t, v in pairs):
                    found.append(node)
    return [(n.lineno, ast.get_source_segment(source, n) or "") for n in found]


def code_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def script_files() -> list[Path]:
    return sorted(p for p in (ROOT / "scripts").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def entry_points() -> list[tuple[str, list[str]]]:
    """(name, command) of every entry point, `--help` appended."""
    out = []
    for p in script_files() + code_files("experiments"):
        rel = str(p.relative_to(ROOT))
        if p.suffix == ".py":
            out.append((rel, [sys.executable, str(p), "--help"]))
        elif p.suffix == ".sh":
            out.append((rel, ["bash", str(p), "--help"]))
    out += [(f"-m {m}", [sys.executable, "-m", m, "--help"]) for m in MODULE_ENTRY_POINTS]
    return out


# ---- the checks' own checks: each detector catches what it is for ------------------------------
@pytest.mark.parametrize("code", [
    "import sys\nsys.path.insert(0, 'x')",
    "import sys\nsys.path.append('x')",
    "import sys\nsys.path.extend(['x'])",
    "import sys\nsys.path[:0] = ['a', 'b']",
    "import sys\nsys.path += ['x']",
    "import sys\nsys.path = ['x'] + sys.path",
    "import sys\nsys.path[:], x = ['x'], 1",
    "import site\nsite.addsitedir('x')",
])
def test_the_detector_finds_an_addition(code):
    assert len(path_additions(code)) == 1, code


@pytest.mark.parametrize("code", [
    "import sys\nsaved = list(sys.path)\nsys.path[:] = saved",
    "import sys\npath, argv = list(sys.path), sys.argv\nsys.path[:], sys.argv = path, argv",
    "import sys\nprint(sys.path[0])",
])
def test_the_detector_leaves_reads_and_restores(code):
    assert path_additions(code) == []


# ---- the layout -------------------------------------------------------------------------------
def test_no_import_path_additions_in_scripts_bench_experiments():
    found = [f"{p.relative_to(ROOT)}:{line}: {code}" for p in code_files(*CODE_DIRS)
             for line, code in path_additions(p.read_text())]
    assert not found, "import the `bench` package (or another installed package) instead:\n" + "\n".join(found)


def test_no_test_puts_scripts_on_the_import_path():
    found = [f"{p.relative_to(ROOT)}:{line}: {code}" for p in code_files("tests")
             for line, code in path_additions(p.read_text()) if "scripts" in code or "experiments" in code]
    assert not found, "load a script with tests/script_loader.py's load_script instead:\n" + "\n".join(found)


def test_no_entry_point_is_named_like_a_package():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert {"bench", "runtime"} <= packages
    clash = [str(p.relative_to(ROOT)) for p in script_files() + code_files("experiments") if p.stem in packages]
    assert not clash, f"{clash}: a sibling script would import this file for the package of that name"


def test_scripts_holds_at_most_16_files_each_listed_in_its_readme():
    files = script_files()
    assert len(files) <= MAX_SCRIPTS, f"{len(files)} files in scripts/ (at most {MAX_SCRIPTS}): " \
                                      f"{[str(p.relative_to(ROOT / 'scripts')) for p in files]}"
    readme = (ROOT / "scripts" / "README.md").read_text()
    missing = [p.name for p in files if p.name != "README.md" and f"`{p.name}`" not in readme]
    assert not missing, f"scripts/README.md does not list {missing}"
    not_entry = [p.name for p in files if p.suffix == ".py" and "__main__" not in p.read_text()]
    assert not not_entry, f"not entry points (no __main__): {not_entry}; a library goes to bench/"


def test_every_experiment_is_in_its_readme():
    readme = (ROOT / "experiments" / "README.md").read_text()
    assert "not maintained" in readme
    missing = [p.name for p in code_files("experiments") if f"`{p.name}`" not in readme]
    assert not missing, f"experiments/README.md does not say how to run {missing} or what result it re-makes"


@pytest.fixture(scope="module")
def help_runs() -> dict[str, subprocess.CompletedProcess | str]:
    """Every entry point's `--help`, four at a time (most of each is Python importing torch)."""
    def run(cmd: list[str]) -> subprocess.CompletedProcess | str:
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            return "timed out after 90 s"
    points = entry_points()
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip((name for name, _ in points), pool.map(run, (cmd for _, cmd in points))))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [name for name, _ in entry_points()])
def test_every_entry_point_answers_help(help_runs, name):
    r = help_runs[name]
    assert not isinstance(r, str), f"{name} --help: {r}"
    assert r.returncode == 0 and r.stdout.strip(), \
        f"{name} --help: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"

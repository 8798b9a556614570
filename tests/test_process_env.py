"""Thread settings are the runtime's: set before torch loads, by `import runtime` or an entry point.

- importing the library (`runtime`, its engine, `plugins.cpu`, the Dynamo worker module) in a fresh
  process sets GOMP_SPINCOUNT and nothing else, only where torch is not loaded yet and the user set
  neither variable, and an engine says which spin its process runs;
- no file under runtime/ or plugins/ writes the environment (`os.environ[...] = `, `.setdefault`,
  `.update`, `.pop`, `del`, `os.putenv`, ...), read from the source with `ast`;
- `runtime.threads.prepare_threads` gives the short OpenMP spin and leaves a user's GOMP_SPINCOUNT or
  OMP_WAIT_POLICY alone;
- the entry points (`python -m runtime`, a script, the Dynamo worker) have GOMP_SPINCOUNT set when
  torch is first imported: libgomp reads it once, then.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.threads import POLICY_VAR, SPIN_DEFAULT, SPIN_VAR, prepare_threads

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_DIRS = ("runtime", "plugins")
WRITE_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
WRITE_FUNCTIONS = {"putenv", "unsetenv"}


def clean_env() -> dict[str, str]:
    """This process's environment without the two thread settings (the Makefile exports one)."""
    return {k: v for k, v in os.environ.items() if k not in (SPIN_VAR, POLICY_VAR)}


def run_python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the import sets the spin, before torch and only then ----------------------------------------
CHANGES = ("after = dict(os.environ)\n"
           "from runtime.threads import spin_setting\n"
           "print(json.dumps({'changed': {k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()"
           " if before.get(k) != after.get(k)}, 'spin': spin_setting()}))")


@pytest.mark.parametrize("first", ["", "import torch\n", "os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'\n"],
                         ids=["runtime-first", "torch-first", "users-policy"])
def test_importing_the_library_sets_only_the_spin_and_only_before_torch(first):
    code = (f"import json, os\n{first}before = dict(os.environ)\n"
            "import runtime, runtime.engine, plugins.cpu, serving.dynamo_worker\n" + CHANGES)
    out = run_python(code)
    if first == "":
        assert out == {"changed": {SPIN_VAR: [None, SPIN_DEFAULT]}, "spin": f"{SPIN_VAR}={SPIN_DEFAULT}"}
    elif "torch" in first:        # libgomp already read its settings: nothing to gain, said instead
        assert out["changed"] == {} and out["spin"].startswith("default: torch was loaded before runtime")
    else:
        assert out == {"changed": {}, "spin": "yours (OMP_WAIT_POLICY=PASSIVE)"}


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
             and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ"))


def environ_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of every statement in `source` that writes the process environment."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and ((f.attr in WRITE_METHODS and _is_environ(f.value)) or
                                                 (f.attr in WRITE_FUNCTIONS and isinstance(f.value, ast.Name)
                                                  and f.value.id == "os")):
                found.append(node)
            elif isinstance(f, ast.Name) and f.id in WRITE_FUNCTIONS:
                found.append(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            if any(_is_environ(t) or (isinstance(t, ast.Subscript) and _is_environ(t.value)) for t in flat):
                found.append(node)
    return [(n.lineno, ast.get_source_segment(source, n) or "") for n in found]


@pytest.mark.parametrize("code", [
    "import os\nos.environ['A'] = '1'",
    "import os\nos.environ.setdefault('A', '1')",
    "import os\nos.environ.update(A='1')",
    "import os\nos.environ.pop('A', None)",
    "import os\ndel os.environ['A']",
    "import os\nos.putenv('A', '1')",
    "from os import environ\nenviron['A'] = '1'",
    "from os import putenv\nputenv('A', '1')",
    "import os\nos.environ['A'], x = '1', 2",
])
def test_the_detector_finds_a_write(code):
    assert len(environ_writes(code)) == 1, code


@pytest.mark.parametrize("code", [
    "import os\nx = os.environ.get('A')",
    "import os\nenv = {**os.environ, 'A': '1'}",
    "import os\nenv = dict(os.environ)\nenv['A'] = '1'",
])
def test_the_detector_leaves_reads_and_copies(code):
    assert environ_writes(code) == []


def test_no_library_file_writes_the_environment():
    files = sorted(p for d in LIBRARY_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)
    assert files
    found = [f"{p.relative_to(ROOT)}:{line}: {code}" for p in files for line, code in environ_writes(p.read_text())]
    assert not found, "set thread settings through runtime/threads.py's prepare_threads:\n" + "\n".join(found)


# ---- prepare_threads -----------------------------------------------------------------------------
def test_prepare_threads_gives_the_short_spin():
    env = {"PATH": "/bin"}
    assert prepare_threads(env) == {SPIN_VAR: SPIN_DEFAULT}
    assert env == {"PATH": "/bin", SPIN_VAR: SPIN_DEFAULT}
    assert prepare_threads(env) == {}                       # a second call changes nothing


@pytest.mark.parametrize("user", [{SPIN_VAR: "300000"}, {POLICY_VAR: "PASSIVE"}, {POLICY_VAR: ""}])
def test_prepare_threads_leaves_a_users_setting(user):
    env = dict(user)
    assert prepare_threads(env) == {}
    assert env == user


def test_importing_the_thread_settings_loads_no_torch():
    """A launcher imports runtime.threads first, then calls prepare_threads before torch loads:
    that import (and the runtime package's __init__ it runs) must not load torch."""
    import subprocess
    import sys

    code = "import sys, runtime.threads; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_prepare_threads_defaults_to_this_process(monkeypatch):
    monkeypatch.delenv(SPIN_VAR, raising=False)
    monkeypatch.delenv(POLICY_VAR, raising=False)
    assert prepare_threads() == {SPIN_VAR: SPIN_DEFAULT}
    assert os.environ[SPIN_VAR] == SPIN_DEFAULT


# ---- the entry points set it before torch loads --------------------------------------------------
# Each runs as its own process would (runpy, as __main__) under an import hook that records
# GOMP_SPINCOUNT at the first `import torch`.
WATCH = """import json, os, runpy, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get({spin!r}))
sys.meta_path.insert(0, Watch())
sys.argv = {argv!r}
try:
    {run}
except SystemExit:
    pass
print(json.dumps(seen))
"""
ENTRIES = {
    # a real command that loads the engine module (and torch), then refuses the missing dir
    "python -m runtime": ("runpy.run_module('runtime', run_name='__main__', alter_sys=True)",
                          ["runtime", "generate", "--engine", "/nonexistent/engine", "--prompt", "x"]),
    "scripts/bench_decode.py": ("runpy.run_path('scripts/bench_decode.py', run_name='__main__')",
                                ["scripts/bench_decode.py", "--help"]),
    "python -m serving.dynamo_worker": ("runpy.run_module('serving.dynamo_worker', run_name='__main__', "
                                        "alter_sys=True)", ["serving.dynamo_worker", "--help"]),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_point_sets_it_before_torch_loads(entry):
    run, argv = ENTRIES[entry]
    assert run_python(WATCH.format(spin=SPIN_VAR, argv=argv, run=run)) == [SPIN_DEFAULT], entry


OMP_POOL = """
import os, sys, time
from runtime.threads import off_main_thread, prepare_threads
prepare_threads()
import torch
torch.set_num_threads(2)
def work():
    a = torch.randn(512, 512)
    for _ in range(3):
        a @ a
    return 7
before = len(os.listdir("/proc/self/task"))
if sys.argv[1] == "off":
    assert off_main_thread(work) == 7
else:
    work()
time.sleep(0.2)
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_an_engine_built_off_the_main_thread_leaves_no_openmp_pool_behind():
    """A parallel region on the main thread leaves its OpenMP workers alive (which made a server's
    loop thread step 1.6x slower: libgomp stops spinning past one thread a core); one run through
    `off_main_thread` leaves none, and its result and errors come back."""
    def extra(where):
        out = subprocess.run([sys.executable, "-c", OMP_POOL, where], capture_output=True, text=True, cwd=ROOT,
                             check=True)
        return int(out.stdout.strip().splitlines()[-1])
    assert extra("main") >= 1 and extra("off") == 0
    from runtime.threads import off_main_thread
    with pytest.raises(ZeroDivisionError):
        off_main_thread(lambda: 1 / 0)

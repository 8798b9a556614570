"""On a machine with a GPU, importing the package compiles nothing (issue: the first H200 run died
in its env stage, where `import plugins` JIT-built the CUDA extension inside a 10 s limit).

Here torch is made to report a GPU (a sitecustomize patches `torch.cuda.is_available` and the device
queries in every Python process of a subprocess) and every way a build could start is recorded:
`torch.utils.cpp_extension.load` and any subprocess that runs nvcc or ninja. Then:

- importing runtime, builder, plugins (and runtime.ops, runtime.transfer.cuda, runtime.engine)
  records nothing, while an explicit `plugins.ensure_cuda_kernels()` does try to build (so the
  recorder would have seen an import that built);
- the env stage of scripts/gpu_check.sh runs with the GPU reported and ends ok, having built nothing;
- the loader's build step: torch's own C++ standard, a stale lock removed, the built module
  recorded and imported prebuilt (no compile, no lock) by later processes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = textwrap.dedent('''
    """Test-only: torch reports a GPU; every attempt to build the CUDA extension is recorded."""
    import os, subprocess
    import torch
    import torch.utils.cpp_extension as _ext

    _MARK = os.environ["GPU_IMPORT_MARK"]

    def _note(what):
        with open(_MARK, "a") as f:
            f.write(what + "\\n")

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda *a, **k: "Fake H200 (test)"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

    def _load(*args, **kwargs):
        _note("cpp_extension.load " + str(kwargs.get("name", args[:1])))
        raise RuntimeError("test: cpp_extension.load called")

    _ext.load = _load
    _Popen = subprocess.Popen

    class _RecordingPopen(_Popen):
        def __init__(self, args, *a, **k):
            text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            if "nvcc" in text or "ninja" in text:
                _note("subprocess " + text[:200])
            super().__init__(args, *a, **k)

    subprocess.Popen = _RecordingPopen
''')


@pytest.fixture
def gpu_env(tmp_path):
    """Environment of a subprocess whose torch reports a GPU and records build attempts in `mark`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    mark = tmp_path / "builds.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "GPU_IMPORT_MARK": str(mark), "LOOKAHEAD_CUDA_BUILD_DIR": str(tmp_path / "torch_ext")}
    env.pop("LOOKAHEAD_CUDA_PREBUILT", None)
    return env, mark


IMPORTS = textwrap.dedent('''
    import os, torch
    assert torch.cuda.is_available(), "the sitecustomize did not load"
    import runtime, builder, plugins                  # noqa: E401,F401
    import runtime.ops, runtime.transfer.cuda, runtime.engine, builder.quantize  # noqa: E401,F401
    mark = os.environ["GPU_IMPORT_MARK"]
    print("after imports:", open(mark).read() if os.path.exists(mark) else "nothing built")
    assert not os.path.exists(mark), open(mark).read()
    # an engine selecting its ops for a CUDA device is where the build happens, once
    print("registered:", plugins.ensure_cuda_kernels(), plugins.ensure_cuda_kernels())
    print("after ensure_cuda_kernels:", open(mark).read().strip())
''')


def test_importing_the_package_with_a_gpu_compiles_nothing(gpu_env):
    env, mark = gpu_env
    r = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "after imports: nothing built" in r.stdout
    # the recorder works: the explicit registration tried to build, once for two calls
    assert "registered: False False" in r.stdout, r.stdout
    assert mark.read_text().count("cpp_extension.load lookahead_kv_cuda") == 1, mark.read_text()


@pytest.mark.timeout(150)
def test_env_stage_with_a_gpu_reported_builds_nothing_and_passes(gpu_env, tmp_path):
    """The env stage of the real (not dry) run, torch reporting a GPU: it imports runtime, builder and
    plugins and reads the device, and it ends ok, not by its limit, with no build attempted."""
    env, mark = gpu_env
    out = tmp_path / "out"
    # this machine's torch takes ~5 s to import on a loaded 2-core VM: the env limit gets 10 s more
    # than the GPU run's 15, the bench 10 s less, so the limits still add up to the budget
    env = {**env, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_STAGES": "env", "T_ENV": "25",
           "T_BENCH": "140", "GPU_CHECK_SCRATCH": str(tmp_path / "scratch")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    log = (out / "setup.log").read_text()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert "\nenv      ok " in "\n" + summary and "Fake H200 (test)" in summary, summary
    assert "imports: runtime, builder, plugins" in log and "nothing compiled" in log, log
    assert not mark.exists(), mark.read_text()
    assert sorted(p.name for p in out.iterdir()) == ["setup.log", "summary.txt"]


def test_loader_build_step_takes_torchs_standard_and_records_the_module(tmp_path, monkeypatch):
    """What `python -m plugins.cuda.loader build` does, with cpp_extension.load stubbed: no -std of
    its own among the flags (torch adds the standard its headers need), a stale lock removed first,
    the built module recorded; with LOOKAHEAD_CUDA_PREBUILT=1 that module is imported directly,
    and without a record the import fails at once instead of compiling."""
    from torch.utils import cpp_extension

    from plugins.cuda import loader
    monkeypatch.setenv("LOOKAHEAD_CUDA_BUILD_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(loader.PREBUILT_ENV, raising=False)
    module_file = tmp_path / "built" / "lookahead_kv_cuda.py"       # stands in for the .so
    module_file.parent.mkdir()
    module_file.write_text("MARK = 'the built extension'\n")
    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs)
        assert not loader.lock_path().exists(), "the stale lock must be gone before the build"
        return type("M", (), {"__file__": str(module_file)})

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    (tmp_path / "ext").mkdir()
    loader.lock_path().write_text("")                          # left by a killed build
    os.utime(loader.lock_path(), (0, 0))                        # long ago
    loader._compile()
    (kw,) = calls
    flags = [*kw["extra_cflags"], *kw["extra_cuda_cflags"]]
    assert flags and not any(f.startswith("-std") for f in flags), flags
    assert kw["build_directory"] == str(tmp_path / "ext")
    record = json.loads((tmp_path / "ext" / loader.PREBUILT_FILE).read_text())
    assert record["module"] == str(module_file.resolve())

    monkeypatch.setenv(loader.PREBUILT_ENV, "1")
    assert loader.load_extension.__wrapped__().MARK == "the built extension"
    assert len(calls) == 1                                      # imported, not built
    (tmp_path / "ext" / loader.PREBUILT_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="plugins.cuda.loader build"):
        loader.load_extension.__wrapped__()
    assert len(calls) == 1


def test_a_fresh_lock_is_left_to_its_build_and_the_build_step_removes_any(tmp_path, monkeypatch):
    from plugins.cuda import loader
    monkeypatch.setenv("LOOKAHEAD_CUDA_BUILD_DIR", str(tmp_path))
    loader.lock_path().write_text("")
    assert not loader.clear_stale_lock() and loader.lock_path().exists()     # a build may hold it now
    r = subprocess.run([sys.executable, "-m", "plugins.cuda.loader", "build", "--dry-run"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**os.environ, "LOOKAHEAD_CUDA_BUILD_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stale lock: removed" in r.stdout and not loader.lock_path().exists()
    assert "dry run: nothing compiled" in r.stdout

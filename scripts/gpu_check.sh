#!/usr/bin/env bash
# The one-shot GPU check (H200): engine dirs, kernels, the CUDA transfer engine, decode timing of the
# real engine. At most 420 s in all, builds included.
#
#   scripts/gpu_check.sh                    # results under ${OUT:-out/gpu_check}
#   scripts/gpu_check.sh --dry-run          # here, without a GPU: every Python stage on CPU, small shapes
#   scripts/gpu_check.sh --prepare          # here, with the network: fill build/wheelhouse (pytest)
#   scripts/gpu_check.sh --help             # this text
#
# On the GPU machine (the `run` tool; its $OUT is the folder that comes back, and this script writes
# there), with the wheelhouse carried (ignored by git, so it must be named):
#   prepare here:  bash scripts/gpu_check.sh --prepare             (~2 MiB: pytest and its deps, cp312)
#   run there:     command "bash scripts/gpu_check.sh", carry ["build/wheelhouse"], timeout_s 450
# Nothing else needs carrying: the kernels build there (build/torch_ext), the engine dirs are
# random-weights recipes written there (build/gpu_check/engines), and the working tree has the rest.
#
# What comes back is at most 8 files of $OUT (names [A-Za-z0-9._-], no deeper than $OUT/a/b), so
# this script writes 7 files, all directly in $OUT, and everything else (engine dirs, the
# extension build, pytest's temporaries) outside it, under build/:
#   summary.txt          the stage table, replaced after every stage (a kill keeps what finished)
#   setup.log            the env and build stages' output
#   kernels.log          the extension build (kbuild) and the kernel checks
#   kernel_check.json    python -m bench.gpu_kernels's results
#   tests.log            pytest's output
#   bench.log            python -m bench.gpu_decode's output and table
#   decode_bench.json    its results
# Every JSON is replaced atomically (temporary file + rename) after each check or row, so a
# sticky CUDA fault or a kill at any moment loses nothing recorded before it.
#
# Stages, each under its own limit; the limits add up to the budget (BUDGET_S, 420 s), and a stage
# that would pass the budget gets only what is left of it. env and build only check and prepare:
# importing runtime, builder and plugins compiles nothing.
#   stage    limit  what                                                         -> output
#   env        40   versions, nvidia-smi, importable modules, the imports (a cold
#                   machine's first CUDA torch import alone can take 20-30 s)     -> setup.log
#   build      20   scripts/build_engine.py --random-weights for llama3-8b,
#                   qwen3-8b-yarn and smollm2-135m (bfloat16; engine.yaml recipes,
#                   no weights); bench times them in that order, as its budget allows -> setup.log
#   (cpulib)        the CPU kernel library (plugins/cpu): started with build, in the background
#                   (one core, beside kbuild), waited for before kernels: built before any
#                   timing; its own wall of 100 s                                 -> setup.log
#   kbuild     90   the kernels stage's first step: python -m plugins.cuda.loader build (a stale
#                   build/torch_ext/lock removed first; the torch extension, all .cu + the
#                   bindings, for sm_90); from then on every process imports the built module
#                   (LOOKAHEAD_CUDA_PREBUILT=1: no compile, no lock)             -> kernels.log
#   kernels    75   python -m bench.gpu_kernels: numerics through the extension,
#                   torch.ops and the wrappers, bandwidths; the >2^31-element cases
#                   in a child process (50 s)                                     -> kernels.log, kernel_check.json
#   tests      45   pytest -m "not slow" tests/test_transfer_cuda.py tests/test_cuda_kernels.py
#                                                                                 -> tests.log
#   bench     150   python -m bench.gpu_decode: the real engine, dense vs lookahead under one
#                   device KV budget at 32K, each shape in a child process         -> bench.log, decode_bench.json
# The summary table is printed last (summary.txt). Exit status: 0 when every stage passed, 2
# without a usable GPU, 1 otherwise.
#
# --dry-run (tests/test_eval_scripts.py runs it; about a minute here): the same stages on CPU with the
# repository's .venv, under limits shifted for a shared 2-core machine (env 25, build 30, kbuild 20,
# bench 200; the same 420 s in all): env without the GPU requirement; build writes the `tiny` random-weights shape;
# kbuild removes a stale lock and prints its plan (no CUDA build of torch here); kernels runs
# bench.gpu_kernels --device cpu (the checks' machinery against the torch ops, a child process,
# the bandwidth code); tests collects the CUDA test files (through the wheelhouse when there is
# one); bench runs bench.gpu_decode on CPU over the tiny engine (256 tokens, every row, the
# satisfied-transfer round, the copy replay, the graph path's eager half).
# GPU_CHECK_STAGES (default env,build,kbuild,kernels,tests,bench) runs only the stages it names
# (tests/test_gpu_import.py runs the env stage with a GPU reported).
#
# pytest: when the machine's python has none, the wheels in WHEELHOUSE (default build/wheelhouse)
# are unpacked into a temporary directory put first on PYTHONPATH.
set -uo pipefail    # no -e: a failing stage is recorded and the next one runs

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
DRY=0 PREPARE=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    --prepare) PREPARE=1 ;;
    -h | --help) sed -n '2,/^set -uo pipefail/{/^set -uo/d; s/^# \{0,1\}//; p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    "") ;;
    *) echo "gpu_check: unknown option $1 (use --dry-run, --prepare, --help, or nothing)" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
if [[ ($DRY == 1 || $PREPARE == 1) && -z "${PYTHON:-}" && -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; fi
# The repository's packages (runtime, builder, plugins, bench) for every python this starts, also
# where they are not pip-installed (the GPU machine's python): the stages run `python -m bench.x`.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
WHEELHOUSE="${WHEELHOUSE:-$ROOT/build/wheelhouse}"
WHEELHOUSE_MAX_MIB=16               # of the 64 MiB the working tree may take to the GPU machine

# ---- --prepare: the wheelhouse the GPU machine's python (3.12, no network) installs pytest from -----
if [[ $PREPARE == 1 ]]; then
    mkdir -p "$WHEELHOUSE"
    "$PY" -m pip download -q pytest pytest-timeout --python-version 3.12 --only-binary :all: \
        --platform manylinux2014_x86_64 --platform any -d "$WHEELHOUSE" || exit 1
    kib=$(du -sk "$WHEELHOUSE" | cut -f1)
    ls -1 "$WHEELHOUSE"
    echo "gpu_check: $WHEELHOUSE holds $((kib / 1024)).$(((kib % 1024) * 10 / 1024)) MiB; carry [\"build/wheelhouse\"]"
    if ((kib > WHEELHOUSE_MAX_MIB * 1024)); then
        echo "gpu_check: the wheelhouse is over ${WHEELHOUSE_MAX_MIB} MiB" >&2
        exit 1
    fi
    exit 0
fi

OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUDGET_S="${GPU_CHECK_BUDGET_S:-420}"
if [[ $DRY == 1 ]]; then   # a 2-core machine shared with a test suite: torch alone takes ~5 s to import there
    T_ENV="${T_ENV:-25}" T_BUILD="${T_BUILD:-30}" T_KBUILD="${T_KBUILD:-20}" T_KERNELS="${T_KERNELS:-85}"
    T_TESTS="${T_TESTS:-60}" T_BENCH="${T_BENCH:-200}"
else
    T_ENV="${T_ENV:-40}" T_BUILD="${T_BUILD:-20}" T_KBUILD="${T_KBUILD:-90}" T_KERNELS="${T_KERNELS:-75}"
    T_TESTS="${T_TESTS:-45}" T_BENCH="${T_BENCH:-150}"
fi
LIMITS_S=$((T_ENV + T_BUILD + T_KBUILD + T_KERNELS + T_TESTS + T_BENCH))
if ((LIMITS_S > BUDGET_S)); then
    echo "gpu_check: the stage limits add up to ${LIMITS_S}s, over the ${BUDGET_S}s budget" >&2
    exit 2
fi
STAGES_WANTED="${GPU_CHECK_STAGES:-env,build,kbuild,kernels,tests,bench}"
wanted() { [[ ",$STAGES_WANTED," == *",$1,"* ]]; }
SCRATCH="${GPU_CHECK_SCRATCH:-$ROOT/build/gpu_check}"     # outside $OUT: only $OUT's files come back
ENGINES="${GPU_ENGINES_DIR:-$SCRATCH/engines}"
mkdir -p "$SCRATCH"
export LOOKAHEAD_CUDA_BUILD_DIR="${LOOKAHEAD_CUDA_BUILD_DIR:-$ROOT/build/torch_ext}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"     # H100/H200: the extension for sm_90 only
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"                        # ninja's parallel nvcc jobs
export PYTHONUNBUFFERED=1
START=$SECONDS
for f in summary.txt setup.log kernels.log kernel_check.json tests.log bench.log decode_bench.json; do
    rm -f "$OUT/$f"
done

STAGES=() STATUS=() SECS=() NOTES=()
RUNNING="" RUNNING_AT=0
# write_summary: summary.txt from what has run so far, replaced atomically (a kill at any moment
# leaves the last whole one, with the stage that was running named)
write_summary() {
    local tmp="$OUT/.summary.txt.tmp"
    {
        if [[ -f "$OUT/bench.log" ]] && grep -q '^decode steps on' "$OUT/bench.log"; then
            sed -n '/^decode steps on/,/^wrote /p' "$OUT/bench.log"
            echo
        fi
        printf '%-8s %-14s %6s  %s\n' stage status seconds result
        for i in "${!STAGES[@]}"; do
            printf '%-8s %-14s %6s  %s\n' "${STAGES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
        done
        if [[ -n $RUNNING ]]; then
            printf '%-8s %-14s %6s  %s\n' "$RUNNING" running - "started at ${RUNNING_AT}s (killed there if this line is last)"
        fi
        echo "total $((SECONDS - START))s of a ${BUDGET_S}s budget (stage limits add up to ${LIMITS_S}s); results in $OUT"
    } >"$tmp"
    mv -f "$tmp" "$OUT/summary.txt"
}
record() {   # name status seconds note
    STAGES+=("$1") STATUS+=("$2") SECS+=("$3") NOTES+=("$4")
    RUNNING=""
    write_summary
}

# run_stage NAME LIMIT_S LOG CMD...: run CMD under `timeout`, capped by what is left of the budget,
# its output appended to LOG. Sets STAGE_RC (124 on timeout), STAGE_STATUS and STAGE_SECS.
run_stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((limit > left)); then limit=$left; fi
    if ((limit < 10)); then
        STAGE_RC=125 STAGE_STATUS=SKIPPED STAGE_SECS=0
        echo "== $name: skipped, ${left}s left of the ${BUDGET_S}s budget" | tee -a "$log"
        return
    fi
    echo "== $name (limit ${limit}s) -> $log"
    echo "== $name (limit ${limit}s)" >>"$log"
    RUNNING=$name RUNNING_AT=$((SECONDS - START))
    write_summary
    local t0=$SECONDS
    # TERM 5 s before the limit, KILL at it: the limit is a wall, even for a stage that ignores TERM
    timeout --signal=TERM --kill-after=5 "$((limit - 5))" "$@" >>"$log" 2>&1
    STAGE_RC=$?
    STAGE_SECS=$((SECONDS - t0))
    case $STAGE_RC in
        0) STAGE_STATUS=ok ;;
        124 | 137) STAGE_STATUS="TIMEOUT(${limit}s)" ;;
        *) STAGE_STATUS="FAIL(rc=$STAGE_RC)" ;;
    esac
    echo "   $STAGE_STATUS in ${STAGE_SECS}s"
    if [[ $STAGE_RC -ne 0 ]]; then
        echo "   --- last lines of $log ---"
        tail -n 25 "$log" | sed 's/^/   | /'
    fi
}

# summary KIND JSON: one line about a stage's JSON (bench/gpu_results.py; empty when there is none)
summary() {
    [[ -f "$2" ]] && "$PY" -m bench.gpu_results "$1" "$2" 2>/dev/null
}

# ---- env: checks only (the imports compile nothing) --------------------------------------------
# shellcheck disable=SC2329  # invoked as `bash -c env_report` (exported below)
env_report() {
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "host: $(hostname), $(nproc) cores, python: $(command -v "$PY")"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "nvidia-smi: not available"
    nvcc --version | tail -n 2 || echo "nvcc: not found"
    echo "ninja: $(command -v ninja || echo 'not found')"
    echo "free: $(free -g | awk '/^Mem:/ {print $2 " GiB total, " $7 " GiB available"}')"
    if [[ -e "$LOOKAHEAD_CUDA_BUILD_DIR/lock" ]]; then
        echo "build lock: $LOOKAHEAD_CUDA_BUILD_DIR/lock is there (a killed build's; kbuild removes it)"
    fi
    "$PY" - <<'EOF'
import importlib.util, os, sys, time
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
def installed(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:      # a submodule whose parent package is missing
        return False
for m in ("cuda.bindings", "numpy", "safetensors", "tokenizers", "yaml", "pytest"):
    print(f"module {m}: {'yes' if installed(m) else 'MISSING'}")
t0 = time.perf_counter()
import builder, plugins, runtime, runtime.ops  # noqa: E401,F401  (none of them builds anything)
from runtime.transfer.cuda import unavailable_reason
print(f"imports: runtime, builder, plugins, runtime.ops, runtime.transfer.cuda in {time.perf_counter() - t0:.1f} s "
      "(nothing compiled: kbuild builds the extension)")
print("CUDA transfer engine:", unavailable_reason() or "available")
if not torch.cuda.is_available():
    if os.environ.get("GPU_CHECK_DRY") == "1":
        print("device: cpu (dry run)")
        sys.exit(0)
    sys.exit("torch.cuda.is_available() is False: no usable GPU")
print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
EOF
}
export PY
export GPU_CHECK_DRY=$DRY
export -f env_report
if wanted env; then
    run_stage env "$T_ENV" "$OUT/setup.log" bash -c env_report
    record env "$STAGE_STATUS" "$STAGE_SECS" "$(grep -m1 '^device:' "$OUT/setup.log" | cut -c9-)"
    if [[ $STAGE_RC -eq 0 ]]; then
        cat "$OUT/setup.log"
    else
        echo "gpu_check: no usable GPU or python with torch (see $OUT/setup.log); nothing else runs" >&2
        exit 2
    fi
fi

# ---- build: the random-weights engine dirs and the CPU kernel library ---------------------------
if [[ $DRY == 1 ]]; then
    SHAPES=(tiny) DTYPE=float32
else
    # Host memory of the 8B rows: none for weights (generated on the GPU, ~16 GB each in bf16);
    # the lookahead rows' host pool holds each sequence's whole KV, bf16 at the bench's 32K:
    # llama3-8b 128 KiB a token (32 layers x 8 KV heads x 128 x K,V x 2 B), 4 GiB a sequence;
    # qwen3-8b-yarn 144 KiB (36 layers), 4.5 GiB. bench.gpu_decode caps that pool at
    # --host-kv-gib (60 GiB by default, of the 128 GiB the GPU machine has): 15 / 13 sequences.
    SHAPES=(llama3-8b qwen3-8b-yarn smollm2-135m) DTYPE=bfloat16
fi
# shellcheck disable=SC2329  # invoked as `bash -c build_engines`
build_engines() {   # one builder process per shape, in parallel (each is mostly Python start-up)
    local shape pids=() rc=0
    for shape in "$@"; do
        "$PY" scripts/build_engine.py --random-weights "$shape" --dtype "$DTYPE" --tokenizer bytes \
            --output "$ENGINES/$shape" --force &
        pids+=("$!")
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || rc=1
    done
    return $rc
}
export ENGINES DTYPE
export -f build_engines
# plugins/cpu's C library (the CPU side of every step; one cc process, 10-30 s) is built before
# anything is timed: started with the build stage, in the background (one core, beside kbuild's
# nvcc jobs), under its own wall (CPU_LIB_S), and waited for before the kernels stage.
CPU_LIB_S="${CPU_LIB_S:-100}" CPU_LIB_PID="" CPU_LIB_T0=0
if wanted build; then
    CPU_LIB_T0=$SECONDS
    timeout --kill-after=5 "$CPU_LIB_S" "$PY" -c 'from plugins.cpu import loader; lib = loader.library()
print("CPU kernel library:", lib._name if lib is not None else "unavailable: " + str(loader.unavailable_reason()))' \
        >"$SCRATCH/cpu_library.log" 2>&1 &
    CPU_LIB_PID=$!
    run_stage build "$T_BUILD" "$OUT/setup.log" bash -c 'build_engines "$@"' _ "${SHAPES[@]}"
    record build "$STAGE_STATUS" "$STAGE_SECS" "${SHAPES[*]} ($DTYPE, random weights) in $ENGINES"
fi
wait_cpu_library() {
    [[ -n $CPU_LIB_PID ]] || return 0
    wait "$CPU_LIB_PID"
    local rc=$? status
    CPU_LIB_PID=""
    { echo "== cpulib (background, limit ${CPU_LIB_S}s)"; cat "$SCRATCH/cpu_library.log"; } >>"$OUT/setup.log"
    case $rc in 0) status=ok ;; 124 | 137) status="TIMEOUT(${CPU_LIB_S}s)" ;; *) status="FAIL(rc=$rc)" ;; esac
    record cpulib "$status" $((SECONDS - CPU_LIB_T0)) "$(grep -m1 '^CPU kernel library' "$SCRATCH/cpu_library.log")"
}
ENGINE_ARGS=""
for shape in "${SHAPES[@]}"; do
    [[ -f "$ENGINES/$shape/engine.yaml" ]] && ENGINE_ARGS+="${ENGINE_ARGS:+,}$shape=$ENGINES/$shape"
done

# ---- kernels: the extension build (its own first step, kbuild), then the checks -----------------
if wanted kbuild; then
    kbuild_args=(build)
    [[ $DRY == 1 ]] && kbuild_args+=(--dry-run)
    run_stage kbuild "$T_KBUILD" "$OUT/kernels.log" "$PY" -m plugins.cuda.loader "${kbuild_args[@]}"
    # The build's process is gone now (done or killed): a lock it left would hang every later build
    if [[ -e "$LOOKAHEAD_CUDA_BUILD_DIR/lock" ]]; then
        rm -f "$LOOKAHEAD_CUDA_BUILD_DIR/lock"
        echo "gpu_check: removed the lock the killed build left ($LOOKAHEAD_CUDA_BUILD_DIR/lock)" | tee -a "$OUT/kernels.log"
    fi
    record kbuild "$STAGE_STATUS" "$STAGE_SECS" "$(grep -m1 -E '^(built |dry run|build failed|no CUDA)' "$OUT/kernels.log")"
fi
# From here on no process compiles: each imports the module kbuild built (none: the torch
# implementations serve CUDA, and the kernel check reports the build error).
export LOOKAHEAD_CUDA_PREBUILT=1
wait_cpu_library

if wanted kernels; then
    kernel_args=(--out "$OUT" --child-timeout 50)
    [[ $DRY == 1 ]] && kernel_args+=(--device cpu)
    run_stage kernels "$T_KERNELS" "$OUT/kernels.log" "$PY" -m bench.gpu_kernels "${kernel_args[@]}"
    record kernels "$STAGE_STATUS" "$STAGE_SECS" "$(summary kernels "$OUT/kernel_check.json")"
fi

# ---- tests -------------------------------------------------------------------------------------
# pytest from the wheelhouse when the machine's python has none (the dry run takes it whenever the
# wheelhouse is there, to exercise this path), first on the tests stage's PYTHONPATH alone.
if wanted tests; then
    TEST_ENV=(env)
    if compgen -G "$WHEELHOUSE/pytest-*.whl" >/dev/null && { [[ $DRY == 1 ]] || ! "$PY" -c 'import pytest' 2>/dev/null; }; then
        DEPS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_deps.XXXXXX")"
        for whl in "$WHEELHOUSE"/*.whl; do
            "$PY" -m zipfile -e "$whl" "$DEPS"
        done
        TEST_ENV=(env "PYTHONPATH=$DEPS${PYTHONPATH:+:$PYTHONPATH}")
        echo "pytest: unpacked $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels from $WHEELHOUSE"
    fi
    if pytest_version=$("${TEST_ENV[@]}" "$PY" -c 'import pytest; print(pytest.__version__)' 2>/dev/null); then
        # On the GPU the nvcc-only compile checks (compile_kernels.sh, ~20 s) are left to CI: kbuild
        # compiled the same sources for sm_90 already. The dry run collects everything.
        collect=(-k "not (compile_for_sm90 or exported_with_c_linkage or spills_registers)")
        [[ $DRY == 1 ]] && collect=(--collect-only)
        run_stage tests "$T_TESTS" "$OUT/tests.log" "${TEST_ENV[@]}" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
            "${collect[@]}" --basetemp "$SCRATCH/pytest" tests/test_transfer_cuda.py tests/test_cuda_kernels.py
        note=$(grep -E '[0-9]+ (passed|failed|error|skipped|tests? collected)' "$OUT/tests.log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
        record tests "$STAGE_STATUS" "$STAGE_SECS" "pytest $pytest_version: ${note:-no pytest summary line}"
    else
        record tests SKIPPED 0 "no pytest on this python and no wheels in $WHEELHOUSE (run scripts/gpu_check.sh --prepare, carry build/wheelhouse)"
    fi
fi

# ---- bench -------------------------------------------------------------------------------------
if wanted bench; then
    left=$((BUDGET_S - (SECONDS - START)))
    bench_limit=$((T_BENCH < left ? T_BENCH : left))
    bench_args=(--engines "${ENGINE_ARGS:-none=$ENGINES/missing}" --out "$OUT" --time-budget-s $((bench_limit - 12)))
    if [[ $DRY == 1 ]]; then
        bench_args+=(--device cpu --context 256 --steps 2 --warmup 1 --top-k 2 --recent-window 16
                     --bandwidth-gib 0.0625 --graph-replays 2)
    else
        bench_args+=(--steps 16 --warmup 3 --equal-batch-modes resident)
    fi
    run_stage bench "$T_BENCH" "$OUT/bench.log" "$PY" -m bench.gpu_decode "${bench_args[@]}"
    record bench "$STAGE_STATUS" "$STAGE_SECS" "$(summary bench "$OUT/decode_bench.json")"
fi

# ---- summary -----------------------------------------------------------------------------------
write_summary
cat "$OUT/summary.txt"
for s in "${STATUS[@]}"; do
    [[ $s == ok ]] || exit 1
done
exit 0

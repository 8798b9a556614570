#!/usr/bin/env bash
# The one-shot GPU check (H200): engine dirs, kernels, the CUDA transfer engine, decode timing of the
# real engine. At most 420 s in all, builds included.
#
#   scripts/gpu_check.sh                    # results under ${OUT:-out/gpu_check}
#   scripts/gpu_check.sh --dry-run          # here, without a GPU: every Python stage on CPU, small shapes
#   scripts/gpu_check.sh --prepare          # here, with the network: fill build/wheelhouse (pytest)
#
# On the GPU machine (the `run` tool; its $OUT is the folder that comes back, and this script writes
# there), with the wheelhouse carried (ignored by git, so it must be named):
#   prepare here:  bash scripts/gpu_check.sh --prepare             (~2 MiB: pytest and its deps, cp312)
#   run there:     command "bash scripts/gpu_check.sh", carry ["build/wheelhouse"], timeout_s 450
# Nothing else needs carrying: the kernels build there (build/torch_ext), the engine dirs are
# random-weights recipes written there (into $OUT/engines), and the working tree has the rest.
#
# Stages, each under its own limit; the limits add up to the budget (BUDGET_S, 420 s), and a stage
# that would pass the budget gets only what is left of it:
#   stage    limit  what                                                         -> output
#   env        15   versions, nvidia-smi, importable modules                      -> env.txt
#   build      25   scripts/build_engine.py --random-weights for llama3-8b and
#                   smollm2-135m (bfloat16; engine.yaml recipes, no weights)      -> build.log
#   kernels   120   scripts/gpu_kernel_check.py: builds the torch extension (all .cu + the
#                   loader, for sm_90, cached in build/torch_ext), numerics through the
#                   extension, torch.ops and the wrappers, bandwidths; the >2^31-element cases
#                   in a child process (60 s)                                     -> kernel_check/
#   tests      80   pytest -m "not slow" tests/test_transfer_cuda.py tests/test_cuda_kernels.py
#                                                                                 -> pytest.log, pytest-junit.xml
#   bench     180   scripts/gpu_decode_bench.py: the real engine, dense vs lookahead under one
#                   device KV budget at 32K, each shape in a child process         -> decode_bench/
# Every JSON file is rewritten after each check or row (a sticky CUDA fault or a kill loses nothing
# recorded before it). Every stage's output is in its log; a summary table is printed last (and in
# summary.txt). Exit status: 0 when every stage passed, 2 without a usable GPU, 1 otherwise.
#
# --dry-run (tests/test_eval_scripts.py runs it; under a minute here): the same stages on CPU with the
# repository's .venv: env without the GPU requirement; build writes the `tiny` random-weights shape;
# kernels runs gpu_kernel_check.py --device cpu (the checks' machinery against the torch ops, a
# child process, the bandwidth code); tests collects the CUDA test files (through the wheelhouse
# when there is one); bench runs gpu_decode_bench.py on CPU over the tiny engine (256 tokens, every
# row, the satisfied-transfer round, the copy replay, the graph path's eager half).
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
    "") ;;
    *) echo "gpu_check: unknown option $1 (use --dry-run, --prepare, or nothing)" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
if [[ ($DRY == 1 || $PREPARE == 1) && -z "${PYTHON:-}" && -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; fi
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
T_ENV="${T_ENV:-15}" T_BUILD="${T_BUILD:-25}" T_KERNELS="${T_KERNELS:-120}" T_TESTS="${T_TESTS:-80}" T_BENCH="${T_BENCH:-180}"
LIMITS_S=$((T_ENV + T_BUILD + T_KERNELS + T_TESTS + T_BENCH))
if ((LIMITS_S > BUDGET_S)); then
    echo "gpu_check: the stage limits add up to ${LIMITS_S}s, over the ${BUDGET_S}s budget" >&2
    exit 2
fi
ENGINES="${GPU_ENGINES_DIR:-$OUT/engines}"
export LOOKAHEAD_CUDA_BUILD_DIR="${LOOKAHEAD_CUDA_BUILD_DIR:-$ROOT/build/torch_ext}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"     # H100/H200: the extension for sm_90 only
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"                        # ninja's parallel nvcc jobs
export PYTHONUNBUFFERED=1
START=$SECONDS

STAGES=() STATUS=() SECS=() NOTES=()
record() {   # name status seconds note
    STAGES+=("$1") STATUS+=("$2") SECS+=("$3") NOTES+=("$4")
}

# run_stage NAME LIMIT_S LOG CMD...: run CMD under `timeout`, capped by what is left of the budget.
# Sets STAGE_RC (124 on timeout), STAGE_STATUS and STAGE_SECS.
run_stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((limit > left)); then limit=$left; fi
    if ((limit < 10)); then
        STAGE_RC=125 STAGE_STATUS=SKIPPED STAGE_SECS=0
        echo "== $name: skipped, ${left}s left of the ${BUDGET_S}s budget" | tee "$log"
        return
    fi
    echo "== $name (limit ${limit}s) -> $log"
    local t0=$SECONDS
    # TERM 5 s before the limit, KILL at it: the limit is a wall, even for a stage that ignores TERM
    timeout --signal=TERM --kill-after=5 "$((limit - 5))" "$@" >"$log" 2>&1
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

# summary KIND JSON: one line about a stage's JSON (scripts/gpu_results.py; empty when there is none)
summary() {
    [[ -f "$2" ]] && "$PY" scripts/gpu_results.py "$1" "$2" 2>/dev/null
}

# ---- env ---------------------------------------------------------------------------------------
# shellcheck disable=SC2329  # invoked as `bash -c env_report` (exported below)
env_report() {
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "host: $(hostname), $(nproc) cores, python: $(command -v "$PY")"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "nvidia-smi: not available"
    nvcc --version | tail -n 2 || echo "nvcc: not found"
    echo "ninja: $(command -v ninja || echo 'not found')"
    echo "free: $(free -g | awk '/^Mem:/ {print $2 " GiB total, " $7 " GiB available"}')"
    "$PY" - <<'EOF'
import importlib.util, os, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
def installed(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:      # a submodule whose parent package is missing
        return False
for m in ("cuda.bindings", "numpy", "safetensors", "tokenizers", "yaml", "pytest"):
    print(f"module {m}: {'yes' if installed(m) else 'MISSING'}")
from runtime.transfer.cuda import unavailable_reason
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
run_stage env "$T_ENV" "$OUT/env.txt" bash -c env_report
record env "$STAGE_STATUS" "$STAGE_SECS" "$(grep -m1 '^device:' "$OUT/env.txt" | cut -c9-)"
if [[ $STAGE_RC -eq 0 ]]; then
    cat "$OUT/env.txt"
else
    echo "gpu_check: no usable GPU or python with torch (see $OUT/env.txt); nothing else runs" >&2
    exit 2
fi

# ---- build: the random-weights engine dirs -------------------------------------------------------
if [[ $DRY == 1 ]]; then
    SHAPES=(tiny) DTYPE=float32
else
    SHAPES=(llama3-8b smollm2-135m) DTYPE=bfloat16
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
run_stage build "$T_BUILD" "$OUT/build.log" bash -c 'build_engines "$@"' _ "${SHAPES[@]}"
record build "$STAGE_STATUS" "$STAGE_SECS" "${SHAPES[*]} ($DTYPE, random weights) in $ENGINES"
ENGINE_ARGS=""
for shape in "${SHAPES[@]}"; do
    [[ -f "$ENGINES/$shape/engine.yaml" ]] && ENGINE_ARGS+="${ENGINE_ARGS:+,}$shape=$ENGINES/$shape"
done

# ---- kernels -----------------------------------------------------------------------------------
kernel_args=(--out "$OUT/kernel_check" --child-timeout 60)
[[ $DRY == 1 ]] && kernel_args+=(--device cpu)
run_stage kernels "$T_KERNELS" "$OUT/kernel_check.log" "$PY" scripts/gpu_kernel_check.py "${kernel_args[@]}"
record kernels "$STAGE_STATUS" "$STAGE_SECS" "$(summary kernels "$OUT/kernel_check/kernel_check.json")"

# ---- tests -------------------------------------------------------------------------------------
# pytest from the wheelhouse when the machine's python has none (the dry run takes it whenever the
# wheelhouse is there, to exercise this path); its PYTHONPATH is the tests stage's alone.
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
    collect=(); [[ $DRY == 1 ]] && collect=(--collect-only)
    run_stage tests "$T_TESTS" "$OUT/pytest.log" "${TEST_ENV[@]}" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
        "${collect[@]}" --junitxml "$OUT/pytest-junit.xml" tests/test_transfer_cuda.py tests/test_cuda_kernels.py
    note=$(grep -E '[0-9]+ (passed|failed|error|skipped|tests? collected)' "$OUT/pytest.log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
    record tests "$STAGE_STATUS" "$STAGE_SECS" "pytest $pytest_version: ${note:-no pytest summary line}"
else
    record tests SKIPPED 0 "no pytest on this python and no wheels in $WHEELHOUSE (run scripts/gpu_check.sh --prepare, carry build/wheelhouse)"
fi

# ---- bench -------------------------------------------------------------------------------------
left=$((BUDGET_S - (SECONDS - START)))
bench_limit=$((T_BENCH < left ? T_BENCH : left))
bench_args=(--engines "${ENGINE_ARGS:-none=$ENGINES/missing}" --out "$OUT/decode_bench" --time-budget-s $((bench_limit - 12)))
if [[ $DRY == 1 ]]; then
    bench_args+=(--device cpu --context 256 --steps 2 --warmup 1 --top-k 2 --recent-window 16
                 --bandwidth-gib 0.0625 --graph-replays 2)
else
    bench_args+=(--steps 16 --warmup 3 --equal-batch-modes resident)
fi
run_stage bench "$T_BENCH" "$OUT/decode_bench.log" "$PY" scripts/gpu_decode_bench.py "${bench_args[@]}"
record bench "$STAGE_STATUS" "$STAGE_SECS" "$(summary bench "$OUT/decode_bench/decode_bench.json")"

# ---- summary -----------------------------------------------------------------------------------
{
    if [[ -f "$OUT/decode_bench.log" ]] && grep -q '^decode steps on' "$OUT/decode_bench.log"; then
        sed -n '/^decode steps on/,/^wrote /p' "$OUT/decode_bench.log"
        echo
    fi
    printf '%-8s %-14s %6s  %s\n' stage status seconds result
    for i in "${!STAGES[@]}"; do
        printf '%-8s %-14s %6s  %s\n' "${STAGES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
    done
    echo "total $((SECONDS - START))s of a ${BUDGET_S}s budget (stage limits add up to ${LIMITS_S}s); results in $OUT"
} | tee "$OUT/summary.txt"

for s in "${STATUS[@]}"; do
    [[ $s == ok ]] || exit 1
done
exit 0

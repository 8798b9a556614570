#!/usr/bin/env bash
# The one-shot GPU check (H200): kernels, the CUDA transfer engine, decode timing. Under 8 minutes.
#
#   scripts/gpu_check.sh                    # results under ${OUT:-out/gpu_check}
#   scripts/gpu_check.sh --dry-run          # here, without a GPU: the same stages on CPU, small shapes
#
# --dry-run (a test runs it): env without the GPU requirement; kernels compile-only is not run (it
# needs a CUDA torch), so the stage imports the check and prints its help; tests collects the CUDA
# test files; bench runs gpu_decode_bench.py on CPU (2 layers, 256 tokens, dense and all lookahead
# modes). It catches a Python error in a stage before the H200 run does.
#
# Runs on the GPU machine with that machine's python (PYTHON, default python3: torch with CUDA,
# cuda-bindings, nvcc, ninja; RECIPES.md "The GPU machine"); the repository's .venv is not used.
# Stages, each under its own timeout (and all within GPU_CHECK_BUDGET_S, default 450 s), so one
# hang cannot eat the budget:
#   env      versions, nvidia-smi, importable modules                      -> env.txt
#   kernels  scripts/gpu_kernel_check.py: builds the torch extension (cached in build/torch_ext),
#            numerics against the references, H2D gather bandwidth        -> kernel_check/
#   tests    pytest tests/test_transfer_cuda.py tests/test_cuda_kernels.py -m "not slow"
#                                                                         -> pytest.log, pytest-junit.xml
#   bench    scripts/gpu_decode_bench.py: dense vs lookahead at 32K, random weights in the
#            SmolLM2-135M and Llama-3-8B shapes                            -> decode_bench/
# Every stage's output is in <stage>.log; a summary table is printed last (and in summary.txt).
# Exit status: 0 when every stage passed, 2 without a usable GPU, 1 otherwise.
#
# pytest: when the machine's python has none, the wheels in WHEELHOUSE (default build/wheelhouse,
# which must travel with the working tree) are unpacked into a temporary directory on PYTHONPATH.
# Fill it on a networked machine with:
#   pip download pytest --only-binary=:all: --python-version 3.12 --implementation py \
#       --abi none --platform any -d build/wheelhouse
set -uo pipefail    # no -e: a failing stage is recorded and the next one runs

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "gpu_check: unknown option $1 (use --dry-run, or nothing)" >&2; exit 2 ;;
esac
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
if [[ $DRY == 1 && -z "${PYTHON:-}" && -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; fi
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
T_ENV="${T_ENV:-30}" T_KERNELS="${T_KERNELS:-150}" T_TESTS="${T_TESTS:-110}" T_BENCH="${T_BENCH:-170}"
WHEELHOUSE="${WHEELHOUSE:-$ROOT/build/wheelhouse}"
export LOOKAHEAD_CUDA_BUILD_DIR="${LOOKAHEAD_CUDA_BUILD_DIR:-$ROOT/build/torch_ext}"
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
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$log" 2>&1
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

# ---- env ---------------------------------------------------------------------------------------
# shellcheck disable=SC2329  # invoked as `bash -c env_report` (exported below)
env_report() {
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "host: $(hostname), $(nproc) cores, python: $(command -v "$PY")"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "nvidia-smi: not available"
    nvcc --version | tail -n 2 || echo "nvcc: not found"
    echo "ninja: $(command -v ninja || echo 'not found')"
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

# ---- kernels -----------------------------------------------------------------------------------
mkdir -p "$OUT/kernel_check"
if [[ $DRY == 1 ]]; then
    run_stage kernels "$T_KERNELS" "$OUT/kernel_check.log" "$PY" scripts/gpu_kernel_check.py --help
    record kernels "$STAGE_STATUS" "$STAGE_SECS" "dry run: imported and parsed its arguments only (needs CUDA)"
else
run_stage kernels "$T_KERNELS" "$OUT/kernel_check.log" "$PY" scripts/gpu_kernel_check.py --out "$OUT/kernel_check"
note=$("$PY" - "$OUT/kernel_check/kernel_check.json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
ok = sum(c["ok"] for c in r["checks"])
ratio = min(g["gather_vs_memcpy"] for g in r["gather"])
h2d = max(g["memcpy_h2d_gbps"] for g in r["gather"])
print(f"numerics {ok}/{len(r['checks'])}; gather/memcpy >= {ratio:.2f}; memcpy H2D {h2d:.0f} GB/s; build {r['build_s']:.0f}s")
EOF
)
record kernels "$STAGE_STATUS" "$STAGE_SECS" "${note:-no kernel_check.json}"
fi

# ---- tests -------------------------------------------------------------------------------------
if ! "$PY" -c 'import pytest' 2>/dev/null; then
    if compgen -G "$WHEELHOUSE/pytest-*.whl" >/dev/null; then
        DEPS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_deps.XXXXXX")"
        for whl in "$WHEELHOUSE"/*.whl; do
            "$PY" -m zipfile -e "$whl" "$DEPS"
        done
        export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
        echo "pytest: unpacked $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels from $WHEELHOUSE"
    fi
fi
if "$PY" -c 'import pytest' 2>/dev/null; then
    collect=(); [[ $DRY == 1 ]] && collect=(--collect-only)
    run_stage tests "$T_TESTS" "$OUT/pytest.log" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" "${collect[@]}" \
        --junitxml "$OUT/pytest-junit.xml" tests/test_transfer_cuda.py tests/test_cuda_kernels.py
    note=$(grep -E '[0-9]+ (passed|failed|error|tests? collected)' "$OUT/pytest.log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
    record tests "$STAGE_STATUS" "$STAGE_SECS" "${note:-no pytest summary line}"
else
    record tests SKIPPED 0 "no pytest on this python and no wheels in $WHEELHOUSE"
fi

# ---- bench -------------------------------------------------------------------------------------
bench_args=(--steps 12 --warmup 2)
[[ $DRY == 1 ]] && bench_args=(--device cpu --context 256 --layers 2 --steps 2 --warmup 1 --prefill-chunk 256
                               --bandwidth-gib 0.125 --dense-batch 8)
run_stage bench "$T_BENCH" "$OUT/decode_bench.log" "$PY" scripts/gpu_decode_bench.py \
    --out "$OUT/decode_bench" "${bench_args[@]}"
note=$("$PY" - "$OUT/decode_bench/decode_bench.json" <<'EOF' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
bad = [r for r in rows if r.get("error")]
print(f"{len(rows) - len(bad)}/{len(rows)} modes timed" + (f"; first error: {bad[0]['error'][:60]}" if bad else ""))
EOF
)
record bench "$STAGE_STATUS" "$STAGE_SECS" "${note:-no decode_bench.json}"

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
    echo "total $((SECONDS - START))s of a ${BUDGET_S}s budget; results in $OUT"
} | tee "$OUT/summary.txt"

for s in "${STATUS[@]}"; do
    [[ $s == ok ]] || exit 1
done
exit 0

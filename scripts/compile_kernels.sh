#!/usr/bin/env bash
# Compile-check the lookahead CUDA kernels for sm_90 (H100 / H200) with plain nvcc; no GPU needed.
#
#   scripts/compile_kernels.sh [OUTDIR]        (default: build/cuda)
#   scripts/compile_kernels.sh --help          this text
#
# Writes OUTDIR/liblookahead_kernels.so (the extern "C" launchers of plugins/cuda/lookahead_kernels.h),
# OUTDIR/ptxas.log (the full -Xptxas -v report) and OUTDIR/ptxas_summary.txt (one line per kernel:
# registers, stack frame, spill stores / loads). Exits non-zero if nvcc fails or any kernel spills.
# NVCC overrides the compiler (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo pipefail/{/^set -euo/d; s/^# \{0,1\}//; p}' "${BASH_SOURCE[0]}"; exit 0 ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/plugins/cuda"
OUT="${1:-$ROOT/build/cuda}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
LIB="$OUT/liblookahead_kernels.so"

FLAGS=(-std=c++17 -O3
       -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
       -Xcompiler -fPIC -Xptxas -v
       # The torch extension build forbids implicit half/bfloat16 conversions; so do we, so that
       # a kernel that builds here also builds there.
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)

[[ -x "$NVCC" ]] || { echo "compile_kernels: nvcc not found (set NVCC=/path/to/nvcc)" >&2; exit 2; }
mkdir -p "$OUT/obj"

# One nvcc per translation unit, in parallel: the attention instantiations dominate.
pids=()
sources=("$SRC"/*.cu)
for cu in "${sources[@]}"; do
    name="$(basename "$cu" .cu)"
    "$NVCC" "${FLAGS[@]}" -c "$cu" -o "$OUT/obj/$name.o" >"$OUT/obj/$name.log" 2>&1 &
    pids+=("$!")
done
failed=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "compile_kernels: nvcc failed on ${sources[$i]}" >&2
        cat "$OUT/obj/$(basename "${sources[$i]}" .cu).log" >&2
        failed=1
    fi
done
cat "$OUT"/obj/*.log >"$OUT/ptxas.log"
[[ $failed -eq 0 ]] || exit 1
"$NVCC" -shared -Xcompiler -fPIC "$OUT"/obj/*.o -o "$LIB"

# ptxas reports, per kernel: "Compiling entry function '<mangled>'", then "N bytes stack frame,
# S bytes spill stores, L bytes spill loads", then "Used R registers". One line per kernel.
demangle() { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
awk '
    /Compiling entry function/ { match($0, /\047[^\047]+\047/); name = substr($0, RSTART + 1, RLENGTH - 2) }
    /bytes stack frame/        { stack = $1; stores = $5; loads = $9 }
    /Used [0-9]+ registers/    { for (i = 1; i <= NF; i++) if ($i == "Used") regs = $(i + 1);
                                 printf "%s\t%s\t%s\t%s\t%s\n", regs, stack, stores, loads, name }
' "$OUT/ptxas.log" | demangle | sed -E 's/\(anonymous namespace\):://g; s/lookahead_kv::cuda:://g' \
    | sort -t$'\t' -k5 >"$OUT/ptxas_summary.body"
{
    printf 'registers\tstack\tspill_st\tspill_ld\tkernel\n'
    cat "$OUT/ptxas_summary.body"
} >"$OUT/ptxas_summary.txt"
rm -f "$OUT/ptxas_summary.body"

kernels=$(($(wc -l <"$OUT/ptxas_summary.txt") - 1))
spilling=$(awk -F'\t' 'NR > 1 && ($3 > 0 || $4 > 0)' "$OUT/ptxas_summary.txt")
column -t -s$'\t' "$OUT/ptxas_summary.txt" 2>/dev/null || cat "$OUT/ptxas_summary.txt"
if [[ $kernels -eq 0 ]]; then
    echo "compile_kernels: no kernel found in the ptxas report ($OUT/ptxas.log)" >&2
    exit 1
fi
if [[ -n "$spilling" ]]; then
    echo "compile_kernels: register spills (see $OUT/ptxas.log):" >&2
    echo "$spilling" >&2
    exit 1
fi
echo "compile_kernels: $kernels kernels for sm_90, no spills -> $LIB"

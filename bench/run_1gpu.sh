#!/usr/bin/env bash
# Everything of the grouped GEMM that one GPU can check and time, in one call (for the device tool,
# whose calls end at 10 minutes and return at most 8 files), in the order that matters most:
#   1. build: tests/gpu/build.sh (test binaries, libsluice_gpu.so for ctypes; SKIP_BUILD=1 keeps a warm
#      machine's earlier build; skipped when TESTS=0 BENCH=0 and neither HARNESS nor FINE needs it) and,
#      at the same time, the CMake library the JAX tests and SWIGLU load (build/, sm_90a only)
#   2. the GPU test suite (tests/gpu/run.sh: plain, memcheck, racecheck, synccheck, initcheck,
#      SLUICE_DEBUG, the bounded wait; TESTS=0 leaves it out)
#   3. the JAX-level GPU tests (tests/gpu/test_jax_gpu.py: sluice.gmm/tgmm through XLA's CUDA FFI;
#      JAX=0 leaves them out)
#   3b. SWIGLU=1 (optional): bench/bench_swiglu.py, the SwiGLU block's jax.grad through sluice.gmm
#      and through ragged_dot (SWIGLU_SHAPES: a comma-separated subset) -> swiglu-$STAMP.{json,log}
#   4. HARNESS="op:versions[:shapes] ..." (optional, e.g. "tgmm:25,40:dsv3proxy-gateup,dsv3-down-ep8"):
#      each spec's dev harness (build-gpu/<op>), its versions checked then timed in turn (shapes:
#      full names, comma-separated) -> harness-<op>-$STAMP.txt
#   5. FINE=1 (optional): the torch part of the benchmark on bench/shapes.py's FINE_SHAPES
#      -> gmm-fine-$STAMP.{md,json}
#   6. the benchmark (bench/run_gpu.sh: in turn with torch/cuBLAS, then ragged_dot, then each alone;
#      BENCH=0 leaves it out; ORDER_AB=1 adds the torch part with gmm's old tile order between two
#      runs of the default: gmm-$STAMP-order1.md, -r2.md; REPEATS=N adds N more runs of the torch
#      part as it is: gmm-$STAMP-rep2.md ...; with TESTS=1 JAX=1 the sustained part does not fit in
#      one call after REPEATS=2: run it in a second call). VARIANTS="33 ..." is passed to
#      tests/gpu/run.sh (forced variants).
# Results: $OUT/gmm-$STAMP.{md,json}, sustained-$STAMP.md and tests-$STAMP.txt (step lines, versions,
# the device); every log and result, resource usage included (written before the timings), in
# $OUT/logs-$STAMP.tar.gz. STAMP defaults to <gpu>-<date>, e.g. h100-20261124.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/1gpu-out}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | tr A-Z a-z)
export STAMP=${STAMP:-${gpu:-gpu}-$(date -u +%Y%m%d)}
export BUILD=${BUILD:-build-gpu} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=$BUILD/logs
mkdir -p "$LOGS"
SUM="$OUT/tests-$STAMP.txt"
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$SUM"; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv
  nvcc --version | tail -2
  python3 -c 'import jax, torch; print("python", __import__("sys").version.split()[0], "jax", jax.__version__, "torch", torch.__version__)'
  # The device's copy of .git can lag the working tree it runs, so name the sources by their content:
  # the same command in a checkout of a commit says whether that commit's kernels are the ones measured.
  echo "sources sha256 (csrc include CMakeLists.txt): $(find csrc include CMakeLists.txt -type f -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
} >>"$SUM" 2>&1
( cmake -B build -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_CUDA_ARCHITECTURES=90a-real &&
  cmake --build build -j 8 --target sluice ) >"$LOGS/cmake.log" 2>&1 &
cmake_pid=$!
if [ "${TESTS:-1}${BENCH:-1}${FINE:-0}" = 000 ] && [ -z "${HARNESS:-}" ]; then
  el "no test binaries needed (TESTS=0 BENCH=0, no HARNESS or FINE): $BUILD not built"
elif [ "${SKIP_BUILD:-0}" = 1 ] && [ -x "$BUILD/test_gmm" ]; then
  el "kept $BUILD (SKIP_BUILD=1: a warm machine's earlier build)"
else
  tests/gpu/build.sh >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log"; exit 1; }
  el "built $BUILD"
fi
if [ "${TESTS:-1}" = 1 ]; then
  SKIP_BUILD=1 LOGS=$LOGS tests/gpu/run.sh 2>&1 | tee -a "$SUM"
  el "GPU suite done"
fi
if [ "${JAX:-1}" != 1 ]; then
  wait $cmake_pid
elif wait $cmake_pid; then
  PYTHONPATH=$PWD/python timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_jax_gpu.py \
    >"$LOGS/test_jax_gpu.log" 2>&1
  el "JAX GPU tests: $(tail -1 "$LOGS/test_jax_gpu.log")"
else
  el "CMake build failed: $(tail -3 "$LOGS/cmake.log")"
fi
if [ "${SWIGLU:-0}" = 1 ]; then
  PYTHONPATH=$PWD/python timeout "${SWIGLU_LIMIT_S:-400}" python3 bench/bench_swiglu.py \
    ${SWIGLU_SHAPES:+--shapes "$SWIGLU_SHAPES"} --out "$OUT/swiglu-$STAMP.json" >"$LOGS/swiglu.log" 2>&1
  el "SwiGLU jax.grad: rc $?"
  cp "$LOGS/swiglu.log" "$OUT/swiglu-$STAMP.log"
fi
for spec in ${HARNESS:-}; do
  IFS=: read -r hop hvers hshapes <<<"$spec"
  hlog=$LOGS/harness-$hop-$STAMP.txt
  HARNESS_SHAPES=${hshapes:-} timeout 200 "$BUILD/$hop" "$hvers" >>"$hlog" 2>&1
  el "harness $spec: rc $? ($(tail -1 "$hlog"))"
  cp "$hlog" "$OUT/"
done
mkdir -p "$LOGS/results"
if [ "${FINE:-0}" = 1 ]; then
  timeout 200 python3 bench/bench_gmm.py --part torch --shapes fine --lib "$BUILD/libsluice_gpu.so" \
    --out "$LOGS/results/fine-torch.json" >"$LOGS/fine.log" 2>&1 &&
    python3 bench/bench_gmm.py --merge "$LOGS/results/fine-torch.json" \
      --md "$LOGS/results/gmm-fine-$STAMP.md" --json "$LOGS/results/gmm-fine-$STAMP.json" >/dev/null
  el "fine shapes: rc $?"
  cp "$LOGS"/results/gmm-fine-"$STAMP".* "$OUT"/ 2>/dev/null
fi
left=$((${BUDGET_S:-560} - $(date +%s) + t0)) # the device tool ends a call at 600 s
if [ "${BENCH:-1}" = 1 ] && [ $left -gt 0 ]; then
  SKIP_BUILD=1 RESULTS=$LOGS/results timeout $left bench/run_gpu.sh >"$LOGS/bench.log" 2>&1
  el "benchmark done (rc $?, limit $left s)"
fi
cp "$LOGS"/results/gmm-"$STAMP".{md,json} "$LOGS"/results/sustained-"$STAMP".md "$OUT"/ 2>/dev/null
cp "$LOGS"/results/gmm-"$STAMP"-{order1,r2}.md "$OUT"/ 2>/dev/null # ORDER_AB=1 (bench/run_gpu.sh)
cp "$LOGS"/results/gmm-"$STAMP"-rep*.md "$OUT"/ 2>/dev/null # REPEATS=N (bench/run_gpu.sh)
tar czf "$OUT/logs-$STAMP.tar.gz" -C "$BUILD" logs

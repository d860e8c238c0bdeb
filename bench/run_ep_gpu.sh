#!/usr/bin/env bash
# sluice.ep on the GPUs of one host, in one command: build in-tree, check the CUDA C API with every
# transport (peer, ipc, nccl; and again under compute-sanitizer, on one GPU), run the JAX GPU tests in one
# process and in one process per GPU (ipc, nccl), then the benchmark (C API per transport, jit in one
# process, jit in two processes). Every step's output goes to $OUT/log.txt; a one-line status per step to
# $OUT/summary.txt; results to $OUT/ep-*.json and ep.md.
#
#   OUT=/tmp/ep bash bench/run_ep_gpu.sh          # OUT defaults to bench/results/run-ep
#   EP_BUILD=full bash bench/run_ep_gpu.sh        # build the whole library with CMake (default: ep only,
#                                                 # faster; gmm's CUDA entry points then report UNSUPPORTED)
#   SLUICE_LIBRARY=.carry/moe_lib/libsluice.so ... # a library built elsewhere (no build here)
#   EP_RANKS=4 ...                                # fewer ranks than the host's GPUs
#   EP_STEPS="capi mp" ...                        # a subset: build capi sanitizer pytest mp bench_capi
#                                                 # bench_jax bench_mp
#
# NVLink multicast stays off (these variables are also set by the machines that lend GPUs here).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/run-ep}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
: >"$OUT/summary.txt"
export PYTHONPATH=$PWD/python:${PYTHONPATH:-} PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
# Hopper only by default (the H100/H200 machines): half the compile time of "80;90a-real".
ARCH=${SLUICE_CUDA_ARCH:-90a-real}

step() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "===== $name: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$OUT/summary.txt"
  return $rc
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c 'import jax, cupy; print("jax", jax.__version__, jax.devices()); print("cupy", cupy.__version__)'
} >>"$LOG" 2>&1

# The whole library; if another part of the tree does not build right now, fall back to the C core, the
# FFI handlers and the ep kernels alone (gmm's CUDA entry points then report UNSUPPORTED).
ep_only_build() {
  local b=build-ep ffi
  ffi=$(python3 -c 'import jax; print(jax.ffi.include_dir())') || return 1
  rm -rf $b && mkdir -p $b || return 1
  cat >$b/gmm_stub.c <<'STUB'
#include "internal.h"
int sl_has_cuda(void) { return 1; }
size_t sl_gmm_cuda_workspace_size(const sl_gmm_desc *d) { (void)d; return 0; }
sl_status sl_gmm_cuda(const sl_gmm_desc *d, const void *a, const void *b, const int32_t *g,
                      const int32_t *o, void *c, void *w, void *s) {
  return sl_set_error(SL_STATUS_UNSUPPORTED, "gmm: not in this ep-only build");
}
sl_status sl_tgmm_cuda(const sl_gmm_desc *d, const void *a, const void *b, const int32_t *g,
                       const int32_t *o, void *c, void *w, void *s) {
  return sl_set_error(SL_STATUS_UNSUPPORTED, "tgmm: not in this ep-only build");
}
STUB
  local objs=() f o
  for f in csrc/core/status.c csrc/core/gmm_cpu.c csrc/core/ep_comm.c csrc/core/ep_cpu.c \
    csrc/core/swiglu_cpu.c csrc/ffi/*.c $b/gmm_stub.c; do
    o=$b/$(basename "$f").o
    gcc -O2 -std=gnu11 -fPIC -fopenmp -Iinclude -Icsrc/core -Icsrc/ffi -I"$ffi" -c "$f" -o "$o" || return 1
    objs+=("$o")
  done
  # NCCL: nccl.h from the CUDA toolkit or the nvidia-nccl wheel (libnccl itself is loaded at run time)
  local ncclinc nccldef=()
  ncclinc=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "include"))' 2>/dev/null)
  for d in "$ncclinc" /usr/local/cuda/include /usr/include; do
    if [ -n "$d" ] && [ -f "$d/nccl.h" ]; then nccldef=(-DSLUICE_HAVE_NCCL -I"$d"); break; fi
  done
  local nccllib
  for f in "${ncclinc%/include}/lib/libnccl.so.2" /usr/local/cuda/lib/libnccl.so.2 \
    /usr/local/cuda/lib64/libnccl.so.2 /usr/lib/x86_64-linux-gnu/libnccl.so.2; do
    if [ -n "${nccldef[*]}" ] && [ -f "$f" ]; then nccldef+=("-DSLUICE_NCCL_PATH=\"$f\""); break; fi
  done
  echo "ep-only build: NCCL ${nccldef[*]:-none}"
  for f in csrc/cuda/ep_*.cu csrc/cuda/swiglu.cu; do
    o=$b/$(basename "$f").o
    nvcc -O3 -std=c++17 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -Iinclude -Icsrc/core \
      "${nccldef[@]}" -c "$f" -o "$o" &
    objs+=("$o")
  done
  wait
  nvcc -shared -o $b/libsluice.so "${objs[@]}" -Xcompiler -fopenmp -cudart static -lm -ldl
}
want() { [ -z "${EP_STEPS:-}" ] || [[ " $EP_STEPS " == *" $1 "* ]]; }
if [ -n "${SLUICE_LIBRARY:-}" ] && [ -f "$SLUICE_LIBRARY" ]; then
  echo "using $SLUICE_LIBRARY (built elsewhere)" | tee -a "$OUT/summary.txt"
elif [ "${EP_BUILD:-ep}" = full ] && step build bash -c "cmake -B build -DPython_EXECUTABLE=$(command -v python3) \
  -DCMAKE_CUDA_ARCHITECTURES=$ARCH && cmake --build build -j 32 --target sluice"; then
  :
else
  rm -f build/libsluice.so
  step build_ep_only ep_only_build || { tail -40 "$LOG"; exit 1; }
  export SLUICE_LIBRARY=$PWD/build-ep/libsluice.so
fi

SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# ranks = every GPU of the host (EP_RANKS=n for fewer): the same script at 2, 4 or 8 GPUs
R=${EP_RANKS:-$(nvidia-smi -L | wc -l)}
export EP_RANKS=$R EP_NPROCS=$R
echo "ranks: $R" | tee -a "$OUT/summary.txt"
# the checks and figures that matter most first (a run cut short loses the least)
want capi && step capi_check timeout 120 python3 tests/gpu/ep_capi_check.py --ranks $R --transport peer ipc nccl
want mp && step mp_test timeout 300 python3 tests/gpu/test_ep_mp.py ipc nccl
want sanitizer && step sanitizer timeout 100 "$SAN" --tool memcheck --leak-check no --error-exitcode 9 \
  python3 tests/gpu/ep_capi_check.py --ranks 1 --quick --transport peer ipc
want bench_capi && step bench_capi timeout 150 python3 bench/bench_ep.py --part capi --ranks $R --sms 20 24 32 64 \
  --transports peer ipc nccl --transport-sms 64 --out "$OUT/ep-capi.json"
want bench_mp && step bench_mp timeout 240 python3 bench/bench_ep.py --part mp --ranks $R --sms 64 --reps 5 --unroll 6 \
  --mp-timeout 110 --out "$OUT/ep-mp.json"
want pytest && step pytest_gpu timeout 200 python3 -m pytest -x -q tests/gpu/test_ep_gpu.py
# libnccl probes its kernels with cudaFuncGetAttributes (error 209 on kernels not built for this GPU):
# API errors inside NCCL are not ours, so they are not reported here; NCCL's init is slow under the
# sanitizer (it overran a 10 s bound on 2026-11-22), hence the longer bound.
want sanitizer && step sanitizer_nccl timeout 150 env SLUICE_EP_TIMEOUT=90 "$SAN" --tool memcheck \
  --leak-check no --report-api-errors no --error-exitcode 9 \
  python3 tests/gpu/ep_capi_check.py --ranks 1 --quick --transport nccl
want bench_jax && step bench_jax timeout 200 python3 bench/bench_ep.py --part jax --ranks $R --sms 64 --reps 5 --out "$OUT/ep-jax.json"
python3 bench/bench_ep.py --report "$OUT/ep-capi.json" "$OUT/ep-jax.json" "$OUT/ep-mp.json" --md "$OUT/ep.md" >>"$LOG" 2>&1

echo
grep -E "FAIL|Error|error|passed|failed|ERROR SUMMARY|capi |jax |mp |ep_capi_check|test_ep_mp|ep_mp_worker|peer-never" "$LOG" | grep -v "^=====" | tail -40
echo
cat "$OUT/summary.txt"
cat "$OUT/ep.md" 2>/dev/null

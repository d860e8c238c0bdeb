#!/usr/bin/env bash
# One command for the GPU test suite on a GPU machine: build (tests/gpu/build.sh), then
#   1. every case plain (public API and the portable kernel, against a float64 reference)
#   2. compute-sanitizer memcheck, racecheck, synccheck and initcheck on a covering subset (--quick);
#      then step 1 and memcheck again on 3 SMs (--sms 3: many waves of tiles); gmm's 128-column
#      tiles on every case (--tile-n 128), plain, on 3 SMs, under memcheck and racecheck
#   3. SLUICE_DEBUG=1: bad device sizes must come back as SL_STATUS_INVALID_VALUE
#   4. test_wait_bound: an mbarrier wait that never completes ends the launch instead of hanging it
#   5. the FP8 kernels: test_gmm_fp8 plain, under memcheck and racecheck, on 3 SMs; the quantization
#      kernel bit for bit against numpy (test_quantize_fp8.py)
# BUILD=dir picks the build folder (default build-gpu); SKIP_BUILD=1 reuses what is there.
# Logs go to $LOGS (default $BUILD/logs). Exit status: number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
export BUILD=${BUILD:-build-gpu}
LOGS=${LOGS:-$BUILD/logs}
mkdir -p "$LOGS"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -x "$BUILD/test_gmm" ]; then
  tests/gpu/build.sh >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log"; exit 1; }
fi
T=${TEST_TIMEOUT:-300}
fails=0
step() { # name, command...
  local name=$1; shift
  timeout "$T" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%-10s rc=%-3d %s\n' "$name" "$rc" "$(tail -1 "$LOGS/$name.log")"
  [ $rc = 0 ] || fails=$((fails + 1))
}
step plain "$BUILD/test_gmm"
step memcheck compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/test_gmm" --quick
step racecheck compute-sanitizer --tool racecheck --error-exitcode 3 "$BUILD/test_gmm" --quick
step synccheck compute-sanitizer --tool synccheck --error-exitcode 3 "$BUILD/test_gmm" --quick
step initcheck compute-sanitizer --tool initcheck --error-exitcode 3 "$BUILD/test_gmm" --quick
# on 3 SMs every case spans many waves: gmm's stride-ordered tiles and its claimed last waves
step fewsms "$BUILD/test_gmm" --sms 3
step memcheck-fewsms compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/test_gmm" --quick --sms 3
# gmm's narrow (128-column) tiles on every case, as the wave model gives them to few-wave problems
step narrow "$BUILD/test_gmm" --tile-n 128
step narrow-fewsms "$BUILD/test_gmm" --tile-n 128 --sms 3
step narrow-memcheck compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/test_gmm" --quick --tile-n 128
step narrow-racecheck compute-sanitizer --tool racecheck --error-exitcode 3 "$BUILD/test_gmm" --quick --tile-n 128
step debug env SLUICE_DEBUG=1 "$BUILD/test_gmm" --debug
step fp8 "$BUILD/test_gmm_fp8"
step fp8-memcheck compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/test_gmm_fp8" --quick
step fp8-racecheck compute-sanitizer --tool racecheck --error-exitcode 3 "$BUILD/test_gmm_fp8" --quick
step fp8-fewsms "$BUILD/test_gmm_fp8" --sms 3
step fp8-quantize python3 tests/gpu/test_quantize_fp8.py "$BUILD/libsluice_gpu.so"
step waitbound "$BUILD/test_wait_bound"
grep -h "^FAIL" "$LOGS"/plain*.log "$LOGS"/fp8*.log | head -20
exit $fails

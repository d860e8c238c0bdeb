#!/usr/bin/env bash
# A/B of a library setting chosen by environment (e.g. SLUICE_GMM_TILE_ORDER=1) on one GPU in one call:
#   1. test_gmm with the setting, on every SM and on 3 SMs (many waves a case), and memcheck on 3 SMs
#   2. dev/probe/order_ab.sh: the dev harness in turn (SPECS) and Nsight Compute (NCU_CASES)
#   3. bench/clocks_gmm.py --part sustained: IMPLS alone under load, without and with the setting,
#      ROUNDS times in turn (the chip's clock follows the kernel's own power draw only there)
# AB_ENV="NAME=value ..." is the setting (session 44 also ran SLUICE_GMM_K_ORDER=1, since removed).
# Writes $OUT/env_ab.txt, $OUT/order.txt, $OUT/z.tgz (order_ab.sh's) and $OUT/z2.tgz (the logs).
#   AB_ENV=SLUICE_GMM_TILE_ORDER=1 SPECS="35,48:dsv3-gateup-ep8" NCU_CASES="35:dsv3-gateup-ep8 48:dsv3-gateup-ep8" \
#     dev/probe/env_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/env-ab-out}
mkdir -p "$OUT"
export BUILD=${BUILD:-build-gpu} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
sum=$OUT/env_ab.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
  echo "setting: ${AB_ENV:?}"; } >"$sum"
OUT=$OUT dev/probe/order_ab.sh >/dev/null 2>&1 # builds, then the harness and Nsight Compute
echo "order_ab.sh rc=$?" >>"$sum"
t() { # name, command...
  local name=$1; shift
  timeout 300 "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?: $(tail -1 "$OUT/$name.log")" >>"$sum"
}
t test env $AB_ENV "$BUILD/test_gmm"
t test-3sms env $AB_ENV SLUICE_GMM_SMS=3 "$BUILD/test_gmm"
t memcheck-3sms env $AB_ENV SLUICE_GMM_SMS=3 compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/test_gmm" --quick
for r in $(seq "${ROUNDS:-2}"); do
  for side in A B; do
    [ $side = A ] && envs="" || envs=$AB_ENV
    env $envs timeout 300 python3 bench/clocks_gmm.py --part sustained --lib "$BUILD/libsluice_gpu.so" \
      --shapes "${SHAPES:-dsv3-gateup-ep8,dsv3-down-ep8,mixtral-up,qwen3-30b-up}" --impls "${IMPLS:-sluice_gmm}" \
      --rounds 1 --dists "${DISTS:-uniform,skewed}" --out "$OUT/sustained-$side-$r.json" >/dev/null 2>&1
    python3 bench/clocks_gmm.py --table "$OUT/sustained-$side-$r.json" --md "$OUT/sustained-$side-$r.md" >/dev/null 2>&1
    grep '^| [a-z]' "$OUT/sustained-$side-$r.md" | sed "s/^/$side$r /" >>"$sum"
  done
done
cat "$sum" "$OUT/order.txt"
tar czf "$OUT/z2.tgz" -C "$OUT" $(cd "$OUT" && ls *.log sustained-* 2>/dev/null)
rm -f "$OUT"/*.log "$OUT"/sustained-*

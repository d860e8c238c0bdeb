#!/usr/bin/env bash
# The benchmark's peers beside our gmm under Nsight Compute (session 26): the kernel names every
# implementation launches (dev/probe/peer_kernels.py --names, torch.profiler) into $OUT/peer-names.txt,
# then for each "impl:shape[:sizes]" in $CASES one call (the third of its GEMM launches), full section
# set, clocks left alone, into $OUT/ncu-<impl>-<shape>-<sizes>.txt, and a condensed block per case in
# $OUT/peer-summary.txt (duration, clock, cycles, tensor pipe, L2/DRAM bytes, grid, block, cluster,
# registers, shared memory). Needs build-gpu/libsluice_gpu.so (tests/gpu/build.sh). Example:
#   CASES="sluice_gmm:dsv3-down-ep8 cublas_batched:dsv3-down-ep8" dev/probe/peer_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/peer-out}
LIB=${LIB:-build-gpu/libsluice_gpu.so}
mkdir -p "$OUT"
[ "${NAMES:-1}" = 1 ] && timeout 300 python3 dev/probe/peer_kernels.py --names --lib "$LIB" >"$OUT/peer-names.txt" 2>&1
for c in ${CASES:-}; do
  IFS=: read -r impl shape sizes <<<"$c"
  sizes=${sizes:-uniform}
  name="ncu-$impl-$shape-$sizes"
  timeout 300 ncu --clock-control none --kernel-name-base demangled \
    --kernel-name "regex:gemm|Gemm|gmm_kernel|cutlass|xmma|nvjet" --launch-skip 2 --launch-count 1 --set full \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum --import-source no -f -o "/tmp/$name" \
    python3 dev/probe/peer_kernels.py --lib "$LIB" --run "$impl" --shape "$shape" --dist "$sizes" --reps 4 \
    >"/tmp/$name.log" 2>&1
  echo "$c: ncu rc=$?"
  ncu --import "/tmp/$name.ncu-rep" --print-details all >"$OUT/$name.txt" 2>&1
  {
    echo "== $c"
    grep -m1 -E "^  [^ ].*\(([0-9]+, ){2}[0-9]+\)x\(" "$OUT/$name.txt" | cut -c1-300
    grep -E "^ +(Duration|Elapsed Cycles |Tensor \(All\)|L2 Hit Rate |dram__bytes_read.sum |dram__bytes_write.sum |lts__t_bytes.sum |SM Frequency|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Grid Size|Block Size|Cluster Size|Registers Per Thread|Dynamic Shared Memory Per Block|Waves Per SM)" \
      "$OUT/$name.txt" | awk '{$1=$1; if (!seen[$0]++) print "  " $0}'
  } >>"$OUT/peer-summary.txt"
done

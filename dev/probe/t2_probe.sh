#!/usr/bin/env bash
# The 256x128 probe (dev/probe/t2_probe.cu) on one GPU, in one call: build, two timing runs (the
# library's gmm, the probe at 3 and 4 stages, its 2-CTA A-multicast variant, cuBLAS batched, in
# turn), then each of them once under Nsight Compute on dsv3-down (clocks left alone) with a
# condensed summary. Everything goes to $OUT (t2-probe.txt, ncu-summary.txt, z.tgz).
# HYBRID=1: the hybrid's timings alone (256x128 tiles for each group's multiple-of-256 rows, the
# library for the rest; RUNS=3), no Nsight Compute.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/t2-out}
B=${B:-/tmp/build-probe}
mkdir -p "$OUT" "$B"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
  nvcc --version | tail -1
} >"$OUT/t2-probe.txt" 2>&1
for f in status gmm_cpu; do gcc -O2 -fPIC -fopenmp -Iinclude -Icsrc/core -c csrc/core/$f.c -o $B/$f.o; done
nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -Iinclude -Icsrc/core \
  dev/probe/t2_probe.cu $B/status.o $B/gmm_cpu.o -lgomp -lcuda -lcublas -o $B/t2_probe \
  >"$OUT/build.txt" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.txt"; exit 1; }
# the benchmark's ragged group sizes (bench/shapes.py), one file per shape and distribution
mkdir -p "$B/sizes"
python3 - "$B/sizes" <<'PY'
import sys
sys.path.insert(0, "bench")
from shapes import FINE_SHAPES, SHAPES, group_sizes
for sh in SHAPES + FINE_SHAPES:
    for dist in ("exact", "uniform", "skewed"):
        with open(f"{sys.argv[1]}/{sh.name}-{dist}.txt", "w") as f:
            f.write(" ".join(str(int(v)) for v in group_sizes(sh, dist)) + "\n")
PY
if [ "${HYBRID:-0}" = 1 ]; then # session 56: the hybrid alone (t2_probe.cu's hybrid()), RUNS times
  for r in $(seq 1 ${RUNS:-3}); do
    echo "== hybrid run $r" >>"$OUT/t2-probe.txt"
    T2_HYBRID=1 T2_SIZES_DIR="$B/sizes" timeout 300 $B/t2_probe >>"$OUT/t2-probe.txt" 2>&1
    echo "rc=$?" >>"$OUT/t2-probe.txt"
  done
  cat "$OUT/t2-probe.txt"
  exit 0
fi
for r in $(seq 1 ${RUNS:-2}); do
  echo "== run $r" >>"$OUT/t2-probe.txt"
  T2_NOEQUAL=${T2_NOEQUAL:-} T2_SIZES_DIR="$B/sizes" timeout 400 $B/t2_probe >>"$OUT/t2-probe.txt" 2>&1
  echo "rc=$?" >>"$OUT/t2-probe.txt"
  T2_NOEQUAL=1 T2R_NOSKIP=1 T2_SIZES_DIR="$B/sizes" timeout 400 $B/t2_probe >>"$OUT/t2-probe.txt" 2>&1
  echo "rc=$?" >>"$OUT/t2-probe.txt"
done
cat "$OUT/t2-probe.txt"
if [ "${NCU:-1}" = 1 ]; then
  for c in ${NCU_IMPLS:-lib:gmm_kernel t2-4stg:t2_kernel t2-4stg-mc:t2_kernel cublas-bmm:nvjet|xmma|cutlass|gemm}; do
    impl=${c%%:*}; rx=${c#*:}
    # lib always runs too (the reference); the probe's kernels are told apart by their mangled names
    base=demangled
    case $impl in t2-4stg) rx='t2_kernelILi4ELb0E' base=mangled;; t2-4stg-mc) rx='t2_kernelILi4ELb1E' base=mangled;; esac
    timeout 200 ncu --clock-control none --kernel-name-base $base --kernel-name "regex:$rx" \
      --launch-skip 2 --launch-count 1 --set full --import-source no \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum -f -o "/tmp/ncu-$impl" \
      env T2_SHAPE=down T2_REPS=2 T2_IMPLS=$impl $B/t2_probe >"/tmp/ncu-$impl.log" 2>&1
    echo "$impl: ncu rc=$?"
    ncu --import "/tmp/ncu-$impl.ncu-rep" --print-details all >"$OUT/ncu-$impl.txt" 2>&1
    {
      echo "== $impl (dsv3-down, equal groups)"
      grep -m1 -E "^  [^ ].*\(([0-9]+, ){2}[0-9]+\)x\(" "$OUT/ncu-$impl.txt" | cut -c1-200
      grep -E "^ +(Duration|Elapsed Cycles |Tensor \(All\)|dram__bytes_read.sum |lts__t_bytes.sum |SM Frequency|L2 Cache Throughput|Grid Size|Cluster Size|Registers Per Thread|Dynamic Shared Memory Per Block)" \
        "$OUT/ncu-$impl.txt" | awk '{$1=$1; if (!seen[$0]++) print "  " $0}'
    } >>"$OUT/ncu-summary.txt"
  done
  cat "$OUT/ncu-summary.txt"
fi
grep -E "registers|spill|Compiling entry" "$OUT/build.txt" >"$OUT/resource-usage.txt"
tar czf "$OUT/z.tgz" -C "$OUT" $(cd "$OUT" && ls ncu-*.txt build.txt 2>/dev/null)
rm -f "$OUT"/ncu-lib.txt "$OUT"/ncu-t2*.txt "$OUT"/ncu-cublas*.txt "$OUT/build.txt"

#!/usr/bin/env bash
# tgmm's cycles per tile against its length (session 61, dev/NOTES.md): dsv3-gateup's K and N with
# 256, 512, 1024, 2048 and 4096 rows a group (harness shapes rows*-gateup, uniform sizes), so the
# tile count (32 groups x 56 x 16 = 28,672) stays fixed and only each tile's contraction grows.
# Cycles per tile = a + b * rows: a is what a tile costs besides its rows (head, drain, staging,
# store), b the mainloop's cycles per row (16.0 at the tensor pipe's peak for a 128x256 tile:
# 128 * 256 * 2 flops / 4096 a cycle). Nsight Compute's elapsed cycles (clock-independent) per
# size for $VERSIONS, plus the plain harness's times, into $OUT. Binaries from $BUILD: those named
# in $BINS (default tgmm). Session 61's diagnostic builds (-DSLUICE_DIAG_*: no store, no staging,
# no epilogue, no drain, ...; bench/results/s61-20261128/README.md) are in the history at 424279a
# and 3c8e2ad, built as the harness with the macro set, e.g. BINS="tgmm tgmm-NO_STORE".
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-sweep}
OUT=${OUT:-/tmp/sweep-out}
VERSIONS=${VERSIONS:-25 20}
BINS=${BINS:-tgmm}
SIZES="rows256-gateup rows512-gateup dsv3-gateup-ep8 rows2048-gateup rows4096-gateup"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv >"$OUT/device.txt"
for bin in $BINS; do
for r in 1 2; do
  HARNESS_NOCHECK=1 HARNESS_SHAPES="$SIZES" HARNESS_MODES=uniform HARNESS_REPS=15 \
    "$BUILD/$bin" "$(echo $VERSIONS | tr ' ' ,)" >"$OUT/plain-$bin-$r.txt" 2>&1
done
for v in $VERSIONS; do
  for s in $SIZES; do
    HARNESS_NOCHECK=1 HARNESS_SHAPES=$s HARNESS_MODES=uniform HARNESS_REPS=1 \
      timeout 300 ncu --clock-control none --kernel-name regex:gmm_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --print-details all --metrics sm__cycles_elapsed.max \
      "$BUILD/$bin" "$v" >"$OUT/ncu-$bin-v$v-$s.txt" 2>&1
    echo "$bin v$v $s ncu rc=$?"
  done
done
python3 - "$OUT" "$bin" $VERSIONS <<'EOF'
import re, sys, pathlib
out, binary, versions = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows = {"rows256-gateup": 256, "rows512-gateup": 512, "dsv3-gateup-ep8": 1024,
        "rows2048-gateup": 2048, "rows4096-gateup": 4096}
tiles_per_sm = 32 * 56 * 16 / 132
lines = [f"{binary}: 128x256 tiles, 28,672 of them (217.2 a CTA) at every size; cycles from Nsight Compute",
         "version rows  elapsed_cycles  tensor%%  cycles/tile  pipe_cycles/tile  other/tile".replace("%%", "%")]
for v in versions:
    pts = []
    for s, r in rows.items():
        t = (out / f"ncu-{binary}-v{v}-{s}.txt").read_text()
        cyc = re.search(r"sm__cycles_elapsed.max\s+cycle\s+([\d,]+)", t)
        ten = re.search(r"Tensor \(All\)\s+%\s+([\d.]+)", t)
        if not cyc:
            lines.append(f"{v} {r}: no cycles"); continue
        c = float(cyc.group(1).replace(",", "")); per = c / tiles_per_sm
        tp = float(ten.group(1)) if ten else float("nan")
        pts.append((r, per))
        lines.append(f"{v:>7} {r:>5} {c:>15,.0f} {tp:>8.1f} {per:>12,.0f} {per * tp / 100:>17,.0f}"
                     f" {per * (1 - tp / 100):>11,.0f}")
    if len(pts) >= 2:
        n = len(pts); mx = sum(r for r, _ in pts) / n; my = sum(p for _, p in pts) / n
        b = sum((r - mx) * (p - my) for r, p in pts) / sum((r - mx) ** 2 for r, _ in pts)
        a = my - b * mx
        res = max(abs(p - (a + b * r)) / p for r, p in pts)
        lines.append(f"  v{v} fit: cycles/tile = {a:,.0f} + {b:.2f} * rows (max residual {res:.1%});"
                     f" at 1024 rows the fixed part is {a / (a + b * 1024):.1%} of a tile,"
                     f" the mainloop {16.0 / b:.1%} of the pipe's peak")
with open(out / "summary.txt", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
done

"""Warp-stall samples per SASS instruction from `ncu --page source --csv` (dev/cuda/profile.sh, SOURCE=1):
the totals per stall reason, then the N instructions with the most samples and their top reasons.
    python3 dev/cuda/ncu_stalls.py ncu-gmm-v4-dsv3-uniform-sass.csv [N]
"""

import csv
import sys

with open(sys.argv[1]) as f:
    rows = list(csv.reader(f))
hdr = rows[1]
data = rows[2:]
ia = hdr.index("Address")
isrc = hdr.index("Source")
ins = hdr.index("Warp Stall Sampling (All Samples)")
stall_cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
tot = sum(int(r[ins] or 0) for r in data)
print("total samples", tot)
agg = {}
for r in data:
    for i in stall_cols:
        agg[hdr[i]] = agg.get(hdr[i], 0) + int(r[i] or 0)
print(sorted(((v, k) for k, v in agg.items()), reverse=True)[:8])
top = sorted(data, key=lambda r: -int(r[ins] or 0))[: int(sys.argv[2]) if len(sys.argv) > 2 else 25]
for r in top:
    st = sorted(((int(r[i] or 0), hdr[i][6:]) for i in stall_cols), reverse=True)[:3]
    print(
        f"{int(r[ins]):7d} {100 * int(r[ins]) / tot:5.1f}% {r[ia][-5:]} {r[isrc].strip()[:60]:60s} {st}"
    )

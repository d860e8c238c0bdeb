"""Side-by-side table of torch-part runs of bench_gmm.py from two builds of the library, timed in turn
in one call (bench/run_gpu.sh with BASELINE=dir): per case the sluice TFLOP/s of each build and its
ratio, and per run the median gmm/torch and tgmm/torch (torch's own figures move with the chip's
clock, so the ratio to torch in the same run is the fair comparison).

    python3 bench/compare_gmm.py --new new-1.json new-2.json --base base-1.json base-2.json --md ab.md
"""

from __future__ import annotations

import argparse
import json
import statistics


def load(path):
    with open(path) as f:
        return json.load(f)["rows"]


def ratios(rows):
    g = [r["tflops"]["sluice_gmm"] / r["tflops"]["torch_grouped_mm"] for r in rows]
    t = [r["tflops"]["sluice_tgmm"] / r["tflops"]["torch_grouped_mm_wgrad"] for r in rows]
    return g, t


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--new", nargs="+", required=True, help="torch-part JSON of the build under test"
    )
    p.add_argument("--base", nargs="+", required=True, help="torch-part JSON of the baseline build")
    p.add_argument("--md", required=True)
    a = p.parse_args()
    runs = [("new", f, load(f)) for f in a.new] + [("base", f, load(f)) for f in a.base]
    lines = [
        "| run | build | gmm/torch median (min) | tgmm/torch median (min) |",
        "| --- | --- | --- | --- |",
    ]
    for side, f, rows in runs:
        g, t = ratios(rows)
        lines.append(
            f"| {f.rsplit('/', 1)[-1]} | {side} | {statistics.median(g):.3f} ({min(g):.3f}) "
            f"| {statistics.median(t):.3f} ({min(t):.3f}) |"
        )

    def mean_by_case(side, key):
        acc = {}
        for s, _, rows in runs:
            if s == side:
                for r in rows:
                    acc.setdefault((r["shape"], r["dist"]), []).append(r["tflops"][key])
        return {c: statistics.mean(v) for c, v in acc.items()}

    lines += ["", "Mean TFLOP/s over the runs of each build:", ""]
    lines += ["| shape | sizes | gmm new | gmm base | new/base | tgmm new | tgmm base | new/base |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    gn, gb = mean_by_case("new", "sluice_gmm"), mean_by_case("base", "sluice_gmm")
    tn, tb = mean_by_case("new", "sluice_tgmm"), mean_by_case("base", "sluice_tgmm")
    rel = []
    for c in gn:
        if c in gb:
            rel += [gn[c] / gb[c], tn[c] / tb[c]]
            lines.append(
                f"| {c[0]} | {c[1]} | {gn[c]:.1f} | {gb[c]:.1f} | {gn[c] / gb[c]:.3f} "
                f"| {tn[c]:.1f} | {tb[c]:.1f} | {tn[c] / tb[c]:.3f} |"
            )
    if rel:
        summary = (
            f"new/base over every case and op: median {statistics.median(rel):.3f}, "
            f"min {min(rel):.3f}, max {max(rel):.3f}"
        )
        lines += ["", summary]
    with open(a.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Reads dev/cuda/ab.sh's outputs (a folder) and prints, per op, shape, sizes and version, the
median time of each run and B/A: run 2 against run 1 and run 3 against run 4 (B in the middle)."""

from __future__ import annotations

import pathlib
import sys


def read(path: pathlib.Path) -> dict[tuple[str, str, str], float]:
    rows = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) == 6 and f[2].isdigit() and f[5].endswith("x"):
            rows[(f[0], f[1], f[2])] = float(f[3])
    return rows


def main(folder: str) -> None:
    d = pathlib.Path(folder)
    for op in ("gmm", "tgmm"):
        runs = [read(p) for p in sorted(d.glob(f"ab-{op}-[1-4]-*.txt"))]
        if len(runs) != 4:
            continue
        print(f"{op}: ms in runs A1 B2 B3 A4; B/A as A1/B2 and A4/B3")
        print(f"{'shape':16s} {'sizes':8s} {'ver':>3s} {'A1':>7s} {'B2':>7s} {'B3':>7s} {'A4':>7s}"
              f" {'B/A(1,2)':>9s} {'B/A(4,3)':>9s}")
        for key in runs[0]:
            if not all(key in r for r in runs):
                continue
            a1, b2, b3, a4 = (r[key] for r in runs)
            print(f"{key[0]:16s} {key[1]:8s} {key[2]:>3s} {a1:7.3f} {b2:7.3f} {b3:7.3f} {a4:7.3f}"
                  f" {a1 / b2:8.3f}x {a4 / b3:8.3f}x")


if __name__ == "__main__":
    main(sys.argv[1])

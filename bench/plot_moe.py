"""Bar charts of a MoE measurement directory (what bench/device_moe.sh and bench_train.sh tgs write):
the layer's forward+backward time per path (bench_moe.py JSON lines) and each training step's
tokens/s per device relative to dense capacity 1.25 (bench/summarize_train.py tgs JSON).

    python bench/plot_moe.py DIR --out DIR/summary.png

DIR holds moe-*.jsonl / moe-*.log (JSON lines, one object per path or one per run with "results")
and tgs/*.json (or *tgs*.json). Paths that failed are drawn as an empty bar labelled with why.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ORDER = ("dense-cf1.25", "dense-cf2.0", "ragged_dot", "sluice+a2a", "sluice")
COLOURS = {
    "dense-cf1.25": "tab:orange",
    "dense-cf2.0": "tab:green",
    "ragged_dot": "tab:gray",
    "sluice+a2a": "tab:purple",
    "sluice": "tab:blue",
}


def layer_runs(d):
    """[(title, {path: result})] from the bench_moe JSON lines in d."""
    runs = []
    for path in sorted(
        glob.glob(os.path.join(d, "moe-*.jsonl")) + glob.glob(os.path.join(d, "moe-*.log"))
    ):
        head, results = None, {}
        with open(path) as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                rec = json.loads(line)
                if "preset" in rec:  # a run header (results inline, or in the following lines)
                    if head is not None and results:
                        runs.append((head, results))
                    head, results = rec, dict(rec.get("results", {}))
                else:
                    results.update(rec)
        if head is not None and results:
            runs.append((head, results))
    seen, out = set(), []
    for head, results in runs:
        key = (head["devices"], head["batch"])
        if key in seen:  # the .log repeats the .jsonl's lines
            continue
        seen.add(key)
        title = f"{head['preset']} layer fwd+bwd, {head['batch']}x{head['seq_len']} tokens/GPU, {head['devices']} GPU"
        out.append((title, results))
    return out


def tgs_runs(d):
    out = []
    for path in sorted(
        glob.glob(os.path.join(d, "tgs", "*.json")) + glob.glob(os.path.join(d, "*tgs*.json"))
    ):
        with open(path) as f:
            rows = json.load(f)
        ok = [r for r in rows.values() if isinstance(r, dict) and "tgs" in r]
        if ok:
            r = ok[0]
            name = os.path.splitext(os.path.basename(path))[0]
            title = f"training step: {name} ({r['devices']} GPU)"
            out.append((title, rows))
    return out


def bars(ax, names, values, labels, ylabel, title):
    x = range(len(names))
    ax.bar(x, [v or 0 for v in values], color=[COLOURS.get(n, "tab:red") for n in names])
    for i, (v, lab) in enumerate(zip(values, labels)):
        ax.text(i, (v or 0), lab, ha="center", va="bottom", fontsize=7, rotation=0)
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set_ylim(0, 1.25 * max([v or 0 for v in values] + [1e-9]))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    panels = []
    for title, res in layer_runs(a.dir):
        names = [n for n in ORDER if n in res]
        ms = [res[n].get("ms") for n in names]
        labels = [
            f"{res[n]['ms']:.2f} ms" if "ms" in res[n] else "failed\n(out of memory)" for n in names
        ]
        panels.append((names, ms, labels, "time (ms), lower is better", title))
    for title, rows in tgs_runs(a.dir):
        base = rows.get("dense-cf1.25", {}).get("tgs")
        names = [n for n in ORDER if n in rows]
        rel = [rows[n]["tgs"] / base if base and "tgs" in rows[n] else None for n in names]
        labels = [
            f"{v:.2f}x\n{rows[n]['tgs'] / 1e3:.0f}k" if v else "failed" for n, v in zip(names, rel)
        ]
        panels.append((names, rel, labels, "tokens/s per GPU / dense cf1.25", title))
    if not panels:
        raise SystemExit(f"plot_moe: nothing to plot in {a.dir}")
    cols = 3
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        bars(ax, *panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out} ({len(panels)} panels)")


if __name__ == "__main__":
    main()

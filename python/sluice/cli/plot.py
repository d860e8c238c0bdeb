"""sluice-plot: overlay several runs' training and validation loss against steps and against wall
time.

    sluice-plot runs/tiny-ragged_dot-s0 runs/tiny-dense-cf1.25-s0 --out loss.png

Each RUN is a directory written by sluice-train (its metrics.jsonl, or metrics.jsonl.gz). Training
loss is smoothed with an exponential moving average (--smooth); validation loss is drawn as markers.
Wall time is the training time the run recorded (compilation, evaluation and checkpoints excluded).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os


def read_run(path: str) -> dict:
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.exists(metrics + ".gz") and not os.path.exists(metrics):
        metrics += ".gz"  # a run kept compressed
    if not os.path.exists(metrics):
        raise SystemExit(
            f"sluice-plot: {metrics} not found (is {path} a sluice-train --out directory?)"
        )
    with (gzip.open if metrics.endswith(".gz") else open)(metrics, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return {
        "train": [r for r in recs if r.get("kind") == "train"],
        "eval": [r for r in recs if r.get("kind") == "eval"],
    }


def ema(values, alpha):
    out, m = [], None
    for v in values:
        m = v if m is None else alpha * m + (1 - alpha) * v
        out.append(m)
    return out


def plot(
    runs: list[str], out: str, labels: list[str] | None = None, smooth: float = 0.5, title: str = ""
):
    """Runs whose labels share a first word ('dropless s0', 'dropless s1') share a colour and differ
    in line style, so many seeds of a few paths stay readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    labels = labels or [os.path.basename(os.path.normpath(path)) for path in runs]
    groups = list(dict.fromkeys(label.split()[0] for label in labels))
    seen: dict[str, int] = {}
    data = [read_run(path) for path in runs]
    for label, run in zip(labels, data, strict=True):
        group = label.split()[0]
        color = colors[groups.index(group) % len(colors)]
        style = styles[seen.get(group, 0) % len(styles)]
        seen[group] = seen.get(group, 0) + 1
        ev = run["eval"]
        final = f" (val {ev[-1]['val_loss']:.3f})" if ev else ""
        for ax, key in zip(axes, ("step", "train_time"), strict=True):
            tr = run["train"]
            if tr:
                ax.plot(
                    [r[key] for r in tr],
                    ema([r["loss"] for r in tr], smooth),
                    style,
                    color=color,
                    alpha=0.5,
                    lw=1.0,
                )
            if ev:
                ax.plot(
                    [r[key] for r in ev],
                    [r["val_loss"] for r in ev],
                    style,
                    marker="o",
                    color=color,
                    ms=3.5,
                    lw=1.4,
                    label=label + final,
                )
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall time (s)")
    axes[0].set_ylabel("loss (nats/token): training (thin), validation (markers)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    # Zoom past the first fifth of training, where every run starts from the same high loss.
    lows = [r["loss"] for run in data for r in run["train"][len(run["train"]) // 5 :]]
    lows += [r["val_loss"] for run in data for r in run["eval"]]
    if lows:
        axes[0].set_ylim(min(lows) - 0.05, max(lows) + 0.1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="sluice-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="sluice-train output directories")
    p.add_argument("--out", default="loss.png")
    p.add_argument("--labels", help="comma-separated labels, one per run")
    p.add_argument(
        "--smooth", type=float, default=0.5, help="EMA factor for the training loss (0 = none)"
    )
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    labels = a.labels.split(",") if a.labels else None
    if labels and len(labels) != len(a.runs):
        raise SystemExit("sluice-plot: --labels needs one label per run")
    print(plot(a.runs, a.out, labels, a.smooth, a.title))


if __name__ == "__main__":
    main()

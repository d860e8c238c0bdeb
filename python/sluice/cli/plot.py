"""sluice-plot: several runs side by side, the figure for a report: loss against steps and against
training time, the dropped fraction of token copies, and tokens/s per device.

    sluice-plot runs/tiny-sluice-s0 runs/tiny-dense-cf1.25-s0 --out runs.png

Each RUN is a directory written by sluice-train (its metrics.jsonl, or metrics.jsonl.gz). A run is
labelled from its config.json by its expert path ('sluice', 'dense cf1.25', 'ragged_dot') and seed,
and by its preset where the runs' presets differ; --labels overrides. Runs of one path share a
colour and differ in line style. Training loss is smoothed with an exponential moving average
(--smooth) and drawn thin; validation loss is drawn with markers. Training time is the time the run
recorded (compilation, evaluation and checkpoints excluded). Every axis shows all of its data.
"""

from __future__ import annotations

import gzip
import json
import os

from .usage import Parser, UsageError, command


def read_run(path: str) -> dict:
    """A run directory's records ("train", "eval") and its config.json ("config", or None)."""
    if not os.path.isdir(path):
        raise UsageError(f"{path}: no such run directory (expected a sluice-train --out directory)")
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.exists(metrics + ".gz") and not os.path.exists(metrics):
        metrics += ".gz"  # a run kept compressed
    if not os.path.exists(metrics):
        raise UsageError(f"{path}: no metrics.jsonl (expected a sluice-train --out directory)")
    recs = []
    with (gzip.open if metrics.endswith(".gz") else open)(metrics, "rt") as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except ValueError:  # a line cut short by a crash
                continue
    run = {
        "train": [r for r in recs if r.get("kind") == "train"],
        "eval": [r for r in recs if r.get("kind") == "eval"],
    }
    if not run["train"] and not run["eval"]:
        raise UsageError(f"{metrics}: no training or validation records yet")
    config = os.path.join(path, "config.json")
    try:
        with open(config) as f:
            run["config"] = json.load(f)
    except (OSError, ValueError):
        run["config"] = None
    return run


def expert_path(args: dict) -> str:
    """A run's expert path in a few words, from its sluice-train flags."""
    impl = args.get("moe_impl", "?")
    if impl == "dense":
        return f"dense cf{args.get('capacity_factor', 1.25):g}"
    if impl == "sluice" and args.get("no_sluice_gmm"):
        return "sluice (ragged_dot matmuls)"
    if args.get("fp8"):
        return f"{impl} FP8" + (
            " (power-of-two scales)" if args.get("fp8_power_of_two_scales") else ""
        )
    return impl


def labels_for(paths: list[str], runs: list[dict]) -> list[tuple[str, str]]:
    """(group, label) of each run: its expert path, then 'path, seed S' (with the preset first
    where the runs' presets differ); a run without config.json is named after its directory."""
    presets = {(r["config"] or {}).get("args", {}).get("preset") for r in runs}
    out = []
    for path, run in zip(paths, runs, strict=True):
        if run["config"] is None:
            name = os.path.basename(os.path.normpath(path))
            out.append((name, name))
            continue
        args = run["config"].get("args", {})
        group = expert_path(args)
        if len(presets) > 1:
            group = f"{args.get('preset')} {group}"
        out.append((group, f"{group}, seed {args.get('seed', 0)}"))
    return out


def ema(values, alpha):
    out, m = [], None
    for v in values:
        m = v if m is None else alpha * m + (1 - alpha) * v
        out.append(m)
    return out


def _line(ax, recs, x, y, **kw):
    recs = [r for r in recs if r.get(y) is not None]
    if recs:
        ax.plot([r[x] for r in recs], [r[y] for r in recs], **kw)


def plot(
    runs: list[str], out: str, labels: list[str] | None = None, smooth: float = 0.5, title: str = ""
):
    """Writes the figure of the run directories `runs` to `out`; labels (one per run) replace
    their labels, and runs whose labels share a first word share a colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [read_run(path) for path in runs]
    named = labels_for(runs, data)
    if labels:
        named = [(label.split()[0] if label.split() else label, label) for label in labels]
    groups = list(dict.fromkeys(g for g, _ in named))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    seen: dict[str, int] = {}

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (loss_step, loss_time), (drop_ax, tgs_ax) = axes
    for (group, label), run in zip(named, data, strict=True):
        color = colors[groups.index(group) % len(colors)]
        style = styles[seen.get(group, 0) % len(styles)]
        seen[group] = seen.get(group, 0) + 1
        tr, ev = run["train"], run["eval"]
        final = f" (val {ev[-1]['val_loss']:.3f})" if ev else ""
        thin = {"color": color, "ls": style, "alpha": 0.55, "lw": 1.0}
        for ax, x in ((loss_step, "step"), (loss_time, "train_time")):
            if tr:
                ax.plot([r[x] for r in tr], ema([r["loss"] for r in tr], smooth), **thin)
            _line(ax, ev, x, "val_loss", color=color, ls=style, marker="o", ms=3.5, lw=1.5)
        # (drawn over the axis, where a dropless run's zeros lie)
        _line(drop_ax, tr, "step", "dropped", color=color, ls=style, lw=1.5, clip_on=False)
        _line(tgs_ax, tr, "step", "tgs", color=color, ls=style, lw=1.5)
        # one legend entry per run, whichever records it has
        loss_step.plot(
            [], [], color=color, ls=style, marker="o" if ev else None, label=label + final
        )

    loss_step.set(title="loss against steps", xlabel="step", ylabel="loss (nats per token)")
    loss_time.set(title="loss against training time", xlabel="training time (s)")
    drop_ax.set(
        title="dropped token copies",
        xlabel="step",
        ylabel="fraction dropped (0 = dropless)",
    )
    tgs_ax.set(title="throughput", xlabel="step", ylabel="tokens/s per device")
    for ax in (drop_ax, tgs_ax):
        ax.set_ylim(bottom=0)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    loss_time.sharey(loss_step)
    fig.legend(
        *loss_step.get_legend_handles_labels(),
        loc="lower center",
        ncol=min(len(named), 3),
        frameon=False,
        title="training loss: thin line (smoothed); validation loss: markers",
    )
    if title:
        fig.suptitle(title)
    rows = -(-len(named) // 3)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * rows, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


@command("sluice-plot")
def main(argv=None):
    p = Parser(prog="sluice-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="sluice-train output directories")
    p.add_argument("--out", default="runs.png", help="the image (default: %(default)s)")
    p.add_argument("--labels", help="comma-separated labels, one per run")
    p.add_argument(
        "--smooth", type=float, default=0.5, help="EMA factor for the training loss (0 = none)"
    )
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    labels = a.labels.split(",") if a.labels else None
    if labels and len(labels) != len(a.runs):
        p.error(
            f"argument --labels: {len(labels)} labels for {len(a.runs)} runs, expected one each"
        )
    if not 0 <= a.smooth < 1:
        p.error(f"argument --smooth: expected a number from 0 to below 1, got {a.smooth:g}")
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        p.error(f"argument --out: {folder} is not a directory")
    print(plot(a.runs, a.out, labels, a.smooth, a.title))


if __name__ == "__main__":
    main()

"""Tables of bench_train.sh runs (one sluice-train --out directory per path under DIR).

python bench/summarize_train.py tgs DIR           -> DIR/tgs.md, DIR/tgs.json
python bench/summarize_train.py convergence DIR   -> DIR/convergence.md, DIR/convergence.json
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import statistics
import sys


def _records(run_dir):
    """The run's metrics.jsonl, or its gzip (how long runs are kept)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    for p, opener in ((path, open), (path + ".gz", gzip.open)):
        if os.path.exists(p):
            with opener(p, "rt") as f:
                return [json.loads(line) for line in f if line.strip()]
    return []


def _last_log_line(out, name):
    path = os.path.join(out, name + ".log")
    if not os.path.exists(path):
        return "no log"
    with open(path) as f:
        lines = f.read().strip().splitlines()
    return lines[-1][:200] if lines else "empty log"


def tgs(out):
    from_step = int(os.environ.get("FROM_STEP", "0"))  # only the windows past this step
    rows = {}
    for name in sorted(d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))):
        recs = _records(os.path.join(out, name))
        train = [r for r in recs if r["kind"] == "train"][1:]  # the first window still warms up
        train = [r for r in train if r["step"] > from_step]
        compile_s = [r["seconds"] for r in recs if r["kind"] == "compile"]
        if not train:
            rows[name] = {"error": _last_log_line(out, name)}
            continue
        with open(os.path.join(out, name, "config.json")) as f:
            cfg = json.load(f)
        mfu = [r["mfu"] for r in train if r.get("mfu") not in (None, "n/a")]
        rows[name] = {
            "tgs": statistics.median(r["tgs"] for r in train),
            "mfu": statistics.median(mfu) if mfu else None,
            "step_ms": 1e3 * statistics.median(r["step_time"] for r in train),
            "dropped": statistics.mean(r["dropped"] for r in train),
            "load_cv": statistics.median(r.get("load_cv", float("nan")) for r in train),
            "peak_mem_gb": train[-1]["peak_mem_gb"],
            "compile_s": compile_s[0] if compile_s else None,
            "steps": train[-1]["step"],
            "loss": train[-1]["loss"],
            "device": cfg["device_kind"],
            "devices": cfg["devices"],
            "mesh": cfg["mesh"],
            "moe_path": cfg.get("moe_path"),
            "preset": cfg["args"]["preset"],
            "jax": cfg["jax"],
        }
    with open(os.path.join(out, "tgs.json"), "w") as f:
        json.dump(rows, f, indent=1)
    first = next((r for r in rows.values() if "device" in r), {})
    lines = [
        (
            f"Training step, preset {first.get('preset')}, {first.get('devices')} x "
            f"{first.get('device')} (mesh {first.get('mesh')}), jax {first.get('jax')}; "
            + (
                f"medians over the logged windows past step {from_step}."
                if from_step
                else "medians over the logged windows after the first."
            )
        ),
        "",
        (
            "| path | TGS (tokens/s/device) | MFU | step (ms) | dropped | expert load CV "
            "| peak memory (GiB) | compile (s) | MoE path |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {name} | {r['tgs']:.0f} | {mfu} | {r['step_ms']:.1f} | {r['dropped']:.4f} | "
            f"{r['load_cv']:.2f} | {r['peak_mem_gb']} | {r['compile_s']:.1f} | {r['moe_path']} |"
        )
    _write(os.path.join(out, "tgs.md"), lines)


def convergence(out):
    """Validation loss of each path and seed at the last evaluation step that every run reached (the
    planned last step when all finished; runs cut short by a time limit are marked)."""
    dirs = [  # NAME-sSEED run directories only
        d
        for d in os.listdir(out)
        if os.path.isdir(os.path.join(out, d)) and re.fullmatch(r".+-s\d+", d)
    ]
    seeds = sorted({int(d.rsplit("-s", 1)[1]) for d in dirs})
    runs = {}  # (name, seed) -> (config, {step: val_loss}, train records)
    bpb = {}  # (name, seed) -> {step: val loss in bits per byte of text}
    for d in dirs:
        name, seed = d.rsplit("-s", 1)
        recs = _records(os.path.join(out, d))
        ev = [r for r in recs if r["kind"] == "eval"]
        evals = {r["step"]: r["val_loss"] for r in ev}
        # runs before val_bpb was logged were all on byte tokens (an end of document a byte too)
        bpb[name, int(seed)] = {
            r["step"]: r.get("val_bpb", r["val_loss"] / math.log(2)) for r in ev
        }
        if evals:
            with open(os.path.join(out, d, "config.json")) as f:
                runs[name, int(seed)] = (
                    json.load(f),
                    evals,
                    [r for r in recs if r["kind"] == "train"],
                )
    if not runs:
        with open(os.path.join(out, "convergence.json"), "w") as f:
            json.dump({}, f)
        _write(os.path.join(out, "convergence.md"), ["no run reached an evaluation"])
        return
    step = min(max(evals) for _, evals, _ in runs.values())
    planned = next(iter(runs.values()))[0]["hp"]["steps"]
    rows, table = {}, []

    def order(name):  # dropless, the capacity factors in rising order, the rest by name
        if name == "dropless":
            return (0, 0.0, "")
        if name.startswith("cf"):
            return (1, float(name[2:]), "")
        return (2, 0.0, name)

    names = sorted({name for name, _ in runs}, key=order)
    for name in names:
        got = [(seed, runs[name, seed]) for seed in seeds if (name, seed) in runs]
        if not got:
            continue
        vals = [evals[step] for _, (_, evals, _) in got]
        bits = [bpb[name, seed][step] for seed, _ in got]
        upto = [[r for r in train if r["step"] <= step] for _, (_, _, train) in got]
        drops = [statistics.mean(r["dropped"] for r in t) for t in upto if t]
        short = [f"s{seed}" for seed, (c, evals, _) in got if max(evals) < c["hp"]["steps"]]
        rows[name] = {
            "seeds": [s for s, _ in got],
            "val_loss": vals,
            "val_bpb": bits,
            "mean_dropped": drops,
            "cut_short": short,
        }
        table.append(
            f"| {name} | {' / '.join(f'{v:.4f}' for v in vals)} | {statistics.mean(vals):.4f} | "
            f"{max(vals) - min(vals):.4f} | {statistics.mean(drops):.4f} | "
            f"{', '.join(short) or '-'} | {statistics.mean(bits):.4f} |"
        )
    with open(os.path.join(out, "convergence.json"), "w") as f:
        json.dump({"step": step, "planned_steps": planned, "paths": rows}, f, indent=1)
    cfg = next(iter(runs.values()))[0]
    hp = cfg["hp"]
    data = cfg["args"].get("data")
    data = os.path.basename(data) if data else "the python3-doc sources"
    lines = [
        (
            f"Convergence at equal steps: preset {cfg['args']['preset']}, validation loss at step {step} "
            f"(of {planned} planned) of {hp['batch_size']}x{hp['seq_len']} tokens per step, "
            f"{cfg['devices']} x {cfg['device_kind']}, jax {cfg['jax']}."
        ),
        (
            f"Validation loss (nats per token; vocabulary {cfg['model']['vocab_size']}) on the fixed "
            f"validation split of {data}, and in bits per byte of text (comparable across tokenizers)."
        ),
        "",
        (
            f"| path | val loss, seeds {' / '.join(map(str, seeds))} | mean | seed spread "
            f"| mean dropped fraction to step {step} | runs cut short before step {planned} "
            "| bits per byte (mean) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
        *table,
    ]
    # every evaluation all runs reached: each path's mean, and its gap to dropless's
    steps = sorted(set.intersection(*(set(evals) for _, evals, _ in runs.values())))
    means = {
        name: [statistics.mean(runs[name, sd][1][st] for sd in rows[name]["seeds"]) for st in steps]
        for name in rows
    }
    lines += [
        "",
        "Mean validation loss over the seeds at each evaluation (in brackets: minus dropless's).",
        "",
        "| step | " + " | ".join(means) + " |",
        "| --- " * (len(means) + 1) + "|",
    ]
    base = means.get("dropless")
    for i, st in enumerate(steps):
        cells = [
            f"{m[i]:.4f}" + (f" ({m[i] - base[i]:+.4f})" if base and n != "dropless" else "")
            for n, m in means.items()
        ]
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    a, b = rows.get("dropless", {}).get("val_loss"), rows.get("nodrop", {}).get("val_loss")
    if a and b:
        gaps = [abs(x - y) for x, y in zip(a, b)]
        lines += [
            "",
            (
                f"nodrop and dropless are the same model computed two ways (bf16 rounding differs, so "
                f"routing decisions and then trajectories diverge): their validation losses differ "
                f"by {statistics.mean(gaps):.4f} on average (at most {max(gaps):.4f}) at equal seed. "
                "Differences between paths smaller than that are noise."
            ),
        ]
    _write(os.path.join(out, "convergence.md"), lines)


def _write(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("tgs", "convergence"):
        raise SystemExit(__doc__)
    {"tgs": tgs, "convergence": convergence}[sys.argv[1]](sys.argv[2])

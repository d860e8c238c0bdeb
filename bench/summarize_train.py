"""Tables of bench_train.sh runs (one sluice-train --out directory per path under DIR).

python bench/summarize_train.py tgs DIR           -> DIR/tgs.md, DIR/tgs.json
python bench/summarize_train.py convergence DIR   -> DIR/convergence.md, DIR/convergence.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def _records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last_log_line(out, name):
    path = os.path.join(out, name + ".log")
    if not os.path.exists(path):
        return "no log"
    with open(path) as f:
        lines = f.read().strip().splitlines()
    return lines[-1][:200] if lines else "empty log"


def tgs(out):
    rows = {}
    for name in sorted(d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))):
        recs = _records(os.path.join(out, name))
        train = [r for r in recs if r["kind"] == "train"][1:]  # the first window still warms up
        compile_s = [r["seconds"] for r in recs if r["kind"] == "compile"]
        if not train:
            rows[name] = {"error": _last_log_line(out, name)}
            continue
        with open(os.path.join(out, name, "config.json")) as f:
            cfg = json.load(f)
        mfu = [r["mfu"] for r in train if r["mfu"] != "n/a"]
        rows[name] = {
            "tgs": statistics.median(r["tgs"] for r in train),
            "mfu": statistics.median(mfu) if mfu else "n/a",
            "step_ms": 1e3 * statistics.median(r["step_time"] for r in train),
            "dropped": statistics.mean(r["dropped"] for r in train),
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
            "medians over the logged windows after the first."
        ),
        "",
        (
            "| path | TGS (tokens/s/device) | MFU | step (ms) | dropped | peak memory (GiB) "
            "| compile (s) | MoE path |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] != "n/a" else "n/a"
        lines.append(
            f"| {name} | {r['tgs']:.0f} | {mfu} | {r['step_ms']:.1f} | {r['dropped']:.4f} | "
            f"{r['peak_mem_gb']} | {r['compile_s']:.1f} | {r['moe_path']} |"
        )
    _write(os.path.join(out, "tgs.md"), lines)


def convergence(out):
    rows, table = {}, []
    cfg = None
    dirs = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d)) and "-s" in d]
    seeds = sorted({int(d.rsplit("-s", 1)[1]) for d in dirs})
    for name in ("dropless", "cf1.25", "cf2.0", "nodrop"):
        vals, drops, times = [], [], []
        for seed in seeds:
            run = os.path.join(out, f"{name}-s{seed}")
            recs = _records(run)
            evals = [r for r in recs if r["kind"] == "eval"]
            train = [r for r in recs if r["kind"] == "train"]
            if not evals:
                continue
            with open(os.path.join(run, "config.json")) as f:
                run_cfg = json.load(f)
            if evals[-1]["step"] != run_cfg["hp"]["steps"]:
                continue  # unfinished
            cfg = cfg or run_cfg
            vals.append(evals[-1]["val_loss"])
            drops.append(statistics.mean(r["dropped"] for r in train))
            times.append(train[-1]["train_time"])
        rows[name] = {"val_loss": vals, "mean_dropped": drops, "train_time_s": times}
        if vals:
            table.append(
                f"| {name} | {' / '.join(f'{v:.4f}' for v in vals)} | "
                f"{statistics.mean(vals):.4f} | "
                f"{statistics.mean(drops):.4f} | {statistics.mean(times):.0f} |"
            )
    with open(os.path.join(out, "convergence.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if cfg is None:
        _write(os.path.join(out, "convergence.md"), ["no finished run"])
        return
    hp = cfg["hp"]
    lines = [
        (
            f"Convergence at equal steps: preset {cfg['args']['preset']}, {hp['steps']} steps of "
            f"{hp['batch_size']}x{hp['seq_len']} tokens, {cfg['devices']} x {cfg['device_kind']}, "
            f"jax {cfg['jax']}; dropless path: --moe-impl {cfg['args']['moe_impl']}."
        ),
        "Validation loss (nats per byte) on the fixed validation split of the python3-doc sources.",
        "",
        (
            f"| path | val loss, seeds {' / '.join(map(str, seeds))} | mean | mean dropped fraction "
            "| train time (s) |"
        ),
        "| --- | --- | --- | --- | --- |",
        *table,
    ]
    a, b = rows["dropless"]["val_loss"], rows["nodrop"]["val_loss"]
    if a and b:
        gaps = [abs(x - y) for x, y in zip(a, b)]
        lines += [
            "",
            (
                f"nodrop and dropless are the same model computed two ways (bf16 rounding differs, so "
                f"routing decisions and then trajectories diverge): their final validation losses differ "
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

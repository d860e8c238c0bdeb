"""The repository's measuring tools that run on any machine (bench/)."""

import os
import pathlib
import subprocess
import sys

import pytest
import shapes

ROOT = pathlib.Path(__file__).resolve().parents[3]

PROBE = """
import jax, jax.numpy as jnp

@jax.jit
def peak_probe(x):  # two [512, 2048] f32 products, both alive at the last one
    a = jnp.tanh(x @ x.T @ x)
    b = jnp.sin(x @ x.T @ x)
    return (a * b).sum() + (a @ b.T).sum()

peak_probe(jnp.ones((512, 2048), jnp.float32)).block_until_ready()
"""


def test_hlo_peak_reads_a_dump_and_names_the_values_at_the_peak(tmp_path):
    dump = tmp_path / "dump"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*peak_probe.*"
    subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, timeout=300)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hlo_peak.py"), str(dump), "--module", "peak_probe"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    head = [line for line in out.splitlines() if "live at once at most" in line]
    assert len(head) == 1, out
    peak_gib = float(head[0].split("live at once at most ")[1].split(" GiB")[0])
    # a and b (4 MiB each) are live together at the last product
    assert peak_gib >= 8 / 1024, out
    peak = out.split("largest values live at the peak")[1]
    assert "jit(peak_probe)/tanh" in peak and "jit(peak_probe)/sin" in peak, out


def test_hlo_peak_says_what_is_missing(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hlo_peak.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode != 0 and "no optimised HLO or buffer assignment" in r.stderr


def test_summarize_train_convergence_tables_every_path_and_evaluation(tmp_path):
    """bench/summarize_train.py convergence on stand-in runs: every path named in the run directories
    (dropless first, capacity factors in rising order), the last evaluation all runs reached, the
    mean dropped fraction, and each path's mean at every evaluation beside dropless's; metrics from
    metrics.jsonl or its gzip; other directories ignored."""
    import gzip
    import json
    import math

    def write_run(name, seed, evals, dropped, steps=4):
        d = tmp_path / f"{name}-s{seed}"
        d.mkdir()
        cfg = {
            "args": {"preset": "tiny", "data": "/x/corpus-all.npz"},
            "model": {"vocab_size": 320},
            "hp": {"steps": steps, "batch_size": 4, "seq_len": 64},
            "devices": 1,
            "device_kind": "cpu",
            "jax": "0",
        }
        (d / "config.json").write_text(json.dumps(cfg))
        recs = [{"kind": "train", "step": s, "dropped": dropped} for s in (2, 4)]
        recs += [{"kind": "eval", "step": s, "val_loss": v} for s, v in evals.items()]
        if name == "cf1.25":  # runs since val_bpb was logged (here: as if 2 bytes a token)
            recs = [
                r | {"val_bpb": r["val_loss"] / 2 / math.log(2)} if "val_loss" in r else r
                for r in recs
            ]
        text = "\n".join(map(json.dumps, recs)) + "\n"
        if name == "cf1.0":  # as long runs are kept
            with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
                f.write(text)
        else:
            (d / "metrics.jsonl").write_text(text)

    for seed, off in ((0, 0.0), (1, 0.2)):
        write_run("dropless", seed, {2: 3.0 + off, 4: 2.0 + off}, 0.0)
        write_run("cf1.25", seed, {2: 3.1 + off, 4: 2.1 + off}, 0.2)
        write_run("cf1.0", seed, {2: 3.3 + off}, 0.3)  # cut short after its first evaluation
    (tmp_path / "no-shared-expert").mkdir()
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "summarize_train.py"), "convergence", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "validation loss at step 2 (of 4 planned)" in out and "corpus-all.npz" in out
    rows = [r for r in out.splitlines() if r.startswith("| ") and not r.startswith("| ---")]
    assert [r.split(" | ")[0] for r in rows[:4]] == ["| path", "| dropless", "| cf1.0", "| cf1.25"]
    # bits per byte: val_bpb where logged, else val_loss / ln 2 (byte tokens)
    bpb = [f"{v / math.log(2):.4f}" for v in (3.1, 3.4, 3.2 / 2)]
    assert rows[1].endswith(f"| 0.0000 | - | {bpb[0]} |")
    assert rows[2].endswith(f"| 0.3000 | s0, s1 | {bpb[1]} |")
    assert rows[3].endswith(f"| 0.2000 | - | {bpb[2]} |")
    assert rows[4] == "| step | dropless | cf1.0 | cf1.25 |"
    assert rows[5] == "| 2 | 3.1000 | 3.4000 (+0.3000) | 3.2000 (+0.1000) |"
    got = json.loads((tmp_path / "convergence.json").read_text())
    assert got["step"] == 2 and got["paths"]["cf1.25"]["val_loss"] == pytest.approx([3.1, 3.3])


def test_bench_train_side_by_side_spreads_the_runs_over_the_gpus(tmp_path):
    """bench/bench_train.sh convergence SIDE_BY_SIDE=1: run j (seed by seed, each seed's paths in
    turn) on GPU j mod GPUS; by default GPUS is the number of paths (path i on GPU i). A stand-in
    python records each sluice-train run's CUDA_VISIBLE_DEVICES."""
    py = tmp_path / "py"
    py.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$2" = sluice.cli.train ]; then\n'
        '  while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
        '  mkdir -p "$out" && echo "$CUDA_VISIBLE_DEVICES" > "$out/gpu"\n'
        "fi\n"
    )
    py.chmod(0o755)

    def gpus(extra):
        out = tmp_path / f"out{len(extra)}"
        env = dict(os.environ, PY=str(py), SIDE_BY_SIDE="1", SEEDS="0 1", **extra)
        env["NAMES"] = "dropless cf1.0 cf1.25"
        subprocess.run(
            ["bash", str(ROOT / "bench" / "bench_train.sh"), "convergence", str(out)],
            env=env,
            check=True,
            capture_output=True,
        )
        return {d.name: int((d / "gpu").read_text()) for d in out.iterdir() if (d / "gpu").exists()}

    assert gpus({}) == {
        "dropless-s0": 0, "cf1.0-s0": 1, "cf1.25-s0": 2, "dropless-s1": 0, "cf1.0-s1": 1, "cf1.25-s1": 2
    }  # fmt: skip
    assert gpus({"GPUS": "4"}) == {
        "dropless-s0": 0, "cf1.0-s0": 1, "cf1.25-s0": 2, "dropless-s1": 3, "cf1.0-s1": 0, "cf1.25-s1": 1
    }  # fmt: skip


def test_the_shape_list_selects_every_set_by_name():
    """tests/shapes.py: each named set and each shape by name; small-groups sweeps the rows per group."""
    assert shapes.select_shapes(None) == shapes.SHAPES
    assert shapes.select_shapes("fine") == shapes.FINE_SHAPES
    sweep = shapes.select_shapes("small-groups")
    cases = len(shapes.SMALL_GROUP_MATMULS) * len(shapes.SMALL_GROUP_ROWS)
    assert len({s.name for s in sweep}) == len(sweep) == cases
    assert all(s.m == s.g * int(s.name.rsplit("-r", 1)[1]) for s in sweep)
    assert shapes.select_shapes(sweep[3].name) == (sweep[3],)
    for s in sweep[:2]:
        for dist in shapes.DISTRIBUTIONS:
            assert int(shapes.group_sizes(s, dist).sum()) == s.m

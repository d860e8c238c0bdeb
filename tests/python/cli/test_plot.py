"""sluice-plot renders runs side by side (loss against steps and time, dropped fraction, tokens/s),
labelled from their config.json by expert path and seed."""

import json
import math

import pytest

pytest.importorskip("matplotlib")


def fake_run(path, impl, seed, dropped=0.0, preset="tiny", config=True):
    """A run directory as sluice-train writes it: 100 steps logged every 10, evaluated every 50."""
    path.mkdir()
    if config:
        args = {"preset": preset, "moe_impl": impl, "capacity_factor": 1.25, "seed": seed}
        (path / "config.json").write_text(json.dumps({"args": args}))
    recs = [{"kind": "compile", "step": 1, "seconds": 2.0, "loss": 5.6}]
    for s in range(10, 101, 10):
        loss = 1.5 + 4 * math.exp(-s / 30)
        recs.append(
            {"kind": "train", "step": s, "loss": loss, "dropped": dropped, "tgs": 5e3 + s,
             "train_time": 0.3 * s, "mfu": None, "peak_mem_gb": None}
        )  # fmt: skip
        if s % 50 == 0:
            recs.append({"kind": "eval", "step": s, "val_loss": loss + 0.1, "train_time": 0.3 * s})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_plot_renders_two_runs_labelled_from_their_config(tmp_path, capsys):
    from sluice.cli import plot

    a = fake_run(tmp_path / "a", "sluice", 0)
    b = fake_run(tmp_path / "b", "dense", 1, dropped=0.1)
    png = str(tmp_path / "runs.png")
    plot.main([a, b, "--out", png, "--title", "tiny, 100 steps"])
    assert capsys.readouterr().out.strip() == png
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    runs = [plot.read_run(a), plot.read_run(b)]
    assert plot.labels_for([a, b], runs) == [
        ("sluice", "sluice, seed 0"),
        ("dense cf1.25", "dense cf1.25, seed 1"),
    ]
    # presets that differ are named; a run without config.json by its directory
    c = fake_run(tmp_path / "c", "ragged_dot", 0, preset="small")
    d = fake_run(tmp_path / "d", "sluice", 0, config=False)
    runs += [plot.read_run(c), plot.read_run(d)]
    assert [label for _, label in plot.labels_for([a, b, c, d], runs)] == [
        "tiny sluice, seed 0",
        "tiny dense cf1.25, seed 1",
        "small ragged_dot, seed 0",
        "d",
    ]
    plot.main([a, b, c, d, "--out", png, "--labels", "sluice s0,dense s1,ragged s0,plain"])

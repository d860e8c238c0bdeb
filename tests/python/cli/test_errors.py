"""Every user error of the sluice-* commands ends in one line, `PROG: error: ...`, naming the flag or
file and what was expected, with exit code 2 and no traceback."""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import random_corpus

pytest.importorskip("flax")
README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")


def one_line_error(capsys, main, argv):
    """The one line a user error prints (exit code 2, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


TRAIN = [
    (["--data", "/nonexistent/corpus.npz"], "--data /nonexistent/corpus.npz: no such file"),
    (["--data", README], "README.md: not a token file (expected an .npz from sluice-prepare-data)"),
    (["--data", "{no_arrays}"], "no_arrays.npz: not a token file (an .npz without the train and"),
    (["--capacity-factor", "-1"], "argument --capacity-factor: expected a number > 0, got '-1'"),
    (["--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got '0'"),
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    (["--steps", "-5"], "argument --steps: expected an integer >= 1, got '-5'"),
    (["--steps", "ten"], "argument --steps: expected an integer >= 1, got 'ten'"),
    (["--lr", "nan"], "argument --lr: expected a number > 0, got 'nan'"),
    (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["--ep-sms", "65"], "argument --ep-sms: expected an integer from 1 to 64, got '65'"),
    (["--grad-accum", "0"], "argument --grad-accum: expected an integer >= 1, got '0'"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from "),
    (["--moe-impl", "fast"], "argument --moe-impl: invalid choice: 'fast'"),
    (["--devices", "9"], "--devices 9: only 8 cpu devices visible"),
    (["--ep", "3"], "--ep 3: expected a divisor of the 8 devices"),
    (["--devices", "6", "--ep", "6"], "--ep 6: expected a divisor of the model's 16 experts"),
    (
        ["--preset", "dsv3-proxy-ep4", "--devices", "2"],
        "--preset dsv3-proxy-ep4's --ep 4: expected",
    ),
    (
        ["--batch-size", "6", "--devices", "4"],
        "--batch-size 6: expected a multiple of the 4 devices",
    ),
    (
        ["--batch-size", "8", "--devices", "4", "--grad-accum", "3"],
        "--batch-size 8: expected a multiple of the 4 devices times --grad-accum 3",
    ),
    (["--resume"], "--resume: no run in "),
    (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    (["--resume", "--no-ckpt"], "--resume reads the run's checkpoints: leave out --no-ckpt"),
    (
        ["--data", "{corpus}", "--seq-len", "30000"],
        "--seq-len 30000: longer than the 20000 training",
    ),
    (
        ["--data", "{corpus}", "--batch-size", "64", "--seq-len", "64"],
        "--eval-every 100: the 1000 validation tokens hold no batch of --batch-size 64 x --seq-len",
    ),
    (["--steps", "6", "--profile", "2", "--profile-from", "7"], "--profile 2 from step 7: the run"),
    (
        ["--fp8", "--moe-impl", "dense"],
        "expected --moe-impl sluice, got --moe-impl dense",
    ),
    (["--fp8", "--no-sluice-gmm"], "--fp8: the experts' FP8 matmuls are sluice.gmm's; leave out"),
    (["--fp8-power-of-two-scales"], "--fp8-power-of-two-scales: scales of --fp8; add --fp8"),
    (["--no-fp8-dispatch"], "--no-fp8-dispatch: the dispatch of --fp8; add --fp8"),
    (
        ["--fp8", "--fp8-dispatch", "--no-sluice-dispatch"],
        "--fp8-dispatch: FP8 rows travel by sluice.ep's dispatch; leave out --no-sluice-dispatch",
    ),
]


@pytest.mark.parametrize("argv,expected", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_sluice_train_user_errors(tmp_path, capsys, argv, expected):
    from sluice.cli import train

    corpus = random_corpus(tmp_path / "corpus.npz", 1_000)
    np.savez(tmp_path / "no_arrays.npz", tokens=np.zeros(3))
    names = {"corpus": corpus, "no_arrays": str(tmp_path / "no_arrays.npz")}
    argv = [a.format(**names) for a in argv] + ["--out", str(tmp_path / "run"), "--no-progress"]
    line = one_line_error(capsys, train.main, argv)
    assert line.startswith("sluice-train: error: ") and expected in line, line


def test_sluice_train_more_devices_than_the_machine_has(tmp_path):
    """As a user runs it, on a machine of one device: the console's one line, no traceback."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run(
        [sys.executable, "-m", "sluice.cli.train", "--devices", "4", "--out", str(tmp_path)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "sluice-train: error: --devices 4: only 1 cpu device visible "
        "(XLA_FLAGS=--xla_force_host_platform_device_count=N makes N CPU devices)"
    )


def test_sluice_plot_user_errors(tmp_path, capsys):
    from sluice.cli import plot

    line = one_line_error(capsys, plot.main, [str(tmp_path / "nope")])
    assert line == f"sluice-plot: error: {tmp_path / 'nope'}: no such run directory (expected a " \
        "sluice-train --out directory)"  # fmt: skip
    line = one_line_error(capsys, plot.main, [str(tmp_path)])
    assert line == f"sluice-plot: error: {tmp_path}: no metrics.jsonl (expected a sluice-train " \
        "--out directory)"  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text('{"kind": "compile", "step": 1}\n')
    line = one_line_error(capsys, plot.main, [str(tmp_path)])
    assert line.endswith("metrics.jsonl: no training or validation records yet")
    line = one_line_error(capsys, plot.main, [str(tmp_path), "--labels", "a,b"])
    assert line == "sluice-plot: error: argument --labels: 2 labels for 1 runs, expected one each"
    line = one_line_error(capsys, plot.main, [str(tmp_path), "--out", "/nonexistent/x.png"])
    assert line == "sluice-plot: error: argument --out: /nonexistent is not a directory"


def test_sluice_prepare_data_user_errors(tmp_path, capsys, monkeypatch):
    from sluice.cli import prepare_data

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("some text " * 100)
    line = one_line_error(capsys, prepare_data.main, ["--out", "/nonexistent/dir/c.npz"])
    assert line == "sluice-prepare-data: error: argument --out: /nonexistent/dir is not a directory"
    line = one_line_error(capsys, prepare_data.main, ["--out", str(tmp_path)])
    assert line.endswith(f"argument --out: {tmp_path} is a directory, expected a file name")
    out = str(tmp_path / "c.npz")
    line = one_line_error(
        capsys, prepare_data.main, ["--out", out, "--sources", "python-docs,wiki"]
    )
    assert line.startswith("sluice-prepare-data: error: argument --sources: unknown source 'wiki'")
    line = one_line_error(
        capsys, prepare_data.main, ["--out", out, "--source", str(tmp_path / "x")]
    )
    assert line.endswith(f"argument --source: {tmp_path / 'x'} is not a directory")
    line = one_line_error(capsys, prepare_data.main, ["--out", out, "--vocab-size", "100"])
    assert line.endswith("argument --vocab-size: expected an integer from 258 to 65536, got '100'")
    (tmp_path / "empty").mkdir()
    line = one_line_error(
        capsys, prepare_data.main, ["--out", out, "--source", str(tmp_path / "empty")]
    )
    assert line == f"sluice-prepare-data: error: no *.txt documents under {tmp_path / 'empty'}"
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the bpe extra not installed
    argv = ["--out", out, "--source", str(docs), "--tokenizer", "bpe"]
    line = one_line_error(capsys, prepare_data.main, argv)
    assert line == (
        "sluice-prepare-data: error: --tokenizer bpe needs Hugging Face tokenizers, sluice's bpe "
        "extra: pip install 'sluice[bpe]' (or pip install tokenizers)"
    )


def test_sluice_profile_user_errors(tmp_path, capsys):
    from sluice.cli import profile

    line = one_line_error(capsys, profile.main, [str(tmp_path / "nope")])
    assert (
        line == f"sluice-profile: error: argument trace_dir: {tmp_path / 'nope'} is not a directory"
    )
    line = one_line_error(capsys, profile.main, [str(tmp_path)])
    assert line == (
        f"sluice-profile: error: {tmp_path}: no *.trace.json.gz under it (expected the profile "
        "directory of sluice-train --profile N, RUN_DIR/profile)"
    )
    line = one_line_error(capsys, profile.main, [str(tmp_path), "--steps", "0"])
    assert line == "sluice-profile: error: argument --steps: expected an integer >= 1, got '0'"

"""A run directory belongs to one run: a new run refuses one that holds a run, --overwrite clears
it, --resume checks the flags that define the run, and a run killed while it saves a checkpoint
resumes from the last finished one with its metrics rewound to it."""

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
from helpers import random_corpus, records

# sluice-train whose checkpoint of step 4 is killed (SIGKILL) once its files are written, before
# orbax renames its temporary directory into place
CRASH_AT_4 = """
import os, signal, sys
from orbax.checkpoint._src.path import atomicity

finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def crash_at_4(self, *args, **kwargs):
    if self._final_path.name == "4":
        os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = crash_at_4
from sluice.cli import train
train.main(sys.argv[1:])
"""


def tiny_run(corpus, out, *extra):
    flags = (
        "--preset tiny --moe-impl sluice --steps 6 --warmup 1 --batch-size 4 --seq-len 16 "
        "--n-layers 1 --devices 1 --eval-every 0 --log-every 1 --ckpt-every 2 --no-progress"
    )
    return flags.split() + ["--data", corpus, "--out", out, *extra]


def one_line_error(capsys, main, argv):
    """The one line a user error prints (exit code 2, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


def test_killed_mid_save_resumes_from_the_last_checkpoint(tmp_path, capsys):
    from sluice.cli import train

    corpus = random_corpus(tmp_path / "small.npz", 1_000)
    out = str(tmp_path / "run")
    argv = tiny_run(corpus, out)
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_AT_4, *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    ckpt = sorted(os.listdir(os.path.join(out, "ckpt")))
    assert "2" in ckpt and "4" not in ckpt and any(".orbax-checkpoint-tmp" in d for d in ckpt)
    before = {r["step"]: r["loss"] for r in records(out, "train")}
    assert sorted(before) == [2, 3, 4]
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # a line the crash cut short

    train.main(argv + ["--resume"])
    assert "resumed from step 2" in capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["4", "6"]  # the unfinished one gone
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    # the records past step 2 written again, once: step 3 is the resumed run's compiling step
    assert [(r["kind"], r["step"]) for r in recs] == [
        ("compile", 1), ("train", 2), ("compile", 3), ("train", 4), ("train", 5), ("train", 6)
    ]  # fmt: skip
    assert recs[3]["loss"] == pytest.approx(before[4], abs=1e-5)
    assert recs[-1]["train_time"] > recs[1]["train_time"]

    # the directory holds a run: a new one is refused, a resume must keep the run's flags
    line = one_line_error(capsys, train.main, argv)
    assert line.startswith(f"sluice-train: error: --out {out} holds a run (config.json, ")
    line = one_line_error(capsys, train.main, argv + ["--resume", "--steps", "8"])
    assert "--resume: --steps is 8 here but 6 in the run" in line
    line = one_line_error(capsys, train.main, argv + ["--resume", "--seed", "1"])
    assert "--resume: --seed is 1 here but 0 in the run" in line
    other = random_corpus(tmp_path / "other.npz", 2_000)
    line = one_line_error(capsys, train.main, tiny_run(other, out, "--resume"))
    assert "--resume: --data is 20000+2000 tokens of 259 (crc32 " in line
    # bookkeeping may change: a finished run resumed with other logging runs no step
    assert train.run(argv + ["--resume", "--log-every", "3", "--ckpt-every", "0"])["steps"] == 6

    # --overwrite deletes the run (and nothing else in the directory) and starts again
    (tmp_path / "run" / "notes.txt").write_text("mine")
    train.main(tiny_run(corpus, out, "--overwrite", "--no-ckpt"))
    assert not os.path.exists(os.path.join(out, "ckpt"))
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert [r["step"] for r in records(out, "train")] == [2, 3, 4, 5, 6]
    line = one_line_error(capsys, train.main, argv + ["--resume"])
    assert "--resume: the run in" in line and "has no finished checkpoint" in line

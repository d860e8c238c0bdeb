"""sluice-train --profile and sluice-profile: traced steps are summarised by category and by op,
named after their source, and left out of the training log."""

import os

import pytest

pytest.importorskip("flax")
from helpers import random_corpus, records


def test_profile_traces_steps_and_leaves_them_out_of_the_log(tmp_path):
    """--profile 2: the two steps after the compiling one are traced, summarised by sluice-profile
    (the CPU runtime's op time, by category and by op), and not logged as training steps."""
    from sluice.cli import profile, train

    corpus = random_corpus(tmp_path / "small.npz", 1_000)
    out = str(tmp_path / "run")
    flags = (
        "--preset tiny --moe-impl sluice --steps 5 --warmup 1 --batch-size 4 --seq-len 16 "
        "--n-layers 2 --devices 1 --no-progress --no-ckpt --eval-every 0 --log-every 1 --profile 2"
    )
    train.main(flags.split() + ["--data", corpus, "--out", out])
    assert [r["step"] for r in records(out, "train")] == [4, 5]
    with open(os.path.join(out, "profile", "summary.txt")) as f:
        text = f.read()
    assert "op time:" in text and "(2 steps)" in text
    rows, where = profile.op_events(profile.trace_file(os.path.join(out, "profile")))
    assert where == "host" and len(rows) > 10 and sum(r[1] for r in rows) > 0
    # busy time: the union of each process's op intervals (overlaps counted once)
    assert 0 < profile.busy_us(rows) <= sum(r[1] for r in rows) + 1e-6
    assert profile.busy_us([("a", 4.0, 0, 0.0), ("b", 4.0, 0, 2.0), ("c", 1.0, 1, 0.0)]) == 7.0
    assert "ops overlapping on several streams" in text
    # the same summary from the trace again, its op table the ops that took the most time first
    assert text == profile.summarize(os.path.join(out, "profile"), steps=2)
    table = text.split("op / kernel\n")[1].splitlines()
    times = [float(line.split()[0]) for line in table]
    assert len(times) > 5 and times == sorted(times, reverse=True)
    # ops named after their source through the step's optimised HLO (hlo.txt beside the trace)
    assert os.path.exists(os.path.join(out, "profile", "hlo.txt"))
    assert any(" <- " in line and ".py:" in line for line in table)
    assert profile.category("sluice_cuda::sm90::gmm_kernel<bf16>") == "sluice"
    assert profile.category("nvjet_sm90_tst_192x192") == "gemm"
    assert profile.category("loop_multiply_fusion") == "other fusion"
    # --profile-from 3: steps 3 and 4 traced, the steps before and after logged
    out = str(tmp_path / "later")
    flags = flags.replace("--steps 5", "--steps 6") + " --profile-from 3"
    train.main(flags.split() + ["--data", corpus, "--out", out])
    assert [r["step"] for r in records(out, "train")] == [2, 3, 6]
    with open(os.path.join(out, "profile", "summary.txt")) as f:
        assert "(2 steps)" in f.read()
    with pytest.raises(train.UsageError, match="--profile 2 from step 7: the run ends at step 6"):
        train.run(
            flags.replace("-from 3", "-from 7").split() + ["--data", corpus, "--out", out + "2"]
        )

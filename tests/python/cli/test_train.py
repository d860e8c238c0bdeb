"""sluice-train end to end on CPU devices: a few steps of the tiny preset lower the loss on real
text (data and expert parallel, with fsdp, bf16 moments, gradient accumulation and remat), a
checkpointed run resumes to the same result, evaluation fits the validation stream, the ep rows
bound stops a run that would drop, and the flags override the preset."""

import glob
import gzip
import os
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from helpers import random_corpus, records
from sluice.nn.model import PRESETS
from sluice.training import data

HAVE_DOCS = bool(glob.glob(data.SOURCE_GLOB))


@pytest.mark.skipif(not HAVE_DOCS, reason=f"corpus not installed: {data.APT_HINT}")
@pytest.mark.parametrize(
    "fsdp,states,accum",
    [(False, "float32", 1), (True, "float32", 1), (False, "bfloat16", 1), (True, "float32", 2)],
    ids=["ep", "ep+fsdp", "ep+bf16-moments", "ep+fsdp+grad-accum+remat"],
)
def test_training_lowers_loss_and_resumes_exactly(tmp_path, fsdp, states, accum):
    """Eight steps of a two-layer tiny model, data- and expert-parallel over four CPU devices with
    the sluice path (with fsdp: expert weights and their optimizer state also split over the data
    axis; bf16-moments: AdamW's moments kept in bfloat16; grad-accum+remat: each step's
    batch in two micro-batches, every block recomputed in the backward pass); then the run is
    resumed from its step-4 checkpoint and must end on the same loss."""
    from sluice.cli import train

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    corpus = data.prepare_data(str(tmp_path / "corpus.npz"))
    out = str(tmp_path / "run")
    argv = [
        "--preset",
        "tiny",
        "--moe-impl",
        "sluice",
        "--steps",
        "8",
        "--warmup",
        "2",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--n-layers",
        "2",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--log-every",
        "1",
        "--devices",
        "4",
        "--ep",
        "2",
        "--data",
        corpus,
        "--out",
        out,
        "--no-progress",
    ]
    if fsdp:
        argv.insert(0, "--fsdp")
    argv[:0] = ["--opt-state-dtype", states, "--grad-accum", str(accum)]
    if accum > 1:
        argv.insert(0, "--remat")
    train.main(argv)
    steps = records(out, "train")
    assert [r["step"] for r in steps] == list(range(2, 9))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    evals = records(out, "eval")
    assert [r["step"] for r in evals] == [4, 8] and evals[1]["val_loss"] < evals[0]["val_loss"]
    for r in steps:
        assert r["dropped"] == 0.0 and r["tgs"] > 0
        # CPUs: no peak FLOP/s nor device memory statistics; the process's peak resident set
        assert r["mfu"] is None and r["peak_mem_gb"] is None and r["peak_host_mem_gb"] > 0.05
        assert np.asarray(r["load"]).shape == (1, 16) and sum(r["load"][0]) == 8 * 64 * 4

    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    shutil.rmtree(os.path.join(resumed, "ckpt", "8"))
    train.main(argv[:-2] + [resumed, "--no-progress", "--resume"])
    again = records(resumed, "train")
    assert [r["step"] for r in again] == [
        2,
        3,
        4,
        6,
        7,
        8,
    ]  # step 5, the first after resuming, compiles
    assert again[-1]["loss"] == pytest.approx(steps[-1]["loss"], abs=1e-5)
    assert records(resumed, "eval")[-1]["val_loss"] == pytest.approx(
        evals[-1]["val_loss"], abs=1e-5
    )

    pytest.importorskip("matplotlib")
    from sluice.cli import plot

    png = str(tmp_path / "loss.png")
    plot.main([out, resumed, "--out", png, "--labels", "straight,resumed"])
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    plain = plot.read_run(resumed)  # bench/results keeps long runs' metrics gzipped
    metrics = os.path.join(resumed, "metrics.jsonl")
    with open(metrics, "rb") as f, gzip.open(metrics + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(metrics)
    assert plot.read_run(resumed) == plain and plain["eval"]


def test_training_fits_evaluation_to_the_validation_stream(tmp_path, capsys):
    """A batch too large for the validation stream: with --eval-every 0 no validation windows are
    needed at all; with evaluation on, only as many batches as the stream holds are used."""
    from sluice.cli import train

    corpus = random_corpus(tmp_path / "small.npz", 1_000)
    common = [
        "--preset",
        "tiny",
        "--moe-impl",
        "sluice",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--seq-len",
        "16",
        "--n-layers",
        "1",
        "--devices",
        "1",
        "--data",
        corpus,
        "--no-progress",
        "--no-ckpt",
        "--log-every",
        "1",
    ]
    # 128 windows of 17 tokens: more than the 1,000 validation tokens
    train.main(common + ["--batch-size", "128", "--eval-every", "0", "--out", str(tmp_path / "a")])
    assert [r["step"] for r in records(str(tmp_path / "a"), "train")] == [2]
    # 8 windows of 17: 7 batches fit of the 8 asked for
    train.main(
        common
        + [
            "--batch-size",
            "8",
            "--eval-every",
            "2",
            "--eval-batches",
            "8",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert "evaluating on 7 batches" in capsys.readouterr().err
    assert [r["step"] for r in records(str(tmp_path / "b"), "eval")] == [2]


def test_ep_rows_bound_overflows_into_rounds_and_says_so(tmp_path):
    """sluice path over sluice.ep: a bound below the routing runs more exchange rounds (metrics.jsonl
    says how many, nothing dropped) and trains to the worst-case path's losses."""
    import json

    from sluice.cli import train

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    corpus = random_corpus(tmp_path / "small.npz", 2_000)
    argv = [
        "--preset",
        "tiny",
        "--moe-impl",
        "sluice",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--n-layers",
        "2",
        "--devices",
        "2",
        "--ep",
        "2",
        "--data",
        corpus,
        "--no-progress",
        "--no-ckpt",
        "--eval-every",
        "0",
        "--log-every",
        "1",
    ]
    runs = {"worst": ["--ep-worst-case"], "fits": [], "rounds": ["--ep-rows-factor", "0.05"]}
    recs = {}
    for name, flags in runs.items():
        train.main(argv + flags + ["--out", str(tmp_path / name)])
        with open(tmp_path / name / "metrics.jsonl") as f:
            lines = [json.loads(line) for line in f]
        recs[name] = [r for r in lines if r["kind"] == "train"]
    for name in runs:
        assert all(r["dropped"] == 0.0 for r in recs[name])
        assert all(r["ep_peak_expert_rows"] > 0 for r in recs[name])
    assert all(r["ep_rounds"] == 1 for r in recs["worst"] + recs["fits"])
    assert all(r["ep_rounds"] > 1 for r in recs["rounds"])
    for name in ("fits", "rounds"):
        for a, b in zip(recs[name], recs["worst"]):
            assert a["ep_peak_recv_rows"] == b["ep_peak_recv_rows"]
            assert abs(a["loss"] - b["loss"]) < 1e-5 * abs(b["loss"])


def test_router_and_shared_expert_flags_override_the_preset():
    from sluice.cli import train
    from sluice.nn.model import BIAS_UPDATE_RATE

    cfg, _ = train.build_config(train.parse_args(["--preset", "dsv3-proxy"]))
    small = PRESETS["small"]["model"].moe
    assert cfg.moe.bias_update_rate == BIAS_UPDATE_RATE == small.bias_update_rate
    assert cfg.moe.aux_loss_coef == PRESETS["dsv3-proxy"]["model"].moe.aux_loss_coef
    argv = ["--preset", "small", "--bias-update-rate", "0", "--aux-loss-coef", "0.003"]
    cfg, _ = train.build_config(train.parse_args(argv + ["--shared-experts", "0"]))
    assert cfg.moe.bias_update_rate == 0.0 and cfg.moe.aux_loss_coef == 0.003
    assert small.num_shared_experts == 1 and cfg.moe.num_shared_experts == 0
    with pytest.raises(SystemExit):  # (test_errors: the flags' ranges)
        train.parse_args(["--preset", "small", "--shared-experts", "-1"])
    assert cfg.active_params() == PRESETS["small"]["model"].active_params() - 3 * 512 * 256 * 7
    tiny, _ = train.build_config(train.parse_args(["--preset", "tiny"]))
    assert tiny.moe.aux_loss_coef == PRESETS["tiny"]["model"].moe.aux_loss_coef > 0


def test_fp8_trains_over_expert_parallelism_and_resumes_only_in_fp8(tmp_path, capsys):
    """--fp8 with the experts split over 2 CPU devices (sluice.ep, FP8 dispatch by default): three
    steps log finite losses; config.json records both, and --resume refuses to drop either."""
    import json

    from sluice.cli import train

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    out = str(tmp_path / "run")
    argv = ["--preset", "tiny", "--steps", "3", "--warmup", "1", "--batch-size", "4",
            "--seq-len", "32", "--n-layers", "2", "--devices", "2", "--ep", "2",
            "--data", random_corpus(tmp_path / "c.npz", 2_000), "--no-progress",
            "--eval-every", "0", "--log-every", "1", "--out", out]  # fmt: skip
    train.main(argv + ["--fp8"])
    losses = [r["loss"] for r in records(out, "compile") + records(out, "train")]
    assert len(losses) == 3 and np.isfinite(losses).all()
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["run"]["--fp8"] is True and config["model"]["fp8"] is not None
    assert config["run"]["--fp8-dispatch"] is True and config["model"]["moe"]["fp8_dispatch"]
    assert "sluice.gmm in FP8" in config["moe_path"] and "FP8 dispatch" in config["moe_path"]
    for flags, err in (
        ([], "--resume: --fp8 is None here but True in the run"),
        (["--fp8", "--no-fp8-dispatch"], "--resume: --fp8-dispatch is None here but True in the"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            train.main(argv + flags + ["--resume"])
        assert err in capsys.readouterr().err
    cfg, _ = train.build_config(train.parse_args(["--fp8", "--no-fp8-dispatch"]))
    assert cfg.fp8 is not None and not cfg.moe.fp8_dispatch

"""A sluice-train run directory, which belongs to one run: its config.json, metrics.jsonl, orbax
checkpoints (ckpt/<step>) and profile.

- A new run refuses a directory that holds a run, unless --overwrite clears it first.
- --resume needs a finished checkpoint, and the flags that define the run (``identity``: model,
  data, schedule with its length, seed) must be the ones the run was started with.
- A checkpoint is written to a temporary directory that orbax renames to ``ckpt/<step>`` when it is
  complete, so a crash mid-save leaves the previous one; resuming reads finished steps only, removes
  unfinished ones, and drops the metrics past the restored step (and a line cut short by a crash).
- config.json and a resumed metrics.jsonl are replaced atomically (written beside, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil

from .usage import UsageError

CONFIG, METRICS, CKPT, PROFILE = "config.json", "metrics.jsonl", "ckpt", "profile"
RUN_FILES = (CONFIG, METRICS, CKPT)  # any of these: the directory holds a run
OWNED = (*RUN_FILES, PROFILE)  # what --overwrite deletes (nothing else in the directory)


def finished_steps(out: str) -> list[int]:
    """The steps of the complete checkpoints under out/ckpt (orbax names an unfinished one
    '<step>.orbax-checkpoint-tmp...': never a step)."""
    ckpt = os.path.join(out, CKPT)
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())


def start_step(out: str, resume: bool, overwrite: bool) -> int:
    """The step the run in `out` starts from: the latest finished checkpoint's when resuming, else
    0. Changes nothing; raises UsageError for a directory that holds a run (without resume or
    overwrite) and for a resume with nothing to resume."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out}: a file, expected a directory")
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(out, n))]
    if resume:
        if not present:
            raise UsageError(f"--resume: no run in {out} (no {', '.join(RUN_FILES)})")
        steps = finished_steps(out)
        if not steps:
            raise UsageError(
                f"--resume: the run in {out} has no finished checkpoint; start it again with "
                "--overwrite"
            )
        return steps[-1]
    if present and not overwrite:
        raise UsageError(
            f"--out {out} holds a run ({', '.join(present)}): --resume continues it, --overwrite "
            "deletes it and starts again, or choose another --out"
        )
    return 0


def prepare(out: str, overwrite: bool) -> None:
    """Creates `out`; with overwrite, first deletes the run there (OWNED, nothing else)."""
    for name in OWNED if overwrite else ():
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create it ({e.strerror})") from None


def identity(a, cfg, hp, data) -> dict:
    """What defines the run, by the flag that sets it (resolved against the preset): resuming with
    any of these changed would train another model. The layout (devices, --ep, --fsdp, remat,
    micro-batches) and the bookkeeping (logging, evaluation, checkpoints, progress) may change."""
    return {
        "--preset": a.preset,
        "--moe-impl": a.moe_impl,
        "--capacity-factor": cfg.moe.capacity_factor if a.moe_impl == "dense" else None,
        "--seed": a.seed,
        "--steps": hp["steps"],
        "--batch-size": hp["batch_size"],
        "--seq-len": hp["seq_len"],
        "--lr": hp["lr"],
        "--warmup": hp["warmup"],
        "--opt-state-dtype": hp["opt_state_dtype"],
        "--n-layers": cfg.n_layers,
        "--bias-update-rate": cfg.moe.bias_update_rate,
        "--aux-loss-coef": cfg.moe.aux_loss_coef,
        "--shared-experts": cfg.moe.num_shared_experts,
        # None when off, so that a run from before these flags resumes as a bf16 run
        "--fp8": True if cfg.fp8 else None,
        "--fp8-power-of-two-scales": True if cfg.fp8 and cfg.fp8.power_of_two_scales else None,
        # a run from before the flag sent bf16 rows: it resumes with --no-fp8-dispatch
        "--fp8-dispatch": True if cfg.fp8 and cfg.moe.fp8_dispatch else None,
        "--data": data.fingerprint(),
    }


def check_resume(out: str, run: dict) -> None:
    """Raises UsageError naming the first flag whose value differs from the one the run in `out`
    was started with (its config.json)."""
    path = os.path.join(out, CONFIG)
    try:
        with open(path) as f:
            saved = json.load(f)["run"]
    except (OSError, ValueError, KeyError):
        raise UsageError(
            f"--resume: {path} is missing or unreadable, so the run's flags cannot be checked; "
            "start it again with --overwrite"
        ) from None
    for flag, value in run.items():
        if saved.get(flag) != value:
            raise UsageError(
                f"--resume: {flag} is {value} here but {saved.get(flag)} in the run in {out}; "
                f"resume with the run's {flag}, or start a new run (--overwrite or another --out)"
            )


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_config(out: str, info: dict) -> None:
    _write_atomically(os.path.join(out, CONFIG), json.dumps(info, indent=1))


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; a line a crash cut short is left out."""
    if not os.path.exists(path):
        return []
    recs = []
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    return recs


def rewind_metrics(out: str, step: int) -> float:
    """Drops the records past `step` (the resumed run writes them again) and returns the training
    time the run had recorded by then."""
    path = os.path.join(out, METRICS)
    recs = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    _write_atomically(path, "".join(json.dumps(r) + "\n" for r in recs))
    train = [r for r in recs if r.get("kind") == "train"]
    return train[-1]["train_time"] if train else 0.0


def checkpoints(out: str):
    """The run's orbax CheckpointManager (the two latest kept; synchronous saves, each renamed into
    place when complete; unfinished ones from a crash deleted on opening)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.join(out, CKPT),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
        ),
    )  # fmt: skip

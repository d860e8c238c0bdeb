"""sluice-train: train sluice.nn.model's MoE decoder LM on real text with one of three expert paths.

    sluice-train --preset tiny --moe-impl sluice --steps 300 --out runs/tiny-sluice

Data and expert parallelism over every visible device (``--ep N`` experts split over N devices, the
batch over all of them). Every ``--log-every`` steps one JSON line in ``OUT/metrics.jsonl``: loss,
tokens/s per device (TGS), MFU (model FLOPs: 6 x active parameters x tokens + causal attention, over
the device's dense bf16 peak; null where the peak is unknown, e.g. CPUs), dropped-token fraction,
per-expert load and its spread, peak device memory (``peak_mem_gb``, null where the device keeps no
statistics, e.g. CPUs) and the process's peak resident set (``peak_host_mem_gb``); validation loss
every ``--eval-every`` steps (per token, and in bits per byte of text: comparable across
tokenizers); an orbax checkpoint every ``--ckpt-every`` steps. The run directory belongs to one run
(``run_dir``): ``--resume`` continues it from its latest checkpoint, ``--overwrite`` starts again.
Batches depend only on (seed, step), so a resumed run trains on the same data as an uninterrupted
one. A token file of BPE tokens (``sluice-prepare-data --tokenizer bpe``) sets the model's
vocabulary (rounded up to 64).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:  # the train extra: a missing package is one line, not a traceback
    import flax  # noqa: F401
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import tqdm  # noqa: F401
except ImportError as e:
    print(f"sluice-train: error: {e.name} is missing: pip install 'sluice[train]'", file=sys.stderr)
    sys.exit(2)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..training.data import TokenData
from ..training.optim import make_optimizer
from ..training.step import (
    DATA_AXIS,
    EXPERT_AXIS,
    compute_copies,
    init_state,
    make_mesh,
    make_steps,
    shardings_for,
)
from . import run_dir
from .profile import summarize as profile_summary
from .train_args import build_config, parse_args, run_name
from .usage import UsageError, command

__all__ = ["build_config", "main", "parse_args", "run", "run_name"]

BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12}


def peak_flops(device) -> float | None:
    """Dense bf16 peak of one device, or None where unknown (CPUs: MFU is reported as null)."""
    if device.platform == "cpu":
        return None
    for name, peak in BF16_PEAK.items():
        if name in device.device_kind:
            return peak
    return None


def peak_memory_bytes(devices) -> int | None:
    peaks = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def peak_host_memory_bytes() -> int:
    """The process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def load_stats(load: np.ndarray) -> dict:
    """load [L_moe, E] token copies per expert -> its spread: max/mean (1 = balanced) and the
    coefficient of variation."""
    mean = load.mean(axis=1, keepdims=True)
    return {
        "load_max_over_mean": float((load.max(axis=1, keepdims=True) / mean).max()),
        "load_cv": float((load.std(axis=1, keepdims=True) / mean).mean()),
    }


@command("sluice-train")
def main(argv=None) -> int:
    """The `sluice-train` console script: trains, prints a summary line, exits 0; a user error is
    one line and exit code 2."""
    run(argv)
    return 0


def make_mesh_for(a, hp, cfg):
    """The (data, expert) mesh of --devices and --ep; UsageError naming the flag where they do not
    fit the machine, the experts or the batch."""
    visible = jax.devices()
    if a.devices and a.devices > len(visible):
        hint = (
            " (XLA_FLAGS=--xla_force_host_platform_device_count=N makes N CPU devices)"
            if visible[0].platform == "cpu"
            else ""
        )
        raise UsageError(
            f"--devices {a.devices}: only {_count(len(visible), visible[0].platform + ' device')} "
            f"visible{hint}"
        )
    n_dev, ep, experts = a.devices or len(visible), hp["ep"], cfg.moe.num_experts
    which = "--ep" if a.ep else f"--preset {a.preset}'s --ep"
    if n_dev % ep:
        raise UsageError(f"{which} {ep}: expected a divisor of the {_count(n_dev, 'device')}")
    if experts % ep:
        raise UsageError(f"{which} {ep}: expected a divisor of the model's {experts} experts")
    per = n_dev * a.grad_accum
    if hp["batch_size"] % per:
        raise UsageError(
            f"--batch-size {hp['batch_size']}: expected a multiple of the {_count(n_dev, 'device')}"
            + (f" times --grad-accum {a.grad_accum}" if a.grad_accum > 1 else "")
        )
    return make_mesh(ep, n_dev)


def load_data(path):
    """The token file (or the default corpus); UsageError where it is missing or not one."""
    if path is not None and not os.path.isfile(path):
        raise UsageError(
            f"--data {path}: no such file (expected a token file from sluice-prepare-data)"
        )
    try:
        return TokenData.load(path)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise UsageError(f"--data {e}" if path else str(e)) from None


def check_profile(a, start, steps):
    """The steps --profile traces (after the compiling one): [begin, end), or None."""
    if not a.profile:
        return None, None
    begin = max(start + 1, a.profile_from)
    end = min(begin + a.profile, steps)
    if begin >= end:
        raise UsageError(f"--profile {a.profile} from step {begin}: the run ends at step {steps}")
    return begin, end


def run(argv=None) -> dict:
    """Trains as `sluice-train` would with these arguments; returns the run's summary."""
    a = parse_args(argv)
    cfg, hp = build_config(a)
    out = os.path.abspath(a.out or os.path.join("runs", run_name(a)))
    if a.resume and a.no_ckpt:
        raise UsageError("--resume reads the run's checkpoints: leave out --no-ckpt")
    # every check before the run directory changes (--overwrite deletes the run there)
    start = run_dir.start_step(out, a.resume, a.overwrite)
    profile_start, profile_end = check_profile(a, start, hp["steps"])
    mesh = make_mesh_for(a, hp, cfg)
    devices = list(mesh.devices.flat)
    n_dev, accum = len(devices), a.grad_accum
    data = load_data(a.data)
    if data.vocab_size > cfg.vocab_size:  # a BPE token file: the model's vocabulary from it
        cfg = dataclasses.replace(cfg, vocab_size=-(-data.vocab_size // 64) * 64)
    bsz, seq = hp["batch_size"], hp["seq_len"]
    if len(data.train) <= seq + 1:
        raise UsageError(f"--seq-len {seq}: longer than the {len(data.train)} training tokens")
    val = []
    if a.eval_every:
        # as many of --eval-batches as the validation stream holds (a large batch can outgrow it)
        fit = len(data.val) // (bsz * (seq + 1))
        if not fit:
            raise UsageError(
                f"--eval-every {a.eval_every}: the {len(data.val)} validation tokens hold no batch "
                f"of --batch-size {bsz} x --seq-len {seq} (+1); a smaller batch, or --eval-every 0"
            )
        if fit < a.eval_batches:
            print(
                f"sluice-train: evaluating on {fit} batches, all the validation stream holds",
                file=sys.stderr,
            )
        val = data.val_batches(min(a.eval_batches, fit), bsz, seq)
        # val_bpb = val_loss / this: bits per byte of text, comparable across tokenizers
        ln2_bytes_per_token = math.log(2) * data.bytes_per_token([b[:, 1:] for b in val])
    run_id = run_dir.identity(a, cfg, hp, data)
    if a.resume:
        run_dir.check_resume(out, run_id)
    run_dir.prepare(out, a.overwrite)

    opt, schedule = make_optimizer(hp)
    graphdef, state, state_sh, moe_path = init_state(cfg, opt, mesh, a.seed)
    batch_sh = NamedSharding(mesh, P((DATA_AXIS, EXPERT_AXIS)))

    train_step, eval_step = make_steps(
        graphdef,
        opt,
        cfg,
        grad_accum=accum,
        micro_sharding=NamedSharding(mesh, P(None, (DATA_AXIS, EXPERT_AXIS))),
        grad_shardings=state_sh["params"],
    )
    sh = (state_sh["params"], state_sh["rest"], state_sh["opt_state"])
    use_copies = a.weight_copies and jnp.dtype(cfg.dtype) != jnp.float32
    copies_sh = None
    if use_copies:  # the copies split as their parameters are
        copies_sh = shardings_for(
            jax.eval_shape(lambda p: compute_copies(p, cfg.dtype), state["params"]), mesh, cfg.moe
        )
        make_copies = jax.jit(
            lambda p: compute_copies(p, cfg.dtype),
            in_shardings=(state_sh["params"],),
            out_shardings=copies_sh,
        )
    train_step = jax.jit(
        train_step,
        in_shardings=(*sh, batch_sh, copies_sh),
        out_shardings=(*sh, copies_sh, None),
        donate_argnums=(0, 1, 2, 4),
    )
    eval_step = jax.jit(eval_step, in_shardings=(sh[0], sh[1], batch_sh, copies_sh))

    ckpt = None if a.no_ckpt else run_dir.checkpoints(out)
    train_time = 0.0
    metrics_path = os.path.join(out, run_dir.METRICS)
    if a.resume:
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_sh
        )
        state = ckpt.restore(start, args=ocp.args.StandardRestore(abstract))
        train_time = run_dir.rewind_metrics(out, start)
        print(f"resumed from step {start} of {out}/ckpt", file=sys.stderr)

    peak = peak_flops(devices[0])
    flops_tok = cfg.flops_per_token(seq)
    info = {
        "run": run_id,
        "args": vars(a),
        "hp": hp,
        "model": _jsonable(dataclasses.asdict(cfg)),
        "active_params": cfg.active_params(),
        "total_params": cfg.total_params(),
        "flops_per_token": flops_tok,
        "devices": n_dev,
        "device_kind": devices[0].device_kind,
        "mesh": dict(mesh.shape),
        "moe_path": moe_path,
        "jax": jax.__version__,
    }
    run_dir.write_config(out, info)
    print(
        f"{run_name(a)}: {cfg.total_params() / 1e6:.1f}M params "
        f"({cfg.active_params() / 1e6:.1f}M active), "
        f"{n_dev} x {devices[0].device_kind}, mesh {dict(mesh.shape)}, {bsz}x{seq} tokens/step"
        + (f" in {accum} micro-batches" if accum > 1 else "")
        + f", MoE {moe_path} -> {out}",
        file=sys.stderr,
    )

    log = open(metrics_path, "a")  # noqa: SIM115 (open for the whole loop, closed at its end)

    def emit(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    def evaluate(step):
        losses = [
            eval_step(state["params"], state["rest"], jax.device_put(b, batch_sh), copies)
            for b in val
        ]
        v = float(np.mean(jax.device_get(losses)))
        bpb = v / ln2_bytes_per_token
        emit(
            {"kind": "eval", "step": step, "val_loss": v, "val_bpb": bpb, "train_time": train_time}
        )
        return v

    # the parameters' compute-dtype copies: made from the state here, by each step after
    copies = make_copies(state["params"]) if use_copies else None

    def step_once(step):
        nonlocal state, copies
        tokens = jax.device_put(data.batch(step, bsz, seq, a.seed), batch_sh)
        p, r, o, copies, m = train_step(
            state["params"], state["rest"], state["opt_state"], tokens, copies
        )
        state = {"params": p, "rest": r, "opt_state": o}
        return m

    bar = None
    if not a.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=hp["steps"], initial=start, dynamic_ncols=True, desc=run_name(a))
    ckpt_every = a.ckpt_every if a.ckpt_every is not None else a.eval_every
    step, val_loss = start, None
    # sluice.ep's rounds and peak rows: the most of any step since the last log (on device)
    ep_most = jnp.zeros((3,), jnp.float32)
    # The first step compiles: timed apart, never counted in TGS.
    if step < hp["steps"]:
        t0 = time.perf_counter()
        m = jax.device_get(step_once(step))
        ep_most = jnp.maximum(ep_most, m["ep"])
        compile_s = time.perf_counter() - t0
        step += 1
        emit({"kind": "compile", "step": step, "seconds": compile_s, "loss": float(m["loss"])})
        if bar:
            bar.update(1)
    window_start, window_steps = time.perf_counter(), 0
    prof_dir = os.path.join(out, run_dir.PROFILE)
    profiling = False
    while step < hp["steps"]:
        if step == profile_start:
            jax.block_until_ready(state)  # the steps before run outside the trace
            profile_steps, profiling = profile_end - step, True
            jax.profiler.start_trace(prof_dir)
        m = step_once(step)
        ep_most = jnp.maximum(ep_most, m["ep"])
        step += 1
        window_steps += 1
        if step == profile_end:
            jax.block_until_ready(m)
            jax.profiler.stop_trace()
            train_time += time.perf_counter() - window_start
            # the step's optimised HLO (from the compilation cache), for sluice-profile to name
            # each fusion kernel's source
            tokens = jax.device_put(data.batch(step, bsz, seq, a.seed), batch_sh)
            lowered = train_step.lower(
                state["params"], state["rest"], state["opt_state"], tokens, copies
            )
            with open(os.path.join(prof_dir, "hlo.txt"), "w") as f:
                f.write(lowered.compile().as_text())
            summary_txt = profile_summary(prof_dir, steps=profile_steps)
            with open(os.path.join(prof_dir, "summary.txt"), "w") as f:
                f.write(summary_txt)
            print(summary_txt, file=sys.stderr)
            # the next window starts here: reading the trace is in neither TGS nor train_time
            window_start, window_steps, profiling = time.perf_counter(), 0, False
        do_eval = a.eval_every and (step % a.eval_every == 0 or step == hp["steps"])
        do_ckpt = ckpt and (step == hp["steps"] or (ckpt_every and step % ckpt_every == 0))
        # no record while profiling, nor for the empty window the profiled steps leave
        logs = step % a.log_every == 0 or step == hp["steps"] or do_eval or do_ckpt
        if logs and window_steps and not profiling:
            m, ep_seen = jax.device_get((m, ep_most))  # the only host sync of the loop
            ep_most = jnp.zeros((3,), jnp.float32)
            dt = time.perf_counter() - window_start
            train_time += dt
            tokens = window_steps * bsz * seq
            rec = {
                "kind": "train",
                "step": step,
                "loss": float(m["loss"]),
                "aux_loss": float(m["aux_loss"]),
                "grad_norm": float(m["grad_norm"]),
                "lr": float(schedule(step - 1)),
                "dropped": float(m["dropped"]),
                # sluice.ep (0 elsewhere): the most exchange rounds of an MoE layer in a step since
                # the last record (1: no rank overflowed its bound), and the most rows and (row,
                # slot) pairs one rank received in such a layer
                "ep_rounds": int(ep_seen[0]),
                "ep_peak_recv_rows": int(ep_seen[1]),
                "ep_peak_expert_rows": int(ep_seen[2]),
                **load_stats(np.asarray(m["load"])),
                "step_time": dt / window_steps,
                "tgs": tokens / dt / n_dev,
                "mfu": flops_tok * tokens / dt / (peak * n_dev) if peak else None,
                "peak_mem_gb": _gb(peak_memory_bytes(devices)),
                "peak_host_mem_gb": _gb(peak_host_memory_bytes()),
                "train_time": train_time,
                "load": np.asarray(m["load"]).astype(int).tolist(),
            }
            emit(rec)
            if bar:
                bar.set_postfix(
                    loss=f"{rec['loss']:.3f}",
                    tgs=f"{rec['tgs']:.0f}",
                    drop=f"{rec['dropped']:.3f}",
                    val=f"{val_loss:.3f}" if val_loss else "-",
                )
            window_start, window_steps = None, 0
        if bar:
            bar.update(1)
        if do_eval:
            val_loss = evaluate(step)
        if do_ckpt:
            ckpt.save(step, args=ocp_save(state))
        if window_start is None:
            window_start = time.perf_counter()
    if bar:
        bar.close()
    if ckpt:
        ckpt.wait_until_finished()
    log.close()
    summary = {"run": run_name(a), "steps": step, "val_loss": val_loss, "out": out}
    print(json.dumps(summary), file=sys.stderr)
    return summary


def ocp_save(state):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(state)


def _count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _gb(b):
    return None if b is None else round(b / 2**30, 3)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


if __name__ == "__main__":
    raise SystemExit(main())

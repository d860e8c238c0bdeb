"""sluice-train: train sluice.nn.model's MoE decoder LM on real text with one of three expert paths.

    sluice-train --preset tiny --moe-impl sluice --steps 300 --out runs/tiny-sluice

Data and expert parallelism over every visible device (``--ep N`` experts split over N devices, the
batch over all of them). Every ``--log-every`` steps one JSON line in ``OUT/metrics.jsonl``: loss,
tokens/s per device (TGS), MFU (model FLOPs: 6 x active parameters x tokens + causal attention, over
the device's dense bf16 peak; 'n/a' where the peak is unknown, e.g. CPUs), dropped-token fraction,
per-expert load and its spread, peak device memory; validation loss every ``--eval-every`` steps
(per token, and in bits per byte of text: comparable across tokenizers); an orbax checkpoint every
``--ckpt-every`` steps (``--resume`` continues from the latest). Batches depend only on (seed, step),
so a resumed run trains on the same data as an uninterrupted one. A token file of BPE tokens
(``sluice-prepare-data --tokenizer bpe``) sets the model's vocabulary (rounded up to 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..nn.model import PRESETS, ModelConfig
from ..nn.moe import IMPLS
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
from .profile import summarize as profile_summary

BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12}


def peak_flops(device) -> float | None:
    """Dense bf16 peak of one device, or None where unknown (CPUs: MFU is reported as 'n/a')."""
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="sluice-train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument(
        "--moe-impl",
        default="sluice",
        choices=IMPLS,
        help="sluice: dropless on sluice's kernels (default); ragged_dot: dropless on "
        "jax.lax.ragged_dot; dense: capacity factor, drops",
    )
    p.add_argument("--capacity-factor", type=float, default=1.25, help="dense path only")
    p.add_argument(
        "--ep-rows-factor",
        type=float,
        help="sluice path over sluice.ep: bound the expert block's rows per rank to this multiple "
        "of the balanced mean (default: the worst case, which grows with --ep); a step that would "
        "drop a copy past the bound stops the run",
    )
    p.add_argument(
        "--ep-sms",
        type=int,
        help="sluice path over sluice.ep: thread blocks (SMs) of its exchange kernels, 1-64 "
        "(default: sluice.ep.setup's 64)",
    )
    p.add_argument(
        "--no-sluice-dispatch",
        action="store_true",
        help="sluice path under --ep: exchange the tokens with jax.lax.ragged_all_to_all instead "
        "of sluice.ep's dispatch/combine",
    )
    p.add_argument(
        "--no-sluice-gmm", action="store_true", help="sluice path with jax.lax.ragged_dot matmuls"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="total steps (default: the preset's)")
    p.add_argument(
        "--batch-size", type=int, help="global batch in sequences (default: the preset's)"
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="split each step's batch into N micro-batches whose gradients are summed (in float32) "
        "before one optimizer update: the batch of N times the memory, and the update's cost "
        "spread over N times the tokens",
    )
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: the preset's)")
    p.add_argument("--ep", type=int, help="expert-parallel degree (default: the preset's)")
    p.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="also split the routed experts' weights and optimizer state over the data axis",
    )
    p.add_argument(
        "--opt-state-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of AdamW's two moments (bfloat16, as DeepSeek-V3 trains: a third less optimizer "
        "traffic; the update is computed in float32)",
    )
    p.add_argument(
        "--weight-copies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the weights the model multiplies in bf16 as bf16 copies, made by the optimizer's "
        "update (fused with it) instead of cast in every forward pass; the same arithmetic. "
        "--no-weight-copies: cast them where they are used",
    )
    p.add_argument("--n-layers", type=int, help="override the preset's layer count")
    p.add_argument(
        "--bias-update-rate",
        type=float,
        help="aux-loss-free balancing: the router bias's step per training step, 0 = off (default: "
        "the preset's)",
    )
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        help="weight of the Switch-style load-balance loss, 0 = off (default: the preset's)",
    )
    p.add_argument(
        "--shared-experts",
        dest="num_shared_experts",
        type=int,
        help="shared experts (one SwiGLU of this many times d_ff every token passes), 0 = none "
        "(default: the preset's)",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="recompute each block's activations in the backward pass (jax.checkpoint per block): "
        "less memory, one more forward pass",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "xla", "cudnn"),
        default="auto",
        help="jax.nn.dot_product_attention's implementation (auto: cuDNN's fused kernel on a GPU "
        "for 16-bit activations, else XLA's)",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, help="default: --eval-every; 0 = only at the end")
    p.add_argument("--no-ckpt", action="store_true", help="write no checkpoint")
    p.add_argument("--out", help="run directory (default: runs/PRESET-IMPL[-cfX]-sSEED)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --out"
    )
    p.add_argument(
        "--data", help="token file from sluice-prepare-data (default: read the installed docs)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="trace the N steps after the compiling one (or from --profile-from) with "
        "jax.profiler into RUN_DIR/profile and write where their device time went to "
        "RUN_DIR/profile/summary.txt (sluice-profile); those steps are left out of the logged TGS "
        "and MFU",
    )
    p.add_argument(
        "--profile-from",
        type=int,
        default=0,
        metavar="STEP",
        help="with --profile: trace from this step on (e.g. once the router is balanced)",
    )
    return p.parse_args(argv)


def run_name(a) -> str:
    impl = a.moe_impl + (f"-cf{a.capacity_factor:g}" if a.moe_impl == "dense" else "")
    return f"{a.preset}-{impl}-s{a.seed}"


def build_config(a) -> tuple[ModelConfig, dict]:
    preset = PRESETS[a.preset]
    cfg: ModelConfig = preset["model"]
    moe = dataclasses.replace(
        cfg.moe,
        impl=a.moe_impl,
        capacity_factor=a.capacity_factor,
        use_sluice_gmm=not a.no_sluice_gmm,
        use_sluice_dispatch=not a.no_sluice_dispatch,
        fsdp=a.fsdp,
        ep_rows_factor=a.ep_rows_factor,
        ep_num_sms=a.ep_sms,
    )
    for k in ("bias_update_rate", "aux_loss_coef", "num_shared_experts"):
        if getattr(a, k) is not None:
            moe = dataclasses.replace(moe, **{k: getattr(a, k)})
    cfg = dataclasses.replace(cfg, moe=moe, attention=a.attention, remat=a.remat)
    if a.n_layers:
        cfg = dataclasses.replace(
            cfg, n_layers=a.n_layers, n_dense_layers=min(cfg.n_dense_layers, a.n_layers - 1)
        )
    hp = {
        k: getattr(a, k) if getattr(a, k) is not None else preset[k]
        for k in ("steps", "batch_size", "seq_len", "lr", "warmup", "ep")
    }
    hp["opt_state_dtype"] = a.opt_state_dtype
    return cfg, hp


def load_stats(load: np.ndarray) -> dict:
    """load [L_moe, E] token copies per expert -> its spread: max/mean (1 = balanced) and the
    coefficient of variation."""
    mean = load.mean(axis=1, keepdims=True)
    return {
        "load_max_over_mean": float((load.max(axis=1, keepdims=True) / mean).max()),
        "load_cv": float((load.std(axis=1, keepdims=True) / mean).mean()),
    }


def main(argv=None) -> int:
    """The `sluice-train` console script: trains, prints a summary line, exits 0."""
    run(argv)
    return 0


def run(argv=None) -> dict:
    """Trains as `sluice-train` would with these arguments; returns the run's summary."""
    a = parse_args(argv)
    cfg, hp = build_config(a)
    out = os.path.abspath(a.out or os.path.join("runs", run_name(a)))
    os.makedirs(out, exist_ok=True)
    try:
        mesh = make_mesh(hp["ep"], a.devices)
    except ValueError as e:
        raise SystemExit(f"--ep {hp['ep']}: {e}") from None
    devices = list(mesh.devices.flat)
    n_dev = len(devices)
    accum = a.grad_accum
    if accum < 1:
        raise SystemExit(f"--grad-accum {accum}: expected a positive number of micro-batches")
    if hp["batch_size"] % (n_dev * accum):
        raise SystemExit(
            f"--batch-size {hp['batch_size']} is not divisible by the {n_dev} devices"
            + (f" times --grad-accum {accum}" if accum > 1 else "")
        )
    data = TokenData.load(a.data)
    if data.vocab_size > cfg.vocab_size:  # a BPE token file: the model's vocabulary from it
        cfg = dataclasses.replace(cfg, vocab_size=-(-data.vocab_size // 64) * 64)
    bsz, seq = hp["batch_size"], hp["seq_len"]
    val = []
    if a.eval_every:
        # as many of --eval-batches as the validation stream holds (a large batch can outgrow it)
        fit = len(data.val) // (bsz * (seq + 1))
        if 0 < fit < a.eval_batches:
            print(
                f"sluice-train: evaluating on {fit} batches, all the validation stream holds",
                file=sys.stderr,
            )
        val = data.val_batches(min(a.eval_batches, max(fit, 1)), bsz, seq)
        # val_bpb = val_loss / this: bits per byte of text, comparable across tokenizers
        ln2_bytes_per_token = math.log(2) * data.bytes_per_token([b[:, 1:] for b in val])

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

    ckpt = None
    if not a.no_ckpt:
        import orbax.checkpoint as ocp

        ckpt = ocp.CheckpointManager(
            os.path.join(out, "ckpt"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2, create=True, enable_async_checkpointing=False
            ),
        )
    start, train_time = 0, 0.0
    metrics_path = os.path.join(out, "metrics.jsonl")
    if a.resume:
        if ckpt is None or ckpt.latest_step() is None:
            raise SystemExit(f"--resume: no checkpoint under {out}/ckpt")
        import orbax.checkpoint as ocp

        start = ckpt.latest_step()
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_sh
        )
        state = ckpt.restore(start, args=ocp.args.StandardRestore(abstract))
        train_time = _last_train_time(metrics_path, start)
        _truncate_metrics(metrics_path, start)
        print(f"resumed from step {start} of {out}/ckpt", file=sys.stderr)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)

    peak = peak_flops(devices[0])
    flops_tok = cfg.flops_per_token(seq)
    info = {
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
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(info, f, indent=1)
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
    # the sluice path drops only past --ep-rows-factor's bound: any step that did stops the run
    strict = a.moe_impl == "sluice" and a.ep_rows_factor is not None
    worst = jnp.zeros(
        (), jnp.float32
    )  # the largest dropped fraction since the last log (on device)
    # The first step compiles: timed apart, never counted in TGS.
    if step < hp["steps"]:
        t0 = time.perf_counter()
        m = jax.device_get(step_once(step))
        worst = jnp.maximum(worst, m["dropped"]) if strict else worst
        compile_s = time.perf_counter() - t0
        step += 1
        emit({"kind": "compile", "step": step, "seconds": compile_s, "loss": float(m["loss"])})
        if bar:
            bar.update(1)
    window_start, window_steps = time.perf_counter(), 0
    profile_start = profile_end = None
    if a.profile > 0:
        profile_start = max(step, a.profile_from)
        profile_end = min(profile_start + a.profile, hp["steps"])
        if profile_start >= profile_end:
            raise SystemExit(
                f"--profile {a.profile} from step {profile_start}: the run ends at step {hp['steps']}"
            )
    prof_dir = os.path.join(out, "profile")
    profiling = False
    while step < hp["steps"]:
        if step == profile_start:
            jax.block_until_ready(state)  # the steps before run outside the trace
            profile_steps, profiling = profile_end - step, True
            jax.profiler.start_trace(prof_dir)
        m = step_once(step)
        if strict:
            worst = jnp.maximum(worst, m["dropped"])
        step += 1
        window_steps += 1
        if step == profile_end:
            if strict and float(worst) > 0:  # (the log's check, which these steps skip)
                raise SystemExit(f"sluice-train: a profiled step dropped {float(worst):.2%}")
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
            m, worst_seen = jax.device_get((m, worst))  # the only host sync of the loop
            if strict and worst_seen > 0:
                raise SystemExit(
                    f"sluice-train: a step before {step} dropped {worst_seen:.2%} of the token "
                    f"copies past --ep-rows-factor {a.ep_rows_factor}'s bound; raise it (or leave "
                    "it out: no bound)"
                )
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
                **load_stats(np.asarray(m["load"])),
                "step_time": dt / window_steps,
                "tgs": tokens / dt / n_dev,
                "mfu": flops_tok * tokens / dt / (peak * n_dev) if peak else "n/a",
                "peak_mem_gb": _gb(peak_memory_bytes(devices)),
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


def _gb(b):
    return None if b is None else round(b / 2**30, 3)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def _read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last_train_time(path, step) -> float:
    recs = [r for r in _read_metrics(path) if r.get("kind") == "train" and r["step"] <= step]
    return recs[-1]["train_time"] if recs else 0.0


def _truncate_metrics(path, step):
    """Drop records past the checkpoint we resume from (they will be produced again)."""
    recs = [r for r in _read_metrics(path) if r["step"] <= step]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


if __name__ == "__main__":
    raise SystemExit(main())

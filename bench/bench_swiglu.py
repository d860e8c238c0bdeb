"""A full jax.grad of a SwiGLU expert block (gate, up, down: three grouped matmuls forward, six
backward) through sluice.gmm against the same through jax.lax.ragged_dot, on one GPU, under jit.

FLOPs per step = 3 matmuls x 3 (forward, d input, d weight) x 2*M*H*F = 18*M*H*F.
Timed with block_until_ready around each call, median of --reps after a warm-up."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import sluice

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from shapes import SWIGLU_BLOCKS as SHAPES  # name: (M rows, G experts, H hidden, F)


def block(mm, x, wg, wu, wd, gs):
    h = mm(x, wg, gs)
    u = mm(x, wu, gs)
    a = (jax.nn.silu(h.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
    return mm(a, wd, gs)


def loss(mm):
    return lambda x, wg, wu, wd, gs, cot: jnp.sum(
        block(mm, x, wg, wu, wd, gs).astype(jnp.float32) * cot
    )


def timeit(f, args, reps):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON file, rewritten after every case")
    p.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"comma-separated subset of {','.join(SHAPES)}",
    )
    p.add_argument(
        "--skip-ragged",
        action="store_true",
        help="time sluice only",
    )
    args = p.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; expected a subset of {list(SHAPES)}")
    dev = jax.devices()[0]
    results = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cases": [],
    }
    print(
        f"{'shape':12s} {'dist':8s} {'sluice ms':>10s} {'ragged ms':>10s} {'sluice TF/s':>12s} "
        f"{'ragged TF/s':>12s} {'speed-up':>9s} {'grad rel err':>12s}"
    )
    for name in names:
        m, g, h, f = SHAPES[name]
        # One generator per shape, so a --shapes subset draws the same sizes as the full run.
        rng = np.random.default_rng([0, list(SHAPES).index(name)])
        for dist in ("uniform", "skewed"):
            pr = rng.dirichlet(np.full(g, 0.3)) if dist == "skewed" else np.full(g, 1 / g)
            gs = jnp.asarray(rng.multinomial(m, pr), jnp.int32)
            bf = jnp.bfloat16
            x = jnp.asarray(rng.standard_normal((m, h)), bf)
            wg = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), bf)
            wu = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), bf)
            wd = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), bf)
            cot = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
            a = (x, wg, wu, wd, gs, cot)
            gs_f = jax.jit(jax.grad(loss(sluice.gmm), argnums=(0, 1, 2, 3)))
            rd_f = jax.jit(jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1, 2, 3)))
            flops = 18.0 * m * h * f
            t_s = timeit(gs_f, a, args.reps)
            case = {
                "shape": name,
                "dist": dist,
                "m": m,
                "g": g,
                "h": h,
                "f": f,
                "group_rows_min_max": [int(gs.min()), int(gs.max())],
                "sluice_ms": t_s * 1e3,
                "sluice_tflops": flops / t_s / 1e12,
            }
            if args.skip_ragged:
                print(
                    f"{name:12s} {dist:8s} {t_s * 1e3:10.2f} {'-':>10s} {flops / t_s / 1e12:12.1f}"
                )
                save(results, case, args.out)
                continue
            try:
                t_r = timeit(rd_f, a, max(3, args.reps // 3))
                ga, gb = gs_f(*a), rd_f(*a)
                err = max(
                    float(
                        jnp.linalg.norm(u.astype(jnp.float32) - v.astype(jnp.float32))
                        / jnp.linalg.norm(v.astype(jnp.float32))
                    )
                    for u, v in zip(ga, gb)
                )
                case.update(
                    ragged_ms=t_r * 1e3,
                    ragged_tflops=flops / t_r / 1e12,
                    speedup=t_r / t_s,
                    grad_rel_err=err,
                )
                print(
                    f"{name:12s} {dist:8s} {t_s * 1e3:10.2f} {t_r * 1e3:10.2f} "
                    f"{flops / t_s / 1e12:12.1f} {flops / t_r / 1e12:12.1f} {t_r / t_s:8.1f}x {err:12.2e}"
                )
            except Exception as e:  # noqa: BLE001 - ragged_dot's temporaries can exceed memory
                case.update(ragged_error=str(e).splitlines()[0][:200])
                print(
                    f"{name:12s} {dist:8s} {t_s * 1e3:10.2f} {'failed':>10s} "
                    f"{flops / t_s / 1e12:12.1f}  ragged_dot: {case['ragged_error'][:60]}"
                )
            save(results, case, args.out)
            del gs_f, rd_f


def save(results, case, out):
    """Append a case and rewrite the JSON, so a run cut short by a time limit keeps what it measured."""
    results["cases"].append(case)
    if out:
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()

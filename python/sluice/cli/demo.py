"""`sluice-demo`: checks sluice.gmm/tgmm against jax.lax.ragged_dot on this machine and prints both
speeds (forward, weight gradient, and a full grad), with GFLOP/s = 2*M*K*N / time."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import sluice

from .usage import Parser, nonneg_int, positive_int


def _time(f, *args, reps=5):
    jax.block_until_ready(f(*args))  # compile + warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def run(m, k, n, g, dtype, seed, reps):
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.full(g, 0.3))), jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
    f32 = jnp.float32

    ours = jax.jit(lambda a, b, s: sluice.gmm(a, b, s, preferred_element_type=f32))
    theirs = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=f32))
    o, r = ours(lhs, rhs, sizes), theirs(lhs, rhs, sizes)
    err = float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r))

    wg_ours = jax.jit(lambda a, d, s: sluice.tgmm(a, d, s, preferred_element_type=f32))
    # ragged_dot's weight gradient is its VJP with respect to rhs
    wg_theirs = jax.jit(
        lambda a, b, d, s: jax.vjp(
            lambda w: jax.lax.ragged_dot(a, w, s, preferred_element_type=f32), b
        )[1](d.astype(f32))[0]
    )
    wg_err = float(
        jnp.linalg.norm(
            wg_ours(lhs, dout, sizes).astype(f32) - wg_theirs(lhs, rhs, dout, sizes).astype(f32)
        )
        / jnp.linalg.norm(wg_theirs(lhs, rhs, dout, sizes).astype(f32))
    )

    def swiglu_loss(impl, x, w, s):
        h = impl(x, w, s)
        return jnp.sum(jax.nn.silu(h).astype(f32) ** 2)

    grad_ours = jax.jit(jax.grad(lambda x, w, s: swiglu_loss(sluice.gmm, x, w, s), (0, 1)))
    grad_theirs = jax.jit(
        jax.grad(lambda x, w, s: swiglu_loss(jax.lax.ragged_dot, x, w, s), (0, 1))
    )
    flops = 2.0 * m * k * n
    rows = [
        (
            "gmm forward",
            _time(ours, lhs, rhs, sizes, reps=reps),
            _time(theirs, lhs, rhs, sizes, reps=reps),
            flops,
        ),
        (
            "tgmm (weight grad)",
            _time(wg_ours, lhs, dout, sizes, reps=reps),
            _time(wg_theirs, lhs, rhs, dout, sizes, reps=reps),
            flops,
        ),
        (
            "jax.grad fwd+bwd",
            _time(grad_ours, lhs, rhs, sizes, reps=reps),
            _time(grad_theirs, lhs, rhs, sizes, reps=reps),
            3 * flops,
        ),
    ]
    return err, wg_err, rows


def main(argv=None):
    p = Parser(prog="sluice-demo", description=__doc__)
    p.add_argument("--m", type=positive_int, default=2048)
    p.add_argument("--k", type=positive_int, default=512)
    p.add_argument("--n", type=positive_int, default=768)
    p.add_argument("--groups", type=positive_int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--seed", type=nonneg_int, default=0)
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    print(
        f"sluice {sluice.__version__} on {dev.platform} ({dev.device_kind}), jax {jax.__version__}"
    )
    print(f"M={a.m} K={a.k} N={a.n} G={a.groups} {a.dtype}, skewed group sizes (Dirichlet 0.3)")
    err, wg_err, rows = run(a.m, a.k, a.n, a.groups, jnp.dtype(a.dtype), a.seed, a.reps)
    print(
        f"check vs jax.lax.ragged_dot: forward rel err {err:.2e}, weight grad rel err {wg_err:.2e}"
    )
    ok = err < 1e-2 and wg_err < 2e-2
    print(
        f"{'op':22s} {'sluice ms':>10s} {'ragged_dot ms':>14s} {'sluice GF/s':>12s} "
        f"{'ragged GF/s':>12s} {'speed-up':>9s}"
    )
    for name, t_s, t_r, fl in rows:
        print(
            f"{name:22s} {t_s * 1e3:10.2f} {t_r * 1e3:14.2f} {fl / t_s / 1e9:12.1f} "
            f"{fl / t_r / 1e9:12.1f} {t_r / t_s:8.1f}x"
        )
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

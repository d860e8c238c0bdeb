"""The CPU kernels. sluice.gmm / tgmm (csrc/core/gmm_cpu.c) on tests/shapes.py's three CPU_SHAPES,
bf16; group sizes multinomial, summing to M - 37. Prints ms per call (mean of 20 under jit) as gmm,
tgmm for each shape in turn.

    python3 bench/bench_cpu_gmm.py

With --swiglu: sluice.swiglu (csrc/core/swiglu_cpu.c) against XLA's element-wise SwiGLU
(swiglu_reference) on h [rows, 2 ff] bf16, the forward and the forward with its VJP, plain and with
a router weight per row; ms per call, the median of --rounds rounds of 20 jitted calls, the two
implementations taking turns within each round.

    python3 bench/bench_cpu_gmm.py --swiglu [--rows 65536] [--ff 256] [--rounds 7]
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import sluice

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from shapes import CPU_SHAPES


def timed(fn, args, calls, rounds):
    """Milliseconds a call, the median over rounds of `calls` calls queued back to back."""
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / calls * 1e3)
    return float(np.median(out))


def bench_swiglu(rows, ff, rounds):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((rows, 2 * ff)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0, 1, rows), jnp.float32)
    d = jnp.asarray(rng.standard_normal((rows, ff)), jnp.bfloat16)
    impls = {"xla": sluice.swiglu_reference, "sluice": sluice.swiglu}
    cases = {}
    for name, f in impls.items():
        for weighted in (False, True):

            def fwd(h, w, f=f, weighted=weighted):
                return f(h, row_weights=w if weighted else None)

            def vjp(h, w, d, fwd=fwd):
                y, back = jax.vjp(fwd, h, w)
                return y, back(d)

            tag = f"{name}{' weighted' if weighted else ''}"
            cases[f"forward {tag}"] = (jax.jit(fwd), (h, w))
            cases[f"forward + VJP {tag}"] = (jax.jit(vjp), (h, w, d))
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for k, (fn, args) in cases.items():
            times[k].append(timed(fn, args, 20, 1))
    print(f"sluice.swiglu against XLA, h [{rows}, {2 * ff}] bf16, ms a call (median of {rounds}):")
    for k, v in times.items():
        print(f"  {k:32s} {np.median(v):8.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--swiglu", action="store_true", help="time sluice.swiglu against XLA's")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--ff", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if args.swiglu:
        bench_swiglu(args.rows, args.ff, args.rounds)
        return
    rng = np.random.default_rng(0)
    out = []
    for m, k, n, g in CPU_SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) * 0.05, jnp.bfloat16)
        gs = jnp.asarray(rng.multinomial(m - 37, np.ones(g) / g).astype(np.int32))
        d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        out.append(timed(jax.jit(lambda x, w, gs=gs: sluice.gmm(x, w, gs)), (x, w), 20, 1))
        out.append(timed(jax.jit(lambda x, d, gs=gs: sluice.tgmm(x, d, gs)), (x, d), 20, 1))
    print(" ".join(f"{v:.2f}" for v in out))


if __name__ == "__main__":
    main()

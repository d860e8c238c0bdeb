"""sluice.gmm / tgmm on the CPU (the C kernels of csrc/core/gmm_cpu.c) on tests/shapes.py's three
CPU_SHAPES, bf16; group sizes multinomial, summing to M - 37. Prints ms per call (mean of 20 under jit) as
gmm, tgmm for each shape in turn.

    python3 bench/bench_cpu_gmm.py
"""

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


def main():
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

"""sluice.gmm / tgmm on the CPU (the C kernels of csrc/core/gmm_cpu.c) on three ragged shapes, bf16:
(M, K, N, G) = (8192, 128, 128, 16) (the tiny preset's gate/up), (8192, 64, 128, 16), (4096, 512,
256, 8); group sizes multinomial, summing to M - 37. Prints ms per call (mean of 20 under jit) as
gmm, tgmm for each shape in turn.

    python3 bench/bench_cpu_gmm.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import sluice


def t(f, *a, n=20):
    f = jax.jit(f)
    jax.block_until_ready(f(*a))
    s = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - s) / n * 1e3


def main():
    rng = np.random.default_rng(0)
    out = []
    for m, k, n, g in [(8192, 128, 128, 16), (8192, 64, 128, 16), (4096, 512, 256, 8)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) * 0.05, jnp.bfloat16)
        gs = jnp.asarray(rng.multinomial(m - 37, np.ones(g) / g).astype(np.int32))
        d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        out.append(t(lambda x, w, gs=gs: sluice.gmm(x, w, gs), x, w))
        out.append(t(lambda x, d, gs=gs: sluice.tgmm(x, d, gs), x, d))
    print(" ".join(f"{v:.2f}" for v in out))


if __name__ == "__main__":
    main()

"""sluice.gmm / tgmm on the CPU (the C kernels of csrc/core/gmm_cpu.c) on three ragged shapes, bf16:
(M, K, N, G) = (8192, 128, 128, 16) (the tiny preset's gate/up), (8192, 64, 128, 16), (4096, 512,
256, 8); group sizes multinomial, summing to M - 37. Prints ms per call (mean of 20 under jit) as
gmm, tgmm for each shape in turn.

    python3 bench/bench_cpu_gmm.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import sluice
from bench_act import timed  # bench/ is the script's sys.path[0]


def main():
    rng = np.random.default_rng(0)
    out = []
    for m, k, n, g in [(8192, 128, 128, 16), (8192, 64, 128, 16), (4096, 512, 256, 8)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) * 0.05, jnp.bfloat16)
        gs = jnp.asarray(rng.multinomial(m - 37, np.ones(g) / g).astype(np.int32))
        d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        out.append(timed(jax.jit(lambda x, w, gs=gs: sluice.gmm(x, w, gs)), (x, w), 20, 1))
        out.append(timed(jax.jit(lambda x, d, gs=gs: sluice.tgmm(x, d, gs)), (x, d), 20, 1))
    print(" ".join(f"{v:.2f}" for v in out))


if __name__ == "__main__":
    main()

"""The MoE router's logits (x [T, D] in f32 times the router weight [D, E], f32) at each matmul
precision XLA offers, on one GPU under jit: the forward and the forward with its VJP (d x, d w), and
how far each is from full f32 (HIGHEST): the logits' largest relative error and the share of tokens
whose top-k experts change. The model computes its router in f32 (moe.py).

    python3 bench/bench_router.py [--tokens 32768] [--d 1024] [--experts 256] [--k 8] [--md out.md]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_act import emit, timed  # bench/ is the script's sys.path[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((a.tokens, a.d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((a.d, a.experts)) * 0.02, jnp.float32)
    g = jnp.asarray(rng.standard_normal((a.tokens, a.experts)), jnp.float32)
    P = jax.lax.Precision
    impls = {
        "f32 HIGHEST": lambda x, w: jnp.dot(x.astype(jnp.float32), w, precision=P.HIGHEST),
        "f32 DEFAULT (the model's)": lambda x, w: jnp.dot(x.astype(jnp.float32), w),
        "f32 HIGH": lambda x, w: jnp.dot(x.astype(jnp.float32), w, precision=P.HIGH),
        "bf16 x, bf16 w, f32 out": lambda x, w: jnp.dot(
            x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32
        ),
    }
    ref = jax.jit(impls["f32 HIGHEST"])(x, w)
    top_ref = np.asarray(jax.lax.top_k(ref, a.k)[1])
    flops = 2 * a.tokens * a.d * a.experts
    lines = [
        (
            f"# router logits on {jax.devices()[0].device_kind}, jax {jax.__version__}: "
            f"T = {a.tokens}, D = {a.d}, E = {a.experts}, top-{a.k}"
        ),
        "",
        "| precision | forward (ms) | TFLOP/s | fwd + VJP (ms) | max rel. error | tokens whose top-k change |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, fn in impls.items():
        fwd = timed(jax.jit(fn), (x, w), 20, 7)

        def both(x, w, g, fn=fn):
            out, pull = jax.vjp(fn, x, w)
            return out, pull(g)

        bwd = timed(jax.jit(both), (x, w, g), 20, 7)
        got = jax.jit(fn)(x, w)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        top = np.asarray(jax.lax.top_k(got, a.k)[1])
        changed = float(np.mean(np.any(np.sort(top, 1) != np.sort(top_ref, 1), axis=1)))
        lines.append(
            f"| {name} | {fwd:.3f} | {flops / fwd / 1e9:.0f} | {bwd:.3f} | {err:.1e} | "
            f"{changed:.2%} |"
        )
    emit(lines, a.md)


if __name__ == "__main__":
    main()

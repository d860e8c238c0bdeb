"""sluice.swiglu against XLA's element-wise SwiGLU (what the MoE layer ran before) on one GPU, under
jit: the forward, and the forward with its VJP, on an expert block of M rows of which U are used
(sluice.ep's block at --ep-rows-factor 2 has U ~ M/2); plain, and with each row times its router
weight (-w: the VJP also gives the weights' gradient, a row-wise sum; what the MoE layer runs). Bytes (bf16) per used row: forward reads 4F
and writes 2F; the VJP reads 6F more and writes 4F. Each figure: the median of --rounds rounds of
--calls calls queued back to back (wall clock / calls).

    python3 bench/bench_act.py [--rows 524288] [--ff 256] [--md act.md]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import sluice


def xla_swiglu(h, w=None):
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return (act if w is None else act * w[:, None]).astype(h.dtype)


def timed(fn, args, calls, rounds):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / calls * 1e3)
    return float(np.median(out))


def emit(lines, md=None):
    """Print a result table, and write it to the file md when given."""
    text = "\n".join(lines)
    print(text, flush=True)
    if md:
        with open(md, "w") as fh:
            fh.write(text + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=524288)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    m, f = a.rows, a.ff
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((m, 2 * f)), jnp.bfloat16)
    dact = jnp.asarray(rng.standard_normal((m, f)), jnp.bfloat16)
    w = jnp.asarray(rng.random(m), jnp.float32)

    def vjp(act_fn):
        def run(h, w, dact, gs):
            out, pull = jax.vjp(lambda x, v: act_fn(x, v, gs), h, w)
            return out, pull(dact)

        return jax.jit(run)

    impls = {
        "xla": lambda x, v, gs: xla_swiglu(x),
        "sluice": lambda x, v, gs: sluice.swiglu(x, gs, zero_unused_rows=False),
        "xla-w": lambda x, v, gs: xla_swiglu(x, v),
        "sluice-w": lambda x, v, gs: sluice.swiglu(x, gs, row_weights=v, zero_unused_rows=False),
    }
    dev = jax.devices()[0].device_kind
    lines = [
        f"# swiglu on {dev}, jax {jax.__version__}: M = {m} rows, F = {f}, bf16",
        "",
        "| used rows | impl | forward (ms) | GB/s (used rows) | forward + VJP (ms) | GB/s (used rows) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for used in (m // 2, m):
        gs = jnp.asarray([used], jnp.int32)
        for name, fn in impls.items():
            fwd = timed(jax.jit(fn), (h, w, gs), a.calls, a.rounds)
            both = timed(vjp(fn), (h, w, dact, gs), a.calls, a.rounds)
            gb_f = used * 6 * f / 1e9  # 6F bytes a used row (bf16), 16F with the VJP
            gb_b = used * 16 * f / 1e9
            lines.append(
                f"| {used} | {name} | {fwd:.3f} | {gb_f / fwd * 1e3:.0f} | {both:.3f} | "
                f"{gb_b / both * 1e3:.0f} |"
            )
    emit(lines, a.md)


if __name__ == "__main__":
    main()

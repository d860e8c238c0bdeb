"""Pure-jnp references of the sluice.ep ops, for tests: the exchange ops over whole arrays of all
ranks at once, the fan ops on one rank, and the whole MoE sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .fan import _fan_rows


def dispatch_reference(x, topk_idx, topk_weights, *, num_experts, num_ranks):
    """dispatch for all ranks at once. x [R, T, H], topk_idx/topk_weights [R, T, k] (rank s's tokens
    at [s]). Returns (recv_x [R, N, H], recv_idx [R, N, k], recv_w [R, N, k], num_rows [R],
    counts [R, L], recv_src [R, N]); index [d] is what rank d receives."""
    r, t, h = x.shape
    k = topk_idx.shape[-1]
    l = num_experts // num_ranks
    n = t * r
    owner = jnp.where(topk_idx >= 0, topk_idx // l, -1)  # [R, T, k]
    outs = []
    for d in range(r):
        goes = jnp.any(owner == d, axis=-1).reshape(-1)  # [(s, t)] in (source, token) order
        row = jnp.cumsum(goes) - 1
        dest = jnp.where(goes, row, n)  # n: dropped by the scatter
        local = (owner == d).reshape(n, k)
        rx = jnp.zeros((n, h), x.dtype).at[dest].set(x.reshape(n, h), mode="drop")
        ri = (
            jnp.full((n, k), -1, jnp.int32)
            .at[dest]
            .set(jnp.where(local, topk_idx.reshape(n, k) - d * l, -1), mode="drop")
        )
        rw = (
            jnp.zeros((n, k), jnp.float32)
            .at[dest]
            .set(jnp.where(local, topk_weights.reshape(n, k), 0.0), mode="drop")
        )
        src = (
            jnp.full((n,), -1, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
        )
        counts = jnp.sum(
            jax.nn.one_hot(
                jnp.where(local, topk_idx.reshape(n, k) - d * l, -1), l, dtype=jnp.int32
            ),
            axis=(0, 1),
        )
        outs.append((rx, ri, rw, jnp.sum(goes).astype(jnp.int32), counts, src))
    return tuple(jnp.stack(z) for z in zip(*outs))


def combine_reference(y, recv_src, num_tokens):
    """combine for all ranks at once: y [R, N, H'] (rank d's rows at [d]), recv_src [R, N] from
    dispatch_reference. Returns [R, T, H'] summed over d in order in f32, rounded to y.dtype."""
    r, _, h = y.shape
    acc = jnp.zeros((r * num_tokens, h), jnp.float32)
    for d in range(r):  # fixed rank order, as the op
        acc = acc.at[recv_src[d]].add(y[d].astype(jnp.float32), mode="drop")
    return acc.reshape(r, num_tokens, h).astype(y.dtype)


def fan_out_reference(x, topk_idx, num_local_experts, max_rows=0):
    """fan_out on one rank: (xs [M, H], group_sizes [L], pos [N, k])."""
    n, k = topk_idx.shape
    l = num_local_experts
    m = _fan_rows(n, k, l, max_rows)
    flat = topk_idx.reshape(-1)
    onehot = jax.nn.one_hot(flat, l, dtype=jnp.int32)  # -1 -> zeros
    sizes = jnp.sum(onehot, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    rank_in_group = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    pos = jnp.where(flat >= 0, starts[jnp.maximum(flat, 0)] + rank_in_group, -1)
    pos = jnp.where(pos < m, pos, -1)  # past max_rows: left out
    ends = jnp.cumsum(sizes)
    sizes = jnp.minimum(ends, m) - jnp.minimum(ends - sizes, m)
    src_rows = jnp.repeat(jnp.arange(n), k)
    xs = (
        jnp.zeros((m, x.shape[1]), x.dtype)
        .at[jnp.where(pos >= 0, pos, m)]
        .set(x[src_rows], mode="drop")
    )
    return xs, sizes.astype(jnp.int32), pos.reshape(n, k).astype(jnp.int32)


def fan_in_reference(ys, weights, pos, out_dtype=None):
    """fan_in on one rank: out [N, H'] = sum_j weights[:, j] * ys[pos[:, j]] in f32."""
    acc = jnp.zeros((pos.shape[0], ys.shape[1]), jnp.float32)
    for j in range(pos.shape[1]):  # slot order, as the op
        acc = acc + jnp.where(
            pos[:, j : j + 1] >= 0,
            weights[:, j : j + 1] * ys[jnp.maximum(pos[:, j], 0)].astype(jnp.float32),
            0.0,
        )
    return acc.astype(out_dtype or ys.dtype)


def moe_reference(x, topk_idx, topk_weights, expert_fn):
    """The math dispatch -> fan_out -> experts -> fan_in -> combine computes, without moving anything:
    out[t] = sum_j topk_weights[t, j] * expert_fn(x[t], topk_idx[t, j]) over slots with an expert.
    expert_fn(x [T, H], e [T] int32) -> [T, H']."""
    acc = None
    for j in range(topk_idx.shape[1]):
        e = topk_idx[:, j]
        y = expert_fn(x, jnp.maximum(e, 0)).astype(jnp.float32)
        term = jnp.where((e >= 0)[:, None], topk_weights[:, j : j + 1] * y, 0.0)
        acc = term if acc is None else acc + term
    return acc

"""Mixture-of-Experts layer (Flax NNX) with three interchangeable expert paths.

One set of parameters and one router; ``MoEConfig.impl`` picks how tokens reach their experts:

- ``dense``: a fixed capacity per expert per sequence, ``C = ceil(S*k/E * capacity_factor)``; tokens
  past an expert's capacity are dropped (first choices of every token take precedence over second
  choices, then by position). Static shapes: tokens are scattered into an ``[E, B*C, D]`` buffer and
  the experts run as one batched matmul. This is the capacity-factor path of MaxText's
  ``dense_matmul``, with index scatter/gather instead of one-hot dispatch einsums (same result, less
  memory).
- ``ragged_dot``: dropless. Token copies are sorted by expert (argsort), the experts run as
  ``jax.lax.ragged_dot`` and the results are unsorted. Expert parallelism with
  ``jax.lax.ragged_all_to_all`` and a worst-case receive buffer.
- ``sluice``: the dropless path on sluice's kernels: ``sluice.gmm`` for the expert matmuls
  (``use_sluice_gmm``), token copies put in expert order and summed back by sluice's counting-sort
  fan-out/fan-in (no argsort, no scatter-add in the backward), each copy's router weight applied in
  its SwiGLU (``sluice.swiglu``) so that nothing keeps the expert outputs for the weights' gradient,
  and ``sluice.ep.dispatch``/``combine`` for expert parallelism (``use_sluice_dispatch``; False
  takes the ``ragged_all_to_all`` exchange instead).

Router (fp32 values; its matmul at XLA's default precision, which on Hopper runs on the tensor
cores: ~2e-4 relative): softmax top-k, or
DeepSeek-V3's sigmoid scores with a per-expert selection bias that no gradient trains;
``MoE.update_bias`` nudges it toward balance from the measured load after each step (aux-loss-free
balancing), optional group-limited routing and a routed scaling factor. An optional Switch-style
load-balance loss. SwiGLU experts in the compute dtype, weighted sums of expert outputs in fp32 (the
sluice path weights the activations and sums in fp32).

Every call returns ``(y, stats)`` with ``stats = {"load": f32[E] routed token copies per expert
(global), "dropped": f32 fraction of token copies dropped, "aux_loss": f32 load-balance loss (per
shard, averaged over shards), "ep": f32[3] over sluice.ep: the exchange's rounds, the most rows and
the most (row, slot) pairs one rank received (zeros on the other paths)}``.

Parallelism: give the layer a ``mesh`` with a data axis and an expert axis. The layer runs in
``shard_map``: tokens are split over both axes (the expert axis also splits the batch), expert
weights over the expert axis, everything else is replicated. With ``fsdp`` the routed experts'
weights (and so their gradients and optimizer moments) are also split over the data axis along
d_model (``expert_weight_specs``); each layer gathers its shard's experts in the compute dtype and
its backward reduce-scatters their gradients.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..ops import ep
from ..ops.gmm import gmm as sluice_gmm
from ..ops.swiglu import swiglu as sluice_swiglu
from ..ops.vma import match_vma

IMPLS = ("dense", "ragged_dot", "sluice")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    d_model: int
    d_ff: int  # hidden size of one routed expert
    num_experts: int
    top_k: int
    num_shared_experts: int = 0  # shared experts are one SwiGLU of width num_shared_experts * d_ff
    router: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to one
    routed_scaling: float = 1.0
    num_groups: int = 1  # group-limited routing: experts split into groups,
    topk_groups: int = 1  # each token picks its experts from its best topk_groups groups
    bias_update_rate: float = 0.0  # aux-loss-free balancing step (DeepSeek-V3: 0.001); 0 = off
    aux_loss_coef: float = 0.0  # Switch-style load-balance loss; 0 = off
    impl: str = "ragged_dot"
    capacity_factor: float = 1.25  # dense only
    use_sluice_gmm: bool = True  # sluice only
    # sluice only, under expert parallelism: sluice.ep's dispatch/combine (True) or
    # jax.lax.ragged_all_to_all (False)
    use_sluice_dispatch: bool = True
    # sluice.ep only: F, the receive buffer and expert block of every rank hold F times the balanced
    # mean (tokens x top_k (row, slot) pairs) a round, sluice.ep.bounded_moe; a step whose routing
    # sends a rank more runs further rounds, nothing is dropped and the values are the worst-case
    # path's. None: the worst-case buffers (every token of every rank for up to min(k, E/R) of this
    # rank's experts), which grow with the rank count. 2.0: balanced routing (and the router's
    # aux-loss-free bias keeps it so) stays in one round with room for a busiest rank at twice the
    # mean.
    ep_rows_factor: float | None = 2.0
    # sluice.ep only: thread blocks of the exchange kernels (sluice.ep.setup's num_sms; None: its
    # default)
    ep_num_sms: int | None = None
    fsdp: bool = False  # also split the routed experts' weights over the data axis (along d_model)
    # the model recomputes its blocks in the backward pass (ModelConfig.remat); over sluice.ep, whose
    # communication jax.checkpoint cannot replay, the block recomputes its local part (fan-out, the
    # experts' SwiGLU, fan-in) and keeps only the received rows
    remat: bool = False
    dtype: Any = jnp.bfloat16  # compute dtype of the experts
    init_std: float = 0.02
    out_init_std: float = 0.02

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by num_groups={self.num_groups}"
            )
        if self.num_groups > 1 and self.top_k > self.topk_groups * (
            self.num_experts // self.num_groups
        ):
            raise ValueError("top_k exceeds the experts in topk_groups groups")
        if self.capacity_factor <= 0:
            raise ValueError("capacity_factor must be positive")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.ep_rows_factor is not None and not self.ep_rows_factor > 0:
            raise ValueError(f"ep_rows_factor must be positive or None, got {self.ep_rows_factor}")
        if self.ep_num_sms is not None and not (
            isinstance(self.ep_num_sms, int) and 1 <= self.ep_num_sms <= 64
        ):
            raise ValueError(
                f"ep_num_sms must be an int in [1, 64] or None, got {self.ep_num_sms!r}"
            )


def capacity(seq_len: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert per sequence (dense path); at most seq_len: top-k experts are distinct."""
    return max(1, min(seq_len, math.ceil(seq_len * top_k / num_experts * capacity_factor)))


# --------------------------------------------------------------------------------------------------
# Router


def top2_sum(x: jax.Array) -> jax.Array:
    """The sum of the two largest entries along the last axis (of the one, for a single entry):
    lax.top_k(x, 2)[0].sum(-1) by two reductions instead of a sort. (XLA:GPU sorts each row of a
    top_k over fewer than 1,024 entries: for dsv3-proxy's 262k groups of 32 experts 0.37 ms an MoE
    layer on an H200, ~3% of its training step; padding such rows to 1,024 to take XLA's own top-k
    kernel instead took 1.04 ms.)"""
    m1 = x.max(-1)
    if x.shape[-1] == 1:
        return m1
    first = jnp.argmax(x, axis=-1)
    rest = jnp.where(jnp.arange(x.shape[-1]) == first[..., None], -jnp.inf, x)
    return m1 + rest.max(-1)


def route(cfg: MoEConfig, logits: jax.Array, bias: jax.Array):
    """fp32 logits [T,E] -> (topk_idx int32 [T,k], topk_weights f32 [T,k], scores f32 [T,E]).

    The bias shifts which experts are selected, never the weights they get (DeepSeek-V3)."""
    scores = jax.nn.softmax(logits, axis=-1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
    sel = scores + jax.lax.stop_gradient(bias)
    if cfg.num_groups > 1:
        t, e = sel.shape
        per_group = e // cfg.num_groups
        grouped = sel.reshape(t, cfg.num_groups, per_group)
        # A group's score is the sum of its two best experts (DeepSeek-V3).
        group_score = top2_sum(grouped)
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_groups)
        group_mask = jax.nn.one_hot(top_groups, cfg.num_groups, dtype=jnp.bool_).any(axis=1)
        sel = jnp.where(jnp.repeat(group_mask, per_group, axis=1), sel, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(sel), cfg.top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob and cfg.top_k > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weights * cfg.routed_scaling, scores


def load_balance_loss(scores: jax.Array, idx: jax.Array, counts: jax.Array) -> jax.Array:
    """Switch Transformer's loss E * sum_e f_e * p_e (1.0 when balanced), on one shard's tokens;
    counts [E]: the copies of ``idx`` per expert."""
    probs = scores / scores.sum(-1, keepdims=True)
    frac = counts / idx.size
    return counts.shape[0] * jnp.sum(jax.lax.stop_gradient(frac) * probs.mean(0))


# --------------------------------------------------------------------------------------------------
# Expert computation


def _ragged_dot(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _sluice_gmm(lhs, rhs, group_sizes):
    return sluice_gmm(lhs, rhs, group_sizes)


def _sluice_gmm_unused_rows_unwritten(lhs, rhs, group_sizes):
    """sluice.gmm leaving the rows past the groups unwritten (zero_unused_rows=False): for the
    sluice.ep expert block, sized for the worst case (or ep_rows_factor times the mean), whose
    unused rows only ever meet row-wise element-wise ops and ops that read the groups' rows alone
    (gmm, tgmm, fan_in, fan_out's transpose): zeroing them cost ~3% of an EP 4 step."""
    return sluice_gmm(lhs, rhs, group_sizes, zero_unused_rows=False)


def _swiglu_act(xs, wi, group_sizes, gmm):
    """xs sorted by expert, wi [E,D,2F] -> the SwiGLU activation [M,F], before the down
    projection."""
    h = gmm(xs, wi, group_sizes)
    gate, up = jnp.split(h, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(xs.dtype)


def _swiglu_grouped(xs, wi, wo, group_sizes, gmm):
    """xs sorted by expert; wi [E,D,2F], wo [E,F,D]. Rows past sum(group_sizes) give zero."""
    return gmm(_swiglu_act(xs, wi, group_sizes, gmm), wo, group_sizes)


def _row_weights(fan, m):
    """Each expert-block row's router weight, f32 [M] (rows without a pair: 0). A scatter to unique
    rows (a pair left out, pos -1, to its own row past M, dropped), so its transpose is a gather."""
    pos = fan.pos.reshape(-1)
    rows = jnp.where(pos >= 0, pos, m + jnp.arange(pos.shape[0], dtype=pos.dtype))
    w = fan.weights.reshape(-1).astype(jnp.float32)
    return jnp.zeros(m, jnp.float32).at[rows].set(w, mode="drop", unique_indices=True)


def _weighted_swiglu(xs, wi, group_sizes, row_w, gmm, kernel, zero_unused_rows):
    """The gate/up projection and SwiGLU, each row times its router weight: act [M, F]. kernel:
    sluice.swiglu (over the groups' rows only, the rest zeroed or left unwritten), else XLA's
    element-wise ops over all M rows."""
    h = gmm(xs, wi, group_sizes)
    if kernel:
        return sluice_swiglu(h, group_sizes, row_weights=row_w, zero_unused_rows=zero_unused_rows)
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32) * row_w[:, None]
    return act.astype(xs.dtype)


def _expert_block(xs, wi, wo, fan, gmm, out_dtype=None, kernel=False):
    """The experts on fan_out's rows xs, summed back per token: ``ep.fan_in(swiglu_down(xs), fan)``
    with the router weights applied to the activations before the down projection instead of to
    its outputs (the same sum, in another order of rounding). So fan_in sums unweighted rows, and
    nothing keeps the expert outputs [M, D] for the router weights' gradient: it is
    sum_j d act[r, j] * (silu(gate) * up)[r, j], which sluice.swiglu's backward (or XLA's fusion of
    it) sums from what it reads anyway. kernel: the SwiGLU by sluice.swiglu (its unused rows as
    fan_out's: fan.zero_unused_rows)."""
    row_w = _row_weights(fan, xs.shape[0])
    act = _weighted_swiglu(xs, wi, fan.group_sizes, row_w, gmm, kernel, fan.zero_unused_rows)
    return ep.fan_in(gmm(act, wo, fan.group_sizes), fan, out_dtype=out_dtype, weighted=False)


def _swiglu_batched(xb, wi, wo):
    """xb [E,M,D], one batch of rows per expert."""
    h = jnp.einsum("emd,edf->emf", xb, wi)
    gate, up = jnp.split(h, 2, axis=-1)
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(xb.dtype)
    return jnp.einsum("emf,efd->emd", act, wo)


def _inverse_permutation(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _weighted_sum(y_copies, weights):
    """y_copies [T,k,D] (compute dtype), weights f32 [T,k] -> f32 [T,D]."""
    return jnp.einsum("tkd,tk->td", y_copies.astype(jnp.float32), weights)


def _dense(cfg, x, idx, weights, wi, wo, ep_axis):
    """Capacity-factor path. x [B,S,D], idx/weights [B,S,k] -> f32 [B,S,D], the dropped count."""
    b, s, d = x.shape
    k = cfg.top_k
    e = cfg.num_experts
    cap = capacity(s, k, e, cfg.capacity_factor)
    # Position of each token copy in its expert's buffer, first choices before second choices.
    choice_major = idx.transpose(0, 2, 1).reshape(b, k * s)
    onehot = jax.nn.one_hot(choice_major, e, dtype=jnp.int32)
    pos = (
        jnp.take_along_axis(jnp.cumsum(onehot, axis=1), choice_major[..., None], axis=-1)[..., 0]
        - 1
    )
    pos = pos.reshape(b, k, s).transpose(0, 2, 1)
    keep = pos < cap
    # A dropped copy gets its own slot past the end (dropped by the scatter, zero from the gather),
    # so every slot index is unique and the scatter needs no atomics.
    overflow = e * cap + jnp.arange(s * k, dtype=idx.dtype).reshape(s, k)
    slot = jnp.where(keep, idx * cap + pos, overflow).reshape(b, s * k)
    rows = jnp.arange(b)[:, None]
    copies = jnp.broadcast_to(x[:, :, None, :], (b, s, k, d)).reshape(b, s * k, d)
    buf = jnp.zeros((b, e * cap, d), x.dtype)
    buf = buf.at[rows, slot].set(copies, mode="drop", unique_indices=True)
    buf = buf.reshape(b, e, cap, d).transpose(1, 0, 2, 3).reshape(e, b * cap, d)
    if ep_axis is not None:  # [E, B*C, D] -> [E_local, R*B*C, D]: each rank gets its experts' slots
        buf = jax.lax.all_to_all(buf, ep_axis, split_axis=0, concat_axis=1, tiled=True)
    out = _swiglu_batched(buf, wi, wo)
    if ep_axis is not None:
        out = jax.lax.all_to_all(out, ep_axis, split_axis=1, concat_axis=0, tiled=True)
    out = out.reshape(e, b, cap, d).transpose(1, 0, 2, 3).reshape(b, e * cap, d)
    y = out.at[rows, slot].get(mode="fill", fill_value=0, unique_indices=True)
    y = y.reshape(b * s, k, d)
    y = _weighted_sum(y, (weights * keep).reshape(b * s, k)).reshape(b, s, d)
    return y, jnp.sum(~keep).astype(jnp.float32)


def _sort_by_expert(x, idx, num_experts):
    """x [T,D], idx [T,k] -> token copies sorted by expert, the order, per-expert counts."""
    k = idx.shape[-1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return x[order // k], order, counts


def _dropless_local(cfg, x, idx, weights, wi, wo, gmm):
    """x [T,D], all experts local -> (y [T,D], per-expert copy counts, int32 [E])."""
    t, d = x.shape
    if gmm is _sluice_gmm:
        # sluice's counting-sort fan-out/fan-in (C/CUDA, no argsort, no scatter-add in the backward).
        xs, counts, fan = ep.fan_out_tokens(x, idx, weights, num_experts=cfg.num_experts)
        # sluice.swiglu on a GPU, where its weighted backward (one pass, the weights' gradient
        # summed on the way) beats XLA's on a full block (0.74 vs 0.80 ms on one H100); XLA's
        # fusion on the CPU, where it is the faster
        kernel = jax.default_backend() == "gpu"
        return _expert_block(xs, wi, wo, fan, gmm, jnp.float32, kernel), counts
    xs, order, counts = _sort_by_expert(x, idx, cfg.num_experts)
    ys = _swiglu_grouped(xs, wi, wo, counts, gmm)
    y = ys[_inverse_permutation(order)].reshape(t, cfg.top_k, d)
    return _weighted_sum(y, weights), counts


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _padded_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, block
):
    """ragged_all_to_all's semantics from a dense all_to_all of [R, block] padded slices (XLA:CPU
    has no ragged-all-to-all). block bounds every send size."""
    r = send_sizes.shape[0]
    i = jnp.arange(block)
    src = input_offsets[:, None] + i[None, :]  # [R, block]
    chunks = operand.at[src].get(mode="fill", fill_value=0)
    chunks = jax.lax.all_to_all(
        chunks, axis_name, 0, 0, tiled=True
    )  # chunks[s]: what rank s sent me
    offsets = jax.lax.all_to_all(
        output_offsets, axis_name, 0, 0, tiled=True
    )  # where rank s asked to put it
    dst = jnp.where(
        i[None, :] < recv_sizes[:, None], offsets[:, None] + i[None, :], output.shape[0]
    )
    return output.at[dst.reshape(-1)].set(chunks.reshape(r * block, -1), mode="drop")


def _a2a_buffer(like, rows):
    """ragged_all_to_all's zero output buffer, [rows, ...] and varying over the manual mesh axes
    `like` (the rows sent) varies over. The op types its result like this buffer alone (jax 0.10,
    0.11): from a plain jnp.zeros the received rows came out typed invariant across the ranks, and
    autodiff then summed their cotangents over the ranks, wrong gradients for the expert weights and
    the input on GPUs."""
    return match_vma(jnp.zeros((rows,) + like.shape[1:], like.dtype), like)


def _dropless_ragged_a2a(cfg, x, idx, weights, wi, wo, gmm, ep_axis, emulate_a2a=False):
    """Expert parallelism the MaxText way: one row per (token, expert) crosses with
    ragged_all_to_all into a worst-case buffer, the receiver sorts its rows by local expert, and the
    results travel back."""
    t, d = x.shape
    k = cfg.top_k
    r = jax.lax.axis_size(ep_axis)
    me = jax.lax.axis_index(ep_axis)
    e_local = cfg.num_experts // r
    xs, order, counts = _sort_by_expert(
        x, idx, cfg.num_experts
    )  # sorted by expert = by destination rank
    all_counts = jax.lax.all_gather(counts, ep_axis)  # [R src, E]
    to_rank = all_counts.reshape(r, r, e_local).sum(-1)  # [src, dst]
    send_sizes = to_rank[me]
    input_offsets = _exclusive_cumsum(send_sizes)
    recv_sizes = to_rank[:, me]
    output_offsets = _exclusive_cumsum(to_rank, axis=0)[me]  # where my block lands in each receiver
    # Each token sends at most min(k, E_local) copies to one rank, from each of R ranks.
    block = t * min(k, e_local)
    cap = block * r
    a2a = partial(_padded_all_to_all, block=block) if emulate_a2a else jax.lax.ragged_all_to_all
    recv = a2a(
        xs,
        _a2a_buffer(xs, cap),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=ep_axis,
    )
    # Received rows: per source rank, sorted by local expert. Sort them by local expert alone.
    local_counts = jax.lax.dynamic_slice_in_dim(
        all_counts, me * e_local, e_local, axis=1
    )  # [R, E_local]
    seg_end = jnp.cumsum(local_counts.reshape(-1))
    seg = jnp.searchsorted(seg_end, jnp.arange(cap, dtype=seg_end.dtype), side="right")
    local_expert = jnp.where(seg < r * e_local, seg % e_local, e_local)  # e_local: an empty row
    order2 = jnp.argsort(local_expert, stable=True)
    ys = _swiglu_grouped(recv[order2], wi, wo, local_counts.sum(0), gmm)
    y_recv = ys[_inverse_permutation(order2)]
    recv_offsets = _exclusive_cumsum(recv_sizes)
    back_offsets = _exclusive_cumsum(to_rank, axis=1)[:, me]  # where each source's rows started
    back = a2a(
        y_recv,
        _a2a_buffer(y_recv, t * k),
        recv_offsets,
        recv_sizes,
        back_offsets,
        send_sizes,
        axis_name=ep_axis,
    )
    y = back[_inverse_permutation(order)].reshape(t, k, d)
    return _weighted_sum(y, weights)


def _dropless_sluice_ep(cfg, x, idx, weights, wi, wo, gmm, ep_axis):
    """Expert parallelism on sluice.ep: each token crosses once to each rank that owns any of its
    experts; the receiver fans rows out by local expert (no argsort), the experts scale each copy
    by its router weight in the SwiGLU, and fan_in/combine sum their outputs in fp32 (rounded once
    per rank to the compute dtype for the trip back). With cfg.ep_rows_factor the buffers hold F
    times the balanced mean and overflow runs in further rounds (sluice.ep.bounded_moe), else they
    are sized for the worst case. Returns (y f32 [T, D], f32 [3]: rounds, the most rows and the
    most (row, slot) pairs a rank received)."""
    # With sluice's gmm the expert block's rows past the groups are never zeroed nor computed
    # (gmm's output, fan_out's, fan_in's gradient, the SwiGLU): only gmm, tgmm, fan_in, fan_out's
    # transpose and row-wise element-wise ops meet them; writing them cost ~6% of an EP 4 step.
    zero_unused = gmm is not _sluice_gmm
    if not zero_unused:
        gmm = _sluice_gmm_unused_rows_unwritten

    def experts(recv, params, max_rows):
        xs, _, fan = ep.fan_out(recv, max_rows=max_rows, zero_unused_rows=zero_unused)
        return _expert_block(xs, *params, fan, gmm, None, kernel=not zero_unused)

    if cfg.ep_rows_factor is not None:
        # Under remat the experts of a round keep only their inputs (the round's received rows)
        rows = ep.bounded_rows(x.shape[0], idx.shape[1], cfg.ep_rows_factor)
        y, st = ep.bounded_moe(
            x,
            idx,
            weights,
            jax.checkpoint(experts, static_argnums=(2,)) if cfg.remat else experts,
            (wi, wo),
            num_experts=cfg.num_experts,
            axis_name=ep_axis,
            rows=rows,
        )
        keys = ("rounds", "peak_recv_rows", "peak_expert_rows")
        return y.astype(jnp.float32), jnp.stack([st[k] for k in keys]).astype(jnp.float32)
    recv = ep.dispatch(x, idx, weights, num_experts=cfg.num_experts, axis_name=ep_axis)

    def local(rx, ri, rw, wi, wo):
        return experts(recv._replace(x=rx, topk_idx=ri, topk_weights=rw), (wi, wo), None)

    # Under remat the whole local part (fan-out, the experts, fan-in: no communication) is one
    # recomputed region: it keeps only the received rows [T*R, H] for the backward pass instead of
    # the expert block's input and output (up to min(k, E/R) times as many rows).
    y = (jax.checkpoint(local) if cfg.remat else local)(
        recv.x, recv.topk_idx, recv.topk_weights, wi, wo
    )
    peaks = jax.lax.pmax(jnp.stack([recv.num_rows, jnp.sum(recv.counts)]), ep_axis)
    info = jnp.concatenate([jnp.ones((1,), jnp.int32), peaks]).astype(jnp.float32)
    return ep.combine(y, recv.handle).astype(jnp.float32), info


def _setup_sluice_ep(cfg: MoEConfig, mesh, axis_name) -> bool:
    """Whether the layer exchanges tokens with sluice.ep on this mesh (the sluice path with
    use_sluice_dispatch); makes the communicator where none is set up for this mesh and axis, or
    where the one set up has other thread blocks than cfg.ep_num_sms asks for (before tracing:
    every layer of a model shares it). An error of sluice.ep.setup (a GPU mesh and a library
    built without CUDA, say) is raised, with the alternative named."""
    if cfg.impl != "sluice" or not cfg.use_sluice_dispatch:
        return False
    comm = ep.communicator(mesh, axis_name)
    if comm is None or (cfg.ep_num_sms is not None and comm.num_sms != cfg.ep_num_sms):
        kw = {} if cfg.ep_num_sms is None else {"num_sms": cfg.ep_num_sms}
        try:
            ep.setup(mesh, axis_name=axis_name, **kw)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            raise type(e)(
                f"{e} (the MoE layer's sluice path with use_sluice_dispatch=True; "
                "use_sluice_dispatch=False, sluice-train --no-sluice-dispatch, exchanges the tokens "
                "with jax.lax.ragged_all_to_all instead)"
            ) from e
    return True


# --------------------------------------------------------------------------------------------------
# The block: route, run the experts, gather statistics. Runs per shard inside shard_map, or alone.


def moe_block(
    cfg: MoEConfig,
    x,
    router_w,
    bias,
    wi,
    wo,
    *,
    ep_axis=None,
    reduce_axes=(),
    emulate_a2a=False,
    sluice_dispatch=False,
    fsdp_axis=None,
):
    """x [B,S,D] (compute dtype) -> (y [B,S,D], stats); wi/wo hold this shard's experts, split along
    d_model over ``fsdp_axis`` when given (gathered here; the backward reduce-scatters)."""
    if fsdp_axis is not None:
        wi = jax.lax.all_gather(wi, fsdp_axis, axis=1, tiled=True)
        wo = jax.lax.all_gather(wo, fsdp_axis, axis=2, tiled=True)
    b, s, d = x.shape
    logits = jnp.dot(x.reshape(b * s, d).astype(jnp.float32), router_w)
    idx, weights, scores = route(cfg, logits, bias)

    def total(v):
        return jax.lax.psum(v, reduce_axes) if reduce_axes else v

    counts = None  # per-expert copies of this shard's tokens, where the path counts them anyway
    ep_info = jnp.zeros((3,), jnp.float32)  # sluice.ep: rounds, peak rows, peak pairs of a rank
    if cfg.impl == "dense":
        y, dropped = _dense(
            cfg, x, idx.reshape(b, s, -1), weights.reshape(b, s, -1), wi, wo, ep_axis
        )
        y = y.reshape(b * s, d)
    else:
        dropped = jnp.zeros((), jnp.float32)
        gmm = _sluice_gmm if cfg.impl == "sluice" and cfg.use_sluice_gmm else _ragged_dot
        xt = x.reshape(b * s, d)
        if ep_axis is None:
            y, counts = _dropless_local(cfg, xt, idx, weights, wi, wo, gmm)
        elif sluice_dispatch:
            y, ep_info = _dropless_sluice_ep(cfg, xt, idx, weights, wi, wo, gmm, ep_axis)
        else:
            y = _dropless_ragged_a2a(cfg, xt, idx, weights, wi, wo, gmm, ep_axis, emulate_a2a)

    if counts is None:
        counts = jnp.bincount(idx.reshape(-1), length=cfg.num_experts)
    load = total(counts.astype(jnp.float32))
    stats = {
        "load": load,
        "dropped": total(dropped) / jnp.sum(load),
        "aux_loss": (
            total(load_balance_loss(scores, idx, counts)) / (total(jnp.ones((), jnp.float32)))
        ),
        # the most over the shards (rounds are the same on every rank of an expert group)
        "ep": jax.lax.pmax(ep_info, reduce_axes) if reduce_axes else ep_info,
    }
    return y.reshape(b, s, d).astype(x.dtype), stats


# --------------------------------------------------------------------------------------------------
# Modules


class RouterBias(nnx.Variable):
    """Per-expert selection bias of aux-loss-free balancing: set by MoE.update_bias, never by a
    gradient."""


class SwiGLU(nnx.Module):
    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.bfloat16,
        init_std=0.02,
        out_init_std=0.02,
    ):
        self.wi = nnx.Param(
            jax.random.normal(rngs.params(), (d_model, 2 * d_ff), jnp.float32) * init_std
        )
        self.wo = nnx.Param(
            jax.random.normal(rngs.params(), (d_ff, d_model), jnp.float32) * out_init_std
        )
        self.dtype = dtype

    def __call__(self, x):
        h = jnp.dot(x, self.wi[...].astype(self.dtype))
        gate, up = jnp.split(h, 2, axis=-1)
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(self.dtype)
        return jnp.dot(act, self.wo[...].astype(self.dtype))


def expert_weight_specs(cfg: MoEConfig, data_axis: str = "data", expert_axis: str = "expert"):
    """PartitionSpecs of the routed experts' wi [E, D, 2F] and wo [E, F, D]: experts over
    ``expert_axis``; with ``cfg.fsdp`` also d_model over ``data_axis``."""
    if cfg.fsdp:
        return P(expert_axis, data_axis, None), P(expert_axis, None, data_axis)
    return P(expert_axis), P(expert_axis)


class MoE(nnx.Module):
    """Routed SwiGLU experts plus optional shared experts. ``__call__(x [B,S,D]) -> (y, stats)``.

    mesh: a ``jax.sharding.Mesh`` with ``data_axis`` and ``expert_axis`` (either may have size 1),
    or None to run on whatever devices jit places the arrays. Expert weights must be sharded over
    ``expert_axis``."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs,
        mesh=None,
        data_axis: str = "data",
        expert_axis: str = "expert",
    ):
        e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
        self.cfg = cfg
        self.router = nnx.Param(
            jax.random.normal(rngs.params(), (d, e), jnp.float32) * cfg.init_std
        )
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.wi = nnx.Param(
            jax.random.normal(rngs.params(), (e, d, 2 * f), jnp.float32) * cfg.init_std
        )
        self.wo = nnx.Param(
            jax.random.normal(rngs.params(), (e, f, d), jnp.float32) * cfg.out_init_std
        )
        self.shared = (
            SwiGLU(
                d,
                cfg.num_shared_experts * f,
                rngs=rngs,
                dtype=cfg.dtype,
                init_std=cfg.init_std,
                out_init_std=cfg.out_init_std,
            )
            if cfg.num_shared_experts
            else None
        )
        self.mesh = mesh
        self.data_axis = data_axis
        self.expert_axis = expert_axis
        if mesh is not None and e % mesh.shape[expert_axis]:
            raise ValueError(
                f"num_experts={e} is not divisible by the expert axis size "
                f"{mesh.shape[expert_axis]}"
            )
        if mesh is not None and cfg.fsdp and d % mesh.shape[data_axis]:
            raise ValueError(
                f"fsdp: d_model={d} is not divisible by the data axis size {mesh.shape[data_axis]}"
            )
        self.sluice_dispatch = (
            mesh is not None
            and mesh.shape[expert_axis] > 1
            and _setup_sluice_ep(cfg, mesh, expert_axis)
        )

    def __call__(self, x):
        cfg = self.cfg
        args = (
            x.astype(cfg.dtype),
            self.router[...],
            self.bias[...],
            self.wi[...].astype(cfg.dtype),
            self.wo[...].astype(cfg.dtype),
        )
        if self.mesh is None:
            y, stats = moe_block(cfg, *args)
        else:
            ep = self.expert_axis if self.mesh.shape[self.expert_axis] > 1 else None
            axes = (self.data_axis, self.expert_axis)
            fsdp = cfg.fsdp and self.mesh.shape[self.data_axis] > 1
            fn = partial(
                moe_block,
                cfg,
                ep_axis=ep,
                reduce_axes=axes,
                emulate_a2a=self.mesh.devices.flat[0].platform == "cpu",
                sluice_dispatch=self.sluice_dispatch,
                fsdp_axis=self.data_axis if fsdp else None,
            )
            tokens = P(axes)
            wi_spec, wo_spec = expert_weight_specs(cfg, self.data_axis, self.expert_axis)
            y, stats = jax.shard_map(
                fn,
                mesh=self.mesh,
                in_specs=(tokens, P(), P(), wi_spec, wo_spec),
                out_specs=(tokens, P()),
            )(*args)
        if self.shared is not None:
            y = y + self.shared(x.astype(cfg.dtype))
        return y, stats

    def describe(self) -> str:
        """The expert path in words, e.g. 'sluice: sluice.gmm, EP 2 over sluice.ep'."""
        cfg = self.cfg
        if cfg.impl == "dense":
            what = f"dense: capacity factor {cfg.capacity_factor:g}, drops"
        else:
            gmm = (
                "sluice.gmm"
                if cfg.impl == "sluice" and cfg.use_sluice_gmm
                else "jax.lax.ragged_dot"
            )
            what = f"{cfg.impl}: {gmm}, dropless"
        r = 1 if self.mesh is None else self.mesh.shape[self.expert_axis]
        if r > 1:
            how = (
                "all_to_all"
                if cfg.impl == "dense"
                else ("sluice.ep" if self.sluice_dispatch else "ragged_all_to_all")
            )
            what += f", EP {r} over {how}"
        return what

    def update_bias(self, load):
        """Aux-loss-free balancing: raise under-loaded experts' bias, lower over-loaded ones'."""
        rate = self.cfg.bias_update_rate
        if rate:
            self.bias[...] = self.bias[...] + rate * jnp.sign(jnp.mean(load) - load)

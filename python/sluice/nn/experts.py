"""The MoE layer's expert computation, one function per path and exchange (moe.py routes and
calls them; each runs per shard inside shard_map, or alone):

- ``capacity_path``: the capacity-factor path (``impl="dense"``), with all_to_all under EP.
- ``dropless_local``: the dropless paths with every expert local (sluice's fan-out/fan-in, or
  argsort and ragged_dot).
- ``dropless_ragged_a2a``: expert parallelism over ``jax.lax.ragged_all_to_all``.
- ``dropless_sluice_ep``: expert parallelism over sluice.ep (bounded rounds or worst-case buffers).

The dropless paths multiply by an ``ExpertMatmul``: sluice.gmm (in FP8 with a Recipe) or
jax.lax.ragged_dot.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from ..ops import ep
from ..ops.fp8 import Fp8Weight, Recipe
from ..ops.gmm import gmm as sluice_gmm
from ..ops.swiglu import swiglu as sluice_swiglu
from ..ops.vma import match_vma

if TYPE_CHECKING:
    from .moe import MoEConfig


def capacity(seq_len: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert per sequence (dense path); at most seq_len: top-k experts are distinct."""
    return max(1, min(seq_len, math.ceil(seq_len * top_k / num_experts * capacity_factor)))


@dataclasses.dataclass(frozen=True)
class ExpertMatmul:
    """The dropless paths' expert matmul ``(lhs, rhs, group_sizes) -> out``: sluice.gmm (sluice),
    in FP8 with ``fp8`` a Recipe, or jax.lax.ragged_dot.

    zero_unused_rows=False leaves sluice.gmm's rows past the groups unwritten: for the sluice.ep
    expert block, sized for the worst case (or ep_rows_factor times the mean), whose unused rows
    only ever meet row-wise element-wise ops and ops that read the groups' rows alone (gmm, tgmm,
    fan_in, fan_out's transpose; FP8 scales are per row there, or taken over the groups' rows
    only): zeroing them cost ~3% of an EP 4 step."""

    sluice: bool
    fp8: Recipe | None = None
    zero_unused_rows: bool = True

    @staticmethod
    def of(cfg: MoEConfig) -> ExpertMatmul:
        return ExpertMatmul(sluice=cfg.impl == "sluice" and cfg.use_sluice_gmm, fp8=cfg.fp8)

    @property
    def fanned_fp8(self) -> bool:
        """Whether the expert block reads fan_out's rows where they are (sluice.ep.fanned_gmm and
        gmm_fan_in: sluice's FP8 gmm, the quantization fused into the row copies)."""
        return self.sluice and self.fp8 is not None

    def __call__(self, lhs, rhs, group_sizes):
        if isinstance(rhs, Fp8Weight):  # (only sluice.ep's fanned FP8 calls take these)
            raise TypeError("ExpertMatmul: an fp8.Fp8Weight needs the fanned FP8 expert block")
        if not self.sluice:
            return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes)
        return sluice_gmm(
            lhs, rhs, group_sizes, zero_unused_rows=self.zero_unused_rows, fp8=self.fp8
        )


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
    return _swiglu_of(h, xs.dtype, group_sizes, row_w, kernel, zero_unused_rows)


def _swiglu_of(h, dtype, group_sizes, row_w, kernel, zero_unused_rows):
    if kernel:
        return sluice_swiglu(h, group_sizes, row_weights=row_w, zero_unused_rows=zero_unused_rows)
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32) * row_w[:, None]
    return act.astype(dtype)


def _swiglu_rows(h, dtype, fan, kernel):
    """_weighted_swiglu's SwiGLU of the gate/up projection h [M, 2F] of fan's rows."""
    row_w = _row_weights(fan, h.shape[0])
    return _swiglu_of(h, dtype, fan.group_sizes, row_w, kernel, fan.zero_unused_rows)


def _expert_block(xs, wi, wo, fan, gmm, out_dtype=None, kernel=False):
    """The experts on fan_out's rows xs, summed back per token: ``ep.fan_in(swiglu_down(xs), fan)``
    with the router weights applied to the activations before the down projection instead of to
    its outputs (the same sum, in another order of rounding). So fan_in sums unweighted rows, and
    nothing keeps the expert outputs [M, D] for the router weights' gradient: it is
    sum_j d act[r, j] * (silu(gate) * up)[r, j], which sluice.swiglu's backward (or XLA's fusion of
    it) sums from what it reads anyway. kernel: the SwiGLU by sluice.swiglu (its unused rows as
    fan_out's: fan.zero_unused_rows).
    With gmm.fanned_fp8, xs is fan_out's input (the fan from fan_out(..., copy_rows=False)), and
    the two ends run as sluice.ep.fanned_gmm and gmm_fan_in: the same values, without the copies
    of the rows in bf16 (forward) and of d out (backward); with kernel too, the whole block runs
    as sluice.ep.fanned_swiglu_mlp, which also never writes the activation nor its gradient in
    bf16 (the router weights' gradient then equal up to float32 rounding)."""
    if gmm.fanned_fp8 and kernel:
        skip = not gmm.zero_unused_rows
        row_w = _row_weights(fan, fan.rows)
        return ep.fanned_swiglu_mlp(
            xs, fan, wi, wo, row_weights=row_w, fp8=gmm.fp8, out_dtype=out_dtype,
            skip_unused_rows=skip,
        )  # fmt: skip
    if gmm.fanned_fp8:
        skip = not gmm.zero_unused_rows
        h = ep.fanned_gmm(xs, fan, wi, fp8=gmm.fp8, skip_unused_rows=skip)
        act = _swiglu_rows(h, xs.dtype, fan, kernel)
        return ep.gmm_fan_in(act, wo, fan, fp8=gmm.fp8, out_dtype=out_dtype, skip_unused_rows=skip)
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


def capacity_path(cfg, x, idx, weights, wi, wo, ep_axis):
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


def dropless_local(cfg, x, idx, weights, wi, wo, gmm):
    """x [T,D], all experts local -> (y [T,D], per-expert copy counts, int32 [E])."""
    t, d = x.shape
    if gmm.sluice:
        # sluice's counting-sort fan-out/fan-in (C/CUDA, no argsort, no scatter-add in the backward).
        # (with FP8 the layout alone: the expert block reads x's rows where they are)
        xs, counts, fan = ep.fan_out_tokens(
            x, idx, weights, num_experts=cfg.num_experts, copy_rows=not gmm.fanned_fp8
        )
        xs = x if gmm.fanned_fp8 else xs
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


def dropless_ragged_a2a(cfg, x, idx, weights, wi, wo, gmm, ep_axis, emulate_a2a=False):
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


def dropless_sluice_ep(cfg, x, idx, weights, wi, wo, gmm, ep_axis):
    """Expert parallelism on sluice.ep: each token crosses once to each rank that owns any of its
    experts; the receiver fans rows out by local expert (no argsort), the experts scale each copy
    by its router weight in the SwiGLU, and fan_in/combine sum their outputs in fp32 (rounded once
    per rank to the compute dtype for the trip back). With cfg.ep_rows_factor the buffers hold F
    times the balanced mean and overflow runs in further rounds (sluice.ep.bounded_moe), else they
    are sized for the worst case. With cfg.fp8 and cfg.fp8_dispatch the rows travel in FP8 (by the
    experts' recipe). Returns (y f32 [T, D], f32 [3]: rounds, the most rows and the
    most (row, slot) pairs a rank received)."""
    # With sluice's gmm the expert block's rows past the groups are never zeroed nor computed
    # (gmm's output, fan_out's, fan_in's gradient, the SwiGLU): only gmm, tgmm, fan_in, fan_out's
    # transpose and row-wise element-wise ops meet them; writing them cost ~6% of an EP 4 step.
    zero_unused = not gmm.sluice
    if gmm.sluice:
        gmm = dataclasses.replace(gmm, zero_unused_rows=False)

    def experts(recv, params, max_rows):
        xs, _, fan = ep.fan_out(
            recv, max_rows=max_rows, zero_unused_rows=zero_unused, copy_rows=not gmm.fanned_fp8
        )
        xs = recv.x if gmm.fanned_fp8 else xs
        return _expert_block(xs, *params, fan, gmm, None, kernel=not zero_unused)

    fp8 = cfg.fp8 if cfg.fp8_dispatch else None
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
            fp8=fp8,
        )
        keys = ("rounds", "peak_recv_rows", "peak_expert_rows")
        return y.astype(jnp.float32), jnp.stack([st[k] for k in keys]).astype(jnp.float32)
    recv = ep.dispatch(x, idx, weights, num_experts=cfg.num_experts, axis_name=ep_axis, fp8=fp8)

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


def setup_sluice_ep(cfg: MoEConfig, mesh, axis_name) -> bool:
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

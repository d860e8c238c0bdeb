"""dispatch and combine: the exchange ops of sluice.ep with their VJPs (dispatch's backward is a
combine, combine's a dispatch that reuses the layout). See sluice.ep's docstring."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._lib import register_targets
from ..vma import _vary_kw, _varying, match_vma
from ._common import check_float as _check_float
from ._common import sds as _sds
from .comm import _comm_for, _where

register_targets(
    {
        "sluice_ep_dispatch": "sl_ffi_ep_dispatch",
        "sluice_ep_combine": "sl_ffi_ep_combine",
        "sluice_ep_redispatch": "sl_ffi_ep_redispatch",
    }
)

_TAGS = itertools.count(1)


def _tag() -> np.int64:
    # A fresh tag per op instance: the n-th run of an instance meets the n-th run on the peers.
    return np.int64(next(_TAGS))


# ---- the pytrees ---------------------------------------------------------------------------------
@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["send_row", "recv_src"],
    meta_fields=["comm_id", "axis_name", "num_ranks", "num_experts"],
)
@dataclasses.dataclass(frozen=True)
class Handle:
    """The layout of one dispatch, for combine (and for dispatch's and combine's backward).

    send_row int32 [T, R]: the row of token t in rank d's received buffer, -1 if not sent there.
    recv_src int32 [N]: s*T + t for a received row from token t of rank s, -1 past num_rows.
    """

    send_row: jax.Array
    recv_src: jax.Array
    comm_id: int
    axis_name: str
    num_ranks: int
    num_experts: int


class Dispatched(NamedTuple):
    """What dispatch returns on each rank (see sluice.ep's docstring)."""

    x: jax.Array
    topk_idx: jax.Array
    topk_weights: jax.Array
    num_rows: jax.Array
    counts: jax.Array
    handle: Handle


# ---- raw FFI calls -------------------------------------------------------------------------------
def _axes_of(where):
    # `where` comes from axis_index: it varies over exactly the mesh axes of the exchange's group.
    return _varying(where)


def _exchange(call, cfg, *args):
    """Runs an exchange op's FFI call; cfg = (comm_id, num_ranks, num_experts)."""
    comm_id, num_ranks, num_experts = cfg
    attrs = {
        "comm_id": np.int64(comm_id),
        "num_ranks": np.int64(num_ranks),
        "num_experts": np.int64(num_experts),
        "tag": _tag(),
    }
    return call(*args, **attrs)


def _dispatch_call(x, idx, w, where, cfg, rows=None):
    """rows: the receive buffer's rows N (None: T*R, the worst case)."""
    t, h = x.shape
    k = idx.shape[1]
    _, r, e = cfg
    n, l = (t * r if rows is None else rows), e // r
    v = _vary_kw(x, idx, w, where, extra=_axes_of(where))
    outs = (
        _sds((n, h), x.dtype, v),
        _sds((n, k), jnp.int32, v),
        _sds((n, k), jnp.float32, v),
        _sds((1,), jnp.int32, v),
        _sds((l,), jnp.int32, v),
        _sds((t, r), jnp.int32, v),
        _sds((n,), jnp.int32, v),
    )
    call = jax.ffi.ffi_call(
        "sluice_ep_dispatch", outs, vmap_method="sequential", has_side_effect=True
    )
    return _exchange(call, cfg, x, idx, w, where)


def _combine_call(y, y_w, send_row, where, cfg):
    t = send_row.shape[0]
    refs = (y, send_row, where) if y_w is None else (y, y_w, send_row, where)
    v = _vary_kw(*refs, extra=_axes_of(where))
    if y_w is None:
        call = jax.ffi.ffi_call(
            "sluice_ep_combine",
            (_sds((t, y.shape[1]), y.dtype, v),),
            vmap_method="sequential",
            has_side_effect=True,
        )
        return _exchange(call, cfg, y, send_row, where)[0], None
    call = jax.ffi.ffi_call(
        "sluice_ep_combine",
        (_sds((t, y.shape[1]), y.dtype, v), _sds((t, y_w.shape[1]), jnp.float32, v)),
        vmap_method="sequential",
        has_side_effect=True,
    )
    out, out_w = _exchange(call, cfg, y, y_w, send_row, where)
    return out, out_w


def _redispatch_call(g, recv_src, where, cfg):
    v = _vary_kw(g, recv_src, where, extra=_axes_of(where))
    call = jax.ffi.ffi_call(
        "sluice_ep_redispatch",
        (_sds((recv_src.shape[0], g.shape[1]), g.dtype, v),),
        vmap_method="sequential",
        has_side_effect=True,
    )
    return _exchange(call, cfg, g, recv_src, where)[0]


# ---- dispatch with its VJP -----------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dispatch(x, idx, w, where, cfg, rows):
    return _dispatch_call(x, idx, w, where, cfg, rows)


def _dispatch_fwd(x, idx, w, where, cfg, rows):
    outs = _dispatch_call(x, idx, w, where, cfg, rows)
    return outs, (outs[1], outs[5], where, x[:0], w[:0])  # [:0]: only the types are kept


def _dispatch_bwd(cfg, rows, res, cts):
    recv_idx, send_row, where, x, w = res
    ct_x, _, ct_w = cts[0], cts[1], cts[2]
    # A weight reaches the one rank owning its expert; elsewhere its slot holds a constant 0.
    ct_w = jnp.where(recv_idx >= 0, ct_w.astype(jnp.float32), 0.0)
    dx, dw = _combine_call(ct_x, ct_w, send_row, where, cfg)
    return match_vma(dx, x), None, match_vma(dw, w), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# ---- FP8 dispatch: rows travel as e4m3 with their 1x128 scales -----------------------------------
def _pack_fp8(x, power_of_two):
    """x [T, H] -> the bytes of its e4m3 rows and their f32 scales (fp8.ACT blocks) side by side,
    [T, H + 4 ceil(H/128) (+1 to make it even)] viewed as bfloat16 pairs: the exchange moves rows
    of bytes, whatever their dtype."""
    from ..fp8 import ACT, quantize

    q, s = quantize(x, ACT, power_of_two=power_of_two)
    t = x.shape[0]
    raw = jnp.concatenate(
        [
            jax.lax.bitcast_convert_type(q, jnp.uint8),
            jax.lax.bitcast_convert_type(s, jnp.uint8).reshape(t, -1),
        ],
        axis=1,
    )
    if raw.shape[1] % 2:
        raw = jnp.pad(raw, ((0, 0), (0, 1)))
    return jax.lax.bitcast_convert_type(raw.reshape(t, -1, 2), jnp.bfloat16)


def _unpack_fp8(packed, h, dtype):
    """The inverse of _pack_fp8 on received rows: dequantized to `dtype` (fp8.dequantize)."""
    from ..fp8 import ACT, E4M3, dequantize

    n = packed.shape[0]
    raw = jax.lax.bitcast_convert_type(packed, jnp.uint8).reshape(n, -1)
    hb = -(-h // 128)
    q = jax.lax.bitcast_convert_type(raw[:, :h], E4M3)
    s = jax.lax.bitcast_convert_type(raw[:, h : h + 4 * hb].reshape(n, hb, 4), jnp.float32)
    return dequantize(q, s, ACT, dtype=dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _dispatch_fp8(x, idx, w, where, cfg, rows, power_of_two):
    return _dispatch_fp8_fwd(x, idx, w, where, cfg, rows, power_of_two)[0]


def _dispatch_fp8_fwd(x, idx, w, where, cfg, rows, power_of_two):
    outs = _dispatch_call(_pack_fp8(x, power_of_two), idx, w, where, cfg, rows)
    outs = (_unpack_fp8(outs[0], x.shape[1], x.dtype), *outs[1:])
    return outs, (outs[1], outs[5], where, x[:0], w[:0])


def _dispatch_fp8_bwd(cfg, rows, power_of_two, res, cts):
    # the quantization passes the gradient straight through: the backward is BF16 dispatch's
    return _dispatch_bwd(cfg, rows, res, cts)


_dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)


def dispatch(
    x,
    topk_idx,
    topk_weights,
    *,
    num_experts: int,
    axis_name,
    recv_rows: int | None = None,
    fp8=None,
) -> Dispatched:
    """Sends each token once to every rank owning one of its experts. See sluice.ep's docstring.
    recv_rows: the rows N of the receive buffer (default T*R, the worst case); the caller makes
    sure no rank receives more (on the CPU more is an error on every rank; on a GPU the rows past
    N are not delivered): sluice.ep.bounded_moe sends them in rounds.
    fp8: None (rows travel in x's dtype), True or a sluice.fp8.Recipe: rows travel as e4m3 with
    their 1x128 block scales (sluice.fp8.ACT; H + 4 ceil(H/128) bytes a row, about half of bf16's)
    and arrive dequantized to x's dtype: recv.x = dequantize(quantize(x)) of the rows sent, the
    values the FP8 expert matmul would have made of them. The gradient passes the quantization
    straight through (the backward is the BF16 dispatch's combine)."""
    x, topk_idx, topk_weights = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_weights)
    if x.ndim != 2:
        raise ValueError(f"sluice.ep.dispatch: x must be 2-D [T, H], got shape {x.shape}")
    _check_float("dispatch", "x", x)
    if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.shape[1] < 1:
        raise ValueError(
            f"sluice.ep.dispatch: topk_idx must be [T, k] with T = {x.shape[0]} and "
            f"k >= 1, got shape {topk_idx.shape}"
        )
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"sluice.ep.dispatch: topk_idx must be int32, got {topk_idx.dtype}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"sluice.ep.dispatch: topk_weights must have topk_idx's shape "
            f"{topk_idx.shape}, got {topk_weights.shape}"
        )
    if topk_weights.dtype != jnp.float32:
        raise TypeError(
            f"sluice.ep.dispatch: topk_weights must be float32, got {topk_weights.dtype}"
        )
    comm = _comm_for("dispatch", axis_name)
    num_experts = int(num_experts)
    if num_experts < 1 or num_experts % comm.num_ranks:
        raise ValueError(
            f"sluice.ep.dispatch: num_experts={num_experts} is not a positive multiple of "
            f"the {comm.num_ranks} ranks of axis {axis_name!r}"
        )
    worst = x.shape[0] * comm.num_ranks
    if recv_rows is not None:
        if not isinstance(recv_rows, (int, np.integer)) or not 1 <= recv_rows <= max(worst, 1):
            raise ValueError(
                f"sluice.ep.dispatch: recv_rows must be an int in [1, T*R = {worst}] or None, "
                f"got {recv_rows!r}"
            )
        recv_rows = min(int(recv_rows), worst)
    cfg = (comm.comm_id, comm.num_ranks, num_experts)
    from ..gmm_fp8 import as_recipe

    recipe = as_recipe(fp8, "sluice.ep.dispatch")
    if recipe is None:
        outs = _dispatch(x, topk_idx, topk_weights, _where(comm), cfg, recv_rows)
    else:
        p2 = recipe.power_of_two_scales
        outs = _dispatch_fp8(x, topk_idx, topk_weights, _where(comm), cfg, recv_rows, p2)
    rx, ri, rw, nr, cn, sr, rs = outs
    handle = Handle(sr, rs, comm.comm_id, axis_name, comm.num_ranks, num_experts)
    return Dispatched(rx, ri, rw, nr[0], cn, handle)


# ---- combine with its VJP ------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(y, send_row, recv_src, where, cfg):
    return _combine_call(y, None, send_row, where, cfg)[0]


def _combine_fwd(y, send_row, recv_src, where, cfg):
    return _combine_call(y, None, send_row, where, cfg)[0], (recv_src, where, y[:0])


def _combine_bwd(cfg, res, ct):
    recv_src, where, y = res
    return match_vma(_redispatch_call(ct, recv_src, where, cfg), y), None, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y, handle: Handle):
    """Sends each received row back to its source token and sums a token's rows in rank order (f32)."""
    y = jnp.asarray(y)
    if not isinstance(handle, Handle):
        raise TypeError(
            f"sluice.ep.combine: handle must be dispatch(...).handle, got {type(handle)}"
        )
    n = handle.recv_src.shape[0]
    if y.ndim != 2 or y.shape[0] != n:
        raise ValueError(
            f"sluice.ep.combine: y must be [N, H] with N = {n} (dispatch's rows), "
            f"got shape {y.shape}"
        )
    _check_float("combine", "y", y)
    comm = _comm_for("combine", handle.axis_name)
    if comm.comm_id != handle.comm_id:
        raise RuntimeError(
            "sluice.ep.combine: the handle comes from a communicator that was replaced "
            "(sluice.ep.setup was called again); dispatch again"
        )
    cfg = (comm.comm_id, comm.num_ranks, handle.num_experts)
    return _combine(y, handle.send_row, handle.recv_src, _where(comm), cfg)

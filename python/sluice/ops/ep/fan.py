"""fan_out / fan_in: the local half of sluice.ep, on the receiving rank. fan_out puts received
rows (or a device's own tokens, fan_out_tokens) in expert order with group sizes for gmm, by a
counting sort; fan_in sums the expert outputs back per row with the router weights. See sluice.ep's
docstring."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._lib import register_targets
from ..capi import fan_workspace_bytes
from ..vma import _vary_kw, match_vma
from ._common import FLOATS as _FLOATS
from ._common import check_float as _check_float
from ._common import sds as _sds
from .exchange import Dispatched

register_targets(
    {
        "sluice_ep_fan_out": "sl_ffi_ep_fan_out",
        "sluice_ep_fan_in": "sl_ffi_ep_fan_in",
        "sluice_ep_fan_in_bwd": "sl_ffi_ep_fan_in_bwd",
    }
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["pos", "weights", "group_sizes"],
    meta_fields=["num_local_experts", "max_rows", "zero_unused_rows"],
)
@dataclasses.dataclass(frozen=True)
class Fan:
    """fan_out's layout: pos int32 [N, k] (the row of xs of each (row, slot), -1 where not local),
    the router weights [N, k] fan_in applies, and the group sizes [L]."""

    pos: jax.Array
    weights: jax.Array
    group_sizes: jax.Array
    num_local_experts: int
    max_rows: int = 0  # fan_out's bound on M (0: none)
    zero_unused_rows: bool = True  # fan_out's rows past the pairs zeroed (False: on CUDA unwritten)

    @property
    def rows(self) -> int:
        """M: the rows of fan_out's output (the expert block)."""
        n, k = self.pos.shape
        return _fan_rows(n, k, self.num_local_experts, self.max_rows)


def _fan_rows(n, k, l, max_rows=0):
    """M: the rows of fan_out's output, N * min(k, L) or max_rows where that is smaller (> 0)."""
    worst = n * min(k, l)
    return min(worst, max_rows) if max_rows > 0 else worst


def _fan_attrs(l, max_rows, zero_unused_rows):
    return {
        "num_local_experts": np.int64(l),
        "max_rows": np.int64(max_rows),
        "skip_unused_rows": np.int64(not zero_unused_rows),
    }


def _fan_out_call(x, idx, l, max_rows, zero_unused_rows=True):
    n, h = x.shape
    k = idx.shape[1]
    v = _vary_kw(x, idx)
    call = jax.ffi.ffi_call(
        "sluice_ep_fan_out",
        (
            _sds((_fan_rows(n, k, l, max_rows), h), x.dtype, v),
            _sds((l,), jnp.int32, v),
            _sds((n, k), jnp.int32, v),
            _sds((fan_workspace_bytes(n, h, k, l),), jnp.uint8, v),
        ),
        vmap_method="sequential",
    )
    return call(x, idx, **_fan_attrs(l, max_rows, zero_unused_rows))[:3]


def _fan_in_call(ys, w, pos, l, out_dtype):
    n = pos.shape[0]
    call = jax.ffi.ffi_call(
        "sluice_ep_fan_in",
        (_sds((n, ys.shape[1]), out_dtype, _vary_kw(ys, w, pos)),),
        vmap_method="sequential",
    )
    # ys holds fan_out's M rows: M passes as max_rows (the handler checks it against N, k and L)
    return call(ys, w, pos, **_fan_attrs(l, ys.shape[0], True))[0]


def _fan_in_bwd_call(dout, ys, w, pos, group_sizes, l, zero_unused_rows=True, with_dw=True):
    """(dys, dw); with_dw=False: dys alone, ys not read (weights that need no gradient: ys may then
    be any [M, 0] array of its dtype)."""
    if not with_dw:
        v = _vary_kw(dout, w, pos, group_sizes)
        call = jax.ffi.ffi_call(
            "sluice_ep_fan_in_bwd",
            (_sds((ys.shape[0], dout.shape[1]), ys.dtype, v),),
            vmap_method="sequential",
        )
        attrs = _fan_attrs(l, ys.shape[0], zero_unused_rows)
        return call(dout, w, pos, group_sizes, with_dw=np.int64(0), **attrs)[0]
    v = _vary_kw(dout, ys, w, pos, group_sizes)
    call = jax.ffi.ffi_call(
        "sluice_ep_fan_in_bwd",
        (_sds(ys.shape, ys.dtype, v), _sds(w.shape, jnp.float32, v)),
        vmap_method="sequential",
    )
    return call(
        dout,
        ys,
        w,
        pos,
        group_sizes,
        with_dw=np.int64(1),
        **_fan_attrs(l, ys.shape[0], zero_unused_rows),
    )


# ---- fan_out / fan_in with their VJPs ------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fan_out(x, idx, l, max_rows, zero_unused_rows):
    return tuple(_fan_out_call(x, idx, l, max_rows, zero_unused_rows))


def _fan_out_fwd(x, idx, l, max_rows, zero_unused_rows):
    xs, gs, pos = _fan_out_call(x, idx, l, max_rows, zero_unused_rows)
    return (xs, gs, pos), (pos, x[:0])


def _fan_out_bwd(l, max_rows, zero_unused_rows, res, cts):
    pos, x = res
    dxs = cts[0]  # xs has x's dtype, so does its cotangent
    # Each row of x was copied to the rows pos[i, :] of xs: its gradient is their sum (fan_in with 1s).
    ones = jnp.where(pos >= 0, 1.0, 0.0).astype(jnp.float32)
    return match_vma(_fan_in_call(dxs, ones, pos, l, dxs.dtype), x), None


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fan_layout(x0, idx, l, max_rows, zero_unused_rows):
    """fan_out's layout alone, (group_sizes, pos): the kernel on x's rows cut to width 0, x0. Its
    outputs are integers, so its gradient in x0 is empty (the rule exists for transformations that
    ask: the kernel call itself has none)."""
    return tuple(_fan_out_call(x0, idx, l, max_rows, zero_unused_rows)[1:])


def _fan_layout_fwd(x0, idx, l, max_rows, zero_unused_rows):
    return _fan_layout(x0, idx, l, max_rows, zero_unused_rows), x0


def _fan_layout_bwd(l, max_rows, zero_unused_rows, x0, cts):
    return jnp.zeros_like(x0), None


_fan_layout.defvjp(_fan_layout_fwd, _fan_layout_bwd)


def _fan_out_checked(op, x, idx, weights, l, max_rows, zero_unused_rows=True, copy_rows=True):
    if not isinstance(zero_unused_rows, (bool, np.bool_)):
        raise TypeError(
            f"sluice.ep.{op}: zero_unused_rows must be a bool, got "
            f"{type(zero_unused_rows).__name__}"
        )
    zero_unused_rows = bool(zero_unused_rows)
    if max_rows is None:
        max_rows = 0
    elif not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"sluice.ep.{op}: max_rows must be an int >= 1 or None, got {max_rows!r}")
    max_rows = int(max_rows)
    x, idx = jnp.asarray(x), jnp.asarray(idx)
    if x.ndim != 2 or idx.ndim != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"sluice.ep.{op}: x [N, H] and topk_idx [N, k] expected, got {x.shape} and {idx.shape}"
        )
    _check_float(op, "x", x)
    if idx.dtype != jnp.int32:
        raise TypeError(f"sluice.ep.{op}: topk_idx must be int32, got {idx.dtype}")
    if jnp.shape(weights) != idx.shape:
        raise ValueError(
            f"sluice.ep.{op}: topk_weights must have topk_idx's shape {idx.shape}, got "
            f"{jnp.shape(weights)}"
        )
    if not isinstance(copy_rows, (bool, np.bool_)):
        raise TypeError(f"sluice.ep.{op}: copy_rows must be a bool, got {type(copy_rows).__name__}")
    if copy_rows:
        xs, gs, pos = _fan_out(x, idx, l, max_rows, zero_unused_rows)
    else:
        xs = None
        gs, pos = _fan_layout(x[:, :0], idx, l, max_rows, zero_unused_rows)
    return xs, gs, Fan(pos, jnp.asarray(weights, jnp.float32), gs, l, max_rows, zero_unused_rows)


def fan_out(
    recv: Dispatched,
    *,
    max_rows: int | None = None,
    zero_unused_rows: bool = True,
    copy_rows: bool = True,
):
    """Expert-sorted rows for gmm: (xs [M, H], group_sizes int32 [L], fan); see sluice.ep's
    docstring.
    max_rows bounds M (default: the worst case N*min(k, L)); the (row, slot) pairs past it are left
    out (pos -1, not in group_sizes): their count is sum(topk_idx >= 0) - sum(group_sizes).
    zero_unused_rows=False leaves xs's rows past sum(group_sizes), and those of fan_in's gradient
    with respect to ys, unwritten on CUDA (whatever the buffer held; the CPU zeroes them anyway):
    for callers that read only the groups' rows (gmm, tgmm, row-wise ops), where zeroing them is a
    write of up to M rows for nothing.
    copy_rows=False makes the layout alone (xs is None): for `fanned_gmm`, which reads the rows
    where they are."""
    return _fan_out_checked(
        "fan_out",
        recv.x,
        recv.topk_idx,
        recv.topk_weights,
        int(recv.counts.shape[0]),
        max_rows,
        zero_unused_rows,
        copy_rows,
    )


def fan_out_tokens(x, topk_idx, topk_weights, *, num_experts: int, copy_rows: bool = True):
    """fan_out for tokens that stay on their device (all experts local, no dispatch): the token copies
    of x [T, H] in expert order, (xs [T*min(k, E), H], group_sizes int32 [E], fan), by a counting sort
    (no argsort; the backward is a gather-sum, no scatter-add). ``fan_in(ys, fan)`` sums them back
    with the weights. topk_idx int32 [T, k] in [-1, E) (-1: no expert)."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(
            f"sluice.ep.fan_out_tokens: num_experts must be an int >= 1, got {num_experts!r}"
        )
    return _fan_out_checked(
        "fan_out_tokens", x, topk_idx, topk_weights, num_experts, None, copy_rows=copy_rows
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fan_in(ys, w, pos, group_sizes, l, out_dtype, zero_unused_rows):
    return _fan_in_call(ys, w, pos, l, out_dtype)


def _fan_in_fwd(ys, w, pos, group_sizes, l, out_dtype, zero_unused_rows):
    return _fan_in_call(ys, w, pos, l, out_dtype), (ys, w, pos, group_sizes)


def _fan_in_bwd(l, out_dtype, zero_unused_rows, res, dout):
    ys, w, pos, group_sizes = res
    dys, dw = _fan_in_bwd_call(dout, ys, w, pos, group_sizes, l, zero_unused_rows)
    return match_vma(dys, ys), match_vma(dw, w), None, None


_fan_in.defvjp(_fan_in_fwd, _fan_in_bwd)


def _ones(pos):
    return jnp.where(pos >= 0, 1.0, 0.0).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fan_sum(ys, pos, group_sizes, l, out_dtype, zero_unused_rows):
    return _fan_in_call(ys, _ones(pos), pos, l, out_dtype)


def _fan_sum_fwd(ys, pos, group_sizes, l, out_dtype, zero_unused_rows):
    # keeps the layout and ys's shape, not ys: the backward copies d out to the rows
    out = _fan_sum(ys, pos, group_sizes, l, out_dtype, zero_unused_rows)
    return out, (pos, group_sizes, ys[:, :0])  # [M, 0]: ys's rows and type, no data


def _fan_sum_bwd(l, out_dtype, zero_unused_rows, res, dout):
    pos, group_sizes, ys = res
    # d out in its own dtype (the kernel rounds each row once to ys's)
    dys = _fan_in_bwd_call(dout, ys, _ones(pos), pos, group_sizes, l, zero_unused_rows, False)
    return match_vma(dys, ys), None, None


_fan_sum.defvjp(_fan_sum_fwd, _fan_sum_bwd)


def fan_in(ys, fan: Fan, *, out_dtype=None, weighted: bool = True):
    """out[i] = sum_j fan.weights[i, j] * ys[fan.pos[i, j]] (f32, slot order); see sluice.ep's
    docstring.
    weighted=False sums the rows unweighted (for experts that applied the weights themselves, e.g.
    ``sluice.swiglu(..., row_weights=...)``): its backward copies d out to the rows and keeps no
    ys (no gradient for fan.weights)."""
    ys = jnp.asarray(ys)
    if not isinstance(fan, Fan):
        raise TypeError(f"sluice.ep.fan_in: fan must come from fan_out, got {type(fan)}")
    m = fan.rows
    if ys.ndim != 2 or ys.shape[0] != m:
        raise ValueError(
            f"sluice.ep.fan_in: ys must be [M, H] with M = {m} (fan_out's rows), got "
            f"shape {ys.shape}"
        )
    _check_float("fan_in", "ys", ys)
    out_dtype = jnp.dtype(out_dtype or ys.dtype)
    if out_dtype not in _FLOATS:
        raise TypeError(
            f"sluice.ep.fan_in: out_dtype must be float32, bfloat16 or float16, got {out_dtype}"
        )
    if not isinstance(weighted, (bool, np.bool_)):
        raise TypeError(f"sluice.ep.fan_in: weighted must be a bool, got {type(weighted).__name__}")
    if not weighted:
        return _fan_sum(
            ys, fan.pos, fan.group_sizes, fan.num_local_experts, out_dtype, fan.zero_unused_rows
        )
    w = jnp.asarray(fan.weights, jnp.float32)
    return _fan_in(
        ys, w, fan.pos, fan.group_sizes, fan.num_local_experts, out_dtype, fan.zero_unused_rows
    )

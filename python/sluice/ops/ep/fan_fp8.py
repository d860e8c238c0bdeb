"""The expert block's two ends in FP8 with the activations quantized as their rows are picked,
never written out in bf16 first (sluice.ep's docstring lists them):

- ``fanned_gmm(x, fan, rhs, fp8=...)`` = ``sluice.gmm(fan_out(x rows), rhs, group_sizes, fp8=...)``:
  the forward quantizes fan_out's copies of x's rows straight from x (fp8.quantize_both's gather),
  so xs [M, H] is neither written nor read; the backward sums the input gradient's copies per row,
  as fan_out's transpose does.
- ``gmm_fan_in(lhs, rhs, fan, fp8=...)`` = ``fan_in(sluice.gmm(lhs, rhs, group_sizes, fp8=...),
  fan, weighted=False)``: the backward quantizes d out's rows for the expert rows straight from
  d out, where fan_in's backward would write them as d ys [M, H'] for the quantization to read.
- ``fanned_swiglu_mlp(x, fan, wi, wo, row_weights=w, fp8=...)`` = ``gmm_fan_in(sluice.swiglu(
  fanned_gmm(x, fan, wi), group_sizes, row_weights=w), wo, fan)``, the whole SwiGLU expert MLP
  with the activation quantized as the SwiGLU computes it and the SwiGLU's gradient as its
  backward computes it (fp8.swiglu_quantize, fp8.swiglu_bwd_quantize): neither the 16-bit
  activation nor its gradient is written.

All three give the compositions' values and gradients bit for bit: the gathered rows are the same
values, and d out is rounded to ys's dtype first, as fan_in's backward rounds it. The one
exception is fanned_swiglu_mlp's gradient in the row weights, equal up to float32 rounding (on a
GPU a row's sum runs in 128-column parts). All three take fan_out(..., copy_rows=False)'s
layout. A row of x (of d out) is read once per copy; the copies of DeepSeek-V3's top-8 would be 2
bytes written and 2 read per element on top of the quantization's 2 read and 2 written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..fp8 import quantize_both, swiglu_bwd_quantize, swiglu_quantize
from ..gmm import _offset_array
from ..gmm_fp8 import (
    Fp8Weight,
    _local_range,
    as_recipe,
    backward_quantized,
    dy_range,
    forward_quantized,
)
from ..vma import match_vma
from .fan import Fan, _fan_in_call, _ones


def sources(fan: Fan):
    """int32 [M]: the row of x (fan_out's input) that each row of fan_out's xs copies, -1 for rows
    past the pairs."""
    (n, k), m = fan.pos.shape, fan.rows
    pos = fan.pos.reshape(-1)
    rows = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    # pairs left out (pos -1) go to a row past M, dropped (a negative index would wrap)
    dst = jnp.where(pos >= 0, pos, m)
    return jnp.full((m,), -1, jnp.int32).at[dst].set(rows, mode="drop", unique_indices=True)


def _quantize_x(x, rhs, group_sizes, recipe, gather=None):
    """x's two layouts for forward_quantized (every group local: group offset 0)."""
    off = _offset_array(None)
    rows = _local_range(group_sizes, off, rhs.shape[-3])
    p2 = recipe.power_of_two_scales
    return quantize_both(x, power_of_two=p2, row_range=rows, pad_rows_to=16, gather=gather), off


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fanned_gmm(x, src, pos, rhs, group_sizes, l, out_dtype, skip, recipe):
    return _fanned_fwd(x, src, pos, rhs, group_sizes, l, out_dtype, skip, recipe)[0]


def _fanned_fwd(x, src, pos, rhs, group_sizes, l, out_dtype, skip, recipe):
    qx, off = _quantize_x(x, rhs, group_sizes, recipe, gather=src)
    y, res = forward_quantized(qx, x, rhs, group_sizes, off, False, out_dtype, skip, recipe)
    return y, (res, pos, x[:0])


def _fanned_bwd(l, out_dtype, skip, recipe, r, dy):
    res, pos, x_like = r
    p2 = recipe.power_of_two_scales
    qdy = quantize_both(dy, power_of_two=p2, row_range=dy_range(res), pad_rows_to=16)
    dxs, dw = backward_quantized(qdy, res, False, skip)
    # fan_out's transpose: each row of x gets the sum of its copies' gradients
    dx = _fan_in_call(dxs, _ones(pos), pos, l, x_like.dtype)
    return match_vma(dx, x_like), None, None, dw, None


_fanned_gmm.defvjp(_fanned_fwd, _fanned_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gmm_fan_sum(lhs, rhs, src, pos, group_sizes, l, out_dtype, skip, recipe):
    return _gmm_fan_sum_fwd(lhs, rhs, src, pos, group_sizes, l, out_dtype, skip, recipe)[0]


def _gmm_fan_sum_fwd(lhs, rhs, src, pos, group_sizes, l, out_dtype, skip, recipe):
    qx, off = _quantize_x(lhs, rhs, group_sizes, recipe)
    ys, res = forward_quantized(qx, lhs, rhs, group_sizes, off, False, lhs.dtype, skip, recipe)
    out = _fan_in_call(ys, _ones(pos), pos, l, out_dtype)
    return out, (res, src)


def _gmm_fan_sum_bwd(l, out_dtype, skip, recipe, r, dout):
    res, src = r
    lhs_dtype = res[6].dtype  # ys has lhs's dtype; fan_in's backward rounds d out to it
    p2 = recipe.power_of_two_scales
    qdy = quantize_both(
        dout.astype(lhs_dtype), power_of_two=p2, row_range=dy_range(res), pad_rows_to=16, gather=src
    )
    dlhs, dw = backward_quantized(qdy, res, False, skip)
    return dlhs, dw, None, None, None


_gmm_fan_sum.defvjp(_gmm_fan_sum_fwd, _gmm_fan_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _swiglu_mlp(x, src, pos, wi, wo, row_w, group_sizes, l, out_dtype, skip, recipe):
    return _swiglu_mlp_fwd(x, src, pos, wi, wo, row_w, group_sizes, l, out_dtype, skip, recipe)[0]


def _swiglu_mlp_fwd(x, src, pos, wi, wo, row_w, group_sizes, l, out_dtype, skip, recipe):
    qx, off = _quantize_x(x, wi, group_sizes, recipe, gather=src)
    h, res_i = forward_quantized(qx, x, wi, group_sizes, off, False, x.dtype, skip, recipe)
    rows = _local_range(group_sizes, off, wo.shape[-3])
    p2 = recipe.power_of_two_scales
    qa = swiglu_quantize(h, row_w, row_range=rows, power_of_two=p2, pad_rows_to=16)
    ys, res_o = forward_quantized(qa, h, wo, group_sizes, off, False, x.dtype, skip, recipe)
    out = _fan_in_call(ys, _ones(pos), pos, l, out_dtype)
    return out, (res_i, res_o, h, row_w, src, pos, x[:0])


def _swiglu_mlp_bwd(l, out_dtype, skip, recipe, r, dout):
    res_i, res_o, h, row_w, src, pos, x_like = r
    p2 = recipe.power_of_two_scales
    qdy = quantize_both(
        dout.astype(h.dtype), power_of_two=p2, row_range=dy_range(res_o), pad_rows_to=16,
        gather=src,
    )  # fmt: skip
    dact, dwo = backward_quantized(qdy, res_o, False, skip)
    qdh, dw_rows = swiglu_bwd_quantize(
        dact, h, row_w, row_range=dy_range(res_i), power_of_two=p2, pad_rows_to=16
    )
    dxs, dwi = backward_quantized(qdh, res_i, False, skip)
    # fan_out's transpose: each row of x gets the sum of its copies' gradients
    dx = _fan_in_call(dxs, _ones(pos), pos, l, x_like.dtype)
    dw_rows = None if row_w is None else match_vma(dw_rows, row_w)
    return match_vma(dx, x_like), None, None, dwi, dwo, dw_rows, None


_swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


def _checked(op, fan, rhs, fp8, skip_unused_rows):
    if not isinstance(fan, Fan):
        raise TypeError(f"sluice.ep.{op}: fan must come from fan_out, got {type(fan)}")
    recipe = as_recipe(fp8, f"sluice.ep.{op}")
    if recipe is None:
        raise ValueError(f"sluice.ep.{op}: fp8 must be True or a sluice.fp8.Recipe (the FP8 path)")
    if not isinstance(rhs, Fp8Weight):  # (an Fp8Weight: fp8.prequantize's, [L, K, N] already)
        rhs = jnp.asarray(rhs)
    if rhs.ndim != 3 or rhs.shape[0] != fan.num_local_experts:
        raise ValueError(
            f"sluice.ep.{op}: rhs must be [L, K, N] with L = {fan.num_local_experts} (the fan's "
            f"local experts), got shape {rhs.shape}"
        )
    return recipe, rhs, bool(skip_unused_rows)


def fanned_gmm(x, fan: Fan, rhs, *, fp8=True, out_dtype=None, skip_unused_rows=False):
    """sluice.gmm(xs, rhs, fan.group_sizes, fp8=fp8) for fan_out's rows xs of x [N, K], computed
    from x itself: [M, N'] (rows past the pairs zero, or unwritten on a GPU with
    skip_unused_rows=True). rhs [L, K, N'] float; out_dtype defaults to x's. Differentiable in x
    and rhs."""
    recipe, rhs, skip = _checked("fanned_gmm", fan, rhs, fp8, skip_unused_rows)
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[0] != fan.pos.shape[0] or x.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"sluice.ep.fanned_gmm: x must be [N, K] with N = {fan.pos.shape[0]} (the fan's rows) "
            f"and K = {rhs.shape[1]} (rhs's), got shape {x.shape}"
        )
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    l = fan.num_local_experts
    return _fanned_gmm(x, sources(fan), fan.pos, rhs, fan.group_sizes, l, out_dtype, skip, recipe)


def gmm_fan_in(lhs, rhs, fan: Fan, *, fp8=True, out_dtype=None, skip_unused_rows=False):
    """fan_in(sluice.gmm(lhs, rhs, fan.group_sizes, fp8=fp8), fan, weighted=False, out_dtype=...)
    with the backward's quantization of d out's rows fused into their copy: [N, N'] (out_dtype,
    default lhs's). lhs [M, K] float (fan_out's rows), rhs [L, K, N']. skip_unused_rows as
    sluice.gmm's zero_unused_rows=False, for the gradient's rows of lhs past the pairs.
    Differentiable in lhs and rhs."""
    recipe, rhs, skip = _checked("gmm_fan_in", fan, rhs, fp8, skip_unused_rows)
    lhs = jnp.asarray(lhs)
    m = fan.rows
    if lhs.ndim != 2 or lhs.shape[0] != m or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"sluice.ep.gmm_fan_in: lhs must be [M, K] with M = {m} (fan_out's rows) and "
            f"K = {rhs.shape[1]} (rhs's), got shape {lhs.shape}"
        )
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    l = fan.num_local_experts
    return _gmm_fan_sum(
        lhs, rhs, sources(fan), fan.pos, fan.group_sizes, l, out_dtype, skip, recipe
    )


def fanned_swiglu_mlp(
    x, fan: Fan, wi, wo, *, row_weights=None, fp8=True, out_dtype=None, skip_unused_rows=False
):
    """The SwiGLU experts on fan_out's rows of x [N, K], summed back per token: gmm_fan_in(act, wo,
    fan) with act = sluice.swiglu(fanned_gmm(x, fan, wi), fan.group_sizes, row_weights=row_weights)
    -> [N, N'] (out_dtype, default x's). wi [L, K, 2F] ([gate | up] columns), wo [L, F, N'];
    row_weights float [M] (each expert row's router weight, applied to its activation), or None.
    The activation and the SwiGLU's gradient exist only in FP8 (fp8.swiglu_quantize,
    fp8.swiglu_bwd_quantize). Differentiable in x, wi, wo and row_weights."""
    recipe, wi, skip = _checked("fanned_swiglu_mlp", fan, wi, fp8, skip_unused_rows)
    _, wo, _ = _checked("fanned_swiglu_mlp", fan, wo, fp8, skip_unused_rows)
    x = jnp.asarray(x)
    n, m = fan.pos.shape[0], fan.rows
    if x.ndim != 2 or x.shape[0] != n or x.shape[1] != wi.shape[1]:
        raise ValueError(
            f"sluice.ep.fanned_swiglu_mlp: x must be [N, K] with N = {n} (the fan's rows) and "
            f"K = {wi.shape[1]} (wi's), got shape {x.shape}"
        )
    if wi.shape[2] % 2 or wo.shape[1] != wi.shape[2] // 2:
        raise ValueError(
            f"sluice.ep.fanned_swiglu_mlp: wi must be [L, K, 2F] and wo [L, F, N'], got "
            f"{wi.shape} and {wo.shape}"
        )
    if row_weights is not None:
        row_weights = jnp.asarray(row_weights)
        if row_weights.shape != (m,):
            raise ValueError(
                f"sluice.ep.fanned_swiglu_mlp: row_weights must be [M] = [{m}] (fan_out's rows), "
                f"got shape {row_weights.shape}"
            )
        row_weights = row_weights.astype(jnp.float32)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    l = fan.num_local_experts
    return _swiglu_mlp(
        x, sources(fan), fan.pos, wi, wo, row_weights, fan.group_sizes, l, out_dtype, skip, recipe
    )

"""The SwiGLU activation and its gradient quantized in both FP8 layouts as they are computed (the
sluice.fp8 namespace re-exports both):

    (q, s), (q_t, s_t) = swiglu_quantize(h, w, row_range=(lo, hi), pad_rows_to=16)
    ((q, s), (q_t, s_t)), dw = swiglu_bwd_quantize(dact, h, w, row_range=(lo, hi), pad_rows_to=16)

are, bit for bit, ``quantize_both(act, row_range=..., pad_rows_to=...)`` of sluice.swiglu's
activation act = silu(gate) * up * w[r] (h [..., R, 2F] = [gate | up], rounded once to h's dtype)
with its rows outside row_range zero, and of sluice.swiglu's gradient dh [..., R, 2F] for the
cotangent dact [..., R, F] (rows outside row_range zero). dw [..., R] float32 is the row weights'
gradient, sum_j dact[r, j] * silu(gate) * up[r, j] (0 outside row_range). An FP8 expert block
needs act only as the down projection's quantized operands and dh only as the gate/up
projection's: on a GPU (h bfloat16 or float16, F a multiple of 8 forward and of 128 backward) one
kernel computes each 128 x 128 tile and quantizes it where it is, so the 16-bit act (dh) is never written nor read back (a bf16
row: 6F bytes instead of 10F forward, 10F instead of 18F backward). Elsewhere the composition runs.
dw: the GPU kernel sums a row's products in 128-column parts and this function sums the parts, so
it can differ from sluice.swiglu's own d w by float32 rounding; everything else is identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._lib import register_targets
from .checks import ShapeError
from .fp8 import BLOCK, _both_shapes, _row_range, quantize_both
from .swiglu import swiglu
from .vma import _vary_kw

register_targets(
    {
        "sluice_swiglu_quantize_fp8": "sl_ffi_swiglu_quantize_fp8",
        "sluice_swiglu_bwd_quantize_fp8": "sl_ffi_swiglu_bwd_quantize_fp8",
    }
)


def _check(op, h, row_weights):
    h = jnp.asarray(h)
    if h.ndim != 2 or h.shape[1] % 2:
        raise ShapeError(f"sluice.fp8.{op}: h must be 2-D [R, 2F], got shape {h.shape}")
    if h.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"sluice.fp8.{op}: h must be float32, bfloat16 or float16, got {h.dtype}")
    w = None
    if row_weights is not None:
        w = jnp.asarray(row_weights)
        if w.shape != (h.shape[0],) or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ShapeError(
                f"sluice.fp8.{op}: row_weights must be floating [R] = [{h.shape[0]}], got "
                f"{w.dtype} {w.shape}"
            )
        w = w.astype(jnp.float32)
    return h, w


def _fused(h, f_align):
    """Whether the GPU kernel takes h (F a multiple of f_align: 8 forward, 128 backward, whose
    CTAs compute d gate's and d up's tiles of the same columns; else the composition runs)."""
    return h.dtype in (jnp.bfloat16, jnp.float16) and (h.shape[1] // 2) % f_align == 0


def _outside_zero(x, rr):
    rows = jnp.arange(x.shape[0])
    return jnp.where(((rows >= rr[0]) & (rows < rr[1]))[:, None], x, jnp.zeros((), x.dtype))


def _swiglu_rows(h, w, rr):
    """sluice.swiglu over rows [0, hi) (zero past hi), then rows below lo zeroed."""
    hi = jnp.clip(rr[1], 0, h.shape[0])
    act = swiglu(h, jnp.reshape(hi, (1,)), row_weights=w)
    return _outside_zero(act, rr)


def swiglu_quantize(h, row_weights=None, *, row_range=None, power_of_two=False, pad_rows_to=1):
    """The SwiGLU activation of h [R, 2F] (times row_weights [R] where given), rows outside
    row_range zero, in both FP8 layouts: ((q [R, F], scale), (q_t [F, R'], scale_t)) as
    fp8.quantize_both's (R' = R rounded up to pad_rows_to). See the module docstring."""
    h, w = _check("swiglu_quantize", h, row_weights)
    r, f = h.shape[0], h.shape[1] // 2
    rp = -(-r // pad_rows_to) * pad_rows_to
    rr = _row_range(jax.ShapeDtypeStruct((r, f), h.dtype), row_range, None)
    wz = jnp.zeros((0,), jnp.float32) if w is None else w

    def composed(h, rr, wz):
        act = _swiglu_rows(h, w if w is None else wz, rr)
        return quantize_both(act, power_of_two=power_of_two, row_range=rr, pad_rows_to=pad_rows_to)

    def kernel_path(h, rr, wz):
        call = jax.ffi.ffi_call(
            "sluice_swiglu_quantize_fp8", _both_shapes((), r, f, rp, _vary_kw(h, rr, wz)),
            vmap_method="sequential",
        )  # fmt: skip
        q, s, qt, st = call(
            h, rr, wz, rows=np.int64(rp), power_of_two=np.int64(bool(power_of_two)),
            weighted=np.int64(w is not None),
        )  # fmt: skip
        return (q, s), (qt, st)

    if not _fused(h, 8):
        return composed(h, rr, wz)
    return jax.lax.platform_dependent(h, rr, wz, cuda=kernel_path, default=composed)


def swiglu_bwd_quantize(
    dact, h, row_weights=None, *, row_range=None, power_of_two=False, pad_rows_to=1
):
    """sluice.swiglu's gradient dh [R, 2F] for the cotangent dact [R, F] (rows outside row_range
    zero) in both FP8 layouts, and the row weights' gradient: (((q, scale), (q_t, scale_t)), dw)
    with dw float32 [R] (None without row_weights). See the module docstring."""
    h, w = _check("swiglu_bwd_quantize", h, row_weights)
    r, f = h.shape[0], h.shape[1] // 2
    dact = jnp.asarray(dact)
    if dact.shape != (r, f):
        raise ShapeError(
            f"sluice.fp8.swiglu_bwd_quantize: dact must be [R, F] = [{r}, {f}], got {dact.shape}"
        )
    dact = dact.astype(h.dtype)
    rp = -(-r // pad_rows_to) * pad_rows_to
    rr = _row_range(jax.ShapeDtypeStruct((r, f), h.dtype), row_range, None)
    wz = jnp.zeros((0,), jnp.float32) if w is None else w

    def composed(dact, h, rr, wz):
        def fn(h, wz):
            return _swiglu_rows(h, None if w is None else wz, rr)

        _, vjp = jax.vjp(fn, h, wz)
        dh, dw = vjp(dact)
        dh = _outside_zero(dh, rr)
        q = quantize_both(dh, power_of_two=power_of_two, row_range=rr, pad_rows_to=pad_rows_to)
        return q, (None if w is None else dw)

    def kernel_path(dact, h, rr, wz):
        kw = _vary_kw(dact, h, rr, wz)
        nparts = -(-f // BLOCK) if w is not None else 0
        parts_shape = jax.ShapeDtypeStruct(
            (r, nparts) if w is not None else (0,), jnp.float32, **kw
        )
        call = jax.ffi.ffi_call(
            "sluice_swiglu_bwd_quantize_fp8", (*_both_shapes((), r, 2 * f, rp, kw), parts_shape),
            vmap_method="sequential",
        )  # fmt: skip
        q, s, qt, st, parts = call(
            dact, h, rr, wz, rows=np.int64(rp), power_of_two=np.int64(bool(power_of_two)),
            weighted=np.int64(w is not None),
        )  # fmt: skip
        return ((q, s), (qt, st)), (None if w is None else jnp.sum(parts, axis=-1))

    if not _fused(h, 128):
        return composed(dact, h, rr, wz)
    return jax.lax.platform_dependent(dact, h, rr, wz, cuda=kernel_path, default=composed)

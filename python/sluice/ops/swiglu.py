"""`swiglu`: the SwiGLU activation of an expert block, computed over its groups' rows only.

    act = swiglu(h, group_sizes)     # h [M, 2F] = [gate | up] per row (a gmm's output) -> [M, F]
    act = swiglu(h, group_sizes, row_weights=w)   # each row also times w [M] (float32)

act = silu(gate) * up (times the row's weight) in float32, rounded once to h's dtype, for the first
sum(group_sizes) rows (the rows gmm writes for groups sorted by row); the rows past them are zero, or
with zero_unused_rows=False left unwritten on a GPU. Differentiable in h (the gradient's rows past the
groups likewise) and in the row weights: an MoE layer that scales each token copy by its router
weight here, before the down projection, sums the expert outputs back unweighted and needs no copy of
them for the router weights' gradient, which this op's backward sums from what it reads anyway.
Where an expert block is sized for the worst case (sluice.ep's, twice the mean rows and more), XLA's
element-wise SwiGLU runs over every row; this runs over the used ones.
On the CPU a negative size or sum(group_sizes) > M is an error at run time; on a GPU negative sizes
count as 0 and the rows are clamped to M.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from ._lib import register_targets
from .checks import ShapeError
from .vma import _vary_kw, match_vma

register_targets({"sluice_swiglu": "sl_ffi_swiglu", "sluice_swiglu_bwd": "sl_ffi_swiglu_bwd"})


def _call(target, out_shapes, operands, skip, weighted):
    v = _vary_kw(*operands)
    call = jax.ffi.ffi_call(
        target,
        tuple(jax.ShapeDtypeStruct(s, d, **v) for s, d in out_shapes),
        vmap_method="sequential",
    )
    return call(*operands, skip_unused_rows=np.int32(skip), weighted=np.int32(weighted))


def _act_shape(h):
    return ((h.shape[0], h.shape[1] // 2), h.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _swiglu(h, group_sizes, skip):
    return _call("sluice_swiglu", [_act_shape(h)], (h, group_sizes), skip, False)[0]


def _swiglu_fwd(h, group_sizes, skip):
    return _swiglu(h, group_sizes, skip), (h, group_sizes)


def _swiglu_bwd(skip, res, dact):
    h, group_sizes = res
    operands = (dact.astype(h.dtype), h, group_sizes)
    dh = _call("sluice_swiglu_bwd", [(h.shape, h.dtype)], operands, skip, False)[0]
    return match_vma(dh, h), None


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _swiglu_w(h, group_sizes, w, skip):
    return _call("sluice_swiglu", [_act_shape(h)], (h, group_sizes, w), skip, True)[0]


def _swiglu_w_fwd(h, group_sizes, w, skip):
    return _swiglu_w(h, group_sizes, w, skip), (h, group_sizes, w)


def _swiglu_w_bwd(skip, res, dact):
    h, group_sizes, w = res
    outs = [(h.shape, h.dtype), (w.shape, jnp.float32)]
    dh, dw = _call("sluice_swiglu_bwd", outs, (dact.astype(h.dtype), h, group_sizes, w), skip, True)
    return match_vma(dh, h), None, match_vma(dw, w)


_swiglu_w.defvjp(_swiglu_w_fwd, _swiglu_w_bwd)


def swiglu(h, group_sizes=None, *, row_weights=None, zero_unused_rows=True, out_sharding=None):
    """silu(gate) * up of h [M, 2F] (gate = h[:, :F], up = h[:, F:]) over the first
    sum(group_sizes) rows (default: all M), each row times row_weights [M] where given (float32);
    see the module docstring. group_sizes takes any integer dtype and M may be symbolic, as in
    sluice.gmm; out_sharding too (under an explicit mesh the default keeps h's row axis)."""
    h = jnp.asarray(h)
    if h.ndim != 2 or h.shape[1] % 2:
        raise ShapeError(f"sluice.swiglu: h must be 2-D [M, 2F], got shape {h.shape}")
    checks.check_float("swiglu", "h", h.dtype)
    if group_sizes is None:
        group_sizes = jnp.reshape(jnp.asarray(h.shape[0], jnp.int32), (1,))
    group_sizes = checks.group_sizes_int32("swiglu", group_sizes, h.shape[0])
    checks.check_group_count("swiglu", group_sizes)
    if group_sizes.shape[0] < 1:
        raise ShapeError("sluice.swiglu: group_sizes must be 1-D [G], G >= 1, got shape (0,)")
    if not isinstance(zero_unused_rows, (bool, np.bool_)):
        raise TypeError(
            f"sluice.swiglu: zero_unused_rows must be a bool, got {type(zero_unused_rows).__name__}"
        )
    if row_weights is None:
        out = _swiglu(*checks.replicated(h, group_sizes), not zero_unused_rows)
    else:
        w = jnp.asarray(row_weights)
        if w.shape != (h.shape[0],):
            raise ShapeError(
                f"sluice.swiglu: row_weights must be [M] = [{h.shape[0]}], got shape {w.shape}"
            )
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise TypeError(f"sluice.swiglu: row_weights must be floating, got {w.dtype}")
        args = checks.replicated(h, group_sizes, w.astype(jnp.float32))
        out = _swiglu_w(*args, not zero_unused_rows)
    return checks.place(out, out_sharding, (h,), lambda: checks.inferred((h, 0), None))


def swiglu_reference(h, group_sizes=None, row_weights=None):
    """swiglu in jnp (rows past sum(group_sizes) zero)."""
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    if row_weights is not None:
        act = act * jnp.asarray(row_weights, jnp.float32)[:, None]
    act = act.astype(h.dtype)
    if group_sizes is None:
        return act
    used = jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where((jnp.arange(h.shape[0]) < used)[:, None], act, jnp.zeros_like(act))

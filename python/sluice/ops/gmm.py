"""Grouped GEMM ops: `gmm` (ragged rows) and `tgmm` (ragged contraction), each differentiable,
vmap-able (the FFI call broadcasts batch dims into the kernels' batch) and usable under jit and
shard_map; each with a pure-jnp reference beside it.

Semantics (the same as jax.lax.ragged_dot, plus group_offset):
  gmm:  lhs [M, K] with rows sorted by group, rhs [G_local, K, N] (or [G_local, N, K] with
        transpose_rhs), group_sizes int32 [G]. For local group j (global group g = offset + j), the rows
        of g are lhs[start_g : start_g + size_g] with start_g = sum(group_sizes[:g]);
        out[rows of g] = lhs[rows of g] @ rhs[j]. Every other row of out is zero (rows of non-local
        groups, rows past sum(group_sizes)).
  tgmm: out[j] = lhs[rows of g].T @ rhs[rows of g], lhs [M, K], rhs [M, N] -> [G_local, K, N].

Drop-in for ragged_dot: gmm and tgmm take ragged_dot's arguments (precision, preferred_element_type,
group_offset, out_sharding; group sizes of any integer dtype), raise TypeError for the shapes it
rejects, trace with a symbolic row count under jax.export, and export with
sluice.export_disabled_checks(). sluice.ragged_dot / ragged_dot_general (ragged.py) carry its exact
signatures.

Device-side group sizes: on the CPU a negative size, sum(group_sizes) > M or an out-of-range
group_offset is an error at run time (raised by the FFI call); on a GPU the kernels clamp them (negative
sizes count as 0, rows past M are ignored) and never read or write out of bounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from ._lib import register_targets
from .capi import gmm_workspace_bytes
from .checks import ShapeError
from .vma import _vary_kw, match_vma

register_targets({"sluice_gmm": "sl_ffi_gmm", "sluice_tgmm": "sl_ffi_tgmm"})


def _check_common(op, lhs, group_sizes, group_offset, preferred_element_type, precision):
    """Checks what gmm and tgmm share; returns group_sizes as int32."""
    if lhs.ndim != 2:
        raise ShapeError(f"sluice.{op}: lhs must be 2-D [M, K], got shape {lhs.shape}")
    checks.check_float(op, "lhs", lhs.dtype)
    group_sizes = checks.group_sizes_int32(op, group_sizes, lhs.shape[0])
    checks.check_group_count(op, group_sizes)
    checks.check_precision(op, precision)
    if preferred_element_type is not None:
        checks.check_float(op, "preferred_element_type", preferred_element_type)
    checks.check_group_offset(op, group_offset)
    return group_sizes


def _check_rhs_dtype(op, lhs, rhs):
    """rhs in lhs's dtype, or float32 with a bfloat16/float16 lhs (master weights)."""
    if rhs.dtype == lhs.dtype or (rhs.dtype == jnp.float32 and lhs.dtype.itemsize == 2):
        return
    raise TypeError(
        f"sluice.{op}: rhs dtype {rhs.dtype} with lhs dtype {lhs.dtype}: expected rhs in lhs's "
        "dtype, or float32 with a bfloat16/float16 lhs"
    )


def _offset_array(group_offset):
    if group_offset is None:
        return jnp.zeros((1,), jnp.int32)
    return jnp.reshape(jnp.asarray(group_offset, jnp.int32), (1,))


def ffi_call(target, out_shape, out_dtype, operands, *, in_dtype, rhs_nk, n, g_local, **attrs):
    """One FFI call of `target` (gmm, tgmm and their FP8 forms) on `operands` (lhs [..., M, K]
    first, group_sizes and group_offset last) with `attrs`: output [..., N] columns, g_local local
    groups, its workspace sized by the library for this problem (in_dtype: the operands' element
    type; rhs_nk: rhs laid out [G_local, N, K])."""
    lhs, group_sizes = operands[0], operands[-2]
    # The size depends on the group counts only (include/sluice.h: O(batch * G)), so a symbolic
    # dimension (jax.export shape polymorphism: M, K or N) passes as 1.
    m, k, n = (d if checks.is_static(d) else 1 for d in (*lhs.shape[-2:], n))
    ws = gmm_workspace_bytes(
        m=m,
        k=k,
        n=n,
        num_groups=group_sizes.shape[-1],
        num_local_groups=g_local,
        dtype=jnp.dtype(in_dtype),
        out_dtype=jnp.dtype(out_dtype),
        transpose_rhs=rhs_nk,
    )
    # Inside shard_map the result varies over whatever mesh axes the operands vary over.
    kw = _vary_kw(*operands)
    call = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct(out_shape, out_dtype, **kw),
            jax.ShapeDtypeStruct((ws,), jnp.uint8, **kw),
        ),
        vmap_method="broadcast_all",
    )
    return call(*operands, **attrs)[0]


def _gmm_call(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip_unused=False):
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    out_shape = lhs.shape[:-1] + (n,)
    g_local = rhs.shape[-3]
    return ffi_call(
        "sluice_gmm", out_shape, out_dtype, (lhs, rhs, group_sizes, group_offset),
        in_dtype=lhs.dtype, rhs_nk=transpose_rhs, n=n, g_local=g_local,
        transpose_rhs=np.int32(transpose_rhs), skip_unused_rows=np.int32(skip_unused),
    )  # fmt: skip


def _tgmm_call(lhs, rhs, group_sizes, group_offset, num_local_groups, out_dtype):
    k, n = lhs.shape[-1], rhs.shape[-1]
    out_shape = lhs.shape[:-2] + (num_local_groups, k, n)
    return ffi_call(
        "sluice_tgmm", out_shape, out_dtype, (lhs, rhs, group_sizes, group_offset),
        in_dtype=lhs.dtype, rhs_nk=False, n=n, g_local=num_local_groups,
    )  # fmt: skip


# ---- gmm with its VJP ------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip_unused):
    """rhs in lhs's dtype, or float32 master weights with a 16-bit lhs: rounded to lhs's dtype
    for the product, and their gradient computed in float32 by tgmm (see gmm's docstring)."""
    rhs = rhs.astype(lhs.dtype)
    return _gmm_call(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip_unused)


def _gmm_fwd(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip_unused):
    rhs_c = rhs.astype(lhs.dtype)
    out = _gmm_call(lhs, rhs_c, group_sizes, group_offset, transpose_rhs, out_dtype, skip_unused)
    # rhs's own dtype rides along as an empty array (the gradient comes out in it)
    return out, (lhs, rhs_c, group_sizes, group_offset, jnp.zeros((0,), rhs.dtype))


def _gmm_bwd(transpose_rhs, out_dtype, skip_unused, res, dout):
    lhs, rhs, group_sizes, group_offset, rhs_dtype = res
    dout = dout.astype(lhs.dtype)
    # d lhs = d out @ rhs[g]^T: the same op with the other orientation of rhs (its rows outside
    # the local groups, whose true gradient is zero, left unwritten too with skip_unused).
    dlhs = _gmm_call(
        dout, rhs, group_sizes, group_offset, not transpose_rhs, lhs.dtype, skip_unused
    )
    g_local = rhs.shape[-3]
    # d rhs in rhs's dtype straight from tgmm's float32 accumulators: float32 master weights get
    # their gradient without a rounding to 16 bits and a separate cast (on dsv3-proxy's experts
    # the cast of a bf16 gradient to float32 took as long as a tgmm)
    if transpose_rhs:  # rhs[g] is [N, K]: d rhs[g] = d out[rows]^T @ lhs[rows]
        drhs = _tgmm_call(dout, lhs, group_sizes, group_offset, g_local, rhs_dtype.dtype)
    else:
        drhs = _tgmm_call(lhs, dout, group_sizes, group_offset, g_local, rhs_dtype.dtype)
    # The weight gradient is off the backward pass's critical path, and XLA:GPU's scheduler, far
    # from its memory limit, ran every layer's late (just before the optimizer's update), keeping
    # each layer's lhs and dout alive until then: with --remat at EP 2 the step took 34.5 GiB
    # instead of 18.3. The barrier makes it run before
    # d lhs is used. Its outputs vary over the union of its inputs' mesh axes; match_vma below
    # then sums only over axes the primal lacks, and the union adds none such: an axis in dlhs's
    # and not drhs's comes from rhs (drhs keeps it), one in drhs's and not dlhs's from lhs.
    dlhs, drhs = jax.lax.optimization_barrier((dlhs, drhs))
    return match_vma(dlhs, lhs), match_vma(drhs, rhs), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    transpose_rhs=False,
    group_offset=None,
    preferred_element_type=None,
    zero_unused_rows=True,
    precision=None,
    out_sharding=None,
    fp8=None,
):
    """Grouped matmul, a drop-in for `jax.lax.ragged_dot(lhs, rhs, group_sizes, ...)`.

    Args:
      lhs: [M, K], rows sorted by group. M may be a jax.export symbolic dimension.
      rhs: [G_local, K, N], or [G_local, N, K] with `transpose_rhs`, in lhs's dtype, or float32
        with a bfloat16/float16 lhs (mixed precision with float32 master weights): rhs is then
        rounded to lhs's dtype for the product (one cast in the forward, the rounded copy saved
        for d lhs), and its gradient comes out in float32 straight from the kernel's float32
        accumulators (no rounding to 16 bits, no separate cast). With fp8, rhs is quantized from
        whichever dtype it has.
      group_sizes: [G] on the device, G >= G_local (static), int32 or any other integer dtype
        (converted: valid sizes exactly, wider values saturate at the int32 bounds).
      group_offset: int (or int32 array of shape () or (1,)): the first global group held in rhs.
        Rows of groups outside [offset, offset + G_local) come out zero. Default 0.
      preferred_element_type: output dtype (float32, bfloat16, float16); default lhs.dtype.
      zero_unused_rows: True (ragged_dot's semantics): rows outside the local groups' rows (past
        sum(group_sizes), or of other groups with group_offset) come out zero. False: on a GPU
        they are left unwritten, their contents unspecified (maybe NaN), and so are those rows of
        the gradient wrt lhs: for callers that never read them, such as an MoE layer whose expert
        block is sized for the worst case (writing its unused half cost ~3% of an EP 4 training
        step). The CPU path zeroes them either way.
      precision: as ragged_dot's (None, a lax.Precision or its name, a pair, a DotAlgorithmPreset).
        Every value computes the same: exact products of the input dtype accumulated in float32,
        i.e. HIGHEST for float32 inputs, and for bfloat16/float16 inputs what every precision gives.
      out_sharding: as ragged_dot's: the result's NamedSharding or PartitionSpec (explicit-sharding
        meshes). Under an explicit mesh without it the result is sharded as dot_general would
        infer (lhs's row axis, rhs's N axis); see sluice.ops.checks.
      fp8: None (default) or False: the matmuls run in the operands' dtype. True or a
        sluice.fp8.Recipe: they run in FP8 with DeepSeek-V3's fine-grained scaling (the Recipe
        says whether scales are powers of two). Forward: lhs is quantized in 1x128 blocks along K
        (scale [M, ceil(K/128)]), rhs in 128x128 blocks over its last two dims (scale
        [G_local, ceil(./128), ceil(./128)]), and the FP8 gmm gives out. Saved for the backward:
        lhs as given, the quantized rhs and its scale. Backward: d out is quantized in 1x128
        blocks along N for d lhs = FP8 gmm against the saved quantized rhs (the same 128x128
        blocks serve the other contraction); lhs and d out, their rows outside the local groups
        zeroed, are quantized in 128x1 blocks along the rows for d rhs = FP8 tgmm. rhs itself
        (the master weights) is never changed; group_sizes gets no gradient. The FP8 kernels
        write bfloat16 or float32; a float16 result is computed in float32 and cast.
        sluice.fp8 states the quantization and the scale layouts.
    Returns:
      [M, N]. Accumulation is always in float32.
    Raises:
      TypeError (sluice.ShapeError, also a ValueError) for shapes ragged_dot rejects; TypeError for
      dtypes outside float32/bfloat16/float16 (float64 included: cast it first).
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    group_sizes = _check_common(
        "gmm", lhs, group_sizes, group_offset, preferred_element_type, precision
    )
    want = "[G_local, N, K]" if transpose_rhs else "[G_local, K, N]"
    if rhs.ndim != 3:
        raise ShapeError(f"sluice.gmm: rhs must be 3-D {want}, got shape {rhs.shape}")
    _check_rhs_dtype("gmm", lhs, rhs)
    k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if k_rhs != lhs.shape[1]:
        raise ShapeError(
            f"sluice.gmm: contraction dims differ: lhs {lhs.shape} has K={lhs.shape[1]}, "
            f"rhs {rhs.shape} {want} has K={k_rhs}"
        )
    if rhs.shape[0] > group_sizes.shape[0]:
        raise ShapeError(
            f"sluice.gmm: rhs holds {rhs.shape[0]} groups but group_sizes has only "
            f"{group_sizes.shape[0]}"
        )
    if group_offset is None and rhs.shape[0] != group_sizes.shape[0]:
        raise ShapeError(
            f"sluice.gmm: rhs holds {rhs.shape[0]} groups and group_sizes {group_sizes.shape[0]}; "
            "pass group_offset to compute a slice of the groups"
        )
    if not isinstance(zero_unused_rows, (bool, np.bool_)):
        raise TypeError(
            f"sluice.gmm: zero_unused_rows must be a bool, got {type(zero_unused_rows).__name__}"
        )
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    args = checks.replicated(lhs, rhs, group_sizes, _offset_array(group_offset))
    if fp8 is None or fp8 is False:
        out = _gmm(*args, bool(transpose_rhs), out_dtype, not zero_unused_rows)
    else:
        from . import gmm_fp8  # imported here: gmm_fp8 builds on this module

        recipe = gmm_fp8.as_recipe(fp8)
        out = gmm_fp8.gmm_with_recipe(
            *args, bool(transpose_rhs), out_dtype, not zero_unused_rows, recipe
        )
    n_dim = 1 if transpose_rhs else 2
    return checks.place(
        out, out_sharding, (lhs, rhs), lambda: checks.inferred((lhs, 0), (rhs, n_dim))
    )


# ---- tgmm with its VJP -----------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tgmm(lhs, rhs, group_sizes, group_offset, num_local_groups, out_dtype):
    return _tgmm_call(lhs, rhs, group_sizes, group_offset, num_local_groups, out_dtype)


def _tgmm_fwd(lhs, rhs, group_sizes, group_offset, num_local_groups, out_dtype):
    out = _tgmm_call(lhs, rhs, group_sizes, group_offset, num_local_groups, out_dtype)
    return out, (lhs, rhs, group_sizes, group_offset)


def _tgmm_bwd(num_local_groups, out_dtype, res, dout):
    lhs, rhs, group_sizes, group_offset = res
    dout = dout.astype(lhs.dtype)
    # out[g] = lhs_g^T rhs_g  =>  d lhs_g = rhs_g @ dout[g]^T,  d rhs_g = lhs_g @ dout[g]
    dlhs = _gmm_call(rhs, dout, group_sizes, group_offset, True, lhs.dtype)
    drhs = _gmm_call(lhs, dout, group_sizes, group_offset, False, rhs.dtype)
    return match_vma(dlhs, lhs), match_vma(drhs, rhs), None, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


def tgmm(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=None,
    num_local_groups=None,
    preferred_element_type=None,
    precision=None,
    out_sharding=None,
):
    """Weight-gradient grouped matmul: out[j] = lhs[rows of g]^T @ rhs[rows of g], g = offset + j
    (ragged_dot_general's ragged-contraction mode).

    Args:
      lhs: [M, K]; rhs: [M, N]; rows sorted by group (M may be symbolic, as in gmm).
      group_sizes: [G], int32 or another integer dtype (as in gmm).
      group_offset, num_local_groups: compute only groups [offset, offset + num_local_groups)
        (default: all G groups, offset 0).
      preferred_element_type: output dtype; default lhs.dtype.
      precision, out_sharding: as in gmm (under an explicit mesh the default keeps lhs's K and
        rhs's N axes).
    Returns:
      [num_local_groups, K, N]; a group with no rows gives zeros.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    group_sizes = _check_common(
        "tgmm", lhs, group_sizes, group_offset, preferred_element_type, precision
    )
    if rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0]:
        raise ShapeError(
            f"sluice.tgmm: rhs must be 2-D [M, N] with the {lhs.shape[0]} rows of lhs, "
            f"got shape {rhs.shape}"
        )
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"sluice.tgmm: rhs dtype {rhs.dtype} differs from lhs dtype {lhs.dtype}")
    g = group_sizes.shape[0]
    num_local_groups = g if num_local_groups is None else int(num_local_groups)
    if not 0 <= num_local_groups <= g:
        raise ValueError(
            f"sluice.tgmm: num_local_groups must be in [0, {g}], got {num_local_groups}"
        )
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    args = checks.replicated(lhs, rhs, group_sizes, _offset_array(group_offset))
    out = _tgmm(*args, num_local_groups, out_dtype)
    return checks.place(
        out, out_sharding, (lhs, rhs), lambda: checks.inferred(None, (lhs, 1), (rhs, 1))
    )


# ---- pure-jnp references ---------------------------------------------------------------------
def _local_masks(m, group_sizes, group_offset, g_local):
    """[G_local, M] bool: row r belongs to local group j."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    off = _offset_array(group_offset)[0]
    rows = jnp.arange(m)
    idx = off + jnp.arange(g_local)
    s, e = starts[idx], ends[idx]
    return (rows[None, :] >= s[:, None]) & (rows[None, :] < e[:, None])


def gmm_reference(
    lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=None, preferred_element_type=None
):
    """gmm in plain jnp (float32 math, G_local dense matmuls): for tests, not for speed."""
    out_dtype = preferred_element_type or lhs.dtype
    masks = _local_masks(lhs.shape[0], group_sizes, group_offset, rhs.shape[0])
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    prods = jnp.einsum(
        "mk,gkn->gmn",
        lhs.astype(jnp.float32),
        w.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return jnp.sum(jnp.where(masks[:, :, None], prods, 0.0), axis=0).astype(out_dtype)


def tgmm_reference(
    lhs, rhs, group_sizes, *, group_offset=None, num_local_groups=None, preferred_element_type=None
):
    """tgmm in plain jnp (float32 math): for tests, not for speed."""
    out_dtype = preferred_element_type or lhs.dtype
    g_local = group_sizes.shape[0] if num_local_groups is None else num_local_groups
    masks = _local_masks(lhs.shape[0], group_sizes, group_offset, g_local)
    return jnp.einsum(
        "gm,mk,mn->gkn",
        masks.astype(jnp.float32),
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    ).astype(out_dtype)

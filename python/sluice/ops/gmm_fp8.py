"""FP8 grouped GEMM ops with DeepSeek-V3's fine-grained scaling (the sluice.fp8 namespace re-exports
`gmm`, `tgmm` and `Recipe`; fp8.py states the quantization and the scale layouts).

- `gmm(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, ...)` and `tgmm(...)` take operands already
  quantized (e4m3 + float32 scales), with the signatures and semantics of `gmm_fp8_reference` and
  `tgmm_fp8_reference`; they are not differentiable (their inputs are quantized).
- `sluice.gmm(lhs, rhs, group_sizes, fp8=Recipe())` is the differentiable path for bfloat16 (or
  float32/float16) operands: the forward quantizes and runs the FP8 gmm, the backward runs the two
  FP8 gradient matmuls (`gmm_with_recipe` below).

The C ops take one layout each (include/sluice.h): gmm_fp8 the weights as [G, N, K] (the
contraction contiguous), tgmm_fp8 both operands transposed, [K, M] and [N, M]. The transposes
happen here, in XLA, which fuses them into the quantization that produces the operand. Sizes the
CUDA kernels need aligned (K % 16 for gmm, M % 16 and K % 4 for tgmm, N % 8) are zero-padded
here: a zero element adds nothing to any sum and the scale shapes do not change (ceil(./128) of
the padded size is the same), so padding changes no result; padded output rows and columns are
cut off. tgmm pads M on GPUs only, so that on the CPU sum(group_sizes) > M stays an error.

Both ops are vmap-able (batch dims go to the C op's batch, as gmm's), and run under jit and
shard_map. Group sizes and group_offset behave as in sluice.gmm (an error on the CPU, clamped on a
GPU). Non-finite values: a block that held inf or NaN has scale NaN and q NaN (fp8.quantize), so
NaN reaches exactly the outputs whose contraction includes that block: for gmm the rows of the lhs
block and, for an rhs block, the 128 columns it covers in every row of its group; for tgmm the
rows (columns) of out[g] of that lhs (rhs) column, for the groups whose rows the block covers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from ._lib import register_targets
from .checks import ShapeError
from .fp8 import (
    ACT,
    E4M3,
    _gmm_operands,
    _tgmm_operands,
    quantize,
    quantize_both,
    quantize_weight,
)
from .gmm import _offset_array, ffi_call
from .vma import match_vma

register_targets({"sluice_gmm_fp8": "sl_ffi_gmm_fp8", "sluice_tgmm_fp8": "sl_ffi_tgmm_fp8"})

OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # what the FP8 kernels write


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How `sluice.gmm(..., fp8=Recipe(...))` quantizes (DeepSeek-V3's recipe: activations and
    gradients in 1x128 blocks along the contraction, weights in 128x128 blocks, f32 scales).

    power_of_two_scales: round every scale up to a power of two (exact scaling, no saturation;
      fp8.quantize's power_of_two).
    """

    power_of_two_scales: bool = False


class Fp8Weight:
    """Weights quantized ahead of the FP8 matmuls that use them (`prequantize`), for a caller that
    multiplies the same weights several times, e.g. once per micro-batch of a step: the FP8 paths
    that take a weight (`sluice.ep.fanned_gmm`, `gmm_fan_in`, `fanned_swiglu_mlp`) take an
    Fp8Weight in its place and use its two layouts instead of quantizing the weights in every call.
    Their gradient in it is the gradient in `value` (the quantized layouts get none: they are held
    as integer bit patterns, so autodiff gives them float0 zeros that are never materialised).

    A pytree: value (the weights, [G, K, N] float), q_bits / q_t_bits (uint8: the e4m3 layouts of
    fp8.quantize_weight's "both", [G, K, N] and [G, N, K]), scale_bits / scale_t_bits (uint32: their
    float32 scales), and power_of_two (static: the Recipe's power_of_two_scales, which the paths
    check against their own Recipe). shape, ndim and dtype are value's."""

    def __init__(self, value, q_bits, scale_bits, q_t_bits, scale_t_bits, power_of_two=False):
        self.value, self.q_bits, self.scale_bits = value, q_bits, scale_bits
        self.q_t_bits, self.scale_t_bits, self.power_of_two = q_t_bits, scale_t_bits, power_of_two

    shape = property(lambda self: self.value.shape)
    ndim = property(lambda self: self.value.ndim)
    dtype = property(lambda self: self.value.dtype)

    def __getitem__(self, key):
        if key is Ellipsis:  # nnx.Param[...]: the whole value
            return self
        raise TypeError("sluice.fp8.Fp8Weight: only w[...] indexes an Fp8Weight")

    def layouts(self):
        """((q [G, K, N], scale), (q_t [G, N, K], scale_t)) as fp8.quantize_weight's "both"."""
        e4m3 = lambda b: jax.lax.bitcast_convert_type(b, E4M3)
        f32 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)
        q, q_t = e4m3(self.q_bits), e4m3(self.q_t_bits)
        return (q, f32(self.scale_bits)), (q_t, f32(self.scale_t_bits))


jax.tree_util.register_pytree_node(
    Fp8Weight,
    lambda w: ((w.value, w.q_bits, w.scale_bits, w.q_t_bits, w.scale_t_bits), w.power_of_two),
    lambda p2, leaves: Fp8Weight(*leaves, power_of_two=p2),
)


def prequantize(w, fp8=True) -> Fp8Weight:
    """w [G, K, N] (float) with its FP8 layouts by `fp8` (True or a Recipe), as an Fp8Weight for
    the FP8 paths to use in w's place. The quantization is not differentiated (the gradient in an
    Fp8Weight goes to its value). Under shard_map, quantize each shard where the weights are split
    only along G."""
    recipe = as_recipe(fp8, "sluice.fp8.prequantize")
    if recipe is None:
        raise ValueError("sluice.fp8.prequantize: fp8 must be True or a sluice.fp8.Recipe")
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ShapeError(f"sluice.fp8.prequantize: w must be [G, K, N], got shape {w.shape}")
    p2 = recipe.power_of_two_scales
    (q, s), (qt, st) = quantize_weight(jax.lax.stop_gradient(w), power_of_two=p2, layout="both")
    u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
    u32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint32)
    return Fp8Weight(w, u8(q), u32(s), u8(qt), u32(st), power_of_two=p2)


def _weight_layouts(rhs, recipe):
    """rhs's two FP8 layouts ((q, scale), (q_t, scale_t)): an Fp8Weight's own, else quantized."""
    p2 = recipe.power_of_two_scales
    if not isinstance(rhs, Fp8Weight):
        return quantize_weight(rhs, power_of_two=p2, layout="both")
    if rhs.power_of_two != p2:
        raise ValueError(
            f"sluice.fp8: an Fp8Weight prequantized with power_of_two_scales={rhs.power_of_two} "
            f"used by a Recipe with power_of_two_scales={p2}"
        )
    return rhs.layouts()


def _rhs_like(rhs):
    """What the backward needs of rhs, as empty arrays: its dtype, and whether it is an Fp8Weight
    (whose cotangent is an Fp8Weight: the gradient in its value, None for the bit patterns)."""
    like = jnp.zeros((0,), rhs.dtype)
    if isinstance(rhs, Fp8Weight):
        u8, u32 = jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.uint32)
        return Fp8Weight(like, u8, u32, u8, u32, power_of_two=rhs.power_of_two)
    return like


def _rhs_cotangent(dw, rhs_like):
    if isinstance(rhs_like, Fp8Weight):
        return Fp8Weight(dw, None, None, None, None, power_of_two=rhs_like.power_of_two)
    return dw


def as_recipe(fp8, op="sluice.gmm") -> Recipe | None:
    """An `fp8` argument (of `op`): None or False (no FP8), True (the default Recipe) or a Recipe."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return Recipe()
    if isinstance(fp8, Recipe):
        return fp8
    raise TypeError(f"{op}: fp8 must be None, a bool or sluice.fp8.Recipe, got {fp8!r}")


def _pad_last(x, *pads):
    """x zero-padded at the end of its last len(pads) dims by `pads`."""
    if not any(pads):
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - len(pads)) + [(0, p) for p in pads])


def _gmm_nt(lhs_q, lhs_s, rhs_q, rhs_s, group_sizes, group_offset, out_dtype, skip_unused):
    """The C op: lhs [..., M, K] (ACT scale), rhs [..., G_local, N, K] (WEIGHT scale of that
    layout) -> [..., M, N]. K is padded to a multiple of 16 and N to one of 8."""
    k, n = lhs_q.shape[-1], rhs_q.shape[-2]
    pk, pn = -k % 16, -n % 8
    lhs_q, rhs_q = _pad_last(lhs_q, pk), _pad_last(rhs_q, pn, pk)
    out = ffi_call(
        "sluice_gmm_fp8",
        lhs_q.shape[:-1] + (n + pn,),
        out_dtype,
        (lhs_q, lhs_s, rhs_q, rhs_s, group_sizes, group_offset),
        in_dtype=E4M3,
        rhs_nk=True,
        n=n + pn,
        g_local=rhs_q.shape[-3],
        skip_unused_rows=np.int32(skip_unused),
    )
    return out[..., :n] if pn else out


def _tgmm_tn(lhs_t, lhs_s, rhs_t, rhs_s, group_sizes, group_offset, g_local, out_dtype):
    """The C op: lhs_t [..., K, M], rhs_t [..., N, M] with ACT_T scales [..., ceil(M/128), K] and
    [..., ceil(M/128), N] -> [..., G_local, K, N]. K is padded to a multiple of 4 (the CUDA kernel
    reads the scale rows in 16-byte units) and N to one of 8, the padded rows and columns with
    zero data and zero scales. M is padded to a multiple of 16 on GPUs only: on the CPU, which
    takes any M, a sum(group_sizes) past the true M stays the error it is."""
    operands = (lhs_t, lhs_s, rhs_t, rhs_s, group_sizes, group_offset)
    call = functools.partial(_tgmm_call, g_local=g_local, out_dtype=out_dtype)
    if lhs_t.shape[-1] % 16 == 0:
        return call(*operands, pad_m=False)
    return jax.lax.platform_dependent(
        *operands,
        cpu=functools.partial(call, pad_m=False),
        default=functools.partial(call, pad_m=True),
    )


def _tgmm_call(lhs_t, lhs_s, rhs_t, rhs_s, group_sizes, group_offset, *, g_local, out_dtype, pad_m):
    k, m, n = lhs_t.shape[-2], lhs_t.shape[-1], rhs_t.shape[-2]
    pk, pm, pn = -k % 4, (-m % 16 if pad_m else 0), -n % 8
    lhs_t, lhs_s = _pad_last(lhs_t, pk, pm), _pad_last(lhs_s, pk)
    rhs_t, rhs_s = _pad_last(rhs_t, pn, pm), _pad_last(rhs_s, pn)
    out = ffi_call(
        "sluice_tgmm_fp8",
        lhs_t.shape[:-2] + (g_local, k + pk, n + pn),
        out_dtype,
        (lhs_t, lhs_s, rhs_t, rhs_s, group_sizes, group_offset),
        in_dtype=E4M3,
        rhs_nk=False,
        n=n + pn,
        g_local=g_local,
    )
    return out[..., :k, :n] if pk or pn else out


def _swap(x):
    return jnp.swapaxes(x, -1, -2)


def _out_dtype(op, preferred_element_type):
    dtype = jnp.dtype(preferred_element_type)
    if dtype not in OUT_DTYPES:
        raise TypeError(
            f"sluice.fp8.{op}: preferred_element_type must be bfloat16 or float32 (what the FP8 "
            f"kernels write), got {dtype}"
        )
    return dtype


def _group_args(op, group_sizes, m, group_offset):
    """group_sizes as int32 [G], and group_offset checked."""
    group_sizes = checks.group_sizes_int32(f"fp8.{op}", group_sizes, m)
    checks.check_group_count(f"fp8.{op}", group_sizes)
    checks.check_group_offset(f"fp8.{op}", group_offset)
    return group_sizes


def gmm(
    lhs_q,
    lhs_scale,
    rhs_q,
    rhs_scale,
    group_sizes,
    *,
    transpose_rhs=False,
    group_offset=None,
    preferred_element_type=jnp.bfloat16,
    skip_unused_rows=False,
):
    """FP8 grouped matmul on quantized operands: `gmm_fp8_reference`'s signature and semantics,
    computed by the FP8 kernels (each 128-long piece of K summed over e4m3 products, then added to
    a float32 total times its two scales).

    Args:
      lhs_q, lhs_scale: [M, K] float8_e4m3fn, rows sorted by group, and its ACT scale
        [M, ceil(K/128)] float32 (`fp8.quantize_act(x)`).
      rhs_q, rhs_scale: [G_local, K, N] float8_e4m3fn and its WEIGHT scale
        [G_local, ceil(K/128), ceil(N/128)] (`fp8.quantize_weight(w)`); with transpose_rhs=True
        [G_local, N, K] and the WEIGHT scale of that array, [G_local, ceil(N/128), ceil(K/128)]
        (the input gradient passes the forward's quantized w unchanged this way).
      group_sizes, group_offset: as sluice.gmm.
      preferred_element_type: bfloat16 (default) or float32.
      skip_unused_rows: False: rows outside the local groups are zero. True: on a GPU they are
        left unwritten (unspecified), for callers that never read them; the CPU zeroes them.
    Returns:
      [M, N].
    Raises:
      ShapeError / TypeError naming the argument for bad shapes and dtypes.
    """
    lhs_q, lhs_scale, rhs_q, rhs_scale = _gmm_operands(
        "gmm", lhs_q, lhs_scale, rhs_q, rhs_scale, transpose_rhs
    )
    gs = _group_args("gmm", group_sizes, lhs_q.shape[0], group_offset)
    g, g_local = gs.shape[0], rhs_q.shape[0]
    if g_local > g:
        raise ShapeError(f"sluice.fp8.gmm: rhs holds {g_local} groups but group_sizes only {g}")
    if group_offset is None and g_local != g:
        raise ShapeError(
            f"sluice.fp8.gmm: rhs holds {g_local} groups and group_sizes {g}; pass group_offset "
            "to compute a slice of the groups"
        )
    out_dtype = _out_dtype("gmm", preferred_element_type)
    if not transpose_rhs:  # the C op's layout: [G, N, K], its scale [G, ceil(N/128), ceil(K/128)]
        rhs_q, rhs_scale = _swap(rhs_q), _swap(rhs_scale)
    return _gmm_nt(
        lhs_q, lhs_scale, rhs_q, rhs_scale, gs, _offset_array(group_offset), out_dtype,
        bool(skip_unused_rows),
    )  # fmt: skip


def tgmm(
    lhs_q,
    lhs_scale,
    rhs_q,
    rhs_scale,
    group_sizes,
    *,
    group_offset=None,
    num_local_groups=None,
    preferred_element_type=jnp.bfloat16,
):
    """FP8 weight-gradient grouped matmul on quantized operands: `tgmm_fp8_reference`'s signature
    and semantics, out[j] = lhs[rows of g]^T @ rhs[rows of g] (g = offset + j), computed by the FP8
    kernels (each group's rows cut at the 128-row scale blocks; each piece's e4m3 sum added to a
    float32 total times the outer product of its scale rows).

    Args:
      lhs_q, lhs_scale: [M, K] float8_e4m3fn and its ACT_T scale [ceil(M/128), K]
        (`fp8.quantize_act(x, axis=-2)`); rhs_q, rhs_scale: [M, N] and [ceil(M/128), N] likewise.
        The 128-row blocks are absolute (rows [128 b, 128 b + 128) of the operand).
      group_sizes, group_offset, num_local_groups: as sluice.tgmm.
      preferred_element_type: bfloat16 (default) or float32.
    Returns:
      [num_local_groups, K, N]; an empty group gives zeros.
    """
    lhs_q, lhs_scale, rhs_q, rhs_scale = _tgmm_operands("tgmm", lhs_q, lhs_scale, rhs_q, rhs_scale)
    gs = _group_args("tgmm", group_sizes, lhs_q.shape[0], group_offset)
    g = gs.shape[0]
    g_local = g if num_local_groups is None else int(num_local_groups)
    if not 0 <= g_local <= g:
        raise ValueError(f"sluice.fp8.tgmm: num_local_groups must be in [0, {g}], got {g_local}")
    out_dtype = _out_dtype("tgmm", preferred_element_type)
    return _tgmm_tn(
        _swap(lhs_q), lhs_scale, _swap(rhs_q), rhs_scale, gs, _offset_array(group_offset),
        g_local, out_dtype,
    )  # fmt: skip


# ---- the differentiable path: sluice.gmm(lhs, rhs, group_sizes, fp8=Recipe()) -----------------
def _local_range(group_sizes, group_offset, g_local):
    """(lo, hi): the rows of the local groups. The weight gradient's quantization reads the rows
    outside as zero, so that whatever they hold (an expert block's unused rows may hold anything,
    NaN included) never reaches a 128-row block's scale."""
    if g_local == 0:
        return jnp.int32(0), jnp.int32(0)
    ends = jnp.cumsum(group_sizes)
    off = group_offset[0]
    return ends[off] - group_sizes[off], ends[off + g_local - 1]


def _kernel_dtype(dtype):
    """The FP8 kernels' output dtype for a wanted dtype (float16 comes back as float32, then cast)."""
    return dtype if jnp.dtype(dtype) in OUT_DTYPES else jnp.dtype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def gmm_with_recipe(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip, recipe):
    """sluice.gmm's FP8 path (called by sluice.gmm with fp8=...; arguments already checked):
    lhs [M, K], rhs [G_local, K, N] (or [G_local, N, K] with transpose_rhs) in a float dtype,
    group_offset int32 [1]. See `_fwd` and `_bwd` for what is quantized how, and what is saved.
    Without a gradient only x's ACT blocks are made."""
    p2 = recipe.power_of_two_scales
    xq, xs = quantize(lhs, ACT, power_of_two=p2)
    # the C op reads the weights as [G, N, K]: rhs itself with transpose_rhs, else its transpose,
    # which the quantization writes directly
    if isinstance(rhs, Fp8Weight):
        w_nt, ws_nt = _weight_layouts(rhs, recipe)[0 if transpose_rhs else 1]
    else:
        w_nt, ws_nt = quantize_weight(rhs, power_of_two=p2, layout="q" if transpose_rhs else "q_t")
    return _product(xq, xs, w_nt, ws_nt, group_sizes, group_offset, out_dtype, skip)


def _product(xq, xs, w_nt, ws_nt, group_sizes, group_offset, out_dtype, skip):
    """y = gmm(quantized x, quantized w as [G, N, K]) in out_dtype."""
    y = _gmm_nt(xq, xs, w_nt, ws_nt, group_sizes, group_offset, _kernel_dtype(out_dtype), skip)
    return y.astype(out_dtype)


def _fwd(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip, recipe):
    """y = gmm(x by ACT, w by WEIGHT). x is quantized in both of its layouts at once
    (fp8.quantize_both): by ACT for y, and by ACT_T, written transposed, for the weight gradient.
    w likewise (fp8.quantize_weight, layout "both"): as [G, N, K] for y and as [G, K, N] for the
    input gradient (a 128x128 block serves both contractions). Saves the transposed x (1 byte an
    element where x itself is 2 or 4), the input gradient's quantized weights and their scales,
    group_sizes and group_offset."""
    rows = _local_range(group_sizes, group_offset, rhs.shape[-3])
    qx = quantize_both(lhs, power_of_two=recipe.power_of_two_scales, row_range=rows, pad_rows_to=16)
    return forward_quantized(qx, lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype,
                             skip, recipe)  # fmt: skip


def forward_quantized(qx, lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, skip,
                      recipe):  # fmt: skip
    """`_fwd` from x's two layouts qx = fp8.quantize_both(x, row_range=the local groups' rows,
    pad_rows_to=16) (x itself may be another array of x's dtype and sharding, e.g. the rows
    qx was gathered from): (y, residuals for `backward_quantized`)."""
    (xq, xs), (x_t, xs_t) = qx
    w, w_t = _weight_layouts(rhs, recipe)
    (w_nt, ws_nt), (w_kn, ws_kn) = (w, w_t) if transpose_rhs else (w_t, w)
    y = _product(xq, xs, w_nt, ws_nt, group_sizes, group_offset, out_dtype, skip)
    # lhs's and rhs's own dtypes (and lhs's sharding type, and whether rhs is an Fp8Weight) ride
    # along as empty arrays
    lhs_like, rhs_like = lhs[:0, :0], _rhs_like(rhs)
    return y, (x_t, xs_t, w_kn, ws_kn, group_sizes, group_offset, lhs_like, rhs_like)


def dy_range(res):
    """The rows of dy that the weight gradient reads (the local groups'), for
    fp8.quantize_both(dy, row_range=..., pad_rows_to=16) in `backward_quantized`."""
    _, _, w_kn, _, group_sizes, group_offset, _, _ = res
    return _local_range(group_sizes, group_offset, w_kn.shape[-3])


def _bwd(transpose_rhs, out_dtype, skip, recipe, res, dy):
    """dx = gmm(dy by ACT, the saved quantized w, transpose_rhs flipped); dw = tgmm(x, dy), both by
    ACT_T (128-row blocks along the contraction), their rows outside the local groups zeroed
    first: x's from the forward, dy's from the same pass as its ACT blocks. The master weights are
    never re-quantized here."""
    qdy = quantize_both(
        dy, power_of_two=recipe.power_of_two_scales, row_range=dy_range(res), pad_rows_to=16
    )
    dx, dw = backward_quantized(qdy, res, transpose_rhs, skip)
    return dx, dw, None, None


def backward_quantized(qdy, res, transpose_rhs, skip):
    """`_bwd` from dy's two layouts qdy = fp8.quantize_both(dy, row_range=dy_range(res),
    pad_rows_to=16): (dx [M, K] in lhs's dtype and sharding type, dw in rhs's dtype: rhs's
    cotangent, an Fp8Weight's for an Fp8Weight)."""
    x_t, xs_t, w_kn, ws_kn, group_sizes, group_offset, lhs_like, rhs_like = res
    (dyq, dys), (dy_t, dys_t) = qdy
    g_local = w_kn.shape[-3]
    # dx contracts N: the C op reads the weights as [G, K, N], saved so by the forward
    lhs_dtype = lhs_like.dtype
    dx = _gmm_nt(dyq, dys, w_kn, ws_kn, group_sizes, group_offset, _kernel_dtype(lhs_dtype), skip)
    # x and dy by ACT_T, transposed: [K, M'] and [N, M'], M' = M rounded up to 16 as the CUDA
    # kernel wants
    a, a_s, b, b_s = (dy_t, dys_t, x_t, xs_t) if transpose_rhs else (x_t, xs_t, dy_t, dys_t)
    # the weight gradient in rhs's dtype (float32 master weights: straight from the kernel)
    rhs_dtype = rhs_like.dtype
    dw = _tgmm_tn(a, a_s, b, b_s, group_sizes, group_offset, g_local, _kernel_dtype(rhs_dtype))
    # As in the bf16 gmm's backward: the weight gradient runs before dx is used (see gmm.py).
    dx, dw = jax.lax.optimization_barrier((dx.astype(lhs_dtype), dw.astype(rhs_dtype)))
    return match_vma(dx, lhs_like), _rhs_cotangent(match_vma(dw, w_kn), rhs_like)


gmm_with_recipe.defvjp(_fwd, _bwd)

"""FP8 with DeepSeek-V3's fine-grained scaling: block quantization to float8_e4m3fn, its inverse, and
pure-jnp references of the FP8 grouped GEMMs, which define what the FP8 kernels compute.

Quantization (`quantize`, over the last two dims; leading dims are batch, so jit and vmap apply):
  A block of `block = (rows, cols)` elements shares one float32 scale. For each block:
    amax  = max |x| over the block (x read as float32)
    scale = max(amax * RCP_MAX, 2**-126)                  RCP_MAX = float32(1 / 448),
                                                           448 = E4M3_MAX, 2**-126 = SCALE_MIN
            power_of_two=True: the smallest power of two p >= SCALE_MIN with 448 * p >= amax
    rcp   = 1 / scale                                      correctly rounded float32
    q     = e4m3(clip(x * rcp, -448, 448))                 e4m3(): round to nearest, ties to even
  and dequantize(q, scale) = float32(q) * scale. Consequences:
  - |x - dequantize(q)| <= 2**-4 * max(|x|, 2**-6 * scale) (3 mantissa bits; below 2**-6 * scale
    the element falls in e4m3's subnormals), plus float32 rounding (~2**-24 relative) in rcp,
    x * rcp and q * scale. Multiplying by the block's reciprocal (as DeepGEMM's and Transformer
    Engine's quantizers do) rather than dividing by the scale costs a kernel one instruction an
    element instead of three. With power_of_two=True, rcp, x * rcp and q * scale are exact: an x
    whose x * rcp is an e4m3 value comes back bit for bit, and no element saturates
    (448 * scale >= amax).
    Without it the block's amax maps to 448 (up to float32 rounding, then clipped), and one element
    may saturate by that rounding alone. With it, |x| >= 2**128 * (1 - 2**-5) (~3.3e38) rounds to
    256 * 2**120 and dequantizes to inf (the scale itself stays finite).
  - A zero block gets scale SCALE_MIN and q = 0. The floor keeps every scale a normal float32 and
    its reciprocal finite: blocks with amax < 448 * 2**-126 (~5.2e-36) are quantized against it.
    Zeros (either sign) and float32 subnormal inputs read as +0, so they give q = +0; a nonzero
    x whose product underflows gives a zero of its own sign.
  - A block holding inf or NaN gets scale NaN and q NaN throughout (e4m3fn has no inf), so it
    dequantizes to NaN and poisons whatever it reaches instead of turning into finite garbage.
  - Partial blocks: when a dim is not a multiple of the block, its last block is shorter; the scale
    is over the elements present. Scale shapes round up: [..., ceil(R / rows), ceil(C / cols)].
  - valid_rows (a device scalar, optional): rows at or past it are read as zero, so they neither
    enter a block's amax nor come out nonzero (an expert block's unused rows may hold anything).
    A batched `quantize` (leading dims) takes one valid_rows for all; vmap for one each.

Scale layouts of the three expert matmuls (BLOCK = 128; every scale is along the contracted dim):
  forward    y  = gmm(x, w):          x [M, K] by ACT (1x128)   -> scale [M, ceil(K/128)]
                                      w [G, K, N] by WEIGHT (128x128) -> [G, ceil(K/128), ceil(N/128)]
  input grad dx = gmm(dy, w, transpose_rhs=True): dy [M, N] by ACT -> [M, ceil(N/128)]; w and its
                                      scale as in the forward (a 128x128 block serves both
                                      contractions, so the weights are quantized once)
  weight grad dw = tgmm(x, dy):       x [M, K] and dy [M, N] by ACT_T (128x1), along the rows
                                      -> [ceil(M/128), K] and [ceil(M/128), N]
  The weight-gradient blocks are absolute 128-row blocks [128 b, 128 b + 128) of the whole [M, .]
  operand, regardless of groups: a block that straddles a group edge has one scale per column for
  the rows of both groups, so a group of small values beside one of large values is quantized
  against the larger amax (fewer significant bits, down to e4m3's subnormals; with valid_rows, the
  rows past the groups' end never raise it). The kernel splits a group's contraction at these
  block edges (its first and last pieces may be partial) and scales each piece's partial sum by
  the block's two scale vectors (an outer product). Per-group blocks would isolate groups but make
  the layout depend on the device's group sizes (ceil(M/128) + G worst-case blocks); padding each
  group to a multiple of 128 rows would avoid the question, and sluice does not pad groups.

FP8 grouped GEMMs (`gmm_fp8_reference`, `tgmm_fp8_reference`): the operands dequantized to float32
per block, then gmm_reference / tgmm_reference in float32 (exact products, float32 accumulation,
ragged_dot's semantics: rows past sum(group_sizes) and empty groups give zeros), output bfloat16
by default. This is the float32 ideal a kernel approaches: a kernel multiplies e4m3 values on the
tensor cores and, as DeepSeek-V3 does, promotes each 128-long partial sum along the contraction to
float32, scaled by the two blocks' scales; it differs from the reference by float32 rounding only
(plus whatever its FP8 accumulator loses inside one 128-long piece).

The ops (gmm_fp8.py, part of this namespace): `gmm` and `tgmm` take quantized operands with the
references' signatures and run the FP8 kernels (CPU and CUDA); `Recipe` configures the
differentiable FP8 path for unquantized operands, `sluice.gmm(lhs, rhs, group_sizes, fp8=Recipe())`;
`prequantize(w)` quantizes weights once for several of sluice.ep's FP8 expert calls (`Fp8Weight`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._lib import register_targets
from .checks import ShapeError
from .gmm import gmm_reference, tgmm_reference
from .vma import _vary_kw

register_targets(
    {
        "sluice_quantize_fp8": "sl_ffi_quantize_fp8",
        "sluice_quantize_fp8_both": "sl_ffi_quantize_fp8_both",
    }
)

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0
SCALE_MIN = 2.0**-126  # the smallest normal float32
# The scale is amax times float32(1/448), a product: XLA rewrites a division by a constant into one
# anyway, and a kernel computes the same bits with one multiply.
RCP_MAX = float(np.float32(1.0 / E4M3_MAX))
BLOCK = 128
ACT = (1, BLOCK)  # activations, contracted along their last dim (gmm's lhs)
ACT_T = (BLOCK, 1)  # operands contracted along their rows (tgmm's lhs and rhs)
WEIGHT = (BLOCK, BLOCK)  # expert weights [G, K, N], either orientation

__all__ = [
    "ACT",
    "ACT_T",
    "BLOCK",
    "E4M3",
    "E4M3_MAX",
    "RCP_MAX",
    "SCALE_MIN",
    "WEIGHT",
    "Fp8Weight",
    "Recipe",
    "dequantize",
    "gmm",
    "gmm_fp8_reference",
    "prequantize",
    "quantize",
    "quantize_act",
    "quantize_both",
    "quantize_t",
    "quantize_weight",
    "scale_shape",
    "swiglu_bwd_quantize",
    "swiglu_quantize",
    "tgmm",
    "tgmm_fp8_reference",
]


def _block(op, block):
    try:
        br, bc = (int(b) for b in block)
    except (TypeError, ValueError):
        raise TypeError(f"sluice.fp8.{op}: block must be a pair of ints, got {block!r}") from None
    if br < 1 or bc < 1:
        raise ValueError(f"sluice.fp8.{op}: block sizes must be positive, got {block!r}")
    return br, bc


def scale_shape(shape, block):
    """The scale's shape for an operand of `shape` quantized by `block` over its last two dims."""
    br, bc = _block("scale_shape", block)
    if len(shape) < 2:
        raise ShapeError(f"sluice.fp8: operands must be at least 2-D, got shape {tuple(shape)}")
    *lead, r, c = shape
    return (*lead, math.ceil(r / br), math.ceil(c / bc))


def _blocked(x, br, bc):
    """x [..., R, C] zero-padded and reshaped to [..., R/br, br, C/bc, bc]."""
    *lead, r, c = x.shape
    pad = [(0, 0)] * len(lead) + [(0, -r % br), (0, -c % bc)]
    xp = jnp.pad(x, pad)
    return xp.reshape(*lead, xp.shape[-2] // br, br, xp.shape[-1] // bc, bc)


def _unblocked(xb, r, c):
    *lead, nr, br, nc, bc = xb.shape
    return xb.reshape(*lead, nr * br, nc * bc)[..., :r, :c]


def _pow2_ceil(s, amax):
    """The smallest power of two p >= SCALE_MIN with 448 * p >= amax, from s = scale (a normal
    float32 within float32 rounding of amax / 448, at least SCALE_MIN)."""
    m, e = jnp.frexp(s)  # s = m * 2**e, m in [0.5, 1)
    p = jnp.ldexp(jnp.ones_like(s), jnp.where(m == 0.5, e - 1, e))  # the power of two >= s
    # s is rounded, so p may be off by one factor of two either way near a power of two.
    p = jnp.where(E4M3_MAX * p < amax, 2 * p, p)
    half = 0.5 * p
    return jnp.where((E4M3_MAX * half >= amax) & (half >= SCALE_MIN), half, p)


def _rcp_rn(s):
    """1 / s correctly rounded, for the scales (normal float32 > 0 whose reciprocal is normal; NaN
    stays NaN), in integer arithmetic: XLA:GPU lowers a float32 division to div.full (it sets
    -nvptx-prec-divf32=1), up to 2 ulp off, which would move the rule's q by one e4m3 step where
    x * rcp lies near a rounding boundary. With s = m * 2**(E - 150) (m the 24-bit significand,
    E the biased exponent), 1 / s = floor(2**47 / m) * 2**(103 - E) plus the remainder's rounding;
    2**47 / m is a long division in uint32, 8 bits at a time."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    e = (bits >> 23) & 0xFF
    m = (bits & 0x7FFFFF) | 0x800000
    q, r = jnp.uint32(1 << 31) // m, jnp.uint32(1 << 31) % m  # q <= 2**8
    for _ in range(2):
        r = r << 8  # r < 2**24
        q, r = (q << 8) | (r // m), r % m
    # q = floor(2**47 / m) in (2**23, 2**24]; round to nearest, ties to even
    q = q + ((2 * r > m) | ((2 * r == m) & ((q & 1) == 1))).astype(jnp.uint32)
    top = q >= (1 << 24)  # 2**24: m a power of two, or the rounding carried
    out = jnp.where(top, (254 - e) << 23, ((253 - e) << 23) | (q & 0x7FFFFF))
    return jnp.where(jnp.isnan(s), s, jax.lax.bitcast_convert_type(out, jnp.float32))


def _check_x(op, x):
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ShapeError(f"sluice.fp8.{op}: x must be at least 2-D, got shape {x.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"sluice.fp8.{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def _row_range(x, row_range, valid_rows):
    """int32 [2]: the rows of x read as themselves, [lo, hi); the others read as zero."""
    lo, hi = (0, x.shape[-2]) if row_range is None else row_range
    if valid_rows is not None:
        hi = jnp.minimum(jnp.asarray(hi, jnp.int32), jnp.asarray(valid_rows, jnp.int32))
    return jnp.stack([jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)])


def quantize(x, block, *, power_of_two=False, valid_rows=None, row_range=None):
    """Quantizes x [..., R, C] to e4m3 in blocks of `block` = (rows, cols) over the last two dims.

    Args:
      x: float32, bfloat16 or float16, at least 2-D; leading dims are batch dims.
      block: (rows, cols), e.g. ACT (1, 128), ACT_T (128, 1), WEIGHT (128, 128).
      power_of_two: round each scale up to a power of two (exact dequantization, no saturation).
      valid_rows: optional int scalar (may live on the device): rows >= valid_rows read as zero.
      row_range: optional (lo, hi) int scalars (may live on the device): rows outside [lo, hi)
        read as zero (with valid_rows too: both apply).
    Returns:
      (q, scale): q float8_e4m3fn [..., R, C], scale float32 [..., ceil(R/rows), ceil(C/cols)].
      The rules (zero, tiny, inf/NaN and partial blocks) are in the module docstring. On a GPU
      the CUDA kernel (sl_quantize_fp8_cuda) computes the same bits for the three blocks of the
      recipe; elsewhere, and for other blocks, this jnp code does.
    """
    br, bc = _block("quantize", block)
    x = _check_x("quantize", x)
    rr = _row_range(x, row_range, valid_rows)
    if (br, bc) not in (ACT, ACT_T, WEIGHT):
        return _quantize_jnp(x, rr, br=br, bc=bc, power_of_two=power_of_two)
    return jax.lax.platform_dependent(
        x,
        rr,
        cuda=functools.partial(_quantize_kernel, block=(br, bc), power_of_two=power_of_two),
        default=functools.partial(_quantize_jnp, br=br, bc=bc, power_of_two=power_of_two),
    )


def quantize_t(x, *, power_of_two=False, row_range=None, pad_rows_to=1):
    """x [..., R, C] quantized in ACT_T blocks (128 x 1, along the rows) and returned transposed:
    (q_t float8_e4m3fn [..., C, R'], scale float32 [..., ceil(R'/128), C]) with R' = R rounded up
    to a multiple of pad_rows_to (the added rows zero), rows outside row_range read as zero. The
    weight gradient's operand layout: on a GPU one kernel pass writes it (no transpose of q)."""
    x = _check_x("quantize_t", x)
    r = x.shape[-2]
    rp = -(-r // pad_rows_to) * pad_rows_to
    rr = _row_range(x, row_range, None)

    def jnp_path(x, rr):
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rp - r), (0, 0)]) if rp != r else x
        q, s = _quantize_jnp(xp, rr, br=ACT_T[0], bc=ACT_T[1], power_of_two=power_of_two)
        return jnp.swapaxes(q, -1, -2), s

    def kernel_path(x, rr):
        return _quantize_kernel(
            x, rr, block=ACT_T, power_of_two=power_of_two, rows=rp, outputs=("q_t",)
        )

    return jax.lax.platform_dependent(x, rr, cuda=kernel_path, default=jnp_path)


def quantize_both(x, *, power_of_two=False, row_range=None, pad_rows_to=1, gather=None):
    """An activation x [..., R, C] in both of the layouts an FP8 matmul and its weight gradient
    take: ((q, scale), (q_t, scale_t)) = (quantize(x, ACT), quantize_t(x, row_range=row_range,
    pad_rows_to=pad_rows_to)), bit for bit: q by 1x128 blocks from every row of x, q_t by 128x1
    blocks from the rows inside row_range, transposed and padded. On a GPU one kernel pass reads
    x once for both (sl_quantize_fp8_both_cuda).

    gather: optional int32 [..., R'] (x's batch dims): the activation is then x's rows picked by
    index, x[..., gather, :] with the rows whose index is outside [0, x.shape[-2]) zero (R = R',
    row_range in its rows), the same bits as quantizing those rows taken first; on a GPU the
    kernel reads them where they are, so the picked copies (fan-out's, of token rows) are never
    written."""
    x = _check_x("quantize_both", x)
    if gather is not None:
        gather = jnp.asarray(gather)
        if gather.dtype != jnp.int32 or gather.shape[:-1] != x.shape[:-2] or gather.ndim < 1:
            raise ShapeError(
                f"sluice.fp8.quantize_both: gather must be int32 [..., rows] with x's batch dims "
                f"{x.shape[:-2]}, got {gather.dtype} {gather.shape}"
            )
    *lead, r, c = x.shape if gather is None else (*gather.shape, x.shape[-1])
    rp = -(-r // pad_rows_to) * pad_rows_to
    rr = _row_range(jax.ShapeDtypeStruct((*lead, r, c), x.dtype), row_range, None)
    g = jnp.zeros((0,), jnp.int32) if gather is None else gather

    def jnp_path(x, rr, g):
        if gather is not None:
            x = _take_rows(x, g)
        act = quantize(x, ACT, power_of_two=power_of_two)
        return act, quantize_t(x, power_of_two=power_of_two, row_range=rr, pad_rows_to=pad_rows_to)

    def kernel_path(x, rr, g):
        kw = _vary_kw(x, rr, g)
        call = jax.ffi.ffi_call(
            "sluice_quantize_fp8_both", _both_shapes(lead, r, c, rp, kw),
            vmap_method="broadcast_all",
        )  # fmt: skip
        q, s, qt, st = call(
            x,
            jnp.broadcast_to(rr, (*lead, 2)),
            g,
            rows=np.int64(rp),
            power_of_two=np.int64(bool(power_of_two)),
            gathered=np.int64(gather is not None),
        )
        return (q, s), (qt, st)

    return jax.lax.platform_dependent(x, rr, g, cuda=kernel_path, default=jnp_path)


def _both_shapes(lead, r, c, rp, kw):
    """The results of a both-layouts kernel for an activation [*lead, r, c] whose q_t has rp rows:
    q, its 1x128 scale, q_t and its 128x1 scale (kw: _vary_kw's)."""
    return (
        jax.ShapeDtypeStruct((*lead, r, c), E4M3, **kw),
        jax.ShapeDtypeStruct((*lead, r, -(-c // BLOCK)), jnp.float32, **kw),
        jax.ShapeDtypeStruct((*lead, c, rp), E4M3, **kw),
        jax.ShapeDtypeStruct((*lead, -(-rp // BLOCK), c), jnp.float32, **kw),
    )


def _take_rows(x, idx):
    """x [..., N, C] -> x[..., idx, :] ([..., R, C]), rows whose index is outside [0, N) zero."""
    n = x.shape[-2]
    ok = (idx >= 0) & (idx < n)
    rows = jnp.take_along_axis(x, jnp.where(ok, idx, 0)[..., None], axis=-2)
    return jnp.where(ok[..., None], rows, jnp.zeros((), x.dtype))


def _quantize_kernel(x, rr, *, block, power_of_two, rows=None, outputs=("q",)):
    """The CUDA kernel on x [..., R, C]: the `outputs` asked for, of q [..., rows, C] and q_t
    [..., C, rows] (in that order), then the scale (in q's block layout)."""
    *lead, r, c = x.shape
    rows = r if rows is None else rows
    br, bc = block
    sshape = (*lead, rows if br == 1 else -(-rows // 128), c if bc == 1 else -(-c // 128))
    want_q, want_qt = "q" in outputs, "q_t" in outputs
    none = (0,)
    kw = _vary_kw(x, rr)
    call = jax.ffi.ffi_call(
        "sluice_quantize_fp8",
        (
            jax.ShapeDtypeStruct((*lead, rows, c) if want_q else none, E4M3, **kw),
            jax.ShapeDtypeStruct((*lead, c, rows) if want_qt else none, E4M3, **kw),
            jax.ShapeDtypeStruct(sshape, jnp.float32, **kw),
        ),
        vmap_method="broadcast_all",
    )
    rr = jnp.broadcast_to(rr, (*lead, 2))
    q, qt, s = call(
        x,
        rr,
        rows=np.int64(rows),
        block_rows=np.int64(br),
        block_cols=np.int64(bc),
        power_of_two=np.int64(bool(power_of_two)),
        write_q=np.int64(want_q),
        write_qt=np.int64(want_qt),
    )
    return (*((q,) if want_q else ()), *((qt,) if want_qt else ()), s)


def _quantize_jnp(x, rr, *, br, bc, power_of_two):
    """The rule in jnp (the definition the kernel follows): rows outside rr = [lo, hi) read as zero."""
    *_, r, c = x.shape
    x = x.astype(jnp.float32)
    rows = jnp.arange(r)
    x = jnp.where(((rows >= rr[..., 0:1]) & (rows < rr[..., 1:2]))[..., :, None], x, 0.0)
    xb = _blocked(x, br, bc)
    amax = jnp.max(jnp.abs(xb), axis=(-3, -1))  # the zero padding never wins
    # Non-finite blocks are found by their own reduction: XLA:CPU's max reduction drops NaN.
    finite = jnp.all(jnp.isfinite(xb), axis=(-3, -1))
    scale = jnp.maximum(amax * jnp.float32(RCP_MAX), SCALE_MIN)
    if power_of_two:
        scale = _pow2_ceil(scale, amax)
    scale = jnp.where(finite, scale, jnp.nan)
    rcp = _rcp_rn(scale)
    xb = jnp.where(jnp.abs(xb) < SCALE_MIN, 0.0, xb)  # zeros and subnormals as +0
    y = xb * rcp[..., :, None, :, None]
    q = jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(E4M3)  # XLA's convert rounds to nearest even
    return _unblocked(q, r, c), scale


def quantize_act(x, *, axis=-1, power_of_two=False, valid_rows=None):
    """Activations x [..., M, K] quantized along the dim a matmul contracts.

    axis=-1 (the last dim, gmm's lhs): ACT blocks (1x128), scale [..., M, ceil(K/128)].
    axis=-2 (the rows, tgmm's operands): ACT_T blocks (128x1), scale [..., ceil(M/128), K].
    For a 2-D x, axis 1 and 0 name the same dims. power_of_two, valid_rows: as in `quantize`.
    """
    nd = jnp.ndim(x)
    if nd < 2 or axis not in (-1, -2, nd - 1, nd - 2):
        raise ValueError(
            f"sluice.fp8.quantize_act: axis must name one of the last two dims of a "
            f"{nd}-D operand, got {axis}"
        )
    block = ACT if axis in (-1, nd - 1) else ACT_T
    return quantize(x, block, power_of_two=power_of_two, valid_rows=valid_rows)


WEIGHT_LAYOUTS = ("q", "q_t", "both")


def quantize_weight(w, *, power_of_two=False, layout="q"):
    """Expert weights w [..., K, N] (e.g. [G, K, N]) in WEIGHT blocks (128x128), in the layouts
    the FP8 matmuls read.

    layout "q": (q [..., K, N], scale [..., ceil(K/128), ceil(N/128)]), as quantize(w, WEIGHT).
      The same q and scale serve gmm (contracting K) and, with transpose_rhs=True, the input
      gradient (contracting N).
    layout "q_t": (q_t, scale_t), their transposes (swapaxes of the last two dims): a 128x128
      block transposed is the block of the transpose, so these are w's transpose quantized.
    layout "both": ((q, scale), (q_t, scale_t)).
    On a GPU one kernel pass reads w once and writes the layouts asked for (no transpose of q
    afterwards); elsewhere q is quantized and swapped.
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(
            f"sluice.fp8.quantize_weight: layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}"
        )
    if layout == "q":
        return quantize(w, WEIGHT, power_of_two=power_of_two)
    w = _check_x("quantize_weight", w)
    rr = _row_range(w, None, None)

    def jnp_path(w, rr):
        q, s = _quantize_jnp(w, rr, br=BLOCK, bc=BLOCK, power_of_two=power_of_two)
        t = (jnp.swapaxes(q, -1, -2), jnp.swapaxes(s, -1, -2))
        return ((q, s), t) if layout == "both" else t

    def kernel_path(w, rr):
        outputs = ("q", "q_t") if layout == "both" else ("q_t",)
        *qs, s = _quantize_kernel(w, rr, block=WEIGHT, power_of_two=power_of_two, outputs=outputs)
        t = (qs[-1], jnp.swapaxes(s, -1, -2))
        return ((qs[0], s), t) if layout == "both" else t

    return jax.lax.platform_dependent(w, rr, cuda=kernel_path, default=jnp_path)


def _expand(scale, block, r, c):
    """scale [..., nr, nc] repeated over its blocks and cut to [..., r, c]."""
    br, bc = block
    s = jnp.repeat(jnp.repeat(scale, br, axis=-2), bc, axis=-1)
    return s[..., :r, :c]


def _check_pair(op, name, q, scale, block):
    if q.dtype != E4M3:
        raise TypeError(f"sluice.fp8.{op}: {name} must be float8_e4m3fn, got {q.dtype}")
    if scale.dtype != jnp.float32:
        raise TypeError(f"sluice.fp8.{op}: {name}'s scale must be float32, got {scale.dtype}")
    want = scale_shape(q.shape, block)
    if tuple(scale.shape) != want:
        raise ShapeError(
            f"sluice.fp8.{op}: {name} {q.shape} in {block[0]}x{block[1]} blocks needs a scale of "
            f"shape {want}, got {scale.shape}"
        )


def dequantize(q, scale, block, *, dtype=jnp.float32):
    """The inverse of `quantize`: float32(q) * scale per block, as `dtype` (float32 by default)."""
    q, scale = jnp.asarray(q), jnp.asarray(scale)
    block = _block("dequantize", block)
    _check_pair("dequantize", "q", q, scale, block)
    *_, r, c = q.shape
    return (q.astype(jnp.float32) * _expand(scale, block, r, c)).astype(dtype)


def gmm_fp8_reference(
    lhs_q,
    lhs_scale,
    rhs_q,
    rhs_scale,
    group_sizes,
    *,
    transpose_rhs=False,
    group_offset=None,
    preferred_element_type=jnp.bfloat16,
):
    """The FP8 gmm's reference: gmm(dequantize(lhs), dequantize(rhs)) in float32.

    Args:
      lhs_q, lhs_scale: [M, K] e4m3 and its ACT scale [M, ceil(K/128)] (`quantize_act(x)`).
      rhs_q, rhs_scale: [G_local, K, N] (or [G_local, N, K] with transpose_rhs) e4m3 and its WEIGHT
        scale over its own last two dims (`quantize_weight(w)`): the input gradient passes the
        forward's w [G, K', N'] and scale unchanged with transpose_rhs=True (contracting N').
      group_sizes, transpose_rhs, group_offset: as sluice.gmm.
      preferred_element_type: output dtype, bfloat16 by default.
    Returns:
      [M, N]; rows outside the local groups are zero.
    """
    lhs_q, lhs_scale, rhs_q, rhs_scale = _gmm_operands(
        "gmm_fp8_reference", lhs_q, lhs_scale, rhs_q, rhs_scale, transpose_rhs
    )
    lhs = dequantize(lhs_q, lhs_scale, ACT)
    rhs = dequantize(rhs_q, rhs_scale, WEIGHT)
    return gmm_reference(
        lhs,
        rhs,
        jnp.asarray(group_sizes, jnp.int32),
        transpose_rhs=transpose_rhs,
        group_offset=group_offset,
        preferred_element_type=preferred_element_type,
    )


def _gmm_operands(op, lhs_q, lhs_scale, rhs_q, rhs_scale, transpose_rhs):
    """gmm's FP8 operands as arrays, checked: lhs [M, K] e4m3 with its ACT scale, rhs [G_local, K, N]
    (or [G_local, N, K] with transpose_rhs) with its WEIGHT scale (sluice.fp8.`op` in the
    messages)."""
    lhs_q, lhs_scale = jnp.asarray(lhs_q), jnp.asarray(lhs_scale)
    rhs_q, rhs_scale = jnp.asarray(rhs_q), jnp.asarray(rhs_scale)
    if lhs_q.ndim != 2 or rhs_q.ndim != 3:
        want = "[G_local, N, K]" if transpose_rhs else "[G_local, K, N]"
        raise ShapeError(
            f"sluice.fp8.{op}: lhs_q must be 2-D [M, K] and rhs_q 3-D {want}, got {lhs_q.shape} "
            f"and {rhs_q.shape}"
        )
    _check_pair(op, "lhs", lhs_q, lhs_scale, ACT)
    _check_pair(op, "rhs", rhs_q, rhs_scale, WEIGHT)
    k_rhs = rhs_q.shape[2] if transpose_rhs else rhs_q.shape[1]
    if k_rhs != lhs_q.shape[1]:
        raise ShapeError(
            f"sluice.fp8.{op}: contraction dims differ: lhs {lhs_q.shape} has K={lhs_q.shape[1]}, "
            f"rhs {rhs_q.shape} has K={k_rhs} (transpose_rhs={bool(transpose_rhs)})"
        )
    return lhs_q, lhs_scale, rhs_q, rhs_scale


def _tgmm_operands(op, lhs_q, lhs_scale, rhs_q, rhs_scale):
    """The weight gradient's FP8 operands as arrays, checked: lhs [M, K] and rhs [M, N] e4m3 with
    their ACT_T scales (sluice.fp8.`op` in the messages)."""
    lhs_q, lhs_scale = jnp.asarray(lhs_q), jnp.asarray(lhs_scale)
    rhs_q, rhs_scale = jnp.asarray(rhs_q), jnp.asarray(rhs_scale)
    if lhs_q.ndim != 2 or rhs_q.ndim != 2 or rhs_q.shape[0] != lhs_q.shape[0]:
        raise ShapeError(
            f"sluice.fp8.{op}: lhs_q [M, K] and rhs_q [M, N] must be 2-D with the same rows, got "
            f"{lhs_q.shape} and {rhs_q.shape}"
        )
    _check_pair(op, "lhs", lhs_q, lhs_scale, ACT_T)
    _check_pair(op, "rhs", rhs_q, rhs_scale, ACT_T)
    return lhs_q, lhs_scale, rhs_q, rhs_scale


def tgmm_fp8_reference(
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
    """The FP8 tgmm's reference (the weight gradient): tgmm(dequantize(lhs), dequantize(rhs)).

    Args:
      lhs_q, lhs_scale: [M, K] e4m3 and its ACT_T scale [ceil(M/128), K]
        (`quantize_act(x, axis=-2)`); rhs_q, rhs_scale: [M, N] and [ceil(M/128), N] likewise.
        The 128-row blocks are absolute, crossing group edges (see the module docstring).
      group_sizes, group_offset, num_local_groups: as sluice.tgmm.
      preferred_element_type: output dtype, bfloat16 by default.
    Returns:
      [num_local_groups, K, N]; an empty group gives zeros.
    """
    lhs_q, lhs_scale, rhs_q, rhs_scale = _tgmm_operands(
        "tgmm_fp8_reference", lhs_q, lhs_scale, rhs_q, rhs_scale
    )
    return tgmm_reference(
        dequantize(lhs_q, lhs_scale, ACT_T),
        dequantize(rhs_q, rhs_scale, ACT_T),
        jnp.asarray(group_sizes, jnp.int32),
        group_offset=group_offset,
        num_local_groups=num_local_groups,
        preferred_element_type=preferred_element_type,
    )


# The FP8 ops build on the quantization above and belong to this namespace: sluice.fp8.gmm / tgmm
# on quantized operands and the Recipe of sluice.gmm(..., fp8=...) (gmm_fp8.py); the SwiGLU's
# activation and gradient quantized as they are computed (fp8_swiglu.py).
from .fp8_swiglu import swiglu_bwd_quantize, swiglu_quantize
from .gmm_fp8 import Fp8Weight, Recipe, gmm, prequantize, tgmm

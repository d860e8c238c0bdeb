"""sluice.fp8: block quantization to e4m3 against an independent numpy model (ml_dtypes' e4m3 cast),
its error bounds and edge cases (saturation, zero, tiny and non-finite blocks, partial blocks,
valid_rows), jit and vmap; the FP8 grouped GEMM references against jax.lax.ragged_dot(_general) on
the dequantized operands, and against bf16 sluice.gmm / tgmm on the original operands within FP8's
error bound."""

import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import sluice
from helpers import rel_err
from sluice import fp8

# Fresh random inputs every run; a failure names its seed, and SLUICE_TEST_SEED=<seed> repeats it.
SEED = int(os.environ.get("SLUICE_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
RNG = np.random.default_rng(SEED)
U = 2.0**-4  # e4m3's unit roundoff: 3 mantissa bits, round to nearest
BLOCKS = [fp8.ACT, fp8.ACT_T, fp8.WEIGHT, (4, 8)]
SHAPES = [(1, 5), (3, 128), (130, 257), (256, 384), (2, 129, 200)]


def scaled_normal(shape, dtype=jnp.float32, spread=4):
    """Normal draws with a magnitude of 10**U(-spread, spread) per row, so blocks of different
    rows have very different scales."""
    mag = 10.0 ** RNG.uniform(-spread, spread, size=(*shape[:-1], 1))
    return jnp.asarray(RNG.standard_normal(shape) * mag, dtype)


def np_quantize(x, block, power_of_two):
    """The quantization rules in numpy, independently: amax per block, scale, ml_dtypes' cast."""
    x = np.asarray(x, np.float32)
    (br, bc), (*lead, r, c) = block, x.shape
    nr, nc = math.ceil(r / br), math.ceil(c / bc)
    xp = np.zeros((*lead, nr * br, nc * bc), np.float32)
    xp[..., :r, :c] = x
    xb = xp.reshape(*lead, nr, br, nc, bc)
    amax = np.abs(xb).max(axis=(-3, -1))
    if power_of_two:
        with np.errstate(divide="ignore"):
            e = np.ceil(np.log2(amax.astype(np.float64) / 448.0))
        scale = np.maximum(2.0**e, 2.0**-126).astype(np.float32)
    else:
        scale = np.maximum(amax * np.float32(1 / 448), np.float32(2.0**-126))
    rcp = (np.float32(1) / scale).astype(np.float32)
    y = np.clip(xb * rcp[..., :, None, :, None], -448, 448)
    q = y.astype(ml_dtypes.float8_e4m3fn).reshape(xp.shape)[..., :r, :c]
    return q, scale


def expanded(scale, block, shape):
    s = np.repeat(np.repeat(np.asarray(scale), block[0], -2), block[1], -1)
    return s[..., : shape[-2], : shape[-1]]


def bits(a):
    return np.asarray(a).view(np.uint8 if np.asarray(a).itemsize == 1 else np.uint32)


# ---- quantization ------------------------------------------------------------------------------
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_numpy_model_and_error_bound(shape, block, power_of_two):
    x = scaled_normal(shape)
    q, scale = fp8.quantize(x, block, power_of_two=power_of_two)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == fp8.scale_shape(x.shape, block)
    q_np, s_np = np_quantize(x, block, power_of_two)
    np.testing.assert_array_equal(bits(q), bits(q_np), err_msg=f"SLUICE_TEST_SEED={SEED}")
    np.testing.assert_array_equal(bits(scale), bits(s_np), err_msg=f"SLUICE_TEST_SEED={SEED}")
    # |x - deq| <= 2**-4 max(|x|, 2**-6 scale), plus float32 rounding without power-of-two scales
    xs, d = np.asarray(x, np.float64), np.asarray(fp8.dequantize(q, scale, block), np.float64)
    s = expanded(scale, block, x.shape).astype(np.float64)
    slack = 0.0 if power_of_two else 2.0**-22
    assert np.all(np.abs(xs - d) <= (U + slack) * np.maximum(np.abs(xs), 2.0**-6 * s))
    if power_of_two:
        m, _ = np.frexp(np.asarray(scale))
        assert np.all(m == 0.5)
        assert np.all(np.abs(np.asarray(q, np.float32)) <= 448)


def test_scale_reciprocal_is_correctly_rounded():
    """The jnp rule's 1 / scale (fp8._rcp_rn, integer arithmetic) is the correctly rounded float32
    reciprocal on every platform (XLA:GPU's own float32 division is div.full, up to 2 ulp off):
    random normal scales over the rule's range, powers of two, significands at both ends, NaN."""
    raw = RNG.integers(1 << 23, 247 << 23, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = [2.0**-126, 1.0, 3.0, 448.0, 1 / 448, np.nextafter(np.float32(2), 0), 3.4e38 / 448]
    s = np.concatenate(
        [raw.view(np.float32), np.asarray(edges, np.float32), 2.0 ** np.arange(-126.0, 120.0)]
    ).astype(np.float32)
    got = np.asarray(jax.jit(fp8._rcp_rn)(jnp.asarray(s)))
    # float64's division rounded to float32 is correctly rounded (53 >= 2 * 24 + 2 bits)
    want = (1.0 / s.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"SLUICE_TEST_SEED={SEED}")
    assert np.isnan(np.asarray(fp8._rcp_rn(jnp.float32(np.nan))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_input_dtypes_and_block_amax_maps_to_448(dtype):
    x = scaled_normal((6, 300), dtype, spread=2)
    q, scale = fp8.quantize_act(x)
    xf = np.asarray(x, np.float32)
    amax = np.abs(np.pad(xf, ((0, 0), (0, 84)))).reshape(6, 3, 128).max(-1)
    np.testing.assert_array_equal(np.asarray(scale), amax * np.float32(1 / 448))
    qa = np.abs(np.asarray(q, np.float32)).reshape(6, -1)
    blocks = [qa[:, :128].max(1), qa[:, 128:256].max(1), qa[:, 256:].max(1)]
    assert np.all(np.stack(blocks, 1) == 448)  # each block's amax element lands on +-448


@pytest.mark.parametrize("power_of_two", [False, True])
def test_representable_values_round_trip_exactly(power_of_two):
    # Per 128x128 block: e4m3 values times 2**k, one element +-448 * 2**k: the scale is 2**k in
    # both modes, and the round trip is bit for bit.
    codes = RNG.integers(0, 256, size=(2, 256, 384), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    v = np.asarray(codes, np.float32)
    v[~np.isfinite(v)] = 0.0
    k = RNG.integers(-30, 30, size=(2, 2, 3))
    v[:, ::128, ::128] = np.where(RNG.random((2, 2, 3)) < 0.5, -448.0, 448.0)
    x = (v * expanded(2.0**k, fp8.WEIGHT, v.shape)).astype(np.float32)
    q, scale = fp8.quantize_weight(jnp.asarray(x), power_of_two=power_of_two)
    np.testing.assert_array_equal(np.asarray(scale), (2.0**k).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(q, scale, fp8.WEIGHT)), x)


def test_saturation_and_huge_values():
    big = np.finfo(np.float32).max
    for p2 in (False, True):
        # With power-of-two scales, |x| within 2**-5 of float32's max may dequantize to 2**128 = inf
        top = 3.2e38 if p2 else big
        x = jnp.asarray([[top, -top, 1.0, 3e38], [1e30, -2e30, 0.5e30, 7.0]], jnp.float32)
        q, scale = fp8.quantize(x, (1, 4), power_of_two=p2)
        qf = np.asarray(q, np.float32)
        assert np.all(np.isfinite(qf)) and np.all(np.abs(qf) <= 448)
        assert np.all(np.isfinite(np.asarray(scale)))
        d = np.asarray(fp8.dequantize(q, scale, (1, 4)), np.float64)
        assert np.all(np.isfinite(d))
        xs = np.asarray(x, np.float64)
        bound = U * np.maximum(np.abs(xs), 2.0**-6 * expanded(scale, (1, 4), x.shape))
        assert np.all(np.abs(d - xs) <= (1 + 2.0**-20) * bound)
    # Values past 448 after scaling saturate instead of becoming NaN (e4m3fn's overflow).
    y = jnp.asarray([[448.0, 464.0, 470.0, 1e4]], jnp.float32)
    clipped = jnp.clip(y, -448, 448).astype(fp8.E4M3)
    assert np.all(np.asarray(clipped, np.float32) == 448)


def test_zero_and_tiny_blocks():
    x = np.zeros((3, 256), np.float32)
    sign = np.where(RNG.random(128) < 0.5, -1.0, 1.0)
    # Normal float32 values only: subnormal inputs read as zero (XLA:CPU flushes them).
    x[1, :128] = sign * RNG.uniform(1.2e-38, 5e-36, 128)  # amax < 448 * 2**-126: the floor scale
    x[2, 128:] = RNG.standard_normal(128) * 1e-30  # small but above the floor
    for p2 in (False, True):
        q, scale = fp8.quantize_act(jnp.asarray(x), power_of_two=p2)
        s = np.asarray(scale)
        assert s[0, 0] == s[0, 1] == s[1, 1] == s[2, 0] == fp8.SCALE_MIN
        assert np.all(np.asarray(q, np.float32)[0] == 0)
        assert s[1, 0] == fp8.SCALE_MIN and s[2, 1] > fp8.SCALE_MIN
        d = np.asarray(fp8.dequantize(q, scale, fp8.ACT), np.float64)
        bound = 1.0001 * U * np.maximum(np.abs(x), 2.0**-6 * expanded(s, fp8.ACT, x.shape))
        assert np.all(np.abs(d - x) <= bound)
        assert np.all(np.isfinite(d)) and np.all(d[0] == 0)


def test_signed_zeros_and_underflow():
    """Zeros of either sign and float32 subnormals give q = +0; a nonzero x whose product with the
    block's reciprocal underflows gives a zero of its own sign (as its e4m3 rounding does)."""
    x = np.zeros((1, 256), np.float32)
    x[0, :4] = [-0.0, -1e-39, 1e-39, 1.0]
    x[0, 128:131] = [3e38, -1e-30, 1e-30]
    q, _ = fp8.quantize_act(jnp.asarray(x))
    b = bits(q)[0]
    assert list(b[:3]) == [0x00, 0x00, 0x00]
    assert b[129] == 0x80 and b[130] == 0x00


def test_non_finite_blocks_come_back_nan():
    x = np.ones((2, 384), np.float32)
    x[0, 5], x[1, 200] = np.inf, np.nan
    q, scale = fp8.quantize_act(jnp.asarray(x))
    s, qf = np.asarray(scale), np.asarray(q, np.float32)
    assert np.isnan(s[0, 0]) and np.isnan(s[1, 1])
    assert np.all(np.isnan(qf[0, :128])) and np.all(np.isnan(qf[1, 128:256]))
    finite = np.isfinite(s)
    assert finite.sum() == 4 and np.all(s[finite] == np.float32(1 / 448))
    d = np.asarray(fp8.dequantize(q, scale, fp8.ACT))
    assert np.all(np.isnan(d[0, :128])) and np.all(d[0, 128:] == 1)
    assert np.all(np.isnan(d[1, 128:256])) and np.all(d[1, :128] == 1) and np.all(d[1, 256:] == 1)
    # a NaN inside a 128x128 block (a reduction XLA:CPU vectorizes, dropping NaN from its max)
    w = np.ones((2, 256, 256), np.float32)
    w[1, 10, 150] = np.nan
    ws = np.asarray(fp8.quantize_weight(jnp.asarray(w))[1])
    assert np.array_equal(np.isnan(ws), np.arange(8).reshape(2, 2, 2) == 5)


@pytest.mark.parametrize("block", [fp8.ACT, fp8.ACT_T])
def test_valid_rows_ignores_the_rows_past_it(block):
    x = np.asarray(scaled_normal((300, 200)))
    junk = x.copy()
    junk[250:] = np.nan
    zeros = x.copy()
    zeros[250:] = 0
    q, scale = jax.jit(lambda a, v: fp8.quantize(a, block, valid_rows=v))(junk, jnp.int32(250))
    q0, s0 = fp8.quantize(jnp.asarray(zeros), block)
    np.testing.assert_array_equal(bits(q), bits(q0))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(s0))
    assert np.all(np.asarray(q, np.float32)[250:] == 0)


def test_jit_and_vmap():
    x = scaled_normal((3, 130, 257))
    eager = fp8.quantize_act(x, axis=-2, power_of_two=True)
    jitted = jax.jit(lambda a: fp8.quantize_act(a, axis=-2, power_of_two=True))(x)
    mapped = jax.vmap(lambda a: fp8.quantize_act(a, axis=0, power_of_two=True))(x)
    for a, b in ((eager, jitted), (eager, mapped)):
        np.testing.assert_array_equal(bits(a[0]), bits(b[0]))
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    assert eager[1].shape == (3, 2, 257)
    # vmap with one valid_rows per slice
    rows = jnp.asarray([130, 7, 0], jnp.int32)
    qv, sv = jax.vmap(lambda a, v: fp8.quantize_act(a, valid_rows=v))(x, rows)
    for i, v in enumerate(np.asarray(rows)):
        qi, si = fp8.quantize_act(jnp.where(jnp.arange(130)[:, None] < v, x[i], 0))
        np.testing.assert_array_equal(bits(qv[i]), bits(qi))
        np.testing.assert_array_equal(np.asarray(sv[i]), np.asarray(si))
    deq = jax.jit(jax.vmap(lambda q, s: fp8.dequantize(q, s, fp8.ACT)))(qv, sv)
    assert deq.shape == x.shape and deq.dtype == jnp.float32


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((300, 384), jnp.bfloat16),
        ((2, 129, 200), jnp.bfloat16),
        ((257, 136), jnp.float16),
        ((130, 257), jnp.bfloat16),  # cols % 8: (on a GPU) the two passes it stands for
        ((200, 256), jnp.float32),
    ],
)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_quantize_both_is_the_two_layouts(shape, dtype, power_of_two):
    """quantize_both = (quantize(x, ACT), quantize_t(x, row_range, pad_rows_to)) bit for bit, on
    the CPU's jnp and the GPU's one-pass kernel alike: rows outside row_range (NaN here) reach q
    but not q_t or its scales; float32 subnormals and -0 read as +0."""
    x = np.array(scaled_normal(shape, jnp.float32))
    r = shape[-2]
    x[..., r - 7 :, :5] = np.nan  # outside the row range below
    x[..., 1, 2], x[..., 1, 3], x[..., 2, :] = 1e-39, -1e-39, -0.0
    x = jnp.asarray(x, dtype)
    rows = (jnp.int32(3), jnp.int32(r - 7))
    both = jax.jit(
        lambda a, lo, hi: fp8.quantize_both(
            a, power_of_two=power_of_two, row_range=(lo, hi), pad_rows_to=16
        )
    )
    (q, s), (qt, st) = both(x, *rows)
    q0, s0 = fp8.quantize(x, fp8.ACT, power_of_two=power_of_two)
    qt0, st0 = fp8.quantize_t(x, power_of_two=power_of_two, row_range=rows, pad_rows_to=16)
    assert q.shape == x.shape and qt.shape == (*shape[:-2], shape[-1], -(-r // 16) * 16)
    np.testing.assert_array_equal(bits(q), bits(q0))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    np.testing.assert_array_equal(bits(qt), bits(qt0))
    np.testing.assert_array_equal(np.asarray(st), np.asarray(st0))
    assert np.isnan(np.asarray(s)).any() and not np.isnan(np.asarray(st)).any()


@pytest.mark.parametrize("shape", [(300, 256), (2, 70, 200)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_both_gathers_rows(shape, dtype):
    """quantize_both(x, gather=idx) = quantize_both of the rows picked first, bit for bit (on the
    GPU the kernel reads them in place): rows repeat, come in any order, and an index outside
    [0, N) (-1, N, a huge one) gives a zero row; row_range and padding apply to the picked rows."""
    x = np.array(scaled_normal(shape, jnp.float32))
    *lead, n, _ = shape
    m = 2 * n + 5
    idx = RNG.integers(0, n, size=(*lead, m)).astype(np.int32)
    idx[..., :3] = [-1, n, 2**30]
    idx[..., 10:14] = idx[..., 9:10]  # one row copied five times in a row
    x = jnp.asarray(x, dtype)
    idx = jnp.asarray(idx)
    rows = (jnp.int32(4), jnp.int32(m - 9))

    @jax.jit
    def both(a, g, lo, hi):
        return fp8.quantize_both(a, row_range=(lo, hi), pad_rows_to=16, gather=g)

    got = jax.tree.leaves(both(x, idx, *rows))
    picked = jnp.take_along_axis(x, jnp.clip(idx, 0, n - 1)[..., None], axis=-2)
    picked = jnp.where(((idx >= 0) & (idx < n))[..., None], picked, 0)
    want = jax.tree.leaves(fp8.quantize_both(picked, row_range=rows, pad_rows_to=16))
    assert got[0].shape == (*lead, m, shape[-1])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(w))
    with pytest.raises(sluice.ShapeError, match="gather must be int32"):
        fp8.quantize_both(x, gather=idx.astype(jnp.float32))


def test_weight_blocks_serve_both_orientations():
    w = scaled_normal((3, 200, 300))
    q, scale = fp8.quantize_weight(w)
    qt, st = fp8.quantize_weight(jnp.swapaxes(w, 1, 2))
    np.testing.assert_array_equal(bits(jnp.swapaxes(q, 1, 2)), bits(qt))
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(scale, 1, 2)), np.asarray(st))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_weight_layouts(dtype, power_of_two):
    """quantize_weight's layouts "q_t" and "both" are q and its transpose bit for bit (on a GPU
    from one kernel pass that writes both)."""
    w = jnp.asarray(scaled_normal((3, 200, 264), jnp.float32), dtype)
    q, s = fp8.quantize_weight(w, power_of_two=power_of_two)
    (q2, s2), (qt, st) = jax.jit(
        lambda a: fp8.quantize_weight(a, power_of_two=power_of_two, layout="both")
    )(w)
    qt1, st1 = jax.jit(lambda a: fp8.quantize_weight(a, power_of_two=power_of_two, layout="q_t"))(w)
    for a, b in ((q2, q), (qt, jnp.swapaxes(q, 1, 2)), (qt1, jnp.swapaxes(q, 1, 2))):
        assert a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    for a, b in ((s2, s), (st, jnp.swapaxes(s, 1, 2)), (st1, jnp.swapaxes(s, 1, 2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="layout must be one of"):
        fp8.quantize_weight(w, layout="t")


def test_bad_arguments():
    x = jnp.ones((4, 256), jnp.float32)
    q, s = fp8.quantize_act(x)
    with pytest.raises(sluice.ShapeError, match="needs a scale of shape"):
        fp8.dequantize(q, s[:, :1], fp8.ACT)
    with pytest.raises(sluice.ShapeError, match="needs a scale of shape"):
        fp8.dequantize(q, s, fp8.ACT_T)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8.dequantize(x, s, fp8.ACT)
    with pytest.raises(TypeError, match="float32"):
        fp8.dequantize(q, s.astype(jnp.bfloat16), fp8.ACT)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fp8.quantize(x.astype(jnp.int32), fp8.ACT)
    with pytest.raises(ValueError, match="axis"):
        fp8.quantize_act(x, axis=2)
    with pytest.raises(ValueError, match="positive"):
        fp8.quantize(x, (0, 128))
    with pytest.raises(sluice.ShapeError, match="at least 2-D"):
        fp8.quantize(jnp.ones(5), fp8.ACT)
    w_q, w_s = fp8.quantize_weight(jnp.ones((2, 256, 64)))
    gs = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(sluice.ShapeError, match="contraction"):
        fp8.gmm_fp8_reference(q, s, w_q, w_s, gs, transpose_rhs=True)
    with pytest.raises(sluice.ShapeError, match="needs a scale"):
        fp8.tgmm_fp8_reference(q, s, q, s, gs)  # ACT scales where ACT_T ones belong


# ---- the FP8 grouped GEMM references -----------------------------------------------------------
def groups(used, g):
    gs = RNG.multinomial(used, RNG.dirichlet(np.full(g, 0.3)))
    gs[RNG.integers(g)] = 0  # at least one empty group
    return jnp.asarray(gs, jnp.int32)


GEMM_CASES = [(300, 200, 130, 4, 280), (256, 384, 256, 3, 256), (64, 100, 60, 5, 50)]


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gmm_fp8_reference_is_ragged_dot_of_dequantized(case, transpose_rhs):
    m, k, n, g, used = case
    gs = groups(used, g)
    x_q, x_s = fp8.quantize_act(scaled_normal((m, k), spread=1))
    w_q, w_s = fp8.quantize_weight(scaled_normal((g, n, k) if transpose_rhs else (g, k, n)))
    out = fp8.gmm_fp8_reference(
        x_q, x_s, w_q, w_s, gs, transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32
    )
    xd, wd = fp8.dequantize(x_q, x_s, fp8.ACT), fp8.dequantize(w_q, w_s, fp8.WEIGHT)
    wd = jnp.swapaxes(wd, 1, 2) if transpose_rhs else wd
    want = jax.lax.ragged_dot(xd, wd, gs, precision="highest", preferred_element_type=jnp.float32)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, want) < 1e-6
    assert np.all(np.asarray(out)[used:] == 0)
    # sluice.gmm's float32 CPU kernel on the dequantized operands agrees too
    assert rel_err(sluice.gmm(xd, wd, gs), want) < 1e-6
    bf = fp8.gmm_fp8_reference(x_q, x_s, w_q, w_s, gs, transpose_rhs=transpose_rhs)
    assert bf.dtype == jnp.bfloat16 and rel_err(bf, want) < 2**-8


def test_gmm_fp8_reference_group_offset():
    """With group_offset the local groups' rows are the same sums as in the full call: the same
    bits on the CPU. On a GPU XLA's float32 dot (cuBLAS, precision HIGHEST) picks its summation
    order by shape, so there each element is within float32's worst case for two orders of the
    same K products: 2 * (K + 1) * 2**-24 of their sum of |products| (each result within
    K * 2**-24 of the exact sum, plus rounding of the products)."""
    m, k = 130, 200
    gs = jnp.asarray([30, 0, 50, 40], jnp.int32)
    x_q, x_s = fp8.quantize_act(scaled_normal((m, k), spread=1))
    w_q, w_s = fp8.quantize_weight(scaled_normal((4, k, 64)))
    full = fp8.gmm_fp8_reference(x_q, x_s, w_q, w_s, gs, preferred_element_type=jnp.float32)
    part = fp8.gmm_fp8_reference(
        x_q, x_s, w_q[1:3], w_s[1:3], gs, group_offset=1, preferred_element_type=jnp.float32
    )
    rows = np.arange(m)
    local = (rows >= 30) & (rows < 80)  # group 2's rows (group 1 is empty)
    part_l, full_l = np.asarray(part)[local], np.asarray(full)[local]
    if jax.default_backend() == "gpu":
        xd = np.asarray(fp8.dequantize(x_q, x_s, fp8.ACT), np.float64)[local]
        wd = np.asarray(fp8.dequantize(w_q, w_s, fp8.WEIGHT), np.float64)[2]
        tol = 2 * (k + 1) * 2.0**-24 * (np.abs(xd) @ np.abs(wd))
        diff = np.abs(part_l.astype(np.float64) - full_l)
        assert np.all(diff <= tol), f"{np.sum(~(diff <= tol))} elements off"
    else:
        np.testing.assert_array_equal(part_l, full_l)
    assert np.all(np.asarray(part)[~local] == 0)


@pytest.mark.parametrize("case", GEMM_CASES)
def test_tgmm_fp8_reference_is_ragged_dot_general_of_dequantized(case):
    m, k, n, g, used = case
    gs = groups(used, g)
    x_q, x_s = fp8.quantize_act(scaled_normal((m, k), spread=1), axis=-2)
    d_q, d_s = fp8.quantize_act(scaled_normal((m, n), spread=1), axis=-2)
    out = fp8.tgmm_fp8_reference(x_q, x_s, d_q, d_s, gs, preferred_element_type=jnp.float32)
    xd, dd = fp8.dequantize(x_q, x_s, fp8.ACT_T), fp8.dequantize(d_q, d_s, fp8.ACT_T)
    dn = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())
    want = jax.lax.ragged_dot_general(
        xd, dd, gs, dn, precision="highest", preferred_element_type=jnp.float32
    )
    assert out.shape == (g, k, n) and rel_err(out, want) < 1e-6
    for j in np.nonzero(np.asarray(gs) == 0)[0]:
        assert np.all(np.asarray(out)[j] == 0)
    assert rel_err(sluice.tgmm(xd, dd, gs), want) < 1e-6


def fp8_bound(a, block_a, sa, b, block_b, sb, matmul):
    """The elementwise bound of an FP8 product against the exact one: with |a - deq a| <= u ã,
    ã = max(|a|, 2**-6 scale_a) (and b alike), |deq a . deq b - a . b| <= (2u + u**2) ã . b̃."""
    at = jnp.maximum(jnp.abs(a), 2.0**-6 * expanded(sa, block_a, a.shape))
    bt = jnp.maximum(jnp.abs(b), 2.0**-6 * expanded(sb, block_b, b.shape))
    return np.asarray(matmul(at, bt), np.float64) * (2 * U + U * U) * (1 + 2.0**-16)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_fp8_matmuls_against_bf16_within_the_quantization_bound(power_of_two):
    # The expert block's three matmuls: forward x @ w, input gradient dy @ w^T, weight gradient
    # x^T @ dy, each FP8 reference against sluice's bf16 kernels on the original operands
    # (float32 output). Bound per element: fp8_bound plus float32 accumulation (2**-16 of
    # |a| . |b|), met with a margin of ~6x; the relative Frobenius error, FP8's statistical
    # ~0.035 for two rounded operands (0.036-0.041 measured), below 0.06.
    m, k, n, g, used = 300, 384, 200, 4, 290
    gs = groups(used, g)
    x, w, dy = (scaled_normal(s, jnp.bfloat16, 1) for s in ((m, k), (g, k, n), (m, n)))
    x32, w32, dy32 = (a.astype(jnp.float32) for a in (x, w, dy))
    f32 = {"preferred_element_type": jnp.float32}
    x_q, x_s = fp8.quantize_act(x, power_of_two=power_of_two)
    w_q, w_s = fp8.quantize_weight(w, power_of_two=power_of_two)
    dy_q, dy_s = fp8.quantize_act(dy, power_of_two=power_of_two)
    xt_q, xt_s = fp8.quantize_act(x, axis=-2, power_of_two=power_of_two, valid_rows=used)
    dyt_q, dyt_s = fp8.quantize_act(dy, axis=-2, power_of_two=power_of_two, valid_rows=used)

    def check(got, want, bound_fp8, plain):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.all(np.abs(got - want) <= bound_fp8 + 2.0**-16 * np.asarray(plain))
        assert rel_err(got, want) < 0.06

    fwd = fp8.gmm_fp8_reference(x_q, x_s, w_q, w_s, gs, **f32)
    gm = lambda a, b: sluice.gmm_reference(a, b, gs, **f32)
    check(
        fwd,
        sluice.gmm(x, w, gs, **f32),
        fp8_bound(x32, fp8.ACT, x_s, w32, fp8.WEIGHT, w_s, gm),
        gm(jnp.abs(x32), jnp.abs(w32)),
    )
    dgrad = fp8.gmm_fp8_reference(dy_q, dy_s, w_q, w_s, gs, transpose_rhs=True, **f32)
    gmt = lambda a, b: sluice.gmm_reference(a, b, gs, transpose_rhs=True, **f32)
    check(
        dgrad,
        sluice.gmm(dy, w, gs, transpose_rhs=True, **f32),
        fp8_bound(dy32, fp8.ACT, dy_s, w32, fp8.WEIGHT, w_s, gmt),
        gmt(jnp.abs(dy32), jnp.abs(w32)),
    )
    wgrad = fp8.tgmm_fp8_reference(xt_q, xt_s, dyt_q, dyt_s, gs, **f32)
    tg = lambda a, b: sluice.tgmm_reference(a, b, gs, **f32)
    check(
        wgrad,
        sluice.tgmm(x, dy, gs, **f32),
        fp8_bound(x32, fp8.ACT_T, xt_s, dy32, fp8.ACT_T, dyt_s, tg),
        tg(jnp.abs(x32), jnp.abs(dy32)),
    )


def test_wgrad_rows_past_the_groups_do_not_reach_the_scales():
    # An expert block's unused rows may hold anything (zero_unused_rows=False): NaN there, with
    # valid_rows, leaves the weight gradient what zeros give.
    m, k, n, g, used = 200, 130, 70, 3, 150
    gs = groups(used, g)
    x, dy = scaled_normal((m, k), spread=1), scaled_normal((m, n), spread=1)
    x_nan, dy_nan = (a.at[used:].set(jnp.nan) for a in (x, dy))
    x_zero, dy_zero = (a.at[used:].set(0) for a in (x, dy))
    args = [fp8.quantize_act(a, axis=-2, valid_rows=used) for a in (x_nan, dy_nan)]
    got = fp8.tgmm_fp8_reference(*args[0], *args[1], gs, preferred_element_type=jnp.float32)
    ref = [fp8.quantize_act(a, axis=-2) for a in (x_zero, dy_zero)]
    want = fp8.tgmm_fp8_reference(*ref[0], *ref[1], gs, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

"""sluice.fp8.gmm / tgmm (the FP8 kernels through the FFI) against the float32 references of
sluice.fp8 and a float64 numpy reference of the dequantized operands; ragged edges, empty groups, K,
M and N not multiples of 128, 16 or 8 (the ops pad), group_offset, vmap, jit, NaN inputs and bad
input; and the differentiable path sluice.gmm(..., fp8=...) against the same quantized math.

Inputs are fresh random draws every test. Kernel outputs are not poisoned here (XLA allocates
them); the C tests (tests/c/test_gmm_fp8.c) poison every output and check that each is written.

Tolerances. The kernels and the references see the same e4m3 values and scales, so they differ in
how they sum the products only: the reference sums each output's K products in one float32 dot, the
kernels sum 128-long pieces and add them scaled. Let mag be an element's sum of |products|.

On the CPU the kernels sum in float32: against float64 each element is within
(128 + pieces + 8) * 2**-24 * mag (the bound the C tests use), plus 2**-8 of the value for a
bfloat16 result (round to nearest).

On a GPU the sm_90a kernels sum each piece on the FP8 tensor cores, whose accumulator keeps fewer
bits than float32 (DeepSeek-V3 puts it near 14): the addends are aligned to the largest and
truncated to 13 bits, so each addend of a piece is off by up to 2**-13 of the piece's largest
|product|. These errors take the products' random signs, and up to 128 of them add like
sqrt(128) ~ 2**3.5: about 2**-9.5 of the piece's sum of |products|, hence ACC_REL = 2**-9 per
piece. It is a statistical bound, not a worst case: on an H200 the excess over the float32 part
was at most 2**-10 of mag over some 3e7 elements of these shapes and larger ones (K and M up to
4096), and at most 2**-12.5 where the products along K are of one size. The pieces' sums of
|products| add up to mag, so the element bound gains ACC_REL * mag; the float32 part (scaling the
pieces, adding them) stays as on the CPU.

Norm-wise, two float32 computations of the same sums stay within 1e-5 of each other for these
sizes (a few hundred terms of random signs: about sqrt(terms) * 2**-24 ~ 1e-6); on a GPU the
tensor cores' accumulation (measured ~2.5e-4 here) gives 2e-3, the norm-wise bound
tests/gpu/test_gmm_fp8.cu uses too.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import sluice
from helpers import rel_err
from sluice import fp8
from sluice.ops.capi import gmm_workspace_bytes

RNG = np.random.default_rng()
# two float32 computations of the same sums; on a GPU, the FP8 tensor cores' own accumulation
# (module docstring)
ON_GPU = jax.default_backend() == "gpu"
F32_TOL = 2e-3 if ON_GPU else 1e-5
# the element-wise bound's part for the FP8 tensor cores' accumulation inside a piece, relative to
# the element's sum of |products| (module docstring); the CPU kernels sum in float32
ACC_REL = 2.0**-9 if ON_GPU else 0.0
F32 = jnp.float32

# Jitted once per shape: op-by-op dispatch would compile every small op of the quantization and the
# references on its own, which is most of these tests' time on a CPU.
quantize_act = jax.jit(fp8.quantize_act, static_argnames=("axis", "power_of_two"))
quantize_weight = jax.jit(fp8.quantize_weight, static_argnames=("power_of_two",))
gmm = jax.jit(
    fp8.gmm, static_argnames=("transpose_rhs", "preferred_element_type", "skip_unused_rows")
)
tgmm = jax.jit(fp8.tgmm, static_argnames=("num_local_groups", "preferred_element_type"))
gmm_ref = jax.jit(
    fp8.gmm_fp8_reference, static_argnames=("transpose_rhs", "preferred_element_type")
)
tgmm_ref = jax.jit(
    fp8.tgmm_fp8_reference, static_argnames=("num_local_groups", "preferred_element_type")
)


def groups(used, g, empty=()):
    """Random sizes of g groups summing to `used`, the groups in `empty` left empty."""
    p = RNG.dirichlet(np.full(g, 0.5))
    p[list(empty)] = 0
    return jnp.asarray(RNG.multinomial(used, p / p.sum()), jnp.int32)


def rand(shape, dtype=F32):
    """Normal draws with a magnitude of 10**U(-2, 2) per row, so blocks have different scales."""
    mag = 10.0 ** RNG.uniform(-2, 2, size=(*shape[:-1], 1))
    return jnp.asarray(RNG.standard_normal(shape) * mag, dtype)


def dequant64(q, scale, block):
    """float64 numpy dequantization: e4m3 values through ml_dtypes, scales repeated per block."""
    q = np.asarray(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.repeat(np.repeat(np.asarray(scale, np.float64), block[0], -2), block[1], -1)
    return q * s[..., : q.shape[-2], : q.shape[-1]]


def starts_ends(gs, offset, g_local):
    ends = np.cumsum(np.asarray(gs))
    return (ends - np.asarray(gs))[offset : offset + g_local], ends[offset : offset + g_local]


def gmm64(lhs, rhs, gs, offset=0):
    """lhs [M, K], rhs [G_local, K, N] float64 -> (out, sum of |products|) per element."""
    out, mag = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros((lhs.shape[0], rhs.shape[2]))
    for j, (s, e) in enumerate(zip(*starts_ends(gs, offset, rhs.shape[0]))):
        out[s:e] = lhs[s:e] @ rhs[j]
        mag[s:e] = np.abs(lhs[s:e]) @ np.abs(rhs[j])
    return out, mag


def tgmm64(lhs, rhs, gs, offset, g_local):
    out = np.zeros((g_local, lhs.shape[1], rhs.shape[1]))
    mag = np.zeros_like(out)
    for j, (s, e) in enumerate(zip(*starts_ends(gs, offset, g_local))):
        out[j], mag[j] = lhs[s:e].T @ rhs[s:e], np.abs(lhs[s:e]).T @ np.abs(rhs[s:e])
    return out, mag


def assert_within_bound(out, ref, mag, terms, bf16):
    """The elementwise bound of the module docstring (float32 sums of `terms` terms, the tensor
    cores' accumulation on a GPU, bfloat16 rounding); NaN fails."""
    out = np.asarray(out, np.float64)
    tol = ((terms + 8) * 2.0**-24 + ACC_REL) * mag + (2.0**-8 * np.abs(ref) if bf16 else 0)
    bad = ~(np.abs(out - ref) <= tol)
    assert not bad.any(), f"{bad.sum()} elements off, first at {np.argwhere(bad)[0]}"


# (M, K, N, G, used rows): K and N not multiples of 128 (short last piece), of 16 (K padded) or of
# 8 (N padded); one-row and empty groups; M past the used rows.
GMM_CASES = [(70, 200, 70, 4, 60), (33, 16, 256, 3, 33), (130, 300, 9, 5, 100), (8, 7, 5, 6, 8)]


@pytest.mark.parametrize("case", GMM_CASES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_references(case, transpose_rhs):
    m, k, n, g, used = case
    gs = groups(used, g, empty=[1])
    xq, xs = quantize_act(rand((m, k)))
    wq, ws = quantize_weight(rand((g, n, k) if transpose_rhs else (g, k, n)))
    kw = {"transpose_rhs": transpose_rhs}
    out = gmm(xq, xs, wq, ws, gs, preferred_element_type=F32, **kw)
    ref = gmm_ref(xq, xs, wq, ws, gs, preferred_element_type=F32, **kw)
    assert out.shape == (m, n) and out.dtype == F32
    assert rel_err(out, ref) < F32_TOL
    w64 = dequant64(wq, ws, fp8.WEIGHT)
    ref64, mag = gmm64(
        dequant64(xq, xs, fp8.ACT), np.swapaxes(w64, 1, 2) if transpose_rhs else w64, gs
    )
    assert_within_bound(out, ref64, mag, 128 + math.ceil(k / 128), bf16=False)
    assert np.all(np.asarray(out)[used:] == 0)  # rows past the groups are zero
    out16 = gmm(xq, xs, wq, ws, gs, **kw)  # bfloat16 by default
    assert out16.dtype == jnp.bfloat16
    assert_within_bound(out16, ref64, mag, 128 + math.ceil(k / 128), bf16=True)


def test_gmm_group_offset_and_power_of_two_scales():
    m, k, n, g, g_local, off = 90, 150, 40, 6, 3, 2
    gs = groups(80, g, empty=[3])
    xq, xs = quantize_act(rand((m, k)), power_of_two=True)
    wq, ws = quantize_weight(rand((g_local, k, n)), power_of_two=True)
    out = gmm(xq, xs, wq, ws, gs, group_offset=off, preferred_element_type=F32)
    ref = gmm_ref(xq, xs, wq, ws, gs, group_offset=off, preferred_element_type=F32)
    assert rel_err(out, ref) < F32_TOL
    s, e = starts_ends(gs, off, g_local)
    local = np.zeros(m, bool)
    local[s[0] : e[-1]] = True
    assert np.all(np.asarray(out)[~local] == 0)  # rows of other groups are zero


TGMM_CASES = [(300, 40, 24, 4, 290), (77, 130, 9, 3, 77), (5, 16, 8, 4, 5)]


@pytest.mark.parametrize("case", TGMM_CASES)
def test_tgmm_matches_references(case):
    m, k, n, g, used = case  # M not a multiple of 16 or 128: groups straddle the row blocks
    gs = groups(used, g, empty=[1])
    xq, xs = quantize_act(rand((m, k)), axis=-2)
    yq, ys = quantize_act(rand((m, n)), axis=-2)
    out = tgmm(xq, xs, yq, ys, gs, preferred_element_type=F32)
    ref = tgmm_ref(xq, xs, yq, ys, gs, preferred_element_type=F32)
    assert out.shape == (g, k, n)
    assert rel_err(out, ref) < F32_TOL
    ref64, mag = tgmm64(dequant64(xq, xs, fp8.ACT_T), dequant64(yq, ys, fp8.ACT_T), gs, 0, g)
    assert_within_bound(out, ref64, mag, 128 + math.ceil(m / 128), bf16=False)
    assert np.all(np.asarray(out[1]) == 0)  # the empty group
    out16 = tgmm(xq, xs, yq, ys, gs)
    assert out16.dtype == jnp.bfloat16
    assert_within_bound(out16, ref64, mag, 128 + math.ceil(m / 128), bf16=True)


def test_tgmm_group_offset():
    m, k, n, g, g_local, off = 200, 24, 16, 7, 3, 3
    gs = groups(190, g)
    xq, xs = quantize_act(rand((m, k)), axis=-2)
    yq, ys = quantize_act(rand((m, n)), axis=-2)
    kw = {"group_offset": off, "num_local_groups": g_local, "preferred_element_type": F32}
    out = tgmm(xq, xs, yq, ys, gs, **kw)
    assert out.shape == (g_local, k, n)
    assert rel_err(out, tgmm_ref(xq, xs, yq, ys, gs, **kw)) < F32_TOL


def test_vmap_and_jit():
    b, m, k, n, g = 3, 40, 72, 24, 3
    gs = jnp.stack([groups(m - 5, g) for _ in range(b)])
    xq, xs = quantize_act(rand((b, m, k)))
    wq, ws = quantize_weight(rand((b, g, k, n)))
    f = jax.jit(jax.vmap(fp8.gmm))
    out = f(xq, xs, wq, ws, gs)
    for i in range(b):
        want = gmm(xq[i], xs[i], wq[i], ws[i], gs[i])
        assert np.array_equal(np.asarray(out[i], np.float32), np.asarray(want, np.float32))
    xt, xts = quantize_act(rand((b, m, k)), axis=-2)
    yt, yts = quantize_act(rand((b, m, n)), axis=-2)
    out = jax.jit(jax.vmap(fp8.tgmm))(xt, xts, yt, yts, gs)
    for i in range(b):
        want = tgmm(xt[i], xts[i], yt[i], yts[i], gs[i])
        assert np.array_equal(np.asarray(out[i], np.float32), np.asarray(want, np.float32))


def test_nan_reaches_only_the_outputs_of_its_block():
    """quantize gives a block holding inf or NaN scale NaN and q NaN: gmm's NaN lands on the rows
    of an lhs block and on the 128 columns of an rhs block for its group's rows; tgmm's on the
    out[g] rows of an lhs column for the groups whose rows the block covers."""
    m, k, n = 40, 300, 200
    gs = jnp.asarray([15, 20, 5], jnp.int32)
    x, w = np.array(rand((m, k))), np.array(rand((3, k, n)))
    x[3, 200] = np.inf  # row 3 (group 0)
    w[1, 10, 150] = np.nan  # group 1 (rows 15..34), columns [128, 200)
    xq, xs = quantize_act(jnp.asarray(x))
    wq, ws = quantize_weight(jnp.asarray(w))
    out = np.asarray(gmm(xq, xs, wq, ws, gs, preferred_element_type=F32))
    want = np.zeros((m, n), bool)
    want[3] = True
    want[15:35, 128:] = True
    assert np.array_equal(np.isnan(out), want)

    x = np.array(rand((m, 8)))
    x[30, 2] = np.nan  # column 2, row block 0 (rows 0..127): every group's rows in it
    xq, xs = quantize_act(jnp.asarray(x), axis=-2)
    yq, ys = quantize_act(rand((m, 6)), axis=-2)
    out = np.asarray(tgmm(xq, xs, yq, ys, gs, preferred_element_type=F32))
    want = np.zeros(out.shape, bool)
    want[:, 2, :] = True
    assert np.array_equal(np.isnan(out), want)


# ---- the differentiable path ---------------------------------------------------------------------
def local_rows(a, gs, off, g_local):
    """a with the rows outside groups [off, off + g_local) zeroed (jnp: gs may be traced)."""
    ends = jnp.cumsum(gs)
    lo, hi = ends[off] - gs[off], ends[off + g_local - 1]
    rows = jnp.arange(a.shape[0])
    return jnp.where(((rows >= lo) & (rows < hi))[:, None], a, 0)


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "recipe"))
def expected_fp8_vjp(x, w, gs, dy, off, *, transpose_rhs, recipe):
    """y, dx, dw of sluice.gmm(fp8=recipe) from the float32 references on the same quantization."""
    p2, g_local = recipe.power_of_two_scales, w.shape[0]
    kw = {"group_offset": off, "preferred_element_type": F32}
    xq, xs = fp8.quantize_act(x, power_of_two=p2)
    wq, ws = fp8.quantize_weight(w, power_of_two=p2)
    y = fp8.gmm_fp8_reference(xq, xs, wq, ws, gs, transpose_rhs=transpose_rhs, **kw)
    dyq, dys = fp8.quantize_act(dy, power_of_two=p2)
    dx = fp8.gmm_fp8_reference(dyq, dys, wq, ws, gs, transpose_rhs=not transpose_rhs, **kw)
    xt = fp8.quantize_act(local_rows(x, gs, off, g_local), axis=-2, power_of_two=p2)
    dyt = fp8.quantize_act(local_rows(dy, gs, off, g_local), axis=-2, power_of_two=p2)
    a, b = (dyt, xt) if transpose_rhs else (xt, dyt)
    dw = fp8.tgmm_fp8_reference(*a, *b, gs, num_local_groups=g_local, **kw)
    return y, dx, dw


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "recipe", "out_dtype"))
def fp8_vjp(x, w, gs, dy, off, *, transpose_rhs, recipe, out_dtype=F32):
    """y, dx, dw of sluice.gmm(..., fp8=recipe) for the cotangent dy."""

    def f(x, w):
        return sluice.gmm(
            x, w, gs, transpose_rhs=transpose_rhs, group_offset=off, fp8=recipe,
            preferred_element_type=out_dtype,
        )  # fmt: skip

    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy.astype(y.dtype)))


@pytest.mark.parametrize(
    "transpose_rhs, offset, recipe",
    [(False, 0, True), (True, 0, fp8.Recipe()), (False, 2, fp8.Recipe(power_of_two_scales=True))],
)
def test_fp8_gmm_gradients_match_the_quantized_reference(transpose_rhs, offset, recipe):
    m, k, n, g_local = 150, 136, 72, 3
    g = g_local + (3 if offset else 0)
    gs = groups(140, g, empty=[1])
    x, dy = rand((m, k)), rand((m, n))
    w = rand((g_local, n, k) if transpose_rhs else (g_local, k, n))
    got = fp8_vjp(x, w, gs, dy, offset, transpose_rhs=transpose_rhs, recipe=recipe)
    rec = recipe if isinstance(recipe, fp8.Recipe) else fp8.Recipe()
    want = expected_fp8_vjp(x, w, gs, dy, offset, transpose_rhs=transpose_rhs, recipe=rec)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == F32
        assert rel_err(a, b) < F32_TOL
    # FP8's error against the unquantized matmul: e4m3 keeps 3 mantissa bits (2**-4 relative per
    # operand at worst, about 0.03 rms for a product of two random operands)
    exact = sluice.gmm_reference(
        x, w, gs, transpose_rhs=transpose_rhs, group_offset=offset, preferred_element_type=F32
    )
    assert rel_err(got[0], exact) < 0.1


def test_fp8_gmm_bf16_vmap_and_grad():
    """bf16 operands and outputs: the gradients are bf16, within bf16 rounding (2**-8 relative) of
    the float32 reference of the same quantized math; vmap of the value and of the gradient over a
    batch (the C op's batch) equals each example's own."""
    b, m, k, n, g = 2, 60, 128, 48, 4  # M not a multiple of 16: tgmm's platform_dependent pad
    gs = jnp.stack([groups(55, g), groups(50, g)])
    x, w, dy = rand((b, m, k), jnp.bfloat16), rand((b, g, k, n), jnp.bfloat16), rand((b, m, n))
    one = functools.partial(fp8_vjp, transpose_rhs=False, recipe=True, out_dtype=jnp.bfloat16)
    batched = jax.jit(jax.vmap(one))(x, w, gs, dy, jnp.zeros((b,), jnp.int32))
    for i in range(b):
        single = one(x[i], w[i], gs[i], dy[i], 0)
        for a, c in zip(batched, single):
            assert a.dtype == jnp.bfloat16
            assert np.array_equal(np.asarray(a[i], np.float32), np.asarray(c, np.float32))
    want = expected_fp8_vjp(
        x[0], w[0], gs[0], dy[0].astype(jnp.bfloat16), 0, transpose_rhs=False, recipe=fp8.Recipe()
    )
    for a, c in zip(batched, want):
        assert rel_err(a[0], c) < 1e-2


def test_fp8_gmm_float32_master_weights():
    """bf16 activations with float32 master weights: the weights are quantized from float32, and
    their gradient comes out in float32, the same float32 sums whose bf16 rounding the bf16-weight
    path returns (d w depends on x and dy alone)."""
    m, k, n, g = 60, 128, 48, 3
    gs = groups(55, g)
    x, dy = rand((m, k), jnp.bfloat16), rand((m, n), jnp.bfloat16)
    w = rand((g, k, n))

    def vjp(w):
        f = functools.partial(sluice.gmm, group_sizes=gs, fp8=fp8.Recipe())
        y, back = jax.vjp(f, x, w)
        return (y, *back(dy))

    y, dx, dw = jax.jit(vjp)(w)
    *_, dw16 = jax.jit(vjp)(w.astype(jnp.bfloat16))
    assert y.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == F32 and dw16.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(dw.astype(jnp.bfloat16), F32), np.asarray(dw16, F32))
    wq, ws = fp8.quantize_weight(w)
    want = gmm_ref(*fp8.quantize_act(x), wq, ws, gs, preferred_element_type=F32)
    assert rel_err(y.astype(F32), want) < 1e-2


def test_fp8_gmm_unused_rows_never_reach_the_weight_gradient():
    """Rows past the groups may hold anything (an expert block's unused rows): NaN there leaves
    out's and the gradients' group rows finite (the weight gradient's 128-row blocks are
    quantized with those rows zeroed)."""
    m, k, n, g = 100, 64, 32, 2
    gs = jnp.asarray([30, 40], jnp.int32)
    x = np.array(rand((m, k)))
    x[75:] = np.nan
    dy = np.array(rand((m, n)))
    dy[80:] = np.nan
    y, dx, dw = fp8_vjp(
        jnp.asarray(x), rand((g, k, n)), gs, jnp.asarray(dy), 0, transpose_rhs=False, recipe=True
    )
    assert np.isfinite(np.asarray(y[:70])).all() and np.all(np.asarray(y[70:]) == 0)
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    m, k, n, g = 20, 40, 16, 2
    gs = jnp.asarray([10, 10], jnp.int32)
    xq, xs = quantize_act(rand((m, k)))
    wq, ws = quantize_weight(rand((g, k, n)))
    with pytest.raises(TypeError, match=r"sluice\.fp8\.gmm: lhs must be float8_e4m3fn"):
        gmm(xq.astype(jnp.bfloat16), xs, wq, ws, gs)
    with pytest.raises(TypeError, match=r"sluice\.fp8\.gmm: rhs's scale must be float32"):
        gmm(xq, xs, wq, ws.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match=r"lhs .* needs a scale of shape \(20, 1\)"):
        gmm(xq, xs[:, :0], wq, ws, gs)
    with pytest.raises(ValueError, match=r"rhs .* 128x128 blocks needs a scale"):
        gmm(xq, xs, wq, ws[:, :, :0], gs)
    with pytest.raises(ValueError, match="contraction dims differ"):
        wt, wts = quantize_weight(rand((g, n, n)))
        gmm(xq, xs, wt, wts, gs)
    with pytest.raises(TypeError, match="preferred_element_type must be bfloat16 or float32"):
        gmm(xq, xs, wq, ws, gs, preferred_element_type=jnp.float16)
    with pytest.raises(ValueError, match="pass group_offset"):
        gmm(xq, xs, wq, ws, jnp.asarray([5, 5, 10], jnp.int32))
    with pytest.raises(ValueError, match="rhs holds 2 groups but group_sizes only 1"):
        gmm(xq, xs, wq, ws, jnp.asarray([5], jnp.int32), group_offset=0)
    with pytest.raises(ValueError, match="group_offset must be a scalar"):
        gmm(xq, xs, wq, ws, gs, group_offset=jnp.zeros((2,), jnp.int32))
    xt, xts = quantize_act(rand((m, k)), axis=-2)
    with pytest.raises(ValueError, match=r"sluice\.fp8\.tgmm: lhs_q \[M, K\] and rhs_q \[M, N\]"):
        tgmm(xt, xts, xt[:5], xts, gs)
    with pytest.raises(ValueError, match=r"num_local_groups must be in \[0, 2\]"):
        tgmm(xt, xts, xt, xts, gs, num_local_groups=3)
    with pytest.raises(TypeError, match="fp8 must be None, a bool or sluice.fp8.Recipe"):
        sluice.gmm(rand((m, k)), rand((g, k, n)), gs, fp8="e4m3")


@pytest.mark.skipif(
    ON_GPU,
    reason="on a GPU the group sizes stay on the device: the CUDA kernels check them only with "
    "SLUICE_DEBUG=1 (include/sluice.h)",
)
def test_bad_group_sizes_raise_at_run_time_on_the_cpu():
    """The CPU kernels read the group sizes on the host and reject bad ones at run time, naming
    the op and the value."""
    m, k, n, g = 20, 40, 16, 2
    xq, xs = quantize_act(rand((m, k)))
    wq, ws = quantize_weight(rand((g, k, n)))
    with pytest.raises(Exception, match=r"gmm_fp8: group_sizes\[0\] = -1 is negative"):
        gmm(xq, xs, wq, ws, jnp.asarray([-1, 3], jnp.int32)).block_until_ready()
    xt, xts = quantize_act(rand((m, k)), axis=-2)
    with pytest.raises(Exception, match=r"tgmm_fp8: sum\(group_sizes\) = 30 exceeds the 20 rows"):
        tgmm(xt, xts, xt, xts, jnp.asarray([10, 20], jnp.int32)).block_until_ready()


def test_ffi_handler_checks_shapes():
    """The FFI handler's own checks, for callers that reach the target without sluice.fp8."""
    xq, xs = quantize_act(rand((8, 32)))
    wq, ws = quantize_weight(rand((1, 16, 32)))  # [G, N, K]
    gs, off = jnp.asarray([8], jnp.int32), jnp.zeros((1,), jnp.int32)
    # the workspace the CUDA handler needs for this problem (as sluice.fp8.gmm sizes it; the CPU
    # handler ignores it)
    ws_bytes = gmm_workspace_bytes(
        m=8,
        k=32,
        n=16,
        num_groups=1,
        num_local_groups=1,
        dtype=fp8.E4M3,
        out_dtype=jnp.dtype(jnp.bfloat16),
        transpose_rhs=True,
    )
    call = jax.ffi.ffi_call(
        "sluice_gmm_fp8",
        (
            jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8),
        ),
    )
    call(xq, xs, wq, ws, gs, off, skip_unused_rows=np.int32(0))[0].block_until_ready()
    with pytest.raises(Exception, match=r"rhs_scale must be float32 \[\.\.\., G_local, ceil"):
        call(xq, xs, wq, ws[:, :, :0], gs, off, skip_unused_rows=np.int32(0))[0].block_until_ready()

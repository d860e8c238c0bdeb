"""sluice.fp8.swiglu_quantize / swiglu_bwd_quantize and sluice.ep.fanned_swiglu_mlp: the SwiGLU's
activation and gradient quantized as they are computed give the composition (sluice.swiglu, then
fp8.quantize_both) bit for bit, on the CPU and, in the GPU suite, from the CUDA kernel; the row
weights' gradient within float32 rounding. Fresh random inputs every run; a failure names its
seed, and SLUICE_TEST_SEED=<seed> repeats it."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sluice
from sluice import ep, fp8
from test_ep import routing

SEED = int(os.environ.get("SLUICE_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
RNG = np.random.default_rng(SEED)
MSG = f"SLUICE_TEST_SEED={SEED}"


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype == fp8.E4M3 else a.view(np.uint32)


def assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape, MSG
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=MSG)


def inputs(r, f, dtype, scale=2.0):
    h = jnp.asarray(RNG.standard_normal((r, 2 * f)) * scale, dtype)
    w = jnp.asarray(RNG.uniform(0.1, 1.0, r), jnp.float32)
    dact = jnp.asarray(RNG.standard_normal((r, f)), dtype)
    return h, w, dact


def masked(x, lo, hi):
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.where((rows >= lo) & (rows < hi), x, jnp.zeros((), x.dtype))


# (rows, F, row_range): full tiles, ragged rows and widths, F not a multiple of 128 (a tile of dh
# across gate and up), F not a multiple of 8 (the composition on a GPU too), an empty range
CASES = [
    (256, 256, (0, 256)),
    (300, 136, (0, 250)),
    (300, 256, (3, 250)),
    (130, 200, (7, 129)),
    (64, 20, (0, 64)),
    (96, 128, (0, 0)),
]


# The CPU runs the composition itself, so there a few cases check the op's semantics; a GPU, where
# the kernels must equal it, runs the whole grid.
GRID = [
    (case, p2, weighted, dtype)
    for case in CASES
    for p2 in (False, True)
    for weighted in (True, False)
    for dtype in (jnp.bfloat16, jnp.float16)
    if jax.default_backend() != "cpu" or (not p2 and dtype == jnp.bfloat16 and case[1] % 128 == 0)
]


@pytest.mark.parametrize(("case", "p2", "weighted", "dtype"), GRID)
def test_swiglu_quantize_is_the_composition(case, p2, weighted, dtype):
    r, f, (lo, hi) = case
    h, w, dact = inputs(r, f, dtype)
    w = w if weighted else None
    kw = {"row_range": (lo, hi), "power_of_two": p2, "pad_rows_to": 16}
    got = jax.jit(lambda h, w: fp8.swiglu_quantize(h, w, **kw))(h, w)
    act = masked(sluice.swiglu(h, jnp.asarray([hi], jnp.int32), row_weights=w), lo, hi)
    assert_same(got, fp8.quantize_both(act, **kw))

    got, dw = jax.jit(lambda d, h, w: fp8.swiglu_bwd_quantize(d, h, w, **kw))(dact, h, w)
    fn = lambda h, w: sluice.swiglu(h, jnp.asarray([hi], jnp.int32), row_weights=w)
    _, vjp = jax.vjp(fn, h, w)
    dh, dw_want = vjp(dact)
    assert_same(got, fp8.quantize_both(masked(dh, lo, hi), **kw))
    if weighted:
        dw_want = masked(dw_want[:, None], lo, hi)[:, 0]
        # float32 sums in two orders: within 1e-5 of the sum of the terms' magnitudes
        g, u = np.asarray(h[:, :f], np.float64), np.asarray(h[:, f:], np.float64)
        mag = np.abs(np.asarray(dact, np.float64) * g / (1 + np.exp(-g)) * u).sum(1)
        err = np.abs(np.asarray(dw, np.float64) - np.asarray(dw_want, np.float64))
        assert np.all(err <= 1e-5 * mag), MSG
    else:
        assert dw is None


def test_swiglu_quantize_nonfinite_and_zero_rows():
    """An inf in h makes its rows' blocks NaN (as fp8.quantize defines); rows outside the range
    stay exactly zero whatever h holds there (NaN included)."""
    r, f = 128, 128
    h, w, dact = inputs(r, f, jnp.bfloat16)
    h = h.at[3, 5].set(jnp.inf).at[100:, :].set(jnp.nan)
    (q, s), _ = fp8.swiglu_quantize(h, w, row_range=(0, 100))
    assert np.isnan(np.asarray(s[3])).all() and not np.isnan(np.asarray(s[4])).any(), MSG
    assert (bits(q[100:]) == 0).all() and (np.asarray(s[100:]) == fp8.SCALE_MIN).all(), MSG
    ((q, s), _), dw = fp8.swiglu_bwd_quantize(dact, h, w, row_range=(0, 100))
    assert (bits(q[100:]) == 0).all() and (np.asarray(dw[100:]) == 0).all(), MSG


def test_swiglu_quantize_rejects_bad_input():
    h = jnp.zeros((8, 16), jnp.bfloat16)
    with pytest.raises(sluice.ShapeError, match=r"swiglu_quantize: h must be 2-D \[R, 2F\]"):
        fp8.swiglu_quantize(h[:, :15])
    with pytest.raises(sluice.ShapeError, match=r"row_weights must be floating \[R\] = \[8\]"):
        fp8.swiglu_quantize(h, jnp.zeros(7))
    with pytest.raises(sluice.ShapeError, match=r"dact must be \[R, F\] = \[8, 8\]"):
        fp8.swiglu_bwd_quantize(jnp.zeros((8, 16)), h)
    with pytest.raises(TypeError, match="h must be float32, bfloat16 or float16"):
        fp8.swiglu_quantize(h.astype(jnp.int32))


@pytest.mark.parametrize("p2", [False, True])
def test_fanned_swiglu_mlp_is_the_composition(p2):
    """sluice.ep.fanned_swiglu_mlp gives fanned_gmm -> sluice.swiglu -> gmm_fan_in: values and the
    gradients in x and both weights bit for bit, the row weights' within float32 rounding. Masked
    slots, an expert no token takes, widths not multiples of 128."""
    t, k, e, d, f = 48, 3, 6, 200, 136
    x = jnp.asarray(RNG.standard_normal((t, d)), jnp.bfloat16)
    idx, w = routing(1, t, k, e)
    idx = jnp.where(idx == 5, -1, idx)
    wi = jnp.asarray(RNG.standard_normal((e, d, 2 * f)) * 0.1, jnp.bfloat16)
    wo = jnp.asarray(RNG.standard_normal((e, f, d)) * 0.1, jnp.bfloat16)
    probe = jnp.asarray(RNG.standard_normal((t, d)), jnp.float32)
    recipe = fp8.Recipe(power_of_two_scales=p2)
    _, gs, fan = ep.fan_out_tokens(x, idx, w, num_experts=e, copy_rows=False)
    rw = jnp.asarray(RNG.uniform(0.1, 1.0, fan.rows), jnp.float32)

    def composed(x, wi, wo, rw):
        h = ep.fanned_gmm(x, fan, wi, fp8=recipe)
        act = sluice.swiglu(h, gs, row_weights=rw)
        return ep.gmm_fan_in(act, wo, fan, fp8=recipe, out_dtype=jnp.float32)

    def fused(x, wi, wo, rw):
        return ep.fanned_swiglu_mlp(
            x, fan, wi, wo, row_weights=rw, fp8=recipe, out_dtype=jnp.float32
        )

    def run(fn):
        loss = lambda *a: jnp.sum(fn(*a) * probe)
        return [fn(x, wi, wo, rw), *jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, wi, wo, rw)]

    got, want = run(jax.jit(fused)), run(jax.jit(composed))
    for g, wnt in zip(got[:4], want[:4], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt), err_msg=MSG)
    scale = float(np.abs(np.asarray(want[4])).max())
    np.testing.assert_allclose(got[4], want[4], rtol=1e-4, atol=1e-5 * scale, err_msg=MSG)
    with pytest.raises(ValueError, match=r"wi must be \[L, K, 2F\] and wo \[L, F, N'\]"):
        ep.fanned_swiglu_mlp(x, fan, wi, wo[:, 1:], fp8=recipe)
    with pytest.raises(ValueError, match=r"row_weights must be \[M\]"):
        ep.fanned_swiglu_mlp(x, fan, wi, wo, row_weights=rw[1:], fp8=recipe)


@pytest.mark.parametrize("p2", [False, True])
def test_prequantized_weights_give_the_same_values_and_gradients(p2):
    """fp8.prequantize(w) in w's place (fanned_swiglu_mlp, and fanned_gmm with gmm_fan_in): the
    same values and gradients bit for bit, the weights' gradient in the Fp8Weight's value and float0
    for its bit patterns; a Recipe other than the prequantization's, or a w not [G, K, N], is an
    error."""
    t, k, e, d, f = 40, 2, 4, 264, 136
    x = jnp.asarray(RNG.standard_normal((t, d)), jnp.bfloat16)
    idx, w = routing(1, t, k, e)
    wi = jnp.asarray(RNG.standard_normal((e, d, 2 * f)) * 0.1, jnp.bfloat16)
    wo = jnp.asarray(RNG.standard_normal((e, f, d)) * 0.1, jnp.bfloat16)
    probe = jnp.asarray(RNG.standard_normal((t, d)), jnp.float32)
    recipe = fp8.Recipe(power_of_two_scales=p2)
    _, gs, fan = ep.fan_out_tokens(x, idx, w, num_experts=e, copy_rows=False)

    def fused(x, wi, wo):
        return ep.fanned_swiglu_mlp(x, fan, wi, wo, fp8=recipe, out_dtype=jnp.float32)

    def composed(x, wi, wo):
        act = sluice.swiglu(ep.fanned_gmm(x, fan, wi, fp8=recipe), gs)
        return ep.gmm_fan_in(act, wo, fan, fp8=recipe, out_dtype=jnp.float32)

    pwi, pwo = fp8.prequantize(wi, recipe), fp8.prequantize(wo, recipe)
    assert isinstance(pwi, fp8.Fp8Weight) and pwi.shape == wi.shape and pwi[...] is pwi
    for fn in (fused, composed):
        loss = lambda *a, fn=fn: jnp.sum(fn(*a) * probe)
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), allow_int=True))
        (v0, g0), (v1, g1) = grad(x, wi, wo), grad(x, pwi, pwo)
        assert float(v0) == float(v1), MSG
        for a, b in zip(g0, (g1[0], g1[1].value, g1[2].value), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=MSG)
        assert g1[1].q_bits.dtype == jax.dtypes.float0
    with pytest.raises(ValueError, match="power_of_two_scales"):
        ep.fanned_gmm(
            x, fan, fp8.prequantize(wi, fp8.Recipe(power_of_two_scales=not p2)), fp8=recipe
        )
    with pytest.raises(sluice.ShapeError, match=r"w must be \[G, K, N\]"):
        fp8.prequantize(wi[0], recipe)


def test_swiglu_quantize_under_vmap_and_jit():
    """vmap over a batch of blocks (each its own row range) gives each block's own quantization."""
    hs, ws, das = zip(*(inputs(64, 128, jnp.bfloat16) for _ in range(3)), strict=True)
    h, w, dact = jnp.stack(hs), jnp.stack(ws), jnp.stack(das)
    his = jnp.asarray([64, 40, 0], jnp.int32)

    def one(h, w, dact, hi):
        kw = {"row_range": (0, hi), "pad_rows_to": 16}
        return fp8.swiglu_quantize(h, w, **kw), fp8.swiglu_bwd_quantize(dact, h, w, **kw)

    got = jax.jit(jax.vmap(one))(h, w, dact, his)
    for i in range(3):
        want = one(h[i], w[i], dact[i], his[i])
        assert_same(jax.tree.map(lambda a, i=i: a[i], got), want)

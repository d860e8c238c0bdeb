"""sluice.gmm / sluice.tgmm against the jnp references and jax.lax.ragged_dot: values, gradients,
vmap, jit, shard_map and bad input, on the CPU cases of tests/shapes.py. Inputs are fresh random
draws every test; kernel outputs are poisoned by construction (the C kernels write every element;
the C tests poison and check that)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sluice
from helpers import rel_err
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from shapes import TEST_CASES

RNG = np.random.default_rng()
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def random_groups(m_used, g, skew=False):
    p = RNG.dirichlet(np.full(g, 0.3)) if skew else np.full(g, 1.0 / g)
    return jnp.asarray(RNG.multinomial(m_used, p), jnp.int32)


def rand(shape, dtype):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", TEST_CASES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_reference_and_ragged_dot(dtype, case, transpose_rhs):
    m, k, n, g, used = case
    gs = random_groups(used, g, skew=True)
    lhs = rand((m, k), dtype)
    rhs = rand((g, n, k) if transpose_rhs else (g, k, n), dtype)
    out = sluice.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32)
    ref = sluice.gmm_reference(
        lhs, rhs, gs, transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32
    )
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL[dtype]
    # rows past sum(group_sizes) are exactly zero, as in ragged_dot
    assert np.all(np.asarray(out)[int(gs.sum()) :] == 0)
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    rd = jax.lax.ragged_dot(lhs, w, gs, preferred_element_type=jnp.float32)
    assert rel_err(out, rd) < TOL[dtype]


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gmm_output_dtypes(out_dtype):
    gs = random_groups(50, 3)
    lhs, rhs = rand((50, 24), jnp.bfloat16), rand((3, 24, 40), jnp.bfloat16)
    out = sluice.gmm(lhs, rhs, gs, preferred_element_type=out_dtype)
    assert out.dtype == out_dtype
    ref = sluice.gmm_reference(lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert rel_err(out, ref) < 1e-2


def test_gmm_default_dtype_is_input_dtype():
    gs = random_groups(10, 2)
    out = sluice.gmm(rand((10, 4), jnp.bfloat16), rand((2, 4, 3), jnp.bfloat16), gs)
    assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tgmm_matches_reference(dtype):
    m, k, n, g = 90, 33, 21, 7
    gs = random_groups(80, g, skew=True)
    lhs, rhs = rand((m, k), dtype), rand((m, n), dtype)
    out = sluice.tgmm(lhs, rhs, gs, preferred_element_type=jnp.float32)
    ref = sluice.tgmm_reference(lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert out.shape == (g, k, n)
    assert rel_err(out, ref) < TOL[dtype]
    for j in np.flatnonzero(np.asarray(gs) == 0):  # empty groups give zeros
        assert np.all(np.asarray(out[j]) == 0)


def test_group_offset_gmm_and_tgmm():
    m, k, n, g, gl = 60, 12, 10, 8, 3
    gs = random_groups(55, g)
    lhs, rhs = rand((m, k), jnp.float32), rand((gl, k, n), jnp.float32)
    for off in range(g - gl + 1):
        out = sluice.gmm(lhs, rhs, gs, group_offset=off)
        ref = sluice.gmm_reference(lhs, rhs, gs, group_offset=off)
        assert rel_err(out, ref) < 1e-5
        # the same through ragged_dot: pad rhs with zero groups around the local ones
        full = jnp.zeros((g, k, n)).at[off : off + gl].set(rhs)
        assert rel_err(out, jax.lax.ragged_dot(lhs, full, gs)) < 1e-5
        t = sluice.tgmm(
            lhs, rand((m, n), jnp.float32), gs, group_offset=jnp.int32(off), num_local_groups=gl
        )
        assert t.shape == (gl, k, n)
    # a traced offset (what expert parallelism computes from axis_index)
    f = jax.jit(lambda o: sluice.gmm(lhs, rhs, gs, group_offset=o))
    assert rel_err(f(jnp.int32(2)), sluice.gmm_reference(lhs, rhs, gs, group_offset=2)) < 1e-5


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grad_matches_ragged_dot_vjp(transpose_rhs):
    m, k, n, g = 48, 20, 30, 5
    gs = random_groups(40, g, skew=True)
    lhs = rand((m, k), jnp.float32)
    rhs = rand((g, n, k) if transpose_rhs else (g, k, n), jnp.float32)
    cot = rand((m, n), jnp.float32)

    def loss_sluice(l, w):
        return jnp.sum(sluice.gmm(l, w, gs, transpose_rhs=transpose_rhs) * cot)

    def loss_rd(l, w):
        w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        return jnp.sum(jax.lax.ragged_dot(l, w, gs) * cot)

    gl_s, gw_s = jax.jit(jax.grad(loss_sluice, (0, 1)))(lhs, rhs)
    gl_r, gw_r = jax.jit(jax.grad(loss_rd, (0, 1)))(lhs, rhs)
    assert rel_err(gl_s, gl_r) < 1e-5
    assert rel_err(gw_s, gw_r) < 1e-5


def test_zero_unused_rows_false_keeps_the_groups_rows_and_checks_its_type():
    """zero_unused_rows=False leaves the rows past the groups unspecified on a GPU (the CPU path
    zeroes them either way): the groups' rows, the weight gradient and the groups' rows of the
    input gradient are those of the default."""
    m, k, n, g = 40, 12, 10, 4
    gs = random_groups(29, g, skew=True)
    lhs, rhs = rand((m, k), jnp.float32), rand((g, k, n), jnp.float32)
    cot = rand((m, n), jnp.float32)
    used = int(np.sum(np.asarray(gs)))

    def run(zero):
        def loss(l, w):
            out = sluice.gmm(l, w, gs, zero_unused_rows=zero)
            return jnp.sum(out[:used] * cot[:used]), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(lhs, rhs)
        return out, grads

    out0, (gl0, gw0) = run(True)
    out1, (gl1, gw1) = run(False)
    np.testing.assert_array_equal(out1[:used], out0[:used])
    np.testing.assert_array_equal(gw1, gw0)
    np.testing.assert_array_equal(gl1[:used], gl0[:used])
    with pytest.raises(TypeError, match="zero_unused_rows"):
        sluice.gmm(lhs, rhs, gs, zero_unused_rows=0)


def test_check_grads_gmm_and_tgmm():
    from jax.test_util import check_grads

    # gmm and tgmm are bilinear, so a central difference is exact for any step; a large one keeps
    # f32 rounding out of the numerical side (with the default step its noise on these sizes can
    # reach the 1e-2 tolerance: one fresh draw failed in CI on 2026-11-24, 60 redraws passed).
    gs = random_groups(14, 3)
    lhs, rhs = rand((16, 5), jnp.float32), rand((3, 5, 4), jnp.float32)
    kw = {"order": 1, "modes": ("rev",), "atol": 1e-2, "rtol": 1e-2, "eps": 0.1}
    check_grads(lambda l, w: sluice.gmm(l, w, gs), (lhs, rhs), **kw)
    check_grads(
        lambda l, w: sluice.gmm(l, w, gs, transpose_rhs=True), (lhs, jnp.swapaxes(rhs, 1, 2)), **kw
    )
    check_grads(lambda a, b: sluice.tgmm(a, b, gs), (lhs, rand((16, 4), jnp.float32)), **kw)


def test_grad_bf16_close_to_f32():
    gs = random_groups(64, 4)
    lhs, rhs = rand((64, 32), jnp.float32), rand((4, 32, 16), jnp.float32)
    f = lambda l, w: jnp.sum(sluice.gmm(l, w, gs, preferred_element_type=jnp.float32) ** 2)
    g32 = jax.grad(f, (0, 1))(lhs, rhs)
    g16 = jax.grad(f, (0, 1))(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16))
    for a, b in zip(g16, g32):
        assert a.dtype == jnp.bfloat16 and rel_err(a, b) < 3e-2


def test_vmap_gmm_and_tgmm():
    b, m, k, n, g = 3, 30, 8, 6, 4
    gs = jnp.stack([random_groups(25, g) for _ in range(b)])
    lhs, rhs = rand((b, m, k), jnp.float32), rand((b, g, k, n), jnp.float32)
    out = jax.vmap(sluice.gmm)(lhs, rhs, gs)
    for i in range(b):
        assert rel_err(out[i], sluice.gmm_reference(lhs[i], rhs[i], gs[i])) < 1e-5
    # rhs shared across the batch (in_axes None) and a vmapped gradient
    out2 = jax.vmap(sluice.gmm, in_axes=(0, None, 0))(lhs, rhs[0], gs)
    assert rel_err(out2[1], sluice.gmm_reference(lhs[1], rhs[0], gs[1])) < 1e-5
    grads = jax.vmap(jax.grad(lambda l, w, s: jnp.sum(sluice.gmm(l, w, s) ** 2), (0, 1)))(
        lhs, rhs, gs
    )
    ref = jax.grad(lambda l, w: jnp.sum(sluice.gmm_reference(l, w, gs[2]) ** 2), (0, 1))(
        lhs[2], rhs[2]
    )
    assert rel_err(grads[0][2], ref[0]) < 1e-5 and rel_err(grads[1][2], ref[1]) < 1e-5
    t = jax.vmap(sluice.tgmm)(lhs, rand((b, m, n), jnp.float32), gs)
    assert t.shape == (b, g, k, n)


def test_shard_map_expert_parallel_gmm():
    """4 CPU devices, experts sharded: each device computes its slice of groups via group_offset."""
    devices = jax.devices()[:4]
    assert len(devices) == 4
    mesh = Mesh(np.array(devices), ("ep",))
    m, k, n, g = 64, 16, 12, 8
    gs = random_groups(60, g)
    lhs, rhs = rand((m, k), jnp.float32), rand((g, k, n), jnp.float32)

    @jax.jit
    @functools.partial(shard_map, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P())
    def ep_gmm(x, w, s):
        off = jax.lax.axis_index("ep") * w.shape[0]
        return jax.lax.psum(sluice.gmm(x, w, s, group_offset=off), "ep")

    assert rel_err(ep_gmm(lhs, rhs, gs), jax.lax.ragged_dot(lhs, rhs, gs)) < 1e-5

    # gradients through the sharded op equal ragged_dot's
    loss = lambda x, w: jnp.sum(ep_gmm(x, w, gs) ** 2)
    loss_rd = lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, gs) ** 2)
    ga, gb = jax.grad(loss, (0, 1))(lhs, rhs), jax.grad(loss_rd, (0, 1))(lhs, rhs)
    assert rel_err(ga[0], gb[0]) < 1e-5 and rel_err(ga[1], gb[1]) < 1e-5


def test_deterministic():
    gs = random_groups(500, 8)
    lhs, rhs = rand((512, 256), jnp.bfloat16), rand((8, 256, 384), jnp.bfloat16)
    a = np.asarray(sluice.gmm(lhs, rhs, gs, preferred_element_type=jnp.float32))
    b = np.asarray(sluice.gmm(lhs, rhs, gs, preferred_element_type=jnp.float32))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_float32_master_weights(transpose_rhs):
    """A float32 rhs with a bfloat16 lhs: the product and d lhs are those of rhs rounded to
    bfloat16, bit for bit; d rhs is float32, tgmm's float32 result with no rounding to bfloat16."""
    m, k, n, gs = 40, 24, 16, jnp.array([7, 0, 21, 8], jnp.int32)
    lhs = rand((m, k), jnp.bfloat16)
    rhs = rand((4, n, k) if transpose_rhs else (4, k, n), jnp.float32)
    dout = rand((m, n), jnp.bfloat16)
    f = functools.partial(sluice.gmm, group_sizes=gs, transpose_rhs=transpose_rhs)
    out, vjp = jax.vjp(lambda a, b: f(a, b), lhs, rhs)
    out16, vjp16 = jax.vjp(lambda a, b: f(a, b), lhs, rhs.astype(jnp.bfloat16))
    (dlhs, drhs), (dlhs16, _) = vjp(dout), vjp16(dout)
    assert out.dtype == jnp.bfloat16 and drhs.dtype == jnp.float32
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(out16, np.float32))
    assert np.array_equal(np.asarray(dlhs, np.float32), np.asarray(dlhs16, np.float32))
    a, b = (dout, lhs) if transpose_rhs else (lhs, dout)
    want = sluice.tgmm(a, b, gs, preferred_element_type=jnp.float32)
    assert np.array_equal(np.asarray(drhs), np.asarray(want))


# ---- bad input ---------------------------------------------------------------------------------


def _ok():
    return rand((8, 4), jnp.float32), rand((2, 4, 3), jnp.float32), jnp.array([3, 5], jnp.int32)


@pytest.mark.parametrize(
    "mutate, exc, msg",
    [
        (lambda l, r, s: (l[None], r, s), ValueError, "lhs must be 2-D"),
        (lambda l, r, s: (l, r[0], s), ValueError, "rhs must be 3-D"),
        (lambda l, r, s: (l, r[:, :3], s), ValueError, "contraction dims differ"),
        # a wider rhs only as float32 master weights of a 16-bit lhs
        (lambda l, r, s: (l, r.astype(jnp.bfloat16), s), TypeError, "rhs dtype bfloat16 with lhs"),
        (lambda l, r, s: (l.astype(jnp.int32), r, s), TypeError, "lhs must be float32"),
        # any integer dtype converts (as ragged_dot takes it: test_ragged_dot_compat.py), floats not
        (lambda l, r, s: (l, r, s.astype(jnp.float32)), TypeError, "group_sizes must be int32"),
        (lambda l, r, s: (l, r, s[None]), ValueError, "group_sizes must be 1-D"),
        (lambda l, r, s: (l, r, s[:1]), ValueError, "groups but group_sizes has only"),
    ],
)
def test_gmm_bad_input(mutate, exc, msg):
    lhs, rhs, gs = mutate(*_ok())
    with pytest.raises(exc, match=msg):
        sluice.gmm(lhs, rhs, gs)


def test_gmm_bad_attributes():
    lhs, rhs, gs = _ok()
    with pytest.raises(TypeError, match="preferred_element_type"):
        sluice.gmm(lhs, rhs, gs, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="group_offset must be a scalar"):
        sluice.gmm(lhs, rhs, gs, group_offset=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="pass group_offset"):
        sluice.gmm(lhs, rhs[:1], gs)
    with pytest.raises(ValueError, match="rhs must be 2-D"):
        sluice.tgmm(lhs, rhs, gs)
    with pytest.raises(ValueError, match="num_local_groups"):
        sluice.tgmm(lhs, lhs, gs, num_local_groups=3)


@pytest.mark.parametrize(
    "sizes, msg",
    [([3, -1], r"group_sizes\[1\] = -1 is negative"), ([6, 5], r"sum\(group_sizes\) = 11 exceeds")],
)
def test_bad_device_side_sizes_raise_on_cpu(sizes, msg):
    lhs, rhs, _ = _ok()
    gs = jnp.array(sizes, jnp.int32)
    with pytest.raises(Exception, match=msg):
        jax.jit(sluice.gmm)(lhs, rhs, gs).block_until_ready()
    with pytest.raises(Exception, match=msg):
        jax.jit(sluice.tgmm)(lhs, lhs, gs).block_until_ready()


def test_bad_offset_raises_on_cpu():
    lhs, rhs, gs = _ok()
    with pytest.raises(Exception, match="group_offset"):
        sluice.gmm(lhs, rhs[:1], gs, group_offset=5).block_until_ready()

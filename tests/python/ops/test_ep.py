"""sluice.ep (dispatch, combine, fan_out, fan_in) on 2, 4 and 8 CPU devices against the pure-jnp
references: values, gradients of the whole expert-parallel pipeline, determinism, edge routings (all
tokens to one rank, masked slots, a rank that receives nothing, nothing routed), vmap, and bad input.
Routing is a fresh random draw every test."""

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
from sluice import ep

RNG = np.random.default_rng()


def mesh_of(r, dp=1):
    if len(jax.devices()) < r * dp:
        pytest.skip(f"needs {r * dp} devices")
    return _mesh_of(r, dp)


@functools.cache
def _mesh_of(r, dp):
    devs = np.array(jax.devices()[: r * dp]).reshape(dp, r)
    if dp == 1:
        mesh = Mesh(devs[0], ("ep",))
    else:
        mesh = Mesh(devs, ("dp", "ep"))
    ep.setup(mesh, "ep", timeout_s=20.0)
    return mesh


def routing(r, t, k, e, mode="random", p_mask=0.2):
    """topk_idx [r*t, k] int32 (distinct experts per token, -1 = masked) and weights f32."""
    l = e // r
    idx = np.full((r * t, k), -1, np.int32)
    for i in range(r * t):
        if mode == "one_rank":  # every token's experts on rank 0 (as many as fit)
            pool = np.arange(l)
        elif mode == "skip_rank1" and r > 1:  # rank 1 owns none of them
            pool = np.setdiff1d(np.arange(e), np.arange(l, 2 * l))
        else:
            pool = np.arange(e)
        kk = min(k, len(pool))
        idx[i, :kk] = RNG.choice(pool, kk, replace=False)
        RNG.shuffle(idx[i])
    if mode == "none":
        idx[:] = -1
    elif p_mask:
        idx[RNG.random(idx.shape) < p_mask] = -1
    w = RNG.random((r * t, k)).astype(np.float32)
    return jnp.asarray(idx), jnp.asarray(w)


def run_dispatch_combine(mesh, x, idx, w, e):
    def body(x, idx, w):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        # A different function per received row, so combine's sums are not trivially x times a count.
        scale = (1.0 + jnp.arange(recv.x.shape[0], dtype=jnp.float32) / 16)[:, None]
        y = (recv.x.astype(jnp.float32) * scale).astype(recv.x.dtype)
        out = ep.combine(y, recv.handle)
        return (
            recv.x,
            recv.topk_idx,
            recv.topk_weights,
            recv.num_rows[None],
            recv.counts,
            recv.handle.recv_src,
            y,
            out,
        )

    spec = P("ep")
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 8))
    return f(x, idx, w)


@pytest.mark.parametrize(
    "r,t,h,k,e,dtype,mode",
    [
        (2, 13, 24, 2, 8, jnp.float32, "random"),
        (2, 1, 8, 1, 2, jnp.bfloat16, "random"),
        (4, 9, 40, 4, 16, jnp.bfloat16, "random"),
        (4, 7, 16, 8, 32, jnp.float16, "one_rank"),
        (4, 11, 8, 3, 12, jnp.float32, "skip_rank1"),
        (8, 5, 16, 8, 64, jnp.bfloat16, "random"),
        (8, 3, 8, 2, 8, jnp.float32, "none"),
        (8, 6, 8, 5, 16, jnp.float32, "one_rank"),
    ],
)
def test_dispatch_combine_vs_reference(r, t, h, k, e, dtype, mode):
    mesh = mesh_of(r)
    x = jnp.asarray(RNG.standard_normal((r * t, h)), dtype)
    idx, w = routing(r, t, k, e, mode)
    rx, ri, rw, nr, cn, src, y, out = run_dispatch_combine(mesh, x, idx, w, e)
    ref = ep.dispatch_reference(
        x.reshape(r, t, h), idx.reshape(r, t, k), w.reshape(r, t, k), num_experts=e, num_ranks=r
    )
    n = t * r
    np.testing.assert_array_equal(np.asarray(rx).reshape(r, n, h), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(ri).reshape(r, n, k), np.asarray(ref[1]))
    np.testing.assert_array_equal(np.asarray(rw).reshape(r, n, k), np.asarray(ref[2]))
    np.testing.assert_array_equal(np.asarray(nr), np.asarray(ref[3]))
    np.testing.assert_array_equal(np.asarray(cn).reshape(r, -1), np.asarray(ref[4]))
    np.testing.assert_array_equal(np.asarray(src).reshape(r, n), np.asarray(ref[5]))
    if mode == "skip_rank1":
        assert int(nr[1]) == 0
    if mode == "none":
        assert int(np.sum(nr)) == 0 and not np.any(np.asarray(out, np.float32))
    want = ep.combine_reference(jnp.asarray(y).reshape(r, n, h), ref[5], t).reshape(r * t, h)
    # Same additions in the same order: equal bits.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def pipeline(mesh, e, out_dtype=None):
    """x, idx, w, W -> combine(fan_in(gmm(fan_out(dispatch(x))))) under shard_map."""

    def body(x, idx, w, wexp):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        xs, gs, fan = ep.fan_out(recv)
        ys = sluice.gmm(xs, wexp, gs, preferred_element_type=jnp.float32).astype(x.dtype)
        yr = ep.fan_in(ys, fan, out_dtype=out_dtype)
        return ep.combine(yr, recv.handle)

    spec = P("ep")
    return shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)


def expert_ref(wexp):
    def fn(x, e):
        return jnp.einsum(
            "th,thn->tn",
            x.astype(jnp.float32),
            wexp[e].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )

    return fn


@pytest.mark.parametrize(
    "r,t,h,n,k,e,mode",
    [
        (2, 11, 16, 12, 2, 4, "random"),
        (4, 7, 8, 20, 6, 16, "random"),
        (4, 5, 12, 8, 3, 8, "one_rank"),
        (8, 3, 8, 8, 8, 16, "random"),
        (8, 4, 8, 4, 1, 8, "skip_rank1"),
    ],
)
def test_pipeline_values_and_gradients(r, t, h, n, k, e, mode):
    mesh = mesh_of(r)
    x = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.float32)
    wexp = jnp.asarray(RNG.standard_normal((e, h, n)) / np.sqrt(h), jnp.float32)
    idx, w = routing(r, t, k, e, mode)
    cot = jnp.asarray(RNG.standard_normal((r * t, n)), jnp.float32)
    f = pipeline(mesh, e)

    def loss(x, w, wexp):
        return jnp.sum(f(x, idx, w, wexp) * cot)

    def loss_ref(x, w, wexp):
        return jnp.sum(ep.moe_reference(x, idx, w, expert_ref(wexp)) * cot)

    out = jax.jit(f)(x, idx, w, wexp)
    want = ep.moe_reference(x, idx, w, expert_ref(wexp))
    assert rel_err(out, want) < 1e-5
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, wexp)
    grads_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(x, w, wexp)
    for name, g, gr in zip(("x", "topk_weights", "experts"), grads, grads_ref):
        assert rel_err(g, gr) < 1e-5, name
    # Masked slots get no weight gradient.
    assert not np.any(np.asarray(grads[1])[np.asarray(idx) < 0])


def test_pipeline_bf16_and_determinism():
    r, t, h, n, k, e = 4, 10, 32, 24, 4, 16
    mesh = mesh_of(r)
    x = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.bfloat16)
    wexp = jnp.asarray(RNG.standard_normal((e, h, n)) / np.sqrt(h), jnp.bfloat16)
    idx, w = routing(r, t, k, e)
    f = pipeline(mesh, e)
    step = jax.jit(
        jax.value_and_grad(
            lambda x, w, wexp: jnp.sum(f(x, idx, w, wexp).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2),
        )
    )
    a = step(x, w, wexp)
    b = step(x, w, wexp)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    out = jax.jit(f)(x, idx, w, wexp)
    want = ep.moe_reference(x, idx, w, expert_ref(wexp))
    assert rel_err(out.astype(jnp.float32), want) < 2e-2


@pytest.mark.parametrize("zero", [True, False], ids=["zeroed", "unwritten"])
@pytest.mark.parametrize("max_rows", [None, 17, 1000], ids=["worst", "cut", "above"])
def test_fan_ops_vs_reference_and_grads(max_rows, zero):
    """fan_out / fan_in alone (no exchange): values, and VJPs against autodiff of the references;
    with max_rows, the pairs past the bound are left out and counted. zero_unused_rows=False
    changes nothing here (the CPU zeroes the rows anyway; the GPU suite checks they are left)."""
    nrows, h, k, l = 23, 8, 3, 5
    x = jnp.asarray(RNG.standard_normal((nrows, h)), jnp.float32)
    idx = np.full((nrows, k), -1, np.int32)
    for i in range(nrows):
        if i % 7 == 3:
            continue  # a row with no local slot
        m = RNG.integers(1, k + 1)
        idx[i, :m] = RNG.choice(l, m, replace=False)
        RNG.shuffle(idx[i])
    idx = jnp.asarray(idx)
    w = jnp.asarray(RNG.random((nrows, k)), jnp.float32)
    recv = ep.Dispatched(x, idx, w, jnp.int32(nrows), jnp.zeros((l,), jnp.int32), None)
    xs, gs, fan = jax.jit(functools.partial(ep.fan_out, max_rows=max_rows, zero_unused_rows=zero))(
        recv
    )
    assert fan.zero_unused_rows is zero
    rxs, rgs, rpos = ep.fan_out_reference(x, idx, l, max_rows or 0)
    pairs = int(jnp.sum(idx >= 0))
    assert xs.shape[0] == min(nrows * min(k, l), max_rows or 10**9)
    assert pairs - int(jnp.sum(gs)) == max(0, pairs - xs.shape[0])
    if max_rows == 17:
        assert pairs > 17 and int(jnp.sum(fan.pos >= 0)) == 17
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(rxs))
    np.testing.assert_array_equal(np.asarray(gs), np.asarray(rgs))
    np.testing.assert_array_equal(np.asarray(fan.pos), np.asarray(rpos))
    ys = jnp.asarray(RNG.standard_normal(xs.shape), jnp.float32)
    # The op may fuse multiply-adds where XLA rounds twice: equal to rounding, not to the bit.
    np.testing.assert_allclose(
        np.asarray(ep.fan_in(ys, fan)),
        np.asarray(ep.fan_in_reference(ys, w, rpos)),
        rtol=1e-6,
        atol=1e-6,
    )
    cot = jnp.asarray(RNG.standard_normal((nrows, h)), jnp.float32)

    def mine(x, w, ys):
        r = ep.Dispatched(x, idx, w, jnp.int32(nrows), jnp.zeros((l,), jnp.int32), None)
        xs, _, fan = ep.fan_out(r, max_rows=max_rows, zero_unused_rows=zero)
        return jnp.sum(ep.fan_in(ys + xs * xs, fan) * cot)

    def ref(x, w, ys):
        xs, _, pos = ep.fan_out_reference(x, idx, l, max_rows or 0)
        return jnp.sum(ep.fan_in_reference(ys + xs * xs, w, pos) * cot)

    g = jax.jit(jax.grad(mine, argnums=(0, 1, 2)))(x, w, ys)
    gr = jax.grad(ref, argnums=(0, 1, 2))(x, w, ys)
    for a, b in zip(g, gr):
        assert rel_err(a, b) < 1e-5

    # weighted=False: the rows summed with unit weights, no gradient in the weights
    ones = jnp.where(rpos >= 0, 1.0, 0.0)
    np.testing.assert_allclose(
        np.asarray(jax.jit(functools.partial(ep.fan_in, weighted=False))(ys, fan)),
        np.asarray(ep.fan_in_reference(ys, ones, rpos)),
        rtol=1e-6,
        atol=1e-6,
    )

    def mine_sum(x, w, ys):
        r = ep.Dispatched(x, idx, w, jnp.int32(nrows), jnp.zeros((l,), jnp.int32), None)
        xs, _, fan = ep.fan_out(r, max_rows=max_rows, zero_unused_rows=zero)
        return jnp.sum(ep.fan_in(ys + xs * xs, fan, weighted=False) * cot)

    def ref_sum(x, w, ys):
        xs, _, pos = ep.fan_out_reference(x, idx, l, max_rows or 0)
        return jnp.sum(ep.fan_in_reference(ys + xs * xs, jnp.where(pos >= 0, 1.0, 0.0), pos) * cot)

    g = jax.jit(jax.grad(mine_sum, argnums=(0, 1, 2)))(x, w, ys)
    gr = jax.grad(ref_sum, argnums=(0, 2))(x, w, ys)
    assert rel_err(g[0], gr[0]) < 1e-5 and rel_err(g[2], gr[1]) < 1e-5
    assert not np.asarray(g[1]).any()  # the weights do not enter the sum
    with pytest.raises(TypeError, match="weighted must be a bool"):
        ep.fan_in(ys, fan, weighted=1)
    # bf16 rows summed to f32: the backward takes d out in f32 and rounds each row once to bf16
    yb = ys.astype(jnp.bfloat16)

    def sum_b(y):
        return jnp.sum(ep.fan_in(y, fan, out_dtype=jnp.float32, weighted=False) * cot)

    db = jax.jit(jax.grad(sum_b))(yb)
    assert db.dtype == jnp.bfloat16
    want = jax.grad(lambda y: jnp.sum(ep.fan_in_reference(y, ones, rpos, jnp.float32) * cot))(yb)
    assert rel_err(db.astype(jnp.float32), want.astype(jnp.float32)) < 1e-2


def test_fan_out_tokens_is_fan_out_without_dispatch():
    """The one-device entry point: the same rows, sizes and layout as fan_out of the same rows, the
    weights carried for fan_in, and clear errors."""
    t, h, k, e = 19, 6, 3, 7
    x = jnp.asarray(RNG.standard_normal((t, h)), jnp.float32)
    idx = jnp.asarray(np.stack([RNG.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    w = jnp.asarray(RNG.random((t, k)), jnp.float32)
    xs, gs, fan = jax.jit(lambda x, i, w: ep.fan_out_tokens(x, i, w, num_experts=e))(x, idx, w)
    rxs, rgs, rpos = ep.fan_out_reference(x, idx, e)
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(rxs))
    np.testing.assert_array_equal(np.asarray(gs), np.asarray(rgs))
    np.testing.assert_array_equal(np.asarray(fan.pos), np.asarray(rpos))
    assert int(gs.sum()) == t * k and xs.shape == (t * k, h)
    np.testing.assert_allclose(
        np.asarray(ep.fan_in(xs * 2, fan)), np.asarray(2 * jnp.sum(w, 1)[:, None] * x), rtol=1e-6
    )
    with pytest.raises(ValueError, match="fan_out_tokens: topk_weights must have topk_idx's shape"):
        ep.fan_out_tokens(x, idx, w[:, :2], num_experts=e)
    with pytest.raises(TypeError, match="fan_out_tokens: topk_idx must be int32"):
        ep.fan_out_tokens(x, idx.astype(jnp.int16), w, num_experts=e)
    with pytest.raises(ValueError, match="fan_out_tokens: num_experts must be an int >= 1"):
        ep.fan_out_tokens(x, idx, w, num_experts=0)


def test_two_dim_mesh_groups():
    """A (dp=2, ep=4) mesh: two independent groups of 4 ranks."""
    r, dp, t, h, k, e = 4, 2, 6, 8, 3, 8
    mesh = mesh_of(r, dp)
    x = jnp.asarray(RNG.standard_normal((dp, r * t, h)), jnp.float32)
    idx = jnp.stack([routing(r, t, k, e)[0] for _ in range(dp)])
    w = jnp.asarray(RNG.random((dp, r * t, k)), jnp.float32)

    def body(x, idx, w):
        recv = ep.dispatch(x[0], idx[0], w[0], num_experts=e, axis_name="ep")
        return recv.x[None], ep.combine(recv.x * 3, recv.handle)[None]

    spec = P("dp", "ep")
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 2))
    rx, out = f(x, idx, w)
    for g in range(dp):
        ref = ep.dispatch_reference(
            x[g].reshape(r, t, h),
            idx[g].reshape(r, t, k),
            w[g].reshape(r, t, k),
            num_experts=e,
            num_ranks=r,
        )
        np.testing.assert_array_equal(np.asarray(rx[g]).reshape(r, t * r, h), np.asarray(ref[0]))
        nd = np.array(
            [len({int(v) // (e // r) for v in row if v >= 0}) for row in np.asarray(idx[g])]
        )
        np.testing.assert_allclose(
            np.asarray(out[g]), np.asarray(x[g]) * 3 * nd[:, None], rtol=1e-6
        )


# ---- bad input ---------------------------------------------------------------------------------


def _dispatch_fn(mesh, e, axis="ep"):
    def body(x, idx, w):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name=axis)
        return recv.x, recv.num_rows[None]

    return jax.jit(shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=(P("ep"),) * 2))


def test_bad_dtypes_and_shapes():
    mesh = mesh_of(2)
    x = jnp.ones((8, 4), jnp.float32)
    idx, w = routing(2, 4, 2, 4)
    f = _dispatch_fn(mesh, 4)
    with pytest.raises(TypeError, match="topk_idx must be int32"):
        f(x, idx.astype(jnp.float32), w)
    with pytest.raises(TypeError, match="topk_weights must be float32"):
        f(x, idx, w.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        f(x.astype(jnp.int32), idx, w)
    with pytest.raises(ValueError, match="topk_weights must have topk_idx's shape"):
        f(x, idx, w[:, :1])
    with pytest.raises(ValueError, match="not a positive multiple"):
        _dispatch_fn(mesh, 5)(x, idx, w)  # 5 experts over 2 ranks


def test_bad_expert_ids_fail_on_every_rank_and_comm_survives():
    mesh = mesh_of(4)
    x = jnp.ones((4 * 5, 4), jnp.float32)
    idx, w = routing(4, 5, 2, 8, p_mask=0)
    f = _dispatch_fn(mesh, 8)
    bad = idx.at[7, 1].set(8)  # token 2 of rank 1
    with pytest.raises(Exception, match=r"rank 1 .*topk_idx\[2, 1\] = 8 is outside \[-1, 8\)"):
        jax.block_until_ready(f(x, bad, w))
    dup = idx.at[13, 1].set(idx[13, 0])  # token 3 of rank 2
    with pytest.raises(Exception, match="token 3 lists expert .* twice"):
        jax.block_until_ready(f(x, dup, w))
    neg = idx.at[0, 0].set(-2)
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(f(x, neg, w))
    # Every rank took part in the failed exchanges, so the communicator still lines up.
    _, nr = f(x, idx, w)
    ref = ep.dispatch_reference(
        x.reshape(4, 5, 4), idx.reshape(4, 5, 2), w.reshape(4, 5, 2), num_experts=8, num_ranks=4
    )
    np.testing.assert_array_equal(np.asarray(nr), np.asarray(ref[3]))


def test_without_setup_or_on_another_mesh():
    mesh_of(2)  # axis "ep" set up, on a mesh of 2
    x = jnp.ones((6, 4), jnp.float32)
    idx, w = routing(3, 2, 1, 3)
    mesh3 = Mesh(np.array(jax.devices()[:3]), ("ep",))  # never set up
    with pytest.raises(RuntimeError, match="not on this mesh"):
        _dispatch_fn(mesh3, 3)(x, idx, w)
    mesh_x = Mesh(np.array(jax.devices()[:3]), ("experts",))

    def body(x, idx, w):
        return ep.dispatch(x, idx, w, num_experts=3, axis_name="experts").x

    f = jax.jit(shard_map(body, mesh=mesh_x, in_specs=(P("experts"),) * 3, out_specs=P("experts")))
    with pytest.raises(RuntimeError, match="no sluice.ep.setup"):
        f(x, idx, w)
    with pytest.raises(ValueError, match="not a mesh axis here"):
        ep.dispatch(x, idx, w, num_experts=3, axis_name="ep")


def test_setup_errors_and_teardown():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tmp",))
    with pytest.raises(ValueError, match="not 'nope'"):
        ep.setup(mesh, "nope")
    with pytest.raises(ValueError, match="timeout_s"):
        ep.setup(mesh, "tmp", timeout_s=0)
    with pytest.raises(ValueError, match="transport must be"):
        ep.setup(mesh, "tmp", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="transport 'nccl' is for GPUs"):
        ep.setup(mesh, "tmp", transport="nccl")
    with pytest.raises(ValueError, match="buffer_bytes"):
        ep.setup(mesh, "tmp", buffer_bytes=0)
    with pytest.raises(ValueError, match="num_sms"):
        ep.setup(mesh, "tmp", num_sms=0)
    ep.setup(mesh, "tmp")
    ep.teardown("tmp")

    def body(x, idx, w):
        return ep.dispatch(x, idx, w, num_experts=2, axis_name="tmp").x

    idx, w = routing(2, 2, 1, 2)
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=(P("tmp"),) * 3, out_specs=P("tmp")))
    with pytest.raises(RuntimeError, match="no sluice.ep.setup"):
        f(jnp.ones((4, 2)), idx, w)


def test_pipeline_gradients_with_vma_checks():
    """shard_map's type checks on (check_vma=True): the ops' results vary over the axis, so no psum
    creeps into the transpose. Experts in plain jnp (row -> expert through the group sizes)."""
    r, t, h, n, k, e = 2, 9, 8, 6, 3, 8
    l = e // r
    mesh = mesh_of(r)
    x = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.float32)
    wexp = jnp.asarray(RNG.standard_normal((e, h, n)) / np.sqrt(h), jnp.float32)
    idx, w = routing(r, t, k, e)
    cot = jnp.asarray(RNG.standard_normal((r * t, n)), jnp.float32)

    def body(x, idx, w, wexp):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        xs, gs, fan = ep.fan_out(recv)
        row_e = jnp.clip(
            jnp.searchsorted(jnp.cumsum(gs), jnp.arange(xs.shape[0]), side="right"), 0, l - 1
        )
        ys = jnp.einsum("mh,mhn->mn", xs, wexp[row_e], precision=jax.lax.Precision.HIGHEST)
        return ep.combine(ep.fan_in(ys, fan), recv.handle)

    f = shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    g = jax.jit(jax.grad(lambda *a: jnp.sum(f(a[0], idx, a[1], a[2]) * cot), argnums=(0, 1, 2)))(
        x, w, wexp
    )
    gr = jax.grad(
        lambda *a: jnp.sum(ep.moe_reference(a[0], idx, a[1], expert_ref(a[2])) * cot),
        argnums=(0, 1, 2),
    )(x, w, wexp)
    for name, a, b in zip(("x", "topk_weights", "experts"), g, gr):
        assert rel_err(a, b) < 1e-5, name


def test_fan_out_max_rows_must_be_positive():
    x = jnp.zeros((4, 8), jnp.float32)
    idx = jnp.zeros((4, 2), jnp.int32).at[:, 1].set(1)
    recv = ep.Dispatched(x, idx, jnp.ones((4, 2)), jnp.int32(4), jnp.zeros((2,), jnp.int32), None)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="fan_out: max_rows must be an int >= 1"):
            ep.fan_out(recv, max_rows=bad)
    with pytest.raises(TypeError, match="fan_out: zero_unused_rows must be a bool"):
        ep.fan_out(recv, zero_unused_rows=0)


def test_vmap_over_every_op_is_the_loop_over_the_batch():
    """jax.vmap of dispatch, fan_out, fan_in and combine (and fan_out_tokens) inside shard_map: each
    batch element gives the bits of the same ops run on it alone, and the gradients in x, the router
    weights and the expert weights match the loop's."""
    r, t, h, n, k, e, b = 4, 5, 8, 6, 3, 8, 3
    mesh = mesh_of(r)
    x = jnp.asarray(RNG.standard_normal((b, r * t, h)), jnp.float32)
    wexp = jnp.asarray(RNG.standard_normal((e, h, n)) / np.sqrt(h), jnp.float32)
    routes = [routing(r, t, k, e) for _ in range(b)]
    idx = jnp.stack([i for i, _ in routes])
    w = jnp.stack([v for _, v in routes])

    def one(x, idx, w, wexp):  # one batch element on one rank
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        xs, gs, fan = ep.fan_out(recv)
        ys = sluice.gmm(xs, wexp, gs, preferred_element_type=jnp.float32)
        return ep.combine(ep.fan_in(ys, fan), recv.handle), recv.num_rows[None]

    spec, bspec = P("ep"), P(None, "ep")
    looped = shard_map(one, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))
    vmapped = shard_map(
        jax.vmap(one, in_axes=(0, 0, 0, None)),
        mesh=mesh,
        in_specs=(bspec, bspec, bspec, spec),
        out_specs=(bspec, bspec),
    )
    out, rows = jax.jit(vmapped)(x, idx, w, wexp)
    for i in range(b):
        want, want_rows = jax.jit(looped)(x[i], idx[i], w[i], wexp)
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(rows[i]), np.asarray(want_rows))
    cot = jnp.asarray(RNG.standard_normal(out.shape), jnp.float32)

    def loss_vmapped(x, w, wexp):
        return jnp.sum(vmapped(x, idx, w, wexp)[0] * cot)

    def loss_looped(x, w, wexp):
        return sum(jnp.sum(looped(x[i], idx[i], w[i], wexp)[0] * cot[i]) for i in range(b))

    g = jax.jit(jax.grad(loss_vmapped, argnums=(0, 1, 2)))(x, w, wexp)
    gr = jax.jit(jax.grad(loss_looped, argnums=(0, 1, 2)))(x, w, wexp)
    for name, a, c in zip(("x", "topk_weights", "experts"), g, gr):
        assert rel_err(a, c) < 1e-6, name

    # the one-device entry point, outside shard_map
    def local(x, idx, w):
        xs, _, fan = ep.fan_out_tokens(x, idx, w, num_experts=e)
        return ep.fan_in(xs * 2, fan)

    got = jax.jit(jax.vmap(local))(x, idx, w)
    for i in range(b):
        np.testing.assert_array_equal(
            np.asarray(got[i]), np.asarray(jax.jit(local)(x[i], idx[i], w[i]))
        )

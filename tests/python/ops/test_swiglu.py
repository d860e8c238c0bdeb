"""sluice.swiglu against its jnp reference: values and gradients (plain and with row weights, the
rows past the groups zeroed or left), under shard_map, and bad input."""

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

RNG = np.random.default_rng()
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def rand(shape, dtype):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,f,sizes", [(37, 24, [9, 0, 20]), (16, 5, [16]), (8, 3, [0, 0])])
@pytest.mark.parametrize("zero", [True, False], ids=["zeroed", "unwritten"])
def test_swiglu_vs_reference_and_grad(dtype, m, f, sizes, zero):
    """Values and the gradient of sluice.swiglu against the jnp reference (the rows past the
    groups zero on the CPU whatever zero_unused_rows says), under jit and vmap."""
    h = rand((m, 2 * f), dtype) * 3
    gs = jnp.asarray(sizes, jnp.int32)
    act = jax.jit(functools.partial(sluice.swiglu, zero_unused_rows=zero))(h, gs)
    ref = sluice.swiglu_reference(h, gs)
    assert act.shape == (m, f) and act.dtype == dtype
    assert rel_err(act, ref) < TOL[dtype]
    used = sum(sizes)
    assert not np.asarray(act[used:], np.float32).any()
    cot = rand((m, f), jnp.float32)

    def loss(fn, h):
        return jnp.sum(fn(h, gs).astype(jnp.float32) * cot)

    mine = jax.jit(
        jax.grad(functools.partial(loss, functools.partial(sluice.swiglu, zero_unused_rows=zero)))
    )(h)
    want = jax.grad(functools.partial(loss, sluice.swiglu_reference))(h)
    assert rel_err(mine, want) < TOL[dtype]
    assert not np.asarray(mine[used:], np.float32).any()
    hb = jnp.stack([h, 2 * h])
    vm = jax.vmap(lambda x: sluice.swiglu(x, gs))(hb)
    assert rel_err(vm, jnp.stack([sluice.swiglu_reference(x, gs) for x in hb])) < TOL[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,f,sizes", [(37, 24, [9, 0, 20]), (16, 5, [16]), (8, 3, [0, 0])])
@pytest.mark.parametrize("zero", [True, False], ids=["zeroed", "unwritten"])
def test_swiglu_row_weights_vs_reference_and_grad(dtype, m, f, sizes, zero):
    """sluice.swiglu with row weights: values and both gradients (h and the weights) against the
    jnp reference, under jit and vmap; the weights' gradient is zero past the groups."""
    h = rand((m, 2 * f), dtype) * 3
    w = rand((m,), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    fn = functools.partial(sluice.swiglu, zero_unused_rows=zero)
    act = jax.jit(lambda h, w: fn(h, gs, row_weights=w))(h, w)
    ref = sluice.swiglu_reference(h, gs, w)
    assert act.shape == (m, f) and act.dtype == dtype
    assert rel_err(act, ref) < TOL[dtype]
    used = sum(sizes)
    cot = rand((m, f), jnp.float32)

    def loss(fn, h, w):
        return jnp.sum(fn(h, gs, row_weights=w).astype(jnp.float32) * cot)

    dh, dw = jax.jit(jax.grad(functools.partial(loss, fn), (0, 1)))(h, w)
    ref_fn = lambda h, gs, row_weights: sluice.swiglu_reference(h, gs, row_weights)
    want_dh, want_dw = jax.grad(functools.partial(loss, ref_fn), (0, 1))(h, w)
    assert rel_err(dh, want_dh) < TOL[dtype]
    assert dw.dtype == jnp.float32 and rel_err(dw, want_dw) < TOL[dtype]
    assert not np.asarray(dw[used:]).any() and not np.asarray(dh[used:], np.float32).any()
    vm = jax.vmap(lambda x, v: sluice.swiglu(x, gs, row_weights=v))(
        jnp.stack([h, 2 * h]), jnp.stack([w, -w])
    )
    want = jnp.stack([ref_fn(h, gs, w), ref_fn(2 * h, gs, -w)])
    assert rel_err(vm, want) < TOL[dtype]


def test_swiglu_all_rows_by_default_and_in_shard_map():
    h = rand((24, 16), jnp.float32)
    assert rel_err(sluice.swiglu(h), sluice.swiglu_reference(h)) < 1e-6
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    gs = jnp.asarray([5, 7], jnp.int32)
    f = shard_map(lambda h: sluice.swiglu(h, gs), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    assert rel_err(jax.jit(f)(h), sluice.swiglu_reference(h, gs)) < 1e-6


@pytest.mark.parametrize(
    "args,exc,msg",
    [
        (((5, 7), None), ValueError, "h must be 2-D \\[M, 2F\\]"),
        (((5, 8), np.zeros((2, 2), np.int32)), ValueError, "group_sizes must be 1-D"),
        (((5, 8), np.zeros(2, np.float32)), TypeError, "group_sizes must be int32"),
    ],
)
def test_swiglu_bad_input(args, exc, msg):
    shape, gs = args
    with pytest.raises(exc, match=msg):
        sluice.swiglu(jnp.zeros(shape, jnp.float32), gs)
    with pytest.raises(TypeError, match="h must be float32, bfloat16 or float16"):
        sluice.swiglu(jnp.zeros((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="row_weights must be \\[M\\] = \\[4\\]"):
        sluice.swiglu(jnp.zeros((4, 4), jnp.float32), row_weights=jnp.ones(3))
    with pytest.raises(TypeError, match="row_weights must be floating"):
        sluice.swiglu(jnp.zeros((4, 4), jnp.float32), row_weights=jnp.ones(4, jnp.int32))
    with pytest.raises(TypeError, match="zero_unused_rows must be a bool"):
        sluice.swiglu(jnp.zeros((4, 4)), zero_unused_rows=1)


@pytest.mark.parametrize("sizes,msg", [([3, -1], "is negative"), ([3, 4], "exceeds the 5 rows")])
def test_swiglu_bad_device_side_sizes_raise_on_cpu(sizes, msg):
    with pytest.raises(Exception, match=msg):
        jax.block_until_ready(sluice.swiglu(jnp.zeros((5, 4)), jnp.asarray(sizes, jnp.int32)))

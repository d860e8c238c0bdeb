"""FP8 dispatch (sluice.ep.dispatch(..., fp8=...)) on CPU devices: rows arrive as the dequantized
e4m3 rows of the BF16 dispatch (bit for bit: dequantize(quantize(x)) of each row sent), the other
outputs are the BF16 dispatch's, and the gradients are the BF16 dispatch's (the quantization passes
them straight through)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sluice
from jax import shard_map
from jax.sharding import PartitionSpec as P
from sluice import ep
from test_ep import mesh_of, routing


def _run(mesh, x, idx, w, e, fp8):
    def body(x, idx, w):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep", fp8=fp8)
        return recv.x, recv.topk_idx, recv.topk_weights, recv.num_rows[None]

    spec = P("ep")
    return jax.jit(shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))(
        x, idx, w
    )


@pytest.mark.parametrize("r,h,p2", [(2, 256, False), (4, 200, True)])
def test_fp8_dispatch_values_and_gradients(r, h, p2):
    t, k, e = 16, 4, 8 * r
    mesh = mesh_of(r)
    rng = np.random.default_rng(r)
    x = jnp.asarray(rng.standard_normal((r * t, h)) * np.exp(rng.uniform(-3, 3, (r * t, 1))))
    x = x.astype(jnp.bfloat16)
    idx, w = routing(r, t, k, e)
    recipe = sluice.fp8.Recipe(power_of_two_scales=p2)
    got = _run(mesh, x, idx, w, e, recipe)
    xq = sluice.fp8.dequantize(
        *sluice.fp8.quantize(x, sluice.fp8.ACT, power_of_two=p2), sluice.fp8.ACT, dtype=x.dtype
    )
    want = _run(mesh, xq, idx, w, e, None)  # BF16 dispatch of the rows FP8 makes of x
    for g, wv in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wv))

    def loss(x, w, fp8):
        def body(x, idx, w):
            recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep", fp8=fp8)
            scale = (1.0 + jnp.arange(recv.x.shape[0], dtype=jnp.float32) / 8)[:, None]
            v = recv.x.astype(jnp.float32) * scale * recv.topk_weights.sum(1)[:, None]
            return jax.lax.psum(jnp.sum(v), "ep")

        f = shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P())
        return f(x, idx, w)

    gx, gw = jax.jit(jax.grad(lambda x, w: loss(x, w, recipe).sum(), argnums=(0, 1)))(x, w)
    gx0, gw0 = jax.jit(jax.grad(lambda x, w: loss(x, w, None).sum(), argnums=(0, 1)))(xq, w)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(gx0))
    # d topk_weights sums recv.x over a row, which XLA may keep unrounded from the dequantization's
    # float32 (excess precision) in one program and not the other: equal to bf16's resolution
    gw, gw0 = np.asarray(gw), np.asarray(gw0)
    assert np.linalg.norm(gw - gw0) <= 1e-2 * np.linalg.norm(gw0)


def test_fp8_dispatch_rejects_a_bad_recipe():
    mesh = mesh_of(2)
    x = jnp.zeros((32, 128), jnp.bfloat16)
    idx, w = routing(2, 16, 2, 4)
    with pytest.raises(TypeError, match="sluice.ep.dispatch: fp8 must be"):
        _run(mesh, x, idx, w, 4, "e4m3")


@pytest.mark.parametrize("dtype,p2", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_fp8_expert_ends_are_the_compositions(dtype, p2):
    """sluice.ep.fanned_gmm and gmm_fan_in (the FP8 quantization picks the rows where they are)
    give fan_out -> sluice.gmm(fp8=) and sluice.gmm(fp8=) -> fan_in(weighted=False) bit for bit:
    values and the gradients in x, lhs and both weights. Masked slots (-1), an expert no token
    takes, K and N not multiples of 128."""
    t, k, e, h, f = 40, 3, 6, 200, 136
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    idx, w = routing(1, t, k, e)
    idx = jnp.where(idx == 5, -1, idx)  # expert 5 gets nothing
    wi = jnp.asarray(rng.standard_normal((e, h, f)) * 0.1, dtype)
    wo = jnp.asarray(rng.standard_normal((e, f, h)) * 0.1, dtype)
    probe = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    recipe = sluice.fp8.Recipe(power_of_two_scales=p2)

    def composed(x, wi, wo):
        xs, gs, fan = ep.fan_out_tokens(x, idx, w, num_experts=e)
        a = jnp.tanh(sluice.gmm(xs, wi, gs, fp8=recipe))
        ys = sluice.gmm(a, wo, gs, fp8=recipe)
        return ep.fan_in(ys, fan, out_dtype=jnp.float32, weighted=False)

    def fused(x, wi, wo):
        xs, _, fan = ep.fan_out_tokens(x, idx, w, num_experts=e, copy_rows=False)
        assert xs is None
        a = jnp.tanh(ep.fanned_gmm(x, fan, wi, fp8=recipe))
        return ep.gmm_fan_in(a, wo, fan, fp8=recipe, out_dtype=jnp.float32)

    def run(f):
        loss = lambda *a: jnp.sum(f(*a) * probe)
        return [f(x, wi, wo), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, wi, wo)]

    for got, want in zip(run(jax.jit(fused)), run(jax.jit(composed)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _, _, fan = ep.fan_out_tokens(x, idx, w, num_experts=e, copy_rows=False)
    with pytest.raises(ValueError, match=r"fanned_gmm: rhs must be \[L, K, N\]"):
        ep.fanned_gmm(x, fan, wi[1:], fp8=recipe)
    with pytest.raises(ValueError, match="gmm_fan_in: fp8 must be True or a sluice.fp8.Recipe"):
        ep.gmm_fan_in(x, wo, fan, fp8=None)

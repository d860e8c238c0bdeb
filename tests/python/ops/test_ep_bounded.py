"""sluice.ep.bounded_moe on 2, 4 and 8 CPU devices against the unbounded path (dispatch -> experts
-> combine with worst-case buffers): adversarial routings (every token to one rank's experts, one
expert takes everything, every rank overflowing at once, nothing routed) give the same values and
the same x and topk_weights gradients bit for bit, the expert weights' gradients to rounding (bit
for bit with one round); the round count against a numpy model of the rounds; the compiled step's
memory does not grow with the rank count at a fixed bound; bad arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sluice
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from sluice import ep

RNG = np.random.default_rng()
SPEC = P("ep")


@functools.cache
def _mesh(r):
    mesh = Mesh(np.array(jax.devices()[:r]), ("ep",))
    ep.setup(mesh, "ep", timeout_s=30.0)
    return mesh


def mesh_of(r):
    if len(jax.devices()) < r:  # (on a GPU host with fewer GPUs)
        pytest.skip(f"needs {r} devices")
    return _mesh(r)


def experts(recv, params, max_rows):
    """A two-matmul expert with a row-wise nonlinearity, summed back with the router weights."""
    wi, wo = params
    xs, gs, fan = ep.fan_out(recv, max_rows=max_rows)
    h = sluice.gmm(xs, wi, gs)
    h = (jnp.tanh(h.astype(jnp.float32)) * h.astype(jnp.float32)).astype(xs.dtype)
    return ep.fan_in(sluice.gmm(h, wo, gs), fan)


def unbounded(e, fp8=None):
    def body(x, idx, w, wi, wo):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep", fp8=fp8)
        return ep.combine(experts(recv, (wi, wo), None), recv.handle)

    return body


def bounded(e, rows, fp8=None):
    def body(x, idx, w, wi, wo):
        out, st = ep.bounded_moe(
            x, idx, w, experts, (wi, wo), num_experts=e, axis_name="ep", rows=rows, fp8=fp8
        )
        return out, jnp.stack([st["rounds"], st["peak_recv_rows"], st["peak_expert_rows"]])[None]

    return body


def value_and_grads(mesh, body, with_stats):
    out_specs = (SPEC, SPEC) if with_stats else SPEC
    f = shard_map(body, mesh=mesh, in_specs=(SPEC,) * 5, out_specs=out_specs)

    def loss(x, w, wi, wo, idx, cot):
        res = f(x, idx, w, wi, wo)
        out = res[0] if with_stats else res
        return jnp.sum(out.astype(jnp.float32) * cot), res

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def routing(r, t, k, e, mode):
    l = e // r
    idx = np.full((r * t, k), -1, np.int32)
    for i in range(r * t):
        if mode == "one_rank":  # every token of every rank to rank 0's experts
            pool = np.arange(l)
        elif mode == "one_expert":  # expert 0 takes every token, the other slots unused
            idx[i, RNG.integers(k)] = 0
            continue
        else:
            pool = np.arange(e)
        kk = min(k, len(pool))
        idx[i, :kk] = RNG.choice(pool, kk, replace=False)
        RNG.shuffle(idx[i])
    if mode == "none":
        idx[:] = -1
    elif mode in ("random", "one_rank"):
        idx[RNG.random(idx.shape) < 0.15] = -1
    return idx


def rounds_model(idx, r, t, e, rows):
    """The rounds from the rule: rank d's pairs numbered by (source, token); a row starting at pair
    p goes in round p // W, W = rows - min(k, L) + 1."""
    l, k = e // r, idx.shape[1]
    window = rows - min(k, l) + 1
    most = 0
    for d in range(r):
        p = 0
        for i in range(r * t):  # (source, token) order = the global token order
            n = int(np.sum((idx[i] >= 0) & (idx[i] // l == d)))
            if n:
                most = max(most, p // window + 1)
                p += n
    return most


CASES = [
    # r, t, h, n, k, e, mode, rows
    (2, 9, 8, 12, 2, 4, "one_rank", 6),
    (4, 6, 8, 12, 3, 8, "one_expert", 4),
    (4, 7, 8, 8, 4, 16, "random", 8),  # every rank overflows at once
    (8, 4, 8, 8, 4, 16, "one_rank", 5),
    (8, 3, 8, 8, 2, 16, "none", 4),
    (4, 6, 8, 8, 2, 16, "random", 40),  # one round in buffers below the worst case (48 pairs)
    (8, 5, 8, 8, 3, 16, "random", 1000),  # buffers that hold every routing: no rounds' branch
]


@pytest.mark.parametrize("r,t,h,n,k,e,mode,rows", CASES)
def test_bounded_is_the_unbounded_path(r, t, h, n, k, e, mode, rows):
    mesh = mesh_of(r)
    idx = routing(r, t, k, e, mode)
    x = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.float32)
    w = jnp.asarray(RNG.random((r * t, k)), jnp.float32)
    wi = jnp.asarray(RNG.standard_normal((e, h, n)) / 3, jnp.float32)
    wo = jnp.asarray(RNG.standard_normal((e, n, h)) / 3, jnp.float32)
    cot = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.float32)
    args = (x, w, wi, wo, jnp.asarray(idx), cot)
    (_, want), g_want = value_and_grads(mesh, unbounded(e), False)(*args)
    (_, (out, stats)), g_out = value_and_grads(mesh, bounded(e, rows), True)(*args)
    stats = np.asarray(stats)
    assert (stats == stats[0]).all(), "the stats differ between ranks"
    rounds, peak_rows, peak_pairs = stats[0]
    assert rounds == rounds_model(idx, r, t, e, rows)
    assert (rounds > 1) == (mode != "none" and rows < 10)
    l = e // r
    owner = np.where(idx >= 0, idx // l, -1)
    per_rank = [np.sum(owner == d) for d in range(r)]
    assert peak_pairs == max(per_rank)
    assert peak_rows == max(np.sum(np.any(owner == d, axis=1)) for d in range(r))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    for name, a, b in zip(("x", "topk_weights"), g_out[:2], g_want[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    for name, a, b in zip(("wi", "wo"), g_out[2:], g_want[2:]):
        if rounds <= 1:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        else:  # summed per round
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bf16_overflow_is_bitwise():
    r, t, h, n, k, e, rows = 4, 8, 16, 8, 4, 8, 6
    mesh = mesh_of(r)
    idx = routing(r, t, k, e, "one_rank")
    x = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.bfloat16)
    w = jnp.asarray(RNG.random((r * t, k)), jnp.float32)
    wi = jnp.asarray(RNG.standard_normal((e, h, n)) / 3, jnp.bfloat16)
    wo = jnp.asarray(RNG.standard_normal((e, n, h)) / 3, jnp.bfloat16)
    cot = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.float32)
    args = (x, w, wi, wo, jnp.asarray(idx), cot)
    (_, want), g_want = value_and_grads(mesh, unbounded(e), False)(*args)
    (_, (out, stats)), g_out = value_and_grads(mesh, bounded(e, rows), True)(*args)
    assert np.asarray(stats)[0, 0] > 1
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    for a, b in zip(g_out[:2], g_want[:2]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fp8_dispatch_rounds_are_the_worst_case_path():
    """With FP8 dispatch (partial 1x128 blocks: H = 200) and every rank's rows overflowing into
    several rounds: the values and d x equal the worst-case path's with FP8 dispatch bit for bit,
    and both equal the BF16 path fed dequantize(quantize(x)) (the quantization per row, its
    gradient straight through); d topk_weights bit for bit too, the weights' gradients to bf16's
    rounding of the per-round sums."""
    r, t, h, n, k, e, rows = 4, 8, 200, 16, 4, 8, 6
    mesh = mesh_of(r)
    idx = routing(r, t, k, e, "random")
    scale = np.exp(RNG.uniform(-3, 3, (r * t, 1)))
    x = jnp.asarray(RNG.standard_normal((r * t, h)) * scale, jnp.bfloat16)
    w = jnp.asarray(RNG.random((r * t, k)), jnp.float32)
    wi = jnp.asarray(RNG.standard_normal((e, h, n)) / 8, jnp.bfloat16)
    wo = jnp.asarray(RNG.standard_normal((e, n, h)) / 3, jnp.bfloat16)
    cot = jnp.asarray(RNG.standard_normal((r * t, h)), jnp.float32)
    args = (x, w, wi, wo, jnp.asarray(idx), cot)
    recipe = sluice.fp8.Recipe()
    (_, (out, stats)), g_out = value_and_grads(mesh, bounded(e, rows, recipe), True)(*args)
    (_, want), g_want = value_and_grads(mesh, unbounded(e, recipe), False)(*args)
    xq = sluice.fp8.dequantize(
        *sluice.fp8.quantize(x, sluice.fp8.ACT), sluice.fp8.ACT, dtype=x.dtype
    )
    (_, plain), g_plain = value_and_grads(mesh, unbounded(e), False)(xq, *args[1:])
    assert np.asarray(stats)[0, 0] > 1
    assert not np.array_equal(np.asarray(xq, np.float32), np.asarray(x, np.float32))
    for name, i in (("out", None), ("x", 0), ("topk_weights", 1)):
        a, b, c = (out, want, plain) if i is None else (g_out[i], g_want[i], g_plain[i])
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(c, np.float32), name)
    for a, b, c in zip(g_out[2:], g_want[2:], g_plain[2:]):
        a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
        np.testing.assert_array_equal(b, c)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


def temp_bytes(r, t, h, k, e, rows):
    """The per-device temporary bytes of the compiled forward and backward (XLA's buffer report)."""
    mesh = mesh_of(r)
    body = unbounded(e) if rows is None else bounded(e, rows)
    f = value_and_grads(mesh, body, rows is not None)
    args = (
        jax.ShapeDtypeStruct((r * t, h), jnp.float32),
        jax.ShapeDtypeStruct((r * t, k), jnp.float32),
        jax.ShapeDtypeStruct((e, h, h), jnp.float32),
        jax.ShapeDtypeStruct((e, h, h), jnp.float32),
        jax.ShapeDtypeStruct((r * t, k), jnp.int32),
        jax.ShapeDtypeStruct((r * t, h), jnp.float32),
    )
    m = f.lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes


def test_memory_does_not_grow_with_the_rank_count():
    t, h, k = 32, 128, 4
    mesh_of(8)
    rows = ep.bounded_rows(t, k, 2.0)  # 2*T*k pairs: at R = 2 every routing fits, not at 4 or 8
    b2, b4, b8 = (temp_bytes(r, t, h, k, 64, rows) for r in (2, 4, 8))
    u2, u8 = temp_bytes(2, t, h, k, 64, None), temp_bytes(8, t, h, k, 64, None)
    assert b8 <= 1.15 * b4, (b4, b8)  # O(C): the [T, R] layout ints are all that grows
    assert b2 <= 1.05 * u2, (b2, u2)  # one round holds every routing: the unbounded path's buffers
    assert u8 >= 3 * u2, (u2, u8)  # the worst case grows with R
    assert b8 < 0.6 * u8, (b8, u8)


def test_bad_arguments():
    mesh = mesh_of(2)
    x = jnp.zeros((8, 4), jnp.float32)
    idx = jnp.zeros((8, 2), jnp.int32)
    w = jnp.zeros((8, 2), jnp.float32)

    def run(rows, e=4, ww=w):
        f = shard_map(
            lambda x, i, w: ep.bounded_moe(
                x, i, w, experts, (None, None), num_experts=e, axis_name="ep", rows=rows
            )[0],
            mesh=mesh,
            in_specs=(SPEC,) * 3,
            out_specs=SPEC,
        )
        return jax.eval_shape(f, x, idx, ww)

    with pytest.raises(ValueError, match="rows must be an int >= min"):
        run(1)
    with pytest.raises(ValueError, match="not a positive multiple"):
        run(8, e=3)
    with pytest.raises(TypeError, match="int32 and topk_weights float32"):
        run(8, ww=w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="factor must be positive"):
        ep.bounded_rows(8, 2, 0.0)
    assert ep.bounded_rows(100, 8, 2.0) == 1600
    with pytest.raises(ValueError, match="recv_rows must be an int"):
        jax.eval_shape(
            shard_map(
                lambda x, i, w: ep.dispatch(x, i, w, num_experts=4, axis_name="ep", recv_rows=9).x,
                mesh=mesh,
                in_specs=(SPEC,) * 3,
                out_specs=SPEC,
            ),
            x,
            idx,
            w,
        )

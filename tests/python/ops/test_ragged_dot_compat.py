"""sluice.gmm / tgmm / swiglu as drop-ins for jax.lax.ragged_dot (issue 71): the same calls through
both side by side (values, dtypes, output shardings on an explicit-sharding mesh of CPU devices),
ragged_dot's arguments (precision, any integer group sizes, out_sharding), its exception types for
bad shapes, float64 refused, ragged_dot_general's modes, and jax.export (round trips, symbolic row
counts, the ep ops under shard_map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sluice
from helpers import rel_err
from jax import export, shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from sluice import ep

RNG = np.random.default_rng()
LAX = jax.lax.Precision


def rand(shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def groups(m_used, g):
    return jnp.asarray(RNG.multinomial(m_used, np.full(g, 1.0 / g)), jnp.int32)


def x64():
    enable = getattr(jax, "enable_x64", None)
    return enable(True) if enable is not None else jax.experimental.enable_x64()


def explicit_mesh(n=4):
    types = (jax.sharding.AxisType.Explicit,)
    return jax.make_mesh((n,), ("x",), axis_types=types, devices=jax.devices()[:n])


# ---- values and dtypes, side by side -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("pet", [None, jnp.float32])
@pytest.mark.parametrize("precision", [None, LAX.HIGHEST, "default", (LAX.HIGH, LAX.HIGHEST)])
def test_gmm_side_by_side_with_ragged_dot(dtype, pet, precision):
    lhs, rhs, gs = rand((40, 24), dtype), rand((3, 24, 16), dtype), groups(35, 3)
    want = jax.lax.ragged_dot(lhs, rhs, gs, precision=precision, preferred_element_type=pet)
    for got in (
        sluice.gmm(lhs, rhs, gs, precision=precision, preferred_element_type=pet),
        sluice.ragged_dot(lhs, rhs, gs, precision, pet),  # ragged_dot's positional signature
        jax.jit(
            functools.partial(sluice.ragged_dot, precision=precision, preferred_element_type=pet)
        )(lhs, rhs, gs),
    ):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 and pet else 1e-2)


def test_precision_values_are_checked_like_ragged_dot():
    lhs, rhs, gs = rand((8, 4)), rand((2, 4, 3)), jnp.array([3, 5], jnp.int32)
    preset = jax.lax.DotAlgorithmPreset.DEFAULT
    ref = sluice.gmm(lhs, rhs, gs)
    assert np.array_equal(sluice.gmm(lhs, rhs, gs, precision=preset), ref)
    assert np.array_equal(sluice.tgmm(lhs, lhs, gs, precision="highest").shape, (2, 4, 4))
    for bad in ("bogus", 3, (LAX.HIGH,) * 3):
        with pytest.raises(ValueError):
            jax.lax.ragged_dot(lhs, rhs, gs, precision=bad)
        with pytest.raises(ValueError, match="sluice.gmm: precision must be"):
            sluice.gmm(lhs, rhs, gs, precision=bad)


def test_ragged_dot_general_modes():
    g, m, k, n = 3, 30, 8, 6
    lhs, gs = rand((m, k)), groups(m - 2, g)
    dn = jax.lax.RaggedDotDimensionNumbers
    rows = dn((((1,), (1,)), ((), ())), (0,), (0,))
    rhs = rand((g, k, n))
    want = jax.lax.ragged_dot_general(lhs, rhs, gs, rows)
    assert rel_err(sluice.ragged_dot_general(lhs, rhs, gs, rows), want) < 1e-5
    rows_t = dn((((1,), (2,)), ((), ())), (0,), (0,))  # rhs [G, N, K]: transpose_rhs
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    assert rel_err(sluice.ragged_dot_general(lhs, rhs_t, gs, rows_t), want) < 1e-5
    contract = dn((((0,), (0,)), ((), ())), (0,), ())
    rhs2 = rand((m, n))
    want2 = jax.lax.ragged_dot_general(lhs, rhs2, gs, contract)
    got2 = sluice.ragged_dot_general(lhs, rhs2, gs, contract)
    assert got2.shape == want2.shape == (g, k, n) and rel_err(got2, want2) < 1e-5
    batch = dn((((2,), (1,)), ((0,), (0,))), (0,), ())  # mode 3: ragged batch dim
    with pytest.raises(NotImplementedError, match="sluice covers ragged rows"):
        sluice.ragged_dot_general(rand((g, 4, k)), rand((g, k, n)), gs, batch)


# ---- group sizes of any integer dtype; float64 refused -------------------------------------------
@pytest.mark.parametrize("int_dtype", [jnp.uint32, jnp.int16, jnp.uint8])
def test_integer_group_sizes(int_dtype):
    lhs, rhs, gs = rand((20, 8)), rand((2, 8, 5)), jnp.array([7, 11], int_dtype)
    assert rel_err(sluice.gmm(lhs, rhs, gs), jax.lax.ragged_dot(lhs, rhs, gs)) < 1e-5
    ref = sluice.tgmm(lhs, lhs, gs.astype(jnp.int32))
    assert np.array_equal(sluice.tgmm(lhs, lhs, gs), ref)
    act = sluice.swiglu(lhs, gs)
    assert np.array_equal(act, sluice.swiglu(lhs, gs.astype(jnp.int32)))


def test_int64_group_sizes_and_float64_operands_under_x64():
    with x64():
        lhs, rhs = rand((20, 8)), rand((2, 8, 5))
        gs = jnp.array([7, 11], jnp.int64)
        assert gs.dtype == jnp.int64
        want = jax.lax.ragged_dot(lhs, rhs, gs)
        assert rel_err(sluice.gmm(lhs, rhs, gs), want) < 1e-5
        loss = lambda f: lambda a, b: jnp.sum(f(a, b, gs) ** 2)
        ga = jax.grad(loss(sluice.gmm), (0, 1))(lhs, rhs)
        gb = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(lhs, rhs)
        assert rel_err(ga[0], gb[0]) < 1e-5 and rel_err(ga[1], gb[1]) < 1e-5
        assert sluice.tgmm(lhs, lhs, gs).shape == (2, 8, 8)
        # a size past int32 saturates and stays invalid: the CPU run reports it
        with pytest.raises(Exception, match="exceeds"):
            sluice.gmm(lhs, rhs, jnp.array([7, 2**33], jnp.int64)).block_until_ready()
        # float64 is refused by name (sluice computes in float32/bf16/f16 only)
        for op, args in [
            ("gmm", (lhs.astype(jnp.float64), rhs.astype(jnp.float64), gs)),
            ("tgmm", (lhs.astype(jnp.float64), lhs.astype(jnp.float64), gs)),
            ("swiglu", (lhs.astype(jnp.float64), gs)),
        ]:
            arg = "h" if op == "swiglu" else "lhs"
            msg = rf"sluice.{op}: {arg} must be float32, bfloat16 or float16, got float64 \(cast"
            with pytest.raises(TypeError, match=msg):
                getattr(sluice, op)(*args)
        with pytest.raises(TypeError, match="preferred_element_type must be float32"):
            sluice.gmm(lhs, rhs, gs, preferred_element_type=jnp.float64)


# ---- bad shapes: ragged_dot's exception type, sluice's message -----------------------------------
def _base():
    return rand((8, 4)), rand((2, 4, 3)), jnp.array([3, 5], jnp.int32)


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda l, r, s: (l[None], r, s), "sluice.gmm: lhs must be 2-D"),
        (lambda l, r, s: (l[0], r, s), "sluice.gmm: lhs must be 2-D"),
        (lambda l, r, s: (l, r[0], s), "sluice.gmm: rhs must be 3-D"),
        (lambda l, r, s: (l, r[:, :3], s), "sluice.gmm: contraction dims differ"),
        (lambda l, r, s: (l, r, s[None]), "sluice.gmm: group_sizes must be 1-D"),
        (lambda l, r, s: (l, r, s[0]), "sluice.gmm: group_sizes must be 1-D"),
        (
            lambda l, r, s: (l, r, s[:1]),
            "sluice.gmm: rhs holds 2 groups but group_sizes has only 1",
        ),
        (lambda l, r, s: (l, r, jnp.append(s, 0)), "sluice.gmm: rhs holds 2 groups and group_siz"),
        (lambda l, r, s: (l, r, s.astype(jnp.float32)), "sluice.gmm: group_sizes must be int32"),
    ],
)
def test_bad_shapes_raise_what_ragged_dot_raises(mutate, msg):
    args = mutate(*_base())
    with pytest.raises(Exception) as theirs:
        jax.lax.ragged_dot(*args)
    assert theirs.type is TypeError
    with pytest.raises(TypeError, match=msg) as ours:
        sluice.gmm(*args)
    # also a ValueError, as these were before (sluice.ShapeError is both) where it is a shape
    assert isinstance(ours.value, ValueError) or "int32" in msg


def test_bad_shapes_of_tgmm_and_swiglu_are_type_errors():
    lhs, rhs, gs = _base()
    with pytest.raises(sluice.ShapeError, match="sluice.tgmm: rhs must be 2-D"):
        sluice.tgmm(lhs, rhs, gs)
    with pytest.raises(sluice.ShapeError, match="sluice.tgmm: group_sizes must be 1-D"):
        sluice.tgmm(lhs, lhs, gs[None])
    with pytest.raises(sluice.ShapeError, match="sluice.swiglu: h must be 2-D"):
        sluice.swiglu(lhs[0], gs)
    assert issubclass(sluice.ShapeError, TypeError) and issubclass(sluice.ShapeError, ValueError)


# ---- explicit-sharding meshes: output shardings --------------------------------------------------
def _spec(a):
    s = jax.typeof(a).sharding.spec
    return tuple(s) + (None,) * (a.ndim - len(s))


@pytest.mark.parametrize("out_sharding", [P("x", None), P(None, "x"), P(None, None)])
def test_out_sharding_matches_ragged_dot(out_sharding):
    lhs, rhs, gs = rand((32, 8)), rand((2, 8, 12)), jnp.array([10, 17], jnp.int32)
    with jax.set_mesh(explicit_mesh()):
        # ragged_dot lowers on CPU from replicated operands only; sluice takes sharded ones too
        want = jax.lax.ragged_dot(lhs, rhs, gs, out_sharding=out_sharding)
        for lhs_in in (lhs, jax.device_put(lhs, P("x", None))):
            got = sluice.gmm(lhs_in, rhs, gs, out_sharding=out_sharding)
            assert _spec(got) == _spec(want) == tuple(out_sharding)
            assert rel_err(got, want) < 1e-5
            got = jax.jit(sluice.ragged_dot, static_argnames="out_sharding")(
                lhs_in, rhs, gs, out_sharding=out_sharding
            )
            assert _spec(got) == tuple(out_sharding) and rel_err(got, want) < 1e-5
        out = sluice.tgmm(lhs, lhs, gs, out_sharding=P(None, "x", None))
        assert _spec(out) == (None, "x", None)


def test_explicit_mesh_default_sharding_and_gradients():
    lhs, rhs, gs = rand((32, 8)), rand((2, 8, 12)), jnp.array([10, 17], jnp.int32)
    with jax.set_mesh(explicit_mesh()):
        ls = jax.device_put(lhs, P("x", None))
        out = jax.jit(sluice.gmm)(ls, rhs, gs)  # ragged_dot asks for out_sharding here
        assert _spec(out) == ("x", None)
        assert rel_err(out, sluice.gmm_reference(lhs, rhs, gs)) < 1e-5
        assert _spec(sluice.swiglu(ls, gs)) == ("x", None)
        rs = jax.device_put(rhs, P(None, None, "x"))
        assert _spec(sluice.gmm(lhs, rs, gs)) == (None, "x")
        # gradients come back with each operand's sharding
        loss = lambda a, b: jnp.sum(sluice.gmm(a, b, gs) ** 2)
        ga, gb = jax.jit(jax.grad(loss, (0, 1)))(ls, rs)
        assert _spec(ga) == ("x", None) and _spec(gb) == (None, None, "x")
    want = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs) ** 2), (0, 1))(lhs, rhs)
    assert rel_err(ga, want[0]) < 1e-5 and rel_err(gb, want[1]) < 1e-5


# ---- jax.export ----------------------------------------------------------------------------------
def _round_trip(exported):
    """The exported program itself (its StableHLO bytecode) and, where jax's serialization
    (flatbuffers) is installed, what deserialize(serialize()) gives."""
    yield exported
    try:
        import flatbuffers  # noqa: F401
    except ImportError:
        return
    yield export.deserialize(exported.serialize())


def _export(fn, *args):
    return export.export(jax.jit(fn), disabled_checks=sluice.export_disabled_checks())(*args)


def test_export_needs_the_disabled_checks():
    names = {c.is_custom_call() for c in sluice.export_disabled_checks()}
    ops = ("gmm", "tgmm", "swiglu", "swiglu_bwd", "ep_dispatch", "ep_combine", "ep_redispatch")
    assert {f"sluice_{op}" for op in ops + ("ep_fan_out", "ep_fan_in", "ep_fan_in_bwd")} <= names
    lhs, rhs, gs = _base()
    with pytest.raises(ValueError, match="custom calls"):
        export.export(jax.jit(sluice.gmm))(lhs, rhs, gs)


def test_export_round_trip_gmm_tgmm_swiglu():
    lhs, rhs, gs = rand((40, 16)), rand((4, 16, 12)), groups(36, 4)

    def model(x, w, s):
        h = sluice.gmm(x, w, s, precision=LAX.HIGHEST)
        return sluice.swiglu(h, s), sluice.tgmm(x, h, s)

    grad = jax.grad(lambda x, w, s: jnp.sum(model(x, w, s)[0] ** 2), (0, 1))
    for fn in (model, grad):
        want = fn(lhs, rhs, gs)
        for exp in _round_trip(_export(fn, lhs, rhs, gs)):
            got = exp.call(lhs, rhs, gs)
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, want)


def test_export_with_symbolic_rows():
    k, n, g = 16, 12, 3
    (m,) = export.symbolic_shape("m")
    specs = (
        jax.ShapeDtypeStruct((m, k), jnp.float32),
        jax.ShapeDtypeStruct((g, k, n), jnp.float32),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    )

    def model(x, w, s):
        h = sluice.gmm(x, w, s)
        return h, sluice.tgmm(x, h, s), sluice.swiglu(h), sluice.swiglu(h, s)

    exp = _export(model, *specs)
    for got_exp in _round_trip(exp):
        for rows in (24, 57):
            lhs, rhs, gs = rand((rows, k)), rand((g, k, n)), groups(rows - 3, g)
            h, t, a_all, a = got_exp.call(lhs, rhs, gs)
            assert h.shape == (rows, n) and t.shape == (g, k, n) and a.shape == (rows, n // 2)
            assert rel_err(h, sluice.gmm_reference(lhs, rhs, gs)) < 1e-5
            assert rel_err(t, sluice.tgmm_reference(lhs, h, gs)) < 1e-5
            assert rel_err(a_all, sluice.swiglu_reference(h)) < 1e-5
            assert rel_err(a, sluice.swiglu_reference(h, gs)) < 1e-5


@functools.cache
def _ep_mesh(r):
    mesh = Mesh(np.array(jax.devices()[:r]), ("ep",))
    ep.setup(mesh, "ep", timeout_s=20.0)
    return mesh


def test_export_round_trip_ep_under_shard_map():
    r, t, h, n, k, e = 2, 8, 16, 8, 2, 4
    mesh = _ep_mesh(r)
    x, w = rand((r * t, h)), rand((e, h, n))
    idx = jnp.asarray(np.stack([RNG.choice(e, k, replace=False) for _ in range(r * t)]), jnp.int32)
    wts = jnp.asarray(RNG.random((r * t, k)), jnp.float32)

    @functools.partial(
        shard_map, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"), check_vma=False
    )
    def moe(x, idx, wts, w_local):
        recv = ep.dispatch(x, idx, wts, num_experts=e, axis_name="ep")
        xs, gs, fan = ep.fan_out(recv)
        return ep.combine(ep.fan_in(sluice.gmm(xs, w_local, gs), fan), recv.handle)

    want = jax.jit(moe)(x, idx, wts, w)
    expert = lambda xt, et: jnp.einsum("th,thn->tn", xt, w[et], precision=LAX.HIGHEST)
    assert rel_err(want, ep.moe_reference(x, idx, wts, expert)) < 1e-5
    # an exported multi-device program runs under a jit over the same number of devices
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, P("ep"))) for a in (x, idx, wts, w)]
    for exp in _round_trip(_export(moe, *args)):
        np.testing.assert_array_equal(jax.jit(exp.call)(*args), want)

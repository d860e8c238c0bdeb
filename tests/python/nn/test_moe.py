"""The MoE layer: the three expert paths agree where they should, with and without expert
parallelism.

conftest.py gives the session several CPU devices (set before jax is imported); meshes here use
four.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from sluice import ep
from sluice.nn import moe
from sluice.nn.experts import capacity
from sluice.nn.moe import MoE, MoEConfig, route

SOFTMAX = MoEConfig(
    d_model=32,
    d_ff=16,
    num_experts=8,
    top_k=2,
    num_shared_experts=1,
    router="softmax",
    aux_loss_coef=0.01,
    dtype=jnp.float32,
)
# DeepSeek-V3 routing: sigmoid scores, selection bias, 4 groups of which 2 may be used, routed
# scaling.
SIGMOID = dataclasses.replace(
    SOFTMAX,
    router="sigmoid",
    num_groups=4,
    topk_groups=2,
    routed_scaling=2.5,
    bias_update_rate=0.01,
    top_k=3,
)
NO_DROP = 8.0  # capacity_factor >= E/k: capacity = S, nothing can be dropped


def _mesh(dp, ep):
    if len(jax.devices()) < dp * ep:
        pytest.skip(f"needs {dp * ep} devices")
    return Mesh(np.array(jax.devices()[: dp * ep]).reshape(dp, ep), ("data", "expert"))


def _x(dtype=jnp.float32, b=4, s=16, d=32):
    return jax.random.normal(jax.random.key(1), (b, s, d), jnp.float32).astype(dtype)


def _run(cfg, x, mesh=None, bias=None):
    """Forward, and gradients in parameters and input of a fixed random projection of the output."""
    layer = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    if bias is not None:
        layer.bias[...] = bias
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    probe = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

    def f(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * probe), (y, stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    return y, stats, grads


def _close(a, b, atol, rtol=0.0):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(u, np.float32), np.asarray(v, np.float32), atol=atol, rtol=rtol
        )


@pytest.mark.parametrize("base", [SOFTMAX, SIGMOID], ids=["softmax", "sigmoid-groups"])
def test_dense_without_drops_equals_dropless(base):
    x = _x()
    bias = jnp.linspace(
        -0.05, 0.05, base.num_experts
    )  # a non-zero selection bias changes the routing
    ref = _run(dataclasses.replace(base, impl="ragged_dot"), x, bias=bias)
    for cfg in (
        dataclasses.replace(base, impl="dense", capacity_factor=NO_DROP),
        dataclasses.replace(base, impl="sluice"),
    ):
        y, stats, grads = _run(cfg, x, bias=bias)
        assert float(stats["dropped"]) == 0.0
        _close(y, ref[0], atol=2e-6)
        _close(grads, ref[2], atol=2e-6)
        _close(stats, ref[1], atol=1e-6)


def test_dense_drops_past_capacity():
    x = _x()
    cfg = dataclasses.replace(SOFTMAX, impl="dense", capacity_factor=1.0)
    y, stats, _ = _run(cfg, x)
    load = np.asarray(stats["load"])
    # Per sequence, each expert keeps at most `capacity` copies: the dropped fraction is at least
    # what the global load forces, and at most everything past capacity in every sequence.
    cap = capacity(16, cfg.top_k, cfg.num_experts, 1.0)
    assert cap == 4
    assert 0.0 < float(stats["dropped"]) < 1.0
    assert float(stats["dropped"]) >= np.maximum(load - 4 * cap, 0).sum() / load.sum()
    assert np.isfinite(np.asarray(y)).all()
    # More capacity drops less.
    _, stats2, _ = _run(dataclasses.replace(cfg, capacity_factor=2.0), x)
    assert float(stats2["dropped"]) < float(stats["dropped"])


PATHS = {
    "dense": {"impl": "dense", "capacity_factor": NO_DROP},
    "ragged_dot": {"impl": "ragged_dot"},
    "sluice-gmm+ragged_a2a": {"impl": "sluice", "use_sluice_dispatch": False},
    "sluice-gmm+ep": {"impl": "sluice", "use_sluice_dispatch": True},
}


@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4)])
@pytest.mark.parametrize("path", list(PATHS))
def test_expert_parallel_equals_single_device(path, dp, ep):
    x = _x()
    base = dataclasses.replace(SIGMOID, **PATHS[path])
    ref = _run(dataclasses.replace(base, impl="ragged_dot"), x)
    y, stats, grads = _run(base, x, mesh=_mesh(dp, ep))
    _close(y, ref[0], atol=2e-6)
    _close(grads, ref[2], atol=2e-6)
    np.testing.assert_array_equal(stats["load"], ref[1]["load"])


@pytest.mark.parametrize(
    "path,dp,ep",
    [(p, 2, 2) for p in ("dense", "ragged_dot", "sluice-gmm+ep")]
    + [(p, 4, 1) for p in ("dense", "ragged_dot")],  # sluice.ep needs an expert axis > 1
)
def test_fsdp_expert_weights_equal_single_device(path, dp, ep):
    """Expert weights split over the data axis too: the same values and gradients, and the
    gradients come back split the same way (reduce-scattered, not replicated)."""
    x = _x()
    base = dataclasses.replace(SIGMOID, **PATHS[path])
    ref = _run(dataclasses.replace(base, impl="ragged_dot"), x)
    mesh = _mesh(dp, ep)
    cfg = dataclasses.replace(base, fsdp=True)
    layer = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    wi_spec, wo_spec = moe.expert_weight_specs(cfg)
    assert wi_spec == jax.sharding.PartitionSpec("expert", "data", None)
    params["wi"][...] = jax.device_put(params["wi"][...], NamedSharding(mesh, wi_spec))
    params["wo"][...] = jax.device_put(params["wo"][...], NamedSharding(mesh, wo_spec))
    probe = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

    def f(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * probe), (y, stats)

    (_, (y, _)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    _close(y, ref[0], atol=2e-6)
    _close(grads, ref[2], atol=2e-6)
    g_wi = grads[0]["wi"][...]
    assert g_wi.sharding.is_equivalent_to(NamedSharding(mesh, wi_spec), g_wi.ndim)
    shard = g_wi.addressable_shards[0].data.shape
    assert shard == (cfg.num_experts // ep, cfg.d_model // dp, 2 * cfg.d_ff)


def test_fsdp_needs_d_model_divisible_by_the_data_axis():
    with pytest.raises(
        ValueError, match="fsdp: d_model=32 is not divisible by the data axis size 3"
    ):
        MoE(dataclasses.replace(SOFTMAX, fsdp=True), rngs=nnx.Rngs(0), mesh=_mesh(3, 1))


def test_expert_parallel_dense_drops_like_single_device():
    """Capacity is per sequence: sharding the batch over devices drops exactly the same copies."""
    x = _x()
    cfg = dataclasses.replace(SOFTMAX, impl="dense", capacity_factor=1.0)
    ref = _run(cfg, x)
    y, stats, grads = _run(cfg, x, mesh=_mesh(2, 2))
    _close(y, ref[0], atol=2e-6)
    _close(grads, ref[2], atol=2e-6)
    assert float(stats["dropped"]) == pytest.approx(float(ref[1]["dropped"]))


def test_sluice_equals_ragged_dot_bf16():
    x = _x(jnp.bfloat16)
    cfg = dataclasses.replace(SIGMOID, dtype=jnp.bfloat16)
    ref = _run(dataclasses.replace(cfg, impl="ragged_dot"), x)
    for mesh in (None, _mesh(2, 2)):
        y, _, grads = _run(dataclasses.replace(cfg, impl="sluice"), x, mesh=mesh)
        _close(y, ref[0], atol=3e-2, rtol=3e-2)
        _close(grads, ref[2], atol=5e-2, rtol=5e-2)


def test_sluice_path_keeps_no_expert_outputs():
    """The router weights act in the SwiGLU (moe._expert_block), so autodiff keeps one [copies,
    d_model] array, the experts' input for the weight gradient, and not also their outputs (which
    fan_in's weighted backward needed for the router weights' gradient).
    2F != d_model here, so no other residual has that shape."""
    cfg = dataclasses.replace(SIGMOID, impl="sluice", d_ff=8)
    x = _x()
    graphdef, params, rest = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    _, vjp_fn = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest)(x)[0], params, x)
    copies = x.shape[0] * x.shape[1] * cfg.top_k
    kept = [leaf.shape for leaf in jax.tree.leaves(vjp_fn) if leaf.shape == (copies, cfg.d_model)]
    assert len(kept) == 1, kept


def test_group_limited_routing_stays_in_groups():
    cfg = dataclasses.replace(SIGMOID, num_experts=16, num_groups=4, topk_groups=2, top_k=4)
    logits = jax.random.normal(jax.random.key(3), (64, 16))
    idx, weights, _ = route(cfg, logits, jnp.zeros(16))
    groups = np.asarray(idx) // 4
    assert max(len(set(row)) for row in groups) <= 2
    np.testing.assert_allclose(
        np.asarray(weights).sum(-1), 2.5, rtol=1e-5
    )  # normalised, then scaled


def test_top2_sum_is_top_k_sum():
    x = jax.random.normal(jax.random.key(5), (64, 8, 32))
    v = x[0, 0].max() + 1
    x = x.at[0, 0, 3].set(v).at[0, 0, 7].set(v)  # a tie for the largest: the sum is 2 v
    for t in (x, x[..., :1], x[..., :2]):
        np.testing.assert_array_equal(
            np.asarray(moe.top2_sum(t)),
            np.asarray(jax.lax.top_k(t, min(2, t.shape[-1]))[0].sum(-1)),
        )


def test_bias_update_balances_and_is_not_trained():
    cfg = dataclasses.replace(SIGMOID, bias_update_rate=0.1)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    assert not isinstance(layer.bias, nnx.Param)  # outside nnx.Param: no optimizer ever sees it
    load = jnp.array([10.0, 0, 0, 2, 4, 4, 4, 8])
    layer.update_bias(load)
    np.testing.assert_allclose(layer.bias[...], 0.1 * np.sign(4.0 - np.asarray(load)))


def test_sluice_dispatch_sets_up_one_communicator_or_says_what_to_do(monkeypatch):
    """The sluice path over an expert axis makes sluice.ep's communicator where none is set up for
    the mesh, and every later layer on that mesh uses it; use_sluice_dispatch=False never touches
    sluice.ep. A setup that fails is an error naming the alternative, never a silent fallback."""
    mesh = _mesh(1, 2)
    ep.teardown("expert")
    assert ep.communicator(mesh, "expert") is None
    cfg = dataclasses.replace(SOFTMAX, impl="sluice")
    assert MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh).sluice_dispatch
    comm = ep.communicator(mesh, "expert")
    assert comm is not None and comm.num_ranks == 2 and comm.transport == "shm"
    assert MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh).sluice_dispatch
    assert ep.communicator(mesh, "expert") is comm  # not made again
    layer = MoE(dataclasses.replace(cfg, use_sluice_dispatch=False), rngs=nnx.Rngs(0), mesh=mesh)
    assert not layer.sluice_dispatch and layer.describe().endswith("EP 2 over ragged_all_to_all")

    def broken(*args, **kw):
        raise RuntimeError(
            "sluice.ep.setup: the mesh holds GPUs but libsluice was built without CUDA"
        )

    ep.teardown("expert")
    monkeypatch.setattr(ep, "setup", broken)
    with pytest.raises(RuntimeError, match="without CUDA.*use_sluice_dispatch=False"):
        MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="impl"):
        dataclasses.replace(SOFTMAX, impl="fast")
    with pytest.raises(ValueError, match="divisible"):
        MoE(
            SOFTMAX,
            rngs=nnx.Rngs(0),
            mesh=_mesh(1, 3) if len(jax.devices()) >= 3 else pytest.skip(),
        )


def test_ep_rows_bound_is_the_worst_case_path_in_rounds():
    """sluice.ep path with ep_rows_factor (bounded rounds, the default) against ep_rows_factor=None
    (worst-case buffers): a bound the routing fits in changes nothing (values, gradients); a bound
    below the routing runs more rounds, drops nothing, gives the same values and input gradient bit
    for bit and the weights' gradients to rounding."""
    x = _x()
    base = dataclasses.replace(SIGMOID, impl="sluice", use_sluice_dispatch=True)
    mesh = _mesh(1, 4)
    ref = _run(dataclasses.replace(base, ep_rows_factor=None), x, mesh=mesh)
    assert float(ref[1]["ep"][0]) == 1.0
    # 16 tokens x k=3 per rank: mean 48 (row, slot) pairs, the worst-case block 64 x min(3, 2)
    y, stats, grads = _run(dataclasses.replace(base, ep_rows_factor=1.5), x, mesh=mesh)
    assert float(stats["dropped"]) == 0.0 and float(stats["ep"][0]) == 1.0
    np.testing.assert_array_equal(np.asarray(stats["ep"]), np.asarray(ref[1]["ep"]))
    _close(y, ref[0], atol=0.0)
    _close(grads, ref[2], atol=0.0)
    y, stats, grads = _run(dataclasses.replace(base, ep_rows_factor=0.3), x, mesh=mesh)
    assert float(stats["dropped"]) == 0.0 and float(stats["ep"][0]) > 1.0
    _close(y, ref[0], atol=0.0)
    _close(grads[1], ref[2][1], atol=0.0)  # d x
    _close(grads[0], ref[2][0], atol=1e-5, rtol=1e-4)  # the weights: summed per round
    with pytest.raises(ValueError, match="ep_rows_factor"):
        dataclasses.replace(base, ep_rows_factor=0.0)


def test_ep_num_sms_is_checked_before_it_reaches_the_communicator():
    """A bad ep_num_sms fails where the config is made, not later at the layer's sluice.ep.setup."""
    for bad in (0, 65, 2.5, "8"):
        with pytest.raises(ValueError, match="ep_num_sms"):
            dataclasses.replace(SIGMOID, impl="sluice", ep_num_sms=bad)
    assert dataclasses.replace(SIGMOID, impl="sluice", ep_num_sms=64).ep_num_sms == 64


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (shard_map, custom_vjp, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_ragged_all_to_all_results_vary_over_the_ranks():
    """The ragged_dot path's jax.lax.ragged_all_to_all (forward and transpose) yields values typed
    as varying over the expert axis. The op types its result like its output buffer alone: from a
    plain jnp.zeros buffer the received rows were typed invariant, autodiff summed their cotangents
    over the ranks, and the expert weights' and the input's gradients came out ~100% off on GPUs.
    XLA:CPU cannot run the op (the layer emulates it here), so this checks the traced program."""
    from functools import partial

    from jax.sharding import PartitionSpec as P

    cfg = dataclasses.replace(SOFTMAX, impl="ragged_dot", num_shared_experts=0)
    mesh = _mesh(1, 2)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    wi_spec, wo_spec = moe.expert_weight_specs(cfg, "data", "expert")
    tokens = P(("data", "expert"))
    block = partial(
        moe.moe_block, cfg, ep_axis="expert", reduce_axes=("data", "expert"), emulate_a2a=False
    )

    def loss(x, router, bias, wi, wo):
        y, _ = jax.shard_map(
            block,
            mesh=mesh,
            in_specs=(tokens, P(), P(), wi_spec, wo_spec),
            out_specs=(tokens, P()),
        )(x, router, bias, wi, wo)
        return jnp.sum(y.astype(jnp.float32))

    args = (_x(), layer.router[...], layer.bias[...], layer.wi[...], layer.wo[...])
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 3, 4)))(*args).jaxpr

    def varying(aval):
        m = getattr(aval, "manual_axis_type", None)
        return frozenset(getattr(m, "varying", ()) or ()) if m else frozenset(aval.vma)

    a2a = [e for e in _eqns(jaxpr) if e.primitive.name == "ragged_all_to_all"]
    assert len(a2a) == 4, [e.primitive.name for e in a2a]  # there and back, and their transposes
    for e in a2a:
        assert "expert" in varying(e.outvars[0].aval), e

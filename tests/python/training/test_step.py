"""The training step's pieces (sluice.training): compute-dtype weight copies, gradient
accumulation (with FP8 experts quantized once a step), remat, the state made in its shardings, and AdamW's moments in bfloat16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from flax import nnx
from helpers import tiny_config
from sluice.nn.model import Transformer
from sluice.ops.fp8 import Recipe
from sluice.training import step as step_mod
from sluice.training.optim import make_optimizer
from sluice.training.step import (
    compute_copies,
    init_state,
    is_expert_weight,
    make_mesh,
    make_steps,
    shardings_for,
)

TINY = tiny_config()


def test_weight_copies_change_nothing():
    """A training step given compute_copies (the bf16 matrices the optimizer's update makes for the
    next step) gives the same bits as one whose forward pass casts the parameters itself: every
    parameter the copies replace is one the model casts where it uses it. The step's own copies
    are those of its updated parameters; the router and the norms have none."""
    cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dtype=jnp.bfloat16))
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    opt, _ = make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    opt_state = opt.init(params)
    train_step, eval_step = (jax.jit(f) for f in make_steps(graphdef, opt, cfg))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 65)), jnp.int32)
    copies = compute_copies(params, cfg.dtype)
    plain = train_step(params, rest, opt_state, tokens, None)
    fast = train_step(params, rest, opt_state, tokens, copies)
    for a, b in zip(jax.tree.leaves(plain[:3]), jax.tree.leaves(fast[:3]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert float(plain[4]["loss"]) == float(fast[4]["loss"])
    for a, b in zip(jax.tree.leaves(compute_copies(fast[0], cfg.dtype)), jax.tree.leaves(fast[3])):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    named = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    with_copy = {
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(copies)
    }
    assert all("router" in k or "norm" in k for k in named - with_copy)
    assert any("router" in k for k in named - with_copy)
    assert float(eval_step(params, rest, tokens, None)) == float(
        eval_step(params, rest, tokens, copies)
    )


@pytest.mark.parametrize("impl", ["sluice", "dense"])
def test_grad_accum_is_one_step_on_the_batch(impl):
    """A step over N micro-batches updates as one step on the whole batch: the mean gradient, the
    batch's loss, its summed expert loads, the same validation loss (float sums in another order
    only; no load-balance loss, which each micro-batch computes on its own tokens, and no drops:
    the dense path's capacity is per micro-batch, so it is given room for every copy)."""
    moe = dataclasses.replace(TINY.moe, impl=impl, aux_loss_coef=0.0, capacity_factor=8.0)
    cfg = dataclasses.replace(TINY, moe=moe)
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    opt, _ = make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    opt_state = opt.init(params)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 33)), jnp.int32)
    outs = {}
    for n in (1, 2, 4):
        step, ev = (jax.jit(f) for f in make_steps(graphdef, opt, cfg, grad_accum=n))
        outs[n] = (step(params, rest, opt_state, tokens), ev(params, rest, tokens))
    (p1, r1, _, _, m1), v1 = outs[1]
    assert float(m1["dropped"]) == 0.0
    for n in (2, 4):
        (pn, rn, _, _, mn), vn = outs[n]
        for a, b in zip(jax.tree.leaves((p1, r1)), jax.tree.leaves((pn, rn)), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)
        np.testing.assert_array_equal(np.asarray(mn["load"]), np.asarray(m1["load"]))
        assert float(mn["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
        assert float(mn["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-4)
        assert float(mn["dropped"]) == 0.0
        assert float(vn) == pytest.approx(float(v1), rel=1e-5)


@pytest.mark.parametrize("ep", [1, 2], ids=["local", "ep2-sluice.ep"])
def test_fp8_experts_quantized_once_a_step(ep, monkeypatch):
    """With FP8 experts and several micro-batches, the step quantizes each routed expert weight once
    (fp8.prequantize, per shard of the expert axis) and every micro-batch's expert block uses that
    Fp8Weight: the same step, bit for bit, as one whose micro-batches quantize the weights
    themselves. Over sluice.ep the buffers are bounded tightly, so that every step runs several
    rounds (the weights' float0 gradients through bounded_moe's loop)."""
    if len(jax.devices()) < 2 * ep:
        pytest.skip(f"needs {2 * ep} devices")
    mesh = make_mesh(ep, 2 * ep) if ep > 1 else None
    moe = dataclasses.replace(TINY.moe, impl="sluice", ep_rows_factor=0.5)
    cfg = dataclasses.replace(TINY, moe=moe, dtype=jnp.bfloat16, fp8=Recipe())
    model = Transformer(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt, _ = make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    opt_state = opt.init(params)
    copies = compute_copies(params, cfg.dtype)
    sh = shardings_for(params, mesh, cfg.moe) if mesh is not None else None
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (8, 65)), jnp.int32)
    n_expert = sum(is_expert_weight(p, x) for p, x in jax.tree_util.tree_leaves_with_path(params))
    calls = []
    real = step_mod.prequantize
    monkeypatch.setattr(step_mod, "prequantize", lambda w, r: calls.append(1) or real(w, r))
    outs = []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(step_mod, "_prequantizes", lambda cfg, n: False)
        calls.clear()
        step = jax.jit(make_steps(graphdef, opt, cfg, grad_accum=2, grad_shardings=sh)[0])
        outs.append(step(params, rest, opt_state, tokens, copies))
        assert len(calls) == (n_expert if once else 0)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if ep > 1:
        assert float(outs[0][4]["ep"][0]) > 1  # rounds


@pytest.mark.parametrize("ep", [1, 2], ids=["local", "ep2-sluice.ep"])
def test_remat_recomputes_and_changes_nothing_else(ep):
    """--remat (jax.checkpoint around every block; over sluice.ep around the attention and the
    experts' local part (fan-out, SwiGLU, fan-in), not the communication): the same step
    (parameters, loss) from a backward pass that recomputes activations. (What it saves is measured
    on a GPU: the CPU compiler's temporary footprint of this tiny model says little, once smaller
    and once larger.)"""
    if len(jax.devices()) < 2 * ep:
        pytest.skip(f"needs {2 * ep} devices")
    mesh = make_mesh(ep, 2 * ep) if ep > 1 else None
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (8, 129)), jnp.int32)
    outs = []
    for remat in (False, True):
        # buffers of the mean (below every routing's worst case at EP 2): the rounds' structure
        moe = dataclasses.replace(TINY.moe, impl="sluice", ep_rows_factor=1.0)
        cfg = dataclasses.replace(TINY, moe=moe, remat=remat)
        model = Transformer(cfg, rngs=nnx.Rngs(0), mesh=mesh)
        assert [layer.replays() for layer in model.layers][1:] == [ep == 1] * 2
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt, _ = make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
        opt_state = opt.init(params)
        step = jax.jit(make_steps(graphdef, opt, cfg)[0])
        jaxpr = str(jax.make_jaxpr(step)(params, rest, opt_state, tokens))
        # one region a block; over sluice.ep (bounded rounds) four in each MoE block: the
        # attention, and the experts of round 0, of the forward's later rounds and of the
        # backward's recomputed ones. (The differentiated step holds them as jax's remat
        # primitive, "remat2" in jax 0.10.)
        regions = jaxpr.count("remat") + jaxpr.count("checkpoint[")
        assert regions == (0 if not remat else 3 if ep == 1 else 9)
        outs.append(step(params, rest, opt_state, tokens))
    for a, b in zip(jax.tree.leaves(outs[0][:2]), jax.tree.leaves(outs[1][:2]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    assert float(outs[1][4]["loss"]) == pytest.approx(float(outs[0][4]["loss"]), rel=1e-6)


def test_init_state_is_made_in_its_shardings():
    """init_state makes the state by one jit straight into its shardings: the routed experts'
    weights and their AdamW moments split over the expert axis, no other array left alive beside
    the state's own, and the same values as on one device (the init does not depend on the mesh)."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, impl="sluice"))
    opt, _ = make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    before = {id(x) for x in jax.live_arrays()}
    _, state, state_sh, _ = init_state(cfg, opt, make_mesh(2, 4), seed=3)
    leaves = jax.tree.leaves(state)
    assert {id(x) for x in jax.live_arrays()} - before <= {id(x) for x in leaves}
    e = cfg.moe.num_experts
    split = 0
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(state_sh)):
        assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
        if is_expert_weight(path, x):
            assert x.shape[0] == e and {sh.data.shape[0] for sh in x.addressable_shards} == {e // 2}
            split += 1
    assert split == 3 * 2 * (cfg.n_layers - cfg.n_dense_layers)  # wi, wo; param, mu, nu
    _, one, _, _ = init_state(cfg, opt, make_mesh(1, 1), seed=3)
    for a, b in zip(leaves, jax.tree.leaves(one), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adam_moments_in_bfloat16():
    """scale_by_adam_in: in float32 it is optax.scale_by_adam; in bfloat16 the moments are stored
    rounded and the updates stay within bf16's rounding of optax's."""
    import optax
    from sluice.training.optim import scale_by_adam_in

    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), "b": jnp.zeros(8)}
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        for _ in range(5)
    ]
    ref, f32, b16 = (
        optax.scale_by_adam(b2=0.95),
        scale_by_adam_in(jnp.float32, b2=0.95),
        (scale_by_adam_in(jnp.bfloat16, b2=0.95)),
    )
    sr, s32, s16 = ref.init(params), f32.init(params), b16.init(params)
    for g in grads:
        ur, sr = ref.update(g, sr)
        u32, s32 = f32.update(g, s32)
        u16, s16 = b16.update(g, s16)
        for a, b in zip(jax.tree.leaves(u32), jax.tree.leaves(ur)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(ur)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=3e-2, atol=3e-2)
    assert {x.dtype for x in jax.tree.leaves((s16.mu, s16.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert jax.tree.leaves(u16)[0].dtype == jnp.float32
    hp = {"warmup": 2, "steps": 10, "lr": 1e-3, "opt_state_dtype": "bfloat16"}
    opt, _ = make_optimizer(hp)
    st = opt.init(params)
    moments = [x for x in jax.tree.leaves(st) if getattr(x, "ndim", 0) >= 1]
    assert moments and all(x.dtype == jnp.bfloat16 for x in moments)

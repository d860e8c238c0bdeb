"""The decoder LM: the expert paths give the same model, the embedding's and the head's custom
gradients, the attention implementation, parameter counts and the presets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx
from helpers import tiny_config
from sluice.nn.model import PRESETS, Transformer
from sluice.nn.moe import MoEConfig
from sluice.training import data

TINY = tiny_config()


def _forward(cfg, tokens):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return jax.jit(lambda m, t: m(t))(model, tokens)


def test_expert_paths_give_the_same_model():
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
    ref, ref_aux = _forward(TINY, tokens)
    for moe in (
        dataclasses.replace(TINY.moe, impl="dense", capacity_factor=8.0),
        dataclasses.replace(TINY.moe, impl="sluice"),
    ):
        logits, aux = _forward(dataclasses.replace(TINY, moe=moe), tokens)
        np.testing.assert_allclose(logits, ref, atol=1e-4)
        np.testing.assert_array_equal(aux["load"], ref_aux["load"])
        assert aux["load"].shape == (2, 8) and float(aux["load"].sum()) == 2 * 2 * 32 * 2
        np.testing.assert_array_equal(aux["dropped"], 0.0)


def test_one_hot_embedding_is_the_lookup(monkeypatch):
    """The embedding's gradient as a one-hot GEMM (vocabularies up to ONE_HOT_MAX_VOCAB) is the
    lookup's own (a scatter-add), and the activations are the lookup's bit for bit in bf16."""
    from sluice.nn import model as model_mod

    cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)

    def run():
        m = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def loss(p):
            logits, _ = nnx.merge(graphdef, p, rest)(tokens)
            return jnp.square(logits.astype(jnp.float32)).mean(), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logits, grads["embed"][...]

    logits, g = run()
    monkeypatch.setattr(model_mod, "ONE_HOT_MAX_VOCAB", 0)
    ref_logits, ref_g = run()
    np.testing.assert_array_equal(
        np.asarray(logits, np.float32), np.asarray(ref_logits, np.float32)
    )
    np.testing.assert_allclose(g, ref_g, rtol=2e-2, atol=1e-6)
    assert np.abs(np.asarray(g)).sum() > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_logits_and_its_gradient(dtype):
    """head_logits: f32 logits of x @ w; its backward takes the logits' gradient in x's dtype (f32:
    autodiff's own, to f32 rounding; bf16: within bf16 rounding of the f32 product's gradients)."""
    from sluice.nn.model import head_logits

    kx, kw, kg = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
    x = jax.random.normal(kx, (2, 24, 64), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (64, 320), jnp.float32) / 8).astype(dtype)
    g = jax.random.normal(kg, (2, 24, 320), jnp.float32)

    def ref(x, w):
        return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)

    out, vjp = jax.vjp(head_logits, x, w)
    ref_out, ref_vjp = jax.vjp(ref, x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, ref_out)
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert np.linalg.norm(got - want) < 1e-2 * np.linalg.norm(want)


def test_attention_implementation_choice():
    from sluice.nn.model import attention_impl

    gpu = jax.default_backend() == "gpu"
    assert attention_impl(dataclasses.replace(TINY, dtype=jnp.bfloat16)) == (
        "cudnn" if gpu else None
    )
    assert attention_impl(TINY) is None  # f32: XLA's
    assert attention_impl(dataclasses.replace(TINY, attention="xla")) == "xla"


def test_parameter_counts():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    counted = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert counted == TINY.total_params()
    moe = TINY.moe
    inactive = (
        (TINY.n_layers - TINY.n_dense_layers)
        * (moe.num_experts - moe.top_k)
        * 3
        * TINY.d_model
        * moe.d_ff
    )
    assert TINY.active_params() == counted - TINY.vocab_size * TINY.d_model - inactive


def test_presets_are_consistent():
    for name, p in PRESETS.items():
        cfg = p["model"]
        assert isinstance(cfg.moe, MoEConfig) and cfg.moe.d_model == cfg.d_model, name
        assert cfg.vocab_size >= data.NUM_TOKENS, name
        assert p["batch_size"] % p["ep"] == 0 and cfg.moe.num_experts % p["ep"] == 0, name
    assert PRESETS["dsv3-proxy"]["model"].moe.num_experts == 256

"""The optimizer of sluice-train: AdamW after global-norm clipping, warm-up then cosine decay, with
its two moments in float32 or bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def scale_by_adam_in(dtype, b1=0.9, b2=0.999, eps=1e-8) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments kept in ``dtype`` (optax's mu_dtype covers only the
    first): each step reads them, updates them in float32, computes the update from the float32
    values and stores them rounded. The state is optax's ScaleByAdamState."""

    def init(params):
        zeros = lambda p: jnp.zeros(jnp.shape(p), dtype)
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(zeros, params),
            nu=jax.tree.map(zeros, params),
        )

    def update(updates, state, params=None):
        del params
        f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
        g = f32(updates)
        mu = jax.tree.map(lambda m, u: b1 * m + (1 - b1) * u, f32(state.mu), g)
        nu = jax.tree.map(lambda v, u: b2 * v + (1 - b2) * jnp.square(u), f32(state.nu), g)
        count = optax.safe_int32_increment(state.count)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        out = jax.tree.map(lambda o, u: o.astype(jnp.result_type(u)), out, updates)
        cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)
        return out, optax.ScaleByAdamState(count=count, mu=cast(mu), nu=cast(nu))

    return optax.GradientTransformation(init, update)


def make_optimizer(hp):
    """AdamW (b2 0.95, weight decay 0.1 on matrices) after global-norm clipping at 1, warm-up then
    cosine decay to a tenth; the moments in hp["opt_state_dtype"] (float32: optax.adamw itself).
    Returns the optimizer and its schedule."""
    warmup = max(1, min(hp["warmup"], hp["steps"] - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, hp["lr"], warmup, max(hp["steps"], warmup + 1), end_value=hp["lr"] * 0.1
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    state_dtype = jnp.dtype(hp.get("opt_state_dtype", "float32"))
    if state_dtype == jnp.float32:
        adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)
    else:  # optax.adamw's chain with the moments in state_dtype
        adamw = optax.chain(
            scale_by_adam_in(state_dtype, b1=0.9, b2=0.95),
            optax.add_decayed_weights(0.1, decay_mask),
            optax.scale_by_learning_rate(schedule),
        )
    return optax.chain(optax.clip_by_global_norm(1.0), adamw), schedule

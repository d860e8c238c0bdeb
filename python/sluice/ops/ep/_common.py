"""What the ep modules share: the float dtypes the ops take, their check, result types."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_float(op, name, a):
    if jnp.dtype(a.dtype) not in FLOATS:
        raise TypeError(
            f"sluice.ep.{op}: {name} must be float32, bfloat16 or float16, got {a.dtype}"
        )


def sds(shape, dtype, kw=None):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), **(kw or {}))

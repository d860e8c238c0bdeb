"""The model's linear layers, in the compute dtype or in FP8 by DeepSeek-V3's recipe.

``dense(x, w, contract, fp8=..., mesh=...)`` multiplies x's last ``contract`` dims with w's first
ones, ``jnp.tensordot(x, w, contract)``. With ``fp8`` (a ``sluice.fp8.Recipe``) it runs on sluice's
FP8 grouped GEMM with one group: x flattened to rows ``[T, K]``, w to ``[1, K, N]``,
``sluice.gmm(x2d, w2d, [T], fp8=recipe)`` and reshaped back. So the attention projections and the
dense and shared-expert FFNs quantize as the routed experts do: x and the output's gradient in 1x128
blocks along the contraction, w in 128x128 blocks, all three matmuls (forward, input gradient,
weight gradient) in e4m3 with f32 scales and f32 accumulation, the output in x's dtype. The master
weights passed in are never changed.

sluice.gmm is an XLA custom call, which XLA's partitioner would run on the whole batch on every
device: with a ``mesh``, the FP8 matmul runs per shard inside ``shard_map``, the rows split over
``batch_axes`` (default: every mesh axis, as the training step splits its batch) and w replicated;
the weight gradient is summed over the shards by shard_map's transpose.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..ops.gmm import gmm as sluice_gmm
from ..ops.gmm_fp8 import Recipe


def _fp8_tensordot(x, w, contract, recipe):
    """x [..., K...] @ w [K..., N...] as one FP8 group: sluice.gmm on [T, K] and [1, K, N]."""
    lead, n_shape = x.shape[: x.ndim - contract], w.shape[contract:]
    rows, k, n = math.prod(lead), math.prod(w.shape[:contract]), math.prod(n_shape)
    y = sluice_gmm(
        x.reshape(rows, k), w.reshape(1, k, n), jnp.full((1,), rows, jnp.int32), fp8=recipe
    )
    return y.reshape(*lead, *n_shape)


def dense(x, w, contract: int = 1, *, fp8: Recipe | None = None, mesh=None, batch_axes=None):
    """``jnp.tensordot(x, w, contract)``: x [B, ..., K...] times w [K..., N...] -> [B, ..., N...]
    in x's dtype. w: the master weights (any float dtype): cast to x's dtype for XLA's dot; the
    FP8 path quantizes them as they are, and their gradient comes out of sluice's kernel in their
    dtype (no cast of either). fp8: None, or a Recipe for sluice's FP8 GEMM (module docstring).
    mesh: where x's leading dim is split over ``batch_axes`` (default all of the mesh's axes) and w
    replicated; used by the FP8 path only."""
    if fp8 is None:
        return jnp.tensordot(x, w.astype(x.dtype), contract)
    f = partial(_fp8_tensordot, contract=contract, recipe=fp8)
    if mesh is None or mesh.size == 1:
        return f(x, w)
    rows = P(tuple(mesh.axis_names) if batch_axes is None else tuple(batch_axes))
    return jax.shard_map(f, mesh=mesh, in_specs=(rows, P()), out_specs=rows)(x, w)

"""Mixture-of-Experts layer (Flax NNX) with three interchangeable expert paths.

One set of parameters and one router; ``MoEConfig.impl`` picks how tokens reach their experts:

- ``dense``: a fixed capacity per expert per sequence, ``C = ceil(S*k/E * capacity_factor)``; tokens
  past an expert's capacity are dropped (first choices of every token take precedence over second
  choices, then by position). Static shapes: tokens are scattered into an ``[E, B*C, D]`` buffer and
  the experts run as one batched matmul. This is the capacity-factor path of MaxText's
  ``dense_matmul``, with index scatter/gather instead of one-hot dispatch einsums (same result, less
  memory).
- ``ragged_dot``: dropless. Token copies are sorted by expert (argsort), the experts run as
  ``jax.lax.ragged_dot`` and the results are unsorted. Expert parallelism with
  ``jax.lax.ragged_all_to_all`` and a worst-case receive buffer.
- ``sluice``: the dropless path on sluice's kernels: ``sluice.gmm`` for the expert matmuls
  (``use_sluice_gmm``), token copies put in expert order and summed back by sluice's counting-sort
  fan-out/fan-in (no argsort, no scatter-add in the backward), each copy's router weight applied in
  its SwiGLU (``sluice.swiglu``) so that nothing keeps the expert outputs for the weights' gradient,
  and ``sluice.ep.dispatch``/``combine`` for expert parallelism (``use_sluice_dispatch``; False
  takes the ``ragged_all_to_all`` exchange instead). With ``fp8`` (a ``sluice.fp8.Recipe``) every
  expert matmul, gate/up and down, forward and both gradients, on every exchange (one device,
  sluice.ep's bounded rounds or worst-case buffers, ragged_all_to_all), runs in FP8 by DeepSeek-V3's
  recipe: ``sluice.gmm(..., fp8=recipe)``; so does the shared expert (``nn.linear.dense``). Over
  sluice.ep the dispatched rows then travel in FP8 too (``fp8_dispatch``, on by default). The
  other two paths have no FP8 matmul and refuse ``fp8``.

Each path's expert computation is in experts.py; this module holds the config, the router, the
block that routes and calls them, and the modules.

Router (fp32 values; its matmul at XLA's default precision, which on Hopper runs on the tensor
cores: ~2e-4 relative): softmax top-k, or
DeepSeek-V3's sigmoid scores with a per-expert selection bias that no gradient trains;
``MoE.update_bias`` nudges it toward balance from the measured load after each step (aux-loss-free
balancing), optional group-limited routing and a routed scaling factor. An optional Switch-style
load-balance loss. SwiGLU experts in the compute dtype, weighted sums of expert outputs in fp32 (the
sluice path weights the activations and sums in fp32).

Every call returns ``(y, stats)`` with ``stats = {"load": f32[E] routed token copies per expert
(global), "dropped": f32 fraction of token copies dropped, "aux_loss": f32 load-balance loss (per
shard, averaged over shards), "ep": f32[3] over sluice.ep: the exchange's rounds, the most rows and
the most (row, slot) pairs one rank received (zeros on the other paths)}``.

Parallelism: give the layer a ``mesh`` with a data axis and an expert axis. The layer runs in
``shard_map``: tokens are split over both axes (the expert axis also splits the batch), expert
weights over the expert axis, everything else is replicated. With ``fsdp`` the routed experts'
weights (and so their gradients and optimizer moments) are also split over the data axis along
d_model (``expert_weight_specs``); each layer gathers its shard's experts in the compute dtype and
its backward reduce-scatters their gradients.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..ops.fp8 import Recipe
from ..ops.gmm_fp8 import as_recipe
from ..ops.vma import _varying
from .experts import (
    ExpertMatmul,
    capacity_path,
    dropless_local,
    dropless_ragged_a2a,
    dropless_sluice_ep,
    setup_sluice_ep,
)
from .linear import dense

IMPLS = ("dense", "ragged_dot", "sluice")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    d_model: int
    d_ff: int  # hidden size of one routed expert
    num_experts: int
    top_k: int
    num_shared_experts: int = 0  # shared experts are one SwiGLU of width num_shared_experts * d_ff
    router: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to one
    routed_scaling: float = 1.0
    num_groups: int = 1  # group-limited routing: experts split into groups,
    topk_groups: int = 1  # each token picks its experts from its best topk_groups groups
    bias_update_rate: float = 0.0  # aux-loss-free balancing step (DeepSeek-V3: 0.001); 0 = off
    aux_loss_coef: float = 0.0  # Switch-style load-balance loss; 0 = off
    impl: str = "ragged_dot"
    capacity_factor: float = 1.25  # dense only
    use_sluice_gmm: bool = True  # sluice only
    # sluice only, under expert parallelism: sluice.ep's dispatch/combine (True) or
    # jax.lax.ragged_all_to_all (False)
    use_sluice_dispatch: bool = True
    # sluice.ep only: F, the receive buffer and expert block of every rank hold F times the balanced
    # mean (tokens x top_k (row, slot) pairs) a round, sluice.ep.bounded_moe; a step whose routing
    # sends a rank more runs further rounds, nothing is dropped and the values are the worst-case
    # path's. None: the worst-case buffers (every token of every rank for up to min(k, E/R) of this
    # rank's experts), which grow with the rank count. 2.0: balanced routing (and the router's
    # aux-loss-free bias keeps it so) stays in one round with room for a busiest rank at twice the
    # mean.
    ep_rows_factor: float | None = 2.0
    # sluice.ep only: thread blocks of the exchange kernels (sluice.ep.setup's num_sms; None: its
    # default)
    ep_num_sms: int | None = None
    fsdp: bool = False  # also split the routed experts' weights over the data axis (along d_model)
    # the model recomputes its blocks in the backward pass (ModelConfig.remat); over sluice.ep, whose
    # communication jax.checkpoint cannot replay, the block recomputes its local part (fan-out, the
    # experts' SwiGLU, fan-in) and keeps only the received rows
    remat: bool = False
    # sluice path with use_sluice_gmm only: None (default) runs the expert matmuls in the compute
    # dtype; a sluice.fp8.Recipe (True: the default Recipe()) runs all three matmuls of each
    # expert projection and of the shared experts in FP8 (e4m3, 1x128 activation and 128x128
    # weight blocks with f32 scales: sluice.gmm's fp8); the weights, their gradients and the
    # router stay as they are
    fp8: Recipe | None = None
    # with fp8, over sluice.ep (its bounded rounds or worst-case buffers): dispatch sends the rows
    # as e4m3 with their 1x128 scales (about half the bytes; sluice.ep.dispatch's fp8) and combine
    # stays in the compute dtype, as DeepSeek-V3 trains. On by default: the gate/up matmul
    # quantizes these rows by the same recipe anyway, and for bf16 rows it makes the same e4m3
    # values and scales of the dequantized rows (a row's amax survives the round trip, so its
    # scale does), so the layer's values and gradients stay as they are but the gate/up weights',
    # which multiplies the dequantized rows instead of the original ones (DeepSeek-V3 keeps the
    # FP8 rows for it too). No effect without fp8, on one device or over ragged_all_to_all
    # (use_sluice_dispatch=False), which send rows in the compute dtype
    fp8_dispatch: bool = True
    dtype: Any = jnp.bfloat16  # compute dtype of the experts
    init_std: float = 0.02
    out_init_std: float = 0.02

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        object.__setattr__(self, "fp8", as_recipe(self.fp8, "MoEConfig"))
        if self.fp8 is not None and not (self.impl == "sluice" and self.use_sluice_gmm):
            raise ValueError(
                "fp8 runs the expert matmuls on sluice.gmm: it needs impl='sluice' with "
                f"use_sluice_gmm=True, got impl={self.impl!r}, use_sluice_gmm={self.use_sluice_gmm}"
            )
        if not isinstance(self.fp8_dispatch, bool):
            raise TypeError(f"fp8_dispatch must be a bool, got {self.fp8_dispatch!r}")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by num_groups={self.num_groups}"
            )
        if self.num_groups > 1 and self.top_k > self.topk_groups * (
            self.num_experts // self.num_groups
        ):
            raise ValueError("top_k exceeds the experts in topk_groups groups")
        if self.capacity_factor <= 0:
            raise ValueError("capacity_factor must be positive")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.ep_rows_factor is not None and not self.ep_rows_factor > 0:
            raise ValueError(f"ep_rows_factor must be positive or None, got {self.ep_rows_factor}")
        if self.ep_num_sms is not None and not (
            isinstance(self.ep_num_sms, int) and 1 <= self.ep_num_sms <= 64
        ):
            raise ValueError(
                f"ep_num_sms must be an int in [1, 64] or None, got {self.ep_num_sms!r}"
            )


# --------------------------------------------------------------------------------------------------
# Router


def top2_sum(x: jax.Array) -> jax.Array:
    """The sum of the two largest entries along the last axis (of the one, for a single entry):
    lax.top_k(x, 2)[0].sum(-1) by two reductions instead of a sort. (XLA:GPU sorts each row of a
    top_k over fewer than 1,024 entries: for dsv3-proxy's 262k groups of 32 experts 0.37 ms an MoE
    layer on an H200, ~3% of its training step; padding such rows to 1,024 to take XLA's own top-k
    kernel instead took 1.04 ms.)"""
    m1 = x.max(-1)
    if x.shape[-1] == 1:
        return m1
    first = jnp.argmax(x, axis=-1)
    rest = jnp.where(jnp.arange(x.shape[-1]) == first[..., None], -jnp.inf, x)
    return m1 + rest.max(-1)


def route(cfg: MoEConfig, logits: jax.Array, bias: jax.Array):
    """fp32 logits [T,E] -> (topk_idx int32 [T,k], topk_weights f32 [T,k], scores f32 [T,E]).

    The bias shifts which experts are selected, never the weights they get (DeepSeek-V3)."""
    scores = jax.nn.softmax(logits, axis=-1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
    sel = scores + jax.lax.stop_gradient(bias)
    if cfg.num_groups > 1:
        t, e = sel.shape
        per_group = e // cfg.num_groups
        grouped = sel.reshape(t, cfg.num_groups, per_group)
        # A group's score is the sum of its two best experts (DeepSeek-V3).
        group_score = top2_sum(grouped)
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_groups)
        group_mask = jax.nn.one_hot(top_groups, cfg.num_groups, dtype=jnp.bool_).any(axis=1)
        sel = jnp.where(jnp.repeat(group_mask, per_group, axis=1), sel, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(sel), cfg.top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob and cfg.top_k > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weights * cfg.routed_scaling, scores


def load_balance_loss(scores: jax.Array, idx: jax.Array, counts: jax.Array) -> jax.Array:
    """Switch Transformer's loss E * sum_e f_e * p_e (1.0 when balanced), on one shard's tokens;
    counts [E]: the copies of ``idx`` per expert."""
    probs = scores / scores.sum(-1, keepdims=True)
    frac = counts / idx.size
    return counts.shape[0] * jnp.sum(jax.lax.stop_gradient(frac) * probs.mean(0))


# --------------------------------------------------------------------------------------------------
def _pmax_varying(v, axes):
    """pmax of v over the mesh axes it varies over (over an axis it is invariant on, every shard
    holds the maximum already): jax 0.11's shard_map types refuse a pmax over an axis the value
    does not vary on, e.g. the worst-case exchange's peaks, a pmax over the expert axis already."""
    axes = tuple(a for a in (axes or ()) if a in _varying(v))
    return jax.lax.pmax(v, axes) if axes else v


# The block: route, run the experts, gather statistics. Runs per shard inside shard_map, or alone.


def moe_block(
    cfg: MoEConfig,
    x,
    router_w,
    bias,
    wi,
    wo,
    *,
    ep_axis=None,
    reduce_axes=(),
    emulate_a2a=False,
    sluice_dispatch=False,
    fsdp_axis=None,
):
    """x [B,S,D] (compute dtype) -> (y [B,S,D], stats); wi/wo hold this shard's experts, split along
    d_model over ``fsdp_axis`` when given (gathered here; the backward reduce-scatters)."""
    if fsdp_axis is not None:
        wi = jax.lax.all_gather(wi, fsdp_axis, axis=1, tiled=True)
        wo = jax.lax.all_gather(wo, fsdp_axis, axis=2, tiled=True)
    b, s, d = x.shape
    logits = jnp.dot(x.reshape(b * s, d).astype(jnp.float32), router_w)
    idx, weights, scores = route(cfg, logits, bias)

    def total(v):
        return jax.lax.psum(v, reduce_axes) if reduce_axes else v

    counts = None  # per-expert copies of this shard's tokens, where the path counts them anyway
    ep_info = jnp.zeros((3,), jnp.float32)  # sluice.ep: rounds, peak rows, peak pairs of a rank
    if cfg.impl == "dense":
        y, dropped = capacity_path(
            cfg, x, idx.reshape(b, s, -1), weights.reshape(b, s, -1), wi, wo, ep_axis
        )
        y = y.reshape(b * s, d)
    else:
        dropped = jnp.zeros((), jnp.float32)
        gmm = ExpertMatmul.of(cfg)
        xt = x.reshape(b * s, d)
        if ep_axis is None:
            y, counts = dropless_local(cfg, xt, idx, weights, wi, wo, gmm)
        elif sluice_dispatch:
            y, ep_info = dropless_sluice_ep(cfg, xt, idx, weights, wi, wo, gmm, ep_axis)
        else:
            y = dropless_ragged_a2a(cfg, xt, idx, weights, wi, wo, gmm, ep_axis, emulate_a2a)

    if counts is None:
        counts = jnp.bincount(idx.reshape(-1), length=cfg.num_experts)
    load = total(counts.astype(jnp.float32))
    stats = {
        "load": load,
        "dropped": total(dropped) / jnp.sum(load),
        "aux_loss": (
            total(load_balance_loss(scores, idx, counts)) / (total(jnp.ones((), jnp.float32)))
        ),
        # the most over the shards (rounds are the same on every rank of an expert group)
        "ep": _pmax_varying(ep_info, reduce_axes),
    }
    return y.reshape(b, s, d).astype(x.dtype), stats


# --------------------------------------------------------------------------------------------------
# Modules


class RouterBias(nnx.Variable):
    """Per-expert selection bias of aux-loss-free balancing: set by MoE.update_bias, never by a
    gradient."""


class SwiGLU(nnx.Module):
    """A dense SwiGLU FFN (the dense layers' and the shared experts'). ``fp8``, ``mesh`` and
    ``batch_axes``: its two projections in FP8 by a Recipe, per shard of x's leading dim over
    ``batch_axes`` of ``mesh`` (``nn.linear.dense``)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.bfloat16,
        init_std=0.02,
        out_init_std=0.02,
        fp8: Recipe | None = None,
        mesh=None,
        batch_axes=None,
    ):
        self.wi = nnx.Param(
            jax.random.normal(rngs.params(), (d_model, 2 * d_ff), jnp.float32) * init_std
        )
        self.wo = nnx.Param(
            jax.random.normal(rngs.params(), (d_ff, d_model), jnp.float32) * out_init_std
        )
        self.dtype = dtype
        self.fp8 = as_recipe(fp8, "SwiGLU")
        self.mesh = mesh
        self.batch_axes = batch_axes

    def __call__(self, x):
        mm = partial(dense, fp8=self.fp8, mesh=self.mesh, batch_axes=self.batch_axes)
        h = mm(x, self.wi[...])
        gate, up = jnp.split(h, 2, axis=-1)
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(self.dtype)
        return mm(act, self.wo[...])


def expert_weight_specs(cfg: MoEConfig, data_axis: str = "data", expert_axis: str = "expert"):
    """PartitionSpecs of the routed experts' wi [E, D, 2F] and wo [E, F, D]: experts over
    ``expert_axis``; with ``cfg.fsdp`` also d_model over ``data_axis``."""
    if cfg.fsdp:
        return P(expert_axis, data_axis, None), P(expert_axis, None, data_axis)
    return P(expert_axis), P(expert_axis)


class MoE(nnx.Module):
    """Routed SwiGLU experts plus optional shared experts. ``__call__(x [B,S,D]) -> (y, stats)``.

    mesh: a ``jax.sharding.Mesh`` with ``data_axis`` and ``expert_axis`` (either may have size 1),
    or None to run on whatever devices jit places the arrays. Expert weights must be sharded over
    ``expert_axis``."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs,
        mesh=None,
        data_axis: str = "data",
        expert_axis: str = "expert",
    ):
        e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
        self.cfg = cfg
        self.router = nnx.Param(
            jax.random.normal(rngs.params(), (d, e), jnp.float32) * cfg.init_std
        )
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.wi = nnx.Param(
            jax.random.normal(rngs.params(), (e, d, 2 * f), jnp.float32) * cfg.init_std
        )
        self.wo = nnx.Param(
            jax.random.normal(rngs.params(), (e, f, d), jnp.float32) * cfg.out_init_std
        )
        self.shared = (
            SwiGLU(
                d,
                cfg.num_shared_experts * f,
                rngs=rngs,
                dtype=cfg.dtype,
                init_std=cfg.init_std,
                out_init_std=cfg.out_init_std,
                fp8=cfg.fp8,
                mesh=mesh,
                batch_axes=(data_axis, expert_axis),
            )
            if cfg.num_shared_experts
            else None
        )
        self.mesh = mesh
        self.data_axis = data_axis
        self.expert_axis = expert_axis
        if mesh is not None and e % mesh.shape[expert_axis]:
            raise ValueError(
                f"num_experts={e} is not divisible by the expert axis size "
                f"{mesh.shape[expert_axis]}"
            )
        if mesh is not None and cfg.fsdp and d % mesh.shape[data_axis]:
            raise ValueError(
                f"fsdp: d_model={d} is not divisible by the data axis size {mesh.shape[data_axis]}"
            )
        self.sluice_dispatch = (
            mesh is not None
            and mesh.shape[expert_axis] > 1
            and setup_sluice_ep(cfg, mesh, expert_axis)
        )

    def __call__(self, x):
        cfg = self.cfg
        fsdp = self.mesh is not None and cfg.fsdp and self.mesh.shape[self.data_axis] > 1
        # sluice.gmm takes float32 master weights as they are and rounds them for the product
        # itself, so their gradient comes out of its weight-gradient kernel in float32 (no rounding
        # to the compute dtype, no separate cast: on dsv3-proxy at 2k tokens that cast was a
        # quarter of the layer's device time). The other paths, and FSDP's all-gather (half the
        # bytes in the compute dtype), take them cast. (sluice-train's step passes the layer the
        # optimizer's compute-dtype copies instead, training.step.compute_copies: then neither
        # cast happens here.)
        master = cfg.impl == "sluice" and cfg.use_sluice_gmm and not fsdp
        wi, wo = self.wi[...], self.wo[...]
        if not master:
            wi, wo = wi.astype(cfg.dtype), wo.astype(cfg.dtype)
        args = (x.astype(cfg.dtype), self.router[...], self.bias[...], wi, wo)
        if self.mesh is None:
            y, stats = moe_block(cfg, *args)
        else:
            ep = self.expert_axis if self.mesh.shape[self.expert_axis] > 1 else None
            axes = (self.data_axis, self.expert_axis)
            fn = partial(
                moe_block,
                cfg,
                ep_axis=ep,
                reduce_axes=axes,
                emulate_a2a=self.mesh.devices.flat[0].platform == "cpu",
                sluice_dispatch=self.sluice_dispatch,
                fsdp_axis=self.data_axis if fsdp else None,
            )
            tokens = P(axes)
            wi_spec, wo_spec = expert_weight_specs(cfg, self.data_axis, self.expert_axis)
            y, stats = jax.shard_map(
                fn,
                mesh=self.mesh,
                in_specs=(tokens, P(), P(), wi_spec, wo_spec),
                out_specs=(tokens, P()),
            )(*args)
        if self.shared is not None:
            y = y + self.shared(x.astype(cfg.dtype))
        return y, stats

    def describe(self) -> str:
        """The expert path in words, e.g. 'sluice: sluice.gmm, EP 2 over sluice.ep'."""
        cfg = self.cfg
        if cfg.impl == "dense":
            what = f"dense: capacity factor {cfg.capacity_factor:g}, drops"
        else:
            gmm = (
                "sluice.gmm"
                if cfg.impl == "sluice" and cfg.use_sluice_gmm
                else "jax.lax.ragged_dot"
            )
            if cfg.fp8 is not None:
                gmm += " in FP8" + (", power-of-two scales" if cfg.fp8.power_of_two_scales else "")
            what = f"{cfg.impl}: {gmm}, dropless"
        r = 1 if self.mesh is None else self.mesh.shape[self.expert_axis]
        if r > 1:
            how = (
                "all_to_all"
                if cfg.impl == "dense"
                else ("sluice.ep" if self.sluice_dispatch else "ragged_all_to_all")
            )
            what += f", EP {r} over {how}"
            if self.sluice_dispatch and cfg.fp8 is not None and cfg.fp8_dispatch:
                what += ", FP8 dispatch"
        return what

    def update_bias(self, load):
        """Aux-loss-free balancing: raise under-loaded experts' bias, lower over-loaded ones'."""
        rate = self.cfg.bias_update_rate
        if rate:
            self.bias[...] = self.bias[...] + rate * jnp.sign(jnp.mean(load) - load)

"""The pieces of a training step over a (data, expert) mesh: the mesh, the state's shardings (routed
experts split over the expert axis, and with fsdp over the data axis too), the state made straight
into them, the parameters' compute-dtype copies, and the train and eval step functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..nn.model import ModelConfig, Transformer
from ..nn.moe import expert_weight_specs
from ..ops.gmm_fp8 import Fp8Weight, prequantize

DATA_AXIS, EXPERT_AXIS = "data", "expert"
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def make_mesh(ep: int, num_devices: int | None) -> Mesh:
    devices = jax.devices()[: num_devices or None]
    if len(devices) % ep:
        raise ValueError(f"expert-parallel degree {ep} does not divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // ep, ep), (DATA_AXIS, EXPERT_AXIS))


def _path_keys(path) -> list:
    """A pytree path's dict keys and attribute names."""
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_expert_weight(path, leaf) -> bool:
    keys = _path_keys(path)
    return "ffn" in keys and any(k in ("wi", "wo") for k in keys) and getattr(leaf, "ndim", 0) == 3


def shardings_for(tree, mesh: Mesh, moe_cfg=None):
    """Routed-expert weights (and their optimizer moments) split over the expert axis (and, with
    ``moe_cfg.fsdp``, along d_model over the data axis); the rest replicated."""
    fsdp = moe_cfg is not None and moe_cfg.fsdp
    wi_spec, wo_spec = (
        expert_weight_specs(moe_cfg, DATA_AXIS, EXPERT_AXIS) if fsdp else (None, None)
    )

    def spec(path, leaf):
        if not is_expert_weight(path, leaf):
            return P()
        if not fsdp:
            return P(EXPERT_AXIS)
        return wi_spec if "wi" in _path_keys(path) else wo_spec

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec(path, leaf)), tree
    )


def _cast_where_used(path, leaf) -> bool:
    """The parameters the model casts to its compute dtype where it multiplies them: every matrix
    but the router's (which stays float32, with the norms)."""
    return getattr(leaf, "ndim", 0) >= 2 and "router" not in _path_keys(path)


def compute_copies(params, dtype):
    """The parameters the model casts where it uses them (_cast_where_used), as copies in `dtype`;
    None for the others. The training step takes these in place of those parameters, so the forward
    pass's casts do nothing, and makes the next step's copies from the parameters it has just
    updated, where XLA fuses the cast into the optimizer's element-wise update: a 2-byte write per
    parameter instead of a separate pass that reads 4 bytes and writes 2 in every step. The
    arithmetic is the same: the same bf16 values multiplied, the same gradients."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.astype(dtype) if _cast_where_used(path, p) else None, params
    )


def _with_copies(params, copies):
    if copies is None:
        return params
    return jax.tree.map(lambda p, c: p if c is None else c, params, copies)


def _prequantizes(cfg: ModelConfig, grad_accum: int) -> bool:
    """Whether the step quantizes the routed experts' FP8 weights once for all its micro-batches:
    with several micro-batches, sluice's FP8 expert block (sluice.ep's fanned paths, which take an
    fp8.Fp8Weight) and the experts split only over the expert axis (without FSDP's all-gather)."""
    moe = cfg.moe  # (ModelConfig.fp8 sets every MoE layer's)
    return (
        grad_accum > 1
        and cfg.fp8 is not None
        and moe.impl == "sluice"
        and moe.use_sluice_gmm
        and moe.use_sluice_dispatch
        and not moe.fsdp
    )


def prequantized_copies(copies, recipe, shardings=None):
    """copies with each routed expert weight as an fp8.Fp8Weight (fp8.prequantize), quantized per
    shard of its sharding's mesh (shardings: the parameters' NamedShardings, or None on one
    device), so that no device gathers another's experts."""

    def one(path, c, sh=None):
        if c is None or not is_expert_weight(path, c):
            return c
        if sh is None or not isinstance(sh, NamedSharding):
            return prequantize(c, recipe)
        fn = lambda w: prequantize(w, recipe)
        return jax.shard_map(fn, mesh=sh.mesh, in_specs=sh.spec, out_specs=sh.spec)(c)

    if shardings is None:
        return jax.tree_util.tree_map_with_path(one, copies)
    return jax.tree_util.tree_map_with_path(one, copies, shardings, is_leaf=lambda c: c is None)


def make_steps(
    graphdef, opt, cfg: ModelConfig, grad_accum: int = 1, micro_sharding=None, grad_shardings=None
):
    """train_step(params, rest, opt_state, tokens, copies) -> (params, rest, opt_state, copies,
    metrics) and eval_step(params, rest, tokens, copies) -> loss; copies: compute_copies(params,
    cfg.dtype), or None (the forward pass casts the parameters itself).

    With ``grad_accum`` N > 1 both take the batch as N micro-batches (rows i, i + N, i + 2N, ... form
    micro-batch i, so each device splits its own rows and no token moves), one after the other in a
    scan (sluice's FP8 experts quantize their weights once for all of them: prequantized_copies):
    the step sums their gradients in float32 and updates once with the mean, as one step on
    the whole batch would, up to the order of the float sums and the load-balance loss, which each
    micro-batch computes on its own tokens. The metrics are the batch's: loss, aux loss and dropped
    fraction averaged over the micro-batches, the expert loads summed, the exchange's rounds and peak
    rows the most of any. ``micro_sharding`` places the
    [N, B/N, ...] micro-batches, ``grad_shardings`` the summed gradients (the parameters'
    shardings); both optional."""

    def loss_fn(params, rest, tokens):
        logits, aux = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce + cfg.moe.aux_loss_coef * aux["aux_loss"], (ce, aux)

    def micro_batches(tokens):
        """[B, ...] -> [N, B/N, ...]: micro-batch i is rows i, i + N, ..."""
        b = tokens.shape[0]
        mb = tokens.reshape(b // grad_accum, grad_accum, *tokens.shape[1:]).swapaxes(0, 1)
        if micro_sharding is not None:
            mb = jax.lax.with_sharding_constraint(mb, micro_sharding)
        return mb

    def grads_on(params, rest, tokens, copies):
        # (allow_int: an Fp8Weight's quantized layouts are integer bit patterns, float0 gradients)
        (_, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True, allow_int=True)(
            _with_copies(params, copies), rest, tokens
        )
        # an Fp8Weight's gradient is its value's
        is_fp8 = lambda g: isinstance(g, Fp8Weight)
        grads = jax.tree.map(lambda g: g.value if is_fp8(g) else g, grads, is_leaf=is_fp8)
        # (the gradient of a copy is the parameter's: what the cast's transpose would give)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return grads, ce, aux

    def accumulated(params, rest, tokens, copies):
        """grads_on over the micro-batches: the mean gradient, the batch's metrics. The first
        micro-batch's gradients start the sum (rather than zeros that the first add reads): one
        pass over the float32 gradients less a step, and no zeroing pass, at the price of tracing
        the model twice (the first micro-batch, then the scan's body)."""
        mbs = micro_batches(tokens)
        if copies is not None and _prequantizes(cfg, grad_accum):
            copies = prequantized_copies(copies, cfg.fp8, grad_shardings)
        first = grads_on(params, rest, mbs[0], copies)
        if grad_shardings is not None:
            first = (jax.lax.with_sharding_constraint(first[0], grad_shardings), *first[1:])

        def body(total, mb):
            new = grads_on(params, rest, mb, copies)
            summed = jax.tree.map(jnp.add, total, new)
            # the exchange's rounds and peaks: the most of any micro-batch
            summed[2]["ep"] = jnp.maximum(total[2]["ep"], new[2]["ep"])
            return summed, None

        (grads, ce, aux), _ = jax.lax.scan(body, first, mbs[1:])
        mean = lambda x: x / grad_accum
        aux = {
            "aux_loss": mean(aux["aux_loss"]),
            "dropped": mean(aux["dropped"]),
            "load": aux["load"],
            "ep": aux["ep"],
        }
        return jax.tree.map(mean, grads), mean(ce), aux

    def train_step(params, rest, opt_state, tokens, copies=None):
        if grad_accum == 1:
            grads, ce, aux = grads_on(params, rest, tokens, copies)
        else:
            grads, ce, aux = accumulated(params, rest, tokens, copies)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if copies is not None:  # the next step's, fused with the update
            copies = compute_copies(params, cfg.dtype)
        model = nnx.merge(graphdef, params, rest)
        model.update_router_bias(aux["load"])  # aux-loss-free balancing, outside the gradient
        _, _, rest = nnx.split(model, nnx.Param, ...)
        metrics = {
            "loss": ce,
            "aux_loss": aux["aux_loss"],
            "grad_norm": _global_norm(grads),
            "dropped": jnp.mean(aux["dropped"]),
            "load": aux["load"],
            # sluice.ep: the most rounds, rows and (row, slot) pairs of a rank in any MoE layer
            "ep": jnp.max(aux["ep"], axis=0),
        }
        return params, rest, opt_state, copies, metrics

    def eval_step(params, rest, tokens, copies=None):
        params = _with_copies(params, copies)
        if grad_accum == 1:
            return loss_fn(params, rest, tokens)[1][0]
        losses = jax.lax.map(lambda mb: loss_fn(params, rest, mb)[1][0], micro_batches(tokens))
        return jnp.mean(losses)

    return train_step, eval_step


def init_state(cfg: ModelConfig, opt, mesh: Mesh, seed: int):
    """The model's and optimizer's initial state, made by one jit straight into its shardings (the
    routed experts' over the mesh, shardings_for): no device holds the whole model or its moments at
    any time (an eager init would put them all on the first device). Returns (graphdef, state
    {"params", "rest", "opt_state"}, its shardings, the MoE path's description)."""

    def init():
        model = Transformer(cfg, rngs=nnx.Rngs(seed), mesh=mesh)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return {"params": params, "rest": rest, "opt_state": opt.init(params)}

    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), mesh=mesh))
    moe_path = model.moe_layers()[0].describe() if model.moe_layers() else "no MoE layer"
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    abstract = {"params": params, "rest": rest, "opt_state": jax.eval_shape(opt.init, params)}
    state_sh = shardings_for(abstract, mesh, cfg.moe)
    return graphdef, jax.jit(init, out_shardings=state_sh)(), state_sh, moe_path

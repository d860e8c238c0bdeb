"""sluice-train: train sluice.model's MoE decoder LM on real text with one of three expert paths.

    sluice-train --preset tiny --moe-impl sluice --steps 300 --out runs/tiny-sluice

Data and expert parallelism over every visible device (``--ep N`` experts split over N devices, the
batch over all of them). Every ``--log-every`` steps one JSON line in ``OUT/metrics.jsonl``: loss,
tokens/s per device (TGS), MFU (model FLOPs: 6 x active parameters x tokens + causal attention, over
the device's dense bf16 peak; 'n/a' where the peak is unknown, e.g. CPUs), dropped-token fraction,
per-expert load and its spread, peak device memory; validation loss every ``--eval-every`` steps
(per token, and in bits per byte of text: comparable across tokenizers); an orbax checkpoint every
``--ckpt-every`` steps (``--resume`` continues from the latest). Batches depend only on (seed, step),
so a resumed run trains on the same data as an uninterrupted one. A token file of BPE tokens
(``sluice-prepare-data --tokenizer bpe``) sets the model's vocabulary (rounded up to 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sluice.data import TokenData
from sluice.model import PRESETS, ModelConfig, Transformer
from sluice.moe import IMPLS, expert_weight_specs
from sluice.profile import summarize as profile_summary

DATA_AXIS, EXPERT_AXIS = "data", "expert"
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12}


def peak_flops(device) -> float | None:
    """Dense bf16 peak of one device, or None where unknown (CPUs: MFU is reported as 'n/a')."""
    if device.platform == "cpu":
        return None
    for name, peak in BF16_PEAK.items():
        if name in device.device_kind:
            return peak
    return None


def peak_memory_bytes(devices) -> int | None:
    peaks = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="sluice-train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument(
        "--moe-impl",
        default="sluice",
        choices=IMPLS,
        help="sluice: dropless on sluice's kernels (default); ragged_dot: dropless on "
        "jax.lax.ragged_dot; dense: capacity factor, drops",
    )
    p.add_argument("--capacity-factor", type=float, default=1.25, help="dense path only")
    p.add_argument(
        "--ep-rows-factor",
        type=float,
        help="sluice path over sluice.ep: bound the expert block's rows per rank to this multiple "
        "of the balanced mean (default: the worst case, which grows with --ep); a step that would "
        "drop a copy past the bound stops the run",
    )
    p.add_argument(
        "--ep-sms",
        type=int,
        help="sluice path over sluice.ep: thread blocks (SMs) of its exchange kernels, 1-64 "
        "(default: sluice.ep.setup's 64)",
    )
    p.add_argument(
        "--interleave",
        type=int,
        default=1,
        metavar="N",
        help="split each device's sequences into N parts that go through the layers side by side "
        "(with --ep-stream: work XLA may overlap with one part's exchange)",
    )
    p.add_argument(
        "--ep-stream",
        type=int,
        help="sluice path over sluice.ep: run its exchange on XLA GPU compute stream N (1-8), so "
        "XLA may overlap it with independent work (default: the main stream)",
    )
    p.add_argument(
        "--sluice-dispatch",
        choices=("auto", "on", "off"),
        default="auto",
        help="sluice path under --ep: sluice.ep dispatch/combine (auto: when built) or "
        "ragged_all_to_all",
    )
    p.add_argument(
        "--no-sluice-gmm", action="store_true", help="sluice path with jax.lax.ragged_dot matmuls"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="total steps (default: the preset's)")
    p.add_argument(
        "--batch-size", type=int, help="global batch in sequences (default: the preset's)"
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="split each step's batch into N micro-batches whose gradients are summed (in float32) "
        "before one optimizer update: the batch of N times the memory, and the update's cost "
        "spread over N times the tokens",
    )
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: the preset's)")
    p.add_argument("--ep", type=int, help="expert-parallel degree (default: the preset's)")
    p.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="also split the routed experts' weights and optimizer state over the data axis",
    )
    p.add_argument(
        "--opt-state-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of AdamW's two moments (bfloat16, as DeepSeek-V3 trains: a third less optimizer "
        "traffic; the update is computed in float32)",
    )
    p.add_argument(
        "--weight-copies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the weights the model multiplies in bf16 as bf16 copies, made by the optimizer's "
        "update (fused with it) instead of cast in every forward pass; the same arithmetic. "
        "--no-weight-copies: cast them where they are used",
    )
    p.add_argument("--n-layers", type=int, help="override the preset's layer count")
    p.add_argument(
        "--bias-update-rate",
        type=float,
        help="aux-loss-free balancing: the router bias's step per training step, 0 = off (default: "
        "the preset's)",
    )
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        help="weight of the Switch-style load-balance loss, 0 = off (default: the preset's)",
    )
    p.add_argument(
        "--shared-experts",
        dest="num_shared_experts",
        type=int,
        help="shared experts (one SwiGLU of this many times d_ff every token passes), 0 = none "
        "(default: the preset's)",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="recompute each block's activations in the backward pass (jax.checkpoint per block): "
        "less memory, one more forward pass",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "xla", "cudnn"),
        default="auto",
        help="jax.nn.dot_product_attention's implementation (auto: cuDNN's fused kernel on a GPU "
        "for 16-bit activations, else XLA's)",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, help="default: --eval-every; 0 = only at the end")
    p.add_argument("--no-ckpt", action="store_true", help="write no checkpoint")
    p.add_argument("--out", help="run directory (default: runs/PRESET-IMPL[-cfX]-sSEED)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --out"
    )
    p.add_argument(
        "--data", help="token file from sluice-prepare-data (default: read the installed docs)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="trace the N steps after the compiling one (or from --profile-from) with "
        "jax.profiler into RUN_DIR/profile and write where their device time went to "
        "RUN_DIR/profile/summary.txt (sluice-profile); those steps are left out of the logged TGS "
        "and MFU",
    )
    p.add_argument(
        "--profile-from",
        type=int,
        default=0,
        metavar="STEP",
        help="with --profile: trace from this step on (e.g. once the router is balanced)",
    )
    return p.parse_args(argv)


def run_name(a) -> str:
    impl = a.moe_impl + (f"-cf{a.capacity_factor:g}" if a.moe_impl == "dense" else "")
    return f"{a.preset}-{impl}-s{a.seed}"


def build_config(a) -> tuple[ModelConfig, dict]:
    preset = PRESETS[a.preset]
    cfg: ModelConfig = preset["model"]
    dispatch = {"auto": None, "on": True, "off": False}[a.sluice_dispatch]
    moe = dataclasses.replace(
        cfg.moe,
        impl=a.moe_impl,
        capacity_factor=a.capacity_factor,
        use_sluice_gmm=not a.no_sluice_gmm,
        use_sluice_dispatch=dispatch,
        fsdp=a.fsdp,
        ep_rows_factor=a.ep_rows_factor,
        ep_num_sms=a.ep_sms,
        ep_stream=a.ep_stream,
    )
    for k in ("bias_update_rate", "aux_loss_coef", "num_shared_experts"):
        if getattr(a, k) is not None:
            moe = dataclasses.replace(moe, **{k: getattr(a, k)})
    cfg = dataclasses.replace(
        cfg, moe=moe, attention=a.attention, remat=a.remat, interleave=a.interleave
    )
    if a.n_layers:
        cfg = dataclasses.replace(
            cfg, n_layers=a.n_layers, n_dense_layers=min(cfg.n_dense_layers, a.n_layers - 1)
        )
    hp = {
        k: getattr(a, k) if getattr(a, k) is not None else preset[k]
        for k in ("steps", "batch_size", "seq_len", "lr", "warmup", "ep")
    }
    hp["opt_state_dtype"] = a.opt_state_dtype
    return cfg, hp


def make_mesh(ep: int, num_devices: int | None) -> Mesh:
    devices = jax.devices()[: num_devices or None]
    if len(devices) % ep:
        raise SystemExit(f"--ep {ep} does not divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // ep, ep), (DATA_AXIS, EXPERT_AXIS))


def _path_keys(path) -> list:
    """A pytree path's dict keys and attribute names."""
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def _is_expert_weight(path, leaf) -> bool:
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
        if not _is_expert_weight(path, leaf):
            return P()
        if not fsdp:
            return P(EXPERT_AXIS)
        return wi_spec if "wi" in _path_keys(path) else wo_spec

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec(path, leaf)), tree
    )


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


def make_steps(
    graphdef, opt, cfg: ModelConfig, grad_accum: int = 1, micro_sharding=None, grad_shardings=None
):
    """train_step(params, rest, opt_state, tokens, copies) -> (params, rest, opt_state, copies,
    metrics) and eval_step(params, rest, tokens, copies) -> loss; copies: compute_copies(params,
    cfg.dtype), or None (the forward pass casts the parameters itself).

    With ``grad_accum`` N > 1 both take the batch as N micro-batches (rows i, i + N, i + 2N, ... form
    micro-batch i, so each device splits its own rows and no token moves), one after the other in a
    scan: the step sums their gradients in float32 and updates once with the mean, as one step on
    the whole batch would, up to the order of the float sums and the load-balance loss, which each
    micro-batch computes on its own tokens. The metrics are the batch's: loss, aux loss and dropped
    fraction averaged over the micro-batches, the expert loads summed. ``micro_sharding`` places the
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
        (_, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            _with_copies(params, copies), rest, tokens
        )
        # (the gradient of a copy is the parameter's: what the cast's transpose would give)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return grads, ce, aux

    def accumulated(params, rest, tokens, copies):
        """grads_on over the micro-batches: the mean gradient, the batch's metrics."""
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype),
            jax.eval_shape(grads_on, params, rest, tokens[: tokens.shape[0] // grad_accum], copies),
        )
        if grad_shardings is not None:
            zeros = (jax.lax.with_sharding_constraint(zeros[0], grad_shardings), *zeros[1:])

        def body(total, mb):
            return jax.tree.map(jnp.add, total, grads_on(params, rest, mb, copies)), None

        (grads, ce, aux), _ = jax.lax.scan(body, zeros, micro_batches(tokens))
        mean = lambda x: x / grad_accum
        aux = {
            "aux_loss": mean(aux["aux_loss"]),
            "dropped": mean(aux["dropped"]),
            "load": aux["load"],
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
        }
        return params, rest, opt_state, copies, metrics

    def eval_step(params, rest, tokens, copies=None):
        params = _with_copies(params, copies)
        if grad_accum == 1:
            return loss_fn(params, rest, tokens)[1][0]
        losses = jax.lax.map(lambda mb: loss_fn(params, rest, mb)[1][0], micro_batches(tokens))
        return jnp.mean(losses)

    return train_step, eval_step


def load_stats(load: np.ndarray) -> dict:
    """load [L_moe, E] token copies per expert -> its spread: max/mean (1 = balanced) and the
    coefficient of variation."""
    mean = load.mean(axis=1, keepdims=True)
    return {
        "load_max_over_mean": float((load.max(axis=1, keepdims=True) / mean).max()),
        "load_cv": float((load.std(axis=1, keepdims=True) / mean).mean()),
    }


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


def main(argv=None) -> int:
    """The `sluice-train` console script: trains, prints a summary line, exits 0."""
    run(argv)
    return 0


def run(argv=None) -> dict:
    """Trains as `sluice-train` would with these arguments; returns the run's summary."""
    a = parse_args(argv)
    cfg, hp = build_config(a)
    out = os.path.abspath(a.out or os.path.join("runs", run_name(a)))
    os.makedirs(out, exist_ok=True)
    mesh = make_mesh(hp["ep"], a.devices)
    devices = list(mesh.devices.flat)
    n_dev = len(devices)
    accum = a.grad_accum
    if accum < 1:
        raise SystemExit(f"--grad-accum {accum}: expected a positive number of micro-batches")
    if hp["batch_size"] % (n_dev * accum):
        raise SystemExit(
            f"--batch-size {hp['batch_size']} is not divisible by the {n_dev} devices"
            + (f" times --grad-accum {accum}" if accum > 1 else "")
        )
    data = TokenData.load(a.data)
    if data.vocab_size > cfg.vocab_size:  # a BPE token file: the model's vocabulary from it
        cfg = dataclasses.replace(cfg, vocab_size=-(-data.vocab_size // 64) * 64)
    bsz, seq = hp["batch_size"], hp["seq_len"]
    val = []
    if a.eval_every:
        # as many of --eval-batches as the validation stream holds (a large batch can outgrow it)
        fit = len(data.val) // (bsz * (seq + 1))
        if 0 < fit < a.eval_batches:
            print(
                f"sluice-train: evaluating on {fit} batches, all the validation stream holds",
                file=sys.stderr,
            )
        val = data.val_batches(min(a.eval_batches, max(fit, 1)), bsz, seq)
        # val_bpb = val_loss / this: bits per byte of text, comparable across tokenizers
        ln2_bytes_per_token = math.log(2) * data.bytes_per_token([b[:, 1:] for b in val])

    opt, schedule = make_optimizer(hp)
    graphdef, state, state_sh, moe_path = init_state(cfg, opt, mesh, a.seed)
    batch_sh = NamedSharding(mesh, P((DATA_AXIS, EXPERT_AXIS)))

    train_step, eval_step = make_steps(
        graphdef,
        opt,
        cfg,
        grad_accum=accum,
        micro_sharding=NamedSharding(mesh, P(None, (DATA_AXIS, EXPERT_AXIS))),
        grad_shardings=state_sh["params"],
    )
    sh = (state_sh["params"], state_sh["rest"], state_sh["opt_state"])
    use_copies = a.weight_copies and jnp.dtype(cfg.dtype) != jnp.float32
    copies_sh = None
    if use_copies:  # the copies split as their parameters are
        copies_sh = shardings_for(
            jax.eval_shape(lambda p: compute_copies(p, cfg.dtype), state["params"]), mesh, cfg.moe
        )
        make_copies = jax.jit(
            lambda p: compute_copies(p, cfg.dtype),
            in_shardings=(state_sh["params"],),
            out_shardings=copies_sh,
        )
    train_step = jax.jit(
        train_step,
        in_shardings=(*sh, batch_sh, copies_sh),
        out_shardings=(*sh, copies_sh, None),
        donate_argnums=(0, 1, 2, 4),
    )
    eval_step = jax.jit(eval_step, in_shardings=(sh[0], sh[1], batch_sh, copies_sh))

    ckpt = None
    if not a.no_ckpt:
        import orbax.checkpoint as ocp

        ckpt = ocp.CheckpointManager(
            os.path.join(out, "ckpt"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2, create=True, enable_async_checkpointing=False
            ),
        )
    start, train_time = 0, 0.0
    metrics_path = os.path.join(out, "metrics.jsonl")
    if a.resume:
        if ckpt is None or ckpt.latest_step() is None:
            raise SystemExit(f"--resume: no checkpoint under {out}/ckpt")
        import orbax.checkpoint as ocp

        start = ckpt.latest_step()
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_sh
        )
        state = ckpt.restore(start, args=ocp.args.StandardRestore(abstract))
        train_time = _last_train_time(metrics_path, start)
        _truncate_metrics(metrics_path, start)
        print(f"resumed from step {start} of {out}/ckpt", file=sys.stderr)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)

    peak = peak_flops(devices[0])
    flops_tok = cfg.flops_per_token(seq)
    info = {
        "args": vars(a),
        "hp": hp,
        "model": _jsonable(dataclasses.asdict(cfg)),
        "active_params": cfg.active_params(),
        "total_params": cfg.total_params(),
        "flops_per_token": flops_tok,
        "devices": n_dev,
        "device_kind": devices[0].device_kind,
        "mesh": dict(mesh.shape),
        "moe_path": moe_path,
        "jax": jax.__version__,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(
        f"{run_name(a)}: {cfg.total_params() / 1e6:.1f}M params "
        f"({cfg.active_params() / 1e6:.1f}M active), "
        f"{n_dev} x {devices[0].device_kind}, mesh {dict(mesh.shape)}, {bsz}x{seq} tokens/step"
        + (f" in {accum} micro-batches" if accum > 1 else "")
        + f", MoE {moe_path} -> {out}",
        file=sys.stderr,
    )

    log = open(metrics_path, "a")  # noqa: SIM115 (open for the whole loop, closed at its end)

    def emit(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    def evaluate(step):
        losses = [
            eval_step(state["params"], state["rest"], jax.device_put(b, batch_sh), copies)
            for b in val
        ]
        v = float(np.mean(jax.device_get(losses)))
        bpb = v / ln2_bytes_per_token
        emit(
            {"kind": "eval", "step": step, "val_loss": v, "val_bpb": bpb, "train_time": train_time}
        )
        return v

    # the parameters' compute-dtype copies: made from the state here, by each step after
    copies = make_copies(state["params"]) if use_copies else None

    def step_once(step):
        nonlocal state, copies
        tokens = jax.device_put(data.batch(step, bsz, seq, a.seed), batch_sh)
        p, r, o, copies, m = train_step(
            state["params"], state["rest"], state["opt_state"], tokens, copies
        )
        state = {"params": p, "rest": r, "opt_state": o}
        return m

    bar = None
    if not a.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=hp["steps"], initial=start, dynamic_ncols=True, desc=run_name(a))
    ckpt_every = a.ckpt_every if a.ckpt_every is not None else a.eval_every
    step, val_loss = start, None
    # the sluice path drops only past --ep-rows-factor's bound: any step that did stops the run
    strict = a.moe_impl == "sluice" and a.ep_rows_factor is not None
    worst = jnp.zeros(
        (), jnp.float32
    )  # the largest dropped fraction since the last log (on device)
    # The first step compiles: timed apart, never counted in TGS.
    if step < hp["steps"]:
        t0 = time.perf_counter()
        m = jax.device_get(step_once(step))
        worst = jnp.maximum(worst, m["dropped"]) if strict else worst
        compile_s = time.perf_counter() - t0
        step += 1
        emit({"kind": "compile", "step": step, "seconds": compile_s, "loss": float(m["loss"])})
        if bar:
            bar.update(1)
    window_start, window_steps = time.perf_counter(), 0
    profile_start = profile_end = None
    if a.profile > 0:
        profile_start = max(step, a.profile_from)
        profile_end = min(profile_start + a.profile, hp["steps"])
        if profile_start >= profile_end:
            raise SystemExit(
                f"--profile {a.profile} from step {profile_start}: the run ends at step {hp['steps']}"
            )
    prof_dir = os.path.join(out, "profile")
    profiling = False
    while step < hp["steps"]:
        if step == profile_start:
            jax.block_until_ready(state)  # the steps before run outside the trace
            profile_steps, profiling = profile_end - step, True
            jax.profiler.start_trace(prof_dir)
        m = step_once(step)
        if strict:
            worst = jnp.maximum(worst, m["dropped"])
        step += 1
        window_steps += 1
        if step == profile_end:
            if strict and float(worst) > 0:  # (the log's check, which these steps skip)
                raise SystemExit(f"sluice-train: a profiled step dropped {float(worst):.2%}")
            jax.block_until_ready(m)
            jax.profiler.stop_trace()
            train_time += time.perf_counter() - window_start
            # the step's optimised HLO (from the compilation cache), for sluice-profile to name
            # each fusion kernel's source
            tokens = jax.device_put(data.batch(step, bsz, seq, a.seed), batch_sh)
            lowered = train_step.lower(
                state["params"], state["rest"], state["opt_state"], tokens, copies
            )
            with open(os.path.join(prof_dir, "hlo.txt"), "w") as f:
                f.write(lowered.compile().as_text())
            summary_txt = profile_summary(prof_dir, steps=profile_steps)
            with open(os.path.join(prof_dir, "summary.txt"), "w") as f:
                f.write(summary_txt)
            print(summary_txt, file=sys.stderr)
            # the next window starts here: reading the trace is in neither TGS nor train_time
            window_start, window_steps, profiling = time.perf_counter(), 0, False
        do_eval = a.eval_every and (step % a.eval_every == 0 or step == hp["steps"])
        do_ckpt = ckpt and (step == hp["steps"] or (ckpt_every and step % ckpt_every == 0))
        # no record while profiling, nor for the empty window the profiled steps leave
        logs = step % a.log_every == 0 or step == hp["steps"] or do_eval or do_ckpt
        if logs and window_steps and not profiling:
            m, worst_seen = jax.device_get((m, worst))  # the only host sync of the loop
            if strict and worst_seen > 0:
                raise SystemExit(
                    f"sluice-train: a step before {step} dropped {worst_seen:.2%} of the token "
                    f"copies past --ep-rows-factor {a.ep_rows_factor}'s bound; raise it (or leave "
                    "it out: no bound)"
                )
            dt = time.perf_counter() - window_start
            train_time += dt
            tokens = window_steps * bsz * seq
            rec = {
                "kind": "train",
                "step": step,
                "loss": float(m["loss"]),
                "aux_loss": float(m["aux_loss"]),
                "grad_norm": float(m["grad_norm"]),
                "lr": float(schedule(step - 1)),
                "dropped": float(m["dropped"]),
                **load_stats(np.asarray(m["load"])),
                "step_time": dt / window_steps,
                "tgs": tokens / dt / n_dev,
                "mfu": flops_tok * tokens / dt / (peak * n_dev) if peak else "n/a",
                "peak_mem_gb": _gb(peak_memory_bytes(devices)),
                "train_time": train_time,
                "load": np.asarray(m["load"]).astype(int).tolist(),
            }
            emit(rec)
            if bar:
                bar.set_postfix(
                    loss=f"{rec['loss']:.3f}",
                    tgs=f"{rec['tgs']:.0f}",
                    drop=f"{rec['dropped']:.3f}",
                    val=f"{val_loss:.3f}" if val_loss else "-",
                )
            window_start, window_steps = None, 0
        if bar:
            bar.update(1)
        if do_eval:
            val_loss = evaluate(step)
        if do_ckpt:
            ckpt.save(step, args=ocp_save(state))
        if window_start is None:
            window_start = time.perf_counter()
    if bar:
        bar.close()
    if ckpt:
        ckpt.wait_until_finished()
    log.close()
    summary = {"run": run_name(a), "steps": step, "val_loss": val_loss, "out": out}
    print(json.dumps(summary), file=sys.stderr)
    return summary


def ocp_save(state):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(state)


def _gb(b):
    return None if b is None else round(b / 2**30, 3)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def _read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last_train_time(path, step) -> float:
    recs = [r for r in _read_metrics(path) if r.get("kind") == "train" and r["step"] <= step]
    return recs[-1]["train_time"] if recs else 0.0


def _truncate_metrics(path, step):
    """Drop records past the checkpoint we resume from (they will be produced again)."""
    recs = [r for r in _read_metrics(path) if r["step"] <= step]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


if __name__ == "__main__":
    raise SystemExit(main())

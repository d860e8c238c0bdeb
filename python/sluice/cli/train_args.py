"""sluice-train's flags, and the model config and hyperparameters they select."""

from __future__ import annotations

import argparse
import dataclasses

from ..nn.model import PRESETS, ModelConfig
from ..nn.moe import IMPLS
from ..ops.fp8 import Recipe
from .usage import (
    Parser,
    UsageError,
    int_range,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
)

DESCRIPTION = "Train sluice.nn.model's MoE decoder LM on real text with one of three expert paths."


def parse_args(argv=None):
    p = Parser(
        prog="sluice-train",
        description=DESCRIPTION,
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
    p.add_argument("--capacity-factor", type=positive_float, default=1.25, help="dense path only")
    p.add_argument(
        "--ep-rows-factor",
        type=positive_float,
        default=2.0,
        help="sluice path over sluice.ep: every rank's receive buffer and expert block hold this "
        "multiple of the balanced mean (tokens x top-k rows) a round; a step whose routing sends a "
        "rank more runs further exchange rounds in the same step (nothing dropped, metrics.jsonl's "
        "ep_rounds > 1) (default 2.0)",
    )
    p.add_argument(
        "--ep-worst-case",
        action="store_true",
        help="sluice path over sluice.ep: size the buffers for the worst case instead (every "
        "token of every rank: memory that grows with --ep), one exchange per step",
    )
    p.add_argument(
        "--ep-sms",
        type=int_range(1, 64),
        help="sluice path over sluice.ep: thread blocks (SMs) of its exchange kernels, 1-64 "
        "(default: sluice.ep.setup's 64)",
    )
    p.add_argument(
        "--no-sluice-dispatch",
        action="store_true",
        help="sluice path under --ep: exchange the tokens with jax.lax.ragged_all_to_all instead "
        "of sluice.ep's dispatch/combine",
    )
    p.add_argument(
        "--no-sluice-gmm", action="store_true", help="sluice path with jax.lax.ragged_dot matmuls"
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="sluice path: the blocks' linear layers (routed and shared experts, dense FFNs, "
        "attention's projections) multiply in FP8 by DeepSeek-V3's recipe on sluice's FP8 GEMM: "
        "e4m3 with activations and gradients in 1x128 blocks, weights in 128x128 blocks, f32 "
        "scales, for the forward and both gradients. The embedding, router, norms, attention's "
        "scores and the output head, the weights and the optimizer state stay as they are",
    )
    p.add_argument(
        "--fp8-power-of-two-scales",
        action="store_true",
        help="with --fp8: round every scale up to a power of two (exact scaling, no saturation)",
    )
    p.add_argument(
        "--fp8-dispatch",
        action=argparse.BooleanOptionalAction,
        help="with --fp8, over sluice.ep (--ep > 1): dispatch sends the tokens' rows as e4m3 with "
        "their 1x128 scales (about half the bytes), combine stays bf16, as DeepSeek-V3 trains. On "
        "by default with --fp8: the FP8 gate/up matmul quantizes those rows by the same recipe "
        "anyway. --no-fp8-dispatch: bf16 rows",
    )
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--steps", type=positive_int, help="total steps (default: the preset's)")
    p.add_argument(
        "--batch-size", type=positive_int, help="global batch in sequences (default: the preset's)"
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        metavar="N",
        help="split each step's batch into N micro-batches whose gradients are summed (in float32) "
        "before one optimizer update: the batch of N times the memory, and the update's cost "
        "spread over N times the tokens",
    )
    p.add_argument("--seq-len", type=positive_int, help="default: the preset's")
    p.add_argument("--lr", type=positive_float, help="peak learning rate (default: the preset's)")
    p.add_argument("--warmup", type=nonneg_int, help="warm-up steps (default: the preset's)")
    p.add_argument("--ep", type=positive_int, help="expert-parallel degree (default: the preset's)")
    p.add_argument("--devices", type=positive_int, help="use the first N devices (default: all)")
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
    p.add_argument("--n-layers", type=positive_int, help="override the preset's layer count")
    p.add_argument(
        "--bias-update-rate",
        type=nonneg_float,
        help="aux-loss-free balancing: the router bias's step per training step, 0 = off (default: "
        "the preset's)",
    )
    p.add_argument(
        "--aux-loss-coef",
        type=nonneg_float,
        help="weight of the Switch-style load-balance loss, 0 = off (default: the preset's)",
    )
    p.add_argument(
        "--shared-experts",
        dest="num_shared_experts",
        type=nonneg_int,
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
    p.add_argument("--eval-every", type=nonneg_int, default=100, help="0 = no evaluation")
    p.add_argument("--eval-batches", type=positive_int, default=8)
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument(
        "--ckpt-every", type=nonneg_int, help="default: --eval-every; 0 = only at the end"
    )
    p.add_argument("--no-ckpt", action="store_true", help="write no checkpoint")
    p.add_argument(
        "--out",
        help="the run's directory (default: runs/PRESET-IMPL[-cfX]-sSEED); one holding a run is "
        "refused unless --resume or --overwrite",
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its latest checkpoint; the flags that define the run "
        "(model, data, schedule and its --steps, seed) must be the ones it was started with",
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="start again in --out, deleting the run there (its metrics, config, checkpoints and "
        "profile)",
    )
    p.add_argument(
        "--data", help="token file from sluice-prepare-data (default: read the installed docs)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--profile",
        type=nonneg_int,
        default=0,
        metavar="N",
        help="trace the N steps after the compiling one (or from --profile-from) with "
        "jax.profiler into RUN_DIR/profile and write where their device time went to "
        "RUN_DIR/profile/summary.txt (sluice-profile); those steps are left out of the logged TGS "
        "and MFU",
    )
    p.add_argument(
        "--profile-from",
        type=nonneg_int,
        default=0,
        metavar="STEP",
        help="with --profile: trace from this step on (e.g. once the router is balanced)",
    )
    return p.parse_args(argv)


def run_name(a) -> str:
    impl = a.moe_impl + (f"-cf{a.capacity_factor:g}" if a.moe_impl == "dense" else "")
    return f"{a.preset}-{impl}{'-fp8' if a.fp8 else ''}-s{a.seed}"


def fp8_recipe(a) -> Recipe | None:
    """--fp8's Recipe, or None; UsageError for a combination that cannot run in FP8."""
    if not a.fp8:
        if a.fp8_power_of_two_scales:
            raise UsageError("--fp8-power-of-two-scales: scales of --fp8; add --fp8")
        if a.fp8_dispatch is not None:
            flag = "--fp8-dispatch" if a.fp8_dispatch else "--no-fp8-dispatch"
            raise UsageError(f"{flag}: the dispatch of --fp8; add --fp8")
        return None
    if a.moe_impl != "sluice":
        raise UsageError(
            f"--fp8: the experts' FP8 matmuls are sluice.gmm's; expected --moe-impl sluice, got "
            f"--moe-impl {a.moe_impl}"
        )
    if a.no_sluice_gmm:
        raise UsageError(
            "--fp8: the experts' FP8 matmuls are sluice.gmm's; leave out --no-sluice-gmm"
        )
    if a.fp8_dispatch and a.no_sluice_dispatch:
        raise UsageError(
            "--fp8-dispatch: FP8 rows travel by sluice.ep's dispatch; leave out "
            "--no-sluice-dispatch"
        )
    return Recipe(power_of_two_scales=a.fp8_power_of_two_scales)


def build_config(a) -> tuple[ModelConfig, dict]:
    """The model config and hyperparameters the flags select; UsageError for flags that do not
    go together."""
    preset = PRESETS[a.preset]
    fp8 = fp8_recipe(a)
    cfg: ModelConfig = preset["model"]
    moe = dataclasses.replace(
        cfg.moe,
        impl=a.moe_impl,
        capacity_factor=a.capacity_factor,
        use_sluice_gmm=not a.no_sluice_gmm,
        use_sluice_dispatch=not a.no_sluice_dispatch,
        fsdp=a.fsdp,
        ep_rows_factor=None if a.ep_worst_case else a.ep_rows_factor,
        ep_num_sms=a.ep_sms,
        fp8=fp8,
        fp8_dispatch=a.fp8_dispatch is not False,
    )
    for k in ("bias_update_rate", "aux_loss_coef", "num_shared_experts"):
        if getattr(a, k) is not None:
            moe = dataclasses.replace(moe, **{k: getattr(a, k)})
    cfg = dataclasses.replace(cfg, moe=moe, attention=a.attention, remat=a.remat, fp8=fp8)
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

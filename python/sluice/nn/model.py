"""A decoder-only LM whose first layers have a dense FFN and the rest a fine-grained MoE.

Pre-norm blocks: RMSNorm -> rotary multi-head attention -> RMSNorm -> SwiGLU FFN or
``sluice.nn.moe.MoE``. Parameters in fp32, compute in ``dtype`` (bf16 by default), norms, softmax and
logits in fp32. With ``fp8`` (a ``sluice.fp8.Recipe``) the attention projections, the dense and
shared-expert FFNs (``nn.linear.dense``) and the routed experts (``MoEConfig.fp8``) multiply in FP8
by DeepSeek-V3's recipe; the embedding, the router, the norms, attention's scores and values and the
output head stay as they are, as in DeepSeek-V3. ``Transformer(tokens [B,S]) -> (logits f32 [B,S,V], aux)`` with ``aux = {"aux_loss":
f32, "load": f32[L_moe,E], "dropped": f32[L_moe], "ep": f32[L_moe, 3]}`` (``MoE``'s stats).

Presets (``PRESETS``) hold the model and its default training sizes:
- ``tiny``: trains on a 2-core laptop CPU in a few minutes.
- ``small``: one GPU.
- ``dsv3-proxy``: DeepSeek-V3's MoE shape (256 experts, top-8 of 8 groups limited to 4, sigmoid
  router with aux-loss-free bias, routed scaling 2.5, one shared expert, dense first layer) scaled
  down to fit one H200.
- ``dsv3-proxy-ep2``, ``-ep4``, ``-ep8``: the same model with its experts split over 2, 4 or 8 GPUs
  (``--ep``) and the batch grown with them (16 sequences per GPU).
- ``dsv3-ep4``: DeepSeek-V3's layer widths on 4 GPUs (hidden 7168 as 56 heads of 128, a dense FFN
  18432 wide, 256 routed experts 2048 wide plus a shared one, top-8 of 8 groups limited to 4; standard
  attention in place of MLA), 4096 tokens per GPU, and 3 layers: the dense first and two MoE. That
  is as many as the parameter count says 141 GB H200s hold with bf16 optimizer moments
  (``--opt-state-dtype bfloat16``): 12 bytes a parameter, ~34 GB a GPU for each MoE layer's 64 local
  experts, ~81 GB in all before activations (an estimate, not yet run).
- ``dsv3-1gpu``: what one GPU of ``dsv3-ep4`` computes, without the exchange: the same widths with
  the 64 routed experts a GPU holds there (top-8 of 8 groups of 8 limited to 4, so each token still
  takes 8 experts), 4096 tokens a step and 2 layers (the dense first, one MoE). The expert matmuls
  have dsv3-ep4's per-GPU shapes (4096 x 8 rows over 64 experts, K and N 7168 and 2048).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..ops.fp8 import Recipe
from ..ops.gmm_fp8 import as_recipe
from .linear import dense
from .moe import MoE, MoEConfig, SwiGLU

VOCAB_SIZE = 320  # 256 bytes + specials (sluice.training.data), rounded up to a multiple of 64
# The embedding's gradient as a one-hot GEMM (2 * tokens * vocab * d_model flops) instead of the
# gather's scatter-add up to this vocabulary (embed_lookup). The scatter-add runs as contended atomics:
# 31 ms of a 221 ms dsv3-proxy step on one H200 at 320 tokens, 9.6 ms of a 102 ms one on one H100 at
# 8192 (BPE; the GEMM ~1 ms).
ONE_HOT_MAX_VOCAB = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_dense_layers: int  # the first n_dense_layers layers have a dense FFN, the rest are MoE
    n_heads: int
    head_dim: int
    d_ff_dense: int
    moe: MoEConfig
    rope_theta: float = 10000.0
    dtype: Any = jnp.bfloat16
    init_std: float = 0.02
    # "auto": cuDNN's fused attention where it applies (an Ampere or newer GPU, 16-bit inputs,
    # head_dim a multiple of 8 up to 128), else XLA's; or "xla" / "cudnn"
    # (jax.nn.dot_product_attention's implementations)
    attention: str = "auto"
    # recompute each block's activations in the backward pass instead of keeping them (jax.checkpoint
    # around every block: only the blocks' inputs are saved): memory for a second forward pass. A
    # block over sluice.ep recomputes its attention and its experts' local part (fan-out, SwiGLU,
    # fan-in) but not the dispatch and combine (communication, an effect jax.checkpoint cannot
    # replay)
    remat: bool = False
    # None (default): every matmul in ``dtype``. A sluice.fp8.Recipe (True: the default Recipe()):
    # the linear layers of the blocks (attention's q/k/v and output projections, the dense FFNs,
    # the shared and routed experts) in FP8 (e4m3 with 1x128 activation and 128x128 weight blocks,
    # f32 scales, forward and both gradients; sluice.gmm's fp8). The routed experts need the MoE's
    # sluice path: this sets every MoE layer's MoEConfig.fp8. The parameters and the optimizer are
    # unchanged.
    fp8: Recipe | None = None

    def __post_init__(self):
        object.__setattr__(self, "fp8", as_recipe(self.fp8, "ModelConfig"))

    def active_params(self) -> int:
        """Parameters touched per token, embedding lookup excluded (the output head counted)."""
        return self._params(active=True)

    def total_params(self) -> int:
        return self._params(active=False) + self.vocab_size * self.d_model

    def _params(self, active: bool) -> int:
        d, m = self.d_model, self.moe
        attn = 4 * d * self.n_heads * self.head_dim + 2 * d
        dense = 3 * d * self.d_ff_dense
        experts = (m.top_k if active else m.num_experts) * 3 * d * m.d_ff
        moe = d * m.num_experts + experts + m.num_shared_experts * 3 * d * m.d_ff
        return (
            self.n_layers * attn
            + self.n_dense_layers * dense
            + (self.n_layers - self.n_dense_layers) * moe
            + d
            + d * self.vocab_size
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per active parameter plus causal attention scores and values
        (forward 2*2*S*H*hd/2 per layer, times 3 with the backward)."""
        attention = 6 * self.n_layers * seq_len * self.n_heads * self.head_dim
        return 6 * self.active_params() + attention


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


@jax.custom_vjp
def embed_lookup(emb, tokens):
    """emb[tokens], whose gradient is a GEMM, one_hot(tokens)^T @ g, where the gather's own is a
    scatter-add of every token's row."""
    return emb[tokens]


def _embed_fwd(emb, tokens):
    return emb[tokens], (emb, tokens)


def _embed_bwd(res, g):
    emb, tokens = res
    one_hot = jax.nn.one_hot(tokens, emb.shape[0], dtype=g.dtype)
    d_emb = jnp.einsum("...v,...d->vd", one_hot, g, preferred_element_type=jnp.float32)
    return d_emb.astype(emb.dtype), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


@jax.custom_vjp
def head_logits(x, w):
    """f32 logits x @ w of compute-dtype x [..., d] and w [d, vocab]. The backward takes the f32
    logits' gradient in x's dtype, so its two GEMMs run in bf16 for a bf16 model, accumulating in f32
    (XLA's own transpose ran them in TF32: 3.4 ms of a 97 ms step at a vocabulary of 8192)."""
    return jnp.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32)


def _head_fwd(x, w):
    return head_logits(x, w), (x, w)


def _head_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("...v,dv->...d", g, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum("...d,...v->dv", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


head_logits.defvjp(_head_fwd, _head_bwd)


def rope_tables(seq_len: int, head_dim: int, theta: float):
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """x [B,S,H,hd]; rotates the two halves of each head."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention_impl(cfg: ModelConfig) -> str | None:
    """jax.nn.dot_product_attention's implementation for cfg. Its own default is XLA's, which
    materialises the S x S scores: on one H200 it took ~10 ms of each dsv3-proxy layer's training
    step, where cuDNN's fused kernel needs ~1-2."""
    if cfg.attention != "auto":
        return cfg.attention
    fits = cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
    half = jnp.dtype(cfg.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if jax.default_backend() != "gpu" or not (fits and half):
        return None
    # cuDNN's fused attention needs compute capability 8.0 (Ampere) or newer
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return "cudnn" if float(cc) >= 8.0 else None


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        d, h, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.wqkv = nnx.Param(
            jax.random.normal(rngs.params(), (d, 3, h, hd), jnp.float32) * cfg.init_std
        )
        self.wo = nnx.Param(jax.random.normal(rngs.params(), (h, hd, d), jnp.float32) * out_std)
        self.dtype = cfg.dtype
        self.impl = attention_impl(cfg)
        self.fp8 = cfg.fp8
        self.mesh = mesh

    def __call__(self, x, cos, sin):
        mm = partial(dense, fp8=self.fp8, mesh=self.mesh)
        # [B, S, 3, H, hd]: the GEMM's own output order (a t-major "tbshk" output cost a transpose
        # each way, ~2.8 ms of a 82 ms dsv3-proxy step on one H200)
        qkv = mm(x, self.wqkv[...])
        q, k = apply_rope(qkv[:, :, 0], cos, sin), apply_rope(qkv[:, :, 1], cos, sin)
        v = qkv[:, :, 2]
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.impl)
        return mm(o, self.wo[...], 2)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, mesh=None):
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, rngs=rngs, mesh=mesh)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.is_moe = layer >= cfg.n_dense_layers
        if self.is_moe:
            moe_cfg = dataclasses.replace(
                cfg.moe,
                dtype=cfg.dtype,
                init_std=cfg.init_std,
                out_init_std=out_std,
                remat=cfg.remat,
                fp8=cfg.fp8,
            )
            self.ffn = MoE(moe_cfg, rngs=rngs, mesh=mesh)
        else:
            self.ffn = SwiGLU(
                cfg.d_model,
                cfg.d_ff_dense,
                rngs=rngs,
                dtype=cfg.dtype,
                init_std=cfg.init_std,
                out_init_std=out_std,
                fp8=cfg.fp8,
                mesh=mesh,
            )

    def replays(self) -> bool:
        """Whether jax.checkpoint can replay the whole block: not over sluice.ep, whose communication
        is an effect (the MoE layer then recomputes only its experts, and the block its attention)."""
        return not (self.is_moe and self.ffn.sluice_dispatch)

    def attend(self, x, cos, sin):
        return x + self.attn(self.attn_norm(x), cos, sin)

    def __call__(self, x, cos, sin, remat_attention=False):
        """-> (x, the MoE layer's stats or None for a dense layer)."""
        x = (_attend_remat if remat_attention else Block.attend)(self, x, cos, sin)
        if self.is_moe:
            h, stats = self.ffn(self.ffn_norm(x))
            return x + h, stats
        return x + self.ffn(self.ffn_norm(x)), None


def _block(layer: Block, x, cos, sin):
    return layer(x, cos, sin)


_block_remat = nnx.remat(_block, graph_updates=False)
_attend_remat = nnx.remat(Block.attend, graph_updates=False)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        self.cfg = cfg
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), jnp.float32)
        )
        self.layers = nnx.List([Block(cfg, i, rngs=rngs, mesh=mesh) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)
        self.head = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.d_model, cfg.vocab_size), jnp.float32)
            * cfg.init_std
        )

    def __call__(self, tokens):
        cfg = self.cfg
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
        emb = self.embed[...].astype(cfg.dtype)
        x = embed_lookup(emb, tokens) if cfg.vocab_size <= ONE_HOT_MAX_VOCAB else emb[tokens]
        stats = []
        for layer in self.layers:
            if not cfg.remat:
                x, st = layer(x, cos, sin)
            elif layer.replays():
                x, st = _block_remat(layer, x, cos, sin)
            else:
                x, st = layer(x, cos, sin, remat_attention=True)
            if st is not None:
                stats.append(st)
        x = self.norm(x)
        logits = head_logits(x, self.head[...].astype(cfg.dtype))
        aux = {
            "aux_loss": sum((st["aux_loss"] for st in stats), jnp.zeros((), jnp.float32)),
            "load": jnp.stack([st["load"] for st in stats]),
            "dropped": jnp.stack([st["dropped"] for st in stats]),
            "ep": jnp.stack([st["ep"] for st in stats]),
        }
        return logits, aux

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers if layer.is_moe]

    def update_router_bias(self, load):
        """load f32 [L_moe, E] from the step's aux: one aux-loss-free bias step per MoE layer."""
        for i, moe in enumerate(self.moe_layers()):
            moe.update_bias(load[i])


# The aux-loss-free balancing step of the sigmoid-routed presets. DeepSeek-V3's 1e-3 suits its ~100k
# steps; over these presets' hundreds, routing collapsed for most of a run at 1e-3 (dsv3-proxy: the
# busiest expert got ~30x the mean load until step ~400 of 600, capacity 1.25 dropped 59% of the
# copies; small: until ~300 of 400) and balanced by step ~100-200 at 1e-2, whose validation losses
# were 0.007-0.014 lower on both paths, inside the seeds' spread.
BIAS_UPDATE_RATE = 1e-2


def _model(
    *, d_model: int, n_layers: int, n_heads: int, head_dim: int, d_ff_dense: int, **moe
) -> ModelConfig:
    """A preset's model: the byte vocabulary, one dense first layer, and an MoE of width ``d_model``
    with one shared expert; ``moe`` holds the rest of its MoEConfig."""
    return ModelConfig(
        vocab_size=VOCAB_SIZE,
        d_model=d_model,
        n_layers=n_layers,
        n_dense_layers=1,
        n_heads=n_heads,
        head_dim=head_dim,
        d_ff_dense=d_ff_dense,
        moe=MoEConfig(d_model=d_model, num_shared_experts=1, **moe),
    )


def _preset(
    model: ModelConfig, *, batch_size: int, seq_len: int, lr: float, steps: int, warmup: int
) -> dict:
    """A preset: the model and its default training sizes, on one GPU (ep=1)."""
    return {
        "model": model,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "steps": steps,
        "warmup": warmup,
        "ep": 1,
    }


# _model's arguments for "small"; "dsv3-proxy" is the same model grown to DeepSeek-V3's MoE shape.
_SMALL = {
    "d_model": 512,
    "n_layers": 8,
    "n_heads": 8,
    "head_dim": 64,
    "d_ff_dense": 1536,
    "d_ff": 256,
    "num_experts": 32,
    "top_k": 4,
    "router": "sigmoid",
    "routed_scaling": 1.0,
    "num_groups": 4,
    "topk_groups": 2,
    "bias_update_rate": BIAS_UPDATE_RATE,
}
_DSV3_PROXY = dict(
    _SMALL,
    d_model=1024,
    n_heads=16,
    d_ff_dense=2816,
    num_experts=256,
    top_k=8,
    routed_scaling=2.5,
    num_groups=8,
    topk_groups=4,
)

# Default training sizes beside each model: batch_size (global, sequences), seq_len, lr, steps,
# warmup, ep.
PRESETS: dict[str, dict] = {
    "tiny": _preset(
        _model(
            d_model=128,
            n_layers=4,
            n_heads=4,
            head_dim=32,
            d_ff_dense=384,
            d_ff=64,
            num_experts=16,
            top_k=4,
            router="softmax",
            aux_loss_coef=0.01,
        ),
        batch_size=16,
        seq_len=128,
        lr=3e-3,
        steps=300,
        warmup=30,
    ),
    "small": _preset(
        _model(**_SMALL), batch_size=32, seq_len=1024, lr=1e-3, steps=2000, warmup=100
    ),
    "dsv3-proxy": _preset(
        _model(**_DSV3_PROXY), batch_size=16, seq_len=2048, lr=6e-4, steps=2000, warmup=100
    ),
}
for _r in (2, 4, 8):
    PRESETS[f"dsv3-proxy-ep{_r}"] = dict(PRESETS["dsv3-proxy"], batch_size=16 * _r, ep=_r)
_DSV3 = dict(
    _DSV3_PROXY, d_model=7168, n_layers=3, n_heads=56, head_dim=128, d_ff_dense=18432, d_ff=2048
)
PRESETS["dsv3-ep4"] = dict(
    _preset(_model(**_DSV3), batch_size=8, seq_len=2048, lr=3e-4, steps=100, warmup=10), ep=4
)
PRESETS["dsv3-1gpu"] = _preset(
    _model(**dict(_DSV3, num_experts=64, n_layers=2)),
    batch_size=2, seq_len=2048, lr=3e-4, steps=100, warmup=10,
)  # fmt: skip

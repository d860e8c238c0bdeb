"""Which expert-parallel MoE path has the right gradients on this machine: each path's output and
gradients (bf16 MoE layer, DeepSeek-V3 routing) against the ragged_dot path on one device, as
relative errors. Paths: sluice on one device; ragged_dot over every device (jax.lax.ragged_all_to_all);
sluice over every device (sluice.ep and sluice.gmm); sluice.gmm with ragged_all_to_all; sluice.ep
with ragged_dot. bench/results/ragged-a2a-grad-h100x2-20261126.md has runs on 2x H100: the one that found
ragged_all_to_all's gradients wrong, and the one after the fix (moe.py's _a2a_buffer).

    SLUICE_LIBRARY=... PYTHONPATH=python python3 dev/probe/moe_grad_diag.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from sluice.moe import MoE, MoEConfig

RNG = np.random.default_rng(0)
n = len(jax.devices())
cfg = MoEConfig(
    d_model=256,
    d_ff=128,
    num_experts=16,
    top_k=4,
    num_shared_experts=1,
    router="sigmoid",
    num_groups=4,
    topk_groups=2,
    routed_scaling=2.5,
    dtype=jnp.bfloat16,
)
x = jnp.asarray(RNG.standard_normal((2 * n, 512, cfg.d_model)), jnp.bfloat16)
probe = jnp.asarray(RNG.standard_normal(x.shape), jnp.float32)


def run(impl, ep, **kw):
    mesh = Mesh(np.array(jax.devices()).reshape(1, n), ("data", "expert")) if ep else None
    layer = MoE(dataclasses.replace(cfg, impl=impl, **kw), rngs=nnx.Rngs(0), mesh=mesh)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def f(p, x):
        y, _ = nnx.merge(graphdef, p, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    (_, y), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    return [("y", y)] + [
        (jax.tree_util.keystr(p), g) for p, g in jax.tree_util.tree_leaves_with_path(grads)
    ]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


ref = run("ragged_dot", False)
for name, kw in [
    ("sluice 1gpu", {"impl": "sluice", "ep": False}),
    ("ragged EP", {"impl": "ragged_dot", "ep": True}),
    ("sluice EP", {"impl": "sluice", "ep": True}),
    ("sluice EP gmm-only", {"impl": "sluice", "ep": True, "use_sluice_dispatch": False}),
    ("sluice EP dispatch-only", {"impl": "sluice", "ep": True, "use_sluice_gmm": False}),
]:
    try:
        out = run(kw.pop("impl"), kw.pop("ep"), **kw)
        print(
            name,
            {
                k: f"{rel(np.asarray(a, np.float32), np.asarray(b, np.float32)):.1e}"
                for (k, a), (_, b) in zip(out, ref)
            },
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - a path that fails to compile is reported, the rest still run
        print(name, "ERROR", type(e).__name__, str(e)[:300], flush=True)

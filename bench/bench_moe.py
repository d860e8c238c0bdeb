"""MoE layer forward+backward: time, expert TFLOP/s, memory and dropped fraction per expert path.

    python bench/bench_moe.py --preset dsv3-proxy                  # one device
    python bench/bench_moe.py --preset dsv3-proxy --ep 2           # experts over two devices
    python bench/bench_moe.py --preset small --skew 0.3 --json out.json

One process, same inputs and parameters for every path: dense (capacity factor 1.25 and 2.0, drops),
ragged_dot (jax.lax.ragged_dot, dropless) and sluice (sluice.gmm, dropless). The layer is the
preset's MoE (router, routed and shared experts) on a batch of the preset's size. Timing: wall clock
around a synchronised call of the jitted value-and-grad, after warm-up, median of --iters runs
(fewer for paths slower than --budget seconds); "queued ms" the mean of --iters calls issued back to
back with one wait at the end (the device's rate when the host keeps ahead). --profile DIR traces
a few queued calls per path and prints where their device time went. TFLOP/s counts useful routed-expert FLOPs only: 3
matmuls of 2*T*k*D*F forward, twice that backward (18*T*k*D*F per step), whatever the path computes.
Memory: XLA's compiled buffer sizes (arguments, outputs, temporaries) for that one function, and the
device's peak so far where the device reports it. --skew ALPHA makes routing uneven: expert
popularity p drawn from Dirichlet(ALPHA) (tests/shapes.py's 'skewed' uses 0.3) and 0.05*log(E*p)
added to the router's selection bias.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sluice.cli.profile import summarize
from sluice.nn.model import PRESETS
from sluice.nn.moe import MoE

PROFILE_CALLS = 5

VARIANTS = {
    "dense-cf1.25": {"impl": "dense", "capacity_factor": 1.25},
    "dense-cf2.0": {"impl": "dense", "capacity_factor": 2.0},
    "ragged_dot": {"impl": "ragged_dot"},
    "sluice": {"impl": "sluice"},  # under --ep: sluice.ep dispatch/combine
    "sluice+a2a": {"impl": "sluice", "use_sluice_dispatch": False},  # sluice.gmm, ragged_all_to_all
}
DEFAULT_VARIANTS = "dense-cf1.25,dense-cf2.0,ragged_dot,sluice"


def bench_one(cfg, x, mesh, bias, iters, budget, profile_dir=None):
    layer = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    layer.bias[...] = bias
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    if mesh is not None:
        params = jax.tree_util.tree_map_with_path(
            lambda path, v: jax.device_put(
                v, NamedSharding(mesh, P("expert") if v.ndim == 3 else P())
            ),
            params,
        )
        rest = jax.device_put(rest, NamedSharding(mesh, P()))
    probe = jax.random.normal(jax.random.key(7), x.shape, x.dtype)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum((y * probe).astype(jnp.float32)), stats

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    t0 = time.perf_counter()
    compiled = fn.lower(params, x).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    (probe_sum, stats), grads = jax.block_until_ready(compiled(params, x))
    times = []
    deadline = time.perf_counter() + budget
    for i in range(iters + 1):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        if i:  # one more warm-up
            times.append(time.perf_counter() - t)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    # The same calls queued back to back, one wait at the end: the device's rate when the host
    # keeps ahead of it (the synced figure adds one dispatch and one wait per call).
    t = time.perf_counter()
    for _ in range(iters):
        out = compiled(params, x)
    jax.block_until_ready(out)
    queued_ms = 1e3 * (time.perf_counter() - t) / iters
    profile = None
    if profile_dir:
        jax.block_until_ready(compiled(params, x))
        with jax.profiler.trace(profile_dir):
            for _ in range(PROFILE_CALLS):
                out = compiled(params, x)
            jax.block_until_ready(out)
        with open(os.path.join(profile_dir, "hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        profile = summarize(profile_dir, steps=PROFILE_CALLS, top=30)
    return {
        "ms": 1e3 * statistics.median(times),
        "queued_ms": queued_ms,
        "profile": profile,
        "runs": len(times),
        "compile_s": compile_s,
        "dropped": float(stats["dropped"]),
        # Checksums: every dropless path computes the same function, so these agree to rounding.
        "probe_sum": float(probe_sum),
        "grad_wi_norm": float(jnp.linalg.norm(grads[0]["wi"][...].astype(jnp.float32))),
        "load_max_over_mean": float(jnp.max(stats["load"]) / jnp.mean(stats["load"])),
        "xla_temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2**30 if mem else None,
        "xla_total_gib": (
            sum(
                getattr(mem, f, 0)
                for f in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
            )
            / 2**30
        )
        if mem
        else None,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, help="sequences (default: the preset's)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (devices)")
    p.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, from {sorted(VARIANTS)}"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--budget", type=float, default=20.0, help="seconds of timed runs per path at most"
    )
    p.add_argument(
        "--skew", type=float, default=0.0, help="Dirichlet alpha of expert popularity; 0 = off"
    )
    p.add_argument("--json", help="append the results as one JSON line to this file")
    p.add_argument(
        "--profile",
        help=f"trace {PROFILE_CALLS} queued calls of each path with jax.profiler into "
        "PROFILE/<path> and print where their device time went (sluice-profile's summary)",
    )
    a = p.parse_args(argv)

    preset = PRESETS[a.preset]
    mcfg = preset["model"]
    b, s = a.batch_size or preset["batch_size"], a.seq_len or preset["seq_len"]
    if a.ep > 1:
        if len(jax.devices()) < a.ep:
            raise SystemExit(f"--ep {a.ep} needs {a.ep} devices, found {len(jax.devices())}")
        mesh = Mesh(np.array(jax.devices()[: a.ep]).reshape(1, a.ep), ("data", "expert"))
    else:
        mesh = None
    x = jax.random.normal(jax.random.key(0), (b, s, mcfg.d_model), jnp.float32).astype(mcfg.dtype)
    if mesh is not None:
        x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    e = mcfg.moe.num_experts
    bias = jnp.zeros((e,), jnp.float32)
    if a.skew:
        popularity = np.random.default_rng(0).dirichlet([a.skew] * e)
        bias = jnp.asarray(np.log(popularity + 1e-6) - np.log(1.0 / e), jnp.float32) * 0.05
    base = dataclasses.replace(mcfg.moe, dtype=mcfg.dtype)
    dev = jax.devices()[0]
    useful_flops = 18 * b * s * base.top_k * base.d_model * base.d_ff
    header = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": dev.device_kind,
        "devices": a.ep,
        "jax": jax.__version__,
        "preset": a.preset,
        "batch": b,
        "seq_len": s,
        "d_model": base.d_model,
        "d_ff": base.d_ff,
        "experts": e,
        "top_k": base.top_k,
        "skew": a.skew,
        "useful_tflop": useful_flops / 1e12,
    }
    print(json.dumps(header), flush=True)
    results = {}
    for name in a.variants.split(","):
        cfg = dataclasses.replace(base, **VARIANTS[name])
        try:
            pdir = os.path.join(a.profile, name) if a.profile else None
            r = bench_one(cfg, x, mesh, bias, a.iters, a.budget, pdir)
            r["tflops_per_device"] = useful_flops / (r["ms"] / 1e3) / 1e12 / a.ep
        # An out-of-memory or a missing kernel is a result too.
        except Exception as err:  # noqa: BLE001
            r = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            r["device_peak_so_far_gib"] = stats["peak_bytes_in_use"] / 2**30
        profile = r.pop("profile", None)
        results[name] = r
        print(json.dumps({name: r}), flush=True)
        if profile:
            print(f"== {name}: device time of {PROFILE_CALLS} calls\n{profile}", flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({**header, "results": results}) + "\n")
    print(
        f"\n{a.preset} MoE layer fwd+bwd, {b}x{s} tokens, E={e} k={base.top_k} D={base.d_model} "
        f"F={base.d_ff}, {a.ep} x {dev.device_kind}"
    )
    print(
        f"{'path':14s} {'ms':>9s} {'queued ms':>9s} {'TFLOP/s/dev':>11s} {'dropped':>8s} "
        f"{'XLA temp GiB':>12s} {'checksum':>10s}"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:14s} {r['error']}")
        else:
            print(
                f"{name:14s} {r['ms']:9.2f} {r['queued_ms']:9.2f} {r['tflops_per_device']:11.1f} "
                f"{r['dropped']:8.4f} "
                f"{r['xla_temp_gib'] or 0:12.2f} {r['probe_sum']:10.4g}"
            )


if __name__ == "__main__":
    main()

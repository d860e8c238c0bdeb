"""One process of the multi-process sluice.ep checks (tests/gpu/test_ep_mp.py starts one per GPU):
jax.distributed with one local GPU each (every process sees all GPUs), a global mesh over them, and
the checks of tests/gpu/test_ep_gpu.py on each process's own shard: dispatch and combine against the
references (bitwise), the pipeline's values and gradients, determinism; then a peer that never
arrives (a bounded wait that ends in an error naming the rank and the call).

    python3 tests/gpu/ep_mp_worker.py --rank I --nprocs N --port P --transport ipc|nccl|auto --seed S
Exit status 0 when every check passed (each failure is printed as 'FAIL ...')."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax

ap = argparse.ArgumentParser()
ap.add_argument("--rank", type=int, required=True)
ap.add_argument("--nprocs", type=int, default=2)
ap.add_argument("--port", type=int, default=23456)
ap.add_argument("--transport", default="auto")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--skip-timeout", action="store_true")
ARGS = ap.parse_args()

if not os.environ.get("SLUICE_MP_SELFTEST"):  # selftest: one process, CPU devices (the harness)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ARGS.port}",
        num_processes=ARGS.nprocs,
        process_id=ARGS.rank,
        local_device_ids=[ARGS.rank],
    )

import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax._src import distributed
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sluice import ep

ME = jax.process_index()
R = len(jax.devices())
failures = []


def log(*a):
    print(f"[p{ME}]", *a, flush=True)


def expect(cond, what):
    if not cond:
        failures.append(what)
        log("FAIL", what)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.isnan(a).any():
        return np.inf
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


MESH = Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("ep",))
assert MESH.devices[ME].process_index == ME


def placed(*arrays):
    """Global arrays sharded over the mesh from the same host values on every process."""
    sh = NamedSharding(MESH, P("ep"))
    out = []
    for a in arrays:
        a = np.asarray(a)
        out.append(jax.make_array_from_callback(a.shape, sh, lambda i, a=a: a[i]))
    return out


def mine(a):
    """This process's shard of a global array, as numpy."""
    return np.asarray(a.addressable_shards[0].data)


def routing(rng, t, k, e, mode="random"):
    l = e // R
    idx = np.full((R * t, k), -1, np.int32)
    for i in range(R * t):
        pool = np.arange(l) if mode == "one_rank" else np.arange(e)
        kk = min(k, len(pool))
        idx[i, :kk] = rng.choice(pool, kk, replace=False)
        rng.shuffle(idx[i])
    if mode == "none":
        idx[:] = -1
    else:
        idx[rng.random(idx.shape) < 0.2] = -1
    return idx, rng.random((R * t, k)).astype(np.float32)


def check_dispatch_combine(rng, t, h, k, e, dtype, mode):
    tag = f"dispatch/combine t={t} h={h} k={k} e={e} {jnp.dtype(dtype).name} {mode}"
    x = np.asarray(jnp.asarray(rng.standard_normal((R * t, h)), dtype))
    idx, w = routing(rng, t, k, e, mode)

    def body(x, idx, w):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        out = ep.combine(recv.x, recv.handle)
        return (
            recv.x,
            recv.topk_idx,
            recv.topk_weights,
            recv.num_rows[None],
            recv.counts,
            recv.handle.recv_src,
            out,
        )

    f = jax.jit(shard_map(body, mesh=MESH, in_specs=(P("ep"),) * 3, out_specs=(P("ep"),) * 7))
    outs = f(*placed(x, idx, w))
    ref = ep.dispatch_reference(
        jnp.asarray(x).reshape(R, t, h),
        jnp.asarray(idx).reshape(R, t, k),
        jnp.asarray(w).reshape(R, t, k),
        num_experts=e,
        num_ranks=R,
    )
    names = ("recv_x", "recv_idx", "recv_w", "num_rows", "counts", "recv_src")
    for name, got, want in zip(names, outs[:6], ref):
        want = np.asarray(want[ME])
        expect(np.array_equal(mine(got).reshape(want.shape), want), f"{tag}: {name}")
    want = np.asarray(ep.combine_reference(ref[0], ref[5], t)[ME])
    expect(np.array_equal(mine(outs[6]), want), f"{tag}: combine")
    again = f(*placed(x, idx, w))
    for name, a, b in zip(names + ("combine",), again, outs):
        expect(np.array_equal(mine(a), mine(b)), f"{tag}: determinism of {name}")


def check_pipeline_and_gradients(rng, dtype, tol):
    t, h, n, k, e = 64, 64, 32, 4, 16
    l = e // R
    tag = f"pipeline {jnp.dtype(dtype).name}"
    x = np.asarray(jnp.asarray(rng.standard_normal((R * t, h)), dtype))
    wexp = np.asarray(jnp.asarray(rng.standard_normal((e, h, n)) / np.sqrt(h), dtype))
    idx, w = routing(rng, t, k, e)
    cot = rng.standard_normal((R * t, n)).astype(np.float32)

    def body(x, idx, w, wexp):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        xs, gs, fan = ep.fan_out(recv)
        m = xs.shape[0]
        row_expert = jnp.clip(
            jnp.searchsorted(jnp.cumsum(gs), jnp.arange(m), side="right"), 0, l - 1
        )
        ys = jnp.einsum(
            "mh,mhn->mn",
            xs.astype(jnp.float32),
            wexp[row_expert].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        ).astype(dtype)
        return ep.combine(ep.fan_in(ys, fan), recv.handle)

    f = shard_map(body, mesh=MESH, in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    xp, idxp, wp, wexpp, cotp = placed(x, idx, w, wexp, cot)
    out = jax.jit(f)(xp, idxp, wp, wexpp)

    def fn(x_, e_, wexp_):
        return jnp.einsum(
            "th,thn->tn",
            x_.astype(jnp.float32),
            jnp.asarray(wexp_)[e_].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )

    ref = ep.moe_reference(
        jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), lambda a, b: fn(a, b, wexp)
    )
    sl = slice(ME * t, (ME + 1) * t)
    err = rel_err(mine(out).astype(np.float32), np.asarray(ref)[sl])
    expect(err < tol, f"{tag}: forward rel. error {err:.2e}")

    def loss(x, w, wexp, cot, idx):  # every global array an argument (none closed over)
        return jnp.sum(f(x, idx, w, wexp).astype(jnp.float32) * cot)

    def loss_ref(x, w, wexp):
        out = ep.moe_reference(x, jnp.asarray(idx), w, lambda a, b: fn(a, b, wexp))
        return jnp.sum(out * jnp.asarray(cot))

    gf = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    g = gf(xp, wp, wexpp, cotp, idxp)
    gr = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(wexp)
    )
    for name, a, b, s_ in zip(
        ("x", "topk_weights", "experts"), g, gr, (sl, sl, slice(ME * l, (ME + 1) * l))
    ):
        err = rel_err(mine(a).astype(np.float32), np.asarray(b, np.float32)[s_])
        expect(err < tol * 2, f"{tag}: gradient of {name} rel. error {err:.2e}")
    g2 = gf(xp, wp, wexpp, cotp, idxp)
    for name, a, b in zip(("x", "topk_weights"), g[:2], g2[:2]):
        expect(
            np.array_equal(mine(a).astype(np.float32), mine(b).astype(np.float32)),
            f"{tag}: determinism of the {name} gradient",
        )


def check_peer_never_arrives():
    """Process 0 runs an exchange that process 1 never joins: the wait ends after timeout_s and the
    next call fails, naming the rank and the call (for NCCL: the watchdog aborts the communicator)."""
    client = distributed.global_state.client
    # NCCL's warm-up exchange at setup took more than 3 s across 8 processes (the timeout is also
    # setup's): 10 s there
    ep.setup(
        MESH,
        "ep",
        timeout_s=10.0 if ARGS.transport == "nccl" else 3.0,
        num_sms=8,
        transport=ARGS.transport,
    )
    t, h, k, e = 8, 64, 2, max(4, R)
    x, idx, w = placed(
        np.ones((R * t, h), np.float32),
        np.tile(np.arange(k, dtype=np.int32), (R * t, 1)),
        np.ones((R * t, k), np.float32),
    )

    def body(x, idx, w):
        recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
        return recv.num_rows[None]

    f = jax.jit(shard_map(body, mesh=MESH, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    f.lower(x, idx, w).compile()
    if ME == 0:
        t0 = time.time()
        msg = ""
        try:
            jax.block_until_ready(f(x, idx, w))  # waits at most timeout_s, then returns
            jax.block_until_ready(f(x, idx, w))  # the error of the first shows here
        except Exception as ex:  # noqa: BLE001 - XlaRuntimeError carries our message
            msg = str(ex)
        took = time.time() - t0
        log(f"peer-never-arrives: {took:.1f} s: {msg[:400]!r}")
        expect(
            "rank 0" in msg and "call #" in msg, f"timeout error names rank and call: {msg[:300]}"
        )
        expect(took < 30, f"timeout bounded: took {took:.1f} s")
        client.key_value_set("sluice_test/timeout_done", "1")
    else:
        client.blocking_key_value_get("sluice_test/timeout_done", 120_000)
    ep.teardown("ep")


def main():
    log(f"devices {jax.devices()} local {jax.local_devices()} transport {ARGS.transport}")
    ep.setup(MESH, "ep", timeout_s=20.0, num_sms=8, transport=ARGS.transport)
    comm = ep.communicator(MESH, "ep")
    log(
        f"communicator {comm.comm_id}: transport {comm.transport}, multi_process {comm.multi_process}"
    )
    if ARGS.transport == "auto" and comm.platform != "cpu":
        expect(comm.transport == "ipc", f"auto picked {comm.transport}, expected ipc (one host)")
    rng = np.random.default_rng(ARGS.seed)
    cases = [
        (37, 128, 4, 16, jnp.bfloat16, "random"),
        (256, 7168, 8, 64, jnp.bfloat16, "random"),
        (9, 24, 2, 8, jnp.float32, "random"),
        (17, 40, 3, 8, jnp.float16, "one_rank"),
        (5, 8, 1, 2, jnp.bfloat16, "none"),
    ]
    for c in cases:
        if c[3] % R:  # the expert count must split over the ranks (a case for 2 ranks, at 4 or 8)
            log(f"skip dispatch/combine {c}: {c[3]} experts over {R} ranks")
            continue
        try:
            check_dispatch_combine(rng, *c)
        except Exception:  # noqa: BLE001
            expect(False, f"dispatch/combine {c}: {traceback.format_exc()[-600:]}")
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        try:
            check_pipeline_and_gradients(rng, dtype, tol)
        except Exception:  # noqa: BLE001
            expect(False, f"pipeline {dtype}: {traceback.format_exc()[-600:]}")
    ep.teardown("ep")
    if not ARGS.skip_timeout:
        try:
            check_peer_never_arrives()
        except Exception:  # noqa: BLE001
            expect(False, f"peer never arrives: {traceback.format_exc()[-600:]}")
    log(f"ep_mp_worker transport={ARGS.transport}: {len(failures)} failures")
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # skip jax.distributed's shutdown barrier after a failure


if __name__ == "__main__":
    main()

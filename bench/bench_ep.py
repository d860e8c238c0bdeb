"""Expert-parallel dispatch / combine on the GPUs of one host: sluice.ep against NCCL all-to-all of the
same deduplicated rows and jax.lax.ragged_all_to_all the MaxText way (one row per token-expert pair,
worst-case output buffer). DeepEP's workload: per rank 4096 tokens, hidden 7168, bf16,
top-8 of 256 experts.

GB/s counts only bytes that cross to another rank (a rank's rows to itself do not count), per rank.

  python3 bench/bench_ep.py --part capi --out results.json   # sluice through its C API, CUDA events
                                                             # (dispatch and combine whole; layout alone;
                                                             #  a sweep of SM counts)
  python3 bench/bench_ep.py --part jax --out results.json    # sluice, NCCL and ragged_all_to_all, all
                                                             # inside jit(shard_map) on the same inputs
  python3 bench/bench_ep.py --part mp --out results.json     # the jax part in R processes (one GPU
                                                             # each), transports ipc and nccl
  python3 bench/bench_ep.py --report a.json b.json --md out.md

--transports (capi part) also times the ipc and nccl transports (one process, --transport-sms SMs).

`--small` shrinks the workload (a smoke test; the jax part then also runs on CPU devices).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from shapes import EP_WORKLOADS


def workload(small, override=None):
    """DeepEP's (4096 tokens of 7168, top-8 of 256), --small's, or --workload T,H,K,E (e.g. the
    dsv3-proxy model's per-GPU step: 32768,1024,8,256)."""
    if override:
        t, h, k, e = (int(v) for v in override.split(","))
        return {"t": t, "h": h, "k": k, "e": e}
    return dict(EP_WORKLOADS["small" if small else "deepep"])


def routing(r, t, k, e, seed=0):
    """Top-k of random scores per token (DeepEP's test draws them the same way): distinct experts."""
    rng = np.random.default_rng(seed)
    scores = rng.random((r, t, e))
    return np.argsort(-scores, axis=-1)[..., :k].astype(np.int32)


def crossing_rows(idx, r, e):
    """rows[s] = tokens of rank s sent to other ranks (deduplicated), pairs[s] = (token, expert) pairs
    of rank s whose expert is on another rank, peer[s][d] = tokens of rank s sent to rank d
    (deduplicated)."""
    l = e // r
    owner = idx // l
    rows, pairs, peer = [], [], []
    for s in range(r):
        goes = np.zeros((idx.shape[1], r), bool)
        for j in range(idx.shape[2]):
            ok = idx[s, :, j] >= 0
            goes[np.arange(idx.shape[1])[ok], owner[s, ok, j]] = True
        rows.append(int(goes.sum() - goes[:, s].sum()))
        pairs.append(int(((owner[s] != s) & (idx[s] >= 0)).sum()))
        peer.append([int(c) for c in goes.sum(axis=0)])
    return rows, pairs, peer


# ---- sluice through the C API, timed with CUDA events ------------------------------------------------
def staging_bytes(r, t, h):
    """Staging the NCCL transport needs for this workload (R*T rows of H bf16 values each way, as
    its error message says at 8 ranks: 940 MB), and never less than the 512 MiB used at 2-4 ranks."""
    return max(512 << 20, r * t * h * 4 + (1 << 20))


def part_capi(args):
    import cupy as cp
    import ep_capi as C
    import ml_dtypes

    r = args.ranks
    wl = workload(args.small, args.workload)
    t, h, k, e = wl["t"], wl["h"], wl["k"], wl["e"]
    idx = routing(r, t, k, e)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((r, t, h)).astype(ml_dtypes.bfloat16)
    w = rng.random((r, t, k)).astype(np.float32)
    rows, _, _ = crossing_rows(idx, r, e)
    row_bytes = h * 2
    res = {"workload": wl, "ranks": r, "crossing_rows": rows, "sms": {}}
    d = C.ep_desc(t, h, k, e, r)

    def timed(ranks, fn, n):
        starts, ends = [], []
        for rk in ranks:
            with cp.cuda.Device(rk.dev):
                s, en = cp.cuda.Event(), cp.cuda.Event()
                s.record(rk.stream)
                starts.append(s)
                ends.append(en)
        for _ in range(n):
            for rk in ranks:
                fn(rk)
        for rk, en in zip(ranks, ends):
            with cp.cuda.Device(rk.dev):
                en.record(rk.stream)
        for rk, en in zip(ranks, ends):
            with cp.cuda.Device(rk.dev):
                en.synchronize()
        return max(cp.cuda.get_elapsed_time(s, en) for s, en in zip(starts, ends)) / n * 1e3  # us

    runs = [("peer", sms) for sms in args.sms] + [
        (tr, args.transport_sms) for tr in args.transports if tr != "peer"
    ]
    for tr, sms in runs:
        try:
            comm = C.make_comm(r, num_sms=sms, transport=tr, buffer_bytes=staging_bytes(r, t, h))
        except RuntimeError as ex:
            print(f"capi {tr}: {ex}", flush=True)
            res.setdefault("errors", {})[tr] = str(ex)[:500]
            continue
        ranks = [
            C.Rank(dv, t, h, k, e, r, x[dv].view(np.uint16), idx[dv], w[dv]) for dv in range(r)
        ]
        crossing = statistics.mean(rows) * row_bytes
        slot = res["sms"] if tr == "peer" else res.setdefault("transports", {})
        entry = slot.setdefault(str(sms) if tr == "peer" else tr, {"sms": sms})
        try:  # one transport failing must not lose the others' figures
            ranks_fn_d = lambda rk, comm=comm: rk.dispatch(comm, d)
            for _ in range(3):
                timed(ranks, ranks_fn_d, 2)  # warm up
            disp = [timed(ranks, ranks_fn_d, args.iters) for _ in range(args.reps)]
            dt = statistics.median(disp)
            entry.update(dispatch_us=dt, dispatch_all_us=disp, dispatch_gbps=crossing / dt / 1e3)
            entry["num_recv"] = [int(rk.num_recv.get()[0]) for rk in ranks]
            print(
                f"capi {tr} sms={sms}: dispatch {dt:.1f} us ({crossing / dt / 1e3:.0f} GB/s), "
                f"rows received {entry['num_recv']}",
                flush=True,
            )
            comb_fn = lambda rk, comm=comm: rk.combine(comm, d, rk.recv_x)
            timed(ranks, comb_fn, 2)
            comb = [timed(ranks, comb_fn, args.iters) for _ in range(args.reps)]
            ct = statistics.median(comb)
            entry.update(combine_us=ct, combine_all_us=comb, combine_gbps=crossing / ct / 1e3)
            print(
                f"capi {tr} sms={sms}: combine {ct:.1f} us ({crossing / ct / 1e3:.0f} GB/s)",
                flush=True,
            )
            # redispatch (combine's transpose, in every backward pass): each rank's x to the
            # ranks that received its rows, the same bytes as dispatch's rows
            red_fn = lambda rk, comm=comm: rk.redispatch(comm, d, rk.x)
            timed(ranks, red_fn, 2)
            red = [timed(ranks, red_fn, args.iters) for _ in range(args.reps)]
            rt = statistics.median(red)
            entry.update(
                redispatch_us=rt, redispatch_all_us=red, redispatch_gbps=crossing / rt / 1e3
            )
            print(
                f"capi {tr} sms={sms}: redispatch {rt:.1f} us ({crossing / rt / 1e3:.0f} GB/s)",
                flush=True,
            )
        except RuntimeError as ex:
            print(f"capi {tr} sms={sms}: {ex}", flush=True)
            entry["error"] = str(ex)[:500]
        C.lib.sl_ep_comm_destroy(comm)
        del ranks
    # the layout kernel alone, on one GPU
    with cp.cuda.Device(0):
        s = cp.cuda.Stream(non_blocking=True)
        di = cp.asarray(idx[0])
        pos = cp.zeros((t, r), cp.int32)
        cnt = cp.zeros((r,), cp.int32)
        hist = cp.zeros((e,), cp.int32)
        call = lambda: C.check(
            C.lib.sl_ep_layout_cuda(
                __import__("ctypes").byref(d),
                C.ptr(di),
                C.ptr(pos),
                C.ptr(cnt),
                C.ptr(hist),
                C.vp(s.ptr),
            ),
            "layout",
        )
        for _ in range(5):
            call()
        s.synchronize()
        # Captured in a CUDA graph, so that Python's launch overhead stays out of the kernel's time.
        graph = None
        try:
            s.begin_capture()
            for _ in range(args.iters):
                call()
            graph = s.end_capture()
        except Exception as ex:  # noqa: BLE001 - fall back to plain launches
            print("layout: no graph capture:", repr(ex)[:200], flush=True)
        times = []
        for _ in range(args.reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            if graph is not None:
                graph.launch(s)
            else:
                for _ in range(args.iters):
                    call()
            b.record(s)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / args.iters * 1e3)
        res["layout_us"] = statistics.median(times)
        res["layout_timing"] = (
            "graph" if graph is not None else "launches (includes Python overhead)"
        )
        print(f"capi layout kernel alone: {res['layout_us']:.1f} us (1 block)", flush=True)
    return res


# ---- everything inside jit(shard_map) ----------------------------------------------------------------
def part_jax(args):
    import jax
    import jax.numpy as jnp
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from sluice import ep

    multi = args.nprocs > 1
    if multi:  # one GPU per process, every process sees every GPU
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.nprocs,
            process_id=args.proc,
            local_device_ids=[args.proc],
        )
    r = args.ranks
    wl = workload(args.small, args.workload)
    t, h, k, e = wl["t"], wl["h"], wl["k"], wl["e"]
    l = e // r
    devs = sorted(jax.devices(), key=lambda d: d.id)[:r]
    mesh = Mesh(np.array(devs), ("ep",))
    ep.setup(
        mesh,
        "ep",
        num_sms=args.sms[0] if args.sms else 20,
        transport=args.transport,
        buffer_bytes=staging_bytes(r, t, h),
    )
    transport = ep.communicator(mesh, "ep").transport
    idx = routing(r, t, k, e)
    rows, pairs, peer = crossing_rows(idx, r, e)
    rng = np.random.default_rng(1)
    sh = NamedSharding(mesh, P("ep"))

    def put(a):
        a = np.asarray(a)
        if multi:
            return jax.make_array_from_callback(a.shape, sh, lambda i: a[i])
        return jax.device_put(jnp.asarray(a), sh)

    x = put(np.asarray(jnp.asarray(rng.standard_normal((r * t, h)), jnp.bfloat16)))
    w = put(rng.random((r * t, k)).astype(np.float32))
    di = put(idx.reshape(r * t, k))
    row_bytes = h * 2
    res = {
        "workload": wl,
        "ranks": r,
        "crossing_rows": rows,
        "crossing_pairs": pairs,
        "device": str(devs[0].device_kind),
        "platform": devs[0].platform,
        "transport": transport,
        "processes": args.nprocs,
        "sms": args.sms[0] if args.sms else 20,
    }

    def wall(f, *a, reps=args.reps):
        jax.block_until_ready(f(*a))  # compile + warm up
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    def per_op(make, *a, n=args.unroll):
        """(time of n ops - time of 1 op) / (n - 1): the launch of the program cancels out."""
        return (wall(make(n), *a) - wall(make(1), *a)) / (n - 1)

    # sluice dispatch, n times (fp8: rows sent as e4m3 with their 1x128 scales, quantized before
    # and dequantized after the exchange, both inside the timed op)
    def make_dispatch(n, fp8=None):
        def body(x, idx, w):
            outs = [
                ep.dispatch(x, idx, w, num_experts=e, axis_name="ep", fp8=fp8) for _ in range(n)
            ]
            return sum(o.num_rows + o.x[0, 0].astype(jnp.int32) for o in outs)[None]

        return jax.jit(shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))

    def make_combine(n):
        def body(x, idx, w):
            recv = ep.dispatch(x, idx, w, num_experts=e, axis_name="ep")
            outs = [ep.combine(recv.x, recv.handle) for _ in range(n)]
            return sum(o[:1, :1].astype(jnp.float32) for o in outs)

        return jax.jit(shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))

    disp = per_op(make_dispatch, x, di, w)
    comb = per_op(make_combine, x, di, w)
    crossing = statistics.mean(rows) * row_bytes
    res["sluice_dispatch_us"], res["sluice_combine_us"] = disp, comb
    res["sluice_dispatch_gbps"], res["sluice_combine_gbps"] = (
        crossing / disp / 1e3,
        crossing / comb / 1e3,
    )
    print(
        f"jax sluice: dispatch {disp:.1f} us ({crossing / disp / 1e3:.0f} GB/s), combine {comb:.1f} us "
        f"({crossing / comb / 1e3:.0f} GB/s)",
        flush=True,
    )
    # FP8 dispatch on the same rows: its GB/s counts the bf16 bytes the rows stand for
    disp8 = per_op(lambda n: make_dispatch(n, fp8=True), x, di, w)
    res["sluice_dispatch_fp8_us"] = disp8
    res["sluice_dispatch_fp8_gbps"] = crossing / disp8 / 1e3
    print(
        f"jax sluice: FP8 dispatch {disp8:.1f} us ({disp8 / disp:.2f}x the bf16 dispatch)",
        flush=True,
    )

    # NCCL (XLA's all-to-all) of the same deduplicated rows: a fixed-size all-to-all sends every peer
    # the largest (source, destination) block, cnt rows; [R * cnt, H] per rank, chained
    cnt = max(peer[s][d] for s in range(r) for d in range(r) if d != s)

    def make_a2a(n):
        def body(y):
            for _ in range(n):
                y = jax.lax.all_to_all(y, "ep", 0, 0, tiled=True)
            return y[:1]

        return jax.jit(shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    ya = put(np.asarray(jnp.asarray(rng.standard_normal((r * r * cnt, h)), jnp.bfloat16)))
    a2a = per_op(make_a2a, ya)
    a2a_bytes = cnt * (r - 1) * row_bytes
    res["nccl_a2a_us"], res["nccl_a2a_gbps"] = a2a, a2a_bytes / a2a / 1e3
    print(
        f"jax all_to_all (NCCL), {cnt} deduplicated rows per peer: {a2a:.1f} us "
        f"({a2a_bytes / a2a / 1e3:.0f} GB/s)",
        flush=True,
    )

    # ragged_all_to_all, MaxText's way: rows = (token, expert) pairs sorted by expert, worst-case output
    owner = idx // l
    order = np.argsort(idx.reshape(r, t * k), axis=1, kind="stable")  # by expert: by rank too
    tok = order // k
    sizes = np.stack([np.bincount(owner[s].reshape(-1), minlength=r) for s in range(r)])  # [s, d]
    in_off = np.cumsum(sizes, axis=1) - sizes
    out_off = np.cumsum(sizes, axis=0) - sizes  # where s's block lands in d's buffer: [s, d]
    recv_sizes = sizes.T  # [d, s]

    if multi:  # the ragged baseline runs once, in the one-process part
        return res
    xg = jnp.asarray(np.asarray(x).reshape(r, t, h))
    xs = jax.device_put(jnp.stack([xg[s][tok[s]] for s in range(r)]).reshape(r * t * k, h), sh)
    as_i32 = lambda a: jax.device_put(jnp.asarray(a.astype(np.int32)).reshape(-1), sh)
    cap = r * t * k

    def ragged(xs, io, ss, oo, rs):
        out = jnp.zeros((cap, h), xs.dtype)
        return jax.lax.ragged_all_to_all(xs, out, io, ss, oo, rs, axis_name="ep")[:1]

    f_r = jax.jit(shard_map(ragged, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
    try:
        rag = wall(
            f_r,
            xs,
            as_i32(in_off),
            as_i32(sizes),
            as_i32(out_off),
            as_i32(recv_sizes),
            reps=max(2, args.reps // 2),
        )
        rag_bytes = statistics.mean(pairs) * row_bytes
        res["ragged_a2a_us"], res["ragged_a2a_gbps"] = rag, rag_bytes / rag / 1e3
        print(
            f"jax ragged_all_to_all (MaxText's way, {int(statistics.mean(pairs))} pairs cross per rank): "
            f"{rag:.1f} us ({rag_bytes / rag / 1e3:.1f} GB/s)",
            flush=True,
        )
    except Exception as ex:  # noqa: BLE001 - report and go on
        res["ragged_a2a_error"] = repr(ex)[:500]
        print("ragged_all_to_all failed:", repr(ex)[:300], flush=True)
    return res


def part_mp(args):
    """The jax part in args.ranks processes (one GPU each), once per transport; process 0 reports."""
    import socket
    import subprocess
    import tempfile

    out = {}
    for tr in args.mp_transports:
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            port = so.getsockname()[1]
        tmp = tempfile.mktemp(suffix=".json")
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        cmd = [
            sys.executable,
            __file__,
            "--part",
            "jax",
            "--nprocs",
            str(args.ranks),
            "--ranks",
            str(args.ranks),
            "--port",
            str(port),
            "--transport",
            tr,
            "--sms",
            str(args.sms[0] if args.sms else 20),
            "--reps",
            str(args.reps),
            "--unroll",
            str(args.unroll),
        ] + (["--small"] if args.small else [])
        procs = [
            subprocess.Popen(cmd + ["--proc", str(i)] + (["--out", tmp] if i == 0 else []), env=env)
            for i in range(args.ranks)
        ]
        ok = True
        for p in procs:
            try:
                ok = p.wait(timeout=args.mp_timeout) == 0 and ok
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                ok = False
        if ok and os.path.exists(tmp):
            with open(tmp) as f:
                out[tr] = json.load(f)["jax"]
        else:
            out[tr] = {"error": f"the {args.ranks} processes failed (see the log)"}
        print(f"mp {tr}: {json.dumps(out[tr])[:400]}", flush=True)
    return out


def versions():
    out = {
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    for m in ("jax", "jaxlib", "numpy", "cupy", "torch"):
        try:
            out[m] = __import__(m).__version__
        except ImportError:
            out[m] = "not installed"
    return out


def report(paths, md):
    data = {}
    for p in paths:
        if os.path.exists(p):
            with open(p) as f:
                data.update(json.load(f))
    capi, jx, mp = data.get("capi", {}), data.get("jax", {}), data.get("mp", {})
    lines = [
        f"# sluice.ep dispatch / combine, {jx.get('ranks', capi.get('ranks', '?'))} GPUs of one host",
        "",
        (
            f"Device: {jx.get('device', '?')} x{jx.get('ranks', capi.get('ranks', '?'))}; "
            f"versions: {json.dumps(data.get('versions', {}))}"
        ),
        "",
        "Workload (DeepEP's): "
        + json.dumps(capi.get("workload", jx.get("workload", {})))
        + f"; rows crossing to other ranks, per rank: {capi.get('crossing_rows', jx.get('crossing_rows'))}",
        "",
        "GB/s = bytes of rows that cross to another rank / time, per rank.",
        "",
        "| what | time (us) | GB/s |",
        "| --- | --- | --- |",
    ]
    runs = [
        (f"{sms} SMs", v)
        for sms, v in sorted(capi.get("sms", {}).items(), key=lambda kv: int(kv[0]))
    ]
    runs += [
        (f"transport {tr} (one process), {v['sms']} SMs", v)
        for tr, v in capi.get("transports", {}).items()
    ]
    for what, v in runs:
        for op in ("dispatch", "combine", "redispatch"):
            if op + "_us" in v:
                lines.append(
                    f"| sluice {op}, C API, {what} | {v[op + '_us']:.1f} | {v[op + '_gbps']:.0f} |"
                )
        if "error" in v:
            lines.append(f"| C API, {what} | failed: {v['error'][:120]} | |")
    for tr, err in capi.get("errors", {}).items():
        lines.append(f"| C API, transport {tr} | failed: {err[:120]} | |")
    if "layout_us" in capi:
        lines.append(f"| layout kernel alone (1 block) | {capi['layout_us']:.1f} | |")
    for key, name in (
        ("sluice_dispatch", "sluice dispatch in jit(shard_map)"),
        ("sluice_dispatch_fp8", "sluice FP8 dispatch in jit(shard_map) (GB/s of the bf16 rows)"),
        ("sluice_combine", "sluice combine in jit(shard_map)"),
        ("nccl_a2a", "XLA all_to_all (NCCL), same deduplicated rows"),
        ("ragged_a2a", "jax.lax.ragged_all_to_all, MaxText's way"),
    ):
        if key + "_us" in jx:
            lines.append(f"| {name} | {jx[key + '_us']:.1f} | {jx[key + '_gbps']:.1f} |")
    for tr, v in mp.items():
        nproc = v.get("processes", jx.get("ranks", "?"))
        if "error" in v:
            lines.append(f"| {tr} in {nproc} processes | failed: {v['error'][:120]} | |")
            continue
        for key, name in (
            (
                "sluice_dispatch",
                f"sluice dispatch in jit, {nproc} processes, transport {v.get('transport', tr)}",
            ),
            (
                "sluice_combine",
                f"sluice combine in jit, {nproc} processes, transport {v.get('transport', tr)}",
            ),
            ("nccl_a2a", f"XLA all_to_all (NCCL), {nproc} processes, same rows"),
        ):
            if key + "_us" in v:
                lines.append(f"| {name} | {v[key + '_us']:.1f} | {v[key + '_gbps']:.1f} |")
    if "ragged_a2a_error" in jx:
        lines.append(f"| jax.lax.ragged_all_to_all | failed: {jx['ragged_a2a_error'][:120]} | |")
    lines.append("")
    if "nccl_a2a_us" in jx and "sluice_dispatch_us" in jx:
        lines.append(
            f"Ratios (jit): NCCL / sluice dispatch = {jx['nccl_a2a_us'] / jx['sluice_dispatch_us']:.2f}x, "
            f"NCCL / sluice combine = {jx['nccl_a2a_us'] / jx['sluice_combine_us']:.2f}x"
            + (
                f", FP8 / bf16 dispatch = "
                f"{jx['sluice_dispatch_fp8_us'] / jx['sluice_dispatch_us']:.2f}x"
                if "sluice_dispatch_fp8_us" in jx
                else ""
            )
            + (
                f", ragged / sluice dispatch = {jx['ragged_a2a_us'] / jx['sluice_dispatch_us']:.0f}x"
                if "ragged_a2a_us" in jx
                else ""
            )
        )
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["capi", "jax", "mp"])
    ap.add_argument("--transports", nargs="*", default=["peer"], help="capi: peer ipc nccl")
    ap.add_argument("--transport-sms", type=int, default=24)
    ap.add_argument("--transport", default="auto", help="jax: sluice.ep.setup's transport")
    ap.add_argument("--mp-transports", nargs="*", default=["ipc", "nccl"])
    ap.add_argument("--mp-timeout", type=int, default=200)
    ap.add_argument("--nprocs", type=int, default=1)
    ap.add_argument("--proc", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--report", nargs="*")
    ap.add_argument("--md")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sms", type=int, nargs="*", default=[20, 24, 16, 32])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--unroll", type=int, default=11)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--workload", help="T,H,K,E per rank instead of DeepEP's (capi and jax parts)")
    args = ap.parse_args()
    if args.report is not None:
        report(args.report, args.md)
        return
    res = {"capi": part_capi, "jax": part_jax, "mp": part_mp}[args.part](args)
    out = {args.part: res, "versions": versions()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.nprocs > 1:
        sys.stdout.flush()
        # Every process done before the coordinator (process 0) goes: one that still polls the
        # coordination service after it went aborts (seen with 4 processes), failing the run.
        try:
            from jax._src import distributed

            distributed.global_state.client.wait_at_barrier("bench_ep_exit", 60_000)
        except Exception as ex:  # noqa: BLE001
            print("exit barrier:", repr(ex)[:200], flush=True)
        if args.proc == 0:
            time.sleep(2)
        os._exit(0)  # past jax.distributed's shutdown barrier: the launcher collects the results


if __name__ == "__main__":
    main()

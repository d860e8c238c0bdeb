"""The CUDA C API of sluice.ep on the GPUs of this machine (CuPy, one thread, no XLA): dispatch, combine
(with the weight payload), redispatch and fan_out / fan_in / fan_in_bwd against the pure-jnp
references, on fresh random routings (masked slots, all tokens to one rank, nothing routed).
Small sizes: this is also what runs under compute-sanitizer. Exit status 0 when all pass.

    python3 tests/gpu/ep_capi_check.py [--ranks 2]
"""

import argparse
import ctypes
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import cupy as cp
import ep_capi as C
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from sluice import ep

RNG = np.random.default_rng()
failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL", what, flush=True)


def routing(r, t, k, e, mode):
    l = e // r
    idx = np.full((r, t, k), -1, np.int32)
    for s in range(r):
        for i in range(t):
            pool = np.arange(l) if mode == "one_rank" else np.arange(e)
            kk = min(k, len(pool))
            idx[s, i, :kk] = RNG.choice(pool, kk, replace=False)
            RNG.shuffle(idx[s, i])
    if mode == "none":
        idx[:] = -1
    else:
        idx[RNG.random(idx.shape) < 0.2] = -1
    return idx


def check_fan(tag, dv, rk, ref, n, h, k, l, skip):
    """fan_out / fan_in / fan_in_bwd on rank dv's received rows; skip: sl_ep_fan_desc's
    skip_unused_rows (the rows past the pairs must keep their poison)."""
    # odd ranks bound fan_out's rows to half their pairs (max_rows): the rest is left out
    pairs = int((rk.recv_idx.get() >= 0).sum())
    mr = 0 if dv % 2 == 0 else max(1, pairs // 2)
    fd = C.FanDesc(ctypes.sizeof(C.FanDesc), n, h, k, l, C.BF16, C.BF16, mr, skip)
    m = n * min(k, l) if mr == 0 else min(n * min(k, l), mr)
    with cp.cuda.Device(rk.dev):
        xs = cp.full((m, h), 0xFFFF, cp.uint16)
        gsz = cp.full((l,), -7, cp.int32)
        pos = cp.full((n, k), -7, cp.int32)
        ws = cp.zeros((int(C.lib.sl_ep_fan_workspace_size(ctypes.byref(fd))),), cp.uint8)
        C.check(
            C.lib.sl_ep_fan_out_cuda(
                ctypes.byref(fd),
                C.ptr(rk.recv_x),
                C.ptr(rk.recv_idx),
                C.ptr(xs),
                C.ptr(gsz),
                C.ptr(pos),
                C.ptr(ws),
                C.vp(rk.stream.ptr),
            ),
            "fan_out",
        )
        ys_h = RNG.standard_normal((m, h)).astype(ml_dtypes.bfloat16)
        ys = cp.asarray(ys_h.view(np.uint16))
        out = cp.full((n, h), 0xFFFF, cp.uint16)
        C.check(
            C.lib.sl_ep_fan_in_cuda(
                ctypes.byref(fd),
                C.ptr(ys),
                C.ptr(rk.recv_w),
                C.ptr(pos),
                C.ptr(out),
                C.vp(rk.stream.ptr),
            ),
            "fan_in",
        )
        dout_h = RNG.standard_normal((n, h)).astype(ml_dtypes.bfloat16)
        dout = cp.asarray(dout_h.view(np.uint16))
        dys = cp.full((m, h), 0xFFFF, cp.uint16)
        dw = cp.full((n, k), np.nan, cp.float32)
        dys2 = cp.full((m, h), 0xFFFF, cp.uint16)  # without dw (ys and dw NULL): the same dys
        for ys_in, rows_out, dw_out, what in (
            (ys, dys, dw, "fan_in_bwd"),
            (None, dys2, None, "fan_in_bwd without dw"),
        ):
            C.check(
                C.lib.sl_ep_fan_in_bwd_cuda(
                    ctypes.byref(fd),
                    C.ptr(dout),
                    C.ptr(ys_in),
                    C.ptr(rk.recv_w),
                    C.ptr(pos),
                    C.ptr(gsz),
                    C.ptr(rows_out),
                    C.ptr(dw_out),
                    C.vp(rk.stream.ptr),
                ),
                what,
            )
        rk.sync()
    rxs, rgs, rpos = ep.fan_out_reference(ref[0][dv], ref[1][dv], l, mr)
    total = int(np.asarray(rgs).sum())  # rows past it: zeros, or with skip the poison
    want = np.asarray(rxs).view(np.uint16).copy()
    if skip:
        want[total:] = 0xFFFF
    expect(np.array_equal(xs.get(), want), f"{tag}: fan_out xs[{dv}]")
    expect(np.array_equal(gsz.get(), np.asarray(rgs)), f"{tag}: fan_out sizes[{dv}]")
    expect(np.array_equal(pos.get(), np.asarray(rpos)), f"{tag}: fan_out pos[{dv}]")
    fin = np.asarray(ep.fan_in_reference(jnp.asarray(ys_h), ref[2][dv], rpos, jnp.float32))
    got = out.get().view(ml_dtypes.bfloat16).astype(np.float32)
    expect(np.allclose(got, fin, rtol=1e-2, atol=1e-2), f"{tag}: fan_in[{dv}]")
    g32 = dout_h.astype(np.float32)
    rp = np.asarray(rpos)
    rw = np.asarray(ref[2][dv])
    dw_ref = np.where(
        rp >= 0, np.einsum("nh,nkh->nk", g32, ys_h.astype(np.float32)[np.maximum(rp, 0)]), 0
    )
    expect(np.allclose(dw.get(), dw_ref, rtol=1e-3, atol=1e-3), f"{tag}: fan_in_bwd dw[{dv}]")
    dys_ref = np.zeros((m, h), np.float32)
    for i, j in zip(*np.nonzero(rp >= 0)):
        dys_ref[rp[i, j]] = rw[i, j] * g32[i]
    raw = dys.get()
    got = raw.view(ml_dtypes.bfloat16).astype(np.float32)
    upto = total if skip else m
    expect(
        np.allclose(got[:upto], dys_ref[:upto], rtol=1e-2, atol=1e-2),
        f"{tag}: fan_in_bwd dys[{dv}]",
    )
    expect(not skip or bool(np.all(raw[total:] == 0xFFFF)), f"{tag}: fan_in_bwd dys poison[{dv}]")
    expect(np.array_equal(dys2.get(), raw), f"{tag}: fan_in_bwd without dw, dys[{dv}]")


def run_case(r, t, h, k, e, mode, num_sms, transport="peer"):
    n, l = t * r, e // r
    comm = C.make_comm(r, num_sms=num_sms, transport=transport, buffer_bytes=64 << 20)
    x = RNG.standard_normal((r, t, h)).astype(ml_dtypes.bfloat16)
    idx = routing(r, t, k, e, mode)
    w = RNG.random((r, t, k)).astype(np.float32)
    ranks = [C.Rank(d, t, h, k, e, r, x[d].view(np.uint16), idx[d], w[d]) for d in range(r)]
    d = C.ep_desc(t, h, k, e, r)
    for rk in ranks:
        rk.dispatch(comm, d)
    for rk in ranks:
        rk.sync()
    ref = ep.dispatch_reference(
        jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), num_experts=e, num_ranks=r
    )
    tag = f"{transport} r={r} t={t} h={h} k={k} e={e} {mode}"
    for dv, rk in enumerate(ranks):
        expect(
            np.array_equal(rk.recv_x.get(), np.asarray(ref[0][dv]).view(np.uint16)),
            f"{tag}: recv_x[{dv}]",
        )
        expect(np.array_equal(rk.recv_idx.get(), np.asarray(ref[1][dv])), f"{tag}: recv_idx[{dv}]")
        expect(np.array_equal(rk.recv_w.get(), np.asarray(ref[2][dv])), f"{tag}: recv_w[{dv}]")
        expect(int(rk.num_recv.get()[0]) == int(ref[3][dv]), f"{tag}: num_recv[{dv}]")
        expect(np.array_equal(rk.counts.get(), np.asarray(ref[4][dv])), f"{tag}: counts[{dv}]")
        expect(np.array_equal(rk.recv_src.get(), np.asarray(ref[5][dv])), f"{tag}: recv_src[{dv}]")
    # combine y = recv_x (bits as they came), with the weight payload y_w = 3 * recv_w
    yw = []
    for rk in ranks:  # each on its rank's GPU, finished before any rank's combine reads it
        with cp.cuda.Device(rk.dev):
            yw.append(rk.recv_w * 3)
            cp.cuda.Device(rk.dev).synchronize()
    for rk, y_w in zip(ranks, yw):
        rk.combine(comm, d, rk.recv_x, y_w)
    for rk in ranks:
        rk.sync()
    want = ep.combine_reference(ref[0], ref[5], t)
    for s, rk in enumerate(ranks):
        expect(
            np.array_equal(rk.out.get(), np.asarray(want[s]).view(np.uint16)),
            f"{tag}: combine[{s}]",
        )
        expect(
            np.allclose(rk.out_w.get(), np.where(idx[s] >= 0, w[s] * 3, 0), rtol=1e-6),
            f"{tag}: combine w[{s}]",
        )
    # redispatch (combine's transpose)
    gs = RNG.standard_normal((r, t, h)).astype(ml_dtypes.bfloat16)
    gdev = []
    for s, rk in enumerate(ranks):
        with cp.cuda.Device(rk.dev):
            gdev.append(cp.asarray(gs[s].view(np.uint16)))
    for rk, g in zip(ranks, gdev):
        rk.redispatch(comm, d, g)
    for rk in ranks:
        rk.sync()
    flat = gs.reshape(n, h)
    for dv, rk in enumerate(ranks):
        src = np.asarray(ref[5][dv])
        wantg = np.where(
            (src >= 0)[:, None], flat[np.maximum(src, 0)], np.zeros_like(flat[:1])
        ).view(np.uint16)
        expect(np.array_equal(rk.rd.get(), wantg), f"{tag}: redispatch[{dv}]")
    # redispatch with recv_src garbage (unsorted, out of range): every row written once, from the
    # row it names or zeros, nothing read or written out of bounds (memcheck runs this too)
    bad = []
    for rk in ranks:
        src = RNG.integers(-3, 2 * n + 3, n).astype(np.int32)
        bad.append(src)
        with cp.cuda.Device(rk.dev):
            rk.recv_src.set(src)
            rk.rd.fill(0xFFFF)
            cp.cuda.Device(rk.dev).synchronize()
    for rk, g in zip(ranks, gdev):
        rk.redispatch(comm, d, g)
    for rk in ranks:
        rk.sync()
    for dv, rk in enumerate(ranks):
        ok = (bad[dv] >= 0) & (bad[dv] < n)
        wantg = np.where(ok[:, None], flat[np.where(ok, bad[dv], 0)], np.zeros_like(flat[:1]))
        expect(np.array_equal(rk.rd.get(), wantg.view(np.uint16)), f"{tag}: redispatch bad[{dv}]")
    # fan_out / fan_in / fan_in_bwd on each rank's received rows, rows past the pairs zeroed or not
    for dv, rk in enumerate(ranks):
        for skip in (0, 1):
            check_fan(f"{tag} skip={skip}", dv, rk, ref, n, h, k, l, skip)
    C.check(C.lib.sl_ep_comm_destroy(comm), "destroy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=min(2, cp.cuda.runtime.getDeviceCount()))
    ap.add_argument("--quick", action="store_true", help="two small cases (for compute-sanitizer)")
    ap.add_argument(
        "--transport", nargs="*", default=["peer", "ipc", "nccl"], choices=["peer", "ipc", "nccl"]
    )
    args = ap.parse_args()
    r = args.ranks
    cases = [  # t, h, k, e, mode, num_sms
        (13, 24, 2, 8 * r, "random", 3),
        (64, 256, 8, 32 * r, "random", 20),
        (7, 8, 1, r, "random", 1),
        (33, 64, 4, 8 * r, "one_rank", 4),
        (9, 16, 3, 4 * r, "none", 2),
        (100, 72, 6, 16 * r, "random", 8),  # rows of 144 bytes: the 16-byte path with a tail
        (5, 3, 2, 2 * r, "random", 2),  # rows of 6 bytes: the 2-byte path
        (40, 520, 5, 16 * r, "random", 4),  # fan_in's slots in batches of 4 (5 = 4 + 1); H past 512
        (24, 1000, 7, 8 * r, "random", 4),  # a last 256-element slice of 232
        (3000, 16, 8, 16 * r, "random", 8),  # the multi-block layout: 3 chunks, the last partial
        (2100, 8, 3, 4 * r, "one_rank", 4),
    ]
    if args.quick:
        cases = [cases[0], cases[6], cases[7], cases[10]]
    for tr in args.transport:
        for t, h, k, e, mode, sms in cases:
            try:
                run_case(r, t, h, k, e, mode, sms, tr)
            except RuntimeError as ex:  # an error from the C API: a failure, go on
                expect(False, f"{tr} t={t} h={h} k={k} e={e} {mode}: {ex}")
    print(
        f"ep_capi_check: {len(cases)} cases x transports {args.transport} on {r} GPUs, "
        f"{len(failures)} failures",
        flush=True,
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

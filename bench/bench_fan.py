"""The local fan kernels (sluice.ep fan_out / fan_in / fan_in_bwd, csrc/cuda/ep_fan.cu) on one GPU, against
the HBM's copy rate and torch's gather/sort equivalents, timed in turn with CUDA events. Two builds of the
library can run side by side (--lib NAME=PATH, repeated): the same inputs go to each, and their outputs
are compared (bit for bit; dw, an f32 sum, to its rounding).

    python3 bench/bench_fan.py --lib new=build/libsluice.so [--lib old=...] --md fan.md --json fan.json

Bytes counted (s = bytes per element, M = N * k rows): fan_out reads x once and writes M rows,
fan_in reads M rows and writes N, fan_in_bwd reads dout and M rows and writes M rows. GB/s = bytes /
time; the copy rate is torch's device-to-device copy of a 1 GiB tensor (read + write bytes).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench_gmm import time_cuda
from shapes import FAN_WORKLOADS  # tests/shapes.py (bench_gmm puts tests/ on the path)
from sluice.ops.capi import EpFanDesc as FanDesc

BF16 = 1
vp = ctypes.c_void_p


def load(path):
    lib = ctypes.CDLL(path)
    P = ctypes.POINTER(FanDesc)
    lib.sl_ep_fan_out_cuda.argtypes = [P] + [vp] * 7
    lib.sl_ep_fan_in_cuda.argtypes = [P] + [vp] * 5
    lib.sl_ep_fan_in_bwd_cuda.argtypes = [P] + [vp] * 8
    lib.sl_ep_fan_workspace_size.argtypes = [P]
    lib.sl_ep_fan_workspace_size.restype = ctypes.c_size_t
    lib.sl_last_error.restype = ctypes.c_char_p
    return lib


def copy_rate(torch):
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = time_cuda({"copy": lambda: b.copy_(a)}, 20)["copy"]
    return 2 * a.numel() * 2 / ms / 1e6  # GB/s


def run_workload(torch, libs, n, k, l, h, iters):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
    idx = (
        torch.rand(n, l, device=dev, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    )
    w = torch.rand(n, k, device=dev, generator=g)
    m = n * min(k, l)
    dout = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
    stream = vp(torch.cuda.current_stream().cuda_stream)

    def ptr(t):
        return vp(t.data_ptr())

    d = FanDesc(ctypes.sizeof(FanDesc), n, h, k, l, BF16, BF16, 0)
    dp = ctypes.byref(d)

    calls, outs = {}, {}
    for name, lib in libs.items():
        o = {
            "xs": torch.empty(m, h, dtype=torch.bfloat16, device=dev),
            "gs": torch.empty(l, dtype=torch.int32, device=dev),
            "pos": torch.empty(n, k, dtype=torch.int32, device=dev),
            "ws": torch.empty(
                max(lib.sl_ep_fan_workspace_size(dp), 1), dtype=torch.uint8, device=dev
            ),
            "out": torch.empty(n, h, dtype=torch.bfloat16, device=dev),
            "dys": torch.empty(m, h, dtype=torch.bfloat16, device=dev),
            "dw": torch.empty(n, k, dtype=torch.float32, device=dev),
        }
        for key, t in o.items():  # poisoned: every output must be written
            t.fill_(float("nan") if t.is_floating_point() else 0xAB if key == "ws" else -7)

        def check(st, what, lib=lib):
            if st:
                raise RuntimeError(f"{what}: {lib.sl_last_error().decode()}")

        def fan_out(lib=lib, o=o):
            check(
                lib.sl_ep_fan_out_cuda(
                    dp,
                    ptr(x),
                    ptr(idx),
                    ptr(o["xs"]),
                    ptr(o["gs"]),
                    ptr(o["pos"]),
                    ptr(o["ws"]),
                    stream,
                ),
                "fan_out",
            )

        def fan_in(lib=lib, o=o):
            check(
                lib.sl_ep_fan_in_cuda(
                    dp, ptr(o["xs"]), ptr(w), ptr(o["pos"]), ptr(o["out"]), stream
                ),
                "fan_in",
            )

        def fan_in_bwd(lib=lib, o=o):
            check(
                lib.sl_ep_fan_in_bwd_cuda(
                    dp,
                    ptr(dout),
                    ptr(o["xs"]),
                    ptr(w),
                    ptr(o["pos"]),
                    ptr(o["gs"]),
                    ptr(o["dys"]),
                    ptr(o["dw"]),
                    stream,
                ),
                "fan_in_bwd",
            )

        fan_out(), fan_in(), fan_in_bwd()
        calls[name] = {"fan_out": fan_out, "fan_in": fan_in, "fan_in_bwd": fan_in_bwd}
        outs[name] = o
    torch.cuda.synchronize()

    # torch's equivalents: a stable sort of the slots by expert and a gather (fan_out), a gather and a
    # weighted sum (fan_in)
    flat = idx.flatten().long()
    order = torch.argsort(flat, stable=True)
    pos_t = torch.empty_like(order)
    pos_t[order] = torch.arange(order.numel(), device=dev)
    pos_t = pos_t.view(n, k)

    def torch_fan_out():
        o = torch.argsort(flat, stable=True)
        return x.index_select(0, o // k), torch.bincount(flat, minlength=l)

    def torch_fan_in():
        ys = outs[next(iter(outs))]["xs"]
        return torch.bmm(w.to(torch.bfloat16).unsqueeze(1), ys[pos_t].view(n, k, h)).squeeze(1)

    # correctness: against each other, and fan_out's rows against the sort
    ref = outs[next(iter(outs))]
    errors = []
    if not torch.equal(ref["xs"], x[order // k]):
        errors.append("fan_out rows differ from the stable sort")
    if not torch.equal(ref["gs"], torch.bincount(flat, minlength=l).to(torch.int32)):
        errors.append("group_sizes differ from bincount")
    for name, o in outs.items():
        for key in ("xs", "gs", "pos", "out", "dys"):
            if not torch.equal(o[key], ref[key]):
                errors.append(f"{name}: {key} differs from {next(iter(outs))}'s")
        # dw: f32 sums of H products, in an order that may differ between builds
        if not torch.allclose(o["dw"], ref["dw"], rtol=1e-4, atol=2e-7 * h):
            errors.append(f"{name}: dw differs beyond f32 rounding")
        if o["out"].isnan().any() or o["dys"].isnan().any() or o["dw"].isnan().any():
            errors.append(f"{name}: NaN left in an output")

    fns = {f"{lib}:{op}": fn for lib, ops in calls.items() for op, fn in ops.items()}
    fns["torch:fan_out"] = torch_fan_out
    fns["torch:fan_in"] = torch_fan_in
    ms = time_cuda(fns, iters)
    s = 2
    bytes_ = {
        "fan_out": n * h * s + m * h * s,
        "fan_in": m * h * s + n * h * s,
        "fan_in_bwd": n * h * s + 2 * m * h * s,
    }
    rows = []
    for key, t in ms.items():
        impl, op = key.split(":")
        rows.append({"impl": impl, "op": op, "ms": t, "GB/s": bytes_[op] / t / 1e6})
    return rows, errors


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lib", action="append", required=True, help="NAME=PATH of a libsluice.so")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    libs = {}
    for spec in args.lib:
        name, _, path = spec.partition("=")
        libs[name] = load(os.path.abspath(path))
    copy = copy_rate(torch)
    res = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_GBps": copy,
        "libs": {k: os.path.abspath(v.partition("=")[2]) for k, v in zip(libs, args.lib)},
        "workloads": {},
    }
    for wname, (n, k, l, h) in FAN_WORKLOADS.items():
        rows, errors = run_workload(torch, libs, n, k, l, h, args.iters)
        res["workloads"][wname] = {"N": n, "k": k, "L": l, "H": h, "rows": rows, "errors": errors}
        print(wname, "errors:", errors or "none", flush=True)
        for r in rows:
            print(
                f"  {r['impl']:>8} {r['op']:<11} {r['ms']:8.3f} ms {r['GB/s']:8.0f} GB/s",
                flush=True,
            )

    lines = [
        f"# Fan kernels ({res['date'][:10]})",
        "",
        f"Device: {res['device']}; torch {res['torch']}. bf16 rows. Copy rate (torch, 1 GiB, read + write): "
        f"{copy:.0f} GB/s. Produced by bench/bench_fan.py; libraries: "
        + ", ".join(f"{k} = {v}" for k, v in res["libs"].items())
        + ".",
        "",
        "| workload (N, k, L, H) | op | impl | ms | GB/s | of copy rate |",
        "|---|---|---|---|---|---|",
    ]
    for wname, wl in res["workloads"].items():
        for r in sorted(wl["rows"], key=lambda r: (r["op"], r["impl"])):
            lines.append(
                f"| {wname} ({wl['N']}, {wl['k']}, {wl['L']}, {wl['H']}) | {r['op']} | {r['impl']} | "
                f"{r['ms']:.3f} | {r['GB/s']:.0f} | {r['GB/s'] / copy:.0%} |"
            )
    errs = [f"{w}: {e}" for w, wl in res["workloads"].items() for e in wl["errors"]]
    lines += [
        "",
        "Checks (outputs poisoned with NaN first; every library against the first and the sort): "
        + ("; ".join(errs) if errs else "all equal"),
    ]
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("\n".join(lines))
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())

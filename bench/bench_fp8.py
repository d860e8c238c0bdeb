"""FP8 grouped GEMM benchmark: sluice's FP8 gmm/tgmm (DeepSeek-V3's 1x128 / 128x128 scaling)
against sluice's BF16 kernels, torch._scaled_grouped_mm (per-row scales), dense FP8 cuBLAS through
torch._scaled_mm at equal FLOPs (one scale per tensor, per row, and 1x128 / 128x128 blocks) and
torch._grouped_mm in BF16; then the quantization kernel's bandwidth.

Run on one GPU (bench/run_fp8_gpu.sh does it):
  python3 bench/bench_fp8.py --lib build-gpu/libsluice_gpu.so --shapes bench,deepgemm --out fp8.json
  python3 bench/bench_fp8.py --merge fp8.json --md fp8.md

TFLOP/s = 2*M*K*N / time, M = the rows of all groups; the FP8 peak is 1979 TFLOP/s (H100/H200
SXM, dense). Timing: bench_gmm.time_cuda (CUDA events, calls of every implementation queued back to
back in rotating order, median of --iters). Operands are bf16 normal values quantized in torch by the
same block rule (amax / 448); the FP8 outputs are checked against torch._grouped_mm of the
dequantized operands. Group sizes (tests/shapes.py) are rounded to multiples of 16 (`aligned`).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gmm import SL_DTYPE_BF16, GmmDesc, QuantDesc, SwigluDesc, time_cuda, torch_meta
from shapes import group_sizes, select_shapes

SL_DTYPE_F8E4M3 = 4
FP8_PEAK = 1979.0  # TFLOP/s, dense
HBM_TBS = 4.8  # H200


def open_lib(path):
    lib = ctypes.CDLL(path)
    for f in ("sl_gmm_cuda", "sl_tgmm_cuda"):
        getattr(lib, f).restype = ctypes.c_int
        getattr(lib, f).argtypes = [ctypes.POINTER(GmmDesc)] + [ctypes.c_void_p] * 7
    for f in ("sl_gmm_fp8_cuda", "sl_tgmm_fp8_cuda"):
        getattr(lib, f).restype = ctypes.c_int
        getattr(lib, f).argtypes = [ctypes.POINTER(GmmDesc)] + [ctypes.c_void_p] * 9
    lib.sl_quantize_fp8_cuda.restype = ctypes.c_int
    lib.sl_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [ctypes.c_void_p] * 6
    lib.sl_quantize_fp8_both_cuda.restype = ctypes.c_int
    lib.sl_quantize_fp8_both_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [ctypes.c_void_p] * 8
    lib.sl_last_error.restype = ctypes.c_char_p
    lib.sl_gmm_cuda_workspace_size.restype = ctypes.c_size_t
    return lib


def quantize(x, br, bc):
    """x (2-D or 3-D, last two dims blocked) -> (e4m3, f32 scale [.., R/br, C/bc]); dims divisible."""
    import torch

    *lead, r, c = x.shape
    xb = x.float().reshape(*lead, r // br, br, c // bc, bc)
    scale = (xb.abs().amax(dim=(-3, -1)) / 448.0).clamp_min(2.0**-126)
    q = (xb / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(*lead, r, c), scale


def dequantize(q, scale, br, bc):
    *lead, r, c = q.shape
    qb = q.float().reshape(*lead, r // br, br, c // bc, bc)
    return (qb * scale[..., :, None, :, None]).reshape(*lead, r, c)


def aligned(sizes, a):
    """Group sizes rounded to multiples of `a` with the same sum (a multiple of `a`): torch's grouped
    GEMMs assert 16-byte group edges on the device (an assert ends the process), so every
    implementation runs these sizes."""
    out = (sizes // a) * a
    for i in np.argsort(-(sizes - out), kind="stable")[: (int(sizes.sum()) - int(out.sum())) // a]:
        out[i] += a
    return out.astype(np.int32)


def check(lib, st, what):
    if st != 0:
        raise RuntimeError(f"{what}: {lib.sl_last_error().decode()}")


def torch_peers(x_q, wt_q, offs, m, k, n, g, sx_row, sw_row, dense):
    """{name: callable} of torch's FP8 peers: _scaled_grouped_mm (per-row scales) and dense
    _scaled_mm at equal FLOPs with each scaling it accepts; `dense` holds the dense operands."""
    import torch

    calls = {}
    calls["torch_scaled_grouped_mm"] = lambda: torch._scaled_grouped_mm(
        x_q, wt_q.transpose(-2, -1), sx_row, sw_row, offs=offs, out_dtype=torch.bfloat16
    )
    a, bt, one = dense["a"], dense["bt"], dense["one"]
    calls["cublas_fp8_tensorwise"] = lambda: torch._scaled_mm(
        a, bt.t(), one, one, out_dtype=torch.bfloat16
    )
    calls["cublas_fp8_rowwise"] = lambda: torch._scaled_mm(
        a, bt.t(), dense["sa_row"], dense["sb_row"], out_dtype=torch.bfloat16
    )
    # 1x128 / 128x128 blocks: cuBLAS wants the activation scales outer-dim-major; the recipes are
    # explicit arguments of torch.nn.functional.scaled_mm (torch._scaled_mm infers tensor- or
    # row-wise scaling from the scales' shapes and rejects these)
    sa_blk, sb_blk = dense["sa_blk"], dense["sb_blk"]
    F = torch.nn.functional
    calls["cublas_fp8_blockwise"] = lambda: F.scaled_mm(
        a,
        bt.t(),
        sa_blk,
        F.ScalingType.BlockWise1x128,
        sb_blk,
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )
    return calls


def bench_shape(lib, shape, args):
    import torch

    dev = torch.device("cuda")
    m, g, k, n = shape.m, shape.g, shape.k, shape.n
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(g, k, n, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    x_q, sx = quantize(x, 1, 128)  # [M, K], [M, K/128]
    wt = w.transpose(1, 2).contiguous()  # [G, N, K]
    wt_q, swt = quantize(wt, 128, 128)  # [G, N, K], [G, N/128, K/128]
    xt_q, sxt = quantize(x.t().contiguous(), 1, 128)  # x^T [K, M] by 1x128 = x by 128x1
    dyt_q, sdyt = quantize(dy.t().contiguous(), 1, 128)  # dy^T [N, M]
    sxt, sdyt = sxt.t().contiguous(), sdyt.t().contiguous()  # [M/128, K], [M/128, N]
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(g, k, n, device=dev, dtype=torch.bfloat16)
    # per-row scaled operands for torch._scaled_grouped_mm
    sx_row = (x.float().abs().amax(1) / 448).clamp_min(1e-12)
    xr_q = (x.float() / sx_row[:, None]).to(torch.float8_e4m3fn)
    sw_row = (wt.float().abs().amax(2) / 448).clamp_min(1e-12)  # [G, N]
    wr_q = (wt.float() / sw_row[..., None]).to(torch.float8_e4m3fn)
    # dense operands at equal FLOPs: [M, K] x [K, N]
    a = x_q
    bt_q, sbt = quantize(wt[0].contiguous(), 128, 128)  # [N, K]
    dense = {
        "a": a,
        "bt": bt_q,
        "one": torch.ones((), device=dev),
        "sa_row": sx_row[:, None].contiguous(),
        "sb_row": sw_row[0][None, :].contiguous(),
        "sa_blk": sx.t().contiguous().t(),  # [M, K/128], outer-dim-major
        # cuBLAS's layouts for 1x128 x 128x128: A's scale [M, K/128] column-major, B's [L4, N/128]
        # column-major with L4 = K/128 rounded up to 4
        "sb_blk": torch.nn.functional.pad(sbt, (0, -sbt.shape[1] % 4)).t(),
    }
    desc8 = GmmDesc(
        ctypes.sizeof(GmmDesc),
        1,
        m,
        k,
        n,
        g,
        g,
        SL_DTYPE_F8E4M3,
        SL_DTYPE_F8E4M3,
        SL_DTYPE_BF16,
        1,
        0,
    )
    desc8t = GmmDesc(
        ctypes.sizeof(GmmDesc),
        1,
        m,
        k,
        n,
        g,
        g,
        SL_DTYPE_F8E4M3,
        SL_DTYPE_F8E4M3,
        SL_DTYPE_BF16,
        0,
        0,
    )
    desc16 = GmmDesc(
        ctypes.sizeof(GmmDesc), 1, m, k, n, g, g, SL_DTYPE_BF16, SL_DTYPE_BF16, SL_DTYPE_BF16, 0, 0
    )
    ws = torch.empty(
        max(lib.sl_gmm_cuda_workspace_size(ctypes.byref(desc8)), 16), device=dev, dtype=torch.uint8
    )

    def stream():
        return torch.cuda.current_stream().cuda_stream

    def sluice_calls(gs):
        def sl_fp8_gmm():
            check(
                lib,
                lib.sl_gmm_fp8_cuda(
                    ctypes.byref(desc8),
                    x_q.data_ptr(),
                    sx.data_ptr(),
                    wt_q.data_ptr(),
                    swt.data_ptr(),
                    gs.data_ptr(),
                    None,
                    out.data_ptr(),
                    ws.data_ptr(),
                    stream(),
                ),
                "gmm_fp8",
            )

        def sl_fp8_tgmm():
            check(
                lib,
                lib.sl_tgmm_fp8_cuda(
                    ctypes.byref(desc8t),
                    xt_q.data_ptr(),
                    sxt.data_ptr(),
                    dyt_q.data_ptr(),
                    sdyt.data_ptr(),
                    gs.data_ptr(),
                    None,
                    dw.data_ptr(),
                    ws.data_ptr(),
                    stream(),
                ),
                "tgmm_fp8",
            )

        def sl_bf16_gmm():
            check(
                lib,
                lib.sl_gmm_cuda(
                    ctypes.byref(desc16),
                    x.data_ptr(),
                    w.data_ptr(),
                    gs.data_ptr(),
                    None,
                    out.data_ptr(),
                    ws.data_ptr(),
                    stream(),
                ),
                "gmm",
            )

        def sl_bf16_tgmm():
            check(
                lib,
                lib.sl_tgmm_cuda(
                    ctypes.byref(desc16),
                    x.data_ptr(),
                    dy.data_ptr(),
                    gs.data_ptr(),
                    None,
                    dw.data_ptr(),
                    ws.data_ptr(),
                    stream(),
                ),
                "tgmm",
            )

        return sl_fp8_gmm, sl_fp8_tgmm, sl_bf16_gmm, sl_bf16_tgmm

    def bf16_grouped(offs):
        return lambda: torch._grouped_mm(x, w, offs=offs)

    rows = []
    for dist in args.dists.split(","):
        sizes = aligned(group_sizes(shape, dist, seed=args.seed), 16)
        gs = torch.tensor(sizes, device=dev, dtype=torch.int32)
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        sl_fp8_gmm, sl_fp8_tgmm, sl_bf16_gmm, sl_bf16_tgmm = sluice_calls(gs)
        row = {
            "shape": shape.name,
            "dist": dist,
            "m": m,
            "g": g,
            "k": k,
            "n": n,
            "sizes_min": int(sizes.min()),
            "sizes_max": int(sizes.max()),
        }
        # correctness: FP8 against BF16 grouped_mm of the dequantized operands
        sl_fp8_gmm()
        ref = torch._grouped_mm(
            dequantize(x_q, sx, 1, 128).bfloat16(),
            dequantize(wt_q, swt, 128, 128).transpose(1, 2).bfloat16(),
            offs=offs,
        )
        row["gmm_rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        sl_fp8_tgmm()
        ref_dw = torch._grouped_mm(  # (x [M, K] row-major, viewed transposed, as torch wants)
            dequantize(xt_q, sxt.t(), 1, 128).t().contiguous().bfloat16().t(),
            dequantize(dyt_q, sdyt.t(), 1, 128).t().contiguous().bfloat16(),
            offs=offs,
        )
        row["tgmm_rel_err"] = float((dw.float() - ref_dw.float()).norm() / ref_dw.float().norm())
        calls = {
            "sluice_fp8_gmm": sl_fp8_gmm,
            "sluice_bf16_gmm": sl_bf16_gmm,
            "torch_grouped_mm_bf16": bf16_grouped(offs),
            "sluice_fp8_tgmm": sl_fp8_tgmm,
            "sluice_bf16_tgmm": sl_bf16_tgmm,
        }
        calls.update(torch_peers(xr_q, wr_q, offs, m, k, n, g, sx_row, sw_row, dense))
        working = {}
        for name, fn in calls.items():
            try:  # a peer that fails (signature, layout) is recorded, not fatal
                fn()
                torch.cuda.synchronize()
                working[name] = fn
            except Exception as e:  # noqa: BLE001
                row.setdefault("errors", {})[name] = str(e)[:300]
        t = time_cuda(working, args.iters)
        flops = 2.0 * m * k * n
        row["ms"] = t
        row["tflops"] = {kk: flops / v / 1e9 for kk, v in t.items()}
        rows.append(row)
        print(
            json.dumps(
                {
                    "shape": shape.name,
                    "dist": dist,
                    "tflops": {kk: round(v) for kk, v in row["tflops"].items()},
                    "err": [row["gmm_rel_err"], row["tgmm_rel_err"]],
                    "errors": list(row.get("errors", {})),
                }
            ),
            flush=True,
        )
    return rows


def quantize_call(lib, d, x, q, qt, sc):
    import torch

    def call():
        check(
            lib,
            lib.sl_quantize_fp8_cuda(
                ctypes.byref(d),
                x.data_ptr(),
                None,
                None if q is None else q.data_ptr(),
                None if qt is None else qt.data_ptr(),
                sc.data_ptr(),
                torch.cuda.current_stream().cuda_stream,
            ),
            "quantize_fp8",
        )

    return call


def bench_quantize(lib, args):
    """GB/s of sl_quantize_fp8_cuda: activations by 1x128 (q), by 128x1 written transposed (q_t),
    and weights by 128x128 written in both layouts; and of sl_quantize_fp8_both_cuda (an
    activation's q and q_t from one read; "gathered": its rows picked from token rows by index, 8
    copies of each in random order, as fan-out makes them; counted as read once per copy)."""
    import torch

    dev = torch.device("cuda")
    rows = []

    def record(case, r, c, b, ms, nbytes):
        gbs = nbytes / ms / 1e6
        rows.append(
            {
                "case": case,
                "rows": r,
                "cols": c,
                "batch": b,
                "ms": ms,
                "GB/s": gbs,
                "hbm_share": gbs / (HBM_TBS * 1000),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    cases = [  # name, rows, cols, batch, block (1x128 with both layouts: "both"), q, q_t
        ("act 1x128 -> q", 32768, 7168, 1, (1, 128), True, False),
        ("act 128x1 -> q_t", 32768, 7168, 1, (128, 1), False, True),
        ("act 128x1 -> q_t (N 2048)", 32768, 2048, 1, (128, 1), False, True),
        ("act 1x128 -> q and 128x1 -> q_t, one pass", 32768, 7168, 1, "both", True, True),
        ("act both, one pass (N 2048)", 32768, 2048, 1, "both", True, True),
        ("act both, gathered 8 copies of 4096 token rows", 32768, 7168, 1, "gather", True, True),
        ("act both, gathered 8 copies of 32768 token rows", 262144, 1024, 1, "gather", True, True),
        ("weight 128x128 -> q, q_t", 7168, 4096, 32, (128, 128), True, True),
    ]
    for name, r, c, b, block, wq, wqt in cases:
        both, gathered = block in ("both", "gather"), block == "gather"
        br, bc = (1, 128) if both else block
        src_rows = r // 8 if gathered else 0
        idx = (torch.randperm(r, device=dev) % src_rows).to(torch.int32) if gathered else None
        x = torch.randn(b, src_rows or r, c, device=dev, dtype=torch.bfloat16)
        q = torch.empty(b, r, c, device=dev, dtype=torch.uint8) if wq else None
        qt = torch.empty(b, c, r, device=dev, dtype=torch.uint8) if wqt else None
        ns = b * (r if br == 1 else (r + 127) // 128) * (c if bc == 1 else (c + 127) // 128)
        sc = torch.empty(ns, device=dev, dtype=torch.float32)
        d = QuantDesc(ctypes.sizeof(QuantDesc), b, r, c, r, SL_DTYPE_BF16, br, bc, 0, src_rows)
        if both:
            sct = torch.empty(b * ((r + 127) // 128) * c, device=dev, dtype=torch.float32)
            ns += sct.numel()

            def call(d=d, x=x, q=q, sc=sc, qt=qt, sct=sct, idx=idx):
                st = lib.sl_quantize_fp8_both_cuda(
                    ctypes.byref(d),
                    x.data_ptr(),
                    None,
                    None if idx is None else idx.data_ptr(),
                    q.data_ptr(),
                    sc.data_ptr(),
                    qt.data_ptr(),
                    sct.data_ptr(),
                    torch.cuda.current_stream().cuda_stream,
                )
                check(lib, st, "quantize_fp8_both")

        else:
            call = quantize_call(lib, d, x, q, qt, sc)
        ms = time_cuda({"q": call}, args.iters)["q"]
        record(name, r, c, b, ms, b * r * c * (2 + int(wq) + int(wqt)) + 4 * ns)
    # what the memory does for a plain copy (torch, 1 GiB read + 1 GiB written): the attainable rate
    a = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    bb = torch.empty_like(a)
    ms = time_cuda({"copy": lambda: bb.copy_(a)}, args.iters)["copy"]
    record("copy (torch, for reference)", 1, a.numel(), 1, ms, 2 * a.numel())
    return rows


def _run_calls(lib, seq):
    for fn, a in seq:
        check(lib, fn(*a), fn.__name__)


def bench_swiglu_quantize(lib, args):
    """The SwiGLU's activation (gradient) quantized in both layouts as it is computed
    (sl_swiglu_quantize_fp8_cuda, sl_swiglu_bwd_quantize_fp8_cuda) against the two passes it
    replaces (sl_swiglu_*_cuda writing bf16, then sl_quantize_fp8_both_cuda), with row weights, at
    DeepSeek-V3's expert width and dsv3-proxy's. GB/s counts each path's own bytes."""
    import torch

    dev, vp = torch.device("cuda"), ctypes.c_void_p
    lib.sl_swiglu_fwd_cuda.argtypes = [ctypes.POINTER(SwigluDesc)] + [vp] * 5
    lib.sl_swiglu_bwd_cuda.argtypes = [ctypes.POINTER(SwigluDesc)] + [vp] * 7
    lib.sl_swiglu_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [vp] * 8
    lib.sl_swiglu_bwd_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [vp] * 10
    rows = []
    for m, f in ((32768, 2048), (65536, 256)):
        h = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16)
        dact = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
        w = torch.rand(m, device=dev)
        gs = torch.tensor([m], device=dev, dtype=torch.int32)
        s = torch.cuda.current_stream().cuda_stream
        for bwd in (False, True):
            c = 2 * f if bwd else f
            d = QuantDesc(ctypes.sizeof(QuantDesc), 1, m, c, m, SL_DTYPE_BF16, 1, 128, 0, 0)
            sd = SwigluDesc(ctypes.sizeof(SwigluDesc), m, f, 1, SL_DTYPE_BF16, 0)
            q = torch.empty(m, c, device=dev, dtype=torch.uint8)
            qt = torch.empty(c, m, device=dev, dtype=torch.uint8)
            sc = torch.empty(m * ((c + 127) // 128), device=dev)
            sct = torch.empty(((m + 127) // 128) * c, device=dev)
            parts = torch.empty(m, (f + 127) // 128, device=dev)
            mid = torch.empty(m, c, device=dev, dtype=torch.bfloat16)
            dw = torch.empty(m, device=dev)
            outs = [t.data_ptr() for t in (q, sc, qt, sct)]
            hp, wp, dap, mp = h.data_ptr(), w.data_ptr(), dact.data_ptr(), mid.data_ptr()
            if bwd:
                fused = [
                    (
                        lib.sl_swiglu_bwd_quantize_fp8_cuda,
                        (ctypes.byref(d), dap, hp, wp, None, *outs, parts.data_ptr(), s),
                    )
                ]
                passes = [
                    (
                        lib.sl_swiglu_bwd_cuda,
                        (ctypes.byref(sd), dap, hp, wp, gs.data_ptr(), mp, dw.data_ptr(), s),
                    )
                ]
            else:
                fused = [
                    (lib.sl_swiglu_quantize_fp8_cuda, (ctypes.byref(d), hp, wp, None, *outs, s))
                ]
                passes = [
                    (lib.sl_swiglu_fwd_cuda, (ctypes.byref(sd), hp, wp, gs.data_ptr(), mp, s))
                ]
            passes.append(
                (lib.sl_quantize_fp8_both_cuda, (ctypes.byref(d), mp, None, None, *outs, s))
            )
            calls = {
                name: functools.partial(_run_calls, lib, seq)
                for name, seq in (("fused", fused), ("passes", passes))
            }  # fmt: skip
            ms = time_cuda(calls, args.iters)
            # bytes: h (4F), dact (2F) in the backward; q, q_t (1 each an element); the scales;
            # the two passes also write and read the bf16 activation (gradient)
            scales = 4 * (sc.numel() + sct.numel())
            moved = m * (4 * f + (2 * f if bwd else 0) + 2 * c) + scales
            what = "gradient" if bwd else "activation"
            for name, nbytes in (("fused", moved), ("passes", moved + 4 * m * c)):
                label = "one pass" if name == "fused" else "two passes (bf16 written, read back)"
                gbs = nbytes / ms[name] / 1e6
                rows.append({
                    "case": f"SwiGLU {what} -> both layouts, {label} (F {f})",
                    "rows": m, "cols": c, "batch": 1, "ms": ms[name], "GB/s": gbs,
                    "hbm_share": gbs / (HBM_TBS * 1000),
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def median_ratio(rows, a, b):
    v = [r["tflops"][a] / r["tflops"][b] for r in rows if a in r["tflops"] and b in r["tflops"]]
    return (statistics.median(v), min(v)) if v else (float("nan"), float("nan"))


def merge(args):
    with open(args.merge) as f:
        data = json.load(f)
    meta, rows, qrows = data["meta"], data["rows"], data["quantize"]
    cols = [
        "sluice_fp8_gmm",
        "sluice_bf16_gmm",
        "torch_scaled_grouped_mm",
        "cublas_fp8_blockwise",
        "cublas_fp8_rowwise",
        "cublas_fp8_tensorwise",
        "torch_grouped_mm_bf16",
        "sluice_fp8_tgmm",
        "sluice_bf16_tgmm",
    ]
    head = (
        f"Command: `{meta['command']}`. {meta['date'][:10]}, torch {meta['torch']}, CUDA "
        f"{meta['cuda']}, {meta.get('iters', '?')} timed runs per call, calls queued back to "
        "back. TFLOP/s = 2*M*K*N / time; dense peers at equal FLOPs ([M, K] x [K, N])."
    )
    out = [f"# FP8 grouped GEMM: {meta['device']}", "", head, ""]
    out.append(
        "| shape | dist | " + " | ".join(cols) + " | fp8/bf16 gmm | fp8/scaled_grouped | "
        "fp8/cublas blockwise | fp8/bf16 tgmm | % of FP8 peak (gmm, tgmm) |"
    )
    out.append("|" + "---|" * (len(cols) + 7))
    for r in rows:
        tf = r["tflops"]
        cell = [f"{tf[c]:.0f}" if c in tf else "-" for c in cols]

        def ratio(a, b, tf=tf):
            return f"{tf[a] / tf[b]:.2f}x" if a in tf and b in tf else "-"

        share = (
            f"{100 * tf.get('sluice_fp8_gmm', 0) / FP8_PEAK:.0f}%, "
            f"{100 * tf.get('sluice_fp8_tgmm', 0) / FP8_PEAK:.0f}%"
        )
        out.append(
            f"| {r['shape']} | {r['dist']} | "
            + " | ".join(cell)
            + " | "
            + " | ".join(
                [
                    ratio("sluice_fp8_gmm", "sluice_bf16_gmm"),
                    ratio("sluice_fp8_gmm", "torch_scaled_grouped_mm"),
                    ratio("sluice_fp8_gmm", "cublas_fp8_blockwise"),
                    ratio("sluice_fp8_tgmm", "sluice_bf16_tgmm"),
                    share,
                ]
            )
            + " |"
        )
    out.append("")
    for a, b, what in [
        ("sluice_fp8_gmm", "sluice_bf16_gmm", "FP8 gmm / BF16 gmm"),
        ("sluice_fp8_gmm", "torch_scaled_grouped_mm", "FP8 gmm / torch._scaled_grouped_mm"),
        ("sluice_fp8_gmm", "cublas_fp8_blockwise", "FP8 gmm / cuBLAS blockwise"),
        ("sluice_fp8_tgmm", "sluice_bf16_tgmm", "FP8 tgmm / BF16 tgmm"),
    ]:
        med, lo = median_ratio(rows, a, b)
        if not np.isnan(med):  # (NaN: the peer failed on every shape)
            out.append(f"- {what}: median {med:.2f}x, min {lo:.2f}x")
        else:
            out.append(f"- {what}: no figure (the peer failed, below)")
    errs = [(r["gmm_rel_err"], r["tgmm_rel_err"]) for r in rows]
    out.append(
        f"- largest relative error against BF16 grouped_mm of the dequantized operands: gmm "
        f"{max(e[0] for e in errs):.1e}, tgmm {max(e[1] for e in errs):.1e}"
    )
    failed = {n for r in rows for n in r.get("errors", {})}
    if failed:
        first = {n: next(r["errors"][n] for r in rows if n in r.get("errors", {})) for n in failed}
        out.append(
            "- peers that failed: "
            + "; ".join(f"{n}: {' '.join(e.split())[:160]}" for n, e in first.items())
        )
    out += [
        "",
        "## Quantization (bf16 -> e4m3 + f32 scales)",
        "",
        "| case | rows x cols (x batch) | ms | GB/s | share of 4.8 TB/s | of the copy rate |",
        "|---|---|---|---|---|---|",
    ]
    copy = next((q["GB/s"] for q in qrows if q["case"].startswith("copy")), None)
    for q in qrows:
        of_copy = f"{100 * q['GB/s'] / copy:.0f}%" if copy else "-"
        out.append(
            f"| {q['case']} | {q['rows']} x {q['cols']} (x {q['batch']}) | {q['ms']:.3f} | "
            f"{q['GB/s']:.0f} | {100 * q['hbm_share']:.0f}% | {of_copy} |"
        )
    if meta.get("clock"):
        out += ["", f"SM clock and board power while the benchmark ran: {meta['clock']}"]
    with open(args.md, "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lib", default="build-gpu/libsluice_gpu.so")
    p.add_argument("--shapes", default="bench,deepgemm", help="tests/shapes.py sets; none: no GEMM")
    p.add_argument("--dists", default="uniform,skewed")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fp8.json")
    p.add_argument("--command", default="bash bench/run_fp8_gpu.sh")
    p.add_argument(
        "--clock", default="", help="a line on the clock and power seen (run_fp8_gpu.sh)"
    )
    p.add_argument("--merge")
    p.add_argument("--md", default="fp8.md")
    args = p.parse_args()
    if args.merge:
        if args.clock:
            with open(args.merge) as f:
                data = json.load(f)
            data["meta"]["clock"] = args.clock
            with open(args.merge, "w") as f:
                json.dump(data, f, indent=1)
        merge(args)
        return
    import torch

    lib = open_lib(args.lib)
    rows = []
    for spec in args.shapes.split(","):
        for shape in select_shapes(spec) if spec != "none" else ():
            rows += bench_shape(lib, shape, args)
            torch.cuda.empty_cache()
    qrows = bench_quantize(lib, args) + bench_swiglu_quantize(lib, args)
    meta = torch_meta(args, command=args.command)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "quantize": qrows}, f, indent=1)


if __name__ == "__main__":
    main()

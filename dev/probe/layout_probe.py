"""Probe (session 16, 2026-11-24): does the weights' layout change the rate of a grouped GEMM?

N-major weights [G, K, N] (the benchmark's layout) against K-major [G, N, K]: sluice gmm with V_FB
forced both ways (transpose_rhs for K-major), the library's default for reference,
torch._grouped_mm and dense cuBLAS (torch.mm) on the same two layouts. In turn, queued, as
bench/bench_gmm.py. Run from the repository root on one GPU:
  python3 dev/probe/layout_probe.py build-gpu/libsluice_gpu.so
Results: bench/results/layout-probe-20261124.txt.
"""

import ctypes
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

import torch
from bench_gmm import SL_DTYPE_BF16, GmmDesc, ShapeCalls, open_lib, time_cuda
from shapes import SHAPES, group_sizes


def gmm_call(lib, desc, sc, w, gs, out):
    def f():
        ptrs = (sc.x.data_ptr(), w.data_ptr(), gs.data_ptr(), None, out.data_ptr())
        if lib.sl_gmm_cuda(ctypes.byref(desc), *ptrs, sc.ws.data_ptr(), sc.stream) != 0:
            raise RuntimeError(lib.sl_last_error().decode())

    return f


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def probe_shape(lib_default, lib_fb, shape):
    sc = ShapeCalls(lib_default, shape)
    m, g, k, n = shape.m, shape.g, shape.k, shape.n
    wt = sc.w.transpose(-2, -1).contiguous()  # [G, N, K]
    wdt = sc.w_dense.t().contiguous()  # [N, K]
    out_fb = torch.empty_like(sc.out)
    bf16 = SL_DTYPE_BF16
    desc_t = GmmDesc(ctypes.sizeof(GmmDesc), 1, m, k, n, g, g, bf16, bf16, bf16, 1)  # transpose_rhs
    for dist in ("uniform", "skewed"):
        sizes = group_sizes(shape, dist, seed=0)
        gs = torch.tensor(sizes, device="cuda", dtype=torch.int32)
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        fns = {
            "sl_default": gmm_call(lib_default, sc.desc, sc, sc.w, gs, sc.out),
            "sl_fb_nmajor": gmm_call(lib_fb, sc.desc, sc, sc.w, gs, out_fb),
            "sl_fb_kmajor": gmm_call(lib_fb, desc_t, sc, wt, gs, out_fb),
            "torch_nmajor": lambda offs=offs: torch._grouped_mm(sc.x, sc.w, offs=offs),
            "torch_kmajor": lambda offs=offs: torch._grouped_mm(
                sc.x, wt.transpose(-2, -1), offs=offs
            ),
            "cublas_nmajor": lambda: torch.mm(sc.x, sc.w_dense),
            "cublas_kmajor": lambda: torch.mm(sc.x, wdt.t()),
        }
        ref = torch._grouped_mm(sc.x, sc.w, offs=offs)
        errs = []
        for name in ("sl_default", "sl_fb_nmajor", "sl_fb_kmajor"):
            # each library copy reads SLUICE_GMM_VARIANT once, at its first call (this one)
            if name != "sl_default":
                os.environ["SLUICE_GMM_VARIANT"] = "18"
            fns[name]()
            torch.cuda.synchronize()
            os.environ.pop("SLUICE_GMM_VARIANT", None)
            errs.append(rel_err(sc.out if name == "sl_default" else out_fb, ref))
        t = time_cuda(fns, 30)
        tf = {name: round(sc.flops / v / 1e9, 1) for name, v in t.items()}
        row = {"shape": shape.name, "dist": dist, "err": [f"{e:.1e}" for e in errs], "tflops": tf}
        print(json.dumps(row), flush=True)


def main():
    # Two copies of the library, one for the default variant and one for V_FB.
    os.environ.pop("SLUICE_GMM_VARIANT", None)
    shutil.copy(sys.argv[1], "/tmp/layout_probe_a.so")
    shutil.copy(sys.argv[1], "/tmp/layout_probe_b.so")
    lib_default = open_lib("/tmp/layout_probe_a.so")
    lib_fb = open_lib("/tmp/layout_probe_b.so")
    for shape in SHAPES:
        probe_shape(lib_default, lib_fb, shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

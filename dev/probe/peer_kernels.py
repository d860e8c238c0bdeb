"""Which kernels the benchmark's peers run, and one peer's calls for a profiler (session 26).

  python3 dev/probe/peer_kernels.py --names [--lib build-gpu/libsluice_gpu.so]
      every implementation of bench/bench_gmm.py (sluice, torch._grouped_mm, cuBLAS dense and batched)
      on each bench shape (uniform sizes): the CUDA kernels one call launches (torch.profiler), with
      their GPU time
  python3 dev/probe/peer_kernels.py --run cublas_batched --shape dsv3-down-ep8 [--dist uniform] [--reps 4]
      that implementation's call, --reps times (for `ncu --launch-skip ... --launch-count 1`;
      dev/probe/peer_kernels.sh does both)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from bench_gmm import ShapeCalls, open_lib
from shapes import SHAPES, group_sizes


def calls_for(lib, shape, dist, seed=0):
    sc = ShapeCalls(lib, shape)
    calls, _ = sc.calls(group_sizes(shape, dist, seed=seed))
    return sc, calls


def names(lib):
    import torch
    from torch.profiler import ProfilerActivity, profile

    for shape in SHAPES:
        sc, calls = calls_for(lib, shape, "uniform")
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            for ev in prof.events():
                if str(ev.device_type).endswith("CUDA"):
                    us = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
                    tf = sc.flops / us / 1e6 if us > 50 else 0.0
                    print(f"{shape.name:16s} {name:24s} {us:9.1f} us {tf:6.1f} TF/s  {ev.name}")
        del sc, calls
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default="build-gpu/libsluice_gpu.so")
    p.add_argument("--names", action="store_true")
    p.add_argument("--run")
    p.add_argument("--shape", default="dsv3-down-ep8")
    p.add_argument("--dist", default="uniform")
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    lib = open_lib(args.lib)
    if args.names:
        names(lib)
    if args.run:
        import torch

        shape = next(s for s in SHAPES if s.name == args.shape)
        _, calls = calls_for(lib, shape, args.dist)
        for _ in range(args.reps):
            calls[args.run]()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

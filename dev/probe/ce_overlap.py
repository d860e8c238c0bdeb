"""Copy engines beside compute: does a peer copy over NVLink slow a GEMM that runs at the same time,
and how fast do the copies go? (The question session 41 left: sluice.ep's exchange moves rows with
SM loads and stores, so beside compute it takes SMs; copies by the copy engines take none.)

    python3 dev/probe/ce_overlap.py [--peers 3] [--mib 64] [--reps 20]

On GPU 0: a bf16 GEMM loop alone; copies of --mib MiB from GPU 0 to each of --peers peers (one stream
a peer, cudaMemcpyPeerAsync through torch) alone; then both at once. Prints times and GB/s."""

from __future__ import annotations

import argparse

import torch


def timed(fn, streams):
    starts = [torch.cuda.Event(enable_timing=True) for _ in streams]
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    torch.cuda.synchronize()
    for s, e in zip(streams, starts):
        e.record(s)
    fn()
    for s, e in zip(streams, ends):
        e.record(s)
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(starts, ends)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peers", type=int, default=min(3, torch.cuda.device_count() - 1))
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--n", type=int, default=8192, help="GEMM size n x n x n")
    a = p.parse_args()
    torch.cuda.set_device(0)
    n = a.n
    x = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    src = torch.empty(a.mib << 20, dtype=torch.uint8, device="cuda:0")
    dsts = [torch.empty_like(src, device=f"cuda:{d}") for d in range(1, a.peers + 1)]
    gemm_s = torch.cuda.Stream(0)
    copy_s = [torch.cuda.Stream(0) for _ in dsts]

    def gemms(reps):
        with torch.cuda.stream(gemm_s):
            for _ in range(reps):
                torch.mm(x, y)

    def copies(reps):
        for s, d in zip(copy_s, dsts):
            with torch.cuda.stream(s):
                for _ in range(reps):
                    d.copy_(src, non_blocking=True)

    gemms(3)  # warm up
    copies(2)
    flops = 2 * n**3 * a.reps
    nbytes = src.numel() * a.reps
    (tg,) = timed(lambda: gemms(a.reps), [gemm_s])
    tc = timed(lambda: copies(a.reps), copy_s)
    both = timed(lambda: (gemms(a.reps), copies(a.reps)), [gemm_s, *copy_s])
    tflops = lambda ms: flops / ms / 1e9
    gbs = lambda ms: nbytes / ms / 1e6
    print(
        f"{torch.cuda.get_device_name(0)}, {a.peers} peers, {a.mib} MiB copies, {n}^3 GEMMs x{a.reps}"
    )
    print(f"GEMM alone:   {tg:8.2f} ms  {tflops(tg):7.1f} TFLOP/s")
    print(
        "copies alone: "
        + ", ".join(f"{t:.2f} ms {gbs(t):.0f} GB/s" for t in tc)
        + f"  (sum {sum(gbs(t) for t in tc):.0f} GB/s)"
    )
    print(
        f"together:     GEMM {both[0]:8.2f} ms  {tflops(both[0]):7.1f} TFLOP/s ({tg / both[0]:.3f}x); "
        + "copies "
        + ", ".join(f"{t:.2f} ms {gbs(t):.0f} GB/s" for t in both[1:])
    )


if __name__ == "__main__":
    main()

"""What limits the grouped GEMMs on a Hopper GPU: clock and power under sustained load, and work per
clock cycle, for sluice gmm/tgmm, torch._grouped_mm and dense cuBLAS on the same inputs.

  python3 bench/clocks_gmm.py --part sustained --lib build-gpu/libsluice_gpu.so --out clocks.json
  ncu --clock-control none --nvtx --nvtx-include "prof/" --set full -o prof \\
      python3 bench/clocks_gmm.py --part ncu --lib build-gpu/libsluice_gpu.so
  (bench/run_clocks_gpu.sh runs both and writes the table.)

--part sustained: each implementation runs back to back (no host synchronisation) for --seconds
while `nvidia-smi` samples the SM clock, the power draw and the clock-event reasons every 50 ms;
implementations take turns, --rounds times. Reported: TFLOP/s over the whole stretch (CUDA events),
the median SM clock and power in its second half, and TFLOP/s / (SMs * 4096 * clock), the fraction
of the tensor pipe's dense bf16 peak at the clock the chip actually ran (4096 flop/clock/SM: 989
TFLOP/s at 1.83 GHz on 132 SMs). With --zeros the inputs are zeros (the same work, less switching
power in the multipliers): if the chip is power-bound, the clock and the rate rise.

--part ncu: one call of each implementation inside an NVTX range "prof" (after warm-up outside it),
for Nsight Compute to count tensor-pipe cycles at whatever clock it finds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gmm import ShapeCalls, open_lib
from shapes import SHAPES, group_sizes

FLOP_PER_CLK_SM = 4096  # dense bf16 wgmma, per SM per clock
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class Sampler:
    """nvidia-smi every 50 ms in the background; samples() returns (host time, fields) pairs."""

    def __init__(self):
        query = QUERY
        probe = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
        if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
            # older drivers name them "throttle" reasons
            query = query.replace("clocks_event_reasons", "clocks_throttle_reasons")
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.rows = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 4:
                self.rows.append((time.time(), parts))

    def window(self, t0, t1):
        return [p for t, p in self.rows if t0 <= t <= t1]

    def stop(self):
        self.proc.terminate()


def sustained(fn, flops, seconds, sampler):
    import torch

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # one call's time, to queue enough calls for `seconds`
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    n = max(int(seconds * 1e3 / e0.elapsed_time(e1)), 10)
    t0 = time.time()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    t1 = time.time()
    ms = e0.elapsed_time(e1)
    samples = sampler.window(t0 + (t1 - t0) / 2, t1)  # the second half: settled clocks
    clk = [float(p[0]) for p in samples if p[0].replace(".", "").isdigit()]
    pwr = [float(p[1]) for p in samples if p[1].replace(".", "").isdigit()]
    reasons = sorted({p[3] for p in samples})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tflops = flops * n / ms / 1e9
    mhz = statistics.median(clk) if clk else None
    return {
        "calls": n,
        "ms_per_call": ms / n,
        "tflops": tflops,
        "sm_mhz": mhz,
        "power_w": statistics.median(pwr) if pwr else None,
        "temp_c": statistics.median(float(p[2]) for p in samples) if samples else None,
        "event_reasons": reasons,
        "samples": len(samples),
        "tensor_frac_at_clock": tflops * 1e12 / (sms * FLOP_PER_CLK_SM * mhz * 1e6)
        if mhz
        else None,
    }


def _round(v):
    return round(v, 3) if isinstance(v, float) else v


def _shapes(args):
    return [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]


def _impls(args, calls):
    return args.impls.split(",") if args.impls else list(calls)


def part_sustained(args):
    import torch

    lib = open_lib(args.lib)
    sampler = Sampler()
    time.sleep(1.0)
    limit = subprocess.run(
        ["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    rows = []
    shapes = _shapes(args)
    # (zeros, shapes, distributions, implementations kept): zeros make their point on one shape
    # against one peer
    passes = [(False, shapes, args.dists.split(","), None)]
    if args.zeros:
        passes.append((True, shapes[:1], ["uniform"], ("sluice_gmm", "cublas_dense")))
    for zeros, pass_shapes, dists, keep in passes:
        for shape in pass_shapes:
            sc = ShapeCalls(lib, shape, zeros=zeros)
            for dist in dists:
                calls, _ = sc.calls(group_sizes(shape, dist, seed=0))
                names = [n for n in _impls(args, calls) if keep is None or n in keep]
                for rnd in range(args.rounds):
                    for name in names:
                        r = sustained(calls[name], sc.flops, args.seconds, sampler)
                        r.update(shape=shape.name, dist=dist, impl=name, round=rnd, zeros=zeros)
                        rows.append(r)
                        print(json.dumps({k: _round(v) for k, v in r.items()}), flush=True)
                del calls
            del sc
            torch.cuda.empty_cache()
    sampler.stop()
    meta = {
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "power_limit_and_max_clock": limit,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "seconds": args.seconds,
        "sluice_variant": {
            op: os.environ.get(f"SLUICE_{op.upper()}_VARIANT", "default") for op in ("gmm", "tgmm")
        },
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def part_ncu(args):
    import torch

    lib = open_lib(args.lib)
    for shape in _shapes(args):
        sc = ShapeCalls(lib, shape)
        calls, _ = sc.calls(group_sizes(shape, "uniform", seed=0))
        for fn in (calls[n] for n in _impls(args, calls)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("prof")  # ncu keeps these kernels
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        del sc, calls
        torch.cuda.empty_cache()


def table(args):
    with open(args.table) as f:
        d = json.load(f)
    m = d["meta"]
    lines = [
        f"# Clocks, power and work per cycle under sustained load ({m['date'][:10]})",
        "",
        (
            f"Device: {m['device']} ({m['sms']} SMs; power limit, max SM clock: "
            f"{m['power_limit_and_max_clock']}); torch {m['torch']}. Produced by "
            "bench/clocks_gmm.py --part sustained (bench/run_gpu.sh, bench/run_clocks_gpu.sh, "
            "dev/cuda/sustained.sh): each implementation back to back for "
            f"{m['seconds']} s, nvidia-smi sampled every 50 ms (median of the second half). "
            "'of peak at clock' = TFLOP/s / (SMs x 4096 flop x SM clock). sluice kernel variant: "
            f"{m.get('sluice_variant', 'default')}."
        ),
        "",
        (
            "| shape | sizes | inputs | implementation | round | TFLOP/s | SM MHz | power W | temp C "
            "| of peak at clock | clock-event reasons |"
        ),
        "|" + "---|" * 11,
    ]
    for r in d["rows"]:

        def f(v, p=1):
            return "-" if v is None else f"{v:.{p}f}"

        lines.append(
            f"| {r['shape']} | {r.get('dist', 'uniform')} | {'zeros' if r['zeros'] else 'random'} "
            f"| {r['impl']} | {r['round']} "
            f"| {f(r['tflops'])} | {f(r['sm_mhz'], 0)} | {f(r['power_w'], 0)} | {f(r['temp_c'], 0)} "
            f"| {f(100 * r['tensor_frac_at_clock'] if r['tensor_frac_at_clock'] else None)}% "
            f"| {' '.join(r['event_reasons'])} |"
        )
    # sluice / peer on the same case (shape, sizes, round), random inputs
    tf = {
        (r["shape"], r.get("dist", "uniform"), r["round"], r["impl"]): r["tflops"]
        for r in d["rows"]
        if not r["zeros"]
    }
    pairs = (
        ("gmm/torch", "sluice_gmm", "torch_grouped_mm"),
        ("gmm/cublas", "sluice_gmm", "cublas_dense"),
        ("tgmm/torch", "sluice_tgmm", "torch_grouped_mm_wgrad"),
    )
    summary = []
    for label, a, b in pairs:
        v = [
            tf[c + (a,)] / tf[c + (b,)]
            for c in {k[:3] for k in tf}
            if c + (a,) in tf and c + (b,) in tf
        ]
        if v:
            summary.append(
                f"| {label} | {statistics.median(v):.2f}x | {min(v):.2f}x | {max(v):.2f}x | {len(v)} |"
            )
    if summary:
        lines += [
            "",
            "| ratio (sustained) | median | min | max | cases |",
            "|---|---|---|---|---|",
        ] + summary
    with open(args.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=["sustained", "ncu"])
    p.add_argument("--lib", default="build-gpu/libsluice_gpu.so")
    p.add_argument("--out", default="clocks.json")
    p.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--impls", default="", help="comma-separated implementations (default: all)")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dists", default="uniform", help="group-size distributions (bench/shapes.py)")
    p.add_argument("--zeros", action="store_true", help="also run the first shape on zeros")
    p.add_argument("--table", help="write the markdown table of this JSON to --md")
    p.add_argument("--md", default="clocks.md")
    args = p.parse_args()
    if args.table:
        table(args)
    elif args.part == "sustained":
        part_sustained(args)
    elif args.part == "ncu":
        part_ncu(args)
    else:
        p.error("give --part or --table")


if __name__ == "__main__":
    main()

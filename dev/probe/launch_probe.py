"""How much of a call timed on its own (bench_gmm.py --timing synced) is the host's launch path?

  python3 dev/probe/launch_probe.py build-gpu/libsluice_gpu.so      (one GPU; bench/ on the path)

For each shape, size pattern and implementation of bench_gmm.py: the median CUDA-event time of the
call waited for on its own ("plain"), of the same call queued behind a ~60 us GPU spin so that the
first event fires when its first kernel can start ("sleep"), their difference, and the host's enqueue
time. Result of 2026-11-24: bench/results/launch-probe-20261124.txt."""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from bench_gmm import ShapeCalls, open_lib  # noqa: E402
from shapes import SHAPES, group_sizes  # noqa: E402

lib = open_lib(sys.argv[1])
for shape in SHAPES:
    sc = ShapeCalls(lib, shape)
    for dist in ("uniform", "skewed"):
        calls, offs = sc.calls(group_sizes(shape, dist))
        for fn in calls.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        names = list(calls)
        res = {n: {"plain": [], "sleep": [], "host": []} for n in names}
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for it in range(30):
            for n in names[it % len(names):] + names[: it % len(names)]:
                fn = calls[n]
                for mode in ("plain", "sleep"):
                    if mode == "sleep":
                        torch.cuda._sleep(100000)  # ~60 us of spinning: the call queues behind it
                    e0.record()
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    e1.record()
                    e1.synchronize()
                    res[n][mode].append(e0.elapsed_time(e1))
                    res[n]["host"].append((t1 - t0) * 1e3)
        line = [f"{shape.name}/{dist}"]
        for n in names:
            p = statistics.median(res[n]["plain"]); s = statistics.median(res[n]["sleep"]); h = statistics.median(res[n]["host"])
            line.append(f"{n}: plain {p:.4f} sleep {s:.4f} ms diff {(p-s)*1e3:.1f}us host {h*1e3:.1f}us")
        print("\n  ".join(line), flush=True)
    del sc
    torch.cuda.empty_cache()

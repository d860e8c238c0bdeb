"""Grouped GEMM benchmark: sluice gmm/tgmm against torch._grouped_mm, cuBLAS (one dense product, and
batched over equal-size groups) and jax ragged_dot.

Run on one GPU (bench/run_gpu.sh does it):
  python3 bench/bench_gmm.py --part torch --lib build-gpu/libsluice_gpu.so --out torch.json
  python3 bench/bench_gmm.py --part jax --out jax.json        (a second process: JAX owns its memory)
  python3 bench/bench_gmm.py --merge torch.json jax.json --md gmm.md --json gmm.json

Shapes and group sizes: tests/shapes.py, the one list the tests use too. TFLOP/s = 2*M*K*N / time,
M = sum of group sizes. Timing: CUDA events, median of --iters runs after warm-up (torch part); the JAX part times
block_until_ready wall clock, which adds microseconds to calls of tens of milliseconds. Every input
here is larger than the L2 (50-60 MB), so inputs are not rotated.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from shapes import DISTRIBUTIONS, group_sizes, select_shapes

JIT_CALLS = 8  # sluice calls per jit program in the JAX part


def _c_structs():
    """python/sluice/ops/c_structs.py, loaded by its path: the harnesses run without the package."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "sluice", "ops")
    spec = importlib.util.spec_from_file_location(
        "sluice_c_structs", os.path.join(path, "c_structs.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the C API's descriptors, for this file, bench_fp8.py and tests/gpu/test_quantize_fp8.py
_C = _c_structs()
GmmDesc, QuantDesc, SwigluDesc = _C.GmmDesc, _C.QuantDesc, _C.SwigluDesc
SL_DTYPE_BF16 = _C.DTYPE_CODES["bfloat16"]


def time_cuda(fns, iters, warmup=3, info=None, mode="queued", flush_l2=True):
    """Median milliseconds of each callable in `fns`: GPU time between two CUDA events around it.
    The callables take turns within every iteration, so clock drift during the run (the dense cuBLAS
    figure moves by 10-20% between runs on H200) hits them all alike and the ratios stay fair. The
    order rotates by one each iteration: the chip runs at its power cap and its clock lags the load,
    so a call starts at the clock its predecessor left.

    flush_l2 (the default): a 256 MiB memset, outside the events, before every timed call, so each
    call starts with none of its operands in the 50 MB L2, as a model's weights are. Without it a
    call found in L2 whatever its predecessor left there: rotating the order keeps each call's
    predecessor the same, and a call that follows another on the same operands ran up to ~25%
    faster on problems of tens of microseconds (the small-groups sweep's forced tile widths against
    the same kernel unforced).

    mode "queued" (the default): every call of every iteration is queued before any is waited for,
    so the GPU runs them back to back, as in a training step: the host's launch path (4-140 us per
    call on the H200 machines: ctypes, torch's dispatcher, cuBLAS's setup) is not in the figures,
    and no call starts from an idle GPU. mode "synced": each call is waited for before the next is
    issued, so each figure includes that call's launch path and the GPU idles between calls; it put
    sluice ~1% higher against torch. `info`, a dict, gets the largest gap the GPU saw between
    two queued calls (ms).

    mode "graph": each callable is captured once into a CUDA graph and the replays are queued as
    above: the GPU time of the call's kernels (and memsets) alone. Problems of tens of
    microseconds need it: there the host's launch path of a queued call can outlast the GPU's work,
    the queue drains, and the event pair of a call would also time its launch."""
    import torch

    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None

    def flush():
        if scratch is not None:
            scratch.zero_()

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    if mode == "graph":
        graphs = {}
        for name, fn in fns.items():
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        fns = {name: g.replay for name, g in graphs.items()}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        mode = "queued"
    times = {name: [] for name in fns}
    names = list(fns)
    order = [n for it in range(iters) for n in names[it % len(names) :] + names[: it % len(names)]]
    if mode == "synced":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name in order:
            flush()
            e0.record()
            fns[name]()
            e1.record()
            e1.synchronize()
            times[name].append(e0.elapsed_time(e1))
    elif mode == "queued":
        evs = []
        for name in order:
            ef, e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            ef.record()
            flush()
            e0.record()
            fns[name]()
            e1.record()
            evs.append((name, ef, e0, e1))
        torch.cuda.synchronize()
        for name, _, e0, e1 in evs:
            times[name].append(e0.elapsed_time(e1))
        if info is not None:  # a call's end to the next flush's start: idle GPU time
            gaps = [evs[i][3].elapsed_time(evs[i + 1][1]) for i in range(len(evs) - 1)]
            info["max_gap_ms"] = max(gaps, default=0.0)
    else:
        raise ValueError(f"unknown timing mode {mode!r}")
    return {name: statistics.median(v) for name, v in times.items()}


class ShapeCalls:
    """Inputs of one shape on the GPU (bf16, seed 0) and, per group-size vector, the timed calls:
    sluice gmm/tgmm through the C API, torch._grouped_mm (forward, weight gradient), a dense
    cuBLAS product of the same FLOPs and, where G divides M, cuBLAS batched over G groups of M/G
    rows (forward and weight gradient)."""

    def __init__(self, lib, shape, zeros=False):
        import torch

        dev = torch.device("cuda")
        m, g, k, n = shape.m, shape.g, shape.k, shape.n
        torch.manual_seed(0)
        make = torch.zeros if zeros else torch.randn
        self.lib, self.shape, self.flops = lib, shape, 2.0 * m * k * n
        self.x = make(m, k, device=dev, dtype=torch.bfloat16)
        self.w = make(g, k, n, device=dev, dtype=torch.bfloat16) * 0.02
        self.dy = make(m, n, device=dev, dtype=torch.bfloat16)
        self.w_dense = make(k, n, device=dev, dtype=torch.bfloat16) * 0.02
        self.out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        self.dw = torch.empty(g, k, n, device=dev, dtype=torch.bfloat16)
        # cuBLAS batched at equal FLOPs: the same problem with every group M/G rows (no ragged edge),
        # the weight gradient writing the same G*K*N output; the ceiling of a grouped kernel that
        # tgmm's dense reference (one M x K x N product, a K x N output) is not
        self.batched = m % g == 0
        if self.batched:
            self.xb = self.x.view(g, m // g, k)
            self.dyb = self.dy.view(g, m // g, n)
            self.out_b = torch.empty(g, m // g, n, device=dev, dtype=torch.bfloat16)
            self.dw_b = torch.empty(g, k, n, device=dev, dtype=torch.bfloat16)
        self.desc = GmmDesc(
            ctypes.sizeof(GmmDesc), 1, m, k, n, g, g, SL_DTYPE_BF16, SL_DTYPE_BF16, SL_DTYPE_BF16, 0
        )
        nws = max(lib.sl_gmm_cuda_workspace_size(ctypes.byref(self.desc)), 16)
        self.ws = torch.empty(nws, device=dev, dtype=torch.uint8)

    def calls(self, sizes):
        """{name: callable} for these group sizes (numpy int32 [G]), plus the offsets tensor."""
        import torch

        gs = torch.tensor(sizes, device=self.x.device, dtype=torch.int32)
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        x, w, dy, lib, desc = self.x, self.w, self.dy, self.lib, self.desc

        def sl_gmm():
            ptrs = (x.data_ptr(), w.data_ptr(), gs.data_ptr(), None, self.out.data_ptr())
            stream = torch.cuda.current_stream().cuda_stream  # (a capture's own stream in "graph")
            if lib.sl_gmm_cuda(ctypes.byref(desc), *ptrs, self.ws.data_ptr(), stream) != 0:
                raise RuntimeError(lib.sl_last_error().decode())

        def sl_tgmm():
            ptrs = (x.data_ptr(), dy.data_ptr(), gs.data_ptr(), None, self.dw.data_ptr())
            stream = torch.cuda.current_stream().cuda_stream
            if lib.sl_tgmm_cuda(ctypes.byref(desc), *ptrs, self.ws.data_ptr(), stream) != 0:
                raise RuntimeError(lib.sl_last_error().decode())

        def sl_gmm_width(tile_n):
            def call():  # the width holds while the call launches (and while a graph captures it)
                lib.gmm_set_tile_n(tile_n)
                try:
                    sl_gmm()
                finally:
                    lib.gmm_set_tile_n(0)

            return call

        calls = {
            "sluice_gmm": sl_gmm,
            "torch_grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
            "cublas_dense": lambda: torch.mm(x, self.w_dense),
            "sluice_tgmm": sl_tgmm,
            "torch_grouped_mm_wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
        }
        if getattr(lib, "gmm_set_tile_n", None) is not None:
            calls["sluice_gmm_n256"] = sl_gmm_width(256)
            calls["sluice_gmm_n128"] = sl_gmm_width(128)
        if self.batched:
            calls["cublas_batched"] = lambda: torch.bmm(self.xb, w, out=self.out_b)
            calls["cublas_batched_wgrad"] = lambda: torch.bmm(
                self.xb.transpose(1, 2), self.dyb, out=self.dw_b
            )
        return calls, offs


def bench_shape_torch(lib, shape, args):
    """Rows for one shape (both distributions): sluice, torch._grouped_mm and cuBLAS."""
    import torch

    sc = ShapeCalls(lib, shape)
    m, g, k, n = shape.m, shape.g, shape.k, shape.n
    rows = []
    for dist in args.dists.split(","):
        sizes = group_sizes(shape, dist, seed=args.seed)
        calls, offs = sc.calls(sizes)
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
        # correctness against torch on these inputs (the same bf16 operands)
        calls["sluice_gmm"]()
        calls["sluice_tgmm"]()
        torch.cuda.synchronize()
        try:
            ref = torch._grouped_mm(sc.x, sc.w, offs=offs)
            row["gmm_rel_err_vs_torch"] = float(
                (sc.out.float() - ref.float()).norm() / ref.float().norm()
            )
        except Exception as e:  # noqa: BLE001
            row["gmm_torch_error"] = str(e)[:300]
        try:
            ref_dw = torch._grouped_mm(sc.x.t(), sc.dy, offs=offs)
            row["tgmm_torch_call"] = "x.t(), dy"
            row["tgmm_rel_err_vs_torch"] = float(
                (sc.dw.float() - ref_dw.float()).norm() / ref_dw.float().norm()
            )
        except Exception as e:  # noqa: BLE001
            row["tgmm_torch_error_xt"] = str(e)[:200]
            del calls["torch_grouped_mm_wgrad"]
        working = {}
        for name, fn in calls.items():
            try:  # one call first: a peer that fails (signature, memory) is recorded, not fatal
                fn()
                working[name] = fn
            except Exception as e:  # noqa: BLE001
                row.setdefault("errors", {})[name] = str(e)[:300]
        timing = {}
        t = time_cuda(working, args.iters, info=timing, mode=args.timing)
        row["timing"] = timing
        row["ms"] = t
        row["tflops"] = {kk: sc.flops / v / 1e9 for kk, v in t.items()}
        rows.append(row)
        tf = {kk: round(v, 1) for kk, v in row["tflops"].items()}
        err = [row.get("gmm_rel_err_vs_torch"), row.get("tgmm_rel_err_vs_torch")]
        print(json.dumps({"shape": shape.name, "dist": dist, "tflops": tf, "err": err}), flush=True)
    return rows


def open_lib(path):
    """The CUDA library (tests/gpu/build.sh's libsluice_gpu.so) with its C entry points typed."""
    lib = ctypes.CDLL(path)
    for f in ("sl_gmm_cuda", "sl_tgmm_cuda"):
        getattr(lib, f).restype = ctypes.c_int
        getattr(lib, f).argtypes = [ctypes.POINTER(GmmDesc)] + [ctypes.c_void_p] * 7
    lib.sl_last_error.restype = ctypes.c_char_p
    lib.sl_gmm_cuda_workspace_size.restype = ctypes.c_size_t
    # the test build's hook that fixes gmm's sm90 tile width (sluice_cuda::gmm_set_tile_n, a C++
    # symbol): with it the torch part also times gmm with 256- and 128-column tiles throughout
    try:
        lib.gmm_set_tile_n = lib._ZN11sluice_cuda14gmm_set_tile_nEi
        lib.gmm_set_tile_n.argtypes, lib.gmm_set_tile_n.restype = [ctypes.c_int], None
    except AttributeError:
        lib.gmm_set_tile_n = None
    return lib


def torch_meta(args, **extra):
    """A torch part's metadata: device, versions, date, timed runs, the library, and `extra`."""
    import torch

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "iters": args.iters,
        "l2_flush": True,  # time_cuda's default
        **extra,
        "library": os.path.realpath(args.lib),
    }


def part_torch(args):
    import torch

    lib = open_lib(args.lib)
    results = []
    for shape in select_shapes(args.shapes):
        results += bench_shape_torch(lib, shape, args)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"meta": torch_meta(args, timing=args.timing), "rows": results}, f, indent=1)


def part_jax(args):
    import jax
    import jax.numpy as jnp

    try:  # sluice through XLA as a model calls it (needs the CMake build of libsluice with its FFI)
        import sluice
    except ImportError as e:
        sluice = None
        print(f"sluice in jit not timed: {e}", flush=True)
    results = []
    for shape in select_shapes(args.shapes):
        m, g, k, n = shape.m, shape.g, shape.k, shape.n
        key = jax.random.PRNGKey(0)
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (m, k), jnp.bfloat16)
        w = (jax.random.normal(k2, (g, k, n), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
        dy = jax.random.normal(k3, (m, n), jnp.bfloat16)
        flops = 2.0 * m * k * n
        fwd = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))

        def wgrad_fn(x, w, gs, dy):
            _, vjp = jax.vjp(lambda w_: jax.lax.ragged_dot(x, w_, gs), w)
            return vjp(dy)[0]

        wgrad = jax.jit(wgrad_fn)
        for dist in args.dists.split(","):
            gs = jnp.asarray(group_sizes(shape, dist, seed=args.seed))
            row = {"shape": shape.name, "dist": dist, "ms": {}, "tflops": {}, "errors": {}}
            calls = []
            if not args.no_ragged_dot:
                calls += [
                    ("ragged_dot", fwd, (x, w, gs)),
                    ("ragged_dot_wgrad", wgrad, (x, w, gs, dy)),
                ]
            if sluice is not None:
                # JIT_CALLS calls in one program on distinct inputs, as a model's step makes them:
                # the wall clock per call is the kernels plus what XLA adds between them (a single
                # call's program would also time the host's wait for the GPU)
                xs = [x * (1 + i) for i in range(JIT_CALLS)]
                calls += [
                    ("sluice_gmm_jit", jax.jit(lambda xs, w, gs: [sluice.gmm(a, w, gs) for a in xs]),
                     (xs, w, gs)),
                    ("sluice_tgmm_jit",
                     jax.jit(lambda xs, dy, gs: [sluice.tgmm(a, dy, gs) for a in xs]), (xs, dy, gs)),
                ]  # fmt: skip
            for name, fn, fargs in calls:
                per = JIT_CALLS if name.endswith("_jit") else 1
                try:
                    jax.block_until_ready(fn(*fargs))
                    times = []
                    for _ in range(args.jax_iters):
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(*fargs))
                        times.append((time.perf_counter() - t0) * 1e3 / per)
                    ms = statistics.median(times)
                    row["ms"][name] = ms
                    row["tflops"][name] = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001  (out of memory is a result here)
                    row["errors"][name] = str(e).splitlines()[0][:300]
            results.append(row)
            print(
                json.dumps(
                    {
                        "shape": shape.name,
                        "dist": dist,
                        "tflops": {kk: round(v, 1) for kk, v in row["tflops"].items()},
                        "errors": row["errors"],
                    }
                ),
                flush=True,
            )
        del x, w, dy
    meta = {"jax": jax.__version__, "jax_devices": str(jax.devices()), "jax_iters": args.jax_iters}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": results}, f, indent=1)


def timing_line(torch_part):
    """How the torch part timed its calls (time_cuda's mode; files before 2026-11-24: "synced")."""
    mode = torch_part["meta"].get("timing", "synced")
    cold = (
        " Every call starts from a cold L2 (a 256 MiB memset before it, outside its events)."
        if torch_part["meta"].get("l2_flush")
        else ""
    )
    return _timing_mode_line(torch_part, mode) + cold


def _timing_mode_line(torch_part, mode):
    if mode == "graph":
        return (
            "Each call captured once in a CUDA graph, the replays queued back to back: the GPU "
            "time of its kernels alone, without the host's launch path."
        )
    if mode != "queued":
        return (
            "Calls timed one at a time: each waited for before the next, so each figure includes "
            "its launch path and the GPU idles between calls."
        )
    gap = max(r["timing"]["max_gap_ms"] for r in torch_part["rows"])
    return (
        "Calls queued back to back: the launch path is not in the figures and the GPU does not "
        f"idle between calls (largest gap between two calls: {gap * 1e3:.1f} us)."
    )


BF16_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense BF16
HBM_TBPS = 4.8  # H200 (H100 SXM: 3.35)


def roofline_share(r, key):
    """Share of the roofline that `key` reaches on row r: the time of its FLOPs at the BF16 peak or
    of its bytes (lhs, weights or their gradient, the other operand, once each) at HBM bandwidth,
    whichever is longer, over its time. The small groups are bound by the weights' bytes."""
    m, g, k, n = r["m"], r["g"], r["k"], r["n"]
    flops, nbytes = 2.0 * m * k * n, 2.0 * (m * k + g * k * n + m * n)
    t = max(flops / (BF16_PEAK_TFLOPS * 1e12), nbytes / (HBM_TBPS * 1e12))
    return t / (flops / (r["tflops"][key] * 1e12))


def by_rows_per_group(rows, ratio):
    """The small-groups sweep (shape names ending in -r<rows per group>) summarised by rows per
    group: medians over its matmuls and distributions, and the share of the BF16 peak."""
    by = {}
    for r in rows:
        tail = r["shape"].rsplit("-r", 1)
        if len(tail) == 2 and tail[1].isdigit():
            by.setdefault(int(tail[1]), []).append(r)
    if not by:
        return []
    out = [
        "",
        (
            "By rows per group (medians over the matmuls and distributions; peak = "
            f"{BF16_PEAK_TFLOPS:.0f} TFLOP/s dense BF16; roofline: that peak or {HBM_TBPS} TB/s "
            "for each operand once, whichever bounds the time):"
        ),
        "",
        (
            "| rows/group | cases | gmm/torch median (min) | tgmm/torch median (min) | gmm TFLOP/s "
            "| gmm % of peak | gmm % of roofline | tgmm TFLOP/s | tgmm % of peak | tgmm % of roofline |"
        ),
        "|" + "---|" * 10,
    ]
    for rpg in sorted(by):
        rs = by[rpg]
        g = [v for v in (ratio(r, "sluice_gmm", "torch_grouped_mm") for r in rs) if v]
        t = [v for v in (ratio(r, "sluice_tgmm", "torch_grouped_mm_wgrad") for r in rs) if v]
        gt = statistics.median(r["tflops"]["sluice_gmm"] for r in rs)
        tt = statistics.median(r["tflops"]["sluice_tgmm"] for r in rs)
        gr = statistics.median(roofline_share(r, "sluice_gmm") for r in rs)
        tr = statistics.median(roofline_share(r, "sluice_tgmm") for r in rs)
        out.append(
            f"| {rpg} | {len(rs)} | {statistics.median(g):.2f}x ({min(g):.2f}x) | "
            f"{statistics.median(t):.2f}x ({min(t):.2f}x) | {gt:.0f} | "
            f"{100 * gt / BF16_PEAK_TFLOPS:.0f}% | {100 * gr:.0f}% | {tt:.0f} | "
            f"{100 * tt / BF16_PEAK_TFLOPS:.0f}% | {100 * tr:.0f}% |"
        )
    return out


def merge(args):
    with open(args.merge[0]) as f:
        tj = json.load(f)
    jj = None
    if len(args.merge) > 1 and os.path.exists(args.merge[1]):
        with open(args.merge[1]) as f:
            jj = json.load(f)
    jrows = {(r["shape"], r["dist"]): r for r in (jj["rows"] if jj else [])}
    rows = []
    for r in tj["rows"]:
        j = jrows.get((r["shape"], r["dist"]), {})
        tf = dict(r["tflops"])
        tf.update(j.get("tflops", {}))
        rows.append({**r, "tflops": tf, "jax_errors": j.get("errors", {})})

    def ratio(row, a, b):
        return (
            row["tflops"][a] / row["tflops"][b]
            if b in row["tflops"] and a in row["tflops"]
            else None
        )

    lines = [
        f"# Grouped GEMM benchmark ({tj['meta']['date'][:10]})",
        "",
        f"Device: {tj['meta']['device']}; torch {tj['meta']['torch']} (CUDA {tj['meta']['cuda']})"
        + (f"; jax {jj['meta']['jax']}" if jj else "; jax part not run")
        + ".",
        (
            f"bf16 in, f32 accumulate, bf16 out. TFLOP/s = 2*M*K*N/time; CUDA-event median of "
            f"{tj['meta']['iters']} runs, implementations interleaved within each run, their "
            f"order rotated every run (JAX: "
            f"wall-clock median of {jj['meta'].get('jax_iters', '-') if jj else '-'})."
        ),
        timing_line(tj),
        "Produced by bench/run_gpu.sh (bench/bench_gmm.py, shapes from tests/shapes.py).",
        f"sluice library: {tj['meta'].get('library', '-')}.",
        "",
        (
            "| shape | sizes | sluice gmm | torch grouped_mm | cuBLAS dense | ragged_dot | gmm/torch "
            "| gmm/cuBLAS | gmm/ragged_dot | sluice tgmm | torch wgrad | ragged_dot wgrad | tgmm/torch "
            "| tgmm/ragged_dot |"
        ),
        "|" + "---|" * 14,
    ]

    def fmt(v):
        return "-" if v is None else f"{v:.1f}"

    def fr(v):
        return "-" if v is None else f"{v:.2f}x"

    agg = {"gmm/torch": [], "gmm/cublas": [], "gmm/ragged": [], "tgmm/torch": [], "tgmm/ragged": []}
    for r in rows:
        t = r["tflops"]
        rs = {
            "gmm/torch": ratio(r, "sluice_gmm", "torch_grouped_mm"),
            "gmm/cublas": ratio(r, "sluice_gmm", "cublas_dense"),
            "gmm/ragged": ratio(r, "sluice_gmm", "ragged_dot"),
            "tgmm/torch": ratio(r, "sluice_tgmm", "torch_grouped_mm_wgrad"),
            "tgmm/ragged": ratio(r, "sluice_tgmm", "ragged_dot_wgrad"),
        }
        for kk, v in rs.items():
            if v is not None:
                agg[kk].append(v)
        rd_wgrad = fmt(t.get("ragged_dot_wgrad"))
        if "ragged_dot_wgrad" in r["jax_errors"]:
            rd_wgrad = "OOM" if "memory" in r["jax_errors"]["ragged_dot_wgrad"].lower() else "error"
        lines.append(
            f"| {r['shape']} | {r['dist']} ({r['sizes_min']}..{r['sizes_max']}) | {fmt(t.get('sluice_gmm'))} | "
            f"{fmt(t.get('torch_grouped_mm'))} | {fmt(t.get('cublas_dense'))} | {fmt(t.get('ragged_dot'))} | "
            f"{fr(rs['gmm/torch'])} | {fr(rs['gmm/cublas'])} | {fr(rs['gmm/ragged'])} | "
            f"{fmt(t.get('sluice_tgmm'))} | {fmt(t.get('torch_grouped_mm_wgrad'))} | {rd_wgrad} | "
            f"{fr(rs['tgmm/torch'])} | {fr(rs['tgmm/ragged'])} |"
        )
    # the dense references against the peers (files from 2026-11-25 on also have cuBLAS batched)
    refs = {
        "cublas/torch": ("cublas_dense", "torch_grouped_mm"),
        "cublas_batched/torch": ("cublas_batched", "torch_grouped_mm"),
        "gmm/cublas_batched": ("sluice_gmm", "cublas_batched"),
        "cublas_batched_wgrad/torch_wgrad": ("cublas_batched_wgrad", "torch_grouped_mm_wgrad"),
        "tgmm/cublas_batched_wgrad": ("sluice_tgmm", "cublas_batched_wgrad"),
    }
    if any("cublas_batched" in r["tflops"] for r in rows):
        lines += [
            "",
            (
                "Dense references at equal FLOPs: cuBLAS dense is one M x K x N product (torch.mm); "
                "cuBLAS batched is torch.bmm over G groups of exactly M/G rows (no ragged edge), the "
                "weight gradient writing the same G x K x N output as tgmm."
            ),
            "",
            "| shape | sizes | cuBLAS batched | cuBLAS batched wgrad | " + " | ".join(refs) + " |",
            "|" + "---|" * (4 + len(refs)),
        ]
        for r in rows:
            t = r["tflops"]
            vals = {kk: ratio(r, a, b) for kk, (a, b) in refs.items()}
            for kk, v in vals.items():
                if v is not None:
                    agg.setdefault(kk, []).append(v)
            lines.append(
                f"| {r['shape']} | {r['dist']} | {fmt(t.get('cublas_batched'))} | "
                f"{fmt(t.get('cublas_batched_wgrad'))} | "
                + " | ".join(fr(v) for v in vals.values())
                + " |"
            )
    if any("sluice_gmm_jit" in r["tflops"] for r in rows):
        lines += [
            "",
            (
                f"sluice inside jit (the JAX part: {JIT_CALLS} calls in one jitted program on "
                "distinct inputs, wall clock per call) against its kernels alone (the torch part): "
                "the difference is what XLA adds around each call, which small problems pay in full."
            ),
            "",
            "| shape | sizes | gmm kernel | gmm in jit | jit/kernel | tgmm kernel | tgmm in jit | jit/kernel |",
            "|" + "---|" * 8,
        ]
        for r in rows:
            t = r["tflops"]
            g_kj = ratio(r, "sluice_gmm", "sluice_gmm_jit")
            t_kj = ratio(r, "sluice_tgmm", "sluice_tgmm_jit")
            lines.append(
                f"| {r['shape']} | {r['dist']} | {fmt(t.get('sluice_gmm'))} | "
                f"{fmt(t.get('sluice_gmm_jit'))} | {fr(g_kj)} | {fmt(t.get('sluice_tgmm'))} | "
                f"{fmt(t.get('sluice_tgmm_jit'))} | {fr(t_kj)} |"
            )
    if any("sluice_gmm_n128" in r["tflops"] for r in rows):
        lines += [
            "",
            (
                "gmm's tile widths (gmm_launch.cu's wave model picks 128 columns where 256-wide "
                "tiles fill the GPU in few waves): each width forced on every case, in the same "
                "interleaved runs."
            ),
            "",
            "| shape | sizes | 256 cols | 128 cols | chosen | 256/torch | 128/torch | chosen/torch |",
            "|" + "---|" * 8,
        ]
        for r in rows:
            t = r["tflops"]
            lines.append(
                f"| {r['shape']} | {r['dist']} | {fmt(t.get('sluice_gmm_n256'))} | "
                f"{fmt(t.get('sluice_gmm_n128'))} | {fmt(t.get('sluice_gmm'))} | "
                f"{fr(ratio(r, 'sluice_gmm_n256', 'torch_grouped_mm'))} | "
                f"{fr(ratio(r, 'sluice_gmm_n128', 'torch_grouped_mm'))} | "
                f"{fr(ratio(r, 'sluice_gmm', 'torch_grouped_mm'))} |"
            )
    lines += by_rows_per_group(rows, ratio)
    lines += ["", "| ratio | median | min | max | cases |", "|---|---|---|---|---|"]
    summary = {}
    for kk, v in agg.items():
        if v:
            summary[kk] = {
                "median": statistics.median(v),
                "min": min(v),
                "max": max(v),
                "cases": len(v),
            }
            lines.append(
                f"| {kk} | {statistics.median(v):.3f}x | {min(v):.3f}x | {max(v):.3f}x | {len(v)} |"
            )
    lines += [
        "",
        (
            "Max relative error vs torch._grouped_mm on the same inputs: gmm "
            f"{max(r.get('gmm_rel_err_vs_torch', 0) for r in rows):.2e}, tgmm "
            f"{max(r.get('tgmm_rel_err_vs_torch', 0) or 0 for r in rows):.2e}."
        ),
    ]
    jerr = {f"{r['shape']}/{r['dist']}/{kk}": v for r in rows for kk, v in r["jax_errors"].items()}
    if jerr:
        lines += ["", "JAX failures:"] + [f"- {kk}: {v}" for kk, v in jerr.items()]
    with open(args.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    meta = {**tj["meta"], **(jj["meta"] if jj else {})}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1)
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=["torch", "jax"])
    p.add_argument("--lib", default="build-gpu/libsluice_gpu.so")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--timing", choices=["queued", "synced", "graph"], default="queued", help="see time_cuda"
    )
    p.add_argument("--jax-iters", type=int, default=20)
    p.add_argument("--no-ragged-dot", action="store_true", help="JAX part: time sluice in jit only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shapes",
        help='"bench" (default: the four benchmark shapes), "fine", "small-groups", or names',
    )
    p.add_argument(
        "--dists",
        default=",".join(DISTRIBUTIONS),
        help="group-size distributions, comma-separated: uniform, skewed (the benchmark's) or "
        "exact (every group M/G rows, no ragged edge)",
    )
    p.add_argument("--merge", nargs="+")
    p.add_argument("--md", default="gmm.md")
    p.add_argument("--json", default="gmm.json")
    args = p.parse_args()
    if args.merge:
        merge(args)
    elif args.part == "torch":
        part_torch(args)
    elif args.part == "jax":
        part_jax(args)
    else:
        p.error("give --part or --merge")


if __name__ == "__main__":
    main()

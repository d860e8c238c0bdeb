"""GPU test of sl_quantize_fp8_cuda against a numpy implementation of sluice.fp8.quantize's rule
(python/sluice/ops/fp8.py), bit for bit: every block layout, q and its transpose, row_range (rows
outside it read as zero), rows past x (padding), power-of-two scales, bf16, f16 and float32 x, and
the edge values (zero blocks, float32 subnormals of either sign, -0, blocks whose scale is below
2^-90, values beyond e4m3's range, inf and NaN). sl_swiglu_quantize_fp8_cuda and its backward
against the composition they stand for (sl_swiglu_*_cuda, then sl_quantize_fp8_both_cuda), bit for
bit, and the row weights' gradient from the parts against sl_swiglu_bwd_cuda's.

  python3 tests/gpu/test_quantize_fp8.py build-gpu/libsluice_gpu.so      (tests/gpu/run.sh runs it)
"""

from __future__ import annotations

import ctypes
import os
import sys

import ml_dtypes
import numpy as np
import torch

# sl_quantize_fp8_desc: the C mirror the benchmarks share
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from bench_gmm import QuantDesc, SwigluDesc

SL_BF16, SL_F32, SL_F16 = 1, 0, 2
RCP_MAX = np.float32(1.0 / 448.0)
SCALE_MIN = np.float32(2.0**-126)


def pow2_ceil(s, amax):
    m, e = np.frexp(s)
    p = np.ldexp(np.float32(1), np.where(m == 0.5, e - 1, e)).astype(np.float32)
    p = np.where(np.float32(448) * p < amax, 2 * p, p).astype(np.float32)
    half = (np.float32(0.5) * p).astype(np.float32)
    return np.where((np.float32(448) * half >= amax) & (half >= SCALE_MIN), half, p)


def reference(x, rows, br, bc, pow2, ranges):
    """x float32 [B, XR, C] -> (q uint8 [B, rows, C], scale). The blocks' maxima by reduceat, so
    that narrow or partial blocks cost no padding."""
    b, xr, c = x.shape
    full = np.zeros((b, rows, c), np.float32)
    full[:, :xr] = x
    for i, (lo, hi) in enumerate(ranges):
        full[i, :lo] = 0
        full[i, hi:] = 0
    full = np.where(np.abs(full) < SCALE_MIN, np.float32(0), full)  # subnormals read as zero
    starts_r, starts_c = np.arange(0, rows, br), np.arange(0, c, bc)

    def block_max(v):
        return np.maximum.reduceat(np.maximum.reduceat(v, starts_r, axis=1), starts_c, axis=2)

    finite = np.isfinite(full)
    bad = block_max((~finite).astype(np.uint8)) > 0
    amax = block_max(np.abs(np.where(finite, full, np.float32(0)))).astype(np.float32)
    scale = np.maximum(amax * RCP_MAX, SCALE_MIN).astype(np.float32)
    if pow2:
        scale = pow2_ceil(scale, amax).astype(np.float32)
    scale = np.where(bad, np.float32(np.nan), scale).astype(np.float32)
    rcp = (np.float32(1) / scale).astype(np.float32)  # correctly rounded
    rcp = np.repeat(np.repeat(rcp, br, axis=1)[:, :rows], bc, axis=2)[:, :, :c]
    y = (full * rcp).astype(np.float32)
    y = np.where(y > 448, np.float32(448), np.where(y < -448, np.float32(-448), y))
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def make_x(rng, b, xr, c, dt, specials):
    """x [b, xr, c] as float32 numpy (values of dtype dt) and as a CUDA tensor of dtype dt."""
    lo, hi = (-10, 4) if dt == SL_F16 else (-30, 10)  # (float16 overflows past 65504)
    x = (rng.standard_normal((b, xr, c)) * np.exp(rng.uniform(lo, hi, (b, xr, 1)))).astype(
        np.float32
    )
    if specials:
        x[0, 0, :128] = 0  # a zero block (1x128) / part of one
        x[0, 1, 3] = 1e-39  # a float32 subnormal
        x[0, 1, 4] = -1e-39  # a negative one (+0 in q, not -0)
        x[0, 1, 6] = -0.0
        x[0, 2, 5] = np.inf
        x[-1, 3, 7] = np.nan
        x[0, 4, 9] = 3e38 if dt != SL_F16 else 6e4
        x[0, 5] *= 2.0**-100  # a block of tiny values (reciprocal near 2^100)
        x[0, 6, 16:] = 0.0
        x[0, 6, 17] = 2.0**-120  # a block of one tiny value
        x[0, 7, :] = -0.0
        x[0, : min(128, xr), 20] *= 2.0**-100  # 128x1: a column block of tiny values
    if dt == SL_BF16:
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    elif dt == SL_F16:
        x = x.astype(np.float16).astype(np.float32)
    xt = torch.tensor(x, device="cuda")
    return x, (xt.bfloat16() if dt == SL_BF16 else xt.half() if dt == SL_F16 else xt)


def report(name, x, checks):
    """Prints ok / FAIL for the (what, got, want) checks, q's first few differences; True if ok."""
    same = {}
    for what, got, want in checks:
        if what.startswith("scale"):
            same[what] = np.array_equal(got, want, equal_nan=True)
            continue
        nan = (want & 0x7F) == 0x7F
        bad = np.argwhere(np.where(nan, (got & 0x7F) != 0x7F, got != want))
        same[what] = len(bad) == 0
        for i in map(tuple, bad[:4]):  # (batch, row, col): x, want, got
            xv = x[i] if i[1] < x.shape[1] else 0.0
            print(f"     {what} at {i}: x {xv!r} want {want[i]:#04x} got {got[i]:#04x}")
    ok = all(same.values())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(f"{k} {v}" for k, v in same.items()))
    return ok


def check_both(lib, x, xt, rows, ranges, dt, pow2, rng=None):
    """sl_quantize_fp8_both_cuda against the reference's 1x128 q of every row of x and 128x1 q_t of
    the rows in ranges (x read as `rows` rows). With rng, through a gather: the rows of x picked by
    random indices (repeats, any order, some outside [0, rows of x): zero rows)."""
    b, xr, c = x.shape
    g = None
    if rng is not None:
        g = rng.integers(-2, xr + 2, size=(b, xr)).astype(np.int32)
        ok = (g >= 0) & (g < xr)
        picked = x[np.arange(b)[:, None], np.clip(g, 0, xr - 1)]
        x = np.where(ok[..., None], picked, 0).astype(np.float32)
        g = torch.tensor(g, device="cuda")
    q_ref, s_ref = reference(x, xr, 1, 128, pow2, [(0, xr)] * b)
    qt_ref, st_ref = reference(x, rows, 128, 1, pow2, ranges)
    q = torch.full((b, xr, c), 0xAB, device="cuda", dtype=torch.uint8)
    qt = torch.full((b, c, rows), 0xAB, device="cuda", dtype=torch.uint8)
    sc = torch.full((s_ref.size,), float("nan"), device="cuda")
    sct = torch.full((st_ref.size,), float("nan"), device="cuda")
    vr = torch.tensor(ranges, device="cuda", dtype=torch.int32)
    d = QuantDesc(ctypes.sizeof(QuantDesc), b, rows, c, xr, dt, 1, 128, pow2, xr)
    ptrs = (xt, vr, g, q, sc, qt, sct)
    st = lib.sl_quantize_fp8_both_cuda(
        ctypes.byref(d), *(None if t is None else t.data_ptr() for t in ptrs), None
    )
    torch.cuda.synchronize()
    name = f"both b{b} rows {xr}->{rows} cols {c} pow2 {pow2} dtype {dt} gather {g is not None}"
    if st != 0:
        print(f"FAIL {name}: {lib.sl_last_error().decode()}")
        return False
    checks = [
        ("q", q.cpu().numpy(), q_ref),
        ("scale", sc.cpu().numpy().reshape(s_ref.shape), s_ref),
        ("q_t", qt.cpu().numpy().transpose(0, 2, 1), qt_ref),
        ("scale_t", sct.cpu().numpy().reshape(st_ref.shape), st_ref),
    ]
    return report(name, x, checks)


def check_swiglu(lib, rng, xr, rows, f, lo, hi, dt, pow2, weighted, bwd):
    """The fused SwiGLU quantization (forward, or backward) of h [xr, 2F] against the composition,
    all outputs poisoned first; rows outside [lo, hi) zero in both."""
    tdt = torch.bfloat16 if dt == SL_BF16 else torch.float16
    h = (torch.randn(xr, 2 * f, device="cuda") * 3).to(tdt)
    h[min(5, xr - 1), 3] = float("inf")  # a non-finite value: its blocks' scale NaN
    dact = torch.randn(xr, f, device="cuda").to(tdt)
    w = torch.rand(xr, device="cuda") if weighted else None
    gs = torch.tensor([hi], device="cuda", dtype=torch.int32)
    vr = torch.tensor([[lo, hi]], device="cuda", dtype=torch.int32)
    c = 2 * f if bwd else f
    sd = SwigluDesc(ctypes.sizeof(SwigluDesc), xr, f, 1, dt, 0)
    ptr = lambda t: None if t is None else t.data_ptr()
    ref = torch.full((xr, c), float("nan"), device="cuda").to(tdt)
    dw = torch.full((xr,), float("nan"), device="cuda")
    if bwd:
        st = lib.sl_swiglu_bwd_cuda(ctypes.byref(sd), ptr(dact), ptr(h), ptr(w), ptr(gs), ptr(ref),
                                    ptr(dw) if weighted else None, None)  # fmt: skip
    else:
        st = lib.sl_swiglu_fwd_cuda(ctypes.byref(sd), ptr(h), ptr(w), ptr(gs), ptr(ref), None)
    assert st == 0, lib.sl_last_error().decode()
    ref[:lo] = 0
    d = QuantDesc(ctypes.sizeof(QuantDesc), 1, rows, c, xr, dt, 1, 128, pow2, 0)
    nb = (c + 127) // 128

    def outs():
        return [
            torch.full((xr, c), 0xAB, device="cuda", dtype=torch.uint8),
            torch.full((xr * nb,), float("nan"), device="cuda"),
            torch.full((c, rows), 0xAB, device="cuda", dtype=torch.uint8),
            torch.full(((rows + 127) // 128 * c,), float("nan"), device="cuda"),
        ]

    want, got = outs(), outs()
    st = lib.sl_quantize_fp8_both_cuda(ctypes.byref(d), ptr(ref), ptr(vr), None,
                                       *map(ptr, want), None)  # fmt: skip
    assert st == 0, lib.sl_last_error().decode()
    parts = torch.full((xr, (f + 127) // 128), float("nan"), device="cuda")
    if bwd:
        st = lib.sl_swiglu_bwd_quantize_fp8_cuda(ctypes.byref(d), ptr(dact), ptr(h), ptr(w),
                                                 ptr(vr), *map(ptr, got),
                                                 ptr(parts) if weighted else None, None)  # fmt: skip
    else:
        st = lib.sl_swiglu_quantize_fp8_cuda(ctypes.byref(d), ptr(h), ptr(w), ptr(vr),
                                             *map(ptr, got), None)  # fmt: skip
    torch.cuda.synchronize()
    name = f"swiglu {'bwd' if bwd else 'fwd'} rows {xr}->{rows} F {f} [{lo}, {hi}) pow2 {pow2} "
    name += f"dtype {dt} weighted {int(weighted)}"
    if bwd and f % 128:  # the backward pairs d gate's and d up's 128-column tiles
        msg = lib.sl_last_error().decode()
        ok = st != 0 and "F must be a multiple of 128" in msg
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rejected ({msg})")
        return ok
    if st != 0:
        print(f"FAIL {name}: {lib.sl_last_error().decode()}")
        return False
    x = ref.float().cpu().numpy()[None]
    checks = []
    for what, g, wnt in zip(("q", "scale", "q_t", "scale_t"), got, want):
        g, wnt = g.cpu().numpy(), wnt.cpu().numpy()
        if what.startswith("q"):
            g, wnt = (g, wnt) if what == "q" else (g.T, wnt.T)
            checks.append((what, g[None], wnt[None]))
        else:
            checks.append((what, g, wnt))
    ok = report(name, x, checks)
    if bwd and weighted:
        dw_ref = dw.cpu().numpy().astype(np.float64)
        dw_ref[:lo] = 0
        dw_got = parts.cpu().numpy().astype(np.float64).sum(axis=1)
        # float32 sums in two orders: within 1e-5 of the sum of the terms' magnitudes
        g, u = h[:, :f].double(), h[:, f:].double()
        mag = (dact.double() * g * torch.sigmoid(g) * u).abs().sum(1).cpu().numpy()
        close = np.allclose(dw_got, dw_ref, rtol=0, atol=0, equal_nan=True) or bool(
            np.all(np.isclose(dw_got, dw_ref, rtol=0, atol=1e-5 * mag + 1e-30, equal_nan=True))
        )
        print(f"{'ok  ' if close else 'FAIL'} {name}: d row weights from the parts")
        ok = ok and close
    return ok


def main(lib_path, only=None):
    np.seterr(over="ignore")  # pow2_ceil's 448 * p may overflow to inf, as in float32 on the GPU
    lib = ctypes.CDLL(lib_path)
    lib.sl_quantize_fp8_cuda.restype = ctypes.c_int
    lib.sl_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [ctypes.c_void_p] * 6
    lib.sl_quantize_fp8_both_cuda.restype = ctypes.c_int
    lib.sl_quantize_fp8_both_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [ctypes.c_void_p] * 8
    lib.sl_last_error.restype = ctypes.c_char_p
    vp = ctypes.c_void_p
    lib.sl_swiglu_fwd_cuda.argtypes = [ctypes.POINTER(SwigluDesc)] + [vp] * 5
    lib.sl_swiglu_bwd_cuda.argtypes = [ctypes.POINTER(SwigluDesc)] + [vp] * 7
    lib.sl_swiglu_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [vp] * 8
    lib.sl_swiglu_bwd_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [vp] * 10
    rng = np.random.default_rng(7)
    fails = runs = 0
    # 16-bit x with cols % 8 == 0 runs the fast kernels (rows: 1x128 q alone; tile: 128x1 and
    # 128x128), the rest the general one
    cases = [  # (batch, x_rows, rows, cols, block, pow2, dtype, valid fraction, specials)
        (1, 300, 300, 384, (1, 128), 0, SL_BF16, 1.0, False),
        (2, 257, 272, 200, (1, 128), 1, SL_BF16, 0.7, True),
        (1, 300, 304, 384, (128, 1), 0, SL_BF16, 1.0, True),
        (1, 290, 300, 136, (128, 1), 0, SL_BF16, 0.9, True),  # rows % 16: q_t byte stores
        (3, 130, 144, 136, (128, 1), 1, SL_F32, 0.5, False),
        (2, 256, 256, 384, (128, 128), 0, SL_BF16, 1.0, True),
        (1, 200, 200, 130, (128, 128), 1, SL_F32, 0.9, False),
        (1, 200, 208, 132, (128, 1), 0, SL_BF16, 1.0, True),  # cols % 8: the general kernel
        (2, 200, 208, 264, (1, 128), 0, SL_F16, 0.8, True),
        (1, 256, 256, 256, (128, 1), 1, SL_F16, 1.0, True),
        (1, 256, 256, 512, (128, 128), 0, SL_F16, 1.0, False),
        # many blocks of random values: the product by each block's reciprocal
        (1, 2048, 2048, 1024, (1, 128), 0, SL_BF16, 1.0, False),
        (1, 2048, 2048, 1024, (128, 1), 0, SL_BF16, 1.0, False),
        (1, 1024, 1024, 1024, (128, 128), 0, SL_BF16, 1.0, False),
        # more row tiles than the grid's y holds (65535 of 128 rows, and of the row kernel's 64):
        # the kernels that run in whole rows fall back to column stripes
        (1, 65538 * 128, 65538 * 128, 8, (1, 128), 0, SL_BF16, 1.0, False),
        (1, 65538 * 128, 65538 * 128, 16, (128, 128), 1, SL_BF16, 1.0, False),
    ]
    for b, xr, rows, c, (br, bc), pow2, dt, frac, specials in cases if only != "swiglu" else ():
        x, xt = make_x(rng, b, xr, c, dt, specials)
        ranges = [(i * 3, int(frac * rows)) for i in range(b)]
        q_ref, s_ref = reference(x, rows, br, bc, pow2, ranges)
        vr = torch.tensor(ranges, device="cuda", dtype=torch.int32)
        # q and q_t together (the tile kernel), and each alone (1x128 q alone: the row kernel)
        for want_q, want_qt in ((True, True), (True, False), (False, True)):
            q = torch.full((b, rows, c), 0xAB, device="cuda", dtype=torch.uint8)
            qt = torch.full((b, c, rows), 0xAB, device="cuda", dtype=torch.uint8)
            sc = torch.full((s_ref.size,), float("nan"), device="cuda")
            d = QuantDesc(ctypes.sizeof(QuantDesc), b, rows, c, xr, dt, br, bc, pow2, 0)
            st = lib.sl_quantize_fp8_cuda(
                ctypes.byref(d),
                xt.data_ptr(),
                vr.data_ptr(),
                q.data_ptr() if want_q else None,
                qt.data_ptr() if want_qt else None,
                sc.data_ptr(),
                None,
            )
            torch.cuda.synchronize()
            name = (
                f"b{b} rows {xr}->{rows} cols {c} block {br}x{bc} pow2 {pow2} dtype {dt} "
                f"q {int(want_q)} q_t {int(want_qt)}"
            )
            runs += 1
            if st != 0:
                print(f"FAIL {name}: {lib.sl_last_error().decode()}")
                fails += 1
                continue
            qg, qtg = q.cpu().numpy(), qt.cpu().numpy().transpose(0, 2, 1)
            sg = sc.cpu().numpy().reshape(s_ref.shape)
            checks = [("scale", sg, s_ref)]
            checks += [("q", qg, q_ref)] if want_q else []
            checks += [("q_t", qtg, q_ref)] if want_qt else []
            fails += not report(name, x, checks)
        # both layouts in one pass (sl_quantize_fp8_both_cuda) where x is an activation
        if (br, bc) != (128, 128):
            for gather_rng in (None, rng):
                runs += 1
                fails += not check_both(lib, x, xt, rows, ranges, dt, pow2, gather_rng)
    swiglu_cases = [  # (x_rows, rows, F, lo, hi, dtype, pow2): full tiles, ragged edges, F % 128
        (256, 256, 256, 0, 256, SL_BF16, 0),
        (300, 304, 136, 0, 250, SL_BF16, 1),
        (130, 144, 200, 7, 129, SL_F16, 0),
        (1024, 1024, 512, 0, 1000, SL_BF16, 0),
        (96, 96, 128, 0, 0, SL_BF16, 0),
        (300, 304, 256, 3, 250, SL_F16, 1),
    ]
    for xr, rows, f, lo, hi, dt, pow2 in swiglu_cases:
        for bwd in (False, True):
            for weighted in (True, False):
                runs += 1
                fails += not check_swiglu(lib, rng, xr, rows, f, lo, hi, dt, pow2, weighted, bwd)
    print(f"{runs - fails} passed, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    # a second argument "swiglu" runs the fused SwiGLU cases alone (for the slower sanitizers)
    lib = sys.argv[1] if len(sys.argv) > 1 else "build-gpu/libsluice_gpu.so"
    sys.exit(main(lib, sys.argv[2] if len(sys.argv) > 2 else None))

"""GPU test of sl_quantize_fp8_cuda against a numpy implementation of sluice.fp8.quantize's rule
(python/sluice/ops/fp8.py), bit for bit: every block layout, q and its transpose, row_range (rows
outside it read as zero), rows past x (padding), power-of-two scales, bf16, f16 and float32 x, and
the edge values (zero blocks, float32 subnormals of either sign, -0, blocks whose scale is below
2^-90, values beyond e4m3's range, inf and NaN).

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
from bench_gmm import QuantDesc

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
    """x float32 [B, XR, C] -> (q uint8 [B, rows, C], scale)."""
    b, xr, c = x.shape
    full = np.zeros((b, rows, c), np.float32)
    full[:, :xr] = x
    for i, (lo, hi) in enumerate(ranges):
        full[i, :lo] = 0
        full[i, hi:] = 0
    full = np.where(np.abs(full) < SCALE_MIN, np.float32(0), full)  # subnormals read as zero
    pr, pc = -rows % br, -c % bc
    xp = np.pad(full, ((0, 0), (0, pr), (0, pc)))
    nr, nc = xp.shape[1] // br, xp.shape[2] // bc
    xb = xp.reshape(b, nr, br, nc, bc)
    bad = ~np.isfinite(xb).all(axis=(2, 4))
    amax = np.abs(np.where(np.isfinite(xb), xb, 0)).max(axis=(2, 4)).astype(np.float32)
    scale = np.maximum(amax * RCP_MAX, SCALE_MIN).astype(np.float32)
    if pow2:
        scale = pow2_ceil(scale, amax).astype(np.float32)
    scale = np.where(bad, np.float32(np.nan), scale).astype(np.float32)
    rcp = (np.float32(1) / scale).astype(np.float32)  # correctly rounded
    y = (xb * rcp[:, :, None, :, None]).astype(np.float32)
    y = np.where(y > 448, np.float32(448), np.where(y < -448, np.float32(-448), y))
    q = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    q = q.reshape(b, nr * br, nc * bc)[:, :rows, :c]
    return q, scale


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


def main(lib_path):
    np.seterr(over="ignore")  # pow2_ceil's 448 * p may overflow to inf, as in float32 on the GPU
    lib = ctypes.CDLL(lib_path)
    lib.sl_quantize_fp8_cuda.restype = ctypes.c_int
    lib.sl_quantize_fp8_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [ctypes.c_void_p] * 6
    lib.sl_quantize_fp8_both_cuda.restype = ctypes.c_int
    lib.sl_quantize_fp8_both_cuda.argtypes = [ctypes.POINTER(QuantDesc)] + [ctypes.c_void_p] * 8
    lib.sl_last_error.restype = ctypes.c_char_p
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
    ]
    for b, xr, rows, c, (br, bc), pow2, dt, frac, specials in cases:
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
    print(f"{runs - fails} passed, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build-gpu/libsluice_gpu.so"))

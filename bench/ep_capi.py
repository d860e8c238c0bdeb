"""ctypes + CuPy harness over the CUDA C API of sluice.ep (include/sluice.h), one thread driving every
GPU of a group: what tests/gpu/ep_capi_check.py checks and bench/bench_ep.py times with CUDA events,
with no XLA in the way. Needs cupy; jax is imported on the CPU only (for sluice's library loader)."""

from __future__ import annotations

import ctypes
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import cupy as cp
import numpy as np
from sluice.ops import capi
from sluice.ops.capi import EpCommDesc as _CommDesc
from sluice.ops.capi import EpDesc
from sluice.ops.capi import EpFanDesc as FanDesc

lib = capi.lib
vp = ctypes.c_void_p

BF16 = 1
DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}

P = ctypes.POINTER
lib.sl_ep_dispatch_cuda.argtypes = [ctypes.c_int64, P(EpDesc)] + [vp] * 11
lib.sl_ep_combine_cuda.argtypes = [ctypes.c_int64, P(EpDesc)] + [vp] * 6
lib.sl_ep_redispatch_cuda.argtypes = [ctypes.c_int64, P(EpDesc)] + [vp] * 4
lib.sl_ep_layout_cuda.argtypes = [P(EpDesc)] + [vp] * 5
lib.sl_ep_fan_out_cuda.argtypes = [P(FanDesc)] + [vp] * 7
lib.sl_ep_fan_in_cuda.argtypes = [P(FanDesc)] + [vp] * 5
lib.sl_ep_fan_in_bwd_cuda.argtypes = [P(FanDesc)] + [vp] * 8
lib.sl_ep_fan_workspace_size.argtypes = [P(FanDesc)]
lib.sl_ep_fan_workspace_size.restype = ctypes.c_size_t
for f in (
    "sl_ep_dispatch_cuda",
    "sl_ep_combine_cuda",
    "sl_ep_redispatch_cuda",
    "sl_ep_layout_cuda",
    "sl_ep_fan_out_cuda",
    "sl_ep_fan_in_cuda",
    "sl_ep_fan_in_bwd_cuda",
):
    getattr(lib, f).restype = ctypes.c_int


def check(st, what):
    if st != 0:
        raise RuntimeError(
            f"{what}: {lib.sl_last_error().decode()} ({lib.sl_status_string(st).decode()})"
        )


def ptr(a):
    return vp(a.data.ptr) if a is not None else vp(0)


TRANSPORTS = {"peer": 0, "ipc": 1, "nccl": 2}


def make_comm(r, num_sms=20, timeout_s=None, transport="peer", buffer_bytes=0):
    """A communicator over GPUs 0..r-1 of this process. transport: peer (NVLink, rows straight
    between the buffers), ipc (staging areas, as across processes), nccl (our NCCL communicator)."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("SLUICE_EP_TIMEOUT", "20"))
    ords = (ctypes.c_int * r)(*range(r))
    d = _CommDesc(
        ctypes.sizeof(_CommDesc),
        1,
        r,
        timeout_s,
        1,
        ctypes.cast(ords, P(ctypes.c_int)),
        num_sms,
        TRANSPORTS[transport],
        buffer_bytes,
    )
    cid = ctypes.c_int64(0)
    check(lib.sl_ep_comm_create(ctypes.byref(d), ctypes.byref(cid)), "comm_create")
    if transport == "nccl":  # one process: rank 0 makes the id, the others share it; then connect
        blob = ctypes.create_string_buffer(256)
        n = ctypes.c_size_t(0)
        check(lib.sl_ep_comm_export(cid.value, 0, 0, blob, ctypes.byref(n)), "comm_export")
        check(lib.sl_ep_comm_connect(cid.value), "comm_connect")
    return cid.value


def ep_desc(t, h, k, e, r, dtype=BF16):
    return EpDesc(ctypes.sizeof(EpDesc), t, h, k, e, r, dtype, 0)


class Rank:
    """One rank's device buffers for dispatch -> combine -> redispatch."""

    def __init__(self, dev, t, h, k, e, r, x_bits, idx, w, itemsize=2):
        self.dev = dev
        n, l = t * r, e // r
        store = {2: np.uint16, 4: np.uint32}[itemsize]
        with cp.cuda.Device(dev):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.x = cp.asarray(x_bits)
            self.idx = cp.asarray(idx, cp.int32)
            self.w = cp.asarray(w, cp.float32)
            poison = 0xFFFF if itemsize == 2 else 0xFFFFFFFF  # NaN bits: every output poisoned
            self.recv_x = cp.full((n, h), poison, store)
            self.recv_idx = cp.full((n, k), -7, cp.int32)
            self.recv_w = cp.full((n, k), np.nan, cp.float32)
            self.num_recv = cp.full((1,), -7, cp.int32)
            self.counts = cp.full((l,), -7, cp.int32)
            self.send_row = cp.full((t, r), -7, cp.int32)
            self.recv_src = cp.full((n,), -7, cp.int32)
            self.out = cp.full((t, h), poison, store)
            self.out_w = cp.full((t, k), np.nan, cp.float32)
            self.g = None
            self.rd = cp.full((n, h), poison, store)

    def dispatch(self, comm, d):
        with cp.cuda.Device(self.dev):
            check(
                lib.sl_ep_dispatch_cuda(
                    comm,
                    ctypes.byref(d),
                    ptr(self.x),
                    ptr(self.idx),
                    ptr(self.w),
                    ptr(self.recv_x),
                    ptr(self.recv_idx),
                    ptr(self.recv_w),
                    ptr(self.num_recv),
                    ptr(self.counts),
                    ptr(self.send_row),
                    ptr(self.recv_src),
                    vp(self.stream.ptr),
                ),
                "dispatch",
            )

    def combine(self, comm, d, y, y_w=None):
        with cp.cuda.Device(self.dev):
            check(
                lib.sl_ep_combine_cuda(
                    comm,
                    ctypes.byref(d),
                    ptr(y),
                    ptr(y_w),
                    ptr(self.send_row),
                    ptr(self.out),
                    ptr(self.out_w) if y_w is not None else vp(0),
                    vp(self.stream.ptr),
                ),
                "combine",
            )

    def redispatch(self, comm, d, g):
        with cp.cuda.Device(self.dev):
            check(
                lib.sl_ep_redispatch_cuda(
                    comm,
                    ctypes.byref(d),
                    ptr(g),
                    ptr(self.recv_src),
                    ptr(self.rd),
                    vp(self.stream.ptr),
                ),
                "redispatch",
            )

    def sync(self):
        with cp.cuda.Device(self.dev):
            self.stream.synchronize()

"""The C entry points called from Python, with their argument types, and the descriptor mirrors of
include/sluice.h (sluice.ops.c_structs, re-exported here). The ops use them to size workspaces and
to make communicators."""

from __future__ import annotations

import ctypes

from ._lib import lib
from .c_structs import (  # noqa: F401 (re-exported: the ops and tests use them from here)
    DTYPE_CODES,
    EP_TRANSPORTS,
    EpCommDesc,
    EpDesc,
    EpFanDesc,
    GmmDesc,
    QuantDesc,
    SwigluDesc,
)

lib.sl_gmm_cuda_workspace_size.restype = ctypes.c_size_t
lib.sl_gmm_cuda_workspace_size.argtypes = [ctypes.POINTER(GmmDesc)]
lib.sl_ep_fan_workspace_size.restype = ctypes.c_size_t
lib.sl_ep_fan_workspace_size.argtypes = [ctypes.POINTER(EpFanDesc)]
lib.sl_ep_comm_create.argtypes = [ctypes.POINTER(EpCommDesc), ctypes.POINTER(ctypes.c_int64)]
lib.sl_ep_comm_destroy.argtypes = [ctypes.c_int64]
lib.sl_ep_comm_export.argtypes = [
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_size_t),
]
lib.sl_ep_comm_needs.argtypes = [
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_int),
]
lib.sl_ep_comm_import.argtypes = [
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_size_t,
]
lib.sl_ep_comm_connect.argtypes = [ctypes.c_int64]
lib.sl_ep_comm_disconnect.argtypes = [ctypes.c_int64]
for _f in ("create", "destroy", "export", "needs", "import", "connect", "disconnect"):
    getattr(lib, f"sl_ep_comm_{_f}").restype = ctypes.c_int


def gmm_workspace_bytes(
    *, m, k, n, num_groups, num_local_groups, dtype, out_dtype, transpose_rhs
) -> int:
    """Device scratch the CUDA kernels need for one gmm/tgmm problem (O(G) bytes; never 0 here)."""
    d = GmmDesc(
        ctypes.sizeof(GmmDesc),
        1,
        m,
        k,
        n,
        num_groups,
        num_local_groups,
        DTYPE_CODES[str(dtype)],
        DTYPE_CODES[str(dtype)],
        DTYPE_CODES[str(out_dtype)],
        int(transpose_rhs),
    )
    return max(int(lib.sl_gmm_cuda_workspace_size(ctypes.byref(d))), 16)


def fan_workspace_bytes(n, h, k, l) -> int:
    """Device scratch of fan_out for N rows of H with k slots over L local experts (never 0)."""
    d = EpFanDesc(ctypes.sizeof(EpFanDesc), n, h, k, l, 0, 0)
    return max(int(lib.sl_ep_fan_workspace_size(ctypes.byref(d))), 16)

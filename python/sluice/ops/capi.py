"""ctypes mirrors of include/sluice.h: the descriptor structs, the enum values Python passes, and the
argument types of the C entry points called from Python. The ops use them to size workspaces and to
make communicators; harnesses that drive the C API directly (bench/, tests/gpu/) use them too.
tests/python/ops/test_c_mirrors.py checks every mirror against the header's layout."""

from __future__ import annotations

import ctypes

from ._lib import lib

# sl_dtype
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int32": 3, "float8_e4m3fn": 4}
# sl_ep_transport ("nvlink" is SL_EP_TRANSPORT_PEER)
EP_TRANSPORTS = {"nvlink": 0, "ipc": 1, "nccl": 2}


class GmmDesc(ctypes.Structure):
    """sl_gmm_desc."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("batch", ctypes.c_int64),
        ("m", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("num_groups", ctypes.c_int64),
        ("num_local_groups", ctypes.c_int64),
        ("lhs_dtype", ctypes.c_int),
        ("rhs_dtype", ctypes.c_int),
        ("out_dtype", ctypes.c_int),
        ("transpose_rhs", ctypes.c_int),
        ("skip_unused_rows", ctypes.c_int),
    ]


class SwigluDesc(ctypes.Structure):
    """sl_swiglu_desc."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("rows", ctypes.c_int64),
        ("ff", ctypes.c_int64),
        ("num_groups", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("skip_unused_rows", ctypes.c_int),
    ]


class EpCommDesc(ctypes.Structure):
    """sl_ep_comm_desc."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_groups", ctypes.c_int),
        ("num_ranks", ctypes.c_int),
        ("timeout_s", ctypes.c_double),
        ("use_cuda", ctypes.c_int),
        ("device_ordinals", ctypes.POINTER(ctypes.c_int)),
        ("num_sms", ctypes.c_int),
        ("transport", ctypes.c_int),
        ("buffer_bytes", ctypes.c_size_t),
    ]


class EpDesc(ctypes.Structure):
    """sl_ep_desc."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("num_ranks", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("tag", ctypes.c_int64),
        ("recv_rows", ctypes.c_int64),
    ]


class EpFanDesc(ctypes.Structure):
    """sl_ep_fan_desc."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_rows", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("num_local_experts", ctypes.c_int64),
        ("x_dtype", ctypes.c_int),
        ("out_dtype", ctypes.c_int),
        ("max_rows", ctypes.c_int64),
        ("skip_unused_rows", ctypes.c_int),
    ]


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

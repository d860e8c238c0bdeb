"""ctypes mirrors of include/sluice.h: the descriptor structs and the enum values Python passes.
The standard library only, and no relative import, so that the harnesses that drive the C API
without the package (bench/, tests/gpu/) load this file by its path; sluice.ops.capi re-exports
it. tests/python/ops/test_c_mirrors.py checks every mirror against the header's layout."""

from __future__ import annotations

import ctypes

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


class QuantDesc(ctypes.Structure):
    """sl_quantize_fp8_desc."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("batch", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("x_rows", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("block_rows", ctypes.c_int),
        ("block_cols", ctypes.c_int),
        ("power_of_two", ctypes.c_int),
        ("src_rows", ctypes.c_int64),
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

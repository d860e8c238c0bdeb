"""Loads libsluice and registers its XLA FFI targets for every platform it was built for."""

from __future__ import annotations

import ctypes
import os
import pathlib

import jax

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parent.parent


def _candidates():
    env = os.environ.get("SLUICE_LIBRARY")
    if env:
        yield pathlib.Path(env)
    yield _HERE / "libsluice.so"
    # An in-tree CMake build (cmake -B build): what the GPU scripts use.
    for build in sorted(_REPO.glob("build*/")):
        yield build / "libsluice.so"


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            return ctypes.CDLL(str(path))
    raise ImportError(
        "sluice: libsluice.so not found (looked in: " + ", ".join(tried) + "). "
        "Install with `pip install --no-build-isolation .` or set SLUICE_LIBRARY."
    )


lib = _load()
lib.sl_has_cuda.restype = ctypes.c_int
lib.sl_version.restype = ctypes.c_int
lib.sl_last_error.restype = ctypes.c_char_p
lib.sl_status_string.restype = ctypes.c_char_p
lib.sl_status_string.argtypes = [ctypes.c_int]


class GmmDesc(ctypes.Structure):
    """Mirror of sl_gmm_desc in include/sluice.h."""

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


lib.sl_gmm_cuda_workspace_size.restype = ctypes.c_size_t
lib.sl_gmm_cuda_workspace_size.argtypes = [ctypes.POINTER(GmmDesc)]

DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int32": 3}


def has_cuda() -> bool:
    return bool(lib.sl_has_cuda())


def register_targets(targets: dict[str, str]) -> None:
    """Registers FFI targets `name -> symbol prefix` (symbols `<prefix>_cpu` and, in a CUDA build,
    `<prefix>_cuda`; registering for CUDA is harmless where jax has no GPU backend)."""
    for name, symbol in targets.items():
        cpu = jax.ffi.pycapsule(getattr(lib, symbol + "_cpu"))
        jax.ffi.register_ffi_target(name, cpu, platform="cpu")
        if has_cuda():
            cuda = jax.ffi.pycapsule(getattr(lib, symbol + "_cuda"))
            jax.ffi.register_ffi_target(name, cuda, platform="CUDA")


register_targets({"sluice_gmm": "sl_ffi_gmm", "sluice_tgmm": "sl_ffi_tgmm"})


def gmm_workspace_bytes(
    *, m, k, n, num_groups, num_local_groups, dtype, out_dtype, transpose_rhs
) -> int:
    """Device scratch the CUDA kernels need for one problem (O(G) bytes; never 0 here)."""
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

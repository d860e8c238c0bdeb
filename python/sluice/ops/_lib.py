"""Loads libsluice and registers its XLA FFI targets for every platform it was built for.

The library is looked up in this order: the path in the environment variable SLUICE_LIBRARY, the
installed package (sluice/libsluice.so), then an in-tree CMake build (build*/libsluice.so at the
repository root, what the GPU scripts and a CPU checkout use).
"""

from __future__ import annotations

import ctypes
import os
import pathlib

import jax

_PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # python/sluice (or site-packages/sluice)
_REPO = _PACKAGE.parents[1]


def _candidates():
    env = os.environ.get("SLUICE_LIBRARY")
    if env:
        yield pathlib.Path(env)
    yield _PACKAGE / "libsluice.so"
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


def has_cuda() -> bool:
    """Whether this libsluice was built with its CUDA kernels."""
    return bool(lib.sl_has_cuda())


TARGETS: list[str] = []  # every FFI target registered, in order


def register_targets(targets: dict[str, str]) -> None:
    """Registers FFI targets `name -> symbol prefix` (symbols `<prefix>_cpu` and, in a CUDA build,
    `<prefix>_cuda`; registering for CUDA is harmless where jax has no GPU backend)."""
    for name, symbol in targets.items():
        TARGETS.append(name)
        cpu = jax.ffi.pycapsule(getattr(lib, symbol + "_cpu"))
        jax.ffi.register_ffi_target(name, cpu, platform="cpu")
        if has_cuda():
            cuda = jax.ffi.pycapsule(getattr(lib, symbol + "_cuda"))
            jax.ffi.register_ffi_target(name, cuda, platform="CUDA")


def export_disabled_checks() -> list:
    """What `jax.export.export(fn, disabled_checks=...)` needs to serialize a program that calls
    sluice: one `jax.export.DisabledSafetyCheck.custom_call(name)` per sluice FFI target (gmm, tgmm,
    their FP8 forms, swiglu and the ep ops). jax.export refuses custom calls it does not know to be
    stable; sluice's are stable within one libsluice build. A deserialized program runs where
    libsluice is loaded (`import sluice` registers the targets). An ep program also needs the
    communicator it was traced against (its id is an attribute of the call), so it runs in the
    process that exported it, while that sluice.ep.setup stands, under a jit over as many devices
    as it was exported for."""
    from . import ep, gmm, gmm_fp8, swiglu  # noqa: F401  (their imports register every target)

    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in TARGETS]

"""Test session setup: 8 CPU devices (for shard_map / expert parallelism) before jax is imported,
and tests/ on the path for the shared list of shapes (tests/shapes.py, which bench/ uses too)."""

import os
import pathlib
import sys

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

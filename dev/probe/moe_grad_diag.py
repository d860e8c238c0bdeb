"""Which expert-parallel MoE path has the right gradients on this machine: each path's output and
gradients (the GPU suite's bf16 MoE layer with DeepSeek-V3 routing, tests/gpu/test_jax_gpu.py
_moe_layer_grads) against the ragged_dot path on one device, as relative errors, one line a path,
including the paths the suite does not assert on. Paths: sluice on one device; ragged_dot over every
device (jax.lax.ragged_all_to_all); sluice over every device (sluice.ep and sluice.gmm); sluice.gmm
with ragged_all_to_all; sluice.ep with ragged_dot. bench/results/ragged-a2a-grad-h100x2-20261126.md
has runs on 2x H100 (of this script's first version, with its own inputs): the one that found
ragged_all_to_all's gradients wrong, and the one after the fix (moe.py's _a2a_buffer).

    SLUICE_LIBRARY=... PYTHONPATH=python python3 dev/probe/moe_grad_diag.py
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from test_jax_gpu import _moe_errors, _moe_layer_grads

ref = _moe_layer_grads("ragged_dot", False)
for name, impl, over_all, kw in [
    ("sluice 1gpu", "sluice", False, {}),
    ("ragged EP", "ragged_dot", True, {}),
    ("sluice EP", "sluice", True, {}),
    ("sluice EP gmm-only", "sluice", True, {"use_sluice_dispatch": False}),
    ("sluice EP dispatch-only", "sluice", True, {"use_sluice_gmm": False}),
]:
    try:
        errs = _moe_errors(_moe_layer_grads(impl, over_all, **kw), ref)
        print(name, {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    except (Exception, pytest.skip.Exception) as e:  # noqa: BLE001 - reported; the others still run
        print(name, "ERROR", type(e).__name__, str(e)[:300], flush=True)

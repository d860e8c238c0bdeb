"""sluice: dropless Mixture-of-Experts primitives for JAX, in C/CUDA through the XLA FFI.

sluice.gmm / sluice.tgmm    grouped GEMM (ragged rows / ragged contraction), differentiable
sluice.gmm_reference ...    pure-jnp references of the same ops
sluice.ragged_dot ...       jax.lax.ragged_dot / ragged_dot_general's exact signatures on gmm / tgmm
sluice.export_disabled_checks()   what jax.export needs to serialize programs that call sluice
sluice.swiglu               an expert block's SwiGLU activation over its groups' rows only
sluice.ep                   expert-parallel dispatch / combine and the local fan-out / fan-in
sluice.fp8                  FP8 (e4m3) block quantization with DeepSeek-V3's scale layouts, the FP8
                            grouped GEMMs on quantized operands (fp8.gmm / fp8.tgmm) and their
                            float32 references; sluice.gmm(..., fp8=sluice.fp8.Recipe()) is the
                            differentiable FP8 path

The package's folders: ops/ (the library, its FFI targets and one differentiable function per op),
nn/ (the MoE layer and the decoder LM, built from the ops), training/ (the corpus, the optimizer and
the training step) and cli/ (the sluice-* commands).
"""

from .ops import ep, fp8
from .ops._lib import export_disabled_checks, has_cuda
from .ops.checks import ShapeError
from .ops.gmm import gmm, gmm_reference, tgmm, tgmm_reference
from .ops.ragged import ragged_dot, ragged_dot_general
from .ops.swiglu import swiglu, swiglu_reference

__version__ = "0.1.0"

__all__ = [
    "ShapeError",
    "__version__",
    "ep",
    "export_disabled_checks",
    "fp8",
    "gmm",
    "gmm_reference",
    "has_cuda",
    "ragged_dot",
    "ragged_dot_general",
    "swiglu",
    "swiglu_reference",
    "tgmm",
    "tgmm_reference",
]

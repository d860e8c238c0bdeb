"""The ops: libsluice loaded (_lib), the C API's ctypes mirrors (capi), shard_map typing for FFI
results (vma), the argument checks and explicit-mesh placement the ops share (checks), and one
differentiable JAX function per op with a pure-jnp reference beside it: gmm / tgmm, swiglu, and the
expert-parallel ep package (communicators, dispatch / combine, fan-out / fan-in); fp8 holds the FP8
block quantization and the FP8 grouped GEMMs' references, and re-exports the FP8 ops of gmm_fp8
(fp8.gmm / fp8.tgmm on quantized operands, the Recipe of gmm's fp8 path); ragged holds
ragged_dot / ragged_dot_general's exact signatures over gmm / tgmm."""

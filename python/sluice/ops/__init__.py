"""The ops: libsluice loaded (_lib), the C API's ctypes mirrors (capi),
shard_map typing for FFI results (vma), and one differentiable JAX
function per op with a pure-jnp reference beside it: gmm / tgmm, swiglu, and the expert-parallel ep
package (communicators, dispatch / combine, fan-out / fan-in)."""

"""Minimal repro, for JAX upstream, of why gradients through jax.lax.ragged_all_to_all came out wrong
inside shard_map (bench/results/ragged-a2a-grad-h100x2-20261126.md): the op types its result like its
`output` operand alone. With a plain jnp.zeros buffer (invariant across the ranks) the result is typed
invariant although each rank receives different rows; where it meets rank-varying values JAX inserts
an invariant-to-varying cast whose transpose is a psum, so the backward sums the received rows'
cotangents over the ranks. Tracing shows it on any machine (XLA:CPU cannot run the op):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 dev/probe/ragged_a2a_vma_repro.py

prints (jax 0.10.2, 2026-11-26) an operand typed {V:x}, a result without it and a psum in the
backward; with the buffer cast to vary over 'x' (sluice's fix, python/sluice/moe.py _a2a_buffer, which
made the gradients right on GPUs with jax 0.11.2) the result varies and the psum is gone.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

mesh = Mesh(np.array(jax.devices()[:2]), ("x",))


def backward_has_psum(fixed):
    def per_rank(operand, sizes, scale):
        buf = jnp.zeros((6, 4))
        if fixed:
            buf = jax.lax.pcast(buf, ("x",), to="varying")
        s = sizes[0]
        out = jax.lax.ragged_all_to_all(operand, buf, s, s, s, s, axis_name="x")
        print(f"fixed={fixed}: operand", jax.typeof(operand), "-> result", jax.typeof(out))
        return jnp.sum(out * scale)[None]  # scale varies over 'x': out is cast to varying here

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P("x"), P("x"), P("x")), out_specs=P("x"))
    operand, sizes, scale = jnp.ones((8, 4)), jnp.zeros((2, 2), jnp.int32), jnp.ones((12, 4))
    jaxpr = jax.make_jaxpr(jax.grad(lambda o: f(o, sizes, scale).sum()))(operand)
    return "psum" in str(jaxpr)


for fixed in (False, True):
    print(f"fixed={fixed}: psum in the backward: {backward_has_psum(fixed)}")

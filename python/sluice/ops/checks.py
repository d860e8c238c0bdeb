"""The argument checks gmm, tgmm and swiglu share, in jax.lax.ragged_dot's terms: what they accept
where ragged_dot does (any integer group sizes, `precision`, `out_sharding`, symbolic row counts)
and which exception a bad argument raises (ragged_dot's TypeError for a bad shape).

Placement under an explicit-sharding mesh (jax.sharding.AxisType.Explicit): the kernels run on
whole operands, so `replicated` reshards any operand sharded over explicit axes to replicated before
the FFI call (XLA gathers it; its gradient goes back to the operand's sharding), and `place` gives
the result `out_sharding` (as ragged_dot's), or where none is given the sharding dot_general would
infer from the operands (e.g. P('x', None) for lhs rows sharded over 'x'). Outside explicit meshes
both are the identity. Sharded expert compute is shard_map + group_offset (sluice.ep).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INT32_MAX = np.iinfo(np.int32).max
_AxisType = getattr(jax.sharding, "AxisType", None)


class ShapeError(TypeError, ValueError):
    """A bad operand shape: a TypeError as jax.lax.ragged_dot raises for the same cases, and a
    ValueError as sluice raised before (callers catching either keep working)."""


def check_float(op, name, dtype):
    dtype = jnp.dtype(dtype)
    if dtype not in FLOATS:
        hint = " (cast float64 to float32 first)" if dtype == jnp.float64 else ""
        raise TypeError(
            f"sluice.{op}: {name} must be float32, bfloat16 or float16, got {dtype}{hint}"
        )


def is_static(d) -> bool:
    """Whether a dimension is a concrete int (not a jax.export symbolic dimension)."""
    return isinstance(d, (int, np.integer))


def group_sizes_int32(op, group_sizes, m):
    """group_sizes [..., G] of any integer dtype as int32 (the kernels' type). Valid sizes (each in
    [0, M], M < 2**31, checked here where M is static) convert exactly; a wider value saturates at
    the int32 bounds, so an invalid size stays invalid (an error on the CPU, clamped on a GPU)."""
    gs = jnp.asarray(group_sizes)
    if not jnp.issubdtype(gs.dtype, jnp.integer):
        raise TypeError(
            f"sluice.{op}: group_sizes must be int32 or another integer dtype, got {gs.dtype}"
        )
    if is_static(m) and m > _INT32_MAX:
        raise ValueError(f"sluice.{op}: {m} rows exceed the kernels' int32 row index")
    if gs.dtype == jnp.int32:
        return gs
    info = jnp.iinfo(gs.dtype)
    if info.max > _INT32_MAX:
        gs = jnp.minimum(gs, jnp.asarray(_INT32_MAX, gs.dtype))
    if info.min < -_INT32_MAX - 1:
        gs = jnp.maximum(gs, jnp.asarray(-_INT32_MAX - 1, gs.dtype))
    return gs.astype(jnp.int32)


def check_group_count(op, group_sizes):
    if group_sizes.ndim != 1:
        raise ShapeError(f"sluice.{op}: group_sizes must be 1-D [G], got shape {group_sizes.shape}")
    if not is_static(group_sizes.shape[0]):
        raise ShapeError(f"sluice.{op}: the group count G must be static, got {group_sizes.shape}")


def check_group_offset(op, group_offset):
    """group_offset: None, or an integer scalar or shape-(1,) array (it may live on the device)."""
    if group_offset is None:
        return
    shape = np.shape(group_offset)
    if shape not in ((), (1,)):
        raise ValueError(f"sluice.{op}: group_offset must be a scalar or shape (1,), got {shape}")
    if not jnp.issubdtype(jnp.result_type(group_offset), jnp.integer):
        raise TypeError(f"sluice.{op}: group_offset must be an integer")


def _is_precision(p) -> bool:
    if p is None or isinstance(p, jax.lax.Precision):
        return True
    try:
        jax.lax.Precision(p)  # its names: "highest", "float32", "default", ...
    except (ValueError, TypeError, KeyError):
        return False
    return True


def check_precision(op, precision):
    """ragged_dot's `precision`: None, a lax.Precision or its name, a pair of them, or a
    lax.DotAlgorithmPreset. sluice takes each and computes the same way (exact products of the
    input dtype, float32 accumulation): at least what any of them asks."""
    names = ("DotAlgorithm", "DotAlgorithmPreset")
    algos = tuple(getattr(jax.lax, n) for n in names if hasattr(jax.lax, n))
    if algos and isinstance(precision, algos):
        return
    items = precision if isinstance(precision, (tuple, list)) else (precision,)
    ok = len(items) in (1, 2) and all(_is_precision(p) for p in items)
    if not ok:
        raise ValueError(
            f"sluice.{op}: precision must be None, a jax.lax.Precision (or its name), a pair of "
            f"them or a jax.lax.DotAlgorithmPreset, got {precision!r}"
        )


# ---- placement under explicit-sharding meshes --------------------------------------------------
def _explicit_names(mesh) -> frozenset:
    if _AxisType is None or mesh.empty:
        return frozenset()
    types = getattr(mesh, "axis_types", ())
    return frozenset(n for n, t in zip(mesh.axis_names, types) if t == _AxisType.Explicit)


def _spec(x):
    """x's PartitionSpec entries (one per dim) over explicit mesh axes, or None where x is not
    sharded over any explicit axis."""
    s = getattr(jax.typeof(x), "sharding", None)
    if s is None or getattr(s, "mesh", None) is None:
        return None
    names = _explicit_names(s.mesh)
    entries = tuple(s.spec) + (None,) * (x.ndim - len(s.spec))
    flat = [a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return entries if names.intersection(flat) else None


def _explicit_mesh(*arrays) -> bool:
    """Whether the current mesh, or any operand's, has explicit axes."""
    meshes = [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in arrays]
    current = getattr(jax.sharding, "get_abstract_mesh", None)
    meshes.append(current() if current else None)
    return any(m is not None and _explicit_names(m) for m in meshes)


def replicated(*arrays):
    """The operands, each sharded over explicit mesh axes resharded to replicated."""
    full = jax.sharding.PartitionSpec()
    return tuple(x if _spec(x) is None else jax.sharding.reshard(x, full) for x in arrays)


def inferred(*dims):
    """A result spec from its dims' sources: each (operand, dim) or None; an axis used twice is
    kept at its first use only (as dot_general's inference drops conflicts)."""
    out, used = [], set()
    for src in dims:
        e = None
        if src is not None:
            spec = _spec(src[0])
            e = None if spec is None else spec[src[1]]
        axes = () if e is None else (e if isinstance(e, tuple) else (e,))
        if used.intersection(axes):
            e, axes = None, ()
        used.update(axes)
        out.append(e)
    return jax.sharding.PartitionSpec(*out)


def place(out, out_sharding, operands, default):
    """The result with `out_sharding` (ragged_dot's argument: a NamedSharding, or a PartitionSpec
    of the current mesh), or under an explicit mesh with `default()` (see the module docstring)."""
    if out_sharding is not None:
        return jax.sharding.reshard(out, out_sharding)
    if _explicit_mesh(*operands):
        return jax.sharding.reshard(out, default())
    return out

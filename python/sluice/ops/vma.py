"""shard_map typing for FFI results: which manual mesh axes a value varies over, and the
ShapeDtypeStruct keywords that give an FFI result the same. Without them, shard_map's type check
(check_vma) sees FFI results as invariant and its transpose would sum cotangents over the axis."""

import inspect

import jax

_SDS_KW = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters


def _varying(a) -> frozenset:
    """The manual mesh axes `a` varies over (jax >= 0.10: manual_axis_type.varying; before: vma)."""
    t = jax.typeof(a)
    m = getattr(t, "manual_axis_type", None)
    if m is not None:
        return frozenset(getattr(m, "varying", ()) or ())
    return frozenset(getattr(t, "vma", ()) or ())


def _vary_kw(*refs, extra=()):
    """ShapeDtypeStruct keywords that make an FFI result vary over the manual axes its operands vary
    over (plus `extra`: an exchange's result differs by rank). Without them, shard_map's type check
    sees the result as invariant and its transpose would sum our cotangents over the axis."""
    axes = frozenset(extra).union(*[_varying(r) for r in refs])
    if not axes:
        return {}
    for r in refs:
        t = jax.typeof(r)
        m = getattr(t, "manual_axis_type", None)
        if m is not None and "manual_axis_type" in _SDS_KW:
            # the type lives on the abstract mesh of the shard_map
            sharding = jax.sharding.NamedSharding(t.sharding.mesh, jax.sharding.PartitionSpec())
            return {"manual_axis_type": m.update(varying=axes), "sharding": sharding}
    return {"vma": axes} if "vma" in _SDS_KW else {}


def match_vma(ct, primal):
    """`ct` with the varying-manual-axes type of its primal, as custom_vjp requires inside shard_map.
    An axis the primal varies over and ct does not: ct is the same on every shard, so it is only
    retyped (pcast). An axis ct varies over and the primal does not: the primal was implicitly
    broadcast to every shard, so its cotangent is the sum of the shards' cotangents (psum)."""
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    missing = tuple(sorted(_varying(primal) - _varying(ct)))
    if missing:
        ct = jax.lax.pcast(ct, missing, to="varying")
    return ct

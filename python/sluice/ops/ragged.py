"""jax.lax.ragged_dot and ragged_dot_general with their exact signatures, on sluice's kernels: a
swap of the module name (`jax.lax.ragged_dot` -> `sluice.ragged_dot`) in existing model code.

ragged_dot_general's modes that sluice covers (lhs ragged dimension, dimension numbers):
  1. ragged rows (non-contracting): lhs [M, K], rhs [G, K, N] (or [G, N, K]), lhs_ragged (0,),
     rhs_group (0,), contracting ((1,), (1,)) (or ((1,), (2,))), no batch dims -> gmm, [M, N].
  2. ragged contraction: lhs [M, K], rhs [M, N], lhs_ragged (0,), rhs_group (), contracting
     ((0,), (0,)), no batch dims -> tgmm, [G, K, N].
Batch dimensions arrive through vmap (both ops batch). Any other dimension numbers (mode 3, ragged
batch; explicit batch dims; other layouts) raise NotImplementedError naming the modes above:
transpose the operands into one of them, or call jax.lax.ragged_dot_general.
"""

from __future__ import annotations

import jax

from .gmm import gmm, tgmm

_MODES = (
    "sluice covers ragged rows (lhs [M, K], rhs [G, K, N] or [G, N, K]: lhs_ragged (0,), "
    "rhs_group (0,), contracting ((1,), (1,)) or ((1,), (2,))) and ragged contraction "
    "(lhs [M, K], rhs [M, N]: lhs_ragged (0,), rhs_group (), contracting ((0,), (0,))), "
    "without batch dims (vmap adds them)"
)


def ragged_dot(
    lhs,
    rhs,
    group_sizes,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    out_sharding=None,
):
    """jax.lax.ragged_dot's signature and semantics on sluice.gmm: lhs [M, K], rhs [G, K, N],
    group_sizes [G] -> [M, N]. group_offset (which ragged_dot does not lower) takes rhs
    [G_local, K, N] holding groups [offset, offset + G_local), as in sluice.gmm."""
    return gmm(
        lhs,
        rhs,
        group_sizes,
        precision=precision,
        preferred_element_type=preferred_element_type,
        group_offset=group_offset,
        out_sharding=out_sharding,
    )


def _dims(dn):
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def ragged_dot_general(
    lhs,
    rhs,
    group_sizes,
    ragged_dot_dimension_numbers,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    out_sharding=None,
):
    """jax.lax.ragged_dot_general's signature, for the modes in this module's docstring."""
    dn = ragged_dot_dimension_numbers
    lc, rc, lb, rb = _dims(dn)
    ragged, group = tuple(dn.lhs_ragged_dimensions), tuple(dn.rhs_group_dimensions)
    kw = {
        "precision": precision,
        "preferred_element_type": preferred_element_type,
        "group_offset": group_offset,
        "out_sharding": out_sharding,
    }
    ranks = (jax.numpy.ndim(lhs), jax.numpy.ndim(rhs))
    if not lb and not rb and ragged == (0,) and ranks[0] == 2:
        if group == (0,) and lc == (1,) and rc in ((1,), (2,)) and ranks[1] == 3:
            return gmm(lhs, rhs, group_sizes, transpose_rhs=rc == (2,), **kw)
        if group == () and lc == (0,) and rc == (0,) and ranks[1] == 2:
            return tgmm(lhs, rhs, group_sizes, **kw)
    raise NotImplementedError(
        f"sluice.ragged_dot_general: dimension numbers {dn} (lhs rank {ranks[0]}, rhs rank "
        f"{ranks[1]}) are not covered; {_MODES}"
    )

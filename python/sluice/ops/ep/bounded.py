"""bounded_moe: dropless expert parallelism whose buffers hold C rows, whatever the routing.

The unbounded path (dispatch -> experts -> combine) sizes the receive buffer for T*R rows and the
expert block for T*R*min(k, L): R times the balanced mean. Here every rank's receive buffer and
expert block hold at most C (row, slot) pairs a round, and a routing that sends a rank more runs
further rounds inside the same program, each a dispatch of at most C pairs per rank -> the experts
-> the rows pulled back to their source tokens.

The rounds. Rank d's unbounded receive order is fixed: by source rank, then token. Its pairs (a
received row carries one pair per local expert of the token, 1..min(k, L)) are numbered in that
order; with the all-gathered [R, R] pair counts every source knows where each of its rows starts
in each receiver's numbering, so a row starting at pair p goes in round p // W, W = C - min(k, L)
+ 1 (a row never straddles two rounds; a round holds at most W rows and C pairs). The rounds'
count, max over the receivers of (start of its last row) // W + 1, comes from the same gathered
counts: the same on every rank, on the device. A round is a dispatch of the token slots of that
round alone (the others set to -1), so the transports only need a receive buffer of
N = min(W, T*R) rows.

One round or more. Round 0 always runs. When it is the only one (the common case) it holds every
row of every token, and combine sums them: the unbounded path's own sum. When there are more, a
lax.cond takes the other branch, where a lax.while_loop runs the rounds past the first. XLA:GPU
reads a cond's predicate (and a while loop's) back to the host: one sync per layer and direction
in the common case. Buffers that hold every routing (C >= T*R*min(k, L): e.g. F = 2 at two ranks
and k <= E/R) can need no second round, so the cond is left out and nothing syncs.

The results, bit for bit. combine sums a token's rows over ranks in rank order in f32; with more
than one round a token's rows may come back in different rounds, so each round pulls its rows into
the token's slots [T, min(k, R)] (slot j: the token's j-th destination rank in rank order) and the
slots are summed in slot order in f32 and rounded once at the end: the unbounded sum, bit for bit,
as long as each row's expert output does not depend on which rows share its round (true of
sluice's gmm, swiglu and fan ops). With fp8 the rows travel as dispatch(..., fp8=)'s e4m3 rows and
1x128 scales, packed once for every round (the blocks are per row, so a row's bytes are the
unbounded path's). The backward does the same for d x (and for d topk_weights, one non-zero slot
per weight): dispatch's transpose (a combine) after one round, the slots after more. The expert
weights' gradients are summed over the rounds: exact when there is one round, otherwise the same
sum rounded per round.

What the backward keeps: round 0's residuals (the expert block's, O(C)), the layer's x and the
[T, k] slot rounds; the rounds past the first are recomputed in the backward (a dispatch and the
experts' forward again). Memory per layer O(C * H) plus O(T * (H + R)) for x and the layout.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..vma import match_vma
from .comm import _comm_for, _where
from .exchange import (
    Dispatched,
    Handle,
    _combine_call,
    _dispatch_call,
    _pack_fp8,
    _redispatch_call,
    _unpack_fp8,
)


def bounded_rows(num_tokens: int, topk: int, factor: float) -> int:
    """C for a factor F: ceil(F * T * k) (T*k pairs is every rank's balanced mean), rounded up to a
    multiple of 16 rows."""
    if not factor > 0:
        raise ValueError(f"sluice.ep.bounded_rows: factor must be positive, got {factor!r}")
    return max(16, -(-math.ceil(factor * num_tokens * topk) // 16) * 16)


def _layout(idx, num_ranks, num_local, window, axis_name):
    """The round of every token slot and the rounds' count. idx [T, k] -> (slot_round int32 [T, k]
    (-1: no expert), dest_slot int32 [T, R] (the slot j of destination d among the token's
    destinations, -1 if none), rounds int32 [], stats)."""
    t, k = idx.shape
    r = num_ranks
    owner = jnp.where(idx >= 0, idx // num_local, -1)
    ranks = jnp.arange(r, dtype=jnp.int32)
    pairs = jnp.zeros((t, r), jnp.int32)
    for j in range(k):
        pairs = pairs + (owner[:, j : j + 1] == ranks[None, :]).astype(jnp.int32)
    goes = pairs > 0
    before = jnp.cumsum(pairs, axis=0) - pairs  # my pairs to d before token t
    total = jnp.sum(pairs, axis=0)
    # the pairs of my last row to each rank (0 where none)
    last_t = (t - 1) - jnp.argmax(goes[::-1], axis=0) if t else jnp.zeros((r,), jnp.int32)
    last = jnp.where(jnp.any(goes, axis=0), pairs[last_t, ranks] if t else 0, 0)
    mine = jnp.stack([total, last, jnp.sum(goes, axis=0, dtype=jnp.int32)])  # [3, R]
    every = jax.lax.all_gather(mine, axis_name)  # [R src, 3, R dst]
    me = jax.lax.axis_index(axis_name)
    per_src = every[:, 0, :]
    start_of_src = jnp.cumsum(per_src, axis=0) - per_src  # [R src, R dst]
    start = start_of_src[me][None, :] + before  # [T, R]: where each row starts at d
    row_round = jnp.where(goes, start // window, -1)
    slot_round = jnp.where(
        owner >= 0, jnp.take_along_axis(row_round, jnp.maximum(owner, 0), axis=1), -1
    )
    dest_slot = jnp.where(goes, jnp.cumsum(goes, axis=1, dtype=jnp.int32) - goes, -1)
    # rounds: the last row of d starts at (all pairs to d) - (its pairs); it is the last row of
    # the last source that sends d any
    to_d = jnp.sum(per_src, axis=0)
    last_src = (r - 1) - jnp.argmax((per_src > 0)[::-1], axis=0)
    last_start = to_d - every[last_src, 1, ranks]
    rounds = jnp.max(jnp.where(to_d > 0, last_start // window + 1, 0))
    stats = {
        "rounds": rounds.astype(jnp.int32),
        "peak_recv_rows": jnp.max(jnp.sum(every[:, 2, :], axis=0)).astype(jnp.int32),
        "peak_expert_rows": jnp.max(to_d).astype(jnp.int32),
    }
    return slot_round.astype(jnp.int32), dest_slot.astype(jnp.int32), stats


def _slot_src(send_row, dest_slot, rows, kk):
    """The pull's index [T*kk]: slot (t, j) takes row send_row[t, d] of rank d's round output
    (d*rows + row), -1 where the token has no row there this round."""
    t, r = send_row.shape
    sent = send_row >= 0
    at = jnp.arange(t, dtype=jnp.int32)[:, None] * kk + dest_slot
    # rows not sent this round: distinct indices past the end, dropped by the scatter
    spare = t * kk + jnp.arange(t * r, dtype=jnp.int32).reshape(t, r)
    at = jnp.where(sent, at, spare)
    val = jnp.where(sent, jnp.arange(r, dtype=jnp.int32)[None, :] * rows + send_row, -1)
    return (
        jnp.full((t * kk,), -1, jnp.int32)
        .at[at.reshape(-1)]
        .set(val.reshape(-1), mode="drop", unique_indices=True)
    )


def _slot_sum(slots, t, kk):
    """[T*kk, H] -> f32 [T, H]: the slots summed in slot order (= rank order) in f32, as combine
    sums a token's rows (a slot without a row holds zeros)."""
    s = slots.reshape(t, kk, -1)
    acc = jnp.zeros((t, s.shape[-1]), jnp.float32)
    for j in range(kk):
        acc = acc + s[:, j].astype(jnp.float32)
    return acc


def _is_float0(a) -> bool:
    """A symbolic zero cotangent (an integer leaf's, e.g. fp8.Fp8Weight's bit patterns)."""
    return getattr(a, "dtype", None) == jax.dtypes.float0


def _tree_add(a, b):
    return jax.tree.map(lambda x, y: x if _is_float0(x) else jnp.add(x, y), a, b)


class _Static:
    """What the rounds need that is not an array (hashable: a custom_vjp nondiff argument)."""

    def __init__(self, experts, cfg, axis_name, rows, recv_rows, kk, max_rows, fp8, one_round):
        self.experts, self.cfg, self.axis_name = experts, cfg, axis_name
        self.rows, self.recv_rows, self.kk, self.max_rows = rows, recv_rows, kk, max_rows
        self.fp8 = fp8  # None: rows travel in x's dtype; a bool: e4m3, power-of-two scales or not
        # every routing fits one round: C holds all T*R*min(k, E/R) pairs a rank can receive
        self.one_round = one_round

    def key(self):
        return (
            self.experts,
            self.cfg,
            self.axis_name,
            self.rows,
            self.recv_rows,
            self.kk,
            self.fp8,
            self.one_round,
        )

    def __hash__(self):
        return hash(self.key())

    def __eq__(self, other):
        return isinstance(other, _Static) and self.key() == other.key()


def _wire(st, x):
    """The rows as they travel, made once for every round: x, or with FP8 its e4m3 rows and their
    1x128 scales packed (dispatch(..., fp8=)'s format; the blocks are per row, so a row's bytes do
    not depend on the rows that share its round)."""
    return x if st.fp8 is None else _pack_fp8(x, st.fp8)


def _dispatch_round(st, wire, like, idx, w, slot_round, rnd, where):
    """Round rnd's dispatch of the rows `wire` (_wire): the token slots of this round alone,
    received in like's dtype (like: x[:0])."""
    _, r, e = st.cfg
    idx_r = jnp.where(slot_round == rnd, idx, -1)
    rx, ri, rw, nr, cn, sr, rs = _dispatch_call(wire, idx_r, w, where, st.cfg, st.recv_rows)
    if st.fp8 is not None:
        rx = _unpack_fp8(rx, like.shape[1], like.dtype)
    handle = Handle(sr, rs, st.cfg[0], st.axis_name, r, e)
    return Dispatched(rx, ri, rw, nr[0], cn, handle)


def _experts_of(st, recv):
    def f(rx, rw, params):
        return st.experts(recv._replace(x=rx, topk_weights=rw), params, st.max_rows)

    return f


def _pull(st, rows_out, src, where):
    """Rows of every rank's round output into this rank's token slots [T*kk, H]."""
    return _redispatch_call(rows_out, src, where, st.cfg)


def _merge(src, new, old):
    return jnp.where((src >= 0)[:, None], new, old)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bounded(st, x, w, params, idx, slot_round, dest_slot, rounds, where):
    return _bounded_fwd(st, x, w, params, idx, slot_round, dest_slot, rounds, where, False)[0]


def _overflowing(st, rounds, slow, fast, *args):
    """slow(*args) when the step runs more than one round, else fast(*args). The branch is chosen on
    the host (XLA:GPU reads the predicate back: one sync), so a buffer that holds every routing
    (st.one_round) skips it."""
    if st.one_round:
        return fast(*args)
    return jax.lax.cond(rounds > 1, slow, fast, *args)


def _bounded_fwd(st, x, w, params, idx, slot_round, dest_slot, rounds, where, keep=True):
    """Round 0; keep: also its VJP (the residuals the backward keeps). One round: combine its
    rows (the unbounded path's sum); more: the slots and the rounds past the first."""
    like = x[:0]
    wire = _wire(st, x)
    recv = _dispatch_round(st, wire, like, idx, w, slot_round, 0, where)
    f = _experts_of(st, recv)
    if keep:
        y, vjp0 = jax.vjp(f, recv.x, recv.topk_weights, params)
    else:
        y, vjp0 = f(recv.x, recv.topk_weights, params), None
    send_row = recv.handle.send_row

    def one(y):
        return _combine_call(y, None, send_row, where, st.cfg)[0]

    def more(y):
        src = _slot_src(send_row, dest_slot, st.recv_rows, st.kk)
        slots = _pull(st, y, src, where)

        def round_(carry):
            rnd, slots = carry
            r_recv = _dispatch_round(st, wire, like, idx, w, slot_round, rnd, where)
            r_y = _experts_of(st, r_recv)(r_recv.x, r_recv.topk_weights, params)
            r_src = _slot_src(r_recv.handle.send_row, dest_slot, st.recv_rows, st.kk)
            return rnd + 1, _merge(r_src, _pull(st, r_y, r_src, where), slots)

        _, slots = jax.lax.while_loop(lambda c: c[0] < rounds, round_, (jnp.int32(1), slots))
        return _slot_sum(slots, x.shape[0], st.kk).astype(y.dtype)

    out = _overflowing(st, rounds, more, one, y)
    # the backward's later rounds dispatch the wire rows again (with FP8 about half x's bytes)
    res = (vjp0, recv.topk_idx, recv.handle.recv_src, send_row, wire, like, w, params, idx)
    return out, res + (slot_round, dest_slot, rounds, where)


def _round_grads(st, vjp, recv_idx, recv_src, dout, where):
    """One round's backward up to the received rows: (d rows, d weights f32, d params)."""
    dy = _redispatch_call(dout, recv_src, where, st.cfg)  # combine's transpose
    drx, drw, dp = vjp(dy)
    drw = jnp.where(recv_idx >= 0, drw.astype(jnp.float32), 0.0)  # weights reach their owner only
    return drx, drw, dp


def _bounded_bwd(st, res, dout):
    vjp0, ri0, rs0, send_row0, wire, like, w, params, idx = res[:9]
    slot_round, dest_slot, rounds, where = res[9:]
    drx, drw, dparams = _round_grads(st, vjp0, ri0, rs0, dout, where)

    def one(drx, drw, dparams):  # dispatch's transpose: the unbounded path's sums
        dx, dw = _combine_call(drx, drw, send_row0, where, st.cfg)
        return dx, dw, dparams

    def more(drx, drw, dparams):
        src = _slot_src(send_row0, dest_slot, st.recv_rows, st.kk)
        carry = (jnp.int32(1), _pull(st, drx, src, where), _pull(st, drw, src, where), dparams)

        def round_(carry):
            rnd, dx_slots, dw_slots, dparams = carry
            recv = _dispatch_round(st, wire, like, idx, w, slot_round, rnd, where)
            _, vjp = jax.vjp(_experts_of(st, recv), recv.x, recv.topk_weights, params)
            g_dx, g_dw, g_p = _round_grads(
                st, vjp, recv.topk_idx, recv.handle.recv_src, dout, where
            )
            src = _slot_src(recv.handle.send_row, dest_slot, st.recv_rows, st.kk)
            return (
                rnd + 1,
                _merge(src, _pull(st, g_dx, src, where), dx_slots),
                _merge(src, _pull(st, g_dw, src, where), dw_slots),
                _tree_add(dparams, g_p),
            )

        _, dx_slots, dw_slots, dparams = jax.lax.while_loop(lambda c: c[0] < rounds, round_, carry)
        t = wire.shape[0]
        dx = _slot_sum(dx_slots, t, st.kk).astype(drx.dtype)
        return dx, _slot_sum(dw_slots, t, st.kk), dparams

    dx, dw, dparams = _overflowing(st, rounds, more, one, drx, drw, dparams)
    dparams = jax.tree.map(lambda d, p: d if _is_float0(d) else match_vma(d, p), dparams, params)
    return match_vma(dx, like), match_vma(dw, w), dparams, None, None, None, None, None


_bounded.defvjp(functools.partial(_bounded_fwd, keep=True), _bounded_bwd)


def bounded_moe(
    x,
    topk_idx,
    topk_weights,
    experts,
    params,
    *,
    num_experts: int,
    axis_name,
    rows: int,
    fp8=None,
):
    """The MoE sum over expert parallelism with buffers of at most `rows` pairs per rank and round.

    x [T, H], topk_idx int32 [T, k], topk_weights float32 [T, k] as for dispatch; params: a pytree
    of arrays (this rank's expert weights); experts(recv, params, max_rows) -> y [N, H']: one output
    row per received row of ``recv`` (a Dispatched of N rows), e.g. fan_out(recv, max_rows=max_rows)
    -> gmm ... -> fan_in; it must be jax-traceable (it runs in a lax.while_loop) and compute each
    row's output from that row alone. rows: C, the expert block's rows (received (row, slot)
    pairs) per round, >= min(k, E/R) (bounded_rows(T, k, F) gives F times the balanced mean).
    fp8: as dispatch's (None, True or a sluice.fp8.Recipe): every round's rows travel as e4m3 with
    their 1x128 scales and reach experts dequantized to x's dtype; the gradient in x passes the
    quantization straight through.

    Returns (out [T, H'] in y's dtype, stats): out equals combine(experts(dispatch(...))) of the
    unbounded path (dispatch with the same fp8) bit for bit, and so do the gradients in x and topk_weights; the params' gradient
    is summed over rounds. stats: int32 scalars, the same on every rank of the axis: "rounds" (1
    unless a rank's pairs overflow C; 0 when nothing is routed), "peak_recv_rows" and
    "peak_expert_rows" (the most rows / pairs one rank received in all rounds together)."""
    x, topk_idx, topk_weights = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_weights)
    if x.ndim != 2 or topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"sluice.ep.bounded_moe: x [T, H] and topk_idx [T, k] expected, got {x.shape} and "
            f"{topk_idx.shape}"
        )
    if topk_idx.dtype != jnp.int32 or topk_weights.dtype != jnp.float32:
        raise TypeError("sluice.ep.bounded_moe: topk_idx must be int32 and topk_weights float32")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError("sluice.ep.bounded_moe: topk_weights must have topk_idx's shape")
    comm = _comm_for("bounded_moe", axis_name)
    r, e = comm.num_ranks, int(num_experts)
    if e < 1 or e % r:
        raise ValueError(
            f"sluice.ep.bounded_moe: num_experts={e} is not a positive multiple of the {r} ranks"
        )
    t, k = topk_idx.shape
    per_row = min(k, e // r)  # the most pairs one received row carries
    if not isinstance(rows, (int, np.integer)) or rows < per_row:
        raise ValueError(
            f"sluice.ep.bounded_moe: rows must be an int >= min(k, E/R) = {per_row}, got {rows!r}"
        )
    window = int(rows) - per_row + 1  # row starts per round: a round's pairs stay <= rows
    recv_rows = min(window, t * r)
    max_rows = min(int(rows), recv_rows * per_row)
    cfg = (comm.comm_id, r, e)
    from ..gmm_fp8 import as_recipe

    recipe = as_recipe(fp8, "sluice.ep.bounded_moe")
    p2 = None if recipe is None else recipe.power_of_two_scales
    one_round = int(rows) >= t * r * per_row
    st = _Static(experts, cfg, axis_name, int(rows), recv_rows, min(k, r), max_rows, p2, one_round)
    slot_round, dest_slot, stats = _layout(topk_idx, r, e // r, window, axis_name)
    where = _where(comm)
    out = _bounded(
        st, x, topk_weights, params, topk_idx, slot_round, dest_slot, stats["rounds"], where
    )
    return out, stats

"""Expert parallelism: token dispatch and combine (DeepEP's approach) as differentiable JAX ops.

Run inside `jax.shard_map` over an expert-parallel mesh axis of size R; E experts, L = E/R per rank
(rank d owns experts [d*L, (d+1)*L)); every rank holds T tokens with k expert slots each.

    sluice.ep.setup(mesh, axis_name="ep")            # once per process, before jit

    def moe(x, topk_idx, topk_weights, w_local):     # per shard, inside shard_map
        recv = sluice.ep.dispatch(x, topk_idx, topk_weights, num_experts=E, axis_name="ep")
        xs, group_sizes, fan = sluice.ep.fan_out(recv)       # expert-sorted rows for gmm
        ys = sluice.gmm(xs, w_local, group_sizes)            # [M, H'] (w_local [L, H, H'])
        y = sluice.ep.fan_in(ys, fan)                        # [T*R, H'], weighted sum per row
        return sluice.ep.combine(y, recv.handle)             # [T, H'] back at the source tokens

    = for each token t: sum_j topk_weights[t, j] * expert_{topk_idx[t, j]}(x[t]), differentiable in
    x, topk_weights and the expert weights (gradients flow back through the same ops).

API
  setup(mesh, axis_name, *, timeout_s=60.0, num_sms=64, transport="auto", buffer_bytes=256 MiB)
      Creates the communicator for `axis_name` of `mesh` (the other mesh axes give independent groups).
      Call it once per process before tracing; calling again for the same mesh and axis replaces it
      (wait for the computations that use the old one first: theirs fail once it is gone).
      With several processes every process calls it, for the same mesh, in the same order (it exchanges
      handles through jax.distributed's key-value store: call jax.distributed.initialize first).
      Transports (`transport`):
        CPU devices of one process: a rendezvous in shared memory between the devices' threads ("auto").
        "nvlink": GPUs of one process, peer memory over NVLink; rows go straight between the ranks'
          buffers (the default for a mesh inside one process).
        "ipc": GPUs of one host, in one or several processes: every rank's flags and a staging area
          of `buffer_bytes` are shared through CUDA IPC; rows are pushed over NVLink into the peer's
          staging area and copied out locally (the default when the mesh spans processes of one host).
        "nccl": any GPUs, several hosts too: our own NCCL communicator (its id shared through the
          key-value store), fixed worst-case blocks of T rows per peer (no host sync), staging of
          `buffer_bytes` (the default when the mesh spans hosts).
      The GPU exchange kernels use `num_sms` blocks (at most 8 ranks per group). Under XLA nothing
      runs beside them (one stream), so the default takes many: on 4 H100s 64 against 20 made the
      dsv3-proxy-ep4 step 2.9% faster.
      Every wait is bounded by `timeout_s` and ends in an error naming the rank and what it waited
      for (on a GPU the error surfaces at the next sluice.ep call, or at once with SLUICE_DEBUG=1;
      NCCL: a watchdog aborts the communicator); the communicator is then broken until setup is
      called again. An op whose shapes need more staging than `buffer_bytes` fails naming the size
      it needs (ipc: about N*(H*itemsize + 8k + 4) bytes, N = T*R; nccl: combine about
      2*N*(H*itemsize + 4k)).
      GPU note: the exchange kernels of the ranks wait for each other, so pass inputs that already live
      on the mesh (sharded); a jit that first has to copy an input shard between GPUs can queue that
      copy behind a peer's waiting kernel and stall until the timeout.
  communicator(mesh, axis_name="ep") -> Communicator | None
      The communicator setup made for this mesh and axis (its transport, ranks, groups, num_sms), or
      None where there is none: what a layer checks before it calls setup itself.
  teardown(axis_name=None)
      Frees the communicators (of one axis, or all). Programs traced against them then fail clearly.
      Across processes every process calls it (it waits for its devices, unmaps the peers, then meets
      the other processes at a barrier before freeing its buffers).

  dispatch(x, topk_idx, topk_weights, *, num_experts, axis_name) -> Dispatched
      x [T, H] float32/bfloat16/float16; topk_idx int32 [T, k] (-1: slot unused); topk_weights float32
      [T, k]. A token goes ONCE to each rank that owns at least one of its experts. Returns, per rank,
      static worst-case shapes (N = T*R rows):
        .x            [N, H]   received rows, ordered by (source rank, source token); zero past num_rows
        .topk_idx     int32 [N, k]  local expert id (0..L-1) where the slot's expert is on this rank,
                      else -1 (all -1 past num_rows)
        .topk_weights float32 [N, k] the slot's weight where local, else 0
        .num_rows     int32 []  valid rows
        .counts       int32 [L] (row, slot) pairs per local expert (= fan_out's group_sizes)
        .handle       Handle: the layout combine needs (a pytree of int32 arrays)
      Differentiable in x and topk_weights: the backward is a combine of the cotangents.
  combine(y, handle) -> [T, H']
      y [N, H'] (one row per received row, any float dtype). Each row goes back to its source token;
      a token's rows are summed over ranks in fixed rank order in float32 and rounded once to y.dtype:
      bitwise deterministic. Tokens sent nowhere get zeros. Backward: a dispatch reusing the handle.
  bounded_moe(x, topk_idx, topk_weights, experts, params, *, num_experts, axis_name, rows,
              fp8=None) -> (out [T, H'], stats)
      The MoE sum dispatch -> experts -> combine with every rank's receive buffer and expert block
      bounded to `rows` (row, slot) pairs a round (bounded_rows(T, k, F): F times the balanced
      mean T*k). A routing that sends a rank more runs further rounds in the same program (a
      lax.cond and a lax.while_loop on the count computed on the device, the same on every rank;
      one round, the common case, is combined as the unbounded path is): nothing is dropped, and
      out and the gradients in x and topk_weights equal the unbounded path's bit for bit.
      experts(recv, params, max_rows) -> [N, H'] is the per-rank part (fan_out -> gmm ->
      fan_in). stats: "rounds", "peak_recv_rows", "peak_expert_rows". fp8: as dispatch's, every
      round's rows in FP8 (the values those of dispatch with the same fp8). See bounded.py.
  dispatch(..., fp8=True or sluice.fp8.Recipe) sends the rows as e4m3 with their 1x128 scales (about
      half the bytes of bf16) and hands them over dequantized; the backward stays BF16.
  dispatch(..., recv_rows=N) bounds the receive buffer to N rows (a rank may receive no more).
  fan_out(recv, *, max_rows=None, zero_unused_rows=True) -> (xs [M, H], group_sizes int32 [L], fan)
      Local: each (row, slot) with a local expert becomes one row of xs, grouped by local expert (a row
      going to 2 local experts appears twice), within a group in (row, slot) order; M = N*min(k, L),
      the worst case (it grows with the rank count), or max_rows where smaller: the pairs that would
      land past it are left out (fan.pos -1, not in group_sizes; their count is
      sum(recv.topk_idx >= 0) - sum(group_sizes)). Rows past sum(group_sizes) are zero
      (zero_unused_rows=False: on CUDA left unwritten, here and in fan_in's gradient in ys). A
      counting sort in C/CUDA (no argsort). Feed xs and group_sizes to sluice.gmm with rhs [L, ...].
      Differentiable in recv.x.
  fan_out_tokens(x, topk_idx, topk_weights, *, num_experts) -> (xs, group_sizes, fan)
      fan_out for tokens that stay on their device (all E experts local, no dispatch): the one-device
      MoE path.
  fan_out(..., copy_rows=False), fan_out_tokens(..., copy_rows=False) -> (None, group_sizes, fan)
      The layout alone, for the FP8 ends below, which read the rows where they are.
  fanned_gmm(x, fan, rhs, *, fp8=True, out_dtype=None, skip_unused_rows=False) -> [M, N']
      sluice.gmm(fan_out's xs, rhs, group_sizes, fp8=...) from x [N, K] itself: the FP8 quantization
      picks the rows (xs is never written). Differentiable in x and rhs (the gradient in x sums the
      copies, as fan_out's does).
  gmm_fan_in(lhs, rhs, fan, *, fp8=True, out_dtype=None, skip_unused_rows=False) -> [N, N']
      fan_in(sluice.gmm(lhs, rhs, group_sizes, fp8=...), fan, weighted=False): the backward's FP8
      quantization picks d out's rows for the expert rows (d ys is never written).
  fanned_swiglu_mlp(x, fan, wi, wo, *, row_weights=None, fp8=True, ...) -> [N, N']
      The SwiGLU expert MLP between them, its activation and the activation's gradient quantized
      as the SwiGLU and its backward compute them (never written in 16 bits). All three give the
      compositions' values and gradients bit for bit (fan_fp8.py; the row weights' up to float32
      rounding on a GPU).
  fan_in(ys, fan, *, out_dtype=None, weighted=True) -> [N, H']
      Local: out[i] = sum over slots j (in slot order, float32) of weight[i, j] * ys[row of (i, j)];
      rows with no local slot are zero. Differentiable in ys and in the weights (recv.topk_weights,
      carried by fan), so router gradients reach topk_weights through dispatch. weighted=False sums
      the rows unweighted, for experts that applied the weights themselves
      (sluice.swiglu(..., row_weights=...), as the MoE layer does): its backward keeps no ys.

Bad input: wrong dtypes or shapes, a mesh axis that does not divide num_experts, an op called without
setup (or on a mesh it was not set up for) raise at trace time. Data-dependent values: on CPU an expert
id outside [-1, E) or an expert listed twice for one token is an error at run time on every rank (the
message names the rank, token and slot); on GPU such a slot is treated as -1 (SLUICE_DEBUG=1 makes it
an error). Ops are deterministic: the same inputs give the same bits.

Under vmap every op runs once per batch element, one after the other (the batch is a loop, not one
bigger exchange), with the same results as a loop over the elements; gradients too. Every rank must
run the same ops (SPMD programs do).
"""

from .bounded import bounded_moe, bounded_rows
from .comm import Communicator, communicator, setup, teardown
from .exchange import Dispatched, Handle, combine, dispatch
from .fan import Fan, fan_in, fan_out, fan_out_tokens
from .fan_fp8 import fanned_gmm, fanned_swiglu_mlp, gmm_fan_in
from .reference import (
    combine_reference,
    dispatch_reference,
    fan_in_reference,
    fan_out_reference,
    moe_reference,
)

__all__ = [
    "Communicator",
    "Dispatched",
    "Fan",
    "Handle",
    "bounded_moe",
    "bounded_rows",
    "combine",
    "combine_reference",
    "communicator",
    "dispatch",
    "dispatch_reference",
    "fan_in",
    "fan_in_reference",
    "fan_out",
    "fan_out_reference",
    "fan_out_tokens",
    "fanned_gmm",
    "fanned_swiglu_mlp",
    "gmm_fan_in",
    "moe_reference",
    "setup",
    "teardown",
]

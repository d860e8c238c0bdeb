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
  setup(mesh, axis_name, *, timeout_s=60.0, num_sms=64, transport="auto", buffer_bytes=256 MiB,
        stream=None)
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
      dsv3-proxy-ep4 step 2.9% faster (dispatch 0.86x, redispatch 0.74x the time at its shapes).
      `stream=N` (GPU, 1..8) runs every exchange op of this communicator on XLA's compute stream N
      (jax's compute_on("gpu_stream:N")): XLA wraps each in an async call-start/call-done pair and
      may run independent work (the weight gradients, a shared expert) beside it. All exchange ops
      of a communicator share the stream, so they keep the program's order on every rank. Leave
      SMs to the rest then (num_sms below 64; SLUICE_GMM_SMS caps gmm's persistent grid). The CPU
      backend ignores the stream (same results, one stream). Measured on 4 H100s (dsv3-proxy-ep4,
      bench/results/ep-stream-overlap-h100x4-20261126/): XLA does overlap the exchange, most with
      the model's --interleave 2, but the exchange kernels then share the SMs and slow by about
      what they hide (net -0.6% to -1.6%; fewer blocks: -4% at 16, -13% at 8), so it is off by
      default.
      Every wait is bounded by `timeout_s` and ends in an error naming the rank and what it waited
      for (on a GPU the error surfaces at the next sluice.ep call, or at once with SLUICE_DEBUG=1;
      NCCL: a watchdog aborts the communicator); the communicator is then broken until setup is
      called again. An op whose shapes need more staging than `buffer_bytes` fails naming the size
      it needs (ipc: about N*(H*itemsize + 8k + 4) bytes, N = T*R; nccl: combine about
      2*N*(H*itemsize + 4k)).
      GPU note: the exchange kernels of the ranks wait for each other, so pass inputs that already live
      on the mesh (sharded); a jit that first has to copy an input shard between GPUs can queue that
      copy behind a peer's waiting kernel and stall until the timeout.
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

Under vmap each exchange op runs once per batch element (sequentially). Every rank must run the same ops
(SPMD programs do).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _lib
from ._vma import _vary_kw, _varying, match_vma

__all__ = [
    "Dispatched",
    "Fan",
    "Handle",
    "combine",
    "combine_reference",
    "dispatch",
    "dispatch_reference",
    "fan_in",
    "fan_in_reference",
    "fan_out",
    "fan_out_reference",
    "moe_reference",
    "setup",
    "teardown",
]

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_lib.register_targets(
    {
        "sluice_ep_dispatch": "sl_ffi_ep_dispatch",
        "sluice_ep_combine": "sl_ffi_ep_combine",
        "sluice_ep_redispatch": "sl_ffi_ep_redispatch",
        "sluice_ep_fan_out": "sl_ffi_ep_fan_out",
        "sluice_ep_fan_in": "sl_ffi_ep_fan_in",
        "sluice_ep_fan_in_bwd": "sl_ffi_ep_fan_in_bwd",
    }
)


class _CommDesc(ctypes.Structure):
    """Mirror of sl_ep_comm_desc in include/sluice.h."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_groups", ctypes.c_int),
        ("num_ranks", ctypes.c_int),
        ("timeout_s", ctypes.c_double),
        ("use_cuda", ctypes.c_int),
        ("device_ordinals", ctypes.POINTER(ctypes.c_int)),
        ("num_sms", ctypes.c_int),
        ("transport", ctypes.c_int),
        ("buffer_bytes", ctypes.c_size_t),
    ]


class _EpDesc(ctypes.Structure):
    """Mirror of sl_ep_desc in include/sluice.h (for the C API's tests and benchmarks)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("num_ranks", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("tag", ctypes.c_int64),
    ]


_TRANSPORTS = {"nvlink": 0, "ipc": 1, "nccl": 2}
_BLOB_BYTES = 256
_lib.lib.sl_ep_comm_create.argtypes = [ctypes.POINTER(_CommDesc), ctypes.POINTER(ctypes.c_int64)]
_lib.lib.sl_ep_comm_create.restype = ctypes.c_int
_lib.lib.sl_ep_comm_destroy.argtypes = [ctypes.c_int64]
_lib.lib.sl_ep_comm_destroy.restype = ctypes.c_int
_lib.lib.sl_ep_comm_export.argtypes = [
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_size_t),
]
_lib.lib.sl_ep_comm_needs.argtypes = [
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_int),
]
_lib.lib.sl_ep_comm_import.argtypes = [
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_size_t,
]
_lib.lib.sl_ep_comm_connect.argtypes = [ctypes.c_int64]
_lib.lib.sl_ep_comm_disconnect.argtypes = [ctypes.c_int64]
for _f in ("export", "needs", "import", "connect", "disconnect"):
    getattr(_lib.lib, f"sl_ep_comm_{_f}").restype = ctypes.c_int


class _FanDesc(ctypes.Structure):
    """Mirror of sl_ep_fan_desc in include/sluice.h."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_rows", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("num_local_experts", ctypes.c_int64),
        ("x_dtype", ctypes.c_int),
        ("out_dtype", ctypes.c_int),
        ("max_rows", ctypes.c_int64),
        ("skip_unused_rows", ctypes.c_int),
    ]


_lib.lib.sl_ep_fan_workspace_size.argtypes = [ctypes.POINTER(_FanDesc)]
_lib.lib.sl_ep_fan_workspace_size.restype = ctypes.c_size_t


def _fan_workspace_bytes(n, h, k, l):
    d = _FanDesc(ctypes.sizeof(_FanDesc), n, h, k, l, 0, 0)
    return max(int(_lib.lib.sl_ep_fan_workspace_size(ctypes.byref(d))), 16)


@dataclasses.dataclass(frozen=True)
class _Comm:
    comm_id: int
    axis_name: str
    axis_names: tuple  # the mesh's axes, in order
    axis_sizes: tuple
    device_ids: tuple
    num_ranks: int
    num_groups: int
    platform: str
    transport: str = "shm"
    multi_process: bool = False
    key: str = ""  # the key-value store prefix of its setup (multi-process)
    timeout_s: float = 60.0
    stream: int | None = None  # XLA's compute stream the exchange ops run on (None: the main one)


_COMMS: dict[str, list[_Comm]] = {}
_SETUPS = itertools.count()


def _check(st, what):
    if st != 0:
        raise RuntimeError(
            f"sluice.ep.{what}: {_lib.lib.sl_last_error().decode()} "
            f"({_lib.lib.sl_status_string(st).decode()})"
        )


def _kv_client(what):
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"sluice.ep.{what}: the mesh spans several processes, but jax.distributed is not "
            "initialized (call jax.distributed.initialize first)"
        )
    return client


def _kv_set(client, key, blob: bytes):
    if hasattr(client, "key_value_set_bytes"):
        client.key_value_set_bytes(key, blob)
    else:
        client.key_value_set(key, blob.hex())


def _kv_get(client, key, timeout_s, what):
    ms = max(int(timeout_s * 1000), 1)
    try:
        if hasattr(client, "blocking_key_value_get_bytes"):
            return bytes(client.blocking_key_value_get_bytes(key, ms))
        return bytes.fromhex(client.blocking_key_value_get(key, ms))
    except Exception as e:  # noqa: BLE001 - the client raises its own types (deadline exceeded)
        raise RuntimeError(
            f"sluice.ep.setup: waited {timeout_s:g} s for {what} (key {key!r}) and it never came: "
            "did every process call sluice.ep.setup for the same mesh, in the same order? "
            f"({type(e).__name__}: {e})"
        ) from None


def _barrier(client, name, timeout_s, what):
    try:
        client.wait_at_barrier(name, max(int(timeout_s * 1000), 1))
    except Exception as e:  # noqa: BLE001 - the client raises its own types
        raise RuntimeError(
            f"sluice.ep.{what}: waited {timeout_s:g} s at barrier {name!r} for the other processes "
            f"({type(e).__name__}: {e})"
        ) from None


def _destroy(c: _Comm) -> None:
    """Frees a communicator; across processes: unmap/abort, a barrier, then free (so no peer still
    touches our buffers when they go)."""
    if c.multi_process:
        _lib.lib.sl_ep_comm_disconnect(c.comm_id)
        _barrier(_kv_client("teardown"), c.key + "/teardown", c.timeout_s, "teardown")
    _lib.lib.sl_ep_comm_destroy(c.comm_id)


def _connect(cid, devs, key, timeout_s):
    """The blob exchange of a communicator over processes (or of NCCL in one process)."""
    g, r = devs.shape
    me = jax.process_index()
    client = _kv_client("setup") if any(d.process_index != me for d in devs.flat) else None
    buf = ctypes.create_string_buffer(_BLOB_BYTES)
    local_blobs = {}
    for gi in range(g):
        for ri in range(r):
            if devs[gi, ri].process_index != me:
                continue
            n = ctypes.c_size_t(0)
            _check(_lib.lib.sl_ep_comm_export(cid, gi, ri, buf, ctypes.byref(n)), "setup")
            if n.value:
                local_blobs[(gi, ri)] = buf.raw[: n.value]
                if client is not None:
                    _kv_set(client, f"{key}/blob/{gi}/{ri}", local_blobs[(gi, ri)])
    for gi in range(g):
        for ri in range(r):
            need = ctypes.c_int(0)
            _check(_lib.lib.sl_ep_comm_needs(cid, gi, ri, ctypes.byref(need)), "setup")
            if not need.value:
                continue
            blob = _kv_get(
                client,
                f"{key}/blob/{gi}/{ri}",
                timeout_s,
                f"the handle of (group {gi}, rank {ri}) from process {devs[gi, ri].process_index}",
            )
            _check(_lib.lib.sl_ep_comm_import(cid, gi, ri, blob, len(blob)), "setup")
    _check(_lib.lib.sl_ep_comm_connect(cid), "setup")


def _mesh_signature(mesh):
    return tuple(mesh.axis_names), tuple(int(mesh.shape[a]) for a in mesh.axis_names)


def setup(
    mesh,
    axis_name="ep",
    *,
    timeout_s: float = 60.0,
    num_sms: int = 64,
    transport: str = "auto",
    buffer_bytes: int = 256 << 20,
    stream: int | None = None,
) -> None:
    """Prepares the communicator of `axis_name` over `mesh` (see the module docstring). Call before jit."""
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"sluice.ep.setup: mesh has axes {tuple(mesh.axis_names)}, not {axis_name!r}"
        )
    if not timeout_s > 0:
        raise ValueError(f"sluice.ep.setup: timeout_s must be > 0, got {timeout_s}")
    names, sizes = _mesh_signature(mesh)
    r = int(mesh.shape[axis_name])
    a = names.index(axis_name)
    devs = np.moveaxis(np.asarray(mesh.devices), a, -1).reshape(-1, r)  # [group, rank]
    g = devs.shape[0]
    platform = devs.flat[0].platform
    if any(d.platform != platform for d in devs.flat):
        raise ValueError("sluice.ep.setup: the mesh mixes platforms")
    if transport not in ("auto", *_TRANSPORTS):
        raise ValueError(
            f"sluice.ep.setup: transport must be 'auto', 'nvlink', 'ipc' or 'nccl', got {transport!r}"
        )
    if not isinstance(num_sms, (int, np.integer)) or not 1 <= num_sms <= 64:
        raise ValueError(f"sluice.ep.setup: num_sms must be an int in [1, 64], got {num_sms!r}")
    if not isinstance(buffer_bytes, (int, np.integer)) or buffer_bytes < 1:
        raise ValueError(
            f"sluice.ep.setup: buffer_bytes must be a positive int (bytes of staging per rank), "
            f"got {buffer_bytes!r}"
        )
    if stream is not None and not (isinstance(stream, (int, np.integer)) and 1 <= stream <= 8):
        raise ValueError(
            f"sluice.ep.setup: stream must be None or an int in [1, 8] (an XLA GPU compute "
            f"stream), got {stream!r}"
        )
    me = jax.process_index()
    multi = any(d.process_index != me for d in devs.flat)
    use_cuda = platform in ("gpu", "cuda")
    if not use_cuda:
        if multi:
            raise NotImplementedError(
                "sluice.ep.setup: a mesh of CPU devices must lie in one process (the CPU transport is "
                "a shared-memory rendezvous); GPU meshes may span processes (transports ipc, nccl)"
            )
        if transport != "auto":
            raise ValueError(
                f"sluice.ep.setup: transport {transport!r} is for GPUs; a CPU mesh uses the "
                "shared-memory rendezvous (transport='auto')"
            )
    if use_cuda and not _lib.has_cuda():
        raise RuntimeError(
            "sluice.ep.setup: the mesh holds GPUs but libsluice was built without CUDA"
        )
    n_setup = next(_SETUPS)
    key = f"sluice_ep/{n_setup}/{axis_name}"
    if use_cuda and transport == "auto":
        transport = "nvlink"
        if multi:
            import socket

            client = _kv_client("setup")
            _kv_set(client, f"{key}/host/{me}", socket.gethostname().encode())
            procs = sorted({int(d.process_index) for d in devs.flat})
            hosts = {
                _kv_get(client, f"{key}/host/{p}", timeout_s, f"the host name of process {p}")
                for p in procs
            }
            transport = "ipc" if len(hosts) == 1 else "nccl"
    elif not use_cuda:
        transport = "shm"
    if transport == "nvlink" and multi:
        raise ValueError(
            "sluice.ep.setup: transport 'nvlink' needs every device of the mesh in this process; "
            "this mesh spans processes (use 'ipc' on one host or 'nccl')"
        )
    ordinals = (ctypes.c_int * devs.size)(
        *[
            int(getattr(d, "local_hardware_id", d.id) or 0) if d.process_index == me else -1
            for d in devs.flat
        ]
    )
    desc = _CommDesc(
        ctypes.sizeof(_CommDesc),
        g,
        r,
        float(timeout_s),
        int(use_cuda),
        ctypes.cast(ordinals, ctypes.POINTER(ctypes.c_int)) if use_cuda else None,
        int(num_sms),
        _TRANSPORTS.get(transport, 0),
        int(buffer_bytes),
    )
    cid = ctypes.c_int64(0)
    _check(_lib.lib.sl_ep_comm_create(ctypes.byref(desc), ctypes.byref(cid)), "setup")
    if multi or transport == "nccl":
        try:
            _connect(cid.value, devs, key, float(timeout_s))
        except Exception:
            _lib.lib.sl_ep_comm_disconnect(cid.value)
            _lib.lib.sl_ep_comm_destroy(cid.value)
            raise
    comm = _Comm(
        int(cid.value),
        axis_name,
        names,
        sizes,
        tuple(int(d.id) for d in devs.flat),
        r,
        g,
        platform,
        transport,
        multi,
        key,
        float(timeout_s),
        None if stream is None else int(stream),
    )
    old = [c for c in _COMMS.get(axis_name, []) if (c.axis_names, c.axis_sizes) == (names, sizes)]
    for c in old:
        _destroy(c)
    _COMMS[axis_name] = [c for c in _COMMS.get(axis_name, []) if c not in old] + [comm]


def teardown(axis_name=None) -> None:
    """Frees the communicators of `axis_name` (all when None)."""
    for name in list(_COMMS) if axis_name is None else [axis_name]:
        for c in _COMMS.pop(name, []):
            _destroy(c)


def _comm_for(op: str, axis_name) -> _Comm:
    """The communicator for the mesh we are tracing under (a trace-time check)."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if axis_name not in names:
        raise ValueError(
            f"sluice.ep.{op}: axis {axis_name!r} is not a mesh axis here (axes: {names}); call it "
            "inside jax.shard_map over a mesh with that axis"
        )
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    cands = _COMMS.get(axis_name, [])
    for c in cands:
        if c.axis_names == names and c.axis_sizes == sizes:
            return c
    if not cands:
        raise RuntimeError(
            f"sluice.ep.{op}: no sluice.ep.setup(mesh, axis_name={axis_name!r}) was made; call it once "
            "before jit"
        )
    raise RuntimeError(
        f"sluice.ep.{op}: sluice.ep.setup was called for axis {axis_name!r} on meshes "
        f"{[dict(zip(c.axis_names, c.axis_sizes)) for c in cands]}, not on this mesh "
        f"{dict(zip(names, sizes))}"
    )


def _where(comm: _Comm):
    """int32 [2] = (group, rank) of this shard: the group is the index over the other mesh axes."""
    rank = jax.lax.axis_index(comm.axis_name)
    group = jnp.int32(0)
    for name, size in zip(comm.axis_names, comm.axis_sizes):
        if name != comm.axis_name:
            group = group * size + jax.lax.axis_index(name)
    return jnp.stack([jnp.asarray(group, jnp.int32), jnp.asarray(rank, jnp.int32)])


_TAGS = itertools.count(1)


def _tag() -> np.int64:
    # A fresh tag per op instance: the n-th run of an instance meets the n-th run on the peers.
    return np.int64(next(_TAGS))


# ---- the pytrees ---------------------------------------------------------------------------------
@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["send_row", "recv_src"],
    meta_fields=["comm_id", "axis_name", "num_ranks", "num_experts"],
)
@dataclasses.dataclass(frozen=True)
class Handle:
    """The layout of one dispatch, for combine (and for dispatch's and combine's backward).

    send_row int32 [T, R]: the row of token t in rank d's received buffer, -1 if not sent there.
    recv_src int32 [N]: s*T + t for a received row from token t of rank s, -1 past num_rows.
    """

    send_row: jax.Array
    recv_src: jax.Array
    comm_id: int
    axis_name: str
    num_ranks: int
    num_experts: int


class Dispatched(NamedTuple):
    """What dispatch returns on each rank (see the module docstring)."""

    x: jax.Array
    topk_idx: jax.Array
    topk_weights: jax.Array
    num_rows: jax.Array
    counts: jax.Array
    handle: Handle


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["pos", "weights", "group_sizes"],
    meta_fields=["num_local_experts", "max_rows", "zero_unused_rows"],
)
@dataclasses.dataclass(frozen=True)
class Fan:
    """fan_out's layout: pos int32 [N, k] (the row of xs of each (row, slot), -1 where not local),
    the router weights [N, k] fan_in applies, and the group sizes [L]."""

    pos: jax.Array
    weights: jax.Array
    group_sizes: jax.Array
    num_local_experts: int
    max_rows: int = 0  # fan_out's bound on M (0: none)
    zero_unused_rows: bool = True  # fan_out's rows past the pairs zeroed (False: on CUDA unwritten)


# ---- raw FFI calls -------------------------------------------------------------------------------
def _sds(shape, dtype, kw=None):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), **(kw or {}))


def _axes_of(where):
    # `where` comes from axis_index: it varies over exactly the mesh axes of the exchange's group.
    return _varying(where)


def _exchange_attrs(cfg):
    comm_id, num_ranks, num_experts, _ = cfg
    return {
        "comm_id": np.int64(comm_id),
        "num_ranks": np.int64(num_ranks),
        "num_experts": np.int64(num_experts),
        "tag": _tag(),
    }


def _exchange(call, cfg, *args):
    """Runs an exchange op's FFI call, on the communicator's XLA stream where setup named one: XLA
    then wraps it in an async call-start/call-done pair and may schedule independent compute (the
    weight gradients, the shared expert) between the two."""
    stream = cfg[3]
    attrs = _exchange_attrs(cfg)
    if stream is None:
        return call(*args, **attrs)
    from jax.experimental import compute_on as co

    # jax 0.10 names the function form compute_on2 (its compute_on is a context manager)
    on = getattr(co, "compute_on2", co.compute_on)
    kw = {"compute_type": f"gpu_stream:{stream}", "out_memory_spaces": jax.memory.Space.Device}
    return on(lambda *a: call(*a, **attrs), **kw)(*args)


def _dispatch_call(x, idx, w, where, cfg):
    t, h = x.shape
    k = idx.shape[1]
    _, r, e, _ = cfg
    n, l = t * r, e // r
    v = _vary_kw(x, idx, w, where, extra=_axes_of(where))
    outs = (
        _sds((n, h), x.dtype, v),
        _sds((n, k), jnp.int32, v),
        _sds((n, k), jnp.float32, v),
        _sds((1,), jnp.int32, v),
        _sds((l,), jnp.int32, v),
        _sds((t, r), jnp.int32, v),
        _sds((n,), jnp.int32, v),
    )
    call = jax.ffi.ffi_call(
        "sluice_ep_dispatch", outs, vmap_method="sequential", has_side_effect=True
    )
    return _exchange(call, cfg, x, idx, w, where)


def _combine_call(y, y_w, send_row, where, cfg):
    t = send_row.shape[0]
    refs = (y, send_row, where) if y_w is None else (y, y_w, send_row, where)
    v = _vary_kw(*refs, extra=_axes_of(where))
    if y_w is None:
        call = jax.ffi.ffi_call(
            "sluice_ep_combine",
            (_sds((t, y.shape[1]), y.dtype, v),),
            vmap_method="sequential",
            has_side_effect=True,
        )
        return _exchange(call, cfg, y, send_row, where)[0], None
    call = jax.ffi.ffi_call(
        "sluice_ep_combine",
        (_sds((t, y.shape[1]), y.dtype, v), _sds((t, y_w.shape[1]), jnp.float32, v)),
        vmap_method="sequential",
        has_side_effect=True,
    )
    out, out_w = _exchange(call, cfg, y, y_w, send_row, where)
    return out, out_w


def _redispatch_call(g, recv_src, where, cfg):
    v = _vary_kw(g, recv_src, where, extra=_axes_of(where))
    call = jax.ffi.ffi_call(
        "sluice_ep_redispatch",
        (_sds((recv_src.shape[0], g.shape[1]), g.dtype, v),),
        vmap_method="sequential",
        has_side_effect=True,
    )
    return _exchange(call, cfg, g, recv_src, where)[0]


def _fan_rows(n, k, l, max_rows=0):
    """M: the rows of fan_out's output, N * min(k, L) or max_rows where that is smaller (> 0)."""
    worst = n * min(k, l)
    return min(worst, max_rows) if max_rows > 0 else worst


def _fan_attrs(l, max_rows, zero_unused_rows):
    return {
        "num_local_experts": np.int64(l),
        "max_rows": np.int64(max_rows),
        "skip_unused_rows": np.int64(not zero_unused_rows),
    }


def _fan_out_call(x, idx, l, max_rows, zero_unused_rows=True):
    n, h = x.shape
    k = idx.shape[1]
    v = _vary_kw(x, idx)
    call = jax.ffi.ffi_call(
        "sluice_ep_fan_out",
        (
            _sds((_fan_rows(n, k, l, max_rows), h), x.dtype, v),
            _sds((l,), jnp.int32, v),
            _sds((n, k), jnp.int32, v),
            _sds((_fan_workspace_bytes(n, h, k, l),), jnp.uint8, v),
        ),
        vmap_method="sequential",
    )
    return call(x, idx, **_fan_attrs(l, max_rows, zero_unused_rows))[:3]


def _fan_in_call(ys, w, pos, l, out_dtype):
    n = pos.shape[0]
    call = jax.ffi.ffi_call(
        "sluice_ep_fan_in",
        (_sds((n, ys.shape[1]), out_dtype, _vary_kw(ys, w, pos)),),
        vmap_method="sequential",
    )
    # ys holds fan_out's M rows: M passes as max_rows (the handler checks it against N, k and L)
    return call(ys, w, pos, **_fan_attrs(l, ys.shape[0], True))[0]


def _fan_in_bwd_call(dout, ys, w, pos, group_sizes, l, zero_unused_rows=True, with_dw=True):
    """(dys, dw); with_dw=False: dys alone, ys not read (weights that need no gradient: ys may then
    be any [M, 0] array of its dtype)."""
    if not with_dw:
        v = _vary_kw(dout, w, pos, group_sizes)
        call = jax.ffi.ffi_call(
            "sluice_ep_fan_in_bwd",
            (_sds((ys.shape[0], dout.shape[1]), ys.dtype, v),),
            vmap_method="sequential",
        )
        attrs = _fan_attrs(l, ys.shape[0], zero_unused_rows)
        return call(dout, w, pos, group_sizes, with_dw=np.int64(0), **attrs)[0]
    v = _vary_kw(dout, ys, w, pos, group_sizes)
    call = jax.ffi.ffi_call(
        "sluice_ep_fan_in_bwd",
        (_sds(ys.shape, ys.dtype, v), _sds(w.shape, jnp.float32, v)),
        vmap_method="sequential",
    )
    return call(
        dout,
        ys,
        w,
        pos,
        group_sizes,
        with_dw=np.int64(1),
        **_fan_attrs(l, ys.shape[0], zero_unused_rows),
    )


# ---- dispatch with its VJP -----------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dispatch(x, idx, w, where, cfg):
    return _dispatch_call(x, idx, w, where, cfg)


def _dispatch_fwd(x, idx, w, where, cfg):
    outs = _dispatch_call(x, idx, w, where, cfg)
    return outs, (outs[1], outs[5], where, x[:0], w[:0])  # [:0]: only the types are kept


def _dispatch_bwd(cfg, res, cts):
    recv_idx, send_row, where, x, w = res
    ct_x, _, ct_w = cts[0], cts[1], cts[2]
    # A weight reaches the one rank owning its expert; elsewhere its slot holds a constant 0.
    ct_w = jnp.where(recv_idx >= 0, ct_w.astype(jnp.float32), 0.0)
    dx, dw = _combine_call(ct_x, ct_w, send_row, where, cfg)
    return match_vma(dx, x), None, match_vma(dw, w), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _check_float(op, name, a):
    if jnp.dtype(a.dtype) not in _FLOATS:
        raise TypeError(
            f"sluice.ep.{op}: {name} must be float32, bfloat16 or float16, got {a.dtype}"
        )


def dispatch(x, topk_idx, topk_weights, *, num_experts: int, axis_name) -> Dispatched:
    """Sends each token once to every rank owning one of its experts. See the module docstring."""
    x, topk_idx, topk_weights = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_weights)
    if x.ndim != 2:
        raise ValueError(f"sluice.ep.dispatch: x must be 2-D [T, H], got shape {x.shape}")
    _check_float("dispatch", "x", x)
    if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.shape[1] < 1:
        raise ValueError(
            f"sluice.ep.dispatch: topk_idx must be [T, k] with T = {x.shape[0]} and "
            f"k >= 1, got shape {topk_idx.shape}"
        )
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"sluice.ep.dispatch: topk_idx must be int32, got {topk_idx.dtype}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"sluice.ep.dispatch: topk_weights must have topk_idx's shape "
            f"{topk_idx.shape}, got {topk_weights.shape}"
        )
    if topk_weights.dtype != jnp.float32:
        raise TypeError(
            f"sluice.ep.dispatch: topk_weights must be float32, got {topk_weights.dtype}"
        )
    comm = _comm_for("dispatch", axis_name)
    num_experts = int(num_experts)
    if num_experts < 1 or num_experts % comm.num_ranks:
        raise ValueError(
            f"sluice.ep.dispatch: num_experts={num_experts} is not a positive multiple of "
            f"the {comm.num_ranks} ranks of axis {axis_name!r}"
        )
    cfg = (comm.comm_id, comm.num_ranks, num_experts, comm.stream)
    rx, ri, rw, nr, cn, sr, rs = _dispatch(x, topk_idx, topk_weights, _where(comm), cfg)
    handle = Handle(sr, rs, comm.comm_id, axis_name, comm.num_ranks, num_experts)
    return Dispatched(rx, ri, rw, nr[0], cn, handle)


# ---- combine with its VJP ------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(y, send_row, recv_src, where, cfg):
    return _combine_call(y, None, send_row, where, cfg)[0]


def _combine_fwd(y, send_row, recv_src, where, cfg):
    return _combine_call(y, None, send_row, where, cfg)[0], (recv_src, where, y[:0])


def _combine_bwd(cfg, res, ct):
    recv_src, where, y = res
    return match_vma(_redispatch_call(ct, recv_src, where, cfg), y), None, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y, handle: Handle):
    """Sends each received row back to its source token and sums a token's rows in rank order (f32)."""
    y = jnp.asarray(y)
    if not isinstance(handle, Handle):
        raise TypeError(
            f"sluice.ep.combine: handle must be dispatch(...).handle, got {type(handle)}"
        )
    n = handle.recv_src.shape[0]
    if y.ndim != 2 or y.shape[0] != n:
        raise ValueError(
            f"sluice.ep.combine: y must be [N, H] with N = {n} (dispatch's rows), "
            f"got shape {y.shape}"
        )
    _check_float("combine", "y", y)
    comm = _comm_for("combine", handle.axis_name)
    if comm.comm_id != handle.comm_id:
        raise RuntimeError(
            "sluice.ep.combine: the handle comes from a communicator that was replaced "
            "(sluice.ep.setup was called again); dispatch again"
        )
    cfg = (comm.comm_id, comm.num_ranks, handle.num_experts, comm.stream)
    return _combine(y, handle.send_row, handle.recv_src, _where(comm), cfg)


# ---- fan_out / fan_in with their VJPs ------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fan_out(x, idx, l, max_rows, zero_unused_rows):
    return tuple(_fan_out_call(x, idx, l, max_rows, zero_unused_rows))


def _fan_out_fwd(x, idx, l, max_rows, zero_unused_rows):
    xs, gs, pos = _fan_out_call(x, idx, l, max_rows, zero_unused_rows)
    return (xs, gs, pos), (pos, x[:0])


def _fan_out_bwd(l, max_rows, zero_unused_rows, res, cts):
    pos, x = res
    dxs = cts[0]  # xs has x's dtype, so does its cotangent
    # Each row of x was copied to the rows pos[i, :] of xs: its gradient is their sum (fan_in with 1s).
    ones = jnp.where(pos >= 0, 1.0, 0.0).astype(jnp.float32)
    return match_vma(_fan_in_call(dxs, ones, pos, l, dxs.dtype), x), None


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def _fan_out_checked(op, x, idx, weights, l, max_rows, zero_unused_rows=True):
    if not isinstance(zero_unused_rows, (bool, np.bool_)):
        raise TypeError(
            f"sluice.ep.{op}: zero_unused_rows must be a bool, got "
            f"{type(zero_unused_rows).__name__}"
        )
    zero_unused_rows = bool(zero_unused_rows)
    if max_rows is None:
        max_rows = 0
    elif not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"sluice.ep.{op}: max_rows must be an int >= 1 or None, got {max_rows!r}")
    max_rows = int(max_rows)
    x, idx = jnp.asarray(x), jnp.asarray(idx)
    if x.ndim != 2 or idx.ndim != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"sluice.ep.{op}: x [N, H] and topk_idx [N, k] expected, got {x.shape} and {idx.shape}"
        )
    _check_float(op, "x", x)
    if idx.dtype != jnp.int32:
        raise TypeError(f"sluice.ep.{op}: topk_idx must be int32, got {idx.dtype}")
    if jnp.shape(weights) != idx.shape:
        raise ValueError(
            f"sluice.ep.{op}: topk_weights must have topk_idx's shape {idx.shape}, got "
            f"{jnp.shape(weights)}"
        )
    xs, gs, pos = _fan_out(x, idx, l, max_rows, zero_unused_rows)
    return xs, gs, Fan(pos, jnp.asarray(weights, jnp.float32), gs, l, max_rows, zero_unused_rows)


def fan_out(recv: Dispatched, *, max_rows: int | None = None, zero_unused_rows: bool = True):
    """Expert-sorted rows for gmm: (xs [M, H], group_sizes int32 [L], fan). See the module docstring.
    max_rows bounds M (default: the worst case N*min(k, L)); the (row, slot) pairs past it are left
    out (pos -1, not in group_sizes): their count is sum(topk_idx >= 0) - sum(group_sizes).
    zero_unused_rows=False leaves xs's rows past sum(group_sizes), and those of fan_in's gradient
    with respect to ys, unwritten on CUDA (whatever the buffer held; the CPU zeroes them anyway):
    for callers that read only the groups' rows (gmm, tgmm, row-wise ops), where zeroing them is a
    write of up to M rows for nothing."""
    return _fan_out_checked(
        "fan_out",
        recv.x,
        recv.topk_idx,
        recv.topk_weights,
        int(recv.counts.shape[0]),
        max_rows,
        zero_unused_rows,
    )


def fan_out_tokens(x, topk_idx, topk_weights, *, num_experts: int):
    """fan_out for tokens that stay on their device (all experts local, no dispatch): the token copies
    of x [T, H] in expert order, (xs [T*min(k, E), H], group_sizes int32 [E], fan), by a counting sort
    (no argsort; the backward is a gather-sum, no scatter-add). ``fan_in(ys, fan)`` sums them back
    with the weights. topk_idx int32 [T, k] in [-1, E) (-1: no expert)."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(
            f"sluice.ep.fan_out_tokens: num_experts must be an int >= 1, got {num_experts!r}"
        )
    return _fan_out_checked("fan_out_tokens", x, topk_idx, topk_weights, num_experts, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fan_in(ys, w, pos, group_sizes, l, out_dtype, zero_unused_rows):
    return _fan_in_call(ys, w, pos, l, out_dtype)


def _fan_in_fwd(ys, w, pos, group_sizes, l, out_dtype, zero_unused_rows):
    return _fan_in_call(ys, w, pos, l, out_dtype), (ys, w, pos, group_sizes)


def _fan_in_bwd(l, out_dtype, zero_unused_rows, res, dout):
    ys, w, pos, group_sizes = res
    dys, dw = _fan_in_bwd_call(dout, ys, w, pos, group_sizes, l, zero_unused_rows)
    return match_vma(dys, ys), match_vma(dw, w), None, None


_fan_in.defvjp(_fan_in_fwd, _fan_in_bwd)


def _ones(pos):
    return jnp.where(pos >= 0, 1.0, 0.0).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fan_sum(ys, pos, group_sizes, l, out_dtype, zero_unused_rows):
    return _fan_in_call(ys, _ones(pos), pos, l, out_dtype)


def _fan_sum_fwd(ys, pos, group_sizes, l, out_dtype, zero_unused_rows):
    # keeps the layout and ys's shape, not ys: the backward copies d out to the rows
    out = _fan_sum(ys, pos, group_sizes, l, out_dtype, zero_unused_rows)
    return out, (pos, group_sizes, ys[:, :0])  # [M, 0]: ys's rows and type, no data


def _fan_sum_bwd(l, out_dtype, zero_unused_rows, res, dout):
    pos, group_sizes, ys = res
    # d out in its own dtype (the kernel rounds each row once to ys's)
    dys = _fan_in_bwd_call(dout, ys, _ones(pos), pos, group_sizes, l, zero_unused_rows, False)
    return match_vma(dys, ys), None, None


_fan_sum.defvjp(_fan_sum_fwd, _fan_sum_bwd)


def fan_in(ys, fan: Fan, *, out_dtype=None, weighted: bool = True):
    """out[i] = sum_j fan.weights[i, j] * ys[fan.pos[i, j]] (f32, slot order). See the module docstring.
    weighted=False sums the rows unweighted (for experts that applied the weights themselves, e.g.
    ``sluice.swiglu(..., row_weights=...)``): its backward copies d out to the rows and keeps no
    ys (no gradient for fan.weights)."""
    ys = jnp.asarray(ys)
    if not isinstance(fan, Fan):
        raise TypeError(f"sluice.ep.fan_in: fan must come from fan_out, got {type(fan)}")
    n, k = fan.pos.shape
    m = _fan_rows(n, k, fan.num_local_experts, fan.max_rows)
    if ys.ndim != 2 or ys.shape[0] != m:
        raise ValueError(
            f"sluice.ep.fan_in: ys must be [M, H] with M = {m} (fan_out's rows), got "
            f"shape {ys.shape}"
        )
    _check_float("fan_in", "ys", ys)
    out_dtype = jnp.dtype(out_dtype or ys.dtype)
    if out_dtype not in _FLOATS:
        raise TypeError(
            f"sluice.ep.fan_in: out_dtype must be float32, bfloat16 or float16, got {out_dtype}"
        )
    if not isinstance(weighted, (bool, np.bool_)):
        raise TypeError(f"sluice.ep.fan_in: weighted must be a bool, got {type(weighted).__name__}")
    if not weighted:
        return _fan_sum(
            ys, fan.pos, fan.group_sizes, fan.num_local_experts, out_dtype, fan.zero_unused_rows
        )
    w = jnp.asarray(fan.weights, jnp.float32)
    return _fan_in(
        ys, w, fan.pos, fan.group_sizes, fan.num_local_experts, out_dtype, fan.zero_unused_rows
    )


# ---- pure-jnp references (whole arrays over all ranks, for tests) -----------------------------------
def dispatch_reference(x, topk_idx, topk_weights, *, num_experts, num_ranks):
    """dispatch for all ranks at once. x [R, T, H], topk_idx/topk_weights [R, T, k] (rank s's tokens
    at [s]). Returns (recv_x [R, N, H], recv_idx [R, N, k], recv_w [R, N, k], num_rows [R],
    counts [R, L], recv_src [R, N]); index [d] is what rank d receives."""
    r, t, h = x.shape
    k = topk_idx.shape[-1]
    l = num_experts // num_ranks
    n = t * r
    owner = jnp.where(topk_idx >= 0, topk_idx // l, -1)  # [R, T, k]
    outs = []
    for d in range(r):
        goes = jnp.any(owner == d, axis=-1).reshape(-1)  # [(s, t)] in (source, token) order
        row = jnp.cumsum(goes) - 1
        dest = jnp.where(goes, row, n)  # n: dropped by the scatter
        local = (owner == d).reshape(n, k)
        rx = jnp.zeros((n, h), x.dtype).at[dest].set(x.reshape(n, h), mode="drop")
        ri = (
            jnp.full((n, k), -1, jnp.int32)
            .at[dest]
            .set(jnp.where(local, topk_idx.reshape(n, k) - d * l, -1), mode="drop")
        )
        rw = (
            jnp.zeros((n, k), jnp.float32)
            .at[dest]
            .set(jnp.where(local, topk_weights.reshape(n, k), 0.0), mode="drop")
        )
        src = (
            jnp.full((n,), -1, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
        )
        counts = jnp.sum(
            jax.nn.one_hot(
                jnp.where(local, topk_idx.reshape(n, k) - d * l, -1), l, dtype=jnp.int32
            ),
            axis=(0, 1),
        )
        outs.append((rx, ri, rw, jnp.sum(goes).astype(jnp.int32), counts, src))
    return tuple(jnp.stack(z) for z in zip(*outs))


def combine_reference(y, recv_src, num_tokens):
    """combine for all ranks at once: y [R, N, H'] (rank d's rows at [d]), recv_src [R, N] from
    dispatch_reference. Returns [R, T, H'] summed over d in order in f32, rounded to y.dtype."""
    r, _, h = y.shape
    acc = jnp.zeros((r * num_tokens, h), jnp.float32)
    for d in range(r):  # fixed rank order, as the op
        acc = acc.at[recv_src[d]].add(y[d].astype(jnp.float32), mode="drop")
    return acc.reshape(r, num_tokens, h).astype(y.dtype)


def fan_out_reference(x, topk_idx, num_local_experts, max_rows=0):
    """fan_out on one rank: (xs [M, H], group_sizes [L], pos [N, k])."""
    n, k = topk_idx.shape
    l = num_local_experts
    m = _fan_rows(n, k, l, max_rows)
    flat = topk_idx.reshape(-1)
    onehot = jax.nn.one_hot(flat, l, dtype=jnp.int32)  # -1 -> zeros
    sizes = jnp.sum(onehot, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    rank_in_group = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    pos = jnp.where(flat >= 0, starts[jnp.maximum(flat, 0)] + rank_in_group, -1)
    pos = jnp.where(pos < m, pos, -1)  # past max_rows: left out
    ends = jnp.cumsum(sizes)
    sizes = jnp.minimum(ends, m) - jnp.minimum(ends - sizes, m)
    src_rows = jnp.repeat(jnp.arange(n), k)
    xs = (
        jnp.zeros((m, x.shape[1]), x.dtype)
        .at[jnp.where(pos >= 0, pos, m)]
        .set(x[src_rows], mode="drop")
    )
    return xs, sizes.astype(jnp.int32), pos.reshape(n, k).astype(jnp.int32)


def fan_in_reference(ys, weights, pos, out_dtype=None):
    """fan_in on one rank: out [N, H'] = sum_j weights[:, j] * ys[pos[:, j]] in f32."""
    acc = jnp.zeros((pos.shape[0], ys.shape[1]), jnp.float32)
    for j in range(pos.shape[1]):  # slot order, as the op
        acc = acc + jnp.where(
            pos[:, j : j + 1] >= 0,
            weights[:, j : j + 1] * ys[jnp.maximum(pos[:, j], 0)].astype(jnp.float32),
            0.0,
        )
    return acc.astype(out_dtype or ys.dtype)


def moe_reference(x, topk_idx, topk_weights, expert_fn):
    """The math dispatch -> fan_out -> experts -> fan_in -> combine computes, without moving anything:
    out[t] = sum_j topk_weights[t, j] * expert_fn(x[t], topk_idx[t, j]) over slots with an expert.
    expert_fn(x [T, H], e [T] int32) -> [T, H']."""
    acc = None
    for j in range(topk_idx.shape[1]):
        e = topk_idx[:, j]
        y = expert_fn(x, jnp.maximum(e, 0)).astype(jnp.float32)
        term = jnp.where((e >= 0)[:, None], topk_weights[:, j : j + 1] * y, 0.0)
        acc = term if acc is None else acc + term
    return acc

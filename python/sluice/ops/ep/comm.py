"""The communicators of sluice.ep: setup / teardown, the one per mesh axis that the exchange ops
find at trace time, and the handle exchange between processes through jax.distributed's key-value
store. See sluice.ep's docstring for what setup takes."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _lib
from ..capi import EP_TRANSPORTS, EpCommDesc

_BLOB_BYTES = 256  # the most bytes of one rank's exported handle


@dataclasses.dataclass(frozen=True)
class Communicator:
    """A communicator made by setup: for which mesh axis and devices, over which transport."""

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
    num_sms: int = 64  # thread blocks of the GPU exchange kernels


_COMMS: dict[str, list[Communicator]] = {}
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


def _destroy(c: Communicator) -> None:
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


def _group_devices(mesh, axis_name) -> np.ndarray:
    """The mesh's devices as [group, rank]: a group per index over the other axes."""
    r = int(mesh.shape[axis_name])
    a = tuple(mesh.axis_names).index(axis_name)
    return np.moveaxis(np.asarray(mesh.devices), a, -1).reshape(-1, r)


def setup(
    mesh,
    axis_name="ep",
    *,
    timeout_s: float = 60.0,
    num_sms: int = 64,
    transport: str = "auto",
    buffer_bytes: int = 256 << 20,
) -> None:
    """Prepares the communicator of `axis_name` over `mesh` (see sluice.ep's docstring). Call it
    before jit."""
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"sluice.ep.setup: mesh has axes {tuple(mesh.axis_names)}, not {axis_name!r}"
        )
    if not timeout_s > 0:
        raise ValueError(f"sluice.ep.setup: timeout_s must be > 0, got {timeout_s}")
    names, sizes = _mesh_signature(mesh)
    r = int(mesh.shape[axis_name])
    devs = _group_devices(mesh, axis_name)
    g = devs.shape[0]
    platform = devs.flat[0].platform
    if any(d.platform != platform for d in devs.flat):
        raise ValueError("sluice.ep.setup: the mesh mixes platforms")
    if transport not in ("auto", *EP_TRANSPORTS):
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
    desc = EpCommDesc(
        ctypes.sizeof(EpCommDesc),
        g,
        r,
        float(timeout_s),
        int(use_cuda),
        ctypes.cast(ordinals, ctypes.POINTER(ctypes.c_int)) if use_cuda else None,
        int(num_sms),
        EP_TRANSPORTS.get(transport, 0),
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
    comm = Communicator(
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
        int(num_sms),
    )
    old = [c for c in _COMMS.get(axis_name, []) if (c.axis_names, c.axis_sizes) == (names, sizes)]
    for c in old:
        _destroy(c)
    _COMMS[axis_name] = [c for c in _COMMS.get(axis_name, []) if c not in old] + [comm]


def communicator(mesh, axis_name="ep") -> Communicator | None:
    """The communicator setup made for `axis_name` of `mesh` (the same axes, sizes and devices), or
    None when there is none (never set up, torn down, or replaced by a setup on another mesh with
    the same axes). A layer that needs one calls setup where this is None."""
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"sluice.ep.communicator: mesh has axes {tuple(mesh.axis_names)}, not {axis_name!r}"
        )
    names, sizes = _mesh_signature(mesh)
    ids = tuple(int(d.id) for d in _group_devices(mesh, axis_name).flat)
    for c in _COMMS.get(axis_name, []):
        if (c.axis_names, c.axis_sizes, c.device_ids) == (names, sizes, ids):
            return c
    return None


def teardown(axis_name=None) -> None:
    """Frees the communicators of `axis_name` (all when None)."""
    for name in list(_COMMS) if axis_name is None else [axis_name]:
        for c in _COMMS.pop(name, []):
            _destroy(c)


def _comm_for(op: str, axis_name) -> Communicator:
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


def _where(comm: Communicator):
    """int32 [2] = (group, rank) of this shard: the group is the index over the other mesh axes."""
    rank = jax.lax.axis_index(comm.axis_name)
    group = jnp.int32(0)
    for name, size in zip(comm.axis_names, comm.axis_sizes):
        if name != comm.axis_name:
            group = group * size + jax.lax.axis_index(name)
    return jnp.stack([jnp.asarray(group, jnp.int32), jnp.asarray(rank, jnp.int32)])

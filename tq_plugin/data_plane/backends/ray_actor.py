"""``RayDataPlane``: one columnar store shared by every process of a Ray cluster.

Pick it when more than one process must read and write the same rows (rollout workers and
trainer ranks on one or more nodes) and TransferQueue is more than you need.

Bulk bytes travel through Ray's object store, never through pickled actor arguments:

* a put ships each field as numpy buffers (Ray hands them to the actor zero-copy from shared
  memory); the actor validates the whole put with ``LocalDataPlane``'s own rules, then ``ray.put``s
  each field's block once, so the store actor *owns* it (a writer process may exit: what was
  acknowledged stays), and keeps only the object references and per-row (start, length) metadata;
* a get asks the actor where the rows are (references plus metadata), then the client maps the
  objects zero-copy and gathers the rows itself;
* clearing the last row of a block drops its reference, and Ray frees the shared memory.

A put therefore writes the bytes to shared memory twice (the call's argument, then the block
the actor owns). Holding the writer's own object instead would save one copy, but Ray frees an
object when its owner exits, so rows a rollout worker wrote would vanish with it.

Small blocks (under ``INLINE_BYTES``) stay in the actor as plain numpy copies: an object-store
round trip costs more than copying them. The contract is ``LocalDataPlane``'s, checked by the
same conformance suite. This is one of the two modules (with the TransferQueue adapter) that
import Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch.nested._internal.nested_tensor import NestedTensor

from tq_plugin.data_plane.backends._checkpoint import Restored
from tq_plugin.data_plane.backends._claims import TaskCursors
from tq_plugin.data_plane.backends._columns import ColumnSpec, gather_rows
from tq_plugin.data_plane.backends._validate import check_storable
from tq_plugin.data_plane.backends.local import LocalDataPlane
from tq_plugin.data_plane.client import DataPlaneClosedError, FieldsLike
from tq_plugin.data_plane.meta import KVBatchMeta

log = logging.getLogger(__name__)

DEFAULT_ACTOR_NAME = "tq_plugin_data_plane"
DEFAULT_NAMESPACE = "tq_plugin"
# A local Ray's node address: with it (and ``_loopback_kept``) every Ray server binds loopback.
LOOPBACK_NODE_IP = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# A read-only GCS call every Ray version with token authentication serves (its first, at attach).
_GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
# Field blocks smaller than this stay in the actor's memory instead of the object store.
INLINE_BYTES = 64 << 10

# The only methods a client may run in the store actor: the protocol, plus ``locate`` (the
# read's first half).
_ACTOR_METHODS = frozenset({
    "register_partition", "put_samples", "locate", "get_tags", "clear_samples",
    "list_sample_ids", "list_partitions", "claim_meta", "check_consumption_status", "stats",
    "save", "restore",
})

_HOSTS: dict[tuple[str, str], Any] = {}
_VERIFIED: set[str] = set()  # GCS addresses seen refusing a caller without the token
_SAME_SIZE_UINT = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


class UnauthenticatedClusterError(RuntimeError):
    """The Ray cluster runs (or would run) without token authentication, and that was not allowed."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "RayDataPlane needs Ray: pip install 'tq_plugin[ray]'; or use LocalDataPlane"
        ) from e
    return ray


def _token_available() -> bool:
    """Whether this host holds a Ray token where Ray looks for one."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or (
        os.path.isfile(path) if path else os.path.isfile(os.path.expanduser("~/.ray/auth_token")))


def _authenticating(allow_unauthenticated: bool, attaching: bool) -> None:
    """Before ``ray.init``: token authentication on for this process and every one Ray starts.

    Ray reads ``RAY_AUTH_MODE`` from the environment (its processes inherit it), and the token
    from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``
    (generated on a first local start). ``RAY_AUTH_MODE=disabled`` is refused unless allowed.
    """
    mode = os.environ.get(AUTH_MODE_ENV, "").lower()
    if not mode and attaching and allow_unauthenticated and not _token_available():
        return  # no token to send: the cluster must be one that does not ask for it
    if mode and mode != "token":
        if not allow_unauthenticated:
            raise UnauthenticatedClusterError(
                f"{AUTH_MODE_ENV}={os.environ[AUTH_MODE_ENV]} turns off Ray's token "
                "authentication, so anyone who can reach the cluster's ports can run code in it; "
                f"unset it (or set {AUTH_MODE_ENV}=token), or set "
                "tq.backend.allow_unauthenticated=true on a network only the job's hosts reach"
            )
        log.warning("Ray runs without token authentication (%s=%s, allowed by "
                    "allow_unauthenticated=True)", AUTH_MODE_ENV, os.environ[AUTH_MODE_ENV])
        return
    os.environ[AUTH_MODE_ENV] = "token"
    # Ray caches its config at import (maybe before the variable was set): re-read it.
    from ray._raylet import Config

    Config.initialize("")


def cluster_answers_without_token(gcs_address: str, timeout_s: float = 10.0) -> bool:
    """True when the GCS at ``gcs_address`` serves a caller that sends no token.

    One read-only call (``GetClusterId``) on a plain channel that carries no token: a cluster
    with token authentication answers ``UNAUTHENTICATED``. Any other failure (TLS, a refused
    connection) also means it did not answer.
    """
    import grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            channel.unary_unary(_GCS_PROBE)(b"", timeout=timeout_s)
        except grpc.RpcError:
            return False
    return True


def _refuse_unauthenticated(allow_unauthenticated: bool) -> None:
    """Stop unless the cluster this process runs in refuses callers without the token."""
    gcs = str(_ray().get_runtime_context().gcs_address)
    if gcs in _VERIFIED or not cluster_answers_without_token(gcs):
        _VERIFIED.add(gcs)
        return
    why = (f"the Ray cluster at {gcs} answers callers that send no token (it runs without "
           "token authentication): anyone who can reach its ports can run code in it")
    if not allow_unauthenticated:
        raise UnauthenticatedClusterError(
            f"{why}. Start it with {AUTH_MODE_ENV}=token on every node (Ray >= 2.52), or set "
            "tq.backend.allow_unauthenticated=true on a network only the job's hosts reach."
        )
    log.warning("%s (allowed by allow_unauthenticated=True).", why)
    _VERIFIED.add(gcs)


@contextlib.contextmanager
def _loopback_kept(node_ip: str | None) -> Iterator[None]:
    """Keep a ``127.0.0.1`` node address on loopback during ``ray.init``.

    On Linux Ray replaces ``127.0.0.1`` (as node address or in a GCS address) with the
    machine's routable one, and its gRPC servers bind every interface unless the node address
    is ``127.0.0.1``. Ray's single-machine mode (its default on macOS and Windows) skips the
    replacement; this turns it on for the call, and for the processes the call starts.
    """
    if node_ip not in ("127.0.0.1", "localhost"):
        yield
        return
    from ray._private import ray_constants

    before_env = os.environ.get(_SINGLE_MACHINE_ENV)
    before = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
        if before_env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = before_env


def start_ray_on_loopback(address: str | None, namespace: str | None,
                          ray_init: Mapping[str, Any] | None, *,
                          allow_unauthenticated: bool = False) -> None:
    """Start Ray (or attach to ``address``) unless this process already runs it; then make
    sure the cluster authenticates.

    Without an address Ray starts a local instance on ``127.0.0.1`` with token authentication
    and no dashboard: everything it and the stores open listens on loopback only. Attaching
    sends this host's token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``). Either way a cluster that answers callers without the token is
    refused (``UnauthenticatedClusterError``) unless ``allow_unauthenticated``.
    """
    ray = _ray()
    if ray.is_initialized():
        _refuse_unauthenticated(allow_unauthenticated)
        return
    opts = dict(ray_init or {})
    in_opts = opts.pop("address", None)
    address = address or in_opts
    _authenticating(allow_unauthenticated, attaching=bool(address and address != "local"))
    if address and address != "local":
        # Attaching to a running cluster: its resources are set; Ray refuses them from a
        # driver that joins (num_cpus, num_gpus, resources, object_store_memory...).
        for key in ("num_cpus", "num_gpus", "resources", "object_store_memory",
                    "include_dashboard", "dashboard_host", "_node_ip_address"):
            opts.pop(key, None)
        host = address.rsplit(":", 1)[0]
        if host.startswith("127."):
            # A cluster on loopback: join it there too (Ray would pick the routable address).
            opts["_node_ip_address"] = host
        with _loopback_kept(host):
            ray.init(address=address, namespace=namespace, **opts)
    else:
        opts.setdefault("_node_ip_address", LOOPBACK_NODE_IP)
        opts.setdefault("include_dashboard", False)
        with _loopback_kept(opts["_node_ip_address"]):
            ray.init(address="local", namespace=namespace, **opts)
    try:
        _refuse_unauthenticated(allow_unauthenticated)
    except UnauthenticatedClusterError:
        ray.shutdown()
        raise


# ---------------------------------------------------------------- numpy <-> torch, zero-copy
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor; dtypes numpy lacks (bfloat16) as same-size uints."""
    try:
        return t.numpy()
    except TypeError:
        return t.view(_SAME_SIZE_UINT[t.element_size()]).numpy()


def _as_torch(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """The tensor ``_as_numpy`` came from, sharing ``a``'s memory (read-only buffers included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable": never written
        t = torch.from_numpy(a)
    dtype = getattr(torch, dtype_name)
    return t if t.dtype == dtype else t.view(dtype)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t if t.is_cpu else t.cpu()).contiguous()


def _listed(values: Any) -> Any:
    """A list of ``values`` to ship; a bare string (or a non-iterable) travels as it is, so the
    store refuses it by name instead of ``list("s1")`` splitting it into ids ``['s', '1']``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        return values
    return list(values)


def _encode(fields: FieldsLike | None) -> Any:
    """A put's payload as numpy buffers Ray ships out of band.

    Anything the fast path does not cover (non-tensor leaves, strided nested tensors, nested
    TensorDicts) travels as-is, and the store's validation names what is wrong with it.
    """
    if fields is None:
        return None
    batch = None
    if isinstance(fields, TensorDictBase):
        batch = tuple(fields.batch_size)
        items = list(fields.items())
    elif isinstance(fields, Mapping):
        items = list(fields.items())
    else:
        return ("raw", fields)
    out = []
    for name, v in items:
        if isinstance(v, NestedTensor) and v._ragged_idx == 1:
            if v._lengths is not None:
                v = v.contiguous()
            values, offsets = _cpu(v._values), _cpu(v._offsets)
            out.append((name, "jagged", _dtype_name(values.dtype), _as_numpy(values), offsets.numpy()))
        elif type(v) is torch.Tensor and not v.is_nested:
            check_storable(name, v)  # a sparse or meta tensor cannot become a numpy buffer
            t = _cpu(v)
            out.append((name, "dense", _dtype_name(t.dtype), _as_numpy(t), None))
        else:
            return ("raw", fields)
    return ("enc", batch, out)


def _decode(payload: Any) -> FieldsLike | None:
    if payload is None:
        return None
    if payload[0] == "raw":
        return payload[1]
    _, batch, items = payload
    fields: dict[str, torch.Tensor] = {}
    for name, kind, dtype, data, offsets in items:
        t = _as_torch(data, dtype)
        fields[name] = (
            t if kind == "dense"
            else torch.nested.nested_tensor_from_jagged(t, torch.from_numpy(np.asarray(offsets)))
        )
    return fields if batch is None else TensorDict(fields, batch_size=list(batch))


# ---------------------------------------------------------------- the actor's columns
class _RefColumn:
    """A column whose bytes live in Ray objects (or small inline arrays): per slot, which block
    holds the row and where (``start``, ``length``, counted in elements of the column's shape).

    A dense row is one element; a jagged row is ``length`` elements. A block is released as
    soon as no live row points into it. Implements the column interface ``LocalDataPlane``
    drives (``reserve`` / ``write`` / ``drop`` / ``release`` / ``to_jagged`` / ``has`` / ``read``).
    """

    # Reads copy out of the (read-only) object store, so a reader can never change the rows.
    intact = True

    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.present = np.zeros(0, dtype=bool)
        self.block = np.zeros(0, dtype=np.int64)
        self.start = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.live_rows = 0
        self.live_elements = 0
        self.blocks: dict[int, Any] = {}  # block id -> ObjectRef, or an inline numpy array
        self.block_rows: dict[int, int] = {}  # block id -> live rows pointing into it
        self.block_elements: dict[int, int] = {}
        self.block_bytes: dict[int, int] = {}
        self._next_block = 0
        n = 1
        for d in spec.shape:
            n *= d
        self.element_bytes = n * torch.empty((), dtype=spec.dtype).element_size()

    def has(self, slots: np.ndarray) -> np.ndarray:
        out = np.zeros(slots.shape[0], dtype=bool)
        inside = slots < self.present.shape[0]
        out[inside] = self.present[slots[inside]]
        return out

    def reserve(self, need_slots: int, extra_values: int = 0) -> bool:
        """Room for slots ``< need_slots`` (bookkeeping only: the block was staged already)."""
        if need_slots > self.present.shape[0]:
            cap = max(need_slots, 2 * self.present.shape[0])
            grown = []
            for old in (self.present, self.block, self.start, self.length):
                new = np.zeros(cap, dtype=old.dtype)
                new[: old.shape[0]] = old
                grown.append(new)
            self.present, self.block, self.start, self.length = grown
        return True  # every put adds a block: let the store re-read its peak

    def _unref(self, slots: np.ndarray) -> int:
        """Forget the live rows at ``slots``; release blocks no row points into. Elements gone."""
        gone = int(self.length[slots].sum())
        self.live_rows -= slots.shape[0]
        self.live_elements -= gone
        self.present[slots] = False
        ids, counts = np.unique(self.block[slots], return_counts=True)
        for b, c in zip(ids.tolist(), counts.tolist()):
            left = self.block_rows[b] - c
            if left:
                self.block_rows[b] = left
            else:
                del self.block_rows[b], self.blocks[b], self.block_bytes[b], self.block_elements[b]
        return gone

    def write(self, slots: np.ndarray, block: torch.Tensor, lengths: np.ndarray | None = None) -> int:
        """Point ``slots`` at the block staged for ``block``; returns the change in live bytes."""
        held, elements, nbytes = _take_staged(block)
        n = slots.shape[0]
        if lengths is None:
            lengths = np.ones(n, dtype=np.int64)
        old = slots[self.present[slots]]
        gone = self._unref(old) if old.shape[0] else 0
        bid = self._next_block
        self._next_block += 1
        self.blocks[bid], self.block_rows[bid] = held, n
        self.block_elements[bid], self.block_bytes[bid] = elements, nbytes
        self.block[slots] = bid
        self.start[slots] = np.cumsum(lengths) - lengths
        self.length[slots] = lengths
        self.present[slots] = True
        added = int(lengths.sum())
        self.live_rows += n
        self.live_elements += added
        return (added - gone) * self.element_bytes

    def drop(self, slots: np.ndarray) -> int:
        slots = slots[slots < self.present.shape[0]]
        slots = slots[self.present[slots]]
        return -self._unref(slots) * self.element_bytes if slots.shape[0] else 0

    def release(self) -> None:
        self.__init__(self.spec)  # type: ignore[misc]

    def to_jagged(self) -> _RefColumn:
        """The same rows as a jagged column: a dense row ``[L, *t]`` becomes L elements ``t``."""
        width = self.spec.shape[0]
        col = _RefColumn(ColumnSpec(True, self.spec.dtype, tuple(self.spec.shape[1:])))
        col.present, col.block = self.present.copy(), self.block.copy()
        col.start = self.start * width
        col.length = np.where(self.present, width, 0).astype(np.int64)
        col.live_rows, col.live_elements = self.live_rows, self.live_elements * width
        col.blocks, col.block_rows = dict(self.blocks), dict(self.block_rows)
        col.block_bytes = dict(self.block_bytes)
        col.block_elements = {b: e * width for b, e in self.block_elements.items()}
        col._next_block = self._next_block
        return col

    def locate(self, slots: np.ndarray) -> tuple[list[Any], list[int], np.ndarray, np.ndarray, np.ndarray]:
        """The blocks holding ``slots`` (each once, with its element count) and, per row, its
        block's position in that list, its start and its length."""
        ids, index = np.unique(self.block[slots], return_inverse=True)
        ids = ids.tolist()
        return ([self.blocks[b] for b in ids], [self.block_elements[b] for b in ids],
                index, self.start[slots], self.length[slots])

    def read(self, slots: np.ndarray) -> Any:
        """Scalar columns (a few bytes a row: claims read ``input_lengths``) and every column
        while a checkpoint is taken (``_RefStore.save``): the values, as ``LocalDataPlane``'s
        columns give them (jagged: values and offsets).

        Otherwise a placeholder of the right row count: ``LocalDataPlane.get_samples`` validates
        a read and calls this, and the actor answers reads with locations (``locate``).
        """
        scalar = not self.spec.jagged and self.spec.shape == ()
        if scalar or getattr(_FULL_READS, "on", False):
            blocks, elements, index, start, length = self.locate(slots)
            values = _gather(_fetch(blocks), elements, _dtype_name(self.spec.dtype),
                             self.spec.shape, index, start, length)
            if not self.spec.jagged:
                return values
            offsets = torch.zeros(slots.shape[0] + 1, dtype=torch.int64)
            torch.cumsum(torch.from_numpy(length), 0, out=offsets[1:])
            return values, offsets
        placeholder = torch.zeros(slots.shape[0], dtype=torch.int8)
        return (placeholder, torch.arange(slots.shape[0] + 1)) if self.spec.jagged else placeholder

    @property
    def live_bytes(self) -> int:
        return self.live_elements * self.element_bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self.block_bytes.values())


# Set on the thread taking a checkpoint: columns then read their bytes, not placeholders.
_FULL_READS = threading.local()

# Blocks of the put being applied on this thread, keyed by id(prepared block): staged (copied
# or put into the object store) before the store's write phase, which must not fail part-way.
_STAGED = threading.local()


def _stage(block: torch.Tensor) -> tuple[Any, int, int]:
    arr = _as_numpy(block.contiguous())
    # Keep nothing that aliases the caller's (argument) buffers: copy small blocks, put big ones.
    held = arr.copy() if arr.nbytes < INLINE_BYTES else _ray().put(arr)
    return held, int(block.shape[0]), int(arr.nbytes)


def _take_staged(block: torch.Tensor) -> tuple[Any, int, int]:
    staged = getattr(_STAGED, "blocks", None) or {}
    found = staged.get(id(block))
    return found if found is not None else _stage(block)


def _fetch(blocks: list[Any], timeout_s: float | None = None) -> list[np.ndarray]:
    refs = [i for i, b in enumerate(blocks) if not isinstance(b, np.ndarray)]
    out = list(blocks)
    if refs:
        for i, arr in zip(refs, _ray().get([blocks[i] for i in refs], timeout=timeout_s)):
            out[i] = arr
    return out


def _gather(arrays: list[np.ndarray], elements: list[int], dtype: str, shape: tuple[int, ...],
            index: np.ndarray, start: np.ndarray, length: np.ndarray) -> torch.Tensor:
    """Rows ``block[index[i]][start[i] : start[i] + length[i]]`` (in elements of ``shape``)
    joined into one new tensor."""
    arrays = [a.reshape(e, *shape) for a, e in zip(arrays, elements)]
    if len(arrays) == 1:
        return gather_rows(_as_torch(arrays[0], dtype), start, length)
    if not arrays:
        return torch.empty((0, *shape), dtype=getattr(torch, dtype))
    rows = [arrays[b][s : s + n] for b, s, n in zip(index.tolist(), start.tolist(), length.tolist())]
    return _as_torch(np.concatenate(rows), dtype)


class _RefStore(LocalDataPlane):
    """``LocalDataPlane``'s schema, validation, claims and bookkeeping, over ``_RefColumn``s."""

    def put_samples(self, sample_ids, partition_id, fields=None, tags=None, **options):  # type: ignore[override]
        # A client's payload comes ``_encode``d; a checkpoint restored in the actor puts tensors.
        fields = _decode(fields) if isinstance(fields, tuple) else fields
        return super().put_samples(sample_ids=sample_ids, partition_id=partition_id,
                                   fields=fields, tags=tags, **options)

    def save(self, path: str, *, metadata: Mapping[str, Any] | None = None) -> None:
        """``LocalDataPlane.save`` (same format and guarantees), over the bytes the blocks hold."""
        _FULL_READS.on = True
        try:
            super().save(path, metadata=metadata)
        finally:
            _FULL_READS.on = False

    def restore(self, path: str) -> tuple[list[str], dict[str, Any]]:
        """Put a ``save`` checkpoint into this store (claims included): ``load_into``'s rules."""
        from tq_plugin.data_plane.backends._checkpoint import load_into

        restored = load_into(self, path)
        return restored.partition_ids, restored.metadata

    def _apply(self, part: Any, ids: list[str], prepared: list[Any], *args: Any, **kwargs: Any) -> None:
        # Stage every block first (the only step that can fail for want of memory), and give each
        # field that starts afresh a _RefColumn, so the base class never allocates a buffer here.
        staged = {id(p.block): _stage(p.block) for p in prepared}
        before = dict(part.columns)
        for p in prepared:
            col = part.columns.get(p.name)
            # Only a field without live rows starts afresh (prepare refuses a change of a live
            # one); replacing a live column would drop every acknowledged row of the field.
            fresh = col is None or col.live_rows == 0
            if not p.promote and fresh and (not isinstance(col, _RefColumn) or col.spec != p.spec):
                part.columns[p.name] = _RefColumn(p.spec)
        _STAGED.blocks = staged
        try:
            super()._apply(part, ids, prepared, *args, **kwargs)
        except BaseException:
            part.columns.clear()
            part.columns.update(before)
            raise
        finally:
            _STAGED.blocks = None

    def locate(self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> dict:
        """Validate a read exactly as ``get_samples`` does; answer with where the rows are."""
        ids, names = list(sample_ids), list(select_fields)
        with self._lock:  # one snapshot: a concurrent clear cannot free a block we hand out
            self.get_samples(ids, partition_id, names)
            part = self._partitions[partition_id]
            slots = np.array([part.slot_of[s] for s in ids], dtype=np.int64)
            plan = {}
            for name in names:
                col = part.columns[name]
                plan[name] = (col.spec.jagged, _dtype_name(col.spec.dtype), col.spec.shape,
                              *col.locate(slots))
        return {"n": len(ids), "fields": plan}


# The hook this module relies on must exist, or the store would silently hold bytes itself.
assert callable(getattr(LocalDataPlane, "_apply", None)), "LocalDataPlane._apply hook is gone"


class _StoreHost:
    """The actor body: one process hosting named stores.

    Creating a store is a dict insert, not a process start (a fresh Ray worker pays the torch
    import, seconds), so short-lived stores (one per experiment, per test) stay cheap.
    """

    def __init__(self) -> None:
        self._stores: dict[str, _RefStore] = {}

    def open(self, store: str, create: bool = True) -> bool:
        """Reach ``store``; True when this call created it. Attaching never creates one."""
        created = store not in self._stores
        if created:
            if not create:
                raise DataPlaneClosedError(f"data-plane store {store!r} does not exist (closed?)")
            self._stores[store] = _RefStore()
        return created

    def call(self, store: str, method: str, kwargs: dict) -> Any:
        if method not in _ACTOR_METHODS:
            raise AttributeError(f"the data-plane store actor does not run {method!r}")
        target = self._stores.get(store)
        if target is None:
            raise DataPlaneClosedError(f"data-plane store {store!r} is closed")
        return getattr(target, method)(**kwargs)

    def drop(self, store: str) -> None:
        target = self._stores.pop(store, None)
        if target is not None:
            target.close()


class RayDataPlane:
    """A ``DataPlaneClient`` whose store lives in a named Ray actor, shared across processes.

    ``RayDataPlane(store="exp1")`` in any process of the same Ray cluster and namespace reaches
    the same rows. The client that creates a store owns it: its ``close()`` drops the store;
    an attached client's ``close()`` only detaches. Calls are synchronous: a put has landed
    when ``put_samples`` returns. An error raised in the actor comes back as its own type
    (Ray's error class subclasses it), message included.

    When Ray is not running in this process it is started on loopback (``127.0.0.1``) with
    token authentication, or attached to the cluster at ``address``; ``ray_init`` adds
    ``ray.init`` options, e.g. ``{"num_cpus": 2}``. A cluster that answers callers without
    the token is refused unless ``allow_unauthenticated`` (``start_ray_on_loopback``). A pickled client (a Ray task argument, a DDP rank) re-attaches to the
    same store by name.
    """

    shared = True  # rows are visible to every process of the Ray cluster
    checks_token_alignment = True  # the actor's store checks per-token rows inside each put
    supports_put_mode = True  # keywords reach the actor's store as they are

    def __init__(
        self,
        store: str = "default",
        *,
        actor_name: str = DEFAULT_ACTOR_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        address: str | None = None,
        ray_init: Mapping[str, Any] | None = None,
        op_timeout_s: float = 300.0,
        allow_unauthenticated: bool = False,
        _create: bool = True,
    ) -> None:
        ray = _ray()
        self.op_timeout_s = float(op_timeout_s)
        self.allow_unauthenticated = bool(allow_unauthenticated)
        start_ray_on_loopback(address, namespace, ray_init,
                              allow_unauthenticated=self.allow_unauthenticated)
        key = (namespace, actor_name)
        self._actor = _HOSTS.get(key)
        if self._actor is None:
            if _create:
                # num_cpus=0: the store only moves metadata and never takes a CPU slot a worker
                # needs. max_concurrency > 1: a blocking claim_meta must not stall every other
                # call; the store itself is thread-safe.
                self._actor = (
                    ray.remote(_StoreHost)
                    .options(name=actor_name, namespace=namespace, num_cpus=0, max_concurrency=16,
                             get_if_exists=True)
                    .remote()
                )
            else:
                self._actor = ray.get_actor(actor_name, namespace=namespace)
            # A named, non-detached actor lives as long as the job that created it; this
            # process keeps a handle so the lookup happens once.
            _HOSTS[key] = self._actor
        self.store = store
        self.actor_name = actor_name
        self.namespace = namespace
        self._owner = bool(ray.get(self._actor.open.remote(store, create=_create),
                                   timeout=self.op_timeout_s))
        self._closed = False

    @classmethod
    def start_cluster(cls, *, address: str | None = None, namespace: str = DEFAULT_NAMESPACE,
                      ray_init: Mapping[str, Any] | None = None,
                      allow_unauthenticated: bool = False, **_store_options: Any) -> str:
        """Start Ray as a client built from these options would (or attach where ``address``
        names a cluster) and return the GCS address other processes attach with
        (``address=...``): how the DDP ranks of one run reach one store. The store options
        (``store``, ``actor_name``, ...) are accepted and not needed here."""
        start_ray_on_loopback(address, namespace, ray_init,
                              allow_unauthenticated=allow_unauthenticated)
        return str(_ray().get_runtime_context().gcs_address)

    def _call(self, method: str, *, extra_s: float = 0.0, **kwargs: Any) -> Any:
        """Run ``method`` in the store actor; ``GetTimeoutError`` (a ``TimeoutError``) after
        ``op_timeout_s`` (+ ``extra_s``, a blocking claim's own wait)."""
        if self._closed:
            raise DataPlaneClosedError("RayDataPlane client is closed; create a new client")
        ref = self._actor.call.remote(self.store, method, kwargs)
        return _ray().get(ref, timeout=self.op_timeout_s + extra_s)

    @property
    def is_owner(self) -> bool:
        return self._owner

    def worker_launcher(self, **options: Any) -> Any:
        """Workers sharing this store run as Ray actors of this driver, in the store's
        namespace (``tq_plugin.data_plane.processes.launcher_for``)."""
        from tq_plugin.data_plane.backends.ray_workers import RayActorLauncher

        return RayActorLauncher(**{"namespace": self.namespace, **options})

    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int | None = None,
        consumer_tasks: Sequence[str] | None = None,
        grpo_group_size: int | None = None,
        enums: Mapping[str, Sequence[str]] | None = None,
        *,
        jagged_fields: Sequence[str] | None = None,
    ) -> None:
        self._call(
            "register_partition", partition_id=partition_id, fields=_listed(fields),
            num_samples=num_samples,
            consumer_tasks=None if consumer_tasks is None else list(consumer_tasks),
            grpo_group_size=grpo_group_size, enums=None if enums is None else dict(enums),
            jagged_fields=None if jagged_fields is None else list(jagged_fields),
        )

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> KVBatchMeta:
        """``LocalDataPlane.put_samples`` semantics; ``options`` (e.g. ``mode``) pass through."""
        return self._call(
            "put_samples", sample_ids=_listed(sample_ids), partition_id=partition_id,
            fields=_encode(fields), tags=None if tags is None else [dict(t) for t in tags],
            **options,
        )

    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> TensorDict:
        plan = self._call("locate", sample_ids=_listed(sample_ids), partition_id=partition_id,
                          select_fields=_listed(select_fields))
        fields = plan["fields"]
        blocks = [b for f in fields.values() for b in f[3]]
        arrays = iter(_fetch(blocks, self.op_timeout_s))  # one object-store trip for all fields
        out: dict[str, torch.Tensor] = {}
        for name, (jagged, dtype, shape, held, elements, index, start, length) in fields.items():
            mine = [next(arrays) for _ in held]
            values = _gather(mine, elements, dtype, shape, index, start, length)
            if jagged:
                offsets = np.zeros(length.shape[0] + 1, dtype=np.int64)
                np.cumsum(length, out=offsets[1:])
                out[name] = torch.nested.nested_tensor_from_jagged(values, torch.from_numpy(offsets))
            else:
                out[name] = values
        return TensorDict(out, batch_size=[plan["n"]])

    # Reads a claimed meta's rows through get_samples, exactly as the embedded store does.
    get_data = TaskCursors.get_data

    def get_tags(self, sample_ids: Sequence[str], partition_id: str) -> list[dict[str, Any]]:
        return self._call("get_tags", sample_ids=_listed(sample_ids), partition_id=partition_id)

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        if sample_ids is None and not self._call("list_sample_ids", partition_id=partition_id):
            # The actor's own warning stays in the actor's log; say it where the caller sees it.
            warnings.warn(
                f"clear_samples(None, {partition_id!r}) found nothing to clear",
                RuntimeWarning,
                stacklevel=2,
            )
        self._call("clear_samples", sample_ids=None if sample_ids is None else _listed(sample_ids),
                   partition_id=partition_id)

    def list_sample_ids(self, partition_id: str) -> list[str]:
        return self._call("list_sample_ids", partition_id=partition_id)

    def list_partitions(self) -> list[str]:
        return self._call("list_partitions")

    def claim_meta(self, partition_id: str, task_name: str, required_fields: Sequence[str],
                   batch_size: int, dp_rank: int | None = None, blocking: bool = True,
                   timeout_s: float = 60.0) -> KVBatchMeta:
        return self._call("claim_meta", extra_s=max(0.0, timeout_s) if blocking else 0.0,
                          partition_id=partition_id, task_name=task_name,
                          required_fields=list(required_fields), batch_size=batch_size,
                          dp_rank=dp_rank, blocking=blocking, timeout_s=timeout_s)

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return self._call("check_consumption_status", partition_id=partition_id,
                          task_names=list(task_names))

    def stats(self) -> dict[str, int]:
        return self._call("stats")

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike[str], *,
             metadata: Mapping[str, Any] | None = None) -> None:
        """Checkpoint the shared store to the directory ``path``: ``LocalDataPlane.save``'s
        format and guarantees (safetensors + JSON, no pickle, SHA-256 of every file, atomic
        swap), written by the store actor's process, so ``path`` must be on its node (or on
        storage every node shares). One client saves; the others need not."""
        self._call("save", path=os.path.abspath(path), metadata=dict(metadata or {}))

    def restore(self, path: str | os.PathLike[str]) -> Restored:
        """Put the checkpoint at ``path`` into this store, in the actor: every file's digest is
        checked and every row revalidated before the first write; claims come back too."""
        ids, metadata = self._call("restore", path=os.path.abspath(path))
        return Restored(ids, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike[str], store: str = "default",
             **options: Any) -> RayDataPlane:
        """A new store ``store`` (``options`` as the constructor's) holding the checkpoint at
        ``path``; a truncated or modified checkpoint is refused (``CheckpointError``)."""
        client = cls(store, **options)
        try:
            client.restore(path)
        except BaseException:
            client.close()
            raise
        return client

    def close(self) -> None:
        """Owner: drop the store. Attached client: detach. Idempotent."""
        if self._closed:
            return
        if self._owner:
            _ray().get(self._actor.drop.remote(self.store), timeout=self.op_timeout_s)
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __reduce__(self):
        # Shipped to another process (a Ray worker, a DDP rank, a subprocess): attach there by
        # name, reaching this cluster when that process does not run Ray yet.
        address = _ray().get_runtime_context().gcs_address
        return (_attach, (self.store, self.actor_name, self.namespace, address, self.op_timeout_s,
                          self.allow_unauthenticated))


def _attach(store: str, actor_name: str, namespace: str, address: str | None = None,
            op_timeout_s: float = 300.0, allow_unauthenticated: bool = False) -> RayDataPlane:
    return RayDataPlane(store, actor_name=actor_name, namespace=namespace, address=address,
                        op_timeout_s=op_timeout_s, allow_unauthenticated=allow_unauthenticated,
                        _create=False)

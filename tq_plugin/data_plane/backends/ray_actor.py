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
same conformance suite. ``ray_columns`` holds the bytes (the wire encoding and the columns over
Ray objects); ``ray_cluster`` starts Ray, or attaches to it, with token authentication.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from tq_plugin.data_plane.backends._claims import TaskCursors
from tq_plugin.data_plane.backends.local import LocalDataPlane
from tq_plugin.data_plane.backends.ray_cluster import (
    UnauthenticatedClusterError,
    gcs_address,
    import_ray,
    start_ray_on_loopback,
)
from tq_plugin.data_plane.backends.ray_columns import (
    INLINE_BYTES,
    RefColumn,
    decode_fields,
    dtype_name,
    encode_fields,
    fetch_blocks,
    full_reads,
    gather_blocks,
    stage_block,
    staged_blocks,
)
from tq_plugin.data_plane.backends.ray_sharded import StorageUnits, checked_units, free_released
from tq_plugin.data_plane.calls import uniform_call
from tq_plugin.data_plane.checkpoint import Restored, load_into
from tq_plugin.data_plane.client import DataPlaneClosedError, FieldsLike
from tq_plugin.data_plane.meta import KVBatchMeta

DEFAULT_ACTOR_NAME = "tq_plugin_data_plane"
DEFAULT_NAMESPACE = "tq_plugin"

# The only methods a client may run in the store actor: the protocol, plus ``locate`` (the
# read's first half).
_ACTOR_METHODS = frozenset({
    "register_partition", "put_samples", "locate", "get_tags", "clear_samples",
    "list_sample_ids", "list_partitions", "claim_meta", "check_consumption_status", "stats",
    "save", "restore",
})

_HOSTS: dict[tuple[str, str], Any] = {}


def _listed(values: Any) -> Any:
    """A list of ``values`` to ship; a bare string (or a non-iterable) travels as it is, so the
    store refuses it by name instead of ``list("s1")`` splitting it into ids ``['s', '1']``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        return values
    return list(values)


class _RefStore(LocalDataPlane):
    """``LocalDataPlane``'s schema, validation, claims and bookkeeping, over ``RefColumn``s."""

    @uniform_call
    def put_samples(self, *, partition_id, sample_ids, fields=None, tags=None, **options):  # type: ignore[override]
        # A client's payload comes encoded (``encode_fields``); a checkpoint restored in the actor
        # puts tensors.
        fields = decode_fields(fields) if isinstance(fields, tuple) else fields
        return super().put_samples(sample_ids=sample_ids, partition_id=partition_id,
                                   fields=fields, tags=tags, **options)

    def save(self, path: str, *, metadata: Mapping[str, Any] | None = None) -> None:
        """``LocalDataPlane.save`` (same format and guarantees), over the bytes the blocks hold."""
        with full_reads():
            super().save(path, metadata=metadata)

    def compact_journal(self) -> bool:
        """``LocalDataPlane.compact_journal``: its snapshot reads the bytes the blocks hold."""
        with full_reads():
            return super().compact_journal()

    def restore(self, path: str) -> tuple[list[str], dict[str, Any]]:
        """Put a ``save`` checkpoint into this store (claims included): ``load_into``'s rules."""
        restored = load_into(self, path)
        return restored.partition_ids, restored.metadata

    def _apply(self, part: Any, ids: list[str], prepared: list[Any], *args: Any, **kwargs: Any) -> None:
        # Stage every block first (the only step that can fail for want of memory), and give each
        # field that starts afresh a RefColumn, so the base class never allocates a buffer here.
        staged = {id(p.block): stage_block(p.block) for p in prepared}
        before = dict(part.columns)
        for p in prepared:
            col = part.columns.get(p.name)
            # Only a field without live rows starts afresh (prepare refuses a change of a live
            # one); replacing a live column would drop every acknowledged row of the field.
            fresh = col is None or col.live_rows == 0
            if not p.promote and fresh and (not isinstance(col, RefColumn) or col.spec != p.spec):
                part.columns[p.name] = RefColumn(p.spec)
        try:
            with staged_blocks(staged):
                super()._apply(part, ids, prepared, *args, **kwargs)
        except BaseException:
            part.columns.clear()
            part.columns.update(before)
            raise

    def locate(self, *, partition_id: str, sample_ids: Sequence[str], select_fields: Sequence[str]) -> dict:
        """Validate a read exactly as ``get_samples`` does; answer with where the rows are."""
        ids, names = list(sample_ids), list(select_fields)
        with self._lock:  # one snapshot: a concurrent clear cannot free a block we hand out
            self.get_samples(partition_id=partition_id, sample_ids=ids, select_fields=names)
            part = self._partitions[partition_id]
            slots = np.array([part.slot_of[s] for s in ids], dtype=np.int64)
            plan = {}
            for name in names:
                col = part.columns[name]
                plan[name] = (col.spec.jagged, dtype_name(col.spec.dtype), col.spec.shape,
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

    def open(self, store: str, create: bool = True, journal: Mapping[str, Any] | None = None) -> bool:
        """Reach ``store``; True when this call created it. Attaching never creates one.
        ``journal`` (``journal_dir``, ``journal_sync``): the new store's journal, on this
        actor's node; a store created on an existing journal recovers it first."""
        created = store not in self._stores
        if created:
            if not create:
                raise DataPlaneClosedError(f"data-plane store {store!r} does not exist (closed?)")
            self._stores[store] = _RefStore(**dict(journal or {}))
        return created

    def pid(self) -> int:
        """The actor's process id (tests kill it to show a journaled store survives)."""
        return os.getpid()

    def call(self, store: str, method: str, kwargs: dict) -> Any:
        if method not in _ACTOR_METHODS:
            raise AttributeError(f"the data-plane store actor does not run {method!r}")
        target = self._store(store)
        try:
            return getattr(target, method)(**kwargs)
        finally:
            free_released()  # blocks storage units hold that no row holds any more

    def _store(self, store: str) -> Any:
        target = self._stores.get(store)
        if target is None:
            raise DataPlaneClosedError(f"data-plane store {store!r} is closed")
        return target

    def call_batch(self, calls: list[tuple[str, dict]]) -> list[tuple[bool, Any]]:
        """Puts a storage unit forwards together (``ray_sharded``): each ``(store, kwargs)``
        applied on its own, in order; per put ``(True, receipt)`` or ``(False, its error)``."""
        out: list[tuple[bool, Any]] = []
        try:
            for store, kwargs in calls:
                try:
                    out.append((True, self._store(store).put_samples(**kwargs)))
                except Exception as err:  # noqa: BLE001 - handed back to the put it belongs to
                    out.append((False, err))
        finally:
            free_released()
        return out

    def drop(self, store: str) -> None:
        target = self._stores.pop(store, None)
        if target is not None:
            target.close()
            del target
            free_released()


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

    ``num_storage_units=S > 1`` shards the bytes: the actor keeps the metadata and claims, and
    ``S`` storage-unit actors hold the blocks of the puts hashed to them (``ray_sharded``).
    """

    shared = True  # rows are visible to every process of the Ray cluster
    checks_token_alignment = True  # the actor's store checks per-token rows inside each put
    supports_put_mode = True  # keywords reach the actor's store as they are
    claims_wait_in_store = True  # a blocking claim_meta sleeps in an actor thread, no polling

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
        num_storage_units: int = 1,
        journal_dir: str | os.PathLike[str] | None = None,
        journal_sync: str = "off",
        _create: bool = True,
    ) -> None:
        units = checked_units(num_storage_units)  # before anything starts
        journal = _journal_options(journal_dir, journal_sync, units)
        ray = import_ray()
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
        try:
            self._owner = bool(ray.get(self._actor.open.remote(store, create=_create, journal=journal),
                                       timeout=self.op_timeout_s))
        except ray.exceptions.RayActorError:
            # The store actor died (killed, its node lost). Ray keeps its name bound to the
            # dead actor for as long as this job holds it, so a new store host needs a new
            # actor_name; a journaled store opened there recovers from its journal_dir.
            _HOSTS.pop(key, None)
            raise
        self.num_storage_units = units
        self.storage_units = (StorageUnits(actor_name, namespace, units, create=_create,
                                           op_timeout_s=self.op_timeout_s) if units > 1 else None)
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
        return gcs_address()

    def _call(self, method: str, *, extra_s: float = 0.0, **kwargs: Any) -> Any:
        """Run ``method`` in the store actor; ``GetTimeoutError`` (a ``TimeoutError``) after
        ``op_timeout_s`` (+ ``extra_s``, a blocking claim's own wait)."""
        if self._closed:
            raise DataPlaneClosedError("RayDataPlane client is closed; create a new client")
        ref = self._actor.call.remote(self.store, method, kwargs)
        return import_ray().get(ref, timeout=self.op_timeout_s + extra_s)

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

    @uniform_call
    def put_samples(
        self,
        *,
        partition_id: str,
        sample_ids: Sequence[str],
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> KVBatchMeta:
        """``LocalDataPlane.put_samples`` semantics; ``options`` (e.g. ``mode``) pass through.
        With storage units, a put with blocks for one goes to it (``StorageUnits.put``)."""
        kwargs = dict(sample_ids=_listed(sample_ids), partition_id=partition_id,
                      fields=encode_fields(fields),
                      tags=None if tags is None else [dict(t) for t in tags], **options)
        if self.storage_units is not None:
            if self._closed:
                raise DataPlaneClosedError("RayDataPlane client is closed; create a new client")
            routed, receipt = self.storage_units.put(self.store, kwargs)
            if routed:
                return receipt
        return self._call("put_samples", **kwargs)

    @uniform_call
    def get_samples(
        self, *, partition_id: str, sample_ids: Sequence[str], select_fields: Sequence[str]
    ) -> TensorDict:
        plan = self._call("locate", sample_ids=_listed(sample_ids), partition_id=partition_id,
                          select_fields=_listed(select_fields))
        fields = plan["fields"]
        blocks = [b for f in fields.values() for b in f[3]]
        arrays = iter(fetch_blocks(blocks, self.op_timeout_s))  # one object-store trip for all fields
        out: dict[str, torch.Tensor] = {}
        for name, (jagged, dtype, shape, held, elements, index, start, length) in fields.items():
            mine = [next(arrays) for _ in held]
            values = gather_blocks(mine, elements, dtype, shape, index, start, length)
            if jagged:
                offsets = np.zeros(length.shape[0] + 1, dtype=np.int64)
                np.cumsum(length, out=offsets[1:])
                out[name] = torch.nested.nested_tensor_from_jagged(values, torch.from_numpy(offsets))
            else:
                out[name] = values
        return TensorDict(out, batch_size=[plan["n"]])

    # Reads a claimed meta's rows through get_samples, exactly as the embedded store does.
    get_data = TaskCursors.get_data

    @uniform_call
    def get_tags(self, *, partition_id: str, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        return self._call("get_tags", sample_ids=_listed(sample_ids), partition_id=partition_id)

    @uniform_call
    def clear_samples(self, *, partition_id: str, sample_ids: Sequence[str] | None = None) -> None:
        if sample_ids is None and not self._call("list_sample_ids", partition_id=partition_id):
            # The actor's own warning stays in the actor's log; say it where the caller sees it.
            warnings.warn(
                f"clear_samples(partition_id={partition_id!r}) found nothing to clear",
                RuntimeWarning,
                stacklevel=3,  # the caller of uniform_call's wrapper
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
            import_ray().get(self._actor.drop.remote(self.store), timeout=self.op_timeout_s)
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __reduce__(self):
        # Shipped to another process (a Ray worker, a DDP rank, a subprocess): attach there by
        # name, reaching this cluster when that process does not run Ray yet.
        address = gcs_address()
        return (_attach, (self.store, self.actor_name, self.namespace, address, self.op_timeout_s,
                          self.allow_unauthenticated, self.num_storage_units))


def _journal_options(journal_dir: Any, journal_sync: str, units: int) -> dict[str, Any] | None:
    """The store actor's journal options, checked here (before anything starts)."""
    if journal_dir is None:
        return None
    if journal_sync not in ("off", "batch", "always"):
        raise ValueError("RayDataPlane: journal_sync must be one of ('off', 'batch', 'always'), "
                         f"got {journal_sync!r}")
    if units > 1:
        raise ValueError("RayDataPlane: journal_dir needs num_storage_units=1 (the storage units "
                         "hold the bytes of a sharded store; the journal is not written there yet)")
    # the actor runs elsewhere, in its own working directory: an absolute path
    return {"journal_dir": os.path.abspath(journal_dir), "journal_sync": journal_sync}


def _attach(store: str, actor_name: str, namespace: str, address: str | None = None,
            op_timeout_s: float = 300.0, allow_unauthenticated: bool = False,
            num_storage_units: int = 1) -> RayDataPlane:
    return RayDataPlane(store, actor_name=actor_name, namespace=namespace, address=address,
                        op_timeout_s=op_timeout_s, allow_unauthenticated=allow_unauthenticated,
                        num_storage_units=num_storage_units, _create=False)


__all__ = ["INLINE_BYTES", "RayDataPlane", "UnauthenticatedClusterError", "start_ray_on_loopback"]

"""``TransferQueueDataPlane``: the data-plane protocol over TransferQueue 0.1.11 (``tq_plugin[tq]``).

``transfer_queue`` is imported only when a client is built (``transferqueue_service``), so the
base install never needs Ray. A client starts TransferQueue on Ray (Ray itself on loopback,
127.0.0.1, with token authentication, unless ``address`` names a cluster) or attaches to the one
already running, and translates the protocol to TransferQueue's key-value calls.

TransferQueue is lax where our contract is strict (reference ``transferqueue.md`` §5): it accepts
a dtype change and corrupts later reads, drops missing keys from a read, answers a missing field
with an empty batch, and hands dense fields back jagged. This adapter checks every put against a
per-partition schema *before* anything is written (``LocalDataPlane``'s own rules, so the errors
are the same), turns short reads into ``KeyError``, and densifies what was written dense. The
schema lives in TransferQueue itself, as the tag of one reserved key per partition, so every
process attached to the same TransferQueue enforces the same rules.

Start-up (``transferqueue_service``) never hangs and keeps TransferQueue's unauthenticated
sockets on loopback; Ray's own ports are covered by its token authentication (``ray_cluster``).
Every blocking call runs under a deadline.
"""

from __future__ import annotations

import json
import threading
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from tq_plugin.data_plane.backends._claims import TaskCursors
from tq_plugin.data_plane.backends._columns import ColumnSpec
from tq_plugin.data_plane.backends._validate import (
    checked_tags,
    copy_tag,
    field_items,
    lengths_from,
    name_some,
    prepare,
    str_list,
)
from tq_plugin.data_plane.backends.ray_cluster import gcs_address
from tq_plugin.data_plane.backends.transferqueue_service import (
    ensure_transfer_queue,
    import_transfer_queue,
    shutdown_transfer_queue,
    with_deadline,
)
from tq_plugin.data_plane.calls import uniform_call
from tq_plugin.data_plane.client import DataPlaneClosedError, FieldsLike
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import INPUT_LENGTHS

PUT_MODES = ("upsert", "insert", "update")
# The reserved key holding a partition's schema (in its tag); never a sample id.
SCHEMA_KEY = "__tq_plugin_schema__"
_SEP = "/"  # TransferQueue partition = "<store>/<partition_id>"

class _Spec:
    """What ``prepare`` reads of a live column: its spec (and that it has rows)."""

    live_rows = 1

    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec


class _PartitionView:
    """A partition's schema in the shape ``_validate.prepare`` checks a field against."""

    def __init__(self, partition_id: str, schema: dict[str, Any]) -> None:
        self.partition_id = partition_id
        self.declared = set(schema["declared"])
        self.jagged = set(schema["jagged"])
        self.columns = {name: _Spec(_spec_from(v)) for name, v in schema["fields"].items()}


def _spec_to(spec: ColumnSpec) -> list:
    return [spec.jagged, str(spec.dtype).removeprefix("torch."), list(spec.shape)]


def _spec_from(v: list) -> ColumnSpec:
    return ColumnSpec(bool(v[0]), getattr(torch, v[1]), tuple(v[2]))


def _empty_schema() -> dict[str, Any]:
    return {"declared": [], "jagged": [], "fields": {}}


class TransferQueueDataPlane:
    """A ``DataPlaneClient`` over TransferQueue's key-value API, shared across Ray processes.

    ``store`` namespaces partitions (TransferQueue partition ``"<store>/<partition_id>"``), so
    several clients share one TransferQueue without seeing each other's rows. The client that
    creates a store owns it: its ``close()`` clears the store's partitions; a pickled client
    (a Ray task argument, another process) re-attaches and its ``close()`` only detaches.

    Not supported (TransferQueue has no equivalent): byte accounting (``stats`` reports rows only)
    and per-partition ``num_samples`` limits.
    """

    shared = True  # rows are visible to every process attached to the same TransferQueue
    supports_put_mode = True  # insert / update are checked against the live keys first
    claims_wait_in_store = False  # a blocking claim_meta polls fetch from the client every 10 ms

    def __init__(
        self,
        store: str | None = None,
        *,
        num_storage_units: int = 1,
        init_timeout_s: float = 60.0,
        op_timeout_s: float = 120.0,
        address: str | None = None,
        ray_init: Mapping[str, Any] | None = None,
        allow_non_loopback: bool = False,
        allow_unauthenticated: bool = False,
        _owner: bool = True,
    ) -> None:
        self._start = {"num_storage_units": num_storage_units, "init_timeout_s": init_timeout_s,
                       "address": address, "ray_init": ray_init,
                       "allow_non_loopback": allow_non_loopback,
                       "allow_unauthenticated": allow_unauthenticated}
        self._tq: Any = None
        if _owner:
            self._connect()
        self.store = store or f"tq-{uuid.uuid4().hex[:8]}"
        self.op_timeout_s = float(op_timeout_s)
        self.init_timeout_s = float(init_timeout_s)
        self.allow_non_loopback = allow_non_loopback
        self.allow_unauthenticated = allow_unauthenticated
        self._owner = _owner
        self._closed = False
        self._lock = threading.RLock()  # one schema read-modify-write at a time per client

    @classmethod
    def start_cluster(cls, *, num_storage_units: int = 1, init_timeout_s: float = 60.0,
                      address: str | None = None, ray_init: Mapping[str, Any] | None = None,
                      allow_non_loopback: bool = False, allow_unauthenticated: bool = False,
                      **_store_options: Any) -> str:
        """Start Ray and TransferQueue as a client built from these options would (or attach
        to the running ones) and return the GCS address other processes attach with
        (``address=...``): how the DDP ranks of one run reach one TransferQueue. Starting it
        here, before any rank exists, means no two ranks race to start it."""
        ensure_transfer_queue(num_storage_units=num_storage_units, init_timeout_s=init_timeout_s,
                              address=address, ray_init=ray_init,
                              allow_non_loopback=allow_non_loopback,
                              allow_unauthenticated=allow_unauthenticated)
        return gcs_address()

    # ------------------------------------------------------------------ plumbing
    def _connect(self) -> Any:
        # An unpickled client attaches on first use, not while Ray deserializes a task's
        # arguments (a TransferQueue attach from there never completes).
        if self._tq is None:
            ensure_transfer_queue(**self._start)
            self._tq = import_transfer_queue()
        return self._tq

    def _call(self, name: str, **kwargs: Any) -> Any:
        """``transfer_queue.<name>(**kwargs)`` under the operation deadline."""
        if self._closed:
            raise DataPlaneClosedError("TransferQueueDataPlane client is closed; create a new client")
        return with_deadline(name, self.op_timeout_s, getattr(self._connect(), name), **kwargs)

    def _ccall(self, name: str, **kwargs: Any) -> Any:
        """``transfer_queue.get_client().<name>(**kwargs)`` under the operation deadline."""
        if self._closed:
            raise DataPlaneClosedError("TransferQueueDataPlane client is closed; create a new client")
        return with_deadline(name, self.op_timeout_s, getattr(self._connect().get_client(), name), **kwargs)

    def _pid(self, partition_id: str) -> str:
        if not isinstance(partition_id, str) or not partition_id:
            raise ValueError(f"partition_id must be a non-empty string, got {partition_id!r}")
        return f"{self.store}{_SEP}{partition_id}"

    def _keys(self, partition_id: str) -> dict[str, dict]:
        """Every key of the partition (schema key included) and its tag."""
        listed = self._call("kv_list", partition_id=self._pid(partition_id))
        return dict(listed.get(self._pid(partition_id), {}))

    def _schema(self, partition_id: str) -> dict[str, Any]:
        meta = self._ccall("kv_retrieve_meta", keys=[SCHEMA_KEY],
                           partition_id=self._pid(partition_id), create=False)
        if meta.size == 0:
            raise KeyError(f"unknown partition {partition_id!r}; call register_partition first")
        return json.loads(meta.custom_meta[0]["schema"])

    def _save_schema(self, partition_id: str, schema: dict[str, Any]) -> None:
        self._call("kv_put", key=SCHEMA_KEY, partition_id=self._pid(partition_id), fields=None,
                   tag={"schema": json.dumps(schema)})

    def _holds_rows(self, partition_id: str) -> bool:
        return any(k != SCHEMA_KEY for k in self._keys(partition_id))

    def _existing(self, partition_id: str, ids: list[str]) -> int:
        meta = self._ccall("kv_retrieve_meta", keys=ids, partition_id=self._pid(partition_id),
                           create=False)
        return meta.size

    # ------------------------------------------------------------------ schema
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
        """Declare a partition or widen its schema. ``num_samples``, ``consumer_tasks``,
        ``grpo_group_size`` and ``enums`` are accepted for parity and not enforced (TransferQueue
        tracks consumption per task on its own)."""
        where = "register_partition"
        names = str_list(fields, where, "fields")
        jagged = str_list(jagged_fields or (), where, "jagged_fields")
        with self._lock:
            try:
                schema = self._schema(partition_id)
            except KeyError:
                schema = _empty_schema()
            declared = set(schema["declared"])
            if names:
                declared.update(names, schema["fields"] if not declared else ())
            for what, listed in (("jagged_fields", jagged), ("enums", list(enums or ()))):
                undeclared = [n for n in listed if declared and n not in declared]
                if undeclared:
                    raise ValueError(
                        f"{where}: {what} {name_some(undeclared)} are not among the declared "
                        f"fields of partition {partition_id!r}"
                    )
            for name in jagged:
                held = schema["fields"].get(name)
                if held is not None and not held[0]:
                    raise TypeError(
                        f"{where}: field {name!r} already holds dense rows; "
                        "it cannot be re-declared jagged while they are live"
                    )
            schema["declared"] = sorted(declared)
            schema["jagged"] = sorted(set(schema["jagged"]) | set(jagged))
            self._save_schema(partition_id, schema)

    # ------------------------------------------------------------------ writes
    @uniform_call
    def put_samples(
        self,
        *,
        partition_id: str,
        sample_ids: Sequence[str],
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        mode: str = "upsert",
    ) -> KVBatchMeta:
        """``LocalDataPlane.put_samples`` semantics; every check runs before anything is written."""
        where = "put_samples"
        ids = str_list(sample_ids, where, "sample_ids")
        if mode not in PUT_MODES:
            raise ValueError(f"{where}: mode must be one of {PUT_MODES}, got {mode!r}")
        if SCHEMA_KEY in ids:
            raise ValueError(f"{where}: {SCHEMA_KEY!r} is reserved")
        n = len(ids)
        tag_rows = checked_tags(tags, n, where)
        items = field_items(fields, n)
        with self._lock:
            schema = self._schema(partition_id)
            try:
                prepared = [prepare(_PartitionView(partition_id, schema), name, value, n)
                            for name, value in items]
            except (TypeError, ValueError):
                # Once a partition holds no rows its fields may change dtype or shape again.
                # Decided here, not by the clear that emptied it: a clear in another process
                # cannot tell a put that is landing rows right now from none.
                if not schema["fields"] or self._holds_rows(partition_id):
                    raise
                schema["fields"] = {}
                prepared = [prepare(_PartitionView(partition_id, schema), name, value, n)
                            for name, value in items]
            if n and mode != "upsert":
                self._check_mode(partition_id, ids, mode)
            payload: dict[str, torch.Tensor] = {}
            changed = False
            for p in prepared:
                if schema["fields"].get(p.name) != _spec_to(p.spec):
                    schema["fields"][p.name] = _spec_to(p.spec)
                    changed = True
                if p.spec.jagged:
                    lengths = torch.from_numpy(np.ascontiguousarray(p.lengths))
                    offsets = torch.zeros(n + 1, dtype=torch.int64)
                    torch.cumsum(lengths, 0, out=offsets[1:])
                    block = p.block.reshape(-1, *p.spec.shape)
                    payload[p.name] = torch.nested.nested_tensor_from_jagged(block, offsets)
                else:
                    payload[p.name] = p.block
            if n:
                if changed:
                    self._save_schema(partition_id, schema)
                pid = self._pid(partition_id)
                if payload and tag_rows is not None:
                    # TransferQueue 0.1.11 marks the fields ready before it sets the tags, so a
                    # claim in between would hand out rows without their tags: tags go first.
                    self._call("kv_batch_put", keys=ids, partition_id=pid, fields=None,
                               tags=tag_rows)
                self._call("kv_batch_put", keys=ids, partition_id=pid,
                           fields=TensorDict(payload, batch_size=[n]) if payload else None,
                           tags=tag_rows)
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=None,
            sample_ids=ids,
            fields=[name for name, _ in items] or None,
            sequence_lengths=lengths_from(items),
            tags=None if tag_rows is None else [copy_tag(t) for t in tag_rows],
        )

    def _check_mode(self, partition_id: str, ids: list[str], mode: str) -> None:
        held = self._existing(partition_id, ids)
        if mode == "insert" and held:
            keys = self._keys(partition_id)
            present = [s for s in ids if s in keys]
            raise ValueError(
                f"put_samples(mode='insert'): {len(present)} sample_ids already exist in "
                f"partition {partition_id!r}: {name_some(present)}"
            )
        if mode == "update" and held != len(ids):
            keys = self._keys(partition_id)
            new = [s for s in ids if s not in keys]
            raise KeyError(
                f"put_samples(mode='update'): {len(new)} sample_ids were never written to "
                f"partition {partition_id!r}: {name_some(new)}"
            )

    # ------------------------------------------------------------------ reads
    @uniform_call
    def get_samples(
        self, *, partition_id: str, sample_ids: Sequence[str], select_fields: Sequence[str]
    ) -> TensorDict:
        """Exactly the requested rows in request order, or ``KeyError`` (never a short read)."""
        ids = str_list(sample_ids, "get_samples", "sample_ids")
        names = str_list(select_fields, "get_samples", "select_fields")
        if not names:
            raise ValueError("get_samples: select_fields must name at least one field")
        schema = self._schema(partition_id)
        never = [name for name in names if name not in schema["fields"]]
        if never:
            raise KeyError(
                f"get_samples: field {never[0]!r} was never written to partition {partition_id!r}"
            )
        if not ids:
            return TensorDict({}, batch_size=[0])
        try:
            td = self._call("kv_batch_get", keys=ids,
                            partition_id=self._pid(partition_id), select_fields=names)
        except ValueError:  # TransferQueue: "keys or partition were not found!"
            td = None
        if td is None or td.batch_size[0] != len(ids) or any(name not in td for name in names):
            self._raise_short_read(partition_id, ids, names)
        out = {}
        for name in names:
            spec = _spec_from(schema["fields"][name])
            out[name] = _as_written(name, td[name], spec, len(ids))
        return TensorDict(out, batch_size=[len(ids)])

    def _raise_short_read(self, partition_id: str, ids: list[str], names: list[str]) -> None:
        keys = self._keys(partition_id)
        missing = [s for s in ids if s not in keys]
        if missing:
            raise KeyError(
                f"get_samples: {len(missing)} unknown sample_ids in partition "
                f"{partition_id!r}: {name_some(missing)}"
            )
        for name in names:  # the error path only: one lookup per requested row
            lacking = [s for s in ids if name not in self._ccall(
                "kv_retrieve_meta", keys=[s], partition_id=self._pid(partition_id),
                create=False).field_names]
            if lacking:
                raise KeyError(
                    f"get_samples: field {name!r} not written for {len(lacking)} requested "
                    f"rows of partition {partition_id!r}: {name_some(lacking)}"
                )
        raise KeyError(f"get_samples: TransferQueue returned a short read for {partition_id!r}")

    get_data = TaskCursors.get_data

    @uniform_call
    def get_tags(self, *, partition_id: str, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        ids = str_list(sample_ids, "get_tags", "sample_ids", unique=False)
        keys = self._keys(partition_id)
        missing = [s for s in ids if s not in keys or s == SCHEMA_KEY]
        if missing:
            raise KeyError(f"get_tags: unknown sample_ids {name_some(missing)}")
        return [copy_tag(keys[s] or {}) for s in ids]

    def list_sample_ids(self, partition_id: str) -> list[str]:
        return sorted(k for k in self._keys(partition_id) if k != SCHEMA_KEY)

    def list_partitions(self) -> list[str]:
        listed = self._call("kv_list", partition_id=None)
        prefix = f"{self.store}{_SEP}"
        return sorted(p[len(prefix):] for p, keys in listed.items()
                      if p.startswith(prefix) and SCHEMA_KEY in keys)

    # ------------------------------------------------------------------ clears
    @uniform_call
    def clear_samples(self, *, partition_id: str, sample_ids: Sequence[str] | None = None) -> None:
        """Drop rows (unknown ids are ignored). ``None`` drops the whole partition, schema too.

        Once a partition holds no rows its fields may change dtype or shape again.
        """
        with self._lock:
            keys = self._keys(partition_id)
            if sample_ids is None:
                if len(keys) <= (SCHEMA_KEY in keys):
                    warnings.warn(
                        f"clear_samples(partition_id={partition_id!r}) found nothing to clear",
                        RuntimeWarning,
                        stacklevel=3,  # the caller of uniform_call's wrapper
                    )
                drop = list(keys)
            else:
                ids = str_list(sample_ids, "clear_samples", "sample_ids", unique=False)
                drop = [s for s in dict.fromkeys(ids) if s in keys and s != SCHEMA_KEY]
            if drop:
                self._call("kv_clear", keys=drop, partition_id=self._pid(partition_id))

    # ------------------------------------------------------------------ claims
    def claim_meta(self, partition_id: str, task_name: str, required_fields: Sequence[str],
                   batch_size: int, dp_rank: int | None = None, blocking: bool = True,
                   timeout_s: float = 60.0) -> KVBatchMeta:
        """TransferQueue's ``fetch``: exactly ``batch_size`` rows whose fields are all written,
        never handed to ``task_name`` twice. Polls until ``timeout_s`` (``TimeoutError``);
        non-blocking returns an empty meta when fewer rows are ready."""
        import time

        if batch_size < 1:
            raise ValueError(f"claim_meta: batch_size must be >= 1, got {batch_size}")
        required = str_list(required_fields, "claim_meta", "required_fields")
        if not required:  # TransferQueue would hand out the schema key as a row
            raise ValueError("claim_meta: TransferQueue claims need at least one required field")
        self._schema(partition_id)
        deadline = time.monotonic() + max(0.0, timeout_s)
        sampling = None if dp_rank is None else {"dp_rank": dp_rank}
        while True:
            meta = self._ccall("get_meta", data_fields=required, batch_size=batch_size,
                              partition_id=self._pid(partition_id), mode="fetch",
                              task_name=task_name, sampling_config=sampling)
            if meta.size or not blocking:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"claim_meta: no {batch_size} rows with fields {required} became ready for "
                    f"task {task_name!r} within {timeout_s}s"
                )
            time.sleep(0.01)
        if not meta.size:
            return KVBatchMeta(partition_id=partition_id, task_name=task_name, sample_ids=[],
                               fields=required, tags=[])
        keys = self._ccall("kv_retrieve_keys", global_indexes=list(meta.global_indexes),
                           partition_id=self._pid(partition_id))
        keys = list(keys)
        tags = [dict(t or {}) for t in (meta.custom_meta or [{}] * meta.size)]
        lengths = None
        spec = self._schema(partition_id)["fields"].get(INPUT_LENGTHS)
        if spec is not None and not spec[0] and spec[2] == []:  # a dense scalar column
            try:
                column = self.get_samples(
                    partition_id=partition_id, sample_ids=keys, select_fields=[INPUT_LENGTHS]
                )[INPUT_LENGTHS]
                lengths = [int(x) for x in column.tolist()]
            except KeyError:  # not written for every claimed row
                lengths = None
        return KVBatchMeta(partition_id=partition_id, task_name=task_name, sample_ids=keys,
                           fields=required, tags=tags, sequence_lengths=lengths)

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        """True iff every listed task has claimed every row (the schema key is no row)."""
        pid = self._pid(partition_id)
        schema = self._ccall("kv_retrieve_meta", keys=[SCHEMA_KEY],
                            partition_id=pid, create=False)
        for task in task_names:
            index, status = self._ccall("get_consumption_status", task_name=task, partition_id=pid)
            if index is None or status is None:
                return False
            rows = ~torch.isin(torch.as_tensor(index), torch.as_tensor(list(schema.global_indexes)))
            if not bool(torch.as_tensor(status)[rows].bool().all()):
                return False
        return True

    def stats(self) -> dict[str, int]:
        """Rows and partitions of this store (TransferQueue reports no byte accounting)."""
        listed = self._call("kv_list", partition_id=None)
        prefix = f"{self.store}{_SEP}"
        mine = [keys for p, keys in listed.items() if p.startswith(prefix)]
        return {"partitions": len(mine), "rows": sum(len(k) - (SCHEMA_KEY in k) for k in mine)}

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Owner: clear the store's partitions. Attached client: detach. Idempotent."""
        if self._closed:
            return
        if self._owner:
            for partition in self.list_partitions():
                keys = self._keys(partition)
                if keys:
                    self._call("kv_clear", keys=list(keys),
                               partition_id=self._pid(partition))
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_owner(self) -> bool:
        return self._owner

    def worker_launcher(self, **options: Any) -> Any:
        """Workers sharing this store run as Ray actors of this driver
        (``tq_plugin.data_plane.processes.launcher_for``)."""
        from tq_plugin.data_plane.backends.ray_workers import RayActorLauncher

        return RayActorLauncher(**options)

    def __reduce__(self):
        address = gcs_address()
        return (_attach, (self.store, address, self.init_timeout_s, self.op_timeout_s,
                          self.allow_non_loopback, self.allow_unauthenticated))


def _attach(store: str, address: str, init_timeout_s: float, op_timeout_s: float,
            allow_non_loopback: bool, allow_unauthenticated: bool = False) -> TransferQueueDataPlane:
    return TransferQueueDataPlane(store, address=address, init_timeout_s=init_timeout_s,
                                  op_timeout_s=op_timeout_s, allow_non_loopback=allow_non_loopback,
                                  allow_unauthenticated=allow_unauthenticated, _owner=False)


def _as_written(name: str, value: torch.Tensor, spec: ColumnSpec, n: int) -> torch.Tensor:
    """A field as it was written: dense fields dense (TransferQueue returns them jagged)."""
    if value.dtype != spec.dtype:
        raise TypeError(f"get_samples: field {name!r} came back {value.dtype}, written {spec.dtype}")
    if spec.jagged:
        if value.is_nested and value.layout == torch.jagged:
            return value
        rows = value.unbind() if value.is_nested else list(value)
        return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)
    if not value.is_nested:
        return value.reshape(n, *spec.shape)
    if value.layout == torch.jagged:
        return value.values().reshape(n, *spec.shape)
    return torch.stack(value.unbind()).reshape(n, *spec.shape)


# The service functions stay reachable here, beside the client that starts the service.
__all__ = ["TransferQueueDataPlane", "ensure_transfer_queue", "shutdown_transfer_queue"]

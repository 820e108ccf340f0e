"""``RayDataPlane``: the embedded columnar store inside a named Ray actor, shared by processes.

Pick it when more than one process must read and write the same rows (rollout workers and
trainer ranks on one or more nodes) and TransferQueue is more than you need. Every client that
names the same actor sees one store; the contract is ``LocalDataPlane``'s, checked by the same
conformance suite. This is the only module besides a TransferQueue adapter that imports Ray.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from tq_plugin.data_plane.backends.local import LocalDataPlane
from tq_plugin.data_plane.client import DataPlaneClosedError, FieldsLike
from tq_plugin.data_plane.meta import KVBatchMeta

DEFAULT_ACTOR_NAME = "tq_plugin_data_plane"
DEFAULT_NAMESPACE = "tq_plugin"


_HOSTS: dict[tuple[str, str], Any] = {}


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "RayDataPlane needs Ray: pip install 'tq_plugin[ray]'; or use LocalDataPlane"
        ) from e
    return ray


class _StoreHost:
    """The actor body: one process hosting named ``LocalDataPlane`` stores.

    Creating a store is a dict insert, not a process start (a fresh Ray worker pays the torch
    import, seconds), so short-lived stores (one per experiment, per test) stay cheap.
    """

    def __init__(self) -> None:
        self._stores: dict[str, LocalDataPlane] = {}

    def open(self, store: str) -> bool:
        created = store not in self._stores
        if created:
            self._stores[store] = LocalDataPlane()
        return created

    def call(self, store: str, method: str, args: tuple, kwargs: dict) -> Any:
        target = self._stores.get(store)
        if target is None:
            raise DataPlaneClosedError(f"data-plane store {store!r} is closed")
        return getattr(target, method)(*args, **kwargs)

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

    ``ray_init`` is passed to ``ray.init`` when Ray is not running yet, e.g.
    ``{"num_cpus": 2, "_node_ip_address": "127.0.0.2", "include_dashboard": False}``.
    """

    def __init__(
        self,
        store: str = "default",
        *,
        actor_name: str = DEFAULT_ACTOR_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        ray_init: Mapping[str, Any] | None = None,
    ) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(namespace=namespace, **dict(ray_init or {}))
        # num_cpus=0: the store only moves bytes and never takes a CPU slot a worker needs.
        # max_concurrency > 1: a blocking claim_meta must not stall every other call; the
        # store itself is thread-safe.
        key = (namespace, actor_name)
        self._actor = _HOSTS.get(key)
        if self._actor is None:
            self._actor = (
                ray.remote(_StoreHost)
                .options(name=actor_name, namespace=namespace, num_cpus=0, max_concurrency=16,
                         get_if_exists=True)
                .remote()
            )
            # A named, non-detached actor dies with its last handle; this process keeps one,
            # so the stores live as long as the process that first reached them.
            _HOSTS[key] = self._actor
        self.store = store
        self.actor_name = actor_name
        self.namespace = namespace
        self._owner = bool(ray.get(self._actor.open.remote(store)))
        self._closed = False

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise DataPlaneClosedError("RayDataPlane client is closed; create a new client")
        return _ray().get(self._actor.call.remote(self.store, method, args, kwargs))

    @property
    def is_owner(self) -> bool:
        return self._owner

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
            "register_partition", partition_id, list(fields), num_samples,
            None if consumer_tasks is None else list(consumer_tasks), grpo_group_size,
            None if enums is None else dict(enums),
            jagged_fields=None if jagged_fields is None else list(jagged_fields),
        )

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return self._call(
            "put_samples", list(sample_ids), partition_id, fields,
            None if tags is None else [dict(t) for t in tags],
        )

    def get_samples(self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]):
        return self._call("get_samples", list(sample_ids), partition_id, list(select_fields))

    def get_tags(self, sample_ids: Sequence[str], partition_id: str) -> list[dict[str, Any]]:
        return self._call("get_tags", list(sample_ids), partition_id)

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        if sample_ids is None and not self._call("list_sample_ids", partition_id):
            # The actor's own warning stays in the actor's log; say it where the caller sees it.
            warnings.warn(
                f"clear_samples(None, {partition_id!r}) found nothing to clear",
                RuntimeWarning,
                stacklevel=2,
            )
        self._call("clear_samples", None if sample_ids is None else list(sample_ids), partition_id)

    def list_sample_ids(self, partition_id: str) -> list[str]:
        return self._call("list_sample_ids", partition_id)

    def list_partitions(self) -> list[str]:
        return self._call("list_partitions")

    def claim_meta(self, partition_id: str, task_name: str, required_fields: Sequence[str],
                   batch_size: int, dp_rank: int | None = None, blocking: bool = True,
                   timeout_s: float = 60.0) -> KVBatchMeta:
        return self._call("claim_meta", partition_id, task_name, list(required_fields),
                          batch_size, dp_rank, blocking, timeout_s)

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None):
        return self._call("get_data", meta, None if select_fields is None else list(select_fields))

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return self._call("check_consumption_status", partition_id, list(task_names))

    def stats(self) -> dict[str, int]:
        return self._call("stats")

    def close(self) -> None:
        """Owner: drop the store. Attached client: detach. Idempotent."""
        if self._closed:
            return
        if self._owner:
            _ray().get(self._actor.drop.remote(self.store))
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __reduce__(self):
        # Shipped to another process (a Ray worker, a DDP rank): attach there by name.
        return (_attach, (self.store, self.actor_name, self.namespace))


def _attach(store: str, actor_name: str, namespace: str) -> RayDataPlane:
    return RayDataPlane(store, actor_name=actor_name, namespace=namespace)

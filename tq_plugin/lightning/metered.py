"""``MeteredClient``: counts what crosses the data-plane boundary (bytes, rows, calls, time).

A thin wrapper in front of any ``DataPlaneClient`` (local object or Ray actor handle, reached
through ``call_dp``). The counters only ever grow; a reader takes deltas between two
``snapshot()`` calls, which is how the callback logs per-step figures.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tensordict import TensorDictBase

from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.column_io import payload_bytes
from tq_plugin.data_plane.meta import KVBatchMeta


@dataclass
class DataPlaneCounters:
    bytes_read: int = 0
    bytes_written: int = 0
    rows_read: int = 0
    rows_written: int = 0
    rows_cleared: int = 0
    calls: int = 0
    seconds: float = 0.0

    def minus(self, other: DataPlaneCounters) -> DataPlaneCounters:
        return DataPlaneCounters(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


class MeteredClient:
    """A ``DataPlaneClient`` that forwards every call and meters it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counters = DataPlaneCounters()

    def snapshot(self) -> DataPlaneCounters:
        return DataPlaneCounters(**asdict(self.counters))

    def _timed(self, method: str, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call_dp(self.inner, method, **kwargs)
        finally:
            self.counters.calls += 1
            self.counters.seconds += time.perf_counter() - start

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
        self._timed(
            "register_partition",
            partition_id=partition_id,
            fields=fields,
            num_samples=num_samples,
            consumer_tasks=consumer_tasks,
            grpo_group_size=grpo_group_size,
            enums=enums,
            jagged_fields=jagged_fields,
        )

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Any = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        meta = self._timed(
            "put_samples", sample_ids=sample_ids, partition_id=partition_id, fields=fields, tags=tags
        )
        self.counters.rows_written += len(sample_ids)
        self.counters.bytes_written += payload_bytes(fields)
        return meta

    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> TensorDictBase:
        td = self._timed(
            "get_samples",
            sample_ids=sample_ids,
            partition_id=partition_id,
            select_fields=select_fields,
        )
        self.counters.rows_read += len(sample_ids)
        self.counters.bytes_read += payload_bytes(td)
        return td

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        self._timed("clear_samples", sample_ids=sample_ids, partition_id=partition_id)
        if sample_ids is not None:
            self.counters.rows_cleared += len(sample_ids)

    def list_sample_ids(self, partition_id: str) -> list[str]:
        return self._timed("list_sample_ids", partition_id=partition_id)

    def close(self) -> None:
        call_dp(self.inner, "close")

    def __getattr__(self, name: str) -> Any:
        # Backend extras (get_tags, stats, ...) pass through unmetered.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

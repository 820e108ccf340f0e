"""``MeteredClient``: counts what crosses the data-plane boundary (bytes, rows, calls, time).

A thin wrapper in front of any ``DataPlaneClient`` (local object or Ray actor handle, reached
through ``call_dp``). It forwards every protocol method (``CLIENT_METHODS``), claims included, by
keyword; nothing re-spells the protocol. The counters only ever grow; a reader takes deltas
between two ``snapshot()`` calls, which is how the callback logs per-step figures.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from tq_plugin.data_plane.client import CLIENT_METHODS, bind_keywords, call_dp
from tq_plugin.data_plane.jagged import payload_bytes


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
    """A ``DataPlaneClient`` that forwards every protocol call and meters it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counters = DataPlaneCounters()

    def snapshot(self) -> DataPlaneCounters:
        return DataPlaneCounters(**asdict(self.counters))

    def _call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        kw = bind_keywords(method, args, kwargs, stacklevel=3)  # warns at the wrapper's caller
        if method == "close":
            return call_dp(self.inner, "close")
        start = time.perf_counter()
        try:
            out = call_dp(self.inner, method, **kw)
        finally:
            self.counters.calls += 1
            self.counters.seconds += time.perf_counter() - start
        c = self.counters
        if method == "put_samples":
            c.rows_written += len(kw["sample_ids"])
            c.bytes_written += payload_bytes(kw.get("fields"))
        elif method in ("get_samples", "get_data"):
            c.rows_read += int(out.batch_size[0]) if out.batch_size else 0
            c.bytes_read += payload_bytes(out)
        elif method == "clear_samples" and kw.get("sample_ids") is not None:
            c.rows_cleared += len(kw["sample_ids"])
        return out

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        if name in CLIENT_METHODS:
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        # Backend extras (get_tags, stats, shared, ...) pass through unmetered.
        return getattr(inner, name)

"""The sink and source contracts of token staging (runtime-checkable, by method name).

Both are synchronous by design: inference workers call them from synchronous capture
hooks, so an implementation must not hide an asynchronous client behind them.

* ``StagingSink.stage`` is thread-safe (the capture host calls it from several completion
  threads at once), makes the record durable before returning ``ok=True``, stores every
  attachment in the same durable write or rejects the call, and reports failures in the
  result rather than raising.
* ``StagingSource.fetch`` returns exactly one base snapshot per requested key, in request
  order, and raises ``KeyError`` for a missing or unreadable row: never a shorter list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StagingSink(Protocol):
    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any: ...


@runtime_checkable
class StagingSource(Protocol):
    def fetch(self, staging_keys: list[str]) -> list[Any]: ...


@runtime_checkable
class WeightVersionProvider(Protocol):
    def __call__(self) -> int: ...

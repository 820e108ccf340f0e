"""The one interface every data-plane backend implements, and the call helper that reaches it.

Everything above this module talks to a backend only through ``DataPlaneClient`` methods called
with keyword arguments (``call_dp``), so the same code drives an in-process store and a Ray actor
handle. Only an adapter module imports Ray or transferqueue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from tq_plugin.data_plane.meta import KVBatchMeta

# A put's payload: a TensorDict with batch_size [N], or a plain mapping of name -> tensor whose
# dim 0 is N. Each tensor is dense, or a jagged nested tensor (torch.nested, layout=torch.jagged).
FieldsLike = TensorDictBase | Mapping[str, torch.Tensor]


class DataPlaneClosedError(RuntimeError):
    """An operation reached a client after ``close()``."""


@runtime_checkable
class DataPlaneClient(Protocol):
    """Keyed columnar store: one row per sample id, one column per field, per partition.

    Contract shared by every backend (the conformance suite in ``tests/data_plane`` pins it):

    * ``put_samples`` is atomic: every row and every field of the put lands, or none does.
    * ``get_samples`` returns exactly the requested rows, in request order, or raises
      ``KeyError`` naming what is missing: never a short read.
    * A field keeps one dtype and per-row rank while it has live rows.
    * ``clear_samples`` is idempotent; ``close`` is idempotent and ends every other operation.
    """

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
    ) -> None: ...

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta: ...

    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> TensorDictBase: ...

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None: ...

    def list_sample_ids(self, partition_id: str) -> list[str]: ...

    def close(self) -> None: ...


def call_dp(client: Any, method_name: str, **kwargs: Any) -> Any:
    """Call ``client.<method_name>(**kwargs)`` on a local client or a Ray actor handle alike.

    A Ray actor method has ``.remote``; its result is awaited before returning (through the
    object ref's own future, so this module never imports Ray), and callers see the same
    synchronous contract on every backend: an acknowledged put has landed.
    """
    method = getattr(client, method_name)
    remote = getattr(method, "remote", None)
    if remote is not None:
        return remote(**kwargs).future().result()
    return method(**kwargs)

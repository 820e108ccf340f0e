"""The one interface every data-plane backend implements, and the call helper that reaches it.

Everything above this module talks to a backend only through ``DataPlaneClient`` methods called
with keyword arguments (``call_dp``), so the same code drives an in-process store and a Ray actor
handle. Only an adapter module imports Ray or transferqueue.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from tq_plugin.data_plane.calls import OLD_ORDER, as_keywords
from tq_plugin.data_plane.meta import KVBatchMeta

# A put's payload: a TensorDict with batch_size [N], or a plain mapping of name -> tensor whose
# dim 0 is N. Each tensor is dense, or a jagged nested tensor (torch.nested, layout=torch.jagged).
FieldsLike = TensorDictBase | Mapping[str, torch.Tensor]


class DataPlaneClosedError(RuntimeError):
    """An operation reached a client after ``close()``."""


class DataPlaneCorruptionError(RuntimeError):
    """Stored rows were changed outside the store (a read's shared memory modified in place)."""


class CapacityError(RuntimeError):
    """A put would pass the store's capacity (``capacity_bytes``, or a partition's
    ``num_samples``); nothing was written."""


@runtime_checkable
class DataPlaneClient(Protocol):
    """Keyed columnar store: one row per sample id, one column per field, per partition.

    One calling convention (``tq_plugin.data_plane.calls``): the partition first, then the rows,
    then the columns, and the row methods by keyword only::

        client.put_samples(partition_id="p", sample_ids=ids, fields=batch)
        client.get_samples(partition_id="p", sample_ids=ids, select_fields=["input_ids"])
        client.clear_samples(partition_id="p", sample_ids=ids)

    Each backend decorates its row methods with ``calls.uniform_call``: for one release a
    positional call in the old order (``sample_ids, partition_id, ...``) still works and emits
    a ``DeprecationWarning`` naming the keyword call.

    Contract shared by every backend (the conformance suite in ``tests/data_plane`` pins it):

    * ``put_samples`` is atomic: every row and every field of the put lands, or none does.
    * ``get_samples`` returns exactly the requested rows, in request order, or raises
      ``KeyError`` naming what is missing: never a short read.
    * ``put_samples(mode="insert")`` refuses ids already held, ``mode="update"`` ids not held
      (a mistyped id never mints a row); the default ``"upsert"`` does both.
    * A field keeps one dtype, per-row rank and trailing dims while it has live rows; rows whose
      first dim differs turn a dense column jagged, losslessly.
    * ``clear_samples`` is idempotent; ``close`` is idempotent and ends every other operation.

    Optional class attributes say what a backend does beyond the contract (absent: ``False``):
    ``shared`` (rows visible to other processes), ``supports_put_mode`` (``accepts_put_mode``),
    ``checks_token_alignment`` (per-token rows checked inside each put) and
    ``claims_wait_in_store`` (a blocking ``claim_meta`` sleeps until a put wakes it, rather than
    polling from the client: a thread may wait in one for as long as it likes, as a rollout
    worker's ``PublishWatch`` does).
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
        *,
        partition_id: str,
        sample_ids: Sequence[str],
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        mode: str = "upsert",
    ) -> KVBatchMeta: ...

    def get_samples(
        self, *, partition_id: str, sample_ids: Sequence[str], select_fields: Sequence[str]
    ) -> TensorDictBase: ...

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta: ...

    def get_data(
        self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None
    ) -> TensorDictBase: ...

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool: ...

    def clear_samples(
        self, *, partition_id: str, sample_ids: Sequence[str] | None = None
    ) -> None: ...

    def list_sample_ids(self, partition_id: str) -> list[str]: ...

    def close(self) -> None: ...


# The protocol's methods, spelled out once: wrappers (metering, fault injection, remote actors)
# derive their forwarding from this table and ``bind_keywords``, never re-spell the signatures.
CLIENT_METHODS = (
    "register_partition",
    "put_samples",
    "get_samples",
    "claim_meta",
    "get_data",
    "check_consumption_status",
    "clear_samples",
    "list_sample_ids",
    "close",
)
_SIGNATURES = {name: inspect.signature(getattr(DataPlaneClient, name)) for name in CLIENT_METHODS}


def bind_keywords(
    method_name: str, args: tuple, kwargs: Mapping[str, Any], *, stacklevel: int = 2
) -> dict[str, Any]:
    """A protocol call's arguments as keywords (positional ones named by the protocol; a row
    method's by its deprecated old order, warning at ``stacklevel`` as ``calls.as_keywords``).

    Raises ``TypeError`` for an unknown method or arguments the protocol does not take.
    """
    sig = _SIGNATURES.get(method_name)
    if sig is None:
        raise TypeError(f"{method_name!r} is not a DataPlaneClient method ({', '.join(CLIENT_METHODS)})")
    if args and method_name in OLD_ORDER:
        kwargs, args = as_keywords(method_name, args, kwargs, stacklevel=stacklevel + 1), ()
    bound = sig.bind(None, *args, **kwargs)
    bound.arguments.pop("self")
    return dict(bound.arguments)


def accepts_put_mode(client: Any) -> bool:
    """Whether ``client.put_samples`` takes ``mode=`` ("insert" / "update" / "upsert").

    The method's signature tells; where it cannot (a wrapper forwarding ``**kwargs``, an actor
    handle), the backend's ``supports_put_mode`` does (the three shipped backends set it, and
    wrappers pass attributes through). A client written to the reference contract has no
    ``mode``: callers then check ids themselves before writing.
    """
    try:
        params = inspect.signature(client.put_samples).parameters
    except (AttributeError, TypeError, ValueError):  # an actor handle, a C callable
        params = None
    if params is not None:
        if "mode" in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False  # a signature that names its keywords, and not this one
    # Forwarding wrappers (``**kwargs``) and actor handles: the backend's own word.
    return bool(getattr(client, "supports_put_mode", False))


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

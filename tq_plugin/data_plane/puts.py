"""How column I/O puts: with ``mode=`` on a store that takes it, with the ids checked against
the partition's listing on a client written to the reference contract; and how a retried
``first_write`` recognizes rows an earlier attempt of the same write left behind."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict

from tq_plugin.data_plane.client import accepts_put_mode, call_dp
from tq_plugin.data_plane.jagged import row_lengths
from tq_plugin.data_plane.schema import DP_TRAIN_FIELDS, TOKEN_ALIGNED_FIELDS


def name_some(items: list[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def as_batch(columns: Mapping[str, torch.Tensor], n: int) -> TensorDict:
    """A put's payload as the contract types it: a ``TensorDict`` of batch ``[n]``."""
    return TensorDict(dict(columns), batch_size=[n])


def put_with_mode(client: Any, put: dict[str, Any], mode: str) -> Any:
    """``put_samples`` with ``mode``; for a client without modes (the reference contract), the
    ids are checked against the partition's listing first ("insert": none may exist, "update":
    all must), then a plain put."""
    if accepts_put_mode(client):
        return call_dp(client, "put_samples", **put, mode=mode)
    if mode != "upsert":
        held = set(call_dp(client, "list_sample_ids", partition_id=put["partition_id"]))
        ids = put["sample_ids"]
        if mode == "insert" and held.intersection(ids):
            clash = [s for s in ids if s in held]
            raise ValueError(
                f"put_samples(mode='insert'): {len(clash)} sample_ids already exist in partition "
                f"{put['partition_id']!r}: {name_some(clash)}"
            )
        if mode == "update" and not held.issuperset(ids):
            unknown = [s for s in ids if s not in held]
            raise KeyError(
                f"put_samples(mode='update'): {len(unknown)} sample_ids were never written to "
                f"partition {put['partition_id']!r}: {name_some(unknown)}"
            )
    return call_dp(client, "put_samples", **put)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal rows (NaN equal to itself), jagged or dense."""
    if a.is_nested != b.is_nested or a.dtype != b.dtype:
        return False
    if a.is_nested:
        if not torch.equal(row_lengths(a).cpu(), row_lengths(b).cpu()):
            return False
        a, b = a.values(), b.values()
    if a.shape != b.shape:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def rows_hold_this_write(
    client: Any, ids: list[str], partition_id: str, columns: Mapping[str, torch.Tensor]
) -> bool:
    """True when the rows ``ids`` already hold some of ``columns``, each exactly as given, and
    nothing that differs: the trace of an earlier attempt of this same write.

    Rows that also hold a training column this write does not carry (``input_ids``, say) were
    written by someone else, however equal the shared columns are: not a retry.
    """
    for name in sorted({*DP_TRAIN_FIELDS, *TOKEN_ALIGNED_FIELDS} - set(columns)):
        try:
            call_dp(client, "get_samples", sample_ids=ids, partition_id=partition_id,
                    select_fields=[name])
        except KeyError:
            continue
        return False
    matched = 0
    for name, value in columns.items():
        try:
            td = call_dp(
                client, "get_samples", sample_ids=ids, partition_id=partition_id, select_fields=[name]
            )
        except KeyError:
            continue  # this field did not land (for some row): the retry writes it
        if name not in td.keys() or not _same_values(td[name], value):  # noqa: SIM118
            return False
        matched += 1
    return matched > 0

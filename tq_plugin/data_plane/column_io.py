"""Column I/O between trainer code and the data plane: first write, write-back, padded reads.

Per-token columns live jagged on the wire (one row of exactly ``input_lengths[i]`` elements), so
padding is paid only when a consumer materializes a read, and always to one pad target per step
(``extra_info[GLOBAL_FORWARD_PAD_SEQLEN]``), so every data-parallel rank sees the same dim 1.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_LENGTHS,
    PAD_TO_MULTIPLE,
    SAMPLE_MASK,
    TOKEN_ALIGNED_FIELDS,
    Layout,
)

# torch 2.13's nested_tensor_from_jagged logs a warning meant for fx/export tracing on its first
# call, outside any tracing. Drop exactly that record; every other torch.fx message still shows.
logging.getLogger("torch.fx._symbolic_trace").addFilter(
    lambda record: "is_fx_tracing will return true" not in record.getMessage()
)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``; ``value`` itself when multiple <= 1."""
    if multiple <= 1:
        return int(value)
    return -(-int(value) // int(multiple)) * int(multiple)


def nested_from_lengths(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A ``torch.jagged`` nested tensor over ``values`` whose row i has ``lengths[i]`` elements."""
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths.to(device=values.device, dtype=torch.int64), 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def jaggedize(name: str, padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Cut each row of a padded ``[N, S, ...]`` column to its own length, in one masked select.

    Trailing padding beyond a row's length is dropped (that is what padding is); a column
    shorter than the longest row would lose real tokens, so it is an error, never a truncation.
    """
    n = lengths.shape[0]
    if padded.dim() < 2 or padded.shape[0] != n:
        raise ValueError(
            f"field {name!r}: a per-token column must be [N={n}, S, ...], got {tuple(padded.shape)}"
        )
    longest = int(lengths.max()) if n else 0
    if padded.shape[1] < longest:
        raise ValueError(
            f"field {name!r}: dim 1 is {padded.shape[1]} but the longest row has {longest} tokens; "
            "refusing to truncate"
        )
    lengths = lengths.to(padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]
    return nested_from_lengths(padded[mask], lengths)


def _row_lengths(nt: torch.Tensor) -> torch.Tensor:
    return nt.offsets().diff() if nt._lengths is None else nt._lengths  # type: ignore[attr-defined]


def payload_bytes(fields: Mapping[str, Any] | TensorDictBase | None) -> int:
    """Bytes of tensor payload in ``fields``: a jagged column counts its values buffer only."""
    if fields is None:
        return 0
    total = 0
    for value in fields.values():
        if isinstance(value, torch.Tensor):
            buf = value._values if value.is_nested else value  # type: ignore[attr-defined]
            total += buf.numel() * buf.element_size()
    return total


def to_wire_columns(
    fields: Mapping[str, Any] | TensorDictBase, lengths: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Validate a write's columns and jaggedize per-token ones to the rows' lengths."""
    items = fields.items()
    out: dict[str, torch.Tensor] = {}
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"field {name!r} is {type(value).__name__}; write tensors "
                "(dense or torch.jagged nested) and put primitives in tags"
            )
        per_token = name in TOKEN_ALIGNED_FIELDS and lengths is not None
        if value.is_nested:
            if per_token and not torch.equal(_row_lengths(value).cpu(), lengths.cpu()):  # type: ignore[union-attr]
                raise ValueError(
                    f"field {name!r}: jagged row lengths differ from the meta's sequence_lengths"
                )
            out[name] = value
        elif per_token and value.dim() >= 2:
            out[name] = jaggedize(name, value, lengths)  # type: ignore[arg-type]
        else:
            out[name] = value
    return out


def first_write(
    batch: Mapping[str, Any] | TensorDictBase,
    *,
    sample_ids: Sequence[str],
    client: Any,
    partition_id: str,
    extra_info: Mapping[str, Any] | None = None,
    task_name: str = "train",
    pad_to_multiple: int = 1,
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> KVBatchMeta:
    """The rollout's one flat put; returns the meta every later step of the iteration uses.

    ``batch[SAMPLE_MASK]`` is the batch-size oracle and ``batch[INPUT_LENGTHS]`` the row lengths;
    per-token columns may come jagged or padded. The keys minted here are the only keys: every
    later write-back lands under them.
    """
    for required in (SAMPLE_MASK, INPUT_LENGTHS):
        if required not in batch.keys():  # noqa: SIM118  (a TensorDict has no `in`)
            raise ValueError(f"first_write: the batch needs a {required!r} column")
    n = int(batch[SAMPLE_MASK].shape[0])
    if n == 0:
        raise ValueError("first_write: the batch is empty")
    if len(sample_ids) != n:
        raise ValueError(f"first_write: {len(sample_ids)} sample_ids for a batch of {n} rows")
    if tags is not None and len(tags) != n:
        raise ValueError(f"first_write: {len(tags)} tags for a batch of {n} rows")
    lengths = batch[INPUT_LENGTHS]
    if lengths.is_nested or lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise ValueError(f"first_write: {INPUT_LENGTHS!r} must be an integer [N] tensor")
    columns = to_wire_columns(batch, lengths.to(torch.int64))
    put_meta = call_dp(
        client,
        "put_samples",
        sample_ids=list(sample_ids),
        partition_id=partition_id,
        fields=columns,
        tags=None if tags is None else [dict(t) for t in tags],
    )
    info = dict(extra_info or {})
    if pad_to_multiple > 1:
        info[PAD_TO_MULTIPLE] = int(pad_to_multiple)
    return KVBatchMeta(
        partition_id=partition_id,
        task_name=task_name,
        sample_ids=list(sample_ids),
        fields=list(columns),
        sequence_lengths=[int(x) for x in lengths.tolist()],
        extra_info=info,
        tags=put_meta.tags,
    )


def write_columns(
    client: Any, meta: KVBatchMeta, fields: Mapping[str, Any] | TensorDictBase
) -> None:
    """Write columns under ``meta``'s keys; per-token columns are cut to the rows' lengths.

    So a padded write-back (``[N, pad_target]`` advantages, say) lands jagged, at the same row
    lengths as the first put, and the next padded read lines up with ``input_ids``.
    """
    if not len(fields.keys()):
        return
    lengths = (
        torch.tensor(meta.sequence_lengths, dtype=torch.int64)
        if meta.sequence_lengths is not None
        else None
    )
    columns = to_wire_columns(fields, lengths)
    call_dp(
        client,
        "put_samples",
        sample_ids=list(meta.sample_ids),
        partition_id=meta.partition_id,
        fields=columns,
    )


def materialize(
    td: TensorDictBase,
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, Any] | None = None,
    pad_to_seqlen: int = 0,
) -> TensorDict:
    """Turn a wire read into trainer tensors.

    ``"jagged"`` returns nested columns untouched. ``"padded"`` pads each jagged column with its
    pad value (default 0), then widens per-token columns (jagged ones, and dense ones named in
    ``TOKEN_ALIGNED_FIELDS``) on dim 1 to ``pad_to_seqlen``. Dense non-token columns (image
    features, per-row scalars) are never widened, and nothing is ever truncated.
    """
    if layout not in ("padded", "jagged"):
        raise ValueError(f"materialize: layout must be 'padded' or 'jagged', got {layout!r}")
    pads = dict(pad_value_dict or {})
    out: dict[str, torch.Tensor] = {}
    for name, value in td.items():
        if layout == "jagged":
            out[name] = value
            continue
        pad = pads.get(name, 0)
        per_token = value.is_nested or name in TOKEN_ALIGNED_FIELDS
        if value.is_nested:
            n = value.size(0)
            longest = int(_row_lengths(value).max()) if n else 0
            width = max(longest, pad_to_seqlen)
            value = torch.nested.to_padded_tensor(
                value, pad, output_size=(n, width, *value.shape[2:])
            )
        elif per_token and value.dim() >= 2 and value.shape[1] < pad_to_seqlen:
            widen = [0, 0] * (value.dim() - 2) + [0, pad_to_seqlen - value.shape[1]]
            value = F.pad(value, widen, value=pad)
        out[name] = value
    return TensorDict(out, batch_size=td.batch_size)


def read_columns(
    client: Any,
    meta: KVBatchMeta,
    select_fields: Sequence[str],
    *,
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, Any] | None = None,
) -> TensorDict:
    """Fetch ``select_fields`` for ``meta``'s rows and materialize them.

    Pads to ``meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]`` when present; it never mints one.
    """
    td = call_dp(
        client,
        "get_samples",
        sample_ids=list(meta.sample_ids),
        partition_id=meta.partition_id,
        select_fields=list(select_fields),
    )
    pad_to = int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0))
    return materialize(td, layout, pad_value_dict, pad_to)


def stamp_global_forward_pad_seqlen(meta: KVBatchMeta, *, sequence_length_round: int = 1) -> None:
    """Raise ``meta``'s pad target to cover its longest row (a ratchet: it never shrinks).

    ``target = round_up(max(sequence_lengths), max(pad_to_multiple, sequence_length_round))``.
    Mint it on the whole step meta before sharding: every shard inherits the same value.
    """
    if not meta.sequence_lengths:
        return
    multiple = max(int(meta.extra_info.get(PAD_TO_MULTIPLE, 1)), int(sequence_length_round))
    target = round_up(max(meta.sequence_lengths), multiple)
    if target > int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0)):
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target

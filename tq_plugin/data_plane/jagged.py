"""Jagged columns: building them from values + lengths, cutting padded columns to their rows,
what they weigh, and a batch of columns as a ``TensorDict`` (``batch_of``). Per-token columns live jagged on the wire (row *i* holds exactly
``input_lengths[i]`` elements); padding is paid only when a reader materializes them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

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
    ``ValueError`` for a shape other than ``[N, S, ...]``, a column narrower than the longest
    row, or a negative length.
    """
    n = lengths.shape[0]
    if padded.dim() < 2 or padded.shape[0] != n:
        raise ValueError(
            f"field {name!r}: a per-token column must be [N={n}, S, ...], got {tuple(padded.shape)}"
        )
    if n and int(lengths.min()) < 0:
        raise ValueError(f"field {name!r}: row lengths must be non-negative")
    longest = int(lengths.max()) if n else 0
    if padded.shape[1] < longest:
        raise ValueError(
            f"field {name!r}: dim 1 is {padded.shape[1]} but the longest row has {longest} tokens; "
            "refusing to truncate"
        )
    lengths = lengths.to(padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]
    return nested_from_lengths(padded[mask], lengths)


def row_lengths(nt: torch.Tensor) -> torch.Tensor:
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


# TensorDict's constructor re-checks every leaf against the batch size (~10 us for 24 fields);
# a batch the store built row by row already holds, so it takes the unchecked constructor.
_unchecked = getattr(TensorDict, "_new_unsafe", None)


def batch_of(columns: dict[str, torch.Tensor], n: int) -> TensorDict:
    """A ``TensorDict`` of batch ``[n]`` over ``columns``, each already ``n`` rows long."""
    if _unchecked is not None:
        return _unchecked(columns, batch_size=torch.Size([n]))
    return TensorDict(columns, batch_size=[n])

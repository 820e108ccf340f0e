"""Microbatch layouts a training step receives: ``padded`` rows or one ``packed`` row.

* ``padded``: every per-token column ``[B, S]`` with ``S`` the step's pad target, so every
  data-parallel rank sees the same dim 1.
* ``packed``: the microbatch's sequences back to back in one row ``[1, T]``, each padded only to
  ``sequence_length_pad_multiple``; ``cu_seqlens`` (int32, ``[B + 1]``) marks the sequence
  boundaries, ``position_ids`` restart at 0 per sequence and ``segment_ids`` name the sequence
  each token belongs to. Per-row columns (``sample_mask``, ``input_lengths``) stay ``[B]``.

Everything is vectorized over the whole microbatch: no per-row Python loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tq_plugin.config.schema import LAYOUTS
from tq_plugin.data_plane.jagged import jaggedize, nested_from_lengths
from tq_plugin.data_plane.padding import materialize
from tq_plugin.data_plane.schema import TOKEN_ALIGNED_FIELDS

__all__ = ["CU_SEQLENS", "LAYOUTS", "PACKED_LAYOUT_FIELDS", "POSITION_IDS", "SEGMENT_IDS",
           "PackedIndex", "packed_batch", "padded_batch"]
CU_SEQLENS = "cu_seqlens"
POSITION_IDS = "position_ids"
SEGMENT_IDS = "segment_ids"
PACKED_LAYOUT_FIELDS = (CU_SEQLENS, POSITION_IDS, SEGMENT_IDS)


def padded_batch(
    td: TensorDictBase,
    *,
    pad_to: int,
    pad_values: Mapping[str, Any] | None = None,
) -> TensorDict:
    """Rows padded on dim 1 to ``pad_to`` (never truncated), batch ``[B]``."""
    return materialize(td, "padded", pad_values, pad_to)


class PackedIndex:
    """Where each token of a packed row comes from: the vectorized map shared by pack/unpack."""

    def __init__(self, lengths: torch.Tensor, pad_multiple: int = 1) -> None:
        self.lengths = lengths.to(torch.int64)
        m = max(int(pad_multiple), 1)
        self.slot_lengths = (self.lengths + (m - 1)) // m * m
        self.cu_seqlens = torch.zeros(self.lengths.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(self.slot_lengths, 0, out=self.cu_seqlens[1:])
        self.total = int(self.cu_seqlens[-1])
        self.segment_ids = torch.repeat_interleave(
            torch.arange(self.lengths.shape[0]), self.slot_lengths, output_size=self.total
        )
        self.position_ids = torch.arange(self.total) - self.cu_seqlens[:-1][self.segment_ids]
        self.real = self.position_ids < self.lengths[self.segment_ids]
        self.dense = m == 1  # no slot padding: the packed row is the jagged values buffer

    def pack(self, values: torch.Tensor, pad: Any = 0) -> torch.Tensor:
        """``values`` ([sum(lengths), ...], a jagged values buffer) laid out in ``[1, T, ...]``."""
        if self.dense:
            return values.unsqueeze(0)
        out = values.new_full((self.total, *values.shape[1:]), pad)
        out[self.real] = values
        return out.unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """A packed ``[1, T, ...]`` (or ``[T, ...]``) tensor back to jagged rows."""
        flat = packed[0] if packed.dim() >= 2 and packed.shape[0] == 1 else packed
        if flat.shape[0] != self.total:
            raise ValueError(
                f"a packed tensor must have {self.total} tokens on its packed dim, "
                f"got shape {tuple(packed.shape)}"
            )
        real = self.real.to(flat.device)
        values = flat if self.dense else flat[real]
        return nested_from_lengths(values, self.lengths)


def packed_batch(
    td: TensorDictBase,
    index: PackedIndex,
    *,
    pad_values: Mapping[str, Any] | None = None,
) -> TensorDict:
    """One packed row per per-token column plus ``cu_seqlens`` / ``position_ids`` / ``segment_ids``."""
    pads = dict(pad_values or {})
    out: dict[str, torch.Tensor] = {}
    for name, value in td.items():
        if not value.is_nested and name in TOKEN_ALIGNED_FIELDS and value.dim() >= 2:
            value = jaggedize(name, value, index.lengths)
        if value.is_nested:
            if value._lengths is not None:  # type: ignore[attr-defined]
                value = value.contiguous()
            out[name] = index.pack(value.values(), pads.get(name, 0))
        else:
            out[name] = value
    out[CU_SEQLENS] = index.cu_seqlens.to(torch.int32)
    out[POSITION_IDS] = index.position_ids.unsqueeze(0)
    out[SEGMENT_IDS] = index.segment_ids.unsqueeze(0)
    return TensorDict(out, batch_size=[])

"""``MetaBatchMixin``: the LightningModule side, turning a microbatch meta into device tensors.

The dataloader yields ``KVBatchMeta`` microbatches; ``on_before_batch_transfer`` reads their
columns from the data plane on the host and lays them out (``padded`` or ``packed``);
``transfer_batch_to_device`` moves them. On CUDA the host tensors are pinned (PyTorch's caching
host allocator reuses the pinned blocks, and guards each block until its copy has finished) and
copied with ``non_blocking=True``. ``training_step`` receives a ``TensorDict``; the microbatch's
meta stays on ``self.dp_meta`` for the step and the callback.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS
from tq_plugin.lightning.layout import LAYOUTS, PackedIndex, packed_batch, padded_batch

# extra_info keys the DataModule stamps on each microbatch meta.
MICROBATCH_INFO = "microbatch"
MICRO_BATCH_LENGTH = "micro_batch_length"
PACK_PAD_MULTIPLE = "sequence_length_pad_multiple"
STEP_SAMPLE_IDS = "step_sample_ids"


class MetaBatchMixin:
    """Mix into a ``LightningModule`` (before it in the bases) to train on data-plane metas.

    Class attributes a host may override: ``dp_layout`` (``"padded"`` or ``"packed"``),
    ``dp_read_fields`` (``None`` reads the meta's ``fields``), ``dp_pad_values`` (per-field pad
    value, default 0) and ``dp_pad_to`` (``"target"``: the step's global pad target, the same on
    every rank; ``"microbatch"``: the microbatch's own planned length).
    """

    dp_layout: str = "padded"
    dp_read_fields: Sequence[str] | None = None
    dp_pad_values: Mapping[str, Any] = MappingProxyType({})
    dp_pad_to: str = "target"
    dp_client: Any = None
    dp_meta: KVBatchMeta | None = None
    dp_packed_index: PackedIndex | None = None
    dp_batch_stats: Mapping[str, float] = MappingProxyType({})

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, KVBatchMeta):
            return self.dp_materialize(batch)
        return super().on_before_batch_transfer(batch, dataloader_idx)  # type: ignore[misc]

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        if isinstance(batch, TensorDictBase):
            return batch.to(device, non_blocking=device.type == "cuda")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def dp_materialize(self, meta: KVBatchMeta) -> TensorDict:
        """Read ``meta``'s columns and lay them out as ``dp_layout`` says, on the host."""
        if self.dp_layout not in LAYOUTS:
            raise ValueError(f"dp_layout must be one of {list(LAYOUTS)}, got {self.dp_layout!r}")
        if self.dp_client is None:
            raise RuntimeError(
                "dp_client is not set: add a DataPlaneCallback to the Trainer (it hands the "
                "client to the module in setup)"
            )
        if meta.sequence_lengths is None:
            raise ValueError("a microbatch meta needs sequence_lengths to be laid out")
        start = time.perf_counter()
        fields = list(self.dp_read_fields or meta.fields or ())
        if not fields:
            raise ValueError("a microbatch meta must name the fields to read (meta.fields)")
        wire = call_dp(
            self.dp_client,
            "get_samples",
            sample_ids=list(meta.sample_ids),
            partition_id=meta.partition_id,
            select_fields=fields,
        )
        lengths = torch.tensor(meta.sequence_lengths, dtype=torch.int64)
        real = int(lengths.sum())
        if self.dp_layout == "packed":
            index = PackedIndex(lengths, int(meta.extra_info.get(PACK_PAD_MULTIPLE, 1)))
            td = packed_batch(wire, index, pad_values=self.dp_pad_values)
            self.dp_packed_index = index
            padded_tokens = index.total
        else:
            td = padded_batch(wire, pad_to=self._dp_pad_target(meta), pad_values=self.dp_pad_values)
            self.dp_packed_index = None
            keys = td.keys()  # a TensorDict refuses `in`
            width = td[INPUT_IDS].shape[1] if INPUT_IDS in keys else self._dp_pad_target(meta)
            padded_tokens = meta.size * int(width)
        if torch.cuda.is_available() and self._dp_device_type() == "cuda":
            td = td.pin_memory()
        self.dp_meta = meta
        self.dp_batch_stats = {
            "real_tokens": float(real),
            "padded_tokens": float(padded_tokens),
            "layout_s": time.perf_counter() - start,
        }
        return td

    def dp_rows(self, value: torch.Tensor) -> torch.Tensor:
        """A per-token step output back in row form, ready for ``write_to_dataplane``.

        Padded outputs ``[B, S, ...]`` pass through (the write cuts them to the rows' lengths);
        packed outputs ``[1, T, ...]`` become jagged rows.
        """
        if self.dp_packed_index is None:
            return value
        return self.dp_packed_index.unpack(value.detach())

    def _dp_pad_target(self, meta: KVBatchMeta) -> int:
        if self.dp_pad_to == "microbatch":
            planned = meta.extra_info.get(MICRO_BATCH_LENGTH)
            longest = max(meta.sequence_lengths or [0])
            return max(int(planned), longest) if planned else longest
        if self.dp_pad_to != "target":
            raise ValueError(f"dp_pad_to must be 'target' or 'microbatch', got {self.dp_pad_to!r}")
        return int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0))

    def _dp_device_type(self) -> str:
        device = getattr(self, "device", None)
        return device.type if isinstance(device, torch.device) else "cpu"


__all__ = [
    "MICROBATCH_INFO",
    "MICRO_BATCH_LENGTH",
    "PACK_PAD_MULTIPLE",
    "STEP_SAMPLE_IDS",
    "MetaBatchMixin",
]

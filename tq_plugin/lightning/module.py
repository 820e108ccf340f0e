"""``MetaBatchMixin``: the LightningModule side, turning a microbatch meta into device tensors.

The dataloader yields ``KVBatchMeta`` microbatches; ``on_before_batch_transfer`` reads their
columns from the data plane on the host and lays them out (``padded`` or ``packed``);
``transfer_batch_to_device`` moves them. On CUDA the host tensors are pinned (PyTorch's caching
host allocator reuses the pinned blocks, and guards each block until its copy has finished) and
copied with ``non_blocking=True``. ``training_step`` receives a ``TensorDict``; the microbatch's
meta stays on ``self.dp_meta`` for the step and the callback.

One global batch is one optimizer step, in every packing mode. The packing mode decides how many
microbatches a global batch is cut into (fixed rows, token-budget bins, padded-width bins); with
automatic optimization the mixin accumulates gradients over all of them and lets the optimizer
step on the global batch's last one (``dp_accumulate``). ``dp_token_mean`` divides a token sum by
the real tokens of the whole global batch, so the accumulated gradient -- and the loss -- is
the same however the rows were cut.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tq_plugin.config.schema import ConfigError
from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS
from tq_plugin.lightning.layout import LAYOUTS, PackedIndex, packed_batch, padded_batch

# extra_info keys the DataModule stamps on each microbatch meta.
MICROBATCH_INFO = "microbatch"
MICRO_BATCH_LENGTH = "micro_batch_length"
PACK_PAD_MULTIPLE = "sequence_length_pad_multiple"
STEP_SAMPLE_IDS = "step_sample_ids"


def _accumulating_modulus(trainer: Any) -> int:
    """A modulus that keeps Lightning accumulating on this batch.

    Lightning steps when ``batches_ready % accumulate_grad_batches == 0``; the smallest power
    of two above ``batches_ready`` never divides it.
    """
    ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
    return 1 << max(ready, 1).bit_length()


class MetaBatchMixin:
    """Mix into a ``LightningModule`` (before it in the bases) to train on data-plane metas.

    Class attributes a host may override: ``dp_layout`` (``"padded"`` or ``"packed"``),
    ``dp_read_fields`` (``None`` reads the meta's ``fields``), ``dp_pad_values`` (per-field pad
    value, default 0) and ``dp_pad_to`` (``"target"``: the step's global pad target, the same on
    every rank; ``"microbatch"``: the microbatch's own planned length) and ``dp_accumulate``
    (``True``: under automatic optimization, one optimizer step per global batch; it drives
    Lightning's own accumulation, so leave ``Trainer(accumulate_grad_batches=1)``).

    A host that overrides ``on_train_batch_start`` or ``optimizer_zero_grad`` calls ``super()``.
    """

    dp_layout: str = "padded"
    dp_read_fields: Sequence[str] | None = None
    dp_pad_values: Mapping[str, Any] = MappingProxyType({})
    dp_pad_to: str = "target"
    dp_client: Any = None
    dp_meta: KVBatchMeta | None = None
    dp_packed_index: PackedIndex | None = None
    dp_batch_stats: Mapping[str, float] = MappingProxyType({})
    dp_accumulate: bool = True
    _dp_is_meta_batch: bool = False

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._dp_is_meta_batch = isinstance(batch, KVBatchMeta)
        if self._dp_is_meta_batch:
            return self.dp_materialize(batch)
        return super().on_before_batch_transfer(batch, dataloader_idx)  # type: ignore[misc]

    # ------------------------------------------------------------ one global batch, one step
    @property
    def dp_microbatch(self) -> Mapping[str, Any] | None:
        """The current microbatch's place in its step (``MICROBATCH_INFO``), or ``None``."""
        if not self._dp_is_meta_batch or self.dp_meta is None:
            return None
        return self.dp_meta.extra_info.get(MICROBATCH_INFO)

    @property
    def dp_loss_tokens(self) -> float:
        """The loss normalizer: real tokens of the current global batch per rank that DDP
        averages over (shared rows: the whole global batch over ``world_size``; local rows:
        this rank's part, exact when ranks hold equal tokens)."""
        info = self.dp_microbatch
        if info is None or "loss_tokens" not in info:
            raise RuntimeError("dp_loss_tokens needs a microbatch planned by plan_step")
        return float(info["loss_tokens"])

    def dp_real_tokens(self, like: torch.Tensor) -> torch.Tensor:
        """1.0 on real tokens, 0.0 on padding, shaped like a per-token ``[B, S]`` / ``[1, T]``."""
        meta = self.dp_meta
        if meta is None or meta.sequence_lengths is None:
            raise RuntimeError("dp_real_tokens needs the current microbatch's meta")
        if self.dp_packed_index is not None:
            real = self.dp_packed_index.real.unsqueeze(0)
        else:
            lengths = torch.tensor(meta.sequence_lengths, dtype=torch.int64)
            real = torch.arange(like.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        return real.to(device=like.device, dtype=like.dtype if like.is_floating_point() else torch.float32)

    def dp_token_mean(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``sum(values * mask)`` over real tokens, divided by the global batch's real tokens.

        Summed over a global batch's microbatches this is the token mean of the whole global
        batch, whatever the packing mode: the loss to return for gradients (and logged values)
        that do not depend on how the rows were cut.
        """
        weights = self.dp_real_tokens(values)
        if mask is not None:
            weights = weights * mask
        return (values * weights).sum() / max(self.dp_loss_tokens, 1.0)

    def _dp_accumulating(self) -> bool:
        return (self.dp_accumulate and self.dp_microbatch is not None
                and bool(getattr(self, "automatic_optimization", False)))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        if self._dp_accumulating():
            info = self.dp_microbatch
            trainer = self.trainer  # type: ignore[attr-defined]
            if not getattr(self, "_dp_owns_accumulation", False):
                if trainer.accumulate_grad_batches != 1:
                    raise ConfigError(
                        f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): "
                        "MetaBatchMixin already accumulates over each global batch's "
                        "microbatches; leave it at 1 (or set dp_accumulate = False)"
                    )
                self._dp_owns_accumulation = True
            trainer.accumulate_grad_batches = (
                1 if info["last_in_global_batch"] else _accumulating_modulus(trainer))
            if info["index"] == 0:
                for opt in trainer.optimizers:
                    opt.zero_grad(set_to_none=True)
        return super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # Lightning divides the loss by accumulate_grad_batches; the modulus set above is not a
        # count of microbatches, so undo it (a power of two: exact in floating point).
        if getattr(self, "_dp_owns_accumulation", False) and self._dp_accumulating():
            loss = loss * self.trainer.accumulate_grad_batches  # type: ignore[attr-defined]
        super().backward(loss, *args, **kwargs)  # type: ignore[misc]

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        # Accumulating over a global batch: gradients are zeroed on its first microbatch only.
        if self._dp_accumulating():
            return
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)  # type: ignore[misc]

    def on_train_end(self) -> None:
        if getattr(self, "_dp_owns_accumulation", False):
            self.trainer.accumulate_grad_batches = 1  # type: ignore[attr-defined]
            self._dp_owns_accumulation = False
        super().on_train_end()  # type: ignore[misc]

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

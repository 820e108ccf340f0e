"""Tiny models and a synthetic step source, shared by tests, docs, benchmarks and recipes.

``DemoPolicy`` / ``DemoValue`` are one-layer token models that adopt the whole integration
(``TQDriverMixin`` + ``MetaBatchMixin``) in a few lines, as a user's own module would.
``SyntheticRollouts`` writes a step of random rollouts into the data plane and returns its meta.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from tensordict import TensorDict
from torch import nn

from tq_plugin.config.schema import PACKING_MODES, PackingConfig
from tq_plugin.data_plane.column_io import first_write
from tq_plugin.data_plane.jagged import nested_from_lengths
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import (
    ADVANTAGES,
    DP_TRAIN_FIELDS,
    DP_VALUE_TRAIN_FIELDS,
    GENERATION_LOGPROBS,
    INPUT_IDS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    RETURNS,
    SAMPLE_MASK,
    TOKEN_MASK,
    VALUES,
)
from tq_plugin.lightning.driver import TQDriverMixin
from tq_plugin.lightning.module import MetaBatchMixin

ROLLOUT_FIELDS = (*DP_TRAIN_FIELDS, VALUES, RETURNS)


def packing_setup(
    mode: str = "none",
    *,
    train_mb_tokens: int = 4096,
    logprob_mb_tokens: int = 8192,
    micro_batch_size: int | None = None,
    sequence_length_round: int = 1,
    sequence_length_pad_multiple: int = 1,
    algorithm: str = PackingConfig.algorithm,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(cfg, host_attributes)`` for a ``TQDriverMixin`` host in one packing mode.

    Built by ``PackingConfig`` (the one definition of both), so the demos and the recipes agree.
    """
    if mode not in PACKING_MODES:
        raise ValueError(f"packing mode must be one of {list(PACKING_MODES)}, got {mode!r}")
    packing = PackingConfig(
        name=mode, use_sequence_packing=mode == "sequence_packing",
        use_dynamic_batches=mode == "dynamic_batching", train_mb_tokens=train_mb_tokens,
        logprob_mb_tokens=logprob_mb_tokens, micro_batch_size=micro_batch_size or 1,
        sequence_length_round=sequence_length_round,
        sequence_length_pad_multiple=sequence_length_pad_multiple, algorithm=algorithm,
    )
    cfg = packing.model_cfg()
    if micro_batch_size is None:  # one microbatch per global batch
        del cfg["train_micro_batch_size"]
    return cfg, packing.host_attributes()


def partition_spec(partition_id: str = "train") -> dict[str, Any]:
    """The ``register_partition`` kwargs for the demo's rollout columns."""
    return {"partition_id": partition_id, "fields": list(ROLLOUT_FIELDS)}


class SyntheticRollouts:
    """``source(step, client) -> KVBatchMeta``: a step of random rollouts, written with one put.

    Lengths are uniform in ``[min_len, max_len]``; everything is a function of ``(seed, step,
    rank)``, so a resumed run sees the same rows. Under DDP each rank writes its own rows.
    """

    def __init__(
        self,
        rows: int = 8,
        *,
        min_len: int = 4,
        max_len: int = 16,
        vocab_size: int = 32,
        seed: int = 0,
        partition_id: str = "train",
    ) -> None:
        self.rows, self.min_len, self.max_len = rows, min_len, max_len
        self.vocab_size, self.seed, self.partition_id = vocab_size, seed, partition_id
        self.calls: list[int] = []

    def batch(self, step: int, rank: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        lengths = torch.randint(self.min_len, self.max_len + 1, (self.rows,), generator=g)
        total = int(lengths.sum())

        def per_token(values: torch.Tensor) -> torch.Tensor:
            return nested_from_lengths(values, lengths)

        return {
            INPUT_IDS: per_token(torch.randint(0, self.vocab_size, (total,), generator=g)),
            INPUT_LENGTHS: lengths,
            GENERATION_LOGPROBS: per_token(-torch.rand(total, generator=g)),
            PREV_LOGPROBS: per_token(-torch.rand(total, generator=g)),
            REFERENCE_POLICY_LOGPROBS: per_token(-torch.rand(total, generator=g)),
            ADVANTAGES: per_token(torch.randn(total, generator=g)),
            TOKEN_MASK: per_token(torch.ones(total)),
            SAMPLE_MASK: torch.ones(self.rows),
            VALUES: per_token(torch.zeros(total)),
            RETURNS: per_token(torch.randn(total, generator=g)),
        }

    def sample_ids(self, step: int, rank: int = 0) -> list[str]:
        return [f"s{step}_r{rank}_{i}" for i in range(self.rows)]

    def __call__(self, step: int, client: Any) -> KVBatchMeta:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.calls.append(step)
        return first_write(
            self.batch(step, rank),
            sample_ids=self.sample_ids(step, rank),
            client=client,
            partition_id=self.partition_id,
        )


class _DemoModel(TQDriverMixin, MetaBatchMixin, LightningModule):
    """One embedding, one hidden layer, one head: position-wise, so padded and packed agree."""

    def __init__(
        self,
        *,
        out_dim: int,
        vocab_size: int = 32,
        hidden: int = 32,
        packing: str = "none",
        layout: str = "padded",
        lr: float = 1e-2,
        record: bool = False,
        **packing_kwargs: Any,
    ) -> None:
        super().__init__()
        self.cfg, attrs = packing_setup(packing, **packing_kwargs)
        self.configure_packing(**attrs)
        self.dp_layout = layout
        self.lr = lr
        self.record = record
        self.received: list[tuple[KVBatchMeta, TensorDict]] = []
        self.embed = nn.Embedding(vocab_size, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, out_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.hidden(self.embed(input_ids))))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def _note(self, batch: TensorDict) -> None:
        if self.record:
            assert self.dp_meta is not None
            self.received.append((self.dp_meta, batch.detach().clone()))


class DemoPolicy(_DemoModel):
    """Policy-gradient loss on ``advantages``; writes ``prev_logprobs`` back."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(out_dim=kwargs.get("vocab_size", 32), **kwargs)

    def training_step(self, batch: TensorDict, batch_idx: int) -> Mapping[str, Any]:
        self._note(batch)
        ids = batch[INPUT_IDS]
        logprobs = torch.log_softmax(self(ids), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        loss = -self.dp_token_mean(logprobs * batch[ADVANTAGES], batch[TOKEN_MASK])
        return {"loss": loss, "write_back": {PREV_LOGPROBS: logprobs.detach()}}


class DemoValue(_DemoModel):
    """Masked MSE to ``returns``; writes ``values`` back."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(out_dim=1, **kwargs)

    def training_step(self, batch: TensorDict, batch_idx: int) -> Mapping[str, Any]:
        self._note(batch)
        values = self(batch[INPUT_IDS]).squeeze(-1)
        loss = self.dp_token_mean((values - batch[RETURNS]) ** 2, batch[TOKEN_MASK])
        return {"loss": loss, "write_back": {VALUES: values.detach()}}


POLICY_FIELDS = list(DP_TRAIN_FIELDS)
VALUE_FIELDS = list(DP_VALUE_TRAIN_FIELDS)

__all__ = [
    "POLICY_FIELDS",
    "ROLLOUT_FIELDS",
    "VALUE_FIELDS",
    "DemoPolicy",
    "DemoValue",
    "SyntheticRollouts",
    "packing_setup",
    "partition_spec",
]

"""``MetaDataModule``: a LightningDataModule whose dataloader yields ``KVBatchMeta`` microbatches.

Bulk tensors never pass through the DataLoader: a step's rows are written to the data plane by
the step source, the loader carries only metas (they pickle in microseconds), and the consuming
module reads its microbatch's columns in ``on_before_batch_transfer`` (``MetaBatchMixin``).

For each RL step: the source produces the step's rows and returns the step meta; the consuming
model narrows it and mints the pad target through its own ``isolated_meta`` (so a Policy and a
Value model never share a target); ``shard_meta_for_dp`` gives this rank its rows; the packing
plan cuts them into microbatches (``plan.plan_step``). ``epochs_per_step`` > 1 replays the step
(PPO epochs), re-planning each pass from the untouched step meta.

Keep ``num_workers=0`` (the default here): the planning runs the strategy's collectives and
reads the model's packing config, which live in the training process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, Trainer
from torch.utils.data import DataLoader, IterableDataset

from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.lightning.callback import DataPlaneCallback
from tq_plugin.lightning.metered import MeteredClient
from tq_plugin.lightning.plan import ROW_PLACEMENTS, ShardFn, plan_step

# source(step, client) -> the step meta; it writes the step's rows (e.g. with first_write).
StepSource = Callable[[int, Any], KVBatchMeta]


def _pass_through(item: KVBatchMeta) -> KVBatchMeta:
    return item


class _StepStream(IterableDataset):
    def __init__(self, datamodule: MetaDataModule) -> None:
        self.dm = datamodule

    def __iter__(self) -> Iterator[KVBatchMeta]:
        return self.dm.iter_microbatches()


def max_over_ranks(strategy: Any, values: list[int]) -> list[int]:
    """Each of ``values``, the largest any rank holds (a collective every rank calls)."""
    tensor = torch.tensor(values, dtype=torch.int64, device=strategy.root_device)
    return [int(v) for v in strategy.reduce(tensor, reduce_op="max").tolist()]


class MetaDataModule(LightningDataModule):
    """Yields one rank's microbatch metas, step after step.

    Args:
        source: ``source(step, client) -> KVBatchMeta`` writes a step's rows and returns its
            meta. Under ``rows="shared"`` rank 0 calls it and broadcasts the meta; under
            ``rows="local"`` every rank calls it for the rows it holds.
        num_steps: RL steps to train on.
        fields: the columns the model reads (the meta is narrowed to them).
        task_name: the consumer name stamped on the microbatch metas.
        role: the ``DataPlaneCallback`` role whose client, host model and resume cursor to use.
        mb_tokens_key: which token budget applies (``"train_mb_tokens"`` or
            ``"logprob_mb_tokens"``).
        global_batch_size: rows per optimizer step over all ranks (``None``: the whole step).
        micro_batch_size: rows per microbatch when neither packing mode is on (``None``: the
            host's ``cfg["train_micro_batch_size"]`` if set, else the whole global batch).
        rows: ``"shared"``, ``"local"`` or ``"auto"`` (``"local"`` for the embedded backend).
        epochs_per_step: passes over each step's rows (PPO epochs).
        shard_fn: replaces ``shard_meta_for_dp`` (tests, custom placement).
        source_on_every_rank: under ``rows="shared"``, every rank calls the source, not rank 0
            alone, and rank 0's meta is broadcast (the others' return is ignored): for a
            source that runs collectives, such as a sharded (FSDP) model's forwards.
    """

    def __init__(
        self,
        source: StepSource,
        *,
        num_steps: int,
        fields: Sequence[str],
        task_name: str = "train",
        role: str = "policy",
        mb_tokens_key: str = "train_mb_tokens",
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        rows: str = "auto",
        epochs_per_step: int = 1,
        shard_fn: ShardFn | None = None,
        source_on_every_rank: bool = False,
    ) -> None:
        super().__init__()
        if num_steps < 0 or epochs_per_step < 1:
            raise ValueError("num_steps must be >= 0 and epochs_per_step >= 1")
        if rows not in (*ROW_PLACEMENTS, "auto"):
            raise ValueError(f"rows must be one of {[*ROW_PLACEMENTS, 'auto']}, got {rows!r}")
        if not fields:
            raise ValueError("fields must name at least one column to read")
        self.source = source
        self.num_steps = num_steps
        self.fields = list(fields)
        self.task_name = task_name
        self.role = role
        self.mb_tokens_key = mb_tokens_key
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rows = rows
        self.epochs_per_step = epochs_per_step
        self.shard_fn = shard_fn
        self.source_on_every_rank = source_on_every_rank

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepStream(self), batch_size=None, collate_fn=_pass_through)

    # ------------------------------------------------------------------ wiring
    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("MetaDataModule is iterated outside a Trainer (pass it to fit)")
        return self.trainer

    def _callback(self) -> DataPlaneCallback | None:
        for cb in self._trainer().callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, DataPlaneCallback) and cb.role == self.role:
                return cb
        return None

    def _row_placement(self, client: Any) -> str:
        if self.rows != "auto":
            return self.rows
        # A backend states its placement (``shared``: other processes see its rows); a client
        # that does not say is taken as shared, the safe side (rank 0 owns each step).
        inner = client.inner if isinstance(client, MeteredClient) else client
        return "shared" if getattr(inner, "shared", True) else "local"

    def _reduce_max(self, values: list[int]) -> list[int]:
        return max_over_ranks(self._trainer().strategy, values)

    # ------------------------------------------------------------------ iteration
    def iter_microbatches(self) -> Iterator[KVBatchMeta]:
        """This rank's microbatch metas, step after step.

        A step's first microbatch is yielded as a pending meta: the step is generated when that
        meta is first read, or when the stream is asked for the next microbatch, whichever
        comes first. Lightning fetches one microbatch ahead (to know which one is last), so it
        fetches step s + 1's first microbatch before step s's last optimizer step; generating
        only then keeps every step's rollouts on-policy (made with the weights after the
        previous step's last update) in every packing mode.
        """
        trainer = self._trainer()
        callback = self._callback()
        host = callback.host(trainer.lightning_module) if callback else trainer.lightning_module
        client = getattr(host, "dp_client", None)
        if client is None:
            raise RuntimeError(
                f"no data-plane client on the model: add DataPlaneCallback(role={self.role!r}) "
                "to the Trainer's callbacks"
            )
        start_step, skip = callback.resume_cursor() if callback else (0, 0)
        for step in range(start_step, self.num_steps):
            microbatches = self._step_microbatches(
                step, skip if step == start_step else 0, trainer=trainer, host=host, client=client)
            pending = PendingMeta(lambda mbs=microbatches, step=step: _first(mbs, step))
            yield pending
            pending.resolve()
            yield from microbatches

    def _step_microbatches(self, step: int, skip: int, *, trainer: Trainer, host: Any,
                           client: Any) -> Iterator[KVBatchMeta]:
        """Generate ``step`` (nothing runs before the first ``next``) and plan its passes."""
        world, rank = trainer.world_size, trainer.global_rank
        placement = self._row_placement(client)
        if placement == "shared" and world > 1:
            meta = self.source(step, client) if rank == 0 or self.source_on_every_rank else None
            meta = trainer.strategy.broadcast(meta if rank == 0 else None, src=0)
        else:
            meta = self.source(step, client)
        index = 0
        for epoch in range(self.epochs_per_step):
            for mb in plan_step(
                meta,
                host=host,
                fields=self.fields,
                task_name=self.task_name,
                step=step,
                epoch=epoch,
                num_epochs=self.epochs_per_step,
                mb_tokens_key=self.mb_tokens_key,
                world_size=world,
                rank=rank,
                rows=placement,
                reduce_max=self._reduce_max,
                global_batch_size=self.global_batch_size,
                micro_batch_size=self.micro_batch_size,
                shard_fn=self.shard_fn,
            ):
                if index >= skip:
                    yield mb
                index += 1


def _first(microbatches: Iterator[KVBatchMeta], step: int) -> KVBatchMeta:
    for mb in microbatches:
        return mb
    raise RuntimeError(f"MetaDataModule: step {step} was planned into no microbatch (no rows)")


_META_FIELDS = frozenset(f.name for f in dataclasses.fields(KVBatchMeta))


class PendingMeta(KVBatchMeta):
    """A microbatch meta whose step is generated on first use (see ``iter_microbatches``).

    It is a ``KVBatchMeta`` to every consumer: reading any of its fields first calls
    ``produce()`` and takes over the fields of the meta it returns. ``dataclasses.replace``
    and ``KVBatchMeta(**fields)``-style copies give plain metas.
    """

    def __init__(self, produce: Callable[[], KVBatchMeta] | None = None, **fields: Any) -> None:
        if produce is None:  # a copy (dataclasses.replace): an ordinary, resolved meta
            super().__init__(**fields)
        else:
            object.__setattr__(self, "_produce", produce)

    def __getattribute__(self, name: str) -> Any:
        if name in _META_FIELDS:
            PendingMeta.resolve(self)
        return object.__getattribute__(self, name)

    @property
    def pending(self) -> bool:
        """Whether the step behind this meta has not been generated yet."""
        return "_produce" in object.__getattribute__(self, "__dict__")

    def resolve(self) -> None:
        """Generate the step now (once); later calls do nothing."""
        state = object.__getattribute__(self, "__dict__")
        produce = state.pop("_produce", None)
        if produce is not None:
            state.update(vars(produce()))

    def __reduce__(self) -> Any:  # pickles (and copies) as the plain meta it stands for
        return (KVBatchMeta, tuple(getattr(self, f.name) for f in dataclasses.fields(KVBatchMeta)))

"""Each step's rows are generated with the weights after the previous step's last update.

Lightning fetches one microbatch ahead to know which is last, so a stream that generated a step
when its first microbatch was fetched generated step s + 1 before step s's last optimizer step
(off-policy by one update). ``MetaDataModule`` yields a step's first microbatch as a pending
meta and generates the step only when it is used.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback

from tq_plugin.data_plane import KVBatchMeta
from tq_plugin.lightning import MICROBATCH_INFO, DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.datamodule import PendingMeta
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec

ROWS, STEPS, EPOCHS, GLOBAL_BATCH = 4, 3, 2, 2
MODES = [("none", "padded"), ("dynamic_batching", "padded"), ("sequence_packing", "packed")]


class RecordingSource(SyntheticRollouts):
    """Records the optimizer steps taken and a weight checksum when each step is generated."""

    def __init__(self, model: DemoPolicy) -> None:
        super().__init__(rows=ROWS, min_len=3, max_len=12, seed=5)
        self.model = model
        self.generated_at: list[int] = []
        self.checksums: list[float] = []

    def __call__(self, step: int, client: Any) -> KVBatchMeta:
        self.generated_at.append(self.model.trainer.global_step)
        self.checksums.append(float(sum(p.detach().sum() for p in self.model.parameters())))
        return super().__call__(step, client)


class Checksums(DemoPolicy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.after_update: list[float] = []  # weight checksum after each optimizer step

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.after_update.append(float(sum(p.detach().sum() for p in self.parameters())))


@pytest.mark.parametrize("mode, layout", MODES)
def test_each_step_is_generated_after_the_previous_steps_last_update(
    make_trainer: Any, mode: str, layout: str
) -> None:
    model = Checksums(packing=mode, layout=layout, train_mb_tokens=40, sequence_length_round=4,
                      micro_batch_size=1, lr=0.1)
    source = RecordingSource(model)
    updates_per_step = EPOCHS * ROWS // GLOBAL_BATCH
    trainer = make_trainer(callbacks=[DataPlaneCallback(partitions=[partition_spec()])],
                           max_steps=STEPS * updates_per_step)
    dm = MetaDataModule(source, num_steps=STEPS, fields=POLICY_FIELDS, epochs_per_step=EPOCHS,
                        global_batch_size=GLOBAL_BATCH)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == STEPS * updates_per_step
    assert source.calls == list(range(STEPS))
    # Step s sees exactly the s * updates_per_step updates made before it ...
    assert source.generated_at == [s * updates_per_step for s in range(STEPS)]
    # ... and the weights they left (not those of one update earlier).
    for s in range(1, STEPS):
        assert source.checksums[s] == model.after_update[s * updates_per_step - 1]
        assert source.checksums[s] != model.after_update[s * updates_per_step - 2]


def test_a_pending_meta_generates_on_first_read_once(make_trainer: Any) -> None:
    produced: list[int] = []
    real = KVBatchMeta(partition_id="p", task_name="t", sample_ids=["a", "b"],
                       sequence_lengths=[1, 2], extra_info={MICROBATCH_INFO: {"step": 0}})

    def produce() -> KVBatchMeta:
        produced.append(1)
        return real

    pending = PendingMeta(produce)
    assert isinstance(pending, KVBatchMeta) and pending.pending and produced == []
    assert pending.sample_ids == ["a", "b"] and pending.size == 2
    assert pending.sequence_lengths == [1, 2] and produced == [1] and not pending.pending
    pending.resolve()
    assert produced == [1]
    for copied in (pickle.loads(pickle.dumps(pending)), copy.copy(pending)):
        assert type(copied) is KVBatchMeta and copied == real
    assert dataclasses.asdict(pending) == dataclasses.asdict(real)


def test_a_step_planned_into_no_microbatch_is_refused_by_name(make_trainer: Any) -> None:
    model = DemoPolicy()
    empty = lambda step, client: KVBatchMeta(partition_id="train", task_name=None,
                                             sample_ids=[], sequence_lengths=[])
    dm = MetaDataModule(empty, num_steps=1, fields=POLICY_FIELDS)
    trainer = make_trainer(callbacks=[DataPlaneCallback(partitions=[partition_spec()])])
    with pytest.raises(RuntimeError, match="step 0 was planned into no microbatch"):
        trainer.fit(model, datamodule=dm)


class SaveAt(Callback):
    """Saves a checkpoint in ``on_train_batch_end`` of microbatch ``at`` (step, index in step),
    placed before the DataPlaneCallback: its resume cursor still points at that microbatch."""

    def __init__(self, path: Path, at: tuple[int, int]) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        info = pl_module.dp_meta.extra_info[MICROBATCH_INFO]
        if (info["step"], info["index_in_step"]) == self.at:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_at_a_steps_last_microbatch_resumes_into_that_step(
    make_trainer: Any, tmp_path: Path
) -> None:
    """The store a checkpoint saves holds the step being trained and nothing ahead of it: with the
    look-ahead it held step 1 too, and the resume generated step 0 again into rows that were
    already there ('sample_ids already exist')."""
    ckpt = tmp_path / "last_mb_of_step0.ckpt"

    def fit(source: SyntheticRollouts, callbacks: list, ckpt_path: str | None = None) -> Any:
        cb = DataPlaneCallback(partitions=[partition_spec()])
        # The resumed run trains the saved microbatch again (its cursor had not moved): one
        # optimizer step more.
        trainer = make_trainer(callbacks=[*callbacks, cb], max_steps=6 + bool(ckpt_path))
        dm = MetaDataModule(source, num_steps=3, fields=POLICY_FIELDS, micro_batch_size=2,
                            global_batch_size=2)
        trainer.fit(DemoPolicy(record=True), datamodule=dm, ckpt_path=ckpt_path)
        return cb

    fit(SyntheticRollouts(rows=4, seed=1), [SaveAt(ckpt, at=(0, 1))])
    resumed = SyntheticRollouts(rows=4, seed=2)
    cb = fit(resumed, [], ckpt_path=str(ckpt))
    assert cb.restored_from is not None
    assert resumed.calls == [1, 2]  # step 0's last microbatch came back from the store
    assert cb.resume_cursor() == (3, 0)

"""A fit resumed from a Lightning checkpoint restores the callback's cursor and never re-reads
or re-writes a microbatch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from tq_plugin.data_plane import INPUT_IDS, LocalDataPlane
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec


class LedgerClient(LocalDataPlane):
    """Records which rows each read and each write-back touched."""

    def __init__(self, ledger: dict[str, list[str]]) -> None:
        super().__init__()
        self.ledger = ledger

    def get_samples(self, sample_ids: Any, partition_id: str, select_fields: Any) -> Any:
        self.ledger["read"] += list(sample_ids)
        return super().get_samples(
            partition_id=partition_id, sample_ids=sample_ids, select_fields=select_fields
        )

    def put_samples(self, sample_ids: Any, partition_id: str, fields: Any = None, tags: Any = None, **kw: Any) -> Any:
        if fields is not None and INPUT_IDS not in list(fields.keys()):
            self.ledger["written"] += list(sample_ids)
        return super().put_samples(
            partition_id=partition_id, sample_ids=sample_ids, fields=fields, tags=tags, **kw
        )


def run(make_trainer: Any, ckpt_dir: Path, max_steps: int, ckpt: str | None = None) -> tuple:
    ledger: dict[str, list[str]] = {"read": [], "written": []}
    source = SyntheticRollouts(rows=4)
    cb = DataPlaneCallback(lambda: LedgerClient(ledger), partitions=[partition_spec()])
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(callbacks=[cb, saver], enable_checkpointing=True, max_steps=max_steps)
    dm = MetaDataModule(source, num_steps=3, fields=POLICY_FIELDS, micro_batch_size=2, global_batch_size=2)
    trainer.fit(DemoPolicy(), datamodule=dm, ckpt_path=ckpt)
    return cb, source, ledger


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_resume_mid_step_continues_without_rereading_or_rewriting(make_trainer: Any, tmp_path: Path) -> None:
    # 3 steps x 2 microbatches; the first fit stops after step 1's first microbatch.
    cb1, src1, first = run(make_trainer, tmp_path / "first", max_steps=3)
    assert cb1.resume_cursor() == (1, 1)
    ckpt = tmp_path / "first" / "epoch=0-step=3.ckpt"
    assert ckpt.exists()

    cb2, src2, second = run(make_trainer, tmp_path / "second", max_steps=6, ckpt=str(ckpt))
    assert cb2.resume_cursor() == (3, 0)
    assert src2.calls == [2]  # the interrupted step 1 is served from the saved store, step 0 never again
    all_ids = [s for step in range(3) for s in src1.sample_ids(step)]
    assert sorted(first["written"] + second["written"]) == sorted(all_ids)  # each row once
    assert sorted(first["written"]) == sorted(first["read"])
    assert not set(second["read"]) & set(first["read"])  # nothing trained is read again
    assert sorted(second["read"]) == sorted(second["written"])
    assert cb2.rows_written == len(all_ids)

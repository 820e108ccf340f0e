"""A fit interrupted inside a step and resumed from its Lightning checkpoint gets the step's rows
back from the saved store, instead of generating the step again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tq_plugin.data_plane import INPUT_IDS, KVBatchMeta
from tq_plugin.data_plane.checkpoint import CheckpointError
from tq_plugin.lightning import MICROBATCH_INFO, DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec

pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed")


class FreshRollouts(SyntheticRollouts):
    """Every call draws new data, so a regenerated step cannot pass for the interrupted one."""

    def __init__(self, salt: int) -> None:
        super().__init__(rows=4)
        self.salt = salt
        self.tokens: dict[str, torch.Tensor] = {}  # sample id -> the input_ids it was put with

    def __call__(self, step: int, client: Any) -> KVBatchMeta:
        self.seed = self.salt + len(self.calls)
        rows = self.batch(step)[INPUT_IDS].unbind()
        self.tokens.update(zip(self.sample_ids(step), rows))
        return super().__call__(step, client)


class Interrupted(DemoPolicy):
    """Raises in the training step of microbatch ``fail_at = (step, index in step)``, after
    that step's rows were put."""

    def __init__(self, fail_at: tuple[int, int] | None = None) -> None:
        super().__init__(record=True)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        info = self.dp_meta.extra_info[MICROBATCH_INFO]
        if (info["step"], info["index_in_step"]) == self.fail_at:
            raise RuntimeError("interrupted")
        return super().training_step(batch, batch_idx)


def fit(make_trainer: Any, root: Path, run: str, *, salt: int,
        fail_at: tuple[int, int] | None = None,
        ckpt: str | None = None, **cb_kwargs: Any) -> tuple:
    source = FreshRollouts(salt)
    cb = DataPlaneCallback(partitions=[partition_spec()], **cb_kwargs)
    saver = ModelCheckpoint(dirpath=root / run, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(callbacks=[cb, saver], enable_checkpointing=True, max_steps=6,
                           default_root_dir=str(root))
    # Two optimizer steps (checkpoints) per step: a checkpoint can land inside a step.
    dm = MetaDataModule(source, num_steps=3, global_batch_size=2,
                        fields=POLICY_FIELDS, micro_batch_size=2)
    model = Interrupted(fail_at)
    if fail_at is None:
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    else:
        with pytest.raises(RuntimeError, match="interrupted"):
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return cb, source, model


def read_tokens(model: DemoPolicy) -> dict[str, torch.Tensor]:
    """Sample id -> the input_ids the model trained on (padding cut by the meta's lengths)."""
    out = {}
    for meta, batch in model.received:
        for i, sid in enumerate(meta.sample_ids):
            out[sid] = batch[INPUT_IDS][i, : meta.sequence_lengths[i]]
    return out


def last_checkpoint(root: Path) -> Path:
    return max(root.glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)


def test_a_resumed_fit_trains_on_the_saved_rows_instead_of_regenerating(
    make_trainer: Any, tmp_path: Path
) -> None:
    # 3 steps x 2 microbatches; step 1's second microbatch raises, after step 1 was put.
    _, src1, _ = fit(make_trainer, tmp_path, "first", salt=0, fail_at=(1, 1))
    assert 1 in src1.calls
    ckpt = last_checkpoint(tmp_path / "first")
    step = int(ckpt.stem.rpartition("step=")[2])
    saved = tmp_path / "dataplane" / "policy" / f"step-{step}" / "rank-0"
    assert (saved / "manifest.json").is_file()
    # The Lightning checkpoint holds only primitives: it loads without unpickling objects.
    state = torch.load(ckpt, weights_only=True)["callbacks"]
    assert any(s.get("store_path") == str(saved.parent) for s in state.values())
    assert any(s.get("completed_steps") == 1 for s in state.values())  # resumes inside step 1

    cb2, src2, model2 = fit(make_trainer, tmp_path, "second", salt=1000, ckpt=str(ckpt))
    assert cb2.restored_from == str(saved.parent)
    assert src2.calls == [2]  # step 1 came back from the store: never generated again
    got = read_tokens(model2)
    step1 = [sid for sid in src1.sample_ids(1) if sid in got]
    assert step1  # what was left of step 1 is trained on ...
    for sid in step1:
        assert torch.equal(got[sid], src1.tokens[sid])  # ... with the rows run 1 put
    assert cb2.resume_cursor() == (3, 0)


def test_without_checkpoint_store_the_interrupted_step_is_generated_again(
    make_trainer: Any, tmp_path: Path
) -> None:
    fit(make_trainer, tmp_path, "first", salt=0, fail_at=(1, 1), checkpoint_store=False)
    assert not (tmp_path / "dataplane").exists()
    _, src2, _ = fit(make_trainer, tmp_path, "second", salt=1000, checkpoint_store=False,
                     ckpt=str(last_checkpoint(tmp_path / "first")))
    assert src2.calls == [1, 2]


def test_a_missing_store_checkpoint_stops_the_resume_with_a_hint(
    make_trainer: Any, tmp_path: Path
) -> None:
    import shutil

    fit(make_trainer, tmp_path, "first", salt=0, fail_at=(1, 1))
    shutil.rmtree(tmp_path / "dataplane")
    with pytest.raises(CheckpointError, match=r"role='policy'.*rank-0.*checkpoint_store=False"):
        fit(make_trainer, tmp_path, "second", salt=1000,
            ckpt=str(last_checkpoint(tmp_path / "first")))


def test_keep_last_stores_prunes_older_store_checkpoints(make_trainer: Any, tmp_path: Path) -> None:
    fit(make_trainer, tmp_path, "first", salt=0, keep_last_stores=2)
    kept = sorted(p.name for p in (tmp_path / "dataplane" / "policy").iterdir())
    saved = sorted(p.stem.rpartition("step=")[2] for p in (tmp_path / "first").glob("*.ckpt"))
    assert len(saved) > 2 and len(kept) == 2
    newest = sorted(saved, key=int)[-2:]
    assert kept == sorted(f"step-{n}" for n in newest)
    with pytest.raises(ValueError, match="keep_last_stores must be >= 1"):
        DataPlaneCallback(keep_last_stores=0)

"""A fit interrupted inside a step and resumed from its Lightning checkpoint gets the step's rows
back from the saved store, instead of generating the step again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tq_plugin.data_plane import INPUT_IDS, KVBatchMeta
from tq_plugin.data_plane.backends._checkpoint import CheckpointError
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule
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
    """Raises in the training step at ``fail_at`` (after that step's rows were put)."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__(record=True)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.global_step == self.fail_at:
            raise RuntimeError("interrupted")
        return super().training_step(batch, batch_idx)


def fit(make_trainer: Any, root: Path, run: str, *, salt: int, fail_at: int | None = None,
        ckpt: str | None = None, wrap: bool = True, **cb_kwargs: Any) -> tuple:
    source = FreshRollouts(salt)
    cb = DataPlaneCallback(partitions=[partition_spec()], **cb_kwargs)
    saver = ModelCheckpoint(dirpath=root / run, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(callbacks=[cb, saver], enable_checkpointing=True, max_steps=6,
                           default_root_dir=str(root))
    dm = MetaDataModule(cb.step_source(source) if wrap else source, num_steps=3,
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


def test_a_resumed_fit_trains_on_the_saved_rows_instead_of_regenerating(
    make_trainer: Any, tmp_path: Path
) -> None:
    # 3 steps x 2 microbatches, one optimizer step each; step 1's second microbatch raises.
    _, src1, _ = fit(make_trainer, tmp_path, "first", salt=0, fail_at=3)
    assert src1.calls == [0, 1, 2]  # step 2 is fetched ahead, after the last checkpoint
    ckpt = tmp_path / "first" / "epoch=0-step=3.ckpt"
    saved = tmp_path / "dataplane" / "policy" / "step-3" / "rank-0"
    assert (saved / "manifest.json").is_file()
    # The Lightning checkpoint holds only primitives: it loads without unpickling objects.
    state = torch.load(ckpt, weights_only=True)["callbacks"]
    assert any(s.get("store_path") == str(saved.parent) for s in state.values())

    cb2, src2, model2 = fit(make_trainer, tmp_path, "second", salt=1000, ckpt=str(ckpt))
    assert cb2.restored_from == str(saved.parent)
    assert src2.calls == [2]  # step 1 came back from the store: never generated again
    got = read_tokens(model2)
    step1_rest = [sid for sid in src1.sample_ids(1) if sid in got]
    assert len(step1_rest) == 2  # the interrupted microbatch, and only it, is trained on
    for sid in step1_rest:
        assert torch.equal(got[sid], src1.tokens[sid])  # the rows run 1 put, not new ones
    assert cb2.resume_cursor() == (3, 0)


def test_without_checkpoint_store_the_interrupted_step_is_generated_again(
    make_trainer: Any, tmp_path: Path
) -> None:
    fit(make_trainer, tmp_path, "first", salt=0, fail_at=3, checkpoint_store=False)
    assert not (tmp_path / "dataplane").exists()
    _, src2, _ = fit(make_trainer, tmp_path, "second", salt=1000, checkpoint_store=False,
                     ckpt=str(tmp_path / "first" / "epoch=0-step=3.ckpt"))
    assert src2.calls == [1, 2]


def test_a_missing_store_checkpoint_stops_the_resume_with_a_hint(
    make_trainer: Any, tmp_path: Path
) -> None:
    import shutil

    fit(make_trainer, tmp_path, "first", salt=0, fail_at=3)
    shutil.rmtree(tmp_path / "dataplane" / "policy" / "step-3")
    with pytest.raises(CheckpointError, match=r"role='policy'.*step-3/rank-0.*checkpoint_store=False"):
        fit(make_trainer, tmp_path, "second", salt=1000, ckpt=str(tmp_path / "first" / "epoch=0-step=3.ckpt"))

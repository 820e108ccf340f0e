"""The progress bar counts RL steps (not microbatches) and shows what is logged for it."""

from __future__ import annotations

from typing import Any

from tq_plugin.lightning import DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec
from tq_plugin.lightning.progress import StepProgressBar


class _RewardPolicy(DemoPolicy):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("rl/reward", 0.5, prog_bar=True)
        return out


def test_bar_counts_rl_steps_and_shows_the_reward(make_trainer: Any) -> None:
    steps = 3
    bar = StepProgressBar()
    seen: list[tuple[int, Any]] = []

    class Spy(DataPlaneCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            seen.append((bar.train_progress_bar.n, bar.train_progress_bar.total))

    # micro_batch_size=2 over 8 rows: four microbatches per step, one bar tick per step.
    model = _RewardPolicy(packing="none", micro_batch_size=2)
    trainer = make_trainer(enable_progress_bar=True, callbacks=[
        bar, Spy(role="policy", partitions=[partition_spec()])])
    trainer.fit(model, datamodule=MetaDataModule(SyntheticRollouts(rows=8), num_steps=steps,
                                                 fields=POLICY_FIELDS))
    assert trainer.progress_bar_callback is bar
    assert len(seen) == steps * 4
    assert {total for _, total in seen} == {steps}
    assert [n for n, _ in seen] == [s + (i == 3) for s in range(steps) for i in range(4)]
    assert "rl/reward" in bar.get_metrics(trainer, model)

"""``StepProgressBar``: a progress bar that counts RL steps, not microbatches.

The dataloader of a ``MetaDataModule`` is an endless-looking stream of microbatch metas, so
Lightning's bar shows ``0/?`` microbatches. This bar advances once per RL step (on the step's
last microbatch, from the meta's ``microbatch`` info), shows ``step/num_steps`` and, beside it,
every metric logged with ``prog_bar=True`` (the recipe's ``rl/reward``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from tq_plugin.lightning.module import MICROBATCH_INFO


def _microbatch_info(pl_module: LightningModule) -> dict[str, Any] | None:
    meta = getattr(pl_module, "dp_meta", None)
    return None if meta is None else meta.extra_info.get(MICROBATCH_INFO)


class StepProgressBar(TQDMProgressBar):
    """``RL step 12/100 … rl/reward=0.41``; plain batches count as Lightning's bar does."""

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        steps = getattr(trainer.datamodule, "num_steps", None)
        if steps is not None:
            self.train_progress_bar.reset(total=steps)
            self.train_progress_bar.set_description("RL step")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        info = _microbatch_info(pl_module)
        if info is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        done = int(info["step"]) + int(bool(info["last_in_step"]))
        if done != bar.n:
            bar.n = done
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

"""One global batch is one optimizer step, and the same update, in every packing mode.

The module below is the README's Lightning pattern (automatic optimization, a loss returned from
``training_step``); only the packing config changes between the runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule

from tq_plugin.config import ConfigError, PackingConfig
from tq_plugin.lightning import DataPlaneCallback, MetaBatchMixin, MetaDataModule, TQDriverMixin
from tq_plugin.lightning.demo import POLICY_FIELDS, SyntheticRollouts, partition_spec

MODES = {
    "none": PackingConfig(name="none", micro_batch_size=2),
    "sequence_packing": PackingConfig(name="sequence_packing", use_sequence_packing=True,
                                      train_mb_tokens=40, layout="packed"),
    "dynamic_batching": PackingConfig(name="dynamic_batching", use_dynamic_batches=True,
                                      train_mb_tokens=40),
}


class ReadmePolicy(TQDriverMixin, MetaBatchMixin, LightningModule):
    def __init__(self, packing: PackingConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Embedding(32, 32)
        self.cfg = packing.model_cfg()
        self.configure_packing(**packing.host_attributes())
        self.dp_layout = packing.layout
        self.losses: list[float] = []
        self.optimizer_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        ids = batch["input_ids"]
        logprobs = self.net(ids).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        loss = -self.dp_token_mean(logprobs * batch["advantages"], batch["token_mask"])
        self.losses.append(float(loss.detach()))
        return {"loss": loss}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.optimizer_steps += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(make_trainer: Any, mode: str, num_steps: int, **trainer_kwargs: Any) -> ReadmePolicy:
    model = ReadmePolicy(MODES[mode])
    callback = DataPlaneCallback(role="policy", partitions=[partition_spec()])
    trainer = make_trainer(callbacks=[callback], **trainer_kwargs)
    trainer.fit(model, datamodule=MetaDataModule(SyntheticRollouts(rows=8), num_steps=num_steps,
                                                 fields=POLICY_FIELDS))
    assert trainer.global_step == model.optimizer_steps
    return model


@pytest.mark.parametrize("num_steps", [1, 2])
def test_same_update_in_every_packing_mode(make_trainer: Any, num_steps: int) -> None:
    models = {mode: _fit(make_trainer, mode, num_steps) for mode in MODES}
    for mode, model in models.items():
        assert model.optimizer_steps == num_steps, mode  # one per global batch (= RL step)
        assert len(model.losses) >= 2 * num_steps, mode  # each step was cut into microbatches
    ref = models["none"].net.weight
    assert not torch.allclose(ref, ReadmePolicy(MODES["none"]).net.weight)  # it did train
    for mode, model in models.items():
        torch.testing.assert_close(model.net.weight, ref, atol=1e-6, rtol=1e-5, msg=mode)
    # The loss of the first global batch (its microbatches' sum) is the same in every mode.
    first = {m: sum(model.losses[: len(model.losses) // num_steps]) for m, model in models.items()}
    assert max(first.values()) - min(first.values()) < 1e-5, first


def test_trainer_accumulation_is_refused_with_meta_batches(make_trainer: Any) -> None:
    with pytest.raises(ConfigError, match="accumulate_grad_batches=2"):
        _fit(make_trainer, "none", 1, accumulate_grad_batches=2)

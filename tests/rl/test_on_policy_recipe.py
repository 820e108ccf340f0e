"""The recipe generates each RL step with the weights after the previous step's last update.

Before ``MetaDataModule`` deferred a step's generation to its first use, Lightning's one-batch
look-ahead made step s + 1's rollouts with the weights of one update before step s's last
(measured with ppo_epochs=2: step 1 at optimizer step 1 instead of 2, step 2 at 3 instead of 4).
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli
from tq_plugin.rl.topology.colocated import Colocated

STEPS, EPOCHS, MINIBATCHES = 3, 2, 2


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    yield
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("packing", ["none", "sequence_packing", "dynamic_batching"])
def test_every_step_is_rolled_out_after_the_previous_steps_last_update(
    monkeypatch, tmp_path, packing
):
    generated_at: dict[int, int] = {}
    prepare = Colocated.prepare_step

    def recording(self, step, client=None):
        generated_at[step] = self.module.trainer.global_step
        return prepare(self, step, client)

    monkeypatch.setattr(Colocated, "prepare_step", recording)
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [
        "grpo", f"hydra.run.dir={tmp_path}", f"tq/packing={packing}",
        f"recipe.num_steps={STEPS}", f"recipe.ppo_epochs={EPOCHS}",
        f"recipe.minibatches={MINIBATCHES}", "recipe.prompts_per_step=4",
        "trainer.enable_progress_bar=false"])
    cli.main(config_name="grpo")
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == STEPS
    per_step = EPOCHS * MINIBATCHES
    assert generated_at == {s: s * per_step for s in range(STEPS)}

"""A disaggregated rollout worker (a Ray actor) holds its own engine and loads the published
weights into it: the worker builds its policy with its own random init, so rows of step 0
matching the trainer's logprobs (gap ~0) show the publish of version 0 reached the engine."""

from __future__ import annotations

import csv

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin.rl.recipe import RLRecipe

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_ray_worker_generates_with_its_own_hf_engine_at_the_published_weights(
        tmp_path, ray_session):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=[
            "tq/backend=ray", "recipe.topology=disaggregated", "recipe.max_staleness=1",
            "tq.backend.ray_init.num_cpus=null", "model=hf_causal_lm", "engine=hf",
            "recipe.num_steps=3", "recipe.prompts_per_step=4", "recipe.ppo_epochs=1",
            "trainer.enable_progress_bar=false", "logger=csv"])
    GlobalHydra.instance().clear()
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.source.stop()
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert float(rows[0]["logprob_gap"]) < 1e-4
    assert int(rows[-1]["failed_calls"]) == 0

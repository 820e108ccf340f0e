"""A finished run continued from its ``last.ckpt`` to a larger ``recipe.num_steps`` trains the
added steps (the toy pattern task, GRPO, colocated, in this process): the metrics rows of every
step, Lightning's global step, the weights moved, and the same figures as one uninterrupted run.
The same ``num_steps`` trains nothing and says so in one line; fewer is refused naming the key."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

FAST = ["recipe.prompts_per_step=4", "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false"]
pytestmark = pytest.mark.usefixtures("fresh_hydra")  # tests/rl/conftest.py


def _train(run_dir, *overrides):
    from hydra import compose, initialize_config_module

    from tq_plugin.rl.recipe import RLRecipe

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=[*FAST, *overrides])
    recipe = RLRecipe(cfg, run_dir)
    recipe.setup()
    recipe.train()
    return recipe, recipe.cleanup()


def _rows(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _policy(recipe):
    return {k: v.detach().clone() for k, v in recipe.module.policy.state_dict().items()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run with its ``last.ckpt``."""
    run_dir = tmp_path_factory.mktemp("continue") / "first"
    GlobalHydra.instance().clear()
    recipe, summary = _train(run_dir, "recipe.num_steps=2", "recipe.checkpoint_every=2")
    assert summary["steps"] == 2 and recipe.trainer.global_step == 2
    return run_dir, _policy(recipe)


@pytest.mark.timeout(180)
def test_a_finished_run_continued_to_more_steps_trains_the_added_steps(tmp_path, finished):
    first, weights = finished
    ckpt = first / "checkpoints" / "last.ckpt"
    recipe, summary = _train(tmp_path / "more", "recipe.num_steps=4", f"ckpt_path={ckpt}")
    assert recipe.trainer.global_step == 4  # 2 optimizer steps more (1 epoch, 1 minibatch each)
    rows = _rows(tmp_path / "more")
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert all(int(r["optimizer_steps"]) == 1 for r in rows)
    assert summary["status"] == "ok" and summary["steps"] == 4
    assert json.loads((tmp_path / "more" / "result.json").read_text())["steps"] == 4
    after = _policy(recipe)
    assert any(not torch.equal(weights[k], after[k]) for k in weights), "the weights never moved"

    # The checkpoint holds the weights, the optimizer, the rollout generator and the cursor:
    # the continued run's steps are those of one run of 4 steps.
    _, straight = _train(tmp_path / "straight", "recipe.num_steps=4")
    assert [r["reward"] for r in rows] == [r["reward"] for r in _rows(tmp_path / "straight")]
    assert summary["reward_last"] == straight["reward_last"]


@pytest.mark.timeout(120)
def test_the_same_num_steps_trains_nothing_and_says_so(tmp_path, finished, capsys):
    first, weights = finished
    ckpt = first / "checkpoints" / "last.ckpt"
    recipe, summary = _train(tmp_path / "same", "recipe.num_steps=2", f"ckpt_path={ckpt}")
    said = [line for line in capsys.readouterr().out.splitlines() if "nothing more to train" in line]
    assert said == [(f"[tq_plugin] {ckpt} finished all recipe.num_steps=2 RL steps: nothing "
                     f"more to train (set recipe.num_steps above 2 to continue the run)")]
    assert recipe.trainer.global_step == 2
    assert summary["steps"] == 2 and [int(r["step"]) for r in _rows(tmp_path / "same")] == [0, 1]
    after = _policy(recipe)
    assert all(torch.equal(weights[k], after[k]) for k in weights)


def test_fewer_steps_than_the_checkpoint_finished_is_refused(tmp_path, finished):
    from tq_plugin.config import ConfigError

    first, _ = finished
    with pytest.raises(ConfigError, match=r"recipe.num_steps: 1 is below the 2 RL steps .* "
                                          r"finished: set recipe.num_steps above 2"):
        _train(tmp_path / "fewer", "recipe.num_steps=1",
               f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}")

"""DAPO's dynamic sampling on the colocated step source (drop the groups whose rewards are all
equal, draw more until the step is full or ``max_draws``; every row not kept cleared from the
data plane), and the loss family, the sequence ratio, the reference KL and dynamic sampling
through ``tq-train recipe=grpo`` end to end (slow)."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli
from tq_plugin.config import RecipeConfig
from tq_plugin.data_plane import KVBatchMeta
from tq_plugin.rl.training.pipeline import Draw, DrawLoop, RowIO


def _source(draws: list[list[float]], *, prompts: int,
            max_draws: int) -> tuple[DrawLoop, list[str]]:
    """A draw loop (the generation side of every topology) whose draws return ``draws``'
    rewards (groups of 2), rows ``d<k>-<i>``; the ids it clears."""
    rc = RecipeConfig(algorithm="grpo", prompts_per_step=prompts, group_size=2,
                      dynamic_sampling=True, max_draws=max_draws)
    cleared: list[str] = []

    def clear(meta):
        assert meta.partition_id == "train"
        cleared.extend(meta.sample_ids)

    loop = DrawLoop(rc=rc, task=None, side=None, io=RowIO(read=None, write=None, clear=clear))

    def draw(engine, *, step: int, prompts: int, generator, partition_id: str,
             index: int = 0) -> Draw:
        rewards = torch.tensor(draws[index])
        meta = KVBatchMeta(partition_id=partition_id, task_name=None,
                           sample_ids=[f"d{index}-{i}" for i in range(len(rewards))])
        return Draw(meta, rewards, rewards.unsqueeze(1), 0, 0, {})

    loop.draw = draw
    loop.sample = lambda: loop.dynamic_sample(None, step=0, prompts=prompts, generator=None,
                                              partition_id="train")
    return loop, cleared


def test_zero_signal_groups_are_dropped_and_cleared_and_more_are_drawn():
    # Draw 0: groups [1 0] (signal), [1 1] (none), [0 0] (none); draw 1: [0 0], [0 1], [1 0].
    source, cleared = _source([[1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]], prompts=3, max_draws=4)
    batch = source.sample()
    assert batch.meta.sample_ids == ["d0-0", "d0-1", "d1-2", "d1-3", "d1-4", "d1-5"]
    assert batch.rewards.tolist() == [1, 0, 0, 1, 1, 0]
    assert sorted(cleared) == ["d0-2", "d0-3", "d0-4", "d0-5", "d1-0", "d1-1"]
    assert batch.figures == {"sampling/draws": 2.0, "sampling/groups_dropped": 3.0,
                             "sampling/groups_filled": 0.0}


def test_a_step_the_draws_do_not_fill_is_filled_with_the_last_draws_zero_signal_groups():
    source, cleared = _source([[1, 1, 0, 0], [0, 1, 1, 1]], prompts=2, max_draws=2)
    batch = source.sample()
    assert batch.meta.sample_ids == ["d1-0", "d1-1", "d1-2", "d1-3"]  # the signal, then a filler
    assert sorted(cleared) == ["d0-0", "d0-1", "d0-2", "d0-3"]
    assert batch.figures["sampling/groups_filled"] == 1.0
    assert batch.figures["sampling/groups_dropped"] == 2.0


def test_surplus_signal_groups_are_cleared_and_nan_rewards_carry_no_signal():
    nan = math.nan
    source, cleared = _source([[1, 0, nan, 1, 0, 1]], prompts=1, max_draws=1)
    batch = source.sample()
    assert batch.meta.sample_ids == ["d0-0", "d0-1"]
    assert sorted(cleared) == ["d0-2", "d0-3", "d0-4", "d0-5"]
    only_nan = Draw(batch.meta, torch.tensor([nan, 1.0]), torch.zeros(2, 1))
    assert only_nan.groups(2).tolist() == [False]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides", [
    ["recipe.loss_type=grpo", "recipe.importance_sampling_level=sequence"],
    ["recipe.loss_type=cispo", "recipe.beta=0.04", "recipe.dynamic_sampling=true"],
    ["recipe.loss_type=dr_grpo", "recipe.clip_eps_high=0.28", "recipe.mask_truncated_completions=true",
     "recipe.overlong_buffer=2"],
], ids=["gspo", "cispo-kl-dynamic", "dr_grpo-shaping"])
def test_the_loss_family_trains_end_to_end(monkeypatch, tmp_path, overrides):
    monkeypatch.setattr(sys, "argv", [
        "grpo", f"hydra.run.dir={tmp_path}", "recipe.num_steps=3", "recipe.prompts_per_step=4",
        "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false", *overrides])
    GlobalHydra.instance().clear()  # a config another test composed
    try:
        cli.main(config_name="grpo")
    finally:
        GlobalHydra.instance().clear()
    summary = json.loads((tmp_path / "result.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    if "recipe.beta=0.04" in overrides:
        assert any(float(r["kl_ref"]) > 0 for r in rows[1:])  # the policy has moved off the reference
        assert all(float(r["sampling/draws"]) >= 1 for r in rows)
    else:
        assert all(float(r["kl_ref"]) == 0 for r in rows)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"importance_sampling_level": "seq"}, "recipe.importance_sampling_level: must be one of"),
    ({"scale_rewards": "std"}, "recipe.scale_rewards: must be one of"),
    ({"kl_estimator": "k4"}, "recipe.kl_estimator: must be one of"),
    ({"cispo_cap": 0.2}, "recipe.cispo_cap: must be >= 1.0"),
    ({"beta": -0.1}, "recipe.beta: must be >= 0"),
    ({"overlong_buffer": 8}, r"recipe.overlong_buffer: must be below recipe.max_new_tokens \(8\)"),
    ({"reference_path": "x.safetensors"}, "recipe.reference_path: is read only with recipe.beta > 0"),
    ({"algorithm": "ppo", "dynamic_sampling": True}, "recipe.dynamic_sampling: needs recipe.algorithm=grpo"),
])
def test_a_bad_loss_family_key_is_a_config_error_naming_it(overrides, message):
    from tq_plugin.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        RecipeConfig(**{"algorithm": "grpo", **overrides})


def test_the_reference_is_a_frozen_copy_or_the_weights_reference_path_names(tmp_path):
    from tq_plugin.config import ConfigError
    from tq_plugin.rl.models.tiny import TinyTransformer
    from tq_plugin.rl.models.weights import save_weights
    from tq_plugin.rl.training.module import build_reference

    torch.manual_seed(0)
    policy, other = TinyTransformer(16, d_model=8, n_layers=1, n_heads=2), \
        TinyTransformer(16, d_model=8, n_layers=1, n_heads=2)
    copy_ = build_reference(policy, RecipeConfig(algorithm="grpo", beta=0.04))
    assert all(torch.equal(a, b) for a, b in zip(copy_.parameters(), policy.parameters()))
    assert not any(p.requires_grad for p in copy_.parameters())
    path = save_weights(other, tmp_path / "policy.safetensors", role="policy")
    loaded = build_reference(policy, RecipeConfig(algorithm="grpo", beta=0.04,
                                                  reference_path=str(path)))
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), other.parameters()))
    with pytest.raises(ConfigError, match="recipe.reference_path: .* must be a policy.safetensors"):
        build_reference(policy, RecipeConfig(algorithm="grpo", beta=0.04,
                                             reference_path=str(tmp_path / "missing")))

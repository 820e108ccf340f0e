"""``recipe.top_k`` / ``top_p`` / ``min_p`` / ``repetition_penalty`` through the colocated
recipe: each engine samples from the processed distribution and the trainer scores it the same
way, so the on-policy IS ratio ``rl/is_ratio_mean`` stays at 1 (scoring the full softmax would
put it near the kept mass, ~0.9 at ``top_p=0.9``); a bad value or an engine that cannot report
the processed logprobs stops at start with one line naming the key."""

from __future__ import annotations

import csv
import importlib.util

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin.config import ConfigError, RecipeConfig
from tq_plugin.rl.recipe import RLRecipe
from tq_plugin.rl.tasks.agent import AgentTask
from tq_plugin.rollout import EngineError
from tq_plugin.rollout.engine import SamplingParams

pytest.importorskip("transformers")
FAST = ["recipe.num_steps=2", "recipe.prompts_per_step=4", "recipe.ppo_epochs=1",
        "recipe.save_artifacts=true", "trainer.enable_progress_bar=false", "logger=csv"]
SAMPLING = ["recipe.top_p=0.9", "recipe.top_k=20"]
# Every control at once, strong enough to cut most of the tiny policy's mass.
ALL = ["recipe.top_p=0.6", "recipe.top_k=2", "recipe.min_p=0.05", "recipe.repetition_penalty=1.3"]
HF = ["model=hf_causal_lm"]


def recipe_for(tmp_path, overrides: list[str]) -> RLRecipe:
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=overrides)
    GlobalHydra.instance().clear()
    return RLRecipe(cfg, tmp_path)


def logged_rows(tmp_path) -> list[dict]:
    """The run dir's metrics.csv rows (one per RL step), each checked against the logger's row
    of the same optimizer step (one optimizer step per RL step here)."""
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    (path,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    with open(path) as f:
        logged = [r for r in csv.DictReader(f) if r.get("rl/is_ratio_mean")]
    assert [float(r["is_ratio_mean"]) for r in rows] == pytest.approx(
        [float(r["rl/is_ratio_mean"]) for r in logged], rel=1e-5)
    return rows


VLLM = [pytest.mark.slow, pytest.mark.timeout(300),
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]


@pytest.mark.parametrize(("engine", "controls"), [
    ("native", SAMPLING),
    ("hf", SAMPLING),
    pytest.param("vllm", SAMPLING, marks=VLLM),
    ("native", ALL),
    ("hf", ALL),
    pytest.param("vllm", ALL, marks=VLLM),
], ids=["native", "hf", "vllm", "native-all", "hf-all", "vllm-all"])
def test_on_policy_is_ratio_stays_at_one_under_top_p_and_top_k(tmp_path, engine, controls):
    model = [] if engine == "native" else HF
    recipe = recipe_for(tmp_path, [*model, f"engine={engine}", *FAST, *controls])
    recipe.setup()
    recipe.train()
    summary = recipe.cleanup()
    assert summary["engine"] == engine
    rows = logged_rows(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert 0.98 <= float(r["is_ratio_mean"]) <= 1.02, r
        # on-policy, every sampled token is in the trainer's kept set
        assert float(r["outside_kept_fraction"]) == 0.0


def test_the_full_softmax_would_bias_the_ratio_by_the_kept_mass(tmp_path, monkeypatch):
    """The check above can fail: a trainer that ignores the controls (its scoring unprocessed)
    puts the on-policy ratio near the kept mass, out of [0.98, 1.02]."""
    from tq_plugin.rl.training import module

    real = module.TokenScoring

    def unprocessed(**kwargs):
        return real(**{**kwargs, "controls": None})

    monkeypatch.setattr(module, "TokenScoring", unprocessed)
    recipe = recipe_for(tmp_path, [*FAST, *ALL])
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    assert all(float(r["is_ratio_mean"]) < 0.9 for r in logged_rows(tmp_path))


@pytest.mark.parametrize(("key", "value", "rule"), [
    ("top_p", 0.0, "must be in (0, 1]"),
    ("top_p", 1.5, "must be in (0, 1]"),
    ("top_k", -1, "0: off"),
    ("top_k", 2.5, "whole number"),
    ("min_p", 1.5, "must be in [0, 1]"),
    ("repetition_penalty", 0.0, "must be > 0"),
])
def test_a_bad_value_is_one_line_naming_the_key_and_the_rule(key, value, rule):
    with pytest.raises(ConfigError) as err:
        RecipeConfig(**{key: value})
    message = str(err.value)
    assert message.startswith(f"recipe.{key}") and rule in message and "\n" not in message
    with pytest.raises(ValueError, match=key):
        SamplingParams(max_new_tokens=1, **{key: value})


def test_vllm_without_processed_logprobs_refuses_at_start(tmp_path):
    recipe = recipe_for(tmp_path, [*HF, "engine=vllm", "engine.logprobs_mode=raw_logprobs",
                                   *FAST, "recipe.min_p=0.1"])
    with pytest.raises(EngineError, match=r"^engine=vllm: recipe.min_p needs "
                                          r"engine.logprobs_mode=processed_logprobs"):
        recipe.setup()


def test_the_agent_task_refuses_the_recipes_controls():
    """task=agent samples as the agent's own requests ask: the recipe's controls never reach
    the endpoint, so they are refused rather than ignored."""
    with pytest.raises(ConfigError, match=r"^recipe.repetition_penalty: task=agent"):
        AgentTask.check_recipe(None, RecipeConfig(algorithm="grpo", repetition_penalty=1.1))
    AgentTask.check_recipe(None, RecipeConfig(algorithm="grpo"))

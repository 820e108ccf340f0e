"""The ``engine`` group wired into the colocated recipe: the engine serves the policy from the
run dir's HF checkpoint, is synced before each step's rollouts, and its staged logprobs equal
the trainer's recomputation; a combination that cannot run stops at setup naming ``engine``."""

from __future__ import annotations

import importlib.util

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin.rl.recipe import RLRecipe
from tq_plugin.rollout import EngineError

pytest.importorskip("transformers")
FAST = ["recipe.num_steps=3", "recipe.prompts_per_step=4", "recipe.ppo_epochs=1",
        "recipe.save_artifacts=true", "trainer.enable_progress_bar=false", "logger=csv"]
HF = ["model=hf_causal_lm"]


def recipe_for(tmp_path, overrides: list[str], name: str = "grpo") -> RLRecipe:
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose(name, overrides=overrides)
    GlobalHydra.instance().clear()
    return RLRecipe(cfg, tmp_path)


def run(tmp_path, overrides: list[str], name: str = "grpo") -> dict:
    recipe = recipe_for(tmp_path, overrides, name)
    recipe.setup()
    recipe.train()
    return recipe.cleanup()


def test_the_default_engine_is_native_and_needs_no_sync(tmp_path):
    summary = run(tmp_path, FAST)
    assert summary["engine"] == "native"
    assert summary["max_logprob_gap"] < 1e-4


@pytest.mark.parametrize("engine", [
    "hf",
    pytest.param("vllm", marks=[
        pytest.mark.slow, pytest.mark.timeout(300),
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]),
])
def test_an_engine_with_its_own_weights_is_synced_before_each_step(tmp_path, engine):
    summary = run(tmp_path, [*HF, f"engine={engine}", *FAST])
    assert summary["engine"] == engine
    assert (tmp_path / "engine_init" / "config.json").is_file()
    assert summary["weight_syncs"] == 2  # before steps 1 and 2; step 0 is the checkpoint
    # The staged engine logprobs equal the trainer's recomputation with the synced weights.
    assert summary["max_logprob_gap"] < 1e-4


@pytest.mark.parametrize(("overrides", "match"), [
    (["engine=vllm"], "engine=vllm serves an HF-format policy: use model=hf_causal_lm"),
    (["engine=hf"], "engine=hf serves an HF-format policy"),
    ([*HF, "engine=hf", "tq/staging=media"], "engine=hf reads no pixels"),
    (["model=hf_causal_lm", "model.n_heads=4", "engine=vllm"],
     "engine=vllm: vLLM's CPU attention fails on head_dim=16"),
    ([*HF, "engine=vllm", "trainer=ddp_cpu"], "engine=vllm runs with one trainer process"),
])
def test_a_combination_that_cannot_run_stops_at_setup_naming_engine(tmp_path, overrides, match):
    recipe = recipe_for(tmp_path, [*overrides, *FAST])
    if "head_dim" in match and importlib.util.find_spec("vllm") is None:
        match = "engine=vllm"
    with pytest.raises(EngineError, match=match):
        recipe.setup()


def _unsynced_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "did a weight sync not happen" in r.getMessage()]


@pytest.mark.parametrize("sync", [True, False])
def test_a_weight_sync_that_did_not_happen_shows(tmp_path, caplog, monkeypatch, sync):
    """TRL #5312 trained for hours on the initial checkpoint: here an engine whose syncs are
    dropped keeps serving step 0's weights, and the IS figures of the on-policy rows say so
    (a warning naming rl/is_ratio_mean and rl/gen_logprob_abs_diff); synced, they stay quiet."""
    from tq_plugin.rollout.engines.hf import HFEngine

    if not sync:  # the push "succeeds" and changes nothing, as a silent non-sync does
        monkeypatch.setattr(HFEngine, "update_weights",
                            lambda self, weights, *, version: setattr(self, "weight_version", version))
    caplog.set_level("WARNING", logger="tq_plugin.rl.training.metrics")
    summary = run(tmp_path, [*HF, "engine=hf", *FAST, "recipe.num_steps=4", "recipe.lr=3e-2"])
    if sync:
        assert summary["max_logprob_gap"] < 1e-4
        assert _unsynced_warnings(caplog) == []
    else:
        assert summary["max_logprob_gap"] > 0.1
        assert _unsynced_warnings(caplog), "an unsynced engine must be reported"

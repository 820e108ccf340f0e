"""Each recipe runs a few steps in-process through its real entry point (patched argv)."""

from __future__ import annotations

import csv
import json
import logging
import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli

FAST = ["recipe.num_steps=2", "recipe.ppo_epochs=2", "recipe.prompts_per_step=4",
        "trainer.enable_progress_bar=false"]


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    yield
    GlobalHydra.instance().clear()


def run_entry(monkeypatch, tmp_path, config_name: str, *overrides: str) -> dict:
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [config_name, f"hydra.run.dir={tmp_path}", *FAST, *overrides])
    cli.main(config_name=config_name)
    return json.loads((tmp_path / "result.json").read_text())


def metrics_rows(tmp_path) -> list[dict]:
    with open(tmp_path / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    ("config_name", "overrides"),
    [
        ("ppo", ["tq/packing=sequence_packing"]),
        ("grpo", ["tq/packing=dynamic_batching"]),
        ("ppo", ["tq/packing=none", "tq/staging=media"]),
        ("grpo", ["tq/packing=sequence_packing", "tq/staging=media"]),
    ],
    ids=["ppo-packed", "grpo-dynamic", "ppo-none-media", "grpo-packed-media"],
)
def test_recipe_runs_and_writes_its_artifacts(monkeypatch, tmp_path, config_name, overrides):
    summary = run_entry(monkeypatch, tmp_path, config_name, *overrides)
    assert summary["status"] == "ok" and summary["steps"] == 2
    for name in ("metrics.csv", "resolved_config.yaml", "reward_curve.png", "result.json"):
        assert (tmp_path / name).is_file(), name
    rows = metrics_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert all(int(r["failed_calls"]) == 0 for r in rows)
    assert all(int(r["train_tokens"]) > 0 and int(r["microbatches"]) > 0 for r in rows)
    assert summary["dp_bytes"] > 0 and summary["tokens_per_s"] > 0
    # The engine's staged logprobs and the policy's recomputation over the training rows agree:
    # rows, masks, padding (and, with media, the pixels) line up end to end.
    assert summary["max_logprob_gap"] < 1e-4
    if "tq/packing=sequence_packing" in overrides:
        assert summary["padded_fraction"] == 0.0
    if "tq/packing=none" in overrides:
        assert summary["padded_fraction"] > 0.0


def test_packing_changes_cost_not_the_update(monkeypatch, tmp_path):
    """Same seed, same rollouts: the first update's loss is the same under every packing mode."""
    losses = {}
    for mode in ("none", "sequence_packing", "dynamic_batching"):
        out = tmp_path / mode
        run_entry(monkeypatch, out, "ppo", f"tq/packing={mode}", "recipe.num_steps=1",
                  "recipe.ppo_epochs=1")
        losses[mode] = float(metrics_rows(out)[0]["loss"])
    ref = losses["none"]
    assert all(abs(v - ref) < 1e-4 * max(1.0, abs(ref)) for v in losses.values()), losses


def test_media_policy_reads_the_staged_pixels(monkeypatch, tmp_path):
    """In media mode the prompt text holds only a placeholder: scrambling the staged pixels
    changes the policy's recomputed logprobs (the model conditions on them)."""
    import torch
    from hydra import compose, initialize_config_module

    from tq_plugin.rl.recipe import RLRecipe

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("ppo", overrides=["tq/staging=media", *FAST])
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    policy = recipe.module.policy
    ids = torch.tensor([[1, 6, 15, 3]])
    patches = recipe.task.draw(0, torch.Generator().manual_seed(0))["imgs"][0]
    other = recipe.task.draw(3, torch.Generator().manual_seed(0))["imgs"][0]
    assert not torch.allclose(policy(ids, image_patches=patches), policy(ids, image_patches=other))

"""``recipe.inflight_updates=true`` through the recipe: refused where it cannot run (fast), and
one two-worker Ray run whose workers take new weights mid-generation (slow)."""

from __future__ import annotations

import csv
import json

import pytest
from hydra import compose, initialize_config_module

from tq_plugin.rl.recipe import RLRecipe

RAY = ["tq/backend=ray", "recipe.topology=disaggregated", "recipe.max_staleness=1",
       "tq.backend.ray_init.num_cpus=null", "recipe.rollout_workers=2",
       "recipe.inflight_updates=true", "trainer.enable_progress_bar=false"]


def _compose(*overrides: str):
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        return compose("grpo", overrides=list(overrides))


@pytest.mark.usefixtures("fresh_hydra")
@pytest.mark.parametrize(("overrides", "match"), [
    (["recipe.inflight_updates=true"],
     "recipe.inflight_updates=true: recipe.topology=colocated generates every step"),
    ([*RAY, "model=hf_causal_lm", "engine=vllm"],
     "recipe.inflight_updates=true with engine=vllm needs recipe.inflight.kv=recompute, not 'keep'"),
    ([*RAY, "recipe.inflight.kv=drop"], "recipe.inflight.kv: must be one of"),
    ([*RAY, "recipe.inflight.chunk_tokens=0"], "recipe.inflight.chunk_tokens: must be > 0"),
])
def test_inflight_updates_are_refused_where_they_cannot_run(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        RLRecipe(_compose(*overrides), tmp_path).setup()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("fresh_hydra")
def test_two_hf_workers_take_weights_mid_generation_within_the_bound(tmp_path, ray_session):
    """The Done-when command with ``engine=hf`` (``model=hf_causal_lm``), completions long
    enough (up to 48 tokens, one PPO epoch a step) that rollouts outlast a trainer step, so a
    version lands while the workers decode: rows span two versions, every token within the
    bound. (At the preset's 8 tokens a step's rollouts end before the trainer's step does and
    the next version lands between tickets: docs/topologies.md.) With ``kv=recompute`` a token
    of the trainer's own version was sampled by exactly the weights that score it, so the
    ledger's alignment check (``fresh_logprob_gap``) is ~0 (``kv=keep``'s tokens after a load
    are the old cache's: tests/rollout/test_inflight.py). ``engine=native``'s decode
    takes weights mid-generation in tests/rollout/test_inflight.py; its runs resume with
    in-flight updates on in tests/rl/topology/test_async_resume.py."""
    cfg = _compose(*RAY, "model=hf_causal_lm", "engine=hf", "recipe.num_steps=6",
                   "recipe.ppo_epochs=1", "recipe.max_new_tokens=48", "model.max_seq_len=112",
                   "recipe.inflight.kv=recompute")
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.source.stop()
    result = json.loads((tmp_path / "result.json").read_text())
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert result["status"] == "ok" and result["steps"] == 6 and result["workers_lost"] == 0
    # Every step's tokens within the bound, nothing masked; some step's rows span two versions
    # and took weights mid-generation; tokens after an update are fresher than their row's start.
    for r in rows:
        assert 0 <= int(r["token_staleness_max"]) <= 1, r
        assert 0.0 <= float(r["token_staleness_mean"]) <= float(r["token_staleness_max"])
        assert int(r["tokens_masked_stale"]) == 0 and int(r["rows_masked_stale"]) == 0
    assert max(float(r["multi_version_fraction"]) for r in rows) > 0, rows
    assert max(float(r["inflight/weights_taken"]) for r in rows) > 0, rows
    assert any(float(r["token_staleness_mean"]) < int(r["staleness_max"]) for r in rows[1:])
    # The fresh tokens (step 0's all, later steps' after a load) score as they were sampled.
    assert sum(float(r["fresh_tokens"]) for r in rows[1:]) > 0, rows
    assert all(float(r["fresh_logprob_gap"]) < 1e-3 for r in rows), rows

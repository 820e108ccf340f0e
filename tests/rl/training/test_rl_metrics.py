"""The recipe's figures reach Lightning's logger, and clipfrac is a fraction.

Lightning fetches one batch ahead, so step s + 1 is prepared (its reward and loss normalizer
set) before step s's last microbatch trains; these tests pin that every microbatch is still
booked on its own step.
"""

from __future__ import annotations

import csv
import logging
import sys

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli
from tq_plugin.data_plane import KVBatchMeta
from tq_plugin.lightning.module import MICROBATCH_INFO
from tq_plugin.rl.training.metrics import MetricsLog

RL_KEYS = ("rl/loss", "rl/clipfrac", "rl/approx_kl", "rl/value_loss", "rl/entropy", "rl/reward",
           "rl/tokens_per_s", "rl/is_ratio_mean", "rl/is_ratio_max", "rl/is_masked_fraction",
           "rl/gen_logprob_abs_diff")


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    yield
    GlobalHydra.instance().clear()


def _rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _mb(step: int, epoch: int, last_in_step: bool) -> KVBatchMeta:
    info = {"step": step, "epoch": epoch, "global_batch": 0, "index": 0, "count": 1,
            "last_in_global_batch": True, "last_in_step": last_in_step}
    return KVBatchMeta(partition_id="train", task_name="train", sample_ids=["a"],
                       extra_info={MICROBATCH_INFO: info})


def test_metrics_book_each_microbatch_on_its_own_step_under_prefetch(tmp_path):
    log = MetricsLog(tmp_path, packing="none")
    ready = {"rewards": torch.ones(2), "turn_scores": torch.ones(2, 2), "rollout_s": 0.0,
             "prepare_s": 0.0, "failed_calls": 0, "lp_gap": 0.0, "dp": None}
    stats = {"clipped_tokens": 9.0, "action_tokens": 10.0, "kl_sum": 1.0, "loss": 0.5,
             "real_tokens": 10.0, "padded_tokens": 10.0, "seconds": 0.1}
    epochs = 4
    log.on_step_ready(0, **ready)
    for step in range(3):
        for epoch in range(epochs):
            if epoch == epochs - 1 and step < 2:  # the loader prepares the next step first
                log.on_step_ready(step + 1, **ready)
            log.on_microbatch(_mb(step, epoch, epoch == epochs - 1), stats)
    rows = [s.row() for s in log.steps]
    assert [r["microbatches"] for r in rows] == [4, 4, 4]
    assert [r["optimizer_steps"] for r in rows] == [4, 4, 4]
    assert all(r["clipfrac"] == pytest.approx(0.9) for r in rows)
    assert all(r["loss"] == pytest.approx(0.5) and r["approx_kl"] == pytest.approx(0.1)
               for r in rows)


def test_short_run_logs_rl_metrics_to_lightning_and_clipfrac_stays_a_fraction(
        monkeypatch, tmp_path):
    # A large learning rate and several epochs: many tokens leave the clip range.
    monkeypatch.setattr(sys, "argv", [
        "ppo", f"hydra.run.dir={tmp_path}", "recipe.num_steps=5", "recipe.ppo_epochs=4",
        "recipe.prompts_per_step=4", "recipe.lr=0.03", "trainer.enable_progress_bar=false",
        "tq/packing=none", "tq.packing.micro_batch_size=4"])
    cli.main(config_name="ppo")
    steps = _rows(tmp_path / "metrics.csv")
    clipfrac = [float(r["clipfrac"]) for r in steps]
    assert all(0.0 <= c <= 1.0 for c in clipfrac), clipfrac
    assert max(clipfrac) > 0.2, clipfrac  # the run does clip: the bound is not vacuous
    (logged_csv,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    logged = [r for r in _rows(logged_csv) if r.get("rl/loss")]
    assert logged and all(r[k] != "" for r in logged for k in RL_KEYS)
    assert all(0.0 <= float(r["rl/clipfrac"]) <= 1.0 for r in logged)
    assert {int(float(r["rl/step"])) for r in logged} == set(range(5))
    # The first epoch of a step trains on unchanged weights: ratio 1, nothing clipped.
    assert float(logged[0]["rl/clipfrac"]) == 0.0
    assert float(logged[0]["rl/approx_kl"]) == pytest.approx(0.0, abs=1e-6)
    # Colocated, the engine is the trained policy: no mismatch, nothing masked.
    for r in logged:
        assert float(r["rl/gen_logprob_abs_diff"]) < 1e-4
        assert float(r["rl/is_ratio_mean"]) == pytest.approx(1.0, abs=1e-4)
        assert float(r["rl/is_masked_fraction"]) == 0.0

"""``logger=wandb`` and ``logger=mlflow`` write a real run inside the run dir, with no network:
wandb offline (the default, WANDB_MODE unset), MLflow into a local file store."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli

FAST = ["recipe.num_steps=2", "recipe.ppo_epochs=1", "recipe.prompts_per_step=4",
        "trainer.enable_progress_bar=false"]


def run(monkeypatch, tmp_path, *overrides: str) -> dict:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["grpo", f"hydra.run.dir={tmp_path}", *FAST, *overrides])
    try:
        cli.main(config_name="grpo")
    finally:
        GlobalHydra.instance().clear()
    return json.loads((tmp_path / "result.json").read_text())


def test_a_callback_monitoring_an_rl_figure_finds_it(monkeypatch, tmp_path):
    """The module hands its rl/* figures to the loggers directly (not through self.log), and
    puts them in trainer.callback_metrics too: a ModelCheckpoint monitoring rl/loss saves."""
    ckpts = tmp_path / "ckpts"
    overrides = ["trainer.enable_checkpointing=true",
                 "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                 "+callbacks.ckpt.monitor=rl/loss", "+callbacks.ckpt.mode=min",
                 "+callbacks.ckpt.every_n_train_steps=1", f"+callbacks.ckpt.dirpath={ckpts}",
                 "+callbacks.ckpt.filename=best"]
    assert run(monkeypatch, tmp_path, *overrides)["status"] == "ok"
    assert (ckpts / "best.ckpt").is_file()


@pytest.mark.slow  # wandb starts its service process: ~30 s on 2 busy cores
@pytest.mark.timeout(180)
def test_wandb_writes_an_offline_run_inside_the_run_dir(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # save_dir wins
    try:
        assert run(monkeypatch, tmp_path, "logger=wandb")["status"] == "ok"
    finally:
        wandb.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))[:20]
    (log,) = runs[0].glob("*.wandb")  # the run's transaction log, what `wandb sync` uploads
    assert b"rl/reward" in log.read_bytes()


@pytest.mark.timeout(180)
def test_mlflow_writes_a_local_store_inside_the_run_dir(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    assert run(monkeypatch, tmp_path, "logger=mlflow")["status"] == "ok"
    rewards = list((tmp_path / "mlruns").glob("*/*/metrics/rl/reward"))
    assert len(rewards) == 1, list((tmp_path / "mlruns").rglob("*"))[:30]
    lines = rewards[0].read_text().split("\n")
    assert len([line for line in lines if line]) == 2  # one per optimizer step


@pytest.mark.timeout(180)
def test_several_loggers_at_once(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    run(monkeypatch, tmp_path, "logger=[csv,mlflow]")
    assert list((tmp_path / "mlruns").glob("*/*/metrics/rl/reward"))
    assert list((tmp_path / "lightning_logs").glob("version_*/metrics.csv"))

"""The sweep comparison aggregates per setting: seeds and jobs a packing mode cannot tell apart."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tq_plugin.rl.training.sweep_report import setting_of, write_report


def _job(sweep, num, overrides, **result):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    (job / "result.json").write_text(json.dumps({"status": "ok", **result}))


def test_setting_drops_the_seed_and_keys_the_mode_ignores():
    assert setting_of("tq/packing=none tq.packing.train_mb_tokens=256 recipe.seed=3") == \
        "tq/packing=none"
    assert setting_of("tq/packing=sequence_packing tq.packing.train_mb_tokens=256 recipe.seed=1") \
        == "tq/packing=sequence_packing tq.packing.train_mb_tokens=256"


def test_report_gives_mean_and_std_per_setting(tmp_path):
    num = 0
    for mode in ("none", "sequence_packing"):
        for budget in (256, 1024):
            for seed, reward in ((0, 0.4), (1, 0.6)):
                _job(tmp_path, num, [f"tq/packing={mode}", f"tq.packing.train_mb_tokens={budget}",
                                     f"recipe.seed={seed}"],
                     reward_last_avg=reward, tokens_per_s=100.0 * (seed + 1),
                     padded_fraction=0.1, peak_rss_mb=400.0)
                num += 1
    report = write_report(tmp_path)
    settings = {e["setting"]: e for e in report["settings"]}
    assert set(settings) == {"tq/packing=none",
                             "tq/packing=sequence_packing tq.packing.train_mb_tokens=256",
                             "tq/packing=sequence_packing tq.packing.train_mb_tokens=1024"}
    assert settings["tq/packing=none"]["jobs"] == 4  # two budgets x two seeds: one setting
    packed = settings["tq/packing=sequence_packing tq.packing.train_mb_tokens=256"]
    assert packed["reward_last_avg_mean"] == pytest.approx(0.5)
    assert packed["reward_last_avg_std"] == pytest.approx(0.1414, abs=1e-3)
    assert packed["tokens_per_s_mean"] == pytest.approx(150.0)
    assert "± " in (tmp_path / "comparison_by_setting.md").read_text()
    assert (tmp_path / "comparison_by_setting.csv").exists()
    assert (tmp_path / "comparison.png").stat().st_size > 0

"""The run's figure: one panel per figure, the eval reward beside the train reward."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tq_plugin.rl.training.plots import PANELS, _series, plot_run, run_title

matplotlib = pytest.importorskip("matplotlib")


def test_series_skips_steps_without_a_number():
    rows = [{"step": 0, "eval/reward": ""}, {"step": 1, "eval/reward": "0.5"},
            {"step": 2, "eval/reward": "nan"}, {"step": 3}]
    assert _series(rows, "eval/reward") == ([1.0], [0.5])


def test_the_figure_has_every_panel_and_the_eval_points(tmp_path, monkeypatch):
    drawn = {}
    import matplotlib.axes

    original = matplotlib.axes.Axes.plot

    def record(self, xs, ys, *args, label=None, **kwargs):
        drawn[label] = list(ys)
        return original(self, xs, ys, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    rows = [{"step": s, "reward": 0.1 * s, "loss": -0.1, "value_loss": 0.0, "kl_ref": 0.0,
             "approx_kl": 0.01, "entropy": 1.0, "tokens_per_s": 100.0,
             "eval/reward": "0.4" if s == 2 else ""} for s in range(4)]
    out = plot_run(rows, tmp_path / "reward_curve.png", title="grpo · m · engine hf")
    assert out is not None and out.stat().st_size > 0
    assert drawn["eval (greedy)"] == [0.4]
    assert drawn["train (mean over turns)"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    # GRPO's zero value loss and a zero reference KL (beta = 0) are not drawn.
    assert "value loss" not in drawn and "to the reference" not in drawn
    assert len(PANELS) == 5


def test_the_title_names_recipe_model_and_engine():
    cfg = OmegaConf.create({"recipe": {"algorithm": "ppo"}, "model": {"name": "hf_causal_lm"},
                            "engine": {"name": "vllm"}})
    assert run_title(cfg) == "ppo · hf_causal_lm · engine vllm"
    assert run_title(OmegaConf.create({})) == "? · ? · engine native"

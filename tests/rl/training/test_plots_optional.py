"""matplotlib is the ``plot`` extra: without it runs and sweep reports skip their plots."""

from __future__ import annotations

import json
import sys

from tq_plugin.rl.training.plots import plot_run
from tq_plugin.rl.training.sweep_report import write_report


def test_no_matplotlib_no_plots_and_no_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    assert plot_run([{"step": 0, "reward": 0.5}], tmp_path / "reward_curve.png", title="t") is None
    assert not (tmp_path / "reward_curve.png").exists()
    job = tmp_path / "sweep" / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- tq/packing=none\n")
    (job / "result.json").write_text(json.dumps({"status": "ok", "tokens_per_s": 1.0}))
    report = write_report(tmp_path / "sweep")
    assert report["failed"] == 0 and (tmp_path / "sweep" / "comparison.md").exists()
    assert not (tmp_path / "sweep" / "comparison.png").exists()

"""``tq-train -m hydra/launcher=joblib``: a packing sweep's jobs run in parallel processes, the
dedup sweeper still launches each distinct run once and the per-setting comparison is written."""

from __future__ import annotations

import csv
import subprocess
import sys
from datetime import datetime

import pytest

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")


def _span(log):
    stamps = [datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
              for line in log.read_text().splitlines() if line.startswith("[20")]
    return min(stamps), max(stamps)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_job_packing_sweep_runs_its_jobs_in_parallel(tmp_path):
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable, "-m", "tq_plugin.cli", "-m", "hydra/sweeper=tq_dedup",
        "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
        # none ignores the token budget: 4 combinations, 2 distinct runs (one per seed).
        "tq/packing=none", "tq.packing.train_mb_tokens=256,1024", "recipe.seed=0,1",
        "recipe.num_steps=8", "recipe.ppo_epochs=1", "recipe.prompts_per_step=4",
        "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=560,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Joblib.Parallel" in proc.stdout + proc.stderr

    with open(sweep_dir / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["overrides"] for r in rows) == ["recipe.seed=0", "recipe.seed=1"]
    assert all(r["status"] == "ok" for r in rows)
    with open(sweep_dir / "comparison_by_setting.csv") as f:
        (setting,) = list(csv.DictReader(f))
    assert (setting["jobs"], setting["ok"]) == ("2", "2"), setting
    # Both jobs were training at the same time.
    (a0, a1), (b0, b1) = (_span(sweep_dir / str(i) / "tq-train.log") for i in (0, 1))
    assert a0 < b1 and b0 < a1, ((a0, a1), (b0, b1))

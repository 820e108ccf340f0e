"""``tq-train -m hydra/launcher=joblib``: a packing sweep's jobs run in a pool of worker
processes, the dedup sweeper still launches each distinct run once and the per-setting comparison
is written. Whether the two jobs' training overlapped in time is a timing property (it depends on
the machine's load), so the test checks the processes, not the clock."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")


def _pids(log):
    """The process ids a job's log lines were written from (the format below puts one on each)."""
    return {int(m) for m in re.findall(r"^\[pid (\d+)\]", log.read_text(), flags=re.MULTILINE)}


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
        "hydra.job_logging.formatters.simple.format='[pid %(process)d] %(message)s'",
    ]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path) as proc:
        out, err = proc.communicate(timeout=560)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert re.search(r"Joblib\.Parallel\((.*,)?n_jobs=2(,.*)?\) is launching 2 jobs", out + err), \
        (out + err)[-3000:]

    with open(sweep_dir / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["overrides"] for r in rows) == ["recipe.seed=0", "recipe.seed=1"]
    assert all(r["status"] == "ok" for r in rows)
    with open(sweep_dir / "comparison_by_setting.csv") as f:
        (setting,) = list(csv.DictReader(f))
    assert (setting["jobs"], setting["ok"]) == ("2", "2"), setting
    # Each job ran, start to end, in a worker process of the pool: not in the sweep's own process.
    pids = [_pids(sweep_dir / str(i) / "tq-train.log") for i in (0, 1)]
    assert all(len(p) == 1 for p in pids), pids
    assert proc.pid not in pids[0] | pids[1], (proc.pid, pids)

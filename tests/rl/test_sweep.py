"""One subprocess multirun over the packing modes ends with the comparison in the sweep dir."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_packing_sweep_writes_comparison_and_reports_failed_jobs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable, "-m", "tq_plugin.cli", "-m",
        "tq/packing=none,sequence_packing,dynamic_batching",
        # 16 tokens cannot hold one row: the packed and dynamic jobs at 16 fail, the others run.
        "tq.packing.train_mb_tokens=16,1024",
        "recipe.num_steps=2", "recipe.ppo_epochs=1", "recipe.prompts_per_step=4",
        "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # failures are reported

    with open(sweep_dir / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    status = {r["overrides"]: r["status"] for r in rows}
    for mode in ("none", "sequence_packing", "dynamic_batching"):
        assert status[f"tq/packing={mode} tq.packing.train_mb_tokens=1024"] == "ok"
    assert status["tq/packing=none tq.packing.train_mb_tokens=16"] == "ok"
    for mode in ("sequence_packing", "dynamic_batching"):
        assert status[f"tq/packing={mode} tq.packing.train_mb_tokens=16"] == "failed"
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["peak_rss_mb"]) > 0 for r in ok)
    assert all(r["reward_last"] != "" for r in ok)
    packed = next(r for r in ok if "sequence_packing" in r["overrides"])
    unpacked = next(r for r in ok if "tq/packing=none" in r["overrides"])
    assert float(packed["padded_fraction"]) < float(unpacked["padded_fraction"])
    failed = [r for r in rows if r["status"] == "failed"]
    assert all("train_mb_tokens" in r["error"] or "16" in r["error"] for r in failed), failed

    table = (sweep_dir / "comparison.md").read_text()
    assert table.count("\n| ") == 6 + 1 - 1 and "Failed jobs:" in table
    assert (sweep_dir / "comparison.png").stat().st_size > 0

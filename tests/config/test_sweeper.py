"""``hydra/sweeper=tq_dedup`` launches each distinct run once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tq_plugin.config.sweeps import run_key, setting_key

APP = """
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path=None)
def main(cfg):
    hc = HydraConfig.get()
    print("JOB", hc.job.num, " ".join(hc.overrides.task), flush=True)

main()
"""


def test_run_key_leaves_out_what_the_mode_ignores():
    none_a = run_key(["tq/packing=none", "tq.packing.train_mb_tokens=256", "recipe.seed=0"])
    none_b = run_key(["tq.packing.train_mb_tokens=1024", "tq/packing=none", "recipe.seed=0"])
    assert none_a == none_b
    packed = [run_key(["tq/packing=sequence_packing", f"tq.packing.train_mb_tokens={t}"])
              for t in (256, 1024)]
    assert packed[0] != packed[1]
    # The mode may come from the primary config's default rather than an override.
    assert run_key(["tq.packing.train_mb_tokens=256"], "none") == ()
    assert run_key(["tq.packing.train_mb_tokens=256"], "dynamic_batching") == \
        ("tq.packing.train_mb_tokens=256",)
    assert run_key(["recipe.seed=0"]) != run_key(["recipe.seed=1"])
    assert setting_key(["recipe.seed=0", "tq/packing=none"]) == ("tq/packing=none",)


@pytest.mark.slow
def test_multirun_skips_jobs_that_repeat_a_run(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    cmd = [sys.executable, "app.py", "-m", "hydra/sweeper=tq_dedup",
           "+tq/packing=none,sequence_packing", "tq.packing.train_mb_tokens=256,1024",
           "+seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         check=True)
    jobs = [line.split(" ", 2)[2] for line in out.stdout.splitlines() if line.startswith("JOB ")]
    # none x 2 budgets x 2 seeds is 2 runs, sequence_packing x 2 budgets x 2 seeds is 4.
    assert len(jobs) == 6, out.stdout
    assert sum("tq/packing=none" in j for j in jobs) == 2
    assert len(set(jobs)) == 6

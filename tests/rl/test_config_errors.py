"""A bad override prints a short message naming the user-facing key (Hydra's convention);
``HYDRA_FULL_ERROR=1`` shows the whole trace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# 16 tokens cannot hold one row: the planner's budget error must name tq.packing.train_mb_tokens.
CASES = [
    (["tq.packing.train_mb_tokens=16"], "tq.packing.train_mb_tokens"),
    (["tq.packing.train_mb_tokens=0"], "tq.packing.train_mb_tokens: must be > 0"),
    (["tq/packing=none", "tq.packing.layout=packed"], "tq.packing.layout"),
]


def _run(tmp_path, overrides: list[str], full: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if full:
        env["HYDRA_FULL_ERROR"] = "1"
    cmd = [sys.executable, "-m", "tq_plugin.cli", f"hydra.run.dir={tmp_path}",
           "recipe.num_steps=1", "recipe.prompts_per_step=4", "trainer.enable_progress_bar=false",
           *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "key"), CASES, ids=[c[1].split(":")[0] for c in CASES])
def test_bad_override_prints_a_short_message_naming_the_key(tmp_path, overrides, key):
    proc = _run(tmp_path, overrides, full=False)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert any(key in line for line in err[-4:]), proc.stderr[-3000:]
    assert "max_tokens_per_microbatch" not in proc.stderr
    assert err[-1] == "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
    assert len(err) <= 4, err


@pytest.mark.slow
def test_full_error_shows_the_trace(tmp_path):
    proc = _run(tmp_path, ["tq.packing.train_mb_tokens=16"], full=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "tq.packing.train_mb_tokens" in proc.stderr

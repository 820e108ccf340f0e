"""``tq_plugin.train``: one run from Python. From a script in an empty folder it writes nothing
but its run dir; in this process it returns the run's figures, run dir and metrics rows, raises
a config mistake as ``ConfigError``, and leaves the caller's logging and Hydra state as they were.
``import tq_plugin`` stays light (no torch, Lightning or Hydra until the API is used)."""

from __future__ import annotations

import csv
import json
import logging
import subprocess
import sys
import textwrap

import pytest

FAST = {"recipe.prompts_per_step": 4, "recipe.ppo_epochs": 1,
        "trainer.enable_progress_bar": False}

SCRIPT = textwrap.dedent("""
    import json
    import sys

    import tq_plugin

    heavy = [m for m in ("torch", "lightning", "hydra") if m in sys.modules]
    result = tq_plugin.train("grpo", ["recipe.num_steps=3", {FAST!r}], output_dir="run")
    print("RESULT " + json.dumps({{"heavy_at_import": heavy, "run_dir": str(result.run_dir),
                                   "steps": result.steps, "rows": len(result.metrics)}}))
""")


@pytest.mark.timeout(180)
def test_a_script_in_an_empty_folder_writes_only_under_its_run_dir(tmp_path):
    work = tmp_path / "empty"
    work.mkdir()
    script = tmp_path / "notebook_like.py"
    script.write_text(SCRIPT.format(FAST=FAST))
    done = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True,
                          text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    assert got["heavy_at_import"] == []
    run_dir = work / "run"
    assert got["run_dir"] == str(run_dir.resolve()) and got["steps"] == 3 and got["rows"] == 3
    new = sorted(p.relative_to(work) for p in work.rglob("*"))
    outside = [str(p) for p in new if p.parts[0] != "run"]
    assert not outside, f"written outside the run dir: {outside}"
    assert {"metrics.csv", "result.json", "policy.safetensors", "tq-train.log"} <= {
        p.name for p in run_dir.iterdir()}


@pytest.mark.timeout(180)
def test_train_returns_the_runs_figures_run_dir_and_metrics_rows(tmp_path):
    from hydra import compose, initialize_config_module

    import tq_plugin
    from tq_plugin.api import TrainResult
    from tq_plugin.config import ConfigError

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = tmp_path / "a run"  # a space: the run dir is quoted for Hydra's grammar
    # A caller that composed a config of its own keeps its Hydra state.
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        result = tq_plugin.train("grpo", [{**FAST, "recipe.num_steps": 2}, "recipe.seed=1"],
                                 output_dir=out)
        assert compose("grpo").recipe.algorithm == "grpo"

    assert isinstance(result, TrainResult) and result.run_dir == out.resolve()
    assert result.summary == json.loads((out / "result.json").read_text())
    assert result.summary["status"] == "ok" and result.steps == 2
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in result.metrics] == [0, 1]
    assert [r["reward"] for r in result.metrics] == [float(r["reward"]) for r in rows]
    assert result.reward_last == result.metrics[-1]["reward"] == result.summary["reward_last"]
    assert TrainResult.load(out) == result
    # the run's own logging is taken down: later records do not land in its tq-train.log
    assert list(root.handlers) == handlers and root.level == level
    size = (out / "tq-train.log").stat().st_size
    logging.getLogger("tq_plugin").warning("after the run")
    assert (out / "tq-train.log").stat().st_size == size

    with pytest.raises(ConfigError, match=r"unknown config key 'recipe.learning_rate': did you "
                                          r"mean recipe.lr \(TRL's learning_rate\)\?$"):
        tq_plugin.train("grpo", {"recipe.learning_rate": 1e-4}, output_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match=r"^recipe.num_steps: must be > 0, got -1$"):
        tq_plugin.train("grpo", {"recipe.num_steps": -1}, output_dir=tmp_path / "bad")


def test_dict_values_reach_hydra_as_written():
    from tq_plugin.api import _override_strings

    assert _override_strings({"a": None, "b": True, "c": 1e-4, "d": "x y", "e": [1, "p/q"],
                              "f": "it's"}) == [
        "a=null", "b=true", "c=0.0001", "d='x y'", "e=[1,p/q]", "f='it\\'s'"]
    with pytest.raises(TypeError, match="neither a 'key=value' string nor a dict"):
        _override_strings([3])

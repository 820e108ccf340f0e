"""metrics.csv grows step by step (issue 37): a run killed part-way keeps every finished step."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from tq_plugin.lightning.module import MICROBATCH_INFO
from tq_plugin.rl.training.callbacks import StepHooks
from tq_plugin.rl.training.metrics import MetricsLog
from tq_plugin.rl.training.step_record import RL_STEP, STEP_FIGURES


def _rows(path):
    if not (path / "metrics.csv").exists():
        return []
    with open(path / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _ready(log: MetricsLog, step: int) -> None:
    log.on_step_ready(step, rewards=torch.tensor([0.25 * step, 1.0]), turn_scores=torch.zeros(2, 1),
                      rollout_s=0.5, prepare_s=0.1, failed_calls=0, lp_gap=0.0, dp=None)


def _meta(step: int, last: bool, figures: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(extra_info={
        MICROBATCH_INFO: {"step": step, "last_in_global_batch": last, "last_in_step": last,
                          "global_step": step},
        RL_STEP: {STEP_FIGURES: figures or {}}})


class _Never:
    def save_if_due(self, *args) -> None:
        pass

    def stop_if_requested(self, *args) -> None:
        pass


def test_each_finished_step_is_appended_as_the_next_trains(tmp_path) -> None:
    log = MetricsLog(tmp_path, packing="none")
    log.live = True
    hooks = StepHooks(metrics=log, periodic=_Never(), sigterm=_Never(), save_hf_every=None,
                      save_hf=lambda d: None, checkpoints_dir=tmp_path)
    trainer = SimpleNamespace(world_size=1)
    dp = SimpleNamespace(bytes_read=100, bytes_written=20)
    for step in range(3):
        _ready(log, step)
        hooks.after_microbatch(trainer, _meta(step, False), {"loss": 1.0}, dp)
        assert len(_rows(tmp_path)) == step  # the step is not finished yet
        figures = {"rewards/extra": 0.5} if step == 2 else None  # a column first seen late
        hooks.after_microbatch(trainer, _meta(step, True, figures), {"loss": 2.0}, dp)
        rows = _rows(tmp_path)
        assert [int(r["step"]) for r in rows] == list(range(step + 1))
        assert float(rows[-1]["reward"]) == pytest.approx(float(torch.tensor([0.25 * step, 1.0]).mean()))
    assert rows[-1]["rewards/extra"] == "0.5" and rows[0]["rewards/extra"] == ""
    assert int(rows[0]["dp_bytes"]) == 120
    # what a killed run leaves is what the run's own end would write for those steps
    log.finish({}, 120, save=False)
    assert [r["step"] for r in _rows(tmp_path)] == [str(s.row()["step"]) for s in log.steps]


def test_a_resumed_run_writes_the_restored_rows_first_and_ranks_wait_for_the_end(tmp_path) -> None:
    earlier = MetricsLog(tmp_path / "a", packing="none")
    _ready(earlier, 0)
    log = MetricsLog(tmp_path / "b", packing="none")
    log.live = True
    log.restored = list(earlier.steps)
    _ready(log, 1)
    log.step_finished(1)
    assert [r["step"] for r in _rows(tmp_path / "b")] == ["0", "1"]
    # several ranks: nothing until the reduced rows at the end; live off: nothing at all
    ddp = MetricsLog(tmp_path / "c", packing="none")
    ddp.live = True
    hooks = StepHooks(metrics=ddp, periodic=_Never(), sigterm=_Never(), save_hf_every=None,
                      save_hf=lambda d: None, checkpoints_dir=tmp_path)
    _ready(ddp, 0)
    hooks.after_microbatch(SimpleNamespace(world_size=2), _meta(0, True), {}, None)
    off = MetricsLog(tmp_path / "d", packing="none")
    _ready(off, 0)
    off.step_finished(0)
    assert not (tmp_path / "c" / "metrics.csv").exists()
    assert not (tmp_path / "d" / "metrics.csv").exists()


@pytest.mark.slow
def test_a_real_run_leaves_each_finished_step_on_disk_before_the_next_ends(
        tmp_path, train_in_process, monkeypatch) -> None:
    """tq-train (GRPO, 3 steps, in this process): after each step's last microbatch the file
    holds every finished step; the run's end rewrites it with the same steps."""
    seen: list[list[str]] = []
    original = MetricsLog.step_finished

    def spy(self, step, dp=None):
        original(self, step, dp)
        seen.append([r["step"] for r in _rows(self.output_dir)])

    monkeypatch.setattr(MetricsLog, "step_finished", spy)
    rows = train_in_process(tmp_path, "grpo", "recipe.num_steps=3", "recipe.ppo_epochs=1",
                            "recipe.prompts_per_step=4")
    assert seen == [["0"], ["0", "1"], ["0", "1", "2"]]
    assert [r["step"] for r in rows] == ["0", "1", "2"]

"""What a run prints: the banner first, one line per RL step off a terminal, the bar on one."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tq_plugin.rl.training.console import STEP_LOG, StepLines, banner, route_step_lines


def test_a_step_line_shows_reward_loss_kl_tokens_and_elapsed():
    line = StepLines(5).line(2, {"rl/reward": 0.25, "rl/loss": -0.0123, "rl/approx_kl": 3.1e-4,
                                 "rl/tokens_per_s": 14203.7})
    head, elapsed = line.rsplit(" | ", 1)
    assert head == "RL step 3/5 | reward 0.250 | loss -0.0123 | kl 3.10e-04 | tok/s 14204"
    assert elapsed.endswith(" s")


def test_the_reference_kl_is_shown_when_the_loss_has_one_and_missing_figures_are_left_out():
    line = StepLines(2).line(0, {"rl/reward": 1.0, "rl/approx_kl": 0.5, "rl/kl_ref": 0.01})
    assert "kl 1.00e-02" in line and "loss" not in line and "tok/s" not in line


def test_log_every_keeps_every_kth_step_the_last_and_the_evaluated(caplog):
    from types import SimpleNamespace

    from tq_plugin.lightning.module import MICROBATCH_INFO
    from tq_plugin.rl.training.evaluation import EVAL
    from tq_plugin.rl.training.step_record import RL_STEP

    lines = StepLines(7, every=3)
    trainer = SimpleNamespace(is_global_zero=True, callback_metrics={"rl/reward": 0.5})
    with caplog.at_level(logging.INFO, logger=STEP_LOG.name):
        for step in range(7):
            extra = {MICROBATCH_INFO: {"step": step, "last_in_step": True},
                     RL_STEP: {EVAL: {"accuracy": 0.5}} if step == 4 else {}}
            module = SimpleNamespace(dp_meta=SimpleNamespace(extra_info=extra))
            lines.on_train_batch_end(trainer, module, None, None, step)
            lines.on_train_batch_start(trainer, module, None, step + 1)
    shown = [r.getMessage().split(" | ")[0] for r in caplog.records if r.name == STEP_LOG.name]
    assert shown == ["RL step 3/7", "RL step 5/7", "RL step 6/7", "RL step 7/7"]


def test_the_banner_names_the_run_dir_first():
    text = banner(run_dir="/runs/x", recipe="grpo", model="tiny", engine="hf",
                  backend="LocalDataPlane", topology="colocated", steps=7)
    first, second = text.splitlines()
    assert first == "[tq_plugin] run dir: /runs/x"
    assert second.endswith("engine hf | backend LocalDataPlane | topology colocated | 7 RL steps")


def test_step_lines_stay_off_the_console_in_a_terminal_but_reach_the_log_file(tmp_path):
    root = logging.getLogger()
    console, file = logging.StreamHandler(sys.stdout), logging.FileHandler(tmp_path / "run.log")
    root.addHandler(console), root.addHandler(file)
    try:
        route_step_lines(terminal=True)
        record = logging.LogRecord(STEP_LOG.name, logging.INFO, __file__, 1, "x", None, None)
        assert not console.filter(record) and file.filter(record)
        route_step_lines(terminal=True)  # idempotent
        assert len(console.filters) == 1
        route_step_lines(terminal=False)
        assert console.filter(record)
    finally:
        root.removeHandler(console), root.removeHandler(file)
        file.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_off_a_terminal_prints_a_banner_and_one_line_per_step(tmp_path):
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("tq-train")
    proc = subprocess.run([str(exe), "recipe=grpo", "recipe.num_steps=5", f"hydra.run.dir={out}"],
                          capture_output=True, text=True, timeout=170, stdin=subprocess.DEVNULL,
                          check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) <= 20, "\n".join(lines)
    assert lines[0] == f"[tq_plugin] run dir: {out}"
    steps = [line for line in lines if "RL step " in line and " | reward " in line]
    assert [s.split("RL step ")[1].split(" ")[0] for s in steps] == [f"{i}/5" for i in range(1, 6)]
    assert not any("it/s" in line for line in lines)  # no progress bar off a terminal


def test_engine_logs_go_to_the_run_dir_unless_verbose(tmp_path, monkeypatch):
    from tq_plugin.rl.training.console import ENGINE_LOG, QUIET_LOGGERS, quiet_third_party_logs

    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    saved = {n: (logging.getLogger(n).propagate, list(logging.getLogger(n).handlers))
             for n in QUIET_LOGGERS}
    seen: list[str] = []
    root_spy = logging.Handler(level=logging.DEBUG)
    root_spy.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(root_spy)
    try:
        assert quiet_third_party_logs(tmp_path / "run", verbose=True) is None
        path = quiet_third_party_logs(tmp_path / "run", verbose=False)
        assert not (tmp_path / "run").exists()  # nothing written before the first record
        quiet_third_party_logs(tmp_path / "run", verbose=False)  # again: one handler, not two
        assert path == tmp_path / "run" / ENGINE_LOG
        logger = logging.getLogger("vllm.tq_test_child")
        logger.setLevel(logging.INFO)
        logger.warning("Failed to load weights")
        assert "Failed to load weights" not in seen  # not on the root's handlers
        assert path.read_text().count("Failed to load weights") == 1
        import os

        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
    finally:
        logging.getLogger().removeHandler(root_spy)
        for name, (propagate, handlers) in saved.items():
            logger = logging.getLogger(name)
            for h in [h for h in logger.handlers if h not in handlers]:
                logger.removeHandler(h)
                h.close()
            logger.propagate = propagate

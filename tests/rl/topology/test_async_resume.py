"""A disaggregated run killed mid-step resumes from its last checkpoint, losing no prompt.

Each run is the real entry point in a subprocess (``python -m tq_plugin.cli``): GRPO,
``tq/backend=ray``, two rollout workers (Ray actors), ``recipe.max_staleness=1``,
``recipe.checkpoint_every=2``. A run of ``N`` steps uninterrupted, then the same seed stopped
by SIGTERM inside step 3 (its own ``sigterm.ckpt``) and resumed with ``ckpt_path`` to ``N``; with
in-flight updates on, a run SIGTERMed, resumed, SIGKILLed (no SIGTERM checkpoint: it resumes
from ``checkpoints/last.ckpt``) and resumed again. The resumed run's record
(``prompt_groups.jsonl``: the steps the final weights trained, the checkpointed ones included)
must hold every prompt group the prompt stream assigns to steps ``0..N-1`` exactly once, each
in the step the uninterrupted run trained it in, none staler than the bound; no process of the
killed run may be left behind.

The kill is sent by the trainer to itself from a callback (``KillAt``, written next to the run):
a step of this tiny task trains in ~0.1 s, too short to aim a kill from outside. Fast tier:
``recipe.checkpoint_every`` on a colocated run (the files, ``last.ckpt``, a resume from one).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

N, PROMPTS, EVERY, STALENESS = 6, 4, 2, 1
RUN = ["--config-name", "grpo", f"recipe.prompts_per_step={PROMPTS}", "recipe.ppo_epochs=2",
       "trainer.enable_progress_bar=false", "tq/backend=ray", "recipe.topology=disaggregated",
       "recipe.rollout_workers=2", f"recipe.max_staleness={STALENESS}", f"recipe.num_steps={N}",
       f"recipe.checkpoint_every={EVERY}", "tq.backend.ray_init.num_cpus=null",
       "++tq.backend.ray_init.log_to_driver=false"]
KILLER = '''
import os
from lightning.pytorch import Callback
from tq_plugin.lightning import MICROBATCH_INFO


class KillAt(Callback):
    """Sends ``signum`` to this process as microbatch ``index`` of RL step ``step`` starts."""

    def __init__(self, step: int, index: int, signum: int) -> None:
        self.step, self.index, self.signum = step, index, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        info = pl_module.dp_meta.extra_info[MICROBATCH_INFO]
        if (info["step"], info["index_in_step"]) == (self.step, self.index):
            os.kill(os.getpid(), self.signum)
'''


def _run(run_process_tree, run_dir: Path, env: dict[str, str], *overrides: str,
         linger: float = 30.0):
    """``(returncode, stderr, processes of its tree still running ``linger`` s after it
    ended)``: the trainer run to its end (``run_process_tree``), ``KillAt`` importable."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / "resume_killer.py").write_text(KILLER)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(run_dir.parent), env.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tq_plugin.cli", *RUN, f"hydra.run.dir={run_dir}", *overrides]
    done, _, left = run_process_tree(cmd, cwd=run_dir.parent, env=env, timeout=240.0,
                                     linger=linger)
    return done.returncode, done.stderr, left


def _record(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "prompt_groups.jsonl").read_text().splitlines()]


_WHOLE: list[dict] = []  # the uninterrupted run's record, made once for both variants


def _uninterrupted(run_process_tree, tmp_path_factory, env: dict[str, str]) -> list[dict]:
    if not _WHOLE:
        run_dir = tmp_path_factory.mktemp("async-resume") / "whole"
        rc, err, left = _run(run_process_tree, run_dir, env)
        assert rc == 0, err[-3000:]
        assert not left, f"processes left behind: {left}"
        _WHOLE.extend(_record(run_dir))
    return _WHOLE


def _in_process(run_dir: Path, *overrides: str) -> dict:
    """One colocated run of the real entry point in this process; its result.json."""
    from hydra.core.global_hydra import GlobalHydra

    from tq_plugin import cli

    GlobalHydra.instance().clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["tq-train", f"hydra.run.dir={run_dir}", "recipe.prompts_per_step=4",
                                 "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false",
                                 *overrides])
        cli.main(config_name="grpo")
    GlobalHydra.instance().clear()
    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.timeout(180)
def test_checkpoint_every_writes_step_checkpoints_and_last_and_resumes(tmp_path):
    """Any topology (here colocated, embedded store): a checkpoint after every K-th RL step,
    ``last.ckpt`` the newest of them, no temporary file left; ``ckpt_path`` resumes from it."""
    first = tmp_path / "first"
    assert _in_process(first, "recipe.num_steps=5", "recipe.checkpoint_every=2")["steps"] == 5
    checkpoints = first / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "last.ckpt", "rl-step-000002.ckpt", "rl-step-000004.ckpt"]
    assert (checkpoints / "last.ckpt").samefile(checkpoints / "rl-step-000004.ckpt")
    resumed = _in_process(tmp_path / "resumed", "recipe.num_steps=6",
                          f"ckpt_path={checkpoints / 'rl-step-000004.ckpt'}")
    assert resumed["status"] == "ok" and resumed["steps"] == 6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_disaggregated_run_resumes_and_trains_every_prompt_group_once(
        tmp_path, tmp_path_factory, run_process_tree, launcher_free_env):
    """SIGTERM as step 3's first optimizer step starts (the run stops after that microbatch,
    inside the step). A SIGKILL mid-step (the next step prepared, its tickets out) is the
    in-flight test's second kill below, and on a journaled store ``test_journal_resume.py``'s."""
    signum, index = signal.SIGTERM, 0
    uninterrupted = _uninterrupted(run_process_tree, tmp_path_factory, launcher_free_env)
    expected = list(range(N * PROMPTS))  # the prompt stream's groups of steps 0..N-1
    assert sorted(g for r in uninterrupted for g in r["prompt_groups"]) == expected

    killed = tmp_path / "killed"
    kill = ["+callbacks.kill._target_=resume_killer.KillAt", "+callbacks.kill.step=3",
            f"+callbacks.kill.index={index}", f"+callbacks.kill.signum={int(signum)}"]
    rc, err, left = _run(run_process_tree, killed, launcher_free_env, *kill)
    assert not left, f"processes of the killed run left behind: {left}"
    checkpoints = killed / "checkpoints"
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    ckpt = checkpoints / "sigterm.ckpt"
    assert json.loads((killed / "result.json").read_text())["status"] == "interrupted"
    assert not list(checkpoints.glob(".*.tmp")), "a checkpoint was left half written"

    resumed = tmp_path / "resumed"
    t0 = time.monotonic()
    rc, err, left = _run(run_process_tree, resumed, launcher_free_env, f"ckpt_path={ckpt}")
    seconds = time.monotonic() - t0
    assert rc == 0, err[-3000:]
    assert not left, f"processes of the resumed run left behind: {left}"
    assert "disaggregated run resumed at step" in err

    record = _record(resumed)
    assert [r["step"] for r in record] == list(range(N)), "a step missing or trained twice"
    groups = Counter(g for r in record for g in r["prompt_groups"])
    assert sorted(groups) == expected, f"skipped: {sorted(set(expected) - set(groups))}"
    assert set(groups.values()) == {1}, f"trained twice: {[g for g, n in groups.items() if n > 1]}"
    # each group in the step the uninterrupted run trained it in, none staler than the bound
    assert [r["prompt_groups"] for r in record] == [r["prompt_groups"] for r in uninterrupted]
    assert max(r["staleness_max"] for r in record) <= STALENESS
    result = json.loads((resumed / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == N
    print(f"[async resume] {signal.Signals(signum).name} inside step 3, resumed from {ckpt.name}: "
          f"{N} steps, {len(groups)} prompt groups checked, each trained once, staleness_max "
          f"{max(r['staleness_max'] for r in record)}; resumed run {seconds:.1f} s")


# In-flight weight updates on: the prompt stream's slots, hence each step's groups, are the same
# as without them.
INFLIGHT = ["recipe.inflight_updates=true"]


def _ledger_rows(run_dir: Path) -> list[dict[str, str]]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("token_staleness_max")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inflight_run_killed_twice_resumes_and_trains_every_prompt_group_once(
        tmp_path, tmp_path_factory, run_process_tree, launcher_free_env):
    """With ``recipe.inflight_updates=true`` (``engine=native``): one run SIGTERMed as step 2's
    first optimizer step starts, resumed from its ``sigterm.ckpt`` and SIGKILLed as step 4's
    second starts, resumed again from that run's ``last.ckpt`` (after step 3) to ``N``. The
    last record holds every prompt group once, each in the uninterrupted run's step; every run's
    metrics.csv has the per-token ledger figures within the bound. (Whether a row spans two
    versions here depends on the box's load: tests/rl/test_inflight_recipe.py checks that.)"""
    uninterrupted = _uninterrupted(run_process_tree, tmp_path_factory, launcher_free_env)
    expected = list(range(N * PROMPTS))

    def kill_at(step: int, index: int, signum: int) -> list[str]:
        return ["+callbacks.kill._target_=resume_killer.KillAt", f"+callbacks.kill.step={step}",
                f"+callbacks.kill.index={index}", f"+callbacks.kill.signum={int(signum)}"]

    termed, killed, resumed = tmp_path / "termed", tmp_path / "killed", tmp_path / "resumed"
    rc, err, left = _run(run_process_tree, termed, launcher_free_env, *INFLIGHT,
                         *kill_at(2, 0, signal.SIGTERM))
    assert rc == 128 + signal.SIGTERM and not left, (left, err[-3000:])
    rc, err, left = _run(run_process_tree, killed, launcher_free_env, *INFLIGHT,
                         *kill_at(4, 1, signal.SIGKILL),
                         f"ckpt_path={termed / 'checkpoints' / 'sigterm.ckpt'}")
    assert rc == -signal.SIGKILL and not left, (left, err[-3000:])
    assert "disaggregated run resumed at step" in err
    last = killed / "checkpoints" / "last.ckpt"
    assert last.samefile(killed / "checkpoints" / "rl-step-000004.ckpt")
    rc, err, left = _run(run_process_tree, resumed, launcher_free_env, *INFLIGHT,
                         f"ckpt_path={last}")
    assert rc == 0 and not left, (left, err[-3000:])
    assert "disaggregated run resumed at step 4" in err, err[-3000:]

    record = _record(resumed)
    assert [r["step"] for r in record] == list(range(N)), "a step missing or trained twice"
    groups = Counter(g for r in record for g in r["prompt_groups"])
    assert sorted(groups) == expected and set(groups.values()) == {1}, groups
    assert [r["prompt_groups"] for r in record] == [r["prompt_groups"] for r in uninterrupted]
    rows = [r for d in (termed, killed, resumed) for r in _ledger_rows(d)]
    assert {int(r["step"]) for r in rows} == set(range(N)), rows
    for r in rows:
        assert 0 <= int(r["token_staleness_max"]) <= STALENESS, r
        assert int(r["tokens_masked_stale"]) == 0 and int(r["rows_masked_stale"]) == 0, r
        assert r["inflight/weights_taken"] != "", r  # the workers ran with in-flight updates
    print(f"[async resume, in-flight] SIGTERM in step 2, SIGKILL in step 4, resumed twice: "
          f"{len(groups)} prompt groups each trained once; multi_version_fraction per step "
          f"{[r['multi_version_fraction'] for r in rows]}")

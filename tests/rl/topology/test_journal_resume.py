"""A disaggregated run on a journaled Ray store, SIGKILLed mid-run and resumed: nothing replayed.

The issue-37 promise end to end, through the real entry point in a subprocess
(``python -m tq_plugin.cli``): GRPO, ``tq/backend=ray`` with ``tq.backend.journal_dir``, two
rollout workers, ``recipe.checkpoint_every=3``, killed by SIGKILL as step 5 starts (a callback
the trainer runs sends it to itself: a step of this task is too short to aim at from outside).
The killed run must leave its finished steps in ``metrics.csv`` and no process of its own
30 s after the kill; resumed with ``ckpt_path`` it must train every step once (each step's own
prompt groups, once each) and report ``rollouts_generated_twice == 0`` in ``result.json``, the
chunks delivered before the kill recovered from the journal rather than generated again.
The collector's side of it is property-tested in ``test_disaggregated.py`` (simulated workers).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
from collections import Counter

import pytest

N, PROMPTS, EVERY, KILL_STEP = 8, 4, 3, 5
LINGER = 30.0  # the issue: no process of the killed run alive 30 s after the kill
KILLER = '''
import os
from lightning.pytorch import Callback
from tq_plugin.lightning import MICROBATCH_INFO


class KillAt(Callback):
    """SIGKILLs this process as RL step ``step``'s first microbatch starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        info = pl_module.dp_meta.extra_info[MICROBATCH_INFO]
        if (info["step"], info["index_in_step"]) == (self.step, 0):
            os.kill(os.getpid(), 9)
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_run_on_a_journaled_store_resumes_replaying_no_rollout(
        tmp_path, run_process_tree, launcher_free_env):
    (tmp_path / "journal_killer.py").write_text(KILLER)
    env = {**launcher_free_env,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), launcher_free_env.get("PYTHONPATH", "")])}
    journal = tmp_path / "journal"
    run = [sys.executable, "-m", "tq_plugin.cli", "--config-name", "grpo",
           "recipe.topology=disaggregated", "recipe.rollout_workers=2", "tq/backend=ray",
           f"tq.backend.journal_dir={journal}", f"recipe.checkpoint_every={EVERY}",
           f"recipe.num_steps={N}", f"recipe.prompts_per_step={PROMPTS}", "recipe.ppo_epochs=1",
           "trainer.enable_progress_bar=false", "tq.backend.ray_init.num_cpus=null",
           "++tq.backend.ray_init.log_to_driver=false"]

    killed = tmp_path / "killed"
    done, _, left = run_process_tree(
        [*run, f"hydra.run.dir={killed}", "+callbacks.kill._target_=journal_killer.KillAt",
         f"+callbacks.kill.step={KILL_STEP}"], cwd=tmp_path, env=env, timeout=300.0, linger=LINGER)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert not left, f"processes of the killed run alive 30 s after the kill: {left}"
    with open(killed / "metrics.csv", newline="") as f:
        finished = list(csv.DictReader(f))
    assert [int(r["step"]) for r in finished] == list(range(KILL_STEP))
    # The work the kill threw away: the finished steps past the checkpoint, trained again.
    lost_s = sum(float(r[k]) for r in finished[EVERY:] for k in ("rollout_s", "prepare_s", "train_s"))
    ckpt = killed / "checkpoints" / "last.ckpt"
    assert ckpt.samefile(killed / "checkpoints" / f"rl-step-{EVERY:06d}.ckpt")

    resumed = tmp_path / "resumed"
    done, _, left = run_process_tree([*run, f"hydra.run.dir={resumed}", f"ckpt_path={ckpt}"],
                                     cwd=tmp_path, env=env, timeout=300.0, linger=30.0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not left, f"processes of the resumed run left behind: {left}"
    result = json.loads((resumed / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == N
    assert result["rollouts_generated_twice"] == 0, result
    # What the killed run had taken past its checkpoint came back from the journal.
    assert result["rollouts_recovered"] > 0, result
    assert result["staleness_max"] <= 1
    record = [json.loads(line) for line in (resumed / "prompt_groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in record] == list(range(N)), "a step missing or trained twice"
    assert [r["prompt_groups"] for r in record] == [
        list(range(s * PROMPTS, (s + 1) * PROMPTS)) for s in range(N)]
    assert set(Counter(g for r in record for g in r["prompt_groups"]).values()) == {1}
    print(f"[journal resume] SIGKILL as step {KILL_STEP} started, resumed from the step-{EVERY} "
          f"checkpoint: "
          f"{result['rollouts_recovered']} rows recovered, 0 generated twice, "
          f"orders reissued {result['orders_reissued']}, calls staged twice "
          f"{result['calls_staged_twice']} ({result.get('calls_staged_twice_why')}); "
          f"{KILL_STEP - EVERY} finished steps past the checkpoint trained again "
          f"({lost_s:.1f} s of step time lost), the resumed run's fit {result['wall_s']:.0f} s for "
          f"steps {EVERY}-{N - 1}")

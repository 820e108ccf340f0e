"""``task=prompts`` through the recipe: the tiny model's tokenizer and checkpoint from
``model.pretrained_path``, ``recipe.eval_every`` figures in the loggers and ``result.json``, a
reward that breaks its contract failing the run by name, and the dataset cursor resuming from a
checkpoint where the interrupted run would have gone on."""

from __future__ import annotations

import csv
import json
import logging
import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from tq_plugin import cli
from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.tasks.prompts import PromptTask
from tq_plugin.rl.tasks.tiny_text import make_tiny_model

FAST = ["recipe.ppo_epochs=1", "recipe.prompts_per_step=4", "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_text")
    model = make_tiny_model(out, train_rows=64, eval_rows=8)
    return out, [f"task.path={out / 'train.jsonl'}", f"task.eval_path={out / 'eval.jsonl'}",
                 "task.reward._target_=tq_plugin.rl.tasks.rewards.token_match", "model=hf_causal_lm",
                 f"model.pretrained_path={model}"]


@pytest.fixture(autouse=True)
def _clean_hydra():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def entry(monkeypatch, out, *overrides):
    monkeypatch.setattr(sys, "argv", ["grpo", f"hydra.run.dir={out}", "task=prompts", *FAST,
                                      *overrides])
    cli.main(config_name="grpo")
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(240)
def test_eval_every_logs_eval_figures_and_the_final_eval_lands_in_result_json(
        monkeypatch, tmp_path, tiny):
    _, task = tiny
    summary = entry(monkeypatch, tmp_path, *task, "recipe.num_steps=3", "recipe.eval_every=2")
    assert summary["status"] == "ok" and set(summary["eval"]) == {"reward", "accuracy"}
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
    (log,) = (tmp_path / "lightning_logs").glob("version_*/metrics.csv")
    with open(log) as f:
        evals = [r for r in csv.DictReader(f) if r.get("eval/reward")]
    # Steps 0 and 2, and the final evaluation: one row each, never repeated.
    assert len(evals) == 3, evals
    assert float(evals[-1]["eval/reward"]) == pytest.approx(summary["eval"]["reward"])


def wrong_length(prompts, completions, **_):
    return [0.5]


@pytest.mark.timeout(240)
def test_a_reward_that_breaks_its_contract_fails_the_run_naming_it(monkeypatch, tmp_path, tiny,
                                                                     capsys):
    _, task = tiny
    with pytest.raises(SystemExit) as info:
        entry(monkeypatch, tmp_path, *task, "recipe.num_steps=1",
              f"task.reward._target_={__name__}.wrong_length")
    assert info.value.code == 1
    out, err = capsys.readouterr()
    # Named as TRL names a reward function: its __name__; then where it is defined, and
    # nothing before the message (its name was once looked up as a module, in three lines).
    assert "reward wrong_length: returned 1 values for 16" in err
    assert f"  the function: {__name__}.wrong_length at {__file__}:" in err
    assert "No module named" not in out + err
    assert not (tmp_path / "result.json").exists()


@pytest.mark.timeout(240)
def test_sample_completions_cover_the_last_step_and_the_summary_names_them(
        monkeypatch, tmp_path, tiny, capsys):
    _, task = tiny
    entry(monkeypatch, tmp_path, *task, "recipe.num_steps=2", "recipe.log_completions_every=5")
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 1]  # step 0 (every 5) and the last
    assert "sample completions with their rewards: completions.jsonl" in capsys.readouterr().out


def _recipe(tmp_path, task, *overrides):
    from hydra import compose, initialize_config_module

    from tq_plugin.rl.recipe import RLRecipe

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=["task=prompts", *FAST, *task, "tq/packing=none",
                                         "tq.packing.micro_batch_size=4", "recipe.num_steps=4",
                                         *overrides])
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    return recipe


@pytest.mark.timeout(300)
def test_the_dataset_cursor_resumes_from_the_checkpoint(monkeypatch, tmp_path, tiny):
    _, task = tiny
    drawn: list[int] = []
    next_rows = PromptTask.next_rows

    def recording(self, n):
        rows = next_rows(self, n)
        drawn.extend(rows)
        return rows

    monkeypatch.setattr(PromptTask, "next_rows", recording)
    full = _recipe(tmp_path / "full", task)
    full.train()
    straight, end_state = list(drawn), full.task.state_dict()
    assert len(straight) == 16

    drawn.clear()
    stopped = _recipe(tmp_path / "stopped", task)
    hook = stopped.step_hooks.after_microbatch

    def stop_in_step_two(trainer, meta, stats, dp=None):
        if meta.extra_info[MICROBATCH_INFO]["step"] == 2:
            stopped.sigterm.stop = True  # what SIGTERM leads to: a checkpoint, then exit 143
        hook(trainer, meta, stats, dp)

    stopped.step_hooks.after_microbatch = stop_in_step_two
    with pytest.raises(SystemExit):
        stopped.train()
    ckpt = tmp_path / "stopped" / "checkpoints" / "sigterm.ckpt"
    assert ckpt.is_file()
    before = list(drawn)
    assert before == straight[:len(before)] and len(before) < 16

    drawn.clear()
    resumed = _recipe(tmp_path / "resumed", task, f"ckpt_path={ckpt}")
    resumed.train()
    assert before + drawn == straight
    assert resumed.task.state_dict() == end_state


@pytest.mark.timeout(240)
def test_the_hf_engine_serves_the_pretrained_policy(monkeypatch, tmp_path, tiny):
    _, task = tiny
    summary = entry(monkeypatch, tmp_path, *task, "recipe.num_steps=2", "recipe.eval_every=1",
                    "engine=hf")
    assert summary["engine"] == "hf" and summary["weight_syncs"] >= 2
    # The engine serves the policy loaded from model.pretrained_path: its logprobs are the trainer's.
    assert summary["max_logprob_gap"] < 1e-3
    assert set(summary["eval"]) == {"reward", "accuracy"}


def test_eval_every_without_held_out_prompts_is_refused_at_start(tmp_path, tiny):
    """A setting that would silently do nothing: no eval would ever be logged."""
    from tq_plugin.config import ConfigError

    _, task = tiny
    no_eval = [o for o in task if not o.startswith("task.eval_path")]
    with pytest.raises(ConfigError, match="recipe.eval_every: task=prompts holds no held-out "
                                          "prompts to evaluate: set task.eval_path"):
        _recipe(tmp_path, no_eval, "recipe.eval_every=2")
    assert not (tmp_path / "metrics.csv").exists()

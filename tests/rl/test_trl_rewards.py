"""TRL's own reward functions (``trl.rewards``, the ``trl`` test extra) and reward functions
written TRL's way run unchanged on ``task=prompts``: conversational completions as one assistant
message, ``None`` for "not applicable", each function's mean and std in ``metrics.csv``, sample
completions in ``completions.jsonl``."""

from __future__ import annotations

import csv
import json
import logging
import math

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")
trl_rewards = pytest.importorskip("trl.rewards")

from tq_plugin.rl.tasks.prompts import PromptTask
from tq_plugin.rl.tasks.tiny_text import make_tiny_model, reverse_rows, train_tokenizer

THINKING = "<think>ok</think>\\boxed{2}"


def solution_match(completions, solution, **kwargs):
    """A user reward written as TRL documents it."""
    return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]


def _rows(n: int) -> list[dict]:
    rows = reverse_rows(n)
    for i, r in enumerate(rows):  # TRL's column name; every 4th gold answer parses as math
        r["solution"] = "$2$" if i % 4 == 0 else r.pop("answer")
        r.pop("answer", None)
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_tiny")
    model = make_tiny_model(out, train_rows=64, eval_rows=4)
    data = out / "trl.jsonl"
    rows = _rows(32)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A tokenizer whose alphabet also spells the thinking completion (the tiny model's knows
    # only the reverse task's bytes).
    tok = train_tokenizer([m["content"] for r in rows for m in r["prompt"]] + [THINKING, "b a"],
                          vocab_size=96)
    tok.save_pretrained(str(out / "tok"))
    return out, model, data


def _task(tiny, **rewards):
    out, _, data = tiny
    return PromptTask(path=str(data), tokenizer=str(out / "tok"), rewards=rewards)


def _score(task, texts, rows):
    ids = [task.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    lens = torch.tensor([len(i) for i in ids])
    padded = torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in ids], batch_first=True)
    return task.score(padded, lens, torch.tensor([[r] for r in rows]), torch.ones(len(rows)))


def test_trl_think_format_and_accuracy_rewards_run_unchanged(tiny):
    task = _task(tiny, think={"_target_": "trl.rewards.think_format_reward"},
                 accuracy={"_target_": "trl.rewards.accuracy_reward", "weight": 2.0})
    row0 = task.rows[0]
    assert row0["solution"] == "$2$" and task.rows[1]["solution"] != "$2$"
    # Row 0: gold 2, the completion thinks then boxes 2: both rewards apply (1 + 2 x 1).
    # Row 1: a gold answer that does not parse as math: accuracy_reward says None, think applies.
    texts = [THINKING, "b a"]
    scores = _score(task, texts, [0, 1])
    assert scores.tolist() == [3.0, 0.0]
    (call,) = task.drain_reward_log()
    assert call["rewards"]["think"] == [1.0, 0.0]
    assert call["rewards"]["accuracy"][0] == 1.0 and math.isnan(call["rewards"]["accuracy"][1])
    # The completions reached the functions as TRL hands them: one assistant message each.
    assert task.reward_call([row0], torch.tensor([[1]]), torch.tensor([1])).completions[0][0]["role"] \
        == "assistant"


def test_a_completion_only_none_applies_to_is_unscorable_and_counted(tiny, caplog):
    task = _task(tiny, accuracy={"_target_": "trl.rewards.accuracy_reward"})
    with caplog.at_level(logging.WARNING):
        scores = _score(task, ["b a"], [1])
    # The rollout receipt carries 0.0; the reward log keeps the NaN the step source writes back.
    assert float(scores[0]) == 0.0
    assert "no reward applies" in caplog.text
    (call,) = task.drain_reward_log()
    assert call["unscorable"] == 1 and math.isnan(call["total"][0])


def test_a_trl_style_user_function_gets_conversational_completions_and_the_column(tiny):
    task = _task(tiny, solution={"_target_": f"{__name__}.solution_match"})
    gold = task.rows[1]["solution"]
    assert _score(task, [gold, "x"], [1, 1]).tolist() == [1.0, 0.0]


def _train(train_in_process, tmp_path, tiny, *overrides: str) -> list[dict]:
    """``tq-train --config-name grpo task=prompts`` on the tiny model; metrics.csv's rows."""
    _, model, data = tiny
    return train_in_process(tmp_path, "grpo", "task=prompts", f"task.path={data}",
                            "model=hf_causal_lm", f"model.pretrained_path={model}",
                            "recipe.ppo_epochs=1", "recipe.prompts_per_step=4", *overrides)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_rewards_train_three_grpo_steps_with_each_functions_mean_logged(
        train_in_process, tmp_path, tiny):
    rows = _train(train_in_process, tmp_path, tiny, "recipe.num_steps=3",
                  "recipe.log_completions_every=1", "recipe.loss_type=grpo", "recipe.beta=0.04",
                  "+task.rewards.think._target_=trl.rewards.think_format_reward",
                  "+task.rewards.accuracy._target_=trl.rewards.accuracy_reward",
                  f"+task.rewards.solution._target_={__name__}.solution_match",
                  "task.reward._target_=null")
    assert len(rows) == 3
    for name in ("think", "solution"):
        assert all(r[f"rewards/{name}/mean"] != "" for r in rows), name
    # accuracy_reward applies to the math rows only: a step that drew none has no mean.
    assert any(r["rewards/accuracy/mean"] != "" for r in rows)
    assert all(float(r["kl_ref"]) >= 0.0 for r in rows)
    assert all(float(r["rewards/unscorable"]) == 0 for r in rows)  # think applies to every row
    (log,) = (tmp_path / "lightning_logs").glob("version_*/metrics.csv")
    with open(log) as f:  # the Lightning loggers get them too, one row per RL step
        logged = [r for r in csv.DictReader(f) if r.get("rewards/think/mean")]
    assert len(logged) == 3
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 1, 2}
    assert {"prompt", "completion", "think", "accuracy", "solution", "reward"} <= set(samples[0])


def test_reward_figures_and_sample_completions_from_a_reward_log(tmp_path):
    from tq_plugin.rl.training.metrics import (
        COMPLETIONS_FILE,
        completion_rows,
        log_completions,
        reward_figures,
    )

    nan = math.nan
    log = [{"prompts": ["p0", "p1"], "completions": ["c0", "c1"], "total": [1.0, nan],
            "rewards": {"a": [1.0, nan], "b": [0.0, nan]}, "extra": {"why": ["x", "y"]},
            "metrics": {"custom": [0.5]}, "unscorable": 1},
           {"prompts": ["p2"], "completions": ["c2"], "total": [3.0],
            "rewards": {"a": [3.0], "b": [nan]}, "extra": {}, "metrics": {"custom": [1.5]},
            "unscorable": 0}]
    figures = reward_figures(log)
    # a: 1 and 3 (mean 2, Bessel std sqrt(2)); b: one value, its std undefined and left out.
    assert figures == {"rewards/a/mean": 2.0, "rewards/a/std": pytest.approx(math.sqrt(2)),
                       "rewards/b/mean": 0.0, "rewards/unscorable": 1.0, "custom": 1.0}
    rows = completion_rows(log, step=5, limit=2)
    assert rows == [{"step": 5, "prompt": "p0", "completion": "c0", "a": 1.0, "b": 0.0,
                     "why": "x", "reward": 1.0},
                    {"step": 5, "prompt": "p1", "completion": "c1", "a": None, "b": None,
                     "why": "y", "reward": None}]
    texts = []
    tb = type("TB", (), {"experiment": type("W", (), {"add_text": lambda self, k, t, global_step:
                                                       texts.append((k, t, global_step))})()})()
    log_completions(rows, output_dir=tmp_path, loggers=[tb], step=5)
    log_completions(rows[:1], output_dir=tmp_path, loggers=[], step=6)
    lines = (tmp_path / COMPLETIONS_FILE).read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == ["p0", "p1", "p0"]
    assert texts[0][0] == "completions" and texts[0][2] == 5 and "| p1 | c1 |" in texts[0][1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_completions_no_reward_applies_to_train_as_unscorable(train_in_process, tmp_path, tiny):
    """accuracy_reward alone: the rows whose gold answer is not math are unscorable (NaN total
    reward, advantage 0), counted, and the run trains on."""
    rows = _train(train_in_process, tmp_path, tiny, "recipe.num_steps=2",
                  "task.reward._target_=trl.rewards.accuracy_reward")
    assert sum(float(r["rewards/unscorable"]) for r in rows) > 0
    assert all(math.isfinite(float(r["loss"])) and math.isfinite(float(r["reward"])) for r in rows)

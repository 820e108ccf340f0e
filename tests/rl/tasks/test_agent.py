"""task=agent: the user's OpenAI-API agent drives the rollouts; every call is staged and the
reassembler trains on exactly what the engine saw."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from tq_plugin.config import ConfigError, RecipeConfig
from tq_plugin.data_plane import TOTAL_REWARD, LocalDataPlane
from tq_plugin.rl.tasks.agent import AgentError, AgentTask, load_agent, reward_of
from tq_plugin.rl.tasks.tiny_text import make_tiny_model

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "agents"


async def two_calls(client, row, *, suffix=""):
    first = await client.chat.completions.create(model="policy", messages=row["prompt"],
                                                 max_tokens=3)
    messages = [*row["prompt"], {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "again" + suffix}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    return {"reward": float(len(row["answer"])), "calls": 2}


async def broken(client, row):
    raise ZeroDivisionError("division by zero")


STARTED = itertools.count()


async def every_other_raises(client, row):
    """Two calls, or (every second rollout started) a ValueError before any call."""
    if next(STARTED) % 2:
        raise ValueError("every other one")
    return await two_calls(client, row)


async def not_a_number(client, row):
    return "yes"


def sync_agent(client, row):
    return 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_text")
    return out, make_tiny_model(out, train_rows=16, eval_rows=4)


def test_the_agent_spec_is_checked_and_its_keys_are_bound():
    fn, name = load_agent({"_target_": f"{__name__}.two_calls", "suffix": "!"})
    assert name == f"{__name__}.two_calls" and fn.keywords == {"suffix": "!"}
    with pytest.raises(ConfigError, match="task.agent._target_: task=agent needs"):
        load_agent({})
    with pytest.raises(ConfigError, match="must be an async def"):
        load_agent({"_target_": f"{__name__}.sync_agent"})
    with pytest.raises(ConfigError, match="cannot import 'nowhere.solve'"):
        load_agent({"_target_": "nowhere.solve"})


def test_a_reward_is_a_number_or_a_dict_with_one():
    assert reward_of(0.5, agent="a") == (0.5, {})
    assert reward_of({"reward": 1, "turns": 3, "note": "x"}, agent="a") == (1.0, {"turns": 3.0})
    for bad in ("yes", None, True, {"turns": 2}):
        with pytest.raises(AgentError, match="agent a: returned"):
            reward_of(bad, agent="a")


def test_one_reward_per_rollout_trains_with_grpo_only(tiny):
    data, model = tiny
    task = AgentTask(path=str(data / "train.jsonl"), tokenizer=str(model),
                     agent={"_target_": f"{__name__}.two_calls"})
    task.check_recipe(RecipeConfig(algorithm="grpo"))
    with pytest.raises(ConfigError, match="task=agent trains with recipe=grpo"):
        task.check_recipe(RecipeConfig(algorithm="ppo"))
    assert task.turns == 1 and task.output_token_ids is None
    assert task.eos_token_id == task.tokenizer.eos_token_id


def _runner(tiny, tmp_path, agent: str):
    from tq_plugin.rollout.engines.hf import HFEngine
    from tq_plugin.staging import RolloutReassembler
    from tq_plugin.staging.factory import build_token_sink

    data, model = tiny
    task = AgentTask(path=str(data / "train.jsonl"), tokenizer=str(model), max_context=96,
                     agent={"_target_": agent}, concurrency=3)
    client = LocalDataPlane()
    sink = build_token_sink(client, staging_partition="staging")
    client.register_partition("train", [])
    engine = HFEngine(model)
    runner = task.rollout_driver(sink, max_new_tokens=4)
    reassembler = RolloutReassembler(client, staging_partition=sink.staging_partition,
                                     pad_token_id=task.pad_token_id, clear_staged=True)
    return task, client, engine, runner, reassembler


def test_a_step_of_agent_rollouts_is_staged_and_verified(tiny, tmp_path):
    _, client, engine, runner, reassembler = _runner(tiny, tmp_path, f"{__name__}.two_calls")
    try:
        batch = runner.run(engine, step=0, prompts=2, group_size=2,
                           generator=torch.Generator().manual_seed(0))
        assert len(batch.receipts) == 4 and batch.staged_calls == 8 and batch.failed_calls == 0
        assert runner.figures["agent/calls_staged"] == 8 and runner.figures["agent/calls"] == 2
        assert [r.rollout_id for r in batch.receipts] == ["s0-p0-g0", "s0-p0-g1", "s0-p1-g0",
                                                         "s0-p1-g1"]
        meta = reassembler.finalize_group(batch.receipts, partition_id="train")
        assert meta.size == 4
        td = client.get_samples(
            partition_id="train", sample_ids=meta.sample_ids, select_fields=[TOTAL_REWARD]
        )
        torch.testing.assert_close(td[TOTAL_REWARD], batch.rewards)
        # the next step's rollouts have their own ids and rows of the stream
        batch = runner.run(engine, step=1, prompts=1, group_size=2,
                           generator=torch.Generator().manual_seed(1))
        assert [r.rollout_id for r in batch.receipts] == ["s1-p0-g0", "s1-p0-g1"]
    finally:
        runner.close()
        engine.close()


@pytest.mark.slow
def test_an_agent_that_raises_is_named_with_its_file_and_line(tiny, tmp_path):
    _, _, engine, runner, _ = _runner(tiny, tmp_path, f"{__name__}.broken")
    try:
        with pytest.raises(AgentError, match=rf"agent {__name__}.broken \(.*test_agent.py:\d+\): "
                                             r"raised ZeroDivisionError: division by zero"):
            runner.run(engine, step=0, prompts=1, group_size=1,
                       generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
        engine.close()


@pytest.mark.slow
def test_when_agents_raise_every_rollout_of_the_step_is_closed_first(tiny, tmp_path):
    global STARTED
    STARTED = itertools.count()
    _, _, engine, runner, _ = _runner(tiny, tmp_path, f"{__name__}.every_other_raises")
    try:
        with pytest.raises(AgentError, match="raised ValueError: every other one") as info:
            runner.run(engine, step=0, prompts=4, group_size=2,
                       generator=torch.Generator().manual_seed(0))
        stats = runner.endpoint.stats()
        # The 4 that raised and the 4 that made their 2 calls each: all closed, none open.
        assert (stats["rollouts_closed"], stats["rollouts_open"]) == (8, 0), stats
        assert stats["calls_staged"] == 8, stats
        assert "4 of the step's 8 rollouts failed; every rollout was closed" in \
            getattr(info.value, "__notes__", []), info.value
    finally:
        runner.close()
        engine.close()


@pytest.mark.slow
def test_the_example_agent_runs_multi_turn(tiny, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("reverse_hint", None)
    _, _, engine, runner, reassembler = _runner(tiny, tmp_path, "reverse_hint.solve")
    try:
        batch = runner.run(engine, step=0, prompts=2, group_size=2,
                           generator=torch.Generator().manual_seed(0))
        assert batch.failed_calls == 0 and batch.staged_calls >= 4
        assert all(0.0 <= float(r) <= 1.0 for r in batch.rewards)
        assert runner.figures["agent/turns"] >= 1
        assert reassembler.finalize_group(batch.receipts, partition_id="train").size == 4
    finally:
        runner.close()
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tq_train_trains_the_example_agent(tiny, tmp_path, monkeypatch):
    """The issue's command, small: every call staged and verified, the counts in metrics.csv."""
    import csv
    import json

    from hydra.core.global_hydra import GlobalHydra

    from tq_plugin import cli

    data, model = tiny
    monkeypatch.syspath_prepend(str(EXAMPLES))
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [
        "grpo", "task=agent", f"task.path={data / 'train.jsonl'}",
        "task.agent._target_=reverse_hint.solve", "model=hf_causal_lm",
        f"model.pretrained_path={model}", "engine=hf", "recipe.num_steps=2",
        "recipe.prompts_per_step=2", "recipe.group_size=2", "recipe.ppo_epochs=1",
        f"hydra.run.dir={tmp_path}"])
    try:
        cli.main(config_name="grpo")
    finally:
        GlobalHydra.instance().clear()
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == 2
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        assert float(row["agent/rollouts_closed"]) == 4 and float(row["agent/rollouts_poisoned"]) == 0
        assert float(row["agent/calls_staged"]) >= 4 and int(row["failed_calls"]) == 0
        assert float(row["logprob_gap"]) < 1e-4  # the rows are the tokens the engine sampled

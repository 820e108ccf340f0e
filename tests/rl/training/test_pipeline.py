"""The one step pipeline (``tq_plugin.rl.training.pipeline``) and what feeds it.

Fast tier: ``DrawLoop`` on a stub rollout side and a stub row store (the unscorable-row NaN, the
truncation mask, the overlong penalty, dynamic sampling through ``run``: each draw shaped and
numbered apart; ``tests/rl/test_trl_sampling.py`` pins ``dynamic_sample``'s choice of groups);
``StepTail.roles``; the disaggregated collector's ``chunk_figures`` and ``in_row_order`` over a
chunk of several draws; the declared task contract; a user's loss from ``recipe.imports``
training two colocated steps, and an unknown ``recipe.loss_type`` as one line. The same options on
the disaggregated topology (Ray, two workers) run in ``tests/rl/topology/test_disaggregated.py``.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

from tq_plugin import cli
from tq_plugin.config import ConfigError, RecipeConfig
from tq_plugin.data_plane import INPUT_IDS, SAMPLE_MASK, TOKEN_MASK, TOTAL_REWARD, KVBatchMeta
from tq_plugin.rl.topology.collector import chunk_figures, in_row_order
from tq_plugin.rl.topology.exchange import FIGURE_TAG_PREFIX
from tq_plugin.rl.training.pipeline import DRAW_STRIDE, DrawLoop, RowIO, StepTail

EOS = 2


# ------------------------------------------------------------------ a stub generation side
class Rows:
    """A row store keyed by sample id: what ``RowIO`` reads, writes and clears."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.cleared: list[str] = []
        self.writes: list[set[str]] = []

    def read(self, meta: KVBatchMeta, fields: list[str]) -> dict[str, torch.Tensor]:
        return {f: torch.stack([self.rows[s][f] for s in meta.sample_ids]) for f in fields}

    def write(self, meta: KVBatchMeta, fields: dict[str, torch.Tensor]) -> None:
        self.writes.append(set(fields))
        for i, sid in enumerate(meta.sample_ids):
            self.rows[sid].update({k: v[i] for k, v in fields.items()})

    def clear(self, meta: KVBatchMeta) -> None:
        self.cleared.extend(meta.sample_ids)
        for sid in meta.sample_ids:
            del self.rows[sid]

    def io(self) -> RowIO:
        return RowIO(read=self.read, write=self.write, clear=self.clear)


def completion(tokens: list[int], width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: a 2-token prompt, then ``tokens`` as the action tokens, right-padded."""
    ids = torch.zeros(width, dtype=torch.long)
    mask = torch.zeros(width)
    ids[:2] = torch.tensor([7, 8])
    ids[2:2 + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    mask[2:2 + len(tokens)] = 1.0
    return ids, mask


class StubRollout:
    """``side.rollout`` and ``side.reassembler``: draw ``k`` writes ``draws[k]``'s rows (each a
    reward, its completion tokens and, if given, its score calls' totals) into ``rows``."""

    def __init__(self, rows: Rows, task: SimpleNamespace, draws: list[list[dict]]) -> None:
        self.rows, self.task, self.draws = rows, task, draws
        self.steps: list[int] = []

    def run(self, engine, *, step: int, prompts: int, group_size: int, generator):
        spec = self.draws[len(self.steps)]
        assert len(spec) == prompts * group_size
        self.steps.append(step)
        ids = [f"s{step}-p{i // group_size}-g{i % group_size}" for i in range(len(spec))]
        for sid, row in zip(ids, spec):
            input_ids, mask = completion(row["tokens"])
            self.rows.rows[sid] = {INPUT_IDS: input_ids, TOKEN_MASK: mask,
                                   SAMPLE_MASK: torch.tensor(1.0),
                                   TOTAL_REWARD: torch.tensor(float(row["reward"]))}
        calls = [r.get("calls") for r in spec]
        if calls[0] is not None:  # one dict per score call: each row's total (NaN: unscored)
            self.task.reward_log.extend({"total": [c[k] for c in calls]}
                                        for k in range(len(calls[0])))
        rewards = torch.tensor([float(r["reward"]) for r in spec])
        return SimpleNamespace(receipts=ids, rewards=rewards, turn_scores=rewards.unsqueeze(1),
                               failed_calls=1, staged_calls=len(spec))

    def finalize_group(self, receipts: list[str], *, partition_id: str) -> KVBatchMeta:
        return KVBatchMeta(partition_id=partition_id, task_name=None, sample_ids=list(receipts))


def loop(draws: list[list[dict]], **recipe) -> tuple[DrawLoop, Rows, StubRollout]:
    rc = RecipeConfig(**{"algorithm": "grpo", "group_size": 2, **recipe})
    task = SimpleNamespace(reward_log=[], eos_token_id=EOS, turns=1)
    rows = Rows()
    rollout = StubRollout(rows, task, draws)
    side = SimpleNamespace(rollout=rollout, reassembler=rollout)
    return DrawLoop(rc=rc, task=task, side=side, io=rows.io()), rows, rollout


def run(draw_loop: DrawLoop, *, prompts: int, step: int = 3):
    return draw_loop.run(None, step=step, prompts=prompts, generator=torch.Generator(),
                         partition_id="train")


def lengths(counts: list[int], *, clipped: float) -> dict[str, float]:
    """The completion-length figures every draw reports, of rows of ``counts`` action tokens."""
    return {"completions/mean_length": sum(counts) / len(counts),
            "completions/min_length": float(min(counts)),
            "completions/max_length": float(max(counts)), "completions/clipped_ratio": clipped}


# ------------------------------------------------------------------ DrawLoop
def test_a_row_no_reward_applied_to_gets_a_nan_reward_written_back():
    nan = math.nan
    draws = [[{"reward": 1.0, "tokens": [5, EOS], "calls": [1.0, nan]},
              {"reward": 0.0, "tokens": [5, EOS], "calls": [nan, nan]}]]
    draw_loop, rows, _ = loop(draws)
    d = run(draw_loop, prompts=1)
    assert d.rewards[0] == 1.0 and math.isnan(d.rewards[1])
    assert math.isnan(float(rows.rows["s3-p0-g1"][TOTAL_REWARD]))
    assert float(rows.rows["s3-p0-g0"][TOTAL_REWARD]) == 1.0
    assert d.figures == lengths([2, 2], clipped=0.0)
    assert d.failed_calls == 1 and d.staged_calls == 2


def test_a_task_without_a_reward_log_writes_nothing():
    draw_loop, rows, _ = loop([[{"reward": 1.0, "tokens": [5, EOS]},
                                {"reward": 0.0, "tokens": [5, 5]}]])
    d = run(draw_loop, prompts=1)
    assert d.rewards.tolist() == [1.0, 0.0] and rows.writes == []


def test_truncated_completions_are_masked_and_counted_their_reward_kept():
    draws = [[{"reward": 1.0, "tokens": [5, EOS]}, {"reward": 0.5, "tokens": [5, 6, 6]},
              {"reward": 0.0, "tokens": []}, {"reward": 1.0, "tokens": [EOS]}]]
    draw_loop, rows, _ = loop(draws, mask_truncated_completions=True)
    d = run(draw_loop, prompts=2)
    masks = [float(rows.rows[s][SAMPLE_MASK]) for s in d.meta.sample_ids]
    assert masks == [1.0, 0.0, 1.0, 1.0]  # a row with no action token is not truncated
    assert d.figures == lengths([2, 3, 0, 1], clipped=0.25)
    assert d.rewards.tolist() == [1.0, 0.5, 0.0, 1.0]  # the baseline still sees it
    assert rows.writes == [{SAMPLE_MASK}]


def test_the_overlong_penalty_is_added_to_the_written_reward():
    # max_new_tokens 4 x 1 turn, buffer 2: free up to 2 tokens, -0.5 at 3, -1 at 4 (x factor).
    draws = [[{"reward": 1.0, "tokens": [5, EOS]}, {"reward": 1.0, "tokens": [5, 5, EOS]},
              {"reward": 0.0, "tokens": [5, 5, 5, 5]}, {"reward": 0.0, "tokens": [5]}]]
    draw_loop, rows, _ = loop(draws, max_new_tokens=4, overlong_buffer=2, overlong_penalty=2.0)
    d = run(draw_loop, prompts=2)
    assert d.rewards.tolist() == [1.0, 0.0, -2.0, 0.0]
    assert [float(rows.rows[s][TOTAL_REWARD]) for s in d.meta.sample_ids] == d.rewards.tolist()
    assert d.figures["rewards/overlong_penalty/mean"] == pytest.approx(-3.0 / 4)
    assert d.figures["completions/clipped_ratio"] == 0.5  # rows 2 and 3 end without EOS
    assert [float(rows.rows[s][SAMPLE_MASK]) for s in d.meta.sample_ids] == [1.0] * 4  # not masked


def test_run_draws_again_under_dynamic_sampling_each_draw_shaped_and_numbered_apart():
    g = [{"reward": 1.0, "tokens": [5, EOS]}, {"reward": 1.0, "tokens": [5, 6, 6]}]  # truncated
    flat = [{"reward": 0.0, "tokens": [5, EOS]}] * 2
    signal = [{"reward": 1.0, "tokens": [5, EOS]}, {"reward": 0.0, "tokens": [5, EOS]}]
    # Draw 0: no group has a signal (the truncated row keeps its reward 1.0); draw 1: group 0
    # has one, and group 1 (none) fills the step, the draws being spent.
    draws = [[*g, *flat], [*signal, *flat]]
    draw_loop, rows, rollout = loop(draws, dynamic_sampling=True, max_draws=2,
                                    mask_truncated_completions=True)
    d = run(draw_loop, prompts=2, step=5)
    assert rollout.steps == [5, 5 + DRAW_STRIDE]  # the second draw's rollout ids are apart
    # One signal group, and the last draw's zero-signal group fills the step.
    assert d.meta.sample_ids == [f"s{5 + DRAW_STRIDE}-p{p}-g{j}" for p in (0, 1) for j in (0, 1)]
    assert d.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert sorted(rows.cleared) == [f"s5-p{p}-g{j}" for p in (0, 1) for j in (0, 1)]
    assert sorted(rows.rows) == sorted(d.meta.sample_ids)  # nothing else left in the store
    assert d.failed_calls == 2 and d.staged_calls == 8
    # The figures are the last draw's (its truncated fraction) and the loop's counts.
    assert d.figures == {**lengths([2, 2, 2, 2], clipped=0.0), "sampling/draws": 2.0,
                         "sampling/groups_dropped": 2.0, "sampling/groups_filled": 1.0}


def test_run_draws_once_without_dynamic_sampling():
    draw_loop, _, rollout = loop([[{"reward": 1.0, "tokens": [EOS]}] * 2], max_draws=3)
    d = run(draw_loop, prompts=1, step=4)
    assert rollout.steps == [4] and d.figures == lengths([1, 1], clipped=0.0)


# ------------------------------------------------------------------ StepTail
@pytest.mark.parametrize(("uses_reference", "value", "roles"), [
    (False, None, ["policy"]),
    (True, None, ["policy", "reference"]),
    (False, object(), ["policy", "value"]),
    (True, object(), ["policy", "reference", "value"]),
], ids=["grpo", "grpo-beta", "ppo", "ppo-beta"])
def test_the_no_grad_passes_are_the_models_the_module_holds(uses_reference, value, roles):
    # recipe.beta > 0: a reference pass, by a copy of the policy or (LoRA) the adapter disabled
    module = SimpleNamespace(uses_reference=uses_reference, value=value)
    assert StepTail(module, rc=RecipeConfig(), turns=1).roles() == roles


# ------------------------------------------------------------------ the collector's side
def chunk(sample_ids: list[str], **figures: float) -> KVBatchMeta:
    tag = {"slot": 0, **{f"{FIGURE_TAG_PREFIX}{k}": v for k, v in figures.items()}}
    return KVBatchMeta(partition_id="rollouts", task_name=None, sample_ids=sample_ids,
                       tags=[dict(tag) for _ in sample_ids])


def test_chunk_figures_average_fractions_and_means_by_rows_and_sum_counts():
    a = chunk([f"s1-p0-g{j}" for j in range(2)], **{
        "completions/clipped_ratio": 0.5, "rewards/overlong_penalty/mean": -1.0,
        "completions/mean_length": 4.0, "completions/max_length": 6.0,
        "completions/min_length": 1.0,
        "sampling/draws": 2.0, "sampling/groups_dropped": 1.0})
    b = chunk([f"s2-p{p}-g{j}" for p in range(3) for j in range(2)], **{
        "completions/clipped_ratio": 0.25, "rewards/overlong_penalty/mean": 0.0,
        "completions/mean_length": 8.0, "completions/max_length": 9.0,
        "completions/min_length": 2.0,
        "sampling/draws": 1.0, "sampling/groups_dropped": 0.0})
    figures = chunk_figures([a, b])
    assert figures == pytest.approx({
        "completions/clipped_ratio": (0.5 * 2 + 0.25 * 6) / 8,
        "completions/mean_length": (4.0 * 2 + 8.0 * 6) / 8, "completions/max_length": 9.0,
        "completions/min_length": 1.0,
        "rewards/overlong_penalty/mean": -2 / 8,
        "sampling/draws": 3.0, "sampling/groups_dropped": 1.0})
    assert chunk_figures([chunk(["s1-p0-g0"])]) == {}  # a worker with nothing to say


def test_in_row_order_keeps_two_draws_with_the_same_prompt_index_apart():
    later = 7 + DRAW_STRIDE
    ids = [f"s{later}-p0-g1", "s7-p0-g1", f"s{later}-p0-g0", "s7-p1-g0", "s7-p0-g0",
           "s7-p1-g1"]
    ordered = in_row_order(chunk(ids))
    assert ordered.sample_ids == ["s7-p0-g0", "s7-p0-g1", "s7-p1-g0", "s7-p1-g1",
                                  f"s{later}-p0-g0", f"s{later}-p0-g1"]
    already = chunk(ordered.sample_ids)
    assert in_row_order(already) is already


# ------------------------------------------------------------------ the task contract
def test_a_task_missing_an_abstract_member_cannot_be_built_and_the_shipped_ones_are_tasks():
    from tq_plugin.rl.tasks.agent import AgentTask
    from tq_plugin.rl.tasks.pattern import PatternTask
    from tq_plugin.rl.tasks.prompts import DatasetTask, PromptTask
    from tq_plugin.rl.tasks.protocol import Task

    class NoScore(Task):
        vocab_size = 8

        def max_sequence_length(self, max_new_tokens):
            return 8

        def sample(self, n, generator):
            return []

    with pytest.raises(TypeError, match="score"):
        NoScore()
    for cls in (PatternTask, PromptTask, AgentTask):
        assert issubclass(cls, Task), cls
    assert issubclass(PromptTask, DatasetTask) and issubclass(AgentTask, DatasetTask)
    task = PatternTask()
    assert isinstance(task, Task)
    # The hooks a task leaves alone answer their defaults.
    assert task.rollout_driver(None) is None and task.drain_reward_log() == []
    assert not task.stateful and list(task.reward_log) == []
    task.seek(3)
    task.set_step(1, 2)
    task.check_recipe(RecipeConfig())


# ------------------------------------------------------------------ registries, end to end
USER_LOSS = '''
import torch

from tq_plugin.rl.algorithms.registry import register_policy_loss


@register_policy_loss("pipeline_test_reinforce", aggregation="token_mean")
def reinforce(logprobs, old_logprobs, advantages, mask, *, weights=None, **_):
    terms = -advantages * logprobs * (1.0 if weights is None else weights)
    log_ratio = ((logprobs - old_logprobs) * mask).detach()
    none = torch.zeros_like(mask, dtype=torch.bool)
    return terms, {"ratio": log_ratio.exp(), "log_ratio": log_ratio,
                   "clipped": none, "clip_low": none, "clip_high": none}
'''


@pytest.mark.usefixtures("fresh_hydra")
def test_a_users_loss_named_in_recipe_imports_trains(monkeypatch, tmp_path):
    from tq_plugin.rl.algorithms.registry import POLICY_LOSSES

    user = tmp_path / "user"
    user.mkdir()
    (user / "pipeline_test_losses.py").write_text(USER_LOSS)
    monkeypatch.chdir(user)  # found in the working directory, as tq-train finds it
    run = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", [
        "grpo", f"hydra.run.dir={run}", "recipe.num_steps=2", "recipe.prompts_per_step=4",
        "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false",
        "recipe.imports=[pipeline_test_losses]", "recipe.loss_type=pipeline_test_reinforce"])
    try:
        cli.main(config_name="grpo")
        assert POLICY_LOSSES["pipeline_test_reinforce"].aggregation == "token_mean"
    finally:
        POLICY_LOSSES.pop("pipeline_test_reinforce", None)
        sys.modules.pop("pipeline_test_losses", None)
        if str(user) in sys.path:
            sys.path.remove(str(user))
    summary = json.loads((run / "result.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert all(math.isfinite(float(r["loss"])) and float(r["loss"]) != 0 for r in rows)


@pytest.mark.usefixtures("fresh_hydra")
def test_an_unknown_loss_type_is_one_line_naming_the_registered_losses(tmp_path):
    from tq_plugin.rl.algorithms.registry import registered_losses
    from tq_plugin.rl.recipe import RLRecipe

    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=["recipe.loss_type=dapoo"])
    with pytest.raises(ConfigError) as caught:
        RLRecipe(cfg, tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("recipe.loss_type: unknown loss 'dapoo'")
    assert f"registered: {', '.join(registered_losses())};" in message
    assert {"bnpo", "cispo", "dapo", "dr_grpo", "grpo"} <= set(registered_losses())
    assert "did you mean 'dapo'" in message
    lines = cli.describe_error(caught.value)
    assert lines is not None and "recipe.loss_type: unknown loss" in lines[0]
    assert not list(tmp_path.iterdir())  # refused before anything is written

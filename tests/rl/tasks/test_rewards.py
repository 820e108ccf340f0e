"""The reward-function contract of ``task=prompts`` (TRL's): called by keyword (``prompts``,
``completions``, ``completion_ids``, the columns, ``trainer_state``), one finite float or ``None``
per completion, or the step fails naming the function."""

from __future__ import annotations

import math

import pytest

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.rewards import (
    RewardCall,
    RewardError,
    TrainerState,
    combine,
    exact_match,
    load_reward,
    load_rewards,
    token_match,
)

PROMPTS = ["reverse: a b", "reverse: c d"]
COMPLETIONS = ["b a", "d c x"]
COLUMNS = {"answer": ["b a", "d c"], "level": [1, 2]}


def call(prompts=PROMPTS, completions=COMPLETIONS, columns=COLUMNS, step=0):
    return RewardCall(prompts=prompts, completions=completions,
                      completion_ids=[[1, 2]] * len(completions), columns=columns,
                      trainer_state=TrainerState(global_step=step, max_steps=10))


def raises(prompts, completions, **_):
    raise KeyError("answer")


def too_short(prompts, completions, **_):
    return [1.0]


def not_finite(prompts, completions, **_):
    return [1.0, math.nan]


def needs_a_missing_column(completions, solution):
    return [0.0] * len(completions)


def infinite(prompts, completions, **_):
    return [math.inf, 0.0]


def not_numbers(prompts, completions, **_):
    return ["high", "low"]


def not_a_list(prompts, completions, **_):
    return 1.0


def named_columns_only(prompts, completions, answer):
    return [float(len(a)) for a in answer]


def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def _spec(fn, weight=1.0):
    return {"_target_": f"{__name__}.{fn.__name__}", "weight": weight}


def test_shipped_rewards():
    assert exact_match(prompts=PROMPTS, completions=COMPLETIONS, **COLUMNS) == [1.0, 0.0]
    assert token_match(completions=COMPLETIONS, **COLUMNS) == [1.0, pytest.approx(2 / 3)]
    assert token_match(completions=["", "c d"], answer=["b a", "d c"]) == [0.0, 0.0]
    # Filler whitespace is an empty word, a miss.
    assert token_match(completions=[" b  a", "d c "], answer=["b a", "d c"]) == [pytest.approx(1 / 3), 1.0]
    # Conversational completions: the assistant message's content.
    chat = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert exact_match(completions=chat, answer=COLUMNS["answer"]) == [1.0, 0.0]


@pytest.mark.parametrize(("fn", "message"), [
    (raises, "raised KeyError"),
    (too_short, "returned 1 values for 2 completions"),
    (not_finite, "non-finite value nan for completion 1"),
    (needs_a_missing_column, r"takes \['solution'\], which nothing supplies"),
    (infinite, "non-finite value inf for completion 0"),
    (not_numbers, "must return a list of floats"),
    (not_a_list, "must return a list of floats"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_a_reward_that_breaks_the_contract_fails_naming_the_function(fn, message):
    reward = load_reward(_spec(fn), key="task.reward")
    with pytest.raises(RewardError, match=message) as info:
        reward(call())
    assert f"reward {fn.__name__}:" in str(info.value)


def test_a_function_without_kwargs_gets_only_the_columns_it_names():
    reward = load_reward(_spec(named_columns_only), key="task.reward")
    assert reward(call()) == [3.0, 3.0]


def test_several_rewards_sum_with_their_weights():
    rewards = load_rewards(_spec(length, 0.5),
                           {"exact": {"_target_": "tq_plugin.rl.tasks.rewards.exact_match",
                                      "weight": 2.0}})
    total, each = combine(rewards, call())
    assert total == [0.5 * 3 + 2.0, 0.5 * 5]
    # Named as TRL names them: task.reward's by its function, task.rewards' by their keys.
    assert each == {"length": [3.0, 5.0], "exact": [1.0, 0.0]}


@pytest.mark.parametrize(("spec", "message"), [
    ({"_target_": "no_such_module.fn"}, r"task.reward._target_: cannot import 'no_such_module.fn'"),
    ({"_target_": f"{__name__}.PROMPTS"}, "is not callable"),
    ({"_target_": f"{__name__}.length", "weight": float("nan")}, "task.reward.weight"),
    ({"_target_": f"{__name__}.length", "scale": 2}, r"unknown key\(s\) \['scale'\]"),
])
def test_a_bad_reward_spec_is_a_config_error_naming_the_key(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_reward(spec, key="task.reward")


def test_no_reward_at_all_is_refused():
    with pytest.raises(ConfigError, match="needs a reward function"):
        load_rewards(None, {})


# ---------------------------------------------------------------- TRL's keyword contract
SEEN: dict = {}


def trl_style(completions, solution, **kwargs):
    """Written as TRL documents it: by keyword, conversational completions."""
    SEEN.update(kwargs, completions=completions, solution=solution)
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


def only_ids(completion_ids):
    return [float(len(i)) for i in completion_ids]


def scheduled(completions, trainer_state, **_):
    return [float(trainer_state.global_step)] * len(completions)


def maybe(completions, applies, **_):
    return [1.0 if a else None for a in applies]


def never(completions, **_):
    return [None] * len(completions)


def logs(completions, log_extra, log_metric, **_):
    log_extra("why", ["a", "b"])
    log_metric("custom", 0.5)
    return [0.0] * len(completions)


EVENTS: list = []


async def slow_async(completions, **_):
    import asyncio

    EVENTS.append("start slow")
    await asyncio.sleep(0.05)
    EVENTS.append("end slow")
    return [2.0] * len(completions)


async def fast_async(completions, **_):
    EVENTS.append("start fast")
    EVENTS.append("end fast")
    return [3.0] * len(completions)


def test_a_trl_style_function_gets_everything_by_keyword():
    chat_prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    chat = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    reward = load_reward(_spec(trl_style), key="task.reward")
    out = reward(call(chat_prompts, chat, {"solution": ["b a", "x"], "level": [1, 2]}, step=7))
    assert out == [1.0, 0.0]
    assert SEEN["prompts"] == chat_prompts and SEEN["level"] == [1, 2]
    assert SEEN["completion_ids"] == [[1, 2], [1, 2]]
    assert SEEN["trainer_state"].global_step == 7 and SEEN["trainer_state"].max_steps == 10
    assert callable(SEEN["log_extra"]) and callable(SEEN["log_metric"])


def test_a_function_naming_what_it_needs_gets_only_that():
    assert load_reward(_spec(only_ids), key="task.reward")(call()) == [2.0, 2.0]
    assert load_reward(_spec(scheduled), key="task.reward")(call(step=3)) == [3.0, 3.0]


def test_none_means_not_applicable_the_total_is_the_weighted_nansum():
    rewards = load_rewards(None, {"maybe": _spec(maybe, 2.0), "len": _spec(length, 0.5),
                                  "never": _spec(never)})
    total, each = combine(rewards, call(columns={"applies": [True, False]}))
    # Completion 0: 2*1 + 0.5*3; completion 1: maybe does not apply, 0.5*5 only.
    assert total == [2.0 + 1.5, 2.5]
    assert each["maybe"][0] == 1.0 and math.isnan(each["maybe"][1])
    assert all(math.isnan(v) for v in each["never"])


def test_a_completion_no_reward_applies_to_is_nan_not_zero():
    total, _ = combine(load_rewards(_spec(never), None), call())
    assert all(math.isnan(t) for t in total)


def test_async_rewards_are_awaited_concurrently_after_the_sync_ones():
    EVENTS.clear()
    rewards = load_rewards(None, {"slow": _spec(slow_async), "len": _spec(length),
                                  "fast": _spec(fast_async)})
    total, each = combine(rewards, call())
    assert each == {"slow": [2.0, 2.0], "len": [3.0, 5.0], "fast": [3.0, 3.0]}
    assert total == [8.0, 10.0]
    # Both started before the slow one ended: they ran concurrently.
    assert EVENTS.index("start fast") < EVENTS.index("end slow")


def test_log_extra_and_log_metric_are_kept_on_the_call():
    c = call()
    load_reward(_spec(logs), key="task.reward")(c)
    assert c.extra == {"why": ["a", "b"]} and c.metrics == {"custom": [0.5]}


def positional_only(prompts, completions, /):
    return [0.0] * len(completions)


def test_positional_only_parameters_are_refused_at_load():
    with pytest.raises(ConfigError, match="task.reward._target_: reward positional_only: takes "
                                          "positional-only parameters"):
        load_reward(_spec(positional_only), key="task.reward")


def test_two_rewards_named_alike_are_refused():
    with pytest.raises(ConfigError, match="named alike"):
        load_rewards(_spec(length), {"length": _spec(only_ids)})

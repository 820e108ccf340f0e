"""The reward-function contract of ``task=prompts``: ``f(prompts, completions, **columns)``
returns one finite float per completion, or the step fails naming the function."""

from __future__ import annotations

import math

import pytest

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.rewards import (
    RewardError,
    combine,
    exact_match,
    load_reward,
    load_rewards,
    token_match,
)

PROMPTS = ["reverse: a b", "reverse: c d"]
COMPLETIONS = ["b a", "d c x"]
COLUMNS = {"answer": ["b a", "d c"], "level": [1, 2]}


def raises(prompts, completions, **_):
    raise KeyError("answer")


def too_short(prompts, completions, **_):
    return [1.0]


def not_finite(prompts, completions, **_):
    return [1.0, math.nan]


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
    assert exact_match(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 0.0]
    assert token_match(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, pytest.approx(2 / 3)]
    assert token_match(PROMPTS, ["", "c d"], answer=["b a", "d c"]) == [0.0, 0.0]
    # Filler whitespace is an empty word, a miss.
    assert token_match(PROMPTS, [" b  a", "d c "], answer=["b a", "d c"]) == [pytest.approx(1 / 3), 1.0]


@pytest.mark.parametrize(("fn", "message"), [
    (raises, "raised KeyError"),
    (too_short, "returned 1 values for 2 completions"),
    (not_finite, "non-finite value nan for completion 1"),
    (infinite, "non-finite value inf for completion 0"),
    (not_numbers, "must return a list of floats"),
    (not_a_list, "must return a list of floats"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_a_reward_that_breaks_the_contract_fails_naming_the_function(fn, message):
    reward = load_reward(_spec(fn), key="task.reward")
    with pytest.raises(RewardError, match=message) as info:
        reward(PROMPTS, COMPLETIONS, COLUMNS)
    assert f"{__name__}.{fn.__name__}" in str(info.value)


def test_a_function_without_kwargs_gets_only_the_columns_it_names():
    reward = load_reward(_spec(named_columns_only), key="task.reward")
    assert reward(PROMPTS, COMPLETIONS, COLUMNS) == [3.0, 3.0]


def test_several_rewards_sum_with_their_weights():
    rewards = load_rewards(_spec(length, 0.5),
                           {"exact": {"_target_": "tq_plugin.rl.tasks.rewards.exact_match",
                                      "weight": 2.0}})
    total, each = combine(rewards, PROMPTS, COMPLETIONS, COLUMNS)
    assert total == [0.5 * 3 + 2.0, 0.5 * 5]
    assert each[f"{__name__}.length"] == [3.0, 5.0]


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

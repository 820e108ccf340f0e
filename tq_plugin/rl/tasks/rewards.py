"""Reward functions for ``task=prompts``: TRL's contract, checked on every call.

A reward function is any importable callable ``f(prompts, completions, **columns) -> list[float]``
(``prompts``, ``completions``: one string per rollout; ``columns``: the dataset's other columns,
one value per rollout, e.g. ``answer``), named by ``task.reward._target_`` (several:
``task.rewards.<name>._target_``, each with a ``weight``; a rollout's reward is the weighted sum).
A function that takes no ``**kwargs`` gets only the columns it names.

The contract is checked at every call, and a breach fails the step with a ``RewardError`` naming
the function: a reward that raises, returns something other than one finite number per rollout,
never turns into a silent 0 that GRPO would happily train on.

The shipped functions: :func:`exact_match` (1.0 when the completion, stripped, equals ``answer``)
and :func:`token_match` (the fraction of whitespace-separated tokens in the right place, the
partial credit the ``reverse`` text task trains on).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.utils import get_object

from tq_plugin.config import ConfigError

RewardFn = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """A reward function broke its contract (raised, wrong length, non-finite value); the
    message names the function."""


@dataclass(frozen=True)
class Reward:
    """One configured reward: the function, its weight and the columns it is given."""

    name: str
    fn: RewardFn
    weight: float
    # None: every column (the function takes **kwargs); else the ones it names.
    accepts: frozenset[str] | None

    def __call__(self, prompts: list[str], completions: list[str],
                 columns: Mapping[str, list[Any]]) -> list[float]:
        kwargs = dict(columns) if self.accepts is None else {
            k: v for k, v in columns.items() if k in self.accepts}
        try:
            out = self.fn(prompts, completions, **kwargs)
        except Exception as exc:
            raise RewardError(f"reward {self.name}: raised {type(exc).__name__}: {exc}") from exc
        try:
            values = [float(v) for v in out]
        except (TypeError, ValueError) as exc:
            raise RewardError(f"reward {self.name}: must return a list of floats, got "
                              f"{type(out).__name__} ({exc})") from exc
        if len(values) != len(completions):
            raise RewardError(f"reward {self.name}: returned {len(values)} values for "
                              f"{len(completions)} completions")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RewardError(f"reward {self.name}: non-finite value {values[bad[0]]!r} for "
                              f"completion {bad[0]} (of {len(bad)} such)")
        return values


def _accepted(fn: RewardFn) -> frozenset[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def load_reward(spec: Mapping[str, Any], *, key: str) -> Reward:
    """The reward ``spec`` (``{_target_, weight}``, at config key ``key``) names; a target that
    does not import or is not callable is a ``ConfigError`` naming the key."""
    target = spec.get("_target_")
    if not target:
        raise ConfigError(f"{key}._target_: must name a reward function (module.fn)")
    try:
        fn = get_object(str(target))
    except Exception as exc:
        raise ConfigError(f"{key}._target_: cannot import {target!r} ({exc})") from exc
    if not callable(fn):
        raise ConfigError(f"{key}._target_: {target!r} is not callable")
    weight = float(spec.get("weight", 1.0))
    if not math.isfinite(weight):
        raise ConfigError(f"{key}.weight: must be finite, got {weight!r}")
    unknown = sorted(set(spec) - {"_target_", "weight"})
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown} (a reward has _target_ and weight)")
    return Reward(name=str(target), fn=fn, weight=weight, accepts=_accepted(fn))


def load_rewards(reward: Mapping[str, Any] | None,
                 rewards: Mapping[str, Mapping[str, Any]] | None) -> list[Reward]:
    """``task.reward`` (one) plus ``task.rewards`` (named); at least one is needed."""
    out = [load_reward(reward, key="task.reward")] if reward and reward.get("_target_") else []
    out += [load_reward(spec, key=f"task.rewards.{name}") for name, spec in (rewards or {}).items()]
    if not out:
        raise ConfigError("task.reward._target_: task=prompts needs a reward function")
    return out


def combine(rewards: Sequence[Reward], prompts: list[str], completions: list[str],
            columns: Mapping[str, list[Any]]) -> tuple[list[float], dict[str, list[float]]]:
    """``(weighted sum per completion, each reward's own values)``."""
    total = [0.0] * len(completions)
    each: dict[str, list[float]] = {}
    for reward in rewards:
        values = reward(prompts, completions, columns)
        each[reward.name] = values
        total = [t + reward.weight * v for t, v in zip(total, values)]
    return total, each


def exact_match(prompts: list[str], completions: list[str], answer: list[Any],
                **_: Any) -> list[float]:
    """1.0 where the completion, stripped, equals the ``answer`` column, else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def token_match(prompts: list[str], completions: list[str], answer: list[Any],
                **_: Any) -> list[float]:
    """Per completion: space-separated words equal to ``answer``'s at the same position, over
    the longer of the two (a wrong length counts as misses); 1.0 is an exact match. Split on
    single spaces after stripping the ends, so a run of spaces is an empty word, a miss: a
    policy cannot pad its answer with whitespace tokens for free."""
    out = []
    for completion, target in zip(completions, answer):
        got, want = completion.strip().split(" "), str(target).strip().split(" ")
        hits = sum(g == w for g, w in zip(got, want))
        out.append(hits / max(len(got), len(want), 1))
    return out


__all__ = ["Reward", "RewardError", "RewardFn", "combine", "exact_match", "load_reward",
           "load_rewards", "token_match"]

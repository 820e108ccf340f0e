"""Reward functions for ``task=prompts``: TRL's contract (``GRPOTrainer``'s reward call), checked
on every call.

A reward function is any importable callable, named by ``task.reward._target_`` (several:
``task.rewards.<name>._target_``, each with a ``weight``). It is called **by keyword**, as TRL
calls it:

* ``prompts``: the dataset prompts, one per completion (a string, or for conversational data the
  message list ``[{"role", "content"}, ...]``);
* ``completions``: the decoded completions, special tokens skipped (strings, or for
  conversational data ``[{"role": "assistant", "content": text}]``);
* ``completion_ids``: each completion's generated token ids (unpadded, the stop token cut off);
* every other dataset column (``answer``, ``solution``, metadata), one value per completion;
* ``trainer_state``: :class:`TrainerState` (``global_step``: the RL step; ``max_steps``);
* ``log_extra(column, values)`` and ``log_metric(name, value)``: extra columns of the sample
  completions (``completions.jsonl``) and extra per-step figures.

A function that takes ``**kwargs`` gets all of them; one that names only what it needs gets only
that (a required name nothing supplies is a ``RewardError`` naming it). Coroutine functions (and
callables returning awaitables) are awaited, several concurrently, after the synchronous ones.

Each returns one value per completion: a finite number, or ``None`` (the reward does not apply
to that completion; TRL's ``accuracy_reward`` says so for a gold answer that does not parse). A
completion's reward is the weighted sum of the rewards that apply to it (TRL's nan-sum); one to
which none applies is *unscorable*: NaN, kept out of its group's baseline, its advantage 0,
counted in ``rewards/unscorable`` and warned about. Anything else (a raise, a wrong length, a
non-number, NaN or inf) fails the step with a ``RewardError`` naming the function: never a
silent 0 that GRPO would happily train on.

Each reward's name (``rewards/<name>/mean`` and ``/std`` in ``metrics.csv`` and the loggers) is
its ``task.rewards`` key, or for ``task.reward`` the function's ``__name__`` (partials unwrapped,
an instance's class name), as TRL names it.

The shipped functions: :func:`exact_match` (1.0 when the completion, stripped, equals ``answer``)
and :func:`token_match` (the fraction of whitespace-separated tokens in the right place, the
partial credit the ``reverse`` text task trains on); both take plain or conversational
completions.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tq_plugin.config import ConfigError

RewardFn = Callable[..., Sequence[float | None]]


class RewardError(RuntimeError):
    """A reward function broke its contract (raised, wrong length, non-finite value, a required
    argument nothing supplies); the message names the function, ``where`` (when the raiser
    passes ``function``) says where it is defined: ``module.name at file:line``."""

    def __init__(self, message: str, *, function: Any = None) -> None:
        super().__init__(message)
        self.where = definition(function) if function is not None else None


def definition(fn: Any) -> str | None:
    """``module.qualname at file:line`` of a function (partials and wrappers unwrapped; an
    instance's class); what of it can be found."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isclass(fn)):
        fn = type(fn)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    try:
        return f"{name} at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return name


def _not_found(key: str, target: str, module: str) -> ConfigError:
    """A ``ConfigError`` for a target whose top-level module is nowhere on the import path,
    with the fix (``fix``: the line ``tq-train`` prints after the message)."""
    cwd = os.getcwd()
    where = "PYTHONPATH, the installed packages" + (
        f", the working directory {cwd}" if cwd in sys.path or "" in sys.path else "")
    exc = ConfigError(f"{key}: cannot import {target!r}: no module named {module!r} on the "
                      f"import path ({where})")
    exc.fix = (f"run from the folder that holds {module}.py, or put that folder on the import "
               f"path: PYTHONPATH=<folder> tq-train ...")
    return exc


def import_target(target: str, key: str) -> Any:
    """The object ``target`` names (``module.function``, ``package.module.Class.method``),
    imported without Hydra's error log. What fails is a one-line ``ConfigError`` naming ``key``:
    a module that is not on the import path (and how to put it there), a module that raised
    while importing, a missing attribute."""
    parts = target.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"{key}: {target!r} is not module.function (e.g. my_reward.reward)")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module + ".").startswith(exc.name + "."):
                continue  # no such module (or package): a shorter prefix may be one
            raise ConfigError(f"{key}: cannot import {target!r}: importing {module} raised "
                              f"ModuleNotFoundError: {exc}") from exc
        except Exception as exc:  # the user's module failed while it ran
            raise ConfigError(f"{key}: cannot import {target!r}: importing {module} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        break
    else:
        raise _not_found(key, target, parts[0])
    for i, attr in enumerate(parts[cut:]):
        if not hasattr(obj, attr):
            raise ConfigError(f"{key}: cannot import {target!r}: {'.'.join(parts[:cut + i])} "
                              f"has no {attr!r}")
        obj = getattr(obj, attr)
    return obj


@dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as ``trainer_state``: the RL step being generated
    (``global_step``, 0-based) and the run's ``max_steps`` (``recipe.num_steps``), the fields of
    transformers' ``TrainerState`` a reward schedule reads."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class RewardCall:
    """One scoring call's inputs and what the functions logged through it."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: Mapping[str, list[Any]]
    trainer_state: TrainerState = field(default_factory=TrainerState)
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "completions": self.completions,
                "completion_ids": self.completion_ids, **self.columns,
                "trainer_state": self.trainer_state, "log_extra": self.log_extra,
                "log_metric": self.log_metric}

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra[str(column)] = list(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004  (an instance with an async __call__)


def reward_name(fn: Any) -> str:
    """TRL's name of a reward function: ``__name__``, partials unwrapped, else the class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


@dataclass(frozen=True)
class Reward:
    """One configured reward: its name, the function, its weight and the arguments it takes."""

    name: str
    fn: RewardFn
    weight: float
    # None: every argument (the function takes **kwargs); else the names it declares.
    accepts: frozenset[str] | None
    # The declared names without a default: a call that supplies none of them fails by name.
    required: frozenset[str] = frozenset()
    is_async: bool = False

    def arguments(self, call: RewardCall) -> dict[str, Any]:
        supplied = call.kwargs()
        missing = sorted(self.required - set(supplied))
        if missing:
            raise RewardError(f"reward {self.name}: takes {missing}, which nothing supplies (the "
                              f"arguments: prompts, completions, completion_ids, trainer_state, "
                              f"log_extra, log_metric and the dataset columns "
                              f"{sorted(call.columns)})", function=self.fn)
        if self.accepts is None:
            return supplied
        return {k: v for k, v in supplied.items() if k in self.accepts}

    def check(self, out: Any, n: int) -> list[float]:
        """``out`` as floats, ``None`` as NaN; a breach of the contract is a ``RewardError``."""
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
            raise RewardError(f"reward {self.name}: must return a list of floats (or None), got "
                              f"{type(out).__name__}", function=self.fn)
        out = out.tolist() if hasattr(out, "tolist") else list(out)
        try:
            values = [math.nan if v is None else float(v) for v in out]
        except (TypeError, ValueError) as exc:
            raise RewardError(f"reward {self.name}: must return a list of floats (or None), got "
                              f"{type(out).__name__} ({exc})", function=self.fn) from exc
        if len(values) != n:
            raise RewardError(f"reward {self.name}: returned {len(values)} values for {n} "
                              f"completions", function=self.fn)
        bad = [i for i, (v, o) in enumerate(zip(values, out)) if o is not None and not math.isfinite(v)]
        if bad:
            raise RewardError(f"reward {self.name}: non-finite value {values[bad[0]]!r} for "
                              f"completion {bad[0]} (of {len(bad)} such; return None for a "
                              f"completion the reward does not apply to)", function=self.fn)
        return values

    def __call__(self, call: RewardCall) -> list[float]:
        """The synchronous call (an async function's result is awaited here, alone)."""
        try:
            out = self.fn(**self.arguments(call))
            if inspect.isawaitable(out):
                out = _run_coroutines([out])[0]
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"reward {self.name}: raised {type(exc).__name__}: {exc}") from exc
        return self.check(out, len(call.completions))


def _run_coroutines(awaitables: list[Any]) -> list[Any]:
    """Await ``awaitables`` concurrently and return their results (or exceptions) in order: on
    this thread's own event loop, or, when one is already running here, on a helper thread's."""
    async def gather() -> list[Any]:
        return list(await asyncio.gather(*awaitables, return_exceptions=True))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(gather())), daemon=True)
    thread.start()
    thread.join()
    return box[0]


def _signature(fn: RewardFn) -> tuple[frozenset[str] | None, frozenset[str]]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, frozenset()
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        raise ConfigError(f"reward {reward_name(fn)}: takes positional-only parameters; reward "
                          f"functions are called by keyword (prompts=, completions=, ...)")
    keyword = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)]
    required = frozenset(p.name for p in keyword if p.default is inspect.Parameter.empty)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None, required
    return frozenset(p.name for p in keyword), required


def load_reward(spec: Mapping[str, Any], *, key: str, name: str | None = None) -> Reward:
    """The reward ``spec`` (``{_target_, weight}``, at config key ``key``) names; a target that
    does not import or is not callable is a ``ConfigError`` naming the key. ``name``: the
    reward's name in the metrics (default: the function's)."""
    target = spec.get("_target_")
    if not target:
        raise ConfigError(f"{key}._target_: must name a reward function (module.fn)")
    fn = import_target(str(target), f"{key}._target_")
    if not callable(fn):
        raise ConfigError(f"{key}._target_: {target!r} is not callable")
    weight = float(spec.get("weight", 1.0))
    if not math.isfinite(weight):
        raise ConfigError(f"{key}.weight: must be finite, got {weight!r}")
    unknown = sorted(set(spec) - {"_target_", "weight"})
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown} (a reward has _target_ and weight)")
    try:
        accepts, required = _signature(fn)
    except ConfigError as exc:
        raise ConfigError(f"{key}._target_: {exc}") from exc
    return Reward(name=name or reward_name(fn), fn=fn, weight=weight, accepts=accepts,
                  required=required, is_async=_is_async(fn))


def load_rewards(reward: Mapping[str, Any] | None,
                 rewards: Mapping[str, Mapping[str, Any]] | None) -> list[Reward]:
    """``task.reward`` (one) plus ``task.rewards`` (named by their keys); at least one is
    needed, and names are unique."""
    out = [load_reward(reward, key="task.reward")] if reward and reward.get("_target_") else []
    out += [load_reward(spec, key=f"task.rewards.{name}", name=str(name))
            for name, spec in (rewards or {}).items()]
    if not out:
        raise ConfigError("task.reward._target_: task=prompts needs a reward function")
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"task.rewards: two rewards are named alike ({names}); give "
                          f"task.reward's function another name, or key it under task.rewards")
    return out


def score_all(rewards: Sequence[Reward], call: RewardCall) -> dict[str, list[float]]:
    """Each reward's values (``None`` as NaN), in ``rewards`` order: the synchronous functions
    one after another, then the asynchronous ones concurrently."""
    each: dict[str, list[float]] = {}
    pending: list[tuple[Reward, Any]] = []
    for reward in rewards:
        if not reward.is_async:
            each[reward.name] = reward(call)
            continue
        try:
            pending.append((reward, reward.fn(**reward.arguments(call))))
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"reward {reward.name}: raised {type(exc).__name__}: {exc}") from exc
    results = _run_coroutines([aw for _, aw in pending]) if pending else []
    for (reward, _), out in zip(pending, results):
        if isinstance(out, BaseException):
            raise RewardError(f"reward {reward.name}: raised {type(out).__name__}: {out}") from out
        each[reward.name] = reward.check(out, len(call.completions))
    return {r.name: each[r.name] for r in rewards}


def weighted_nansum(rewards: Sequence[Reward], each: Mapping[str, list[float]]) -> list[float]:
    """Per completion, ``sum_k w_k r_k`` over the rewards that apply (not NaN); NaN where none
    does (an unscorable completion)."""
    n = len(next(iter(each.values()))) if each else 0
    total = []
    for i in range(n):
        applies = [(r.weight, each[r.name][i]) for r in rewards if not math.isnan(each[r.name][i])]
        total.append(sum(w * v for w, v in applies) if applies else math.nan)
    return total


def combine(rewards: Sequence[Reward], call: RewardCall) -> tuple[list[float], dict[str, list[float]]]:
    """``(weighted nan-sum per completion, each reward's own values)`` of one call."""
    each = score_all(rewards, call)
    return weighted_nansum(rewards, each), each


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or a conversational completion's last message's
    ``content``."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"])


def exact_match(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion, stripped, equals the ``answer`` column, else 0.0."""
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def token_match(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """Per completion: space-separated words equal to ``answer``'s at the same position, over
    the longer of the two (a wrong length counts as misses); 1.0 is an exact match. Split on
    single spaces after stripping the ends, so a run of spaces is an empty word, a miss: a
    policy cannot pad its answer with whitespace tokens for free."""
    out = []
    for completion, target in zip(completions, answer):
        got, want = completion_text(completion).strip().split(" "), str(target).strip().split(" ")
        hits = sum(g == w for g, w in zip(got, want))
        out.append(hits / max(len(got), len(want), 1))
    return out


__all__ = ["Reward", "RewardCall", "RewardError", "RewardFn", "TrainerState", "combine",
           "completion_text", "definition", "exact_match", "import_target", "load_reward",
           "load_rewards", "reward_name", "score_all", "token_match", "weighted_nansum"]

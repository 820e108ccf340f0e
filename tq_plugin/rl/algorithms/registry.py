"""The registries of policy losses and advantage estimators: one list of names each.

A loss or an estimator is one function and one name (verl's ``register_policy_loss`` and
``register_adv_est``); the trainer looks the name up (``recipe.loss_type``,
``recipe.advantage_estimator``). The built-in ones register themselves when
:mod:`~tq_plugin.rl.algorithms.losses` and :mod:`~tq_plugin.rl.algorithms.advantages` are
imported; a user's register themselves when their module is imported, which
:func:`import_user_modules` does for the modules ``recipe.imports`` names. The config schema is
torch-free and cannot see these lists, so the names are checked here (:func:`check_registered`),
after the imports.

Torch-free itself: the registries hold functions, and the built-in modules are imported only
when a name is looked up.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tq_plugin.config.rules import ConfigError

# How a loss's per-token terms become one global batch's loss (verl's loss_agg_mode):
#  token_mean:            the token sum over the global batch's action tokens (dapo, cispo);
#  seq_mean_token_mean:   each sequence's token mean, then the mean over its sequences (grpo);
#  seq_mean_token_sum_norm: the token sum over sequences x max completion tokens (dr_grpo);
#  microbatch_token_mean: each microbatch's token mean, over the global batch's microbatches
#                         (bnpo: depends on the microbatch cut, as TRL's on the device batch).
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm",
                "microbatch_token_mean")

PolicyLoss = Callable[..., Any]
AdvantageEstimator = Callable[..., Any]
# The names the config had before the registry, kept so a caller passing the algorithm works.
ESTIMATOR_ALIASES = {"ppo": "gae"}


@dataclass(frozen=True)
class RegisteredLoss:
    """A policy loss under its name: the per-token function and its aggregation."""

    name: str
    fn: PolicyLoss
    aggregation: str


POLICY_LOSSES: dict[str, RegisteredLoss] = {}
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """One function defined at one place: a module imported twice re-registers it harmlessly."""
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == \
        (getattr(b, "__module__", None), getattr(b, "__qualname__", None))


def register_policy_loss(name: str, *, aggregation: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a per-token policy loss as ``recipe.loss_type=name``, aggregated by
    ``aggregation`` (one of :data:`AGGREGATIONS`). Stack the decorator to register one function
    under several names.

    The function is called ``fn(logprobs, old_logprobs, advantages, mask, **options)`` with
    ``[B, S]`` tensors and returns ``(terms, parts)``: ``terms`` the per-token loss (the caller
    masks and aggregates it) and ``parts`` a dict with at least ``ratio``, ``log_ratio``,
    ``clipped``, ``clip_low``, ``clip_high`` (per token; the step's metrics read them).
    ``options`` holds ``clip_eps``, ``clip_eps_high``, ``cispo_cap``, ``level``, ``weights``
    (the importance-sampling correction, to multiply the terms by) and ``sequence_ids``:
    accept ``**_`` for those it does not use. A name already taken by another function is an
    error (re-registering the same function, as a re-imported module does, is not)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"register_policy_loss({name!r}): aggregation must be one of "
                         f"{list(AGGREGATIONS)}, got {aggregation!r}")

    def register(fn: PolicyLoss) -> PolicyLoss:
        taken = POLICY_LOSSES.get(name)
        if taken is not None and not _same_function(taken.fn, fn):
            raise ValueError(f"register_policy_loss: {name!r} is already "
                             f"{taken.fn.__module__}.{taken.fn.__qualname__}")
        POLICY_LOSSES[name] = RegisteredLoss(name, fn, aggregation)
        return fn
    return register


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register an advantage estimator as ``recipe.advantage_estimator=name``.

    The estimator is called with keyword arguments only and returns ``(advantages, returns)``:

    * ``mask`` ``[B, S]``: the action mask (token mask times sample mask);
    * ``total_reward`` ``[B]``: each row's reward; rows are group-major (``group_size``
      consecutive rows per prompt);
    * ``turn_rewards`` ``[B, turns]`` or None: each turn's reward;
    * ``values`` ``[B, S]`` or None: the value model's (``recipe.algorithm=ppo`` only);
    * ``group_size``, ``gamma``, ``lam`` (``recipe.gae_lambda``), ``scale_rewards``.

    ``advantages`` is ``[B, S]``, 0 off the mask; ``returns`` is ``[B, S]`` (the value model's
    targets: ``recipe.algorithm=ppo`` needs them) or None. Accept ``**_`` for the arguments it
    does not use, so a new one does not break it."""
    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        taken = ADVANTAGE_ESTIMATORS.get(name)
        if taken is not None and not _same_function(taken, fn):
            raise ValueError(f"register_advantage_estimator: {name!r} is already "
                             f"{taken.__module__}.{taken.__qualname__}")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return register


def _load_builtins() -> None:
    """Import the modules whose functions register the built-in names."""
    importlib.import_module("tq_plugin.rl.algorithms.losses")
    importlib.import_module("tq_plugin.rl.algorithms.advantages")


def registered_losses() -> list[str]:
    """Every registered ``recipe.loss_type``, built-in and the user's, sorted."""
    _load_builtins()
    return sorted(POLICY_LOSSES)


def registered_advantage_estimators() -> list[str]:
    """Every registered ``recipe.advantage_estimator``, sorted."""
    _load_builtins()
    return sorted(ADVANTAGE_ESTIMATORS)


def loss_aggregation(loss_type: str) -> str:
    """The aggregation ``loss_type`` was registered with (ValueError for an unknown name)."""
    _load_builtins()
    try:
        return POLICY_LOSSES[loss_type].aggregation
    except KeyError:
        raise ValueError(f"loss_type must be one of {sorted(POLICY_LOSSES)}, got "
                         f"{loss_type!r}") from None


def _unknown(key: str, what: str, name: Any, registered: list[str], how: str) -> ConfigError:
    close = difflib.get_close_matches(str(name), registered, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{key}: unknown {what} {name!r}{hint}; registered: "
                       f"{', '.join(registered)}; {how}")


def advantage_estimator_name(rc: Any) -> str:
    """The estimator in force: ``recipe.advantage_estimator``, else the algorithm's own (``gae``
    for ``ppo``, ``grpo`` for ``grpo``). ``rc`` is the ``recipe`` section (dataclass or
    DictConfig)."""
    name = getattr(rc, "advantage_estimator", None)
    if name is not None:
        return str(name)
    return "gae" if getattr(rc, "algorithm", "ppo") == "ppo" else "grpo"


def check_registered(rc: Any) -> None:
    """Raise a one-line :class:`~tq_plugin.config.ConfigError` when ``recipe.loss_type`` or
    ``recipe.advantage_estimator`` names nothing registered. Call it after
    :func:`import_user_modules`, whose modules may register the names."""
    losses = registered_losses()
    if rc.loss_type not in POLICY_LOSSES:
        raise _unknown("recipe.loss_type", "loss", rc.loss_type, losses,
                       "register one with @register_policy_loss in a module named in "
                       "recipe.imports")
    estimator = getattr(rc, "advantage_estimator", None)
    if estimator is not None and estimator not in ADVANTAGE_ESTIMATORS:
        raise _unknown("recipe.advantage_estimator", "advantage estimator", estimator,
                       registered_advantage_estimators(),
                       "register one with @register_advantage_estimator in a module named in "
                       "recipe.imports")


def import_user_modules(names: Iterable[str]) -> None:
    """Import each module of ``recipe.imports`` (dotted names), so the losses and estimators it
    registers can be selected by name.

    A module is found on ``sys.path``, and else in the working directory, as ``python -m`` would
    find it (a console script such as ``tq-train`` does not put the working directory on
    ``sys.path``). Importing is idempotent: a module already imported is not run again. A
    module that cannot be imported is a one-line ConfigError naming it and the cause."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"recipe.imports: entries must be module names, got {name!r}")
        try:
            importlib.import_module(name)
        except Exception as exc:  # a user's module may fail in any way while it runs
            cause = str(exc).strip().splitlines()
            raise ConfigError(f"recipe.imports: cannot import {name!r} ({type(exc).__name__}: "
                              f"{cause[0] if cause else ''})") from exc


__all__ = ["ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "ESTIMATOR_ALIASES", "POLICY_LOSSES",
           "RegisteredLoss", "advantage_estimator_name", "check_registered",
           "import_user_modules", "loss_aggregation", "register_advantage_estimator",
           "register_policy_loss", "registered_advantage_estimators", "registered_losses"]

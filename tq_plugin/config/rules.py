"""The rule helpers every typed schema uses: the one error type and its wording.

Torch-free (imported on every Hydra start through the search-path plugin)."""

from __future__ import annotations

from typing import Any

from hydra.errors import CompactHydraException


class ConfigError(CompactHydraException, ValueError):
    """A config value breaks a rule; the message names the user-facing key and the rule.

    A ``CompactHydraException``, so a Hydra app that lets it escape prints the message alone
    (Hydra's convention for config errors); ``HYDRA_FULL_ERROR=1`` shows the whole trace. It is
    also a ``ValueError``, so ``except ValueError`` keeps working.
    """


def fail(key: str, rule: str) -> None:
    raise ConfigError(f"{key}: {rule}")


def positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        fail(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        fail(key, f"must be one of {list(allowed)}, got {value!r}")


__all__ = ["ConfigError", "fail", "one_of", "positive"]

"""Build Lightning callbacks and loggers from Hydra config groups (``callbacks``, ``logger``).

Each group is a dict of configs, one per component; every entry with a ``_target_`` is
instantiated and the rest are skipped, so ``logger=csv``, ``logger=[csv,tensorboard]``,
``callbacks=none`` and ``~logger`` all compose to something these functions accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger


def _instantiate_all(cfg: Mapping[str, Any] | None, kind: type, group: str) -> list[Any]:
    from hydra.utils import instantiate

    if not cfg:
        return []
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{group}: must be a dict of configs, one per {kind.__name__}, got {cfg!r}")
    built = []
    for name, node in cfg.items():
        if not isinstance(node, Mapping) or "_target_" not in node:
            continue
        obj = instantiate(node)
        if not isinstance(obj, kind):
            raise TypeError(f"{group}.{name}: {node['_target_']} is not a Lightning {kind.__name__}")
        built.append(obj)
    return built


def instantiate_callbacks(
    cfg: Mapping[str, Any] | None, *, progress_bar: bool = True
) -> list[Callback]:
    """The ``callbacks`` group's entries, instantiated, in config order.

    ``progress_bar=False`` (pass the trainer's ``enable_progress_bar``) leaves progress bars out:
    Lightning refuses a progress-bar callback when the bar is disabled.
    """
    built = _instantiate_all(cfg, Callback, "callbacks")
    if progress_bar:
        return built
    from lightning.pytorch.callbacks import ProgressBar

    return [c for c in built if not isinstance(c, ProgressBar)]


def instantiate_loggers(cfg: Mapping[str, Any] | None) -> list[Logger]:
    """The ``logger`` group's entries, instantiated, in config order."""
    return _instantiate_all(cfg, Logger, "logger")


__all__ = ["instantiate_callbacks", "instantiate_loggers"]

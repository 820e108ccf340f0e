"""The step source ``recipe.topology`` names, built from the registry
(:data:`~tq_plugin.rl.topology.source.STEP_SOURCES`), where the built-in sources (``colocated``,
``disaggregated``) register themselves on import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tq_plugin.config import ConfigError
from tq_plugin.rl.topology import colocated, disaggregated  # noqa: F401  (they register)
from tq_plugin.rl.topology.source import STEP_SOURCES, StepSource


def build_step_source(cfg: Any, *, rc: Any, task: Any, output_dir: str | Path,
                      rollouts: Any) -> StepSource:
    """The step source ``recipe.topology`` names."""
    try:
        cls = STEP_SOURCES[rc.topology]
    except KeyError:
        raise ConfigError(f"recipe.topology: unknown topology {rc.topology!r}; registered: "
                          f"{', '.join(sorted(STEP_SOURCES))}") from None
    return cls(cfg, rc=rc, task=task, output_dir=output_dir, rollouts=rollouts)


__all__ = ["build_step_source"]

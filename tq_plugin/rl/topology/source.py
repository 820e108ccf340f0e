"""The one interface the recipe sees of a topology: a step source, built once at setup by name
(``recipe.topology``) from the registry, so neither the recipe nor the module branches on which
topology runs.

A step source is constructed from the run's config, then handed its collaborators
(:meth:`StepSource.attach`: the trained module, the step metrics, the ``DataPlaneCallback``, the
SIGTERM stop) before the trainer is built, and the trainer's shape after (:meth:`StepSource.bind`).
What it declares (class attributes) and answers (methods) is all the recipe asks of it. A new
topology (in-flight updates, say) subclasses :class:`StepSource` and registers itself with
:func:`register_step_source`; the config's ``recipe.topology`` then selects it
(:func:`tq_plugin.rl.topology.sources.build_step_source`). The torch-free config schema checks
``recipe.topology`` against its own list (``TOPOLOGIES`` in ``tq_plugin/config/recipe_schema.py``),
which the new name joins.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from tq_plugin.config import ConfigError
from tq_plugin.rl.training.metrics import MetricsLog


class StepSource:
    """What a topology gives the recipe (see the module docstring)."""

    name: ClassVar[str] = ""
    # The step metrics' class (its rows' columns).
    metrics_type: ClassVar[type[MetricsLog]] = MetricsLog
    # Rows may come from weights older than the trainer's: the IS correction is always on and
    # the module does not expect on-policy figures.
    off_policy: ClassVar[bool] = False
    # The task's own state (a prompt stream's cursor) rides the checkpoint; a source whose
    # tickets say which prompts come next keeps its own.
    checkpoints_task: ClassVar[bool] = True
    # Weights can change while a rollout generates (``recipe.inflight_updates``): only where
    # workers generate while the trainer trains.
    inflight_updates: ClassVar[bool] = False

    def __init__(self, cfg: Any, *, rc: Any, task: Any, output_dir: str | Path,
                 rollouts: Any) -> None:
        if getattr(rc, "inflight_updates", False) and not self.inflight_updates:
            raise ConfigError(
                f"recipe.inflight_updates=true: recipe.topology={self.name or type(self).__name__} "
                "generates every step with the trainer's weights of that step, so none can "
                "arrive mid-generation; use recipe.topology=disaggregated")
        self.cfg, self.rc, self.task = cfg, rc, task
        self.output_dir, self.rollouts = Path(output_dir), rollouts
        self.module: Any = None

    # ------------------------------------------------------------------ wiring
    def attach(self, *, module: Any, metrics: MetricsLog, dp_callback: Any, sigterm: Any) -> None:
        """The collaborators, before the trainer is built."""
        self.module, self.metrics = module, metrics
        self.dp_callback, self.sigterm = dp_callback, sigterm

    def callbacks(self) -> list[Any]:
        """Lightning callbacks of the source's own (publishing weights, stopping workers)."""
        return []

    def bind(self, *, world_size: int, replicated: bool, global_batch: int,
             sharded: bool) -> None:
        """The trainer's shape: ``replicated`` (every rank replays the step into its embedded
        store), the per-rank ``global_batch`` and whether the policy is ``sharded``."""
        self.world_size, self.replicated = world_size, replicated
        self.global_batch, self.sharded = global_batch, sharded

    # ------------------------------------------------------------------ what the recipe asks
    def prepare_step(self, step: int, client: Any = None) -> Any:
        raise NotImplementedError

    def own_store(self) -> Any:
        """The store the trainer's rows live in when not ``tq.backend`` (``None``: the
        backend's)."""
        return None

    def every_rank(self) -> bool:
        """Whether every rank runs :meth:`prepare_step` (rank 0 alone otherwise, under a
        shared store)."""
        return False

    def final_evaluation(self, trainer: Any) -> dict[str, float] | None:
        """``recipe.eval_every``'s last evaluation, of the trained weights (``None``: none)."""
        return None

    def summary(self) -> dict[str, Any]:
        """The source's own figures for ``result.json``."""
        return {}

    def close(self) -> None:
        """Release what the source started (idempotent)."""


STEP_SOURCES: dict[str, type[StepSource]] = {}


def register_step_source(name: str) -> Callable[[type[StepSource]], type[StepSource]]:
    """Register a :class:`StepSource` under ``name`` (a ``recipe.topology`` value)."""
    def register(cls: type[StepSource]) -> type[StepSource]:
        cls.name = name
        STEP_SOURCES[name] = cls
        return cls
    return register


__all__ = ["STEP_SOURCES", "StepSource", "register_step_source"]

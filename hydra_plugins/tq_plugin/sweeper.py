"""``hydra/sweeper=tq_dedup``: Hydra's basic sweeper, launching each distinct run once.

Jobs that differ only in keys their packing mode ignores (``tq/packing=none`` at two token
budgets) are one run (:func:`tq_plugin.config.sweeps.run_key`); the first is launched, the rest
are logged as skipped. Torch-free: Hydra imports this module on every start.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.
import logging
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.types import Override

from tq_plugin.config.sweeps import PACKING_GROUP, run_key

log = logging.getLogger(__name__)


@dataclass
class DedupSweeperConf:
    _target_: str = "hydra_plugins.tq_plugin.sweeper.DedupSweeper"
    max_batch_size: Any = None
    params: Any = None


ConfigStore.instance().store(group="hydra/sweeper", name="tq_dedup", node=DedupSweeperConf,
                             provider="tq_plugin")


class DedupSweeper(BasicSweeper):
    """Cartesian product of the sweep, minus jobs that would repeat an earlier job's run."""

    def split_arguments(  # type: ignore[override]
        self, overrides: "list[Override]", max_batch_size: int | None
    ) -> "list[list[list[str]]]":
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        choices = self.config.hydra.runtime.choices if self.config is not None else {}
        default_mode = choices.get(PACKING_GROUP)
        seen: dict[tuple[str, ...], list[str]] = {}
        kept = []
        for job in jobs:
            key = run_key(job, default_mode)
            if key in seen:
                log.info("skipping %s: the same run as %s", " ".join(job), " ".join(seen[key]))
                continue
            seen[key] = job
            kept.append(job)
        if not kept:
            return []
        return [list(c) for c in BasicSweeper.split_overrides_to_chunks(kept, max_batch_size)]

"""tq_plugin: a data plane for RL post-training with Lightning and Hydra.

``tq_plugin.train(config_name, overrides, output_dir=...)`` runs one ``tq-train`` run from Python
and returns a ``TrainResult`` (``tq_plugin.api``). Importing ``tq_plugin`` imports nothing
heavy: the API (and with it torch, Lightning and Hydra) loads at its first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tq_plugin.api import TrainResult, train

__all__ = ["TrainResult", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tq_plugin import api

        return getattr(api, name)
    raise AttributeError(f"module 'tq_plugin' has no attribute {name!r}")

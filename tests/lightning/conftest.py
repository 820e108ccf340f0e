"""Fixtures for the Lightning integration tests: a quiet, small, CPU-only Trainer factory."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from lightning.pytorch import Trainer


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    # The module-side hooks are the design (MetaBatchMixin); Lightning warns when a DataModule
    # is passed too.
    warnings.filterwarnings("ignore", message="You have overridden `(on_before_batch_transfer|transfer_batch_to_device|on_after_batch_transfer)`")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


@pytest.fixture
def make_trainer(tmp_path: Any) -> Callable[..., Trainer]:
    def make(**kwargs: Any) -> Trainer:
        opts: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
        }
        opts.update(kwargs)
        return Trainer(**opts)

    return make

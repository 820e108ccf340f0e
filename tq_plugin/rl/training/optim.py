"""The RL module's optimiser, learning-rate schedule and gradient clipping, from ``recipe``.

The names and the semantics are ``transformers``' (what TRL's ``GRPOConfig`` passes on):

* ``recipe.optimizer``: ``adamw`` (``torch.optim.AdamW``; with ``weight_decay`` 0 the same
  update as ``adam``), ``adam`` (``torch.optim.Adam``, weight decay added to the gradient, the
  coupled L2 form) or ``sgd`` (``torch.optim.SGD``, no momentum);
* ``recipe.weight_decay``: applied to matrices only; biases and norm weights (parameters of
  fewer than two dimensions) are never decayed, as ``transformers.Trainer`` excludes them;
* ``recipe.lr_scheduler``: ``constant``, ``linear`` (to 0 at the last optimizer step) or
  ``cosine`` (half a cosine to 0), after ``recipe.warmup_steps`` optimizer steps (or
  ``recipe.warmup_ratio`` of them) rising linearly from 0; the multiplier of optimizer step
  ``k`` (0-based) is :func:`lr_multiplier`'s;
* ``recipe.max_grad_norm``: the gradient norm over every trained parameter clipped to it
  before each optimizer step (``null``: no clipping); the norm before the clip is reported as
  ``grad_norm``.

The schedule counts optimizer steps (``recipe.num_steps x ppo_epochs x minibatches``, the
trainer's ``max_steps``), as TRL's does, and is stepped by Lightning after each one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from tq_plugin.config.recipe_schema import LR_SCHEDULERS, OPTIMIZERS


def warmup_steps(rc: Any, total: int) -> int:
    """The warmup length in optimizer steps: ``recipe.warmup_steps``, else
    ``ceil(warmup_ratio x total)`` (``transformers``' rounding)."""
    if rc.warmup_steps:
        return int(rc.warmup_steps)
    return math.ceil(float(rc.warmup_ratio) * total)


def lr_multiplier(step: int, *, schedule: str, total: int, warmup: int) -> float:
    """The factor on the base learning rate at optimizer step ``step`` (0-based) of ``total``."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"recipe.lr_scheduler: must be one of {list(LR_SCHEDULERS)}, got {schedule!r}")


def _decay_groups(params: Iterable[torch.nn.Parameter], lr: float,
                  weight_decay: float) -> list[dict[str, Any]]:
    params = [p for p in params if p.requires_grad]
    if not weight_decay:
        return [{"params": params, "lr": lr, "weight_decay": 0.0}]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "lr": lr, "weight_decay": weight_decay},
                        {"params": rest, "lr": lr, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(rc: Any, models: list[tuple[torch.nn.Module, float]]) -> torch.optim.Optimizer:
    """``recipe.optimizer`` over each ``(model, lr)``'s trainable parameters, with
    ``recipe.weight_decay`` on its matrices."""
    groups = [g for model, lr in models
              for g in _decay_groups(model.parameters(), lr, float(rc.weight_decay))]
    if rc.optimizer == "adamw":
        return torch.optim.AdamW(groups)
    if rc.optimizer == "adam":
        return torch.optim.Adam(groups)
    if rc.optimizer == "sgd":
        return torch.optim.SGD(groups)
    raise ValueError(f"recipe.optimizer: must be one of {list(OPTIMIZERS)}, got {rc.optimizer!r}")


def build_scheduler(rc: Any, optimizer: torch.optim.Optimizer,
                    total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``recipe.lr_scheduler`` over ``total`` optimizer steps. The multiplier is a plain
    function, so a checkpoint keeps only the step count: a run resumed with more
    ``recipe.num_steps`` follows the schedule of its new length."""
    schedule, warmup = str(rc.lr_scheduler), warmup_steps(rc, total)

    def factor(step: int) -> float:
        return lr_multiplier(step, schedule=schedule, total=total, warmup=warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def grad_norm_value(norm: torch.Tensor) -> float:
    """A ``clip_grad_norm_`` total as a float (a sharded run's is a ``DTensor``)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


__all__ = ["LR_SCHEDULERS", "OPTIMIZERS", "build_optimizer", "build_scheduler",
           "grad_norm_value", "lr_multiplier", "warmup_steps"]

"""``recipe.eval_every=K``: greedy completions of the task's held-out prompts every ``K`` RL
steps and once after the last, scored by the task's own reward.

The recipe evaluates at the start of a step (the engine holds that step's weights) and carries
the figures in the step meta; :class:`EvalLog` hands them as ``eval/reward`` and
``eval/accuracy`` to every configured Lightning logger at the step's first microbatch, on rank
0, at the trainer's global step. Straight to the loggers rather than through ``self.log``: a
value logged that way is repeated on every later step's row until it is logged again, and an
evaluation is one point. The final evaluation (the trained weights) goes into ``result.json``
under ``eval``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.training.step_record import RL_STEP
from tq_plugin.rollout import SamplingParams

EVAL = "eval"


def evaluates(task: Any) -> bool:
    """Whether ``task`` has held-out prompts to evaluate (``task.evaluate``, and for a dataset
    task, held-out rows: ``task.eval_path`` or ``task.eval_size``)."""
    return hasattr(task, "evaluate") and bool(getattr(task, "eval_rows", True))


def evaluate(task: Any, engine: Any, *, max_new_tokens: int) -> dict[str, float]:
    """``task.evaluate`` over ``engine``'s greedy completions (``{}``: the task holds none)."""
    if engine is None or not hasattr(task, "evaluate"):
        return {}
    allowed = task.output_token_ids
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=(task.eos_token_id,),
                            allowed_token_ids=None if allowed is None else tuple(allowed))

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        return [c.token_ids for c in engine.generate(prompts, params, seeds=[0] * len(prompts))]

    return task.evaluate(generate, max_new_tokens=max_new_tokens)


class EvalLog(Callback):
    """Logs a step's ``eval/*`` figures (carried in its meta) at the step's first microbatch."""

    def __init__(self) -> None:
        self.step: int | None = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        meta = pl_module.dp_meta
        step = meta.extra_info[MICROBATCH_INFO]["step"]
        figures = meta.extra_info.get(RL_STEP, {}).get(EVAL)
        if step == self.step or not figures:
            return
        self.step = step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{k}": float(v) for k, v in figures.items()},
                                   step=trainer.global_step)


__all__ = ["EVAL", "EvalLog", "evaluate", "evaluates"]

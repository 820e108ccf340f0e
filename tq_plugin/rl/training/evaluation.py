"""``recipe.eval_every=K``: greedy completions of the task's held-out prompts every ``K`` RL
steps and once after the last, scored by the task's own reward.

The recipe evaluates at the start of a step (the engine holds that step's weights) and carries
the figures in the step meta; :class:`EvalLog` hands them as ``eval/reward`` and
``eval/accuracy`` to every configured Lightning logger at the step's first microbatch, on rank
0, at the trainer's global step. Straight to the loggers rather than through ``self.log``: a
value logged that way is repeated on every later step's row until it is logged again, and an
evaluation is one point. The final evaluation (the trained weights) goes into ``result.json``
under ``eval``.

The held-out completions themselves: :func:`write_eval_completions` appends the latest
evaluation's rows to ``eval_completions.jsonl`` in the run dir, one JSON object per prompt with
the step (``step``: the RL step whose weights were evaluated; ``recipe.num_steps`` for the
trained weights): a task's own rows (``task.last_eval_rows``: ``task=reasoning_gym`` keeps the
prompt, completion, extracted answer, gold answer and score), else the prompt and completion
texts :func:`evaluate` decoded with the task's tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.training.step_record import RL_STEP
from tq_plugin.rollout import SamplingParams

EVAL = "eval"
EVAL_COMPLETIONS_FILE = "eval_completions.jsonl"
# A task without rows of its own: the texts of its latest evaluation (evaluate's fallback).
_DECODED: weakref.WeakKeyDictionary[Any, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


def evaluates(task: Any) -> bool:
    """Whether ``task`` has held-out prompts to evaluate (the task contract's ``evaluates``:
    for a dataset task, held-out rows, ``task.eval_path`` or ``task.eval_size``)."""
    return bool(task.evaluates)


def evaluate(task: Any, engine: Any, *, max_new_tokens: int) -> dict[str, float]:
    """``task.evaluate`` over ``engine``'s greedy completions (``{}``: the task holds none)."""
    if engine is None or not task.evaluates:
        return {}
    allowed = task.output_token_ids
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=(task.eos_token_id,),
                            allowed_token_ids=None if allowed is None else tuple(allowed))

    seen: list[tuple[list[list[int]], list[list[int]]]] = []

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = [c.token_ids for c in engine.generate(prompts, params, seeds=[0] * len(prompts))]
        seen.append((prompts, outs))
        return outs

    figures = task.evaluate(generate, max_new_tokens=max_new_tokens)
    if not hasattr(task, "last_eval_rows"):
        _remember_texts(task, seen)
    return figures


def _remember_texts(task: Any, seen: list[tuple[list[list[int]], list[list[int]]]]) -> None:
    """The prompt and completion texts of a task's latest evaluation (its tokenizer's decoding),
    for :func:`write_eval_completions`; nothing for a task without a tokenizer."""
    decode = getattr(getattr(task, "tokenizer", None), "decode", None)
    if decode is None:
        return
    eos = getattr(task, "eos_token_id", None)
    rows = []
    with contextlib.suppress(TypeError):  # a task that keeps weak references out
        for prompts, outs in seen:
            for p, o in zip(prompts, outs):
                o = list(o)[:-1] if o and o[-1] == eos else list(o)
                rows.append({"prompt": decode(list(p)), "completion": decode(o,
                             skip_special_tokens=True)})
        _DECODED[task] = rows


def eval_rows(task: Any) -> list[dict[str, Any]]:
    """The latest evaluation's rows, and forget them: ``task.last_eval_rows`` (emptied) when the
    task keeps its own, else what :func:`evaluate` decoded."""
    own = getattr(task, "last_eval_rows", None)
    if own is not None:
        rows, task.last_eval_rows = list(own), []
        return rows
    with contextlib.suppress(TypeError):
        return _DECODED.pop(task, [])
    return []


def write_eval_completions(task: Any, output_dir: str | Path, step: int) -> Path | None:
    """Append the latest evaluation's rows (:func:`eval_rows`), each with ``step``, to
    ``eval_completions.jsonl`` in ``output_dir``; the file, or ``None`` when there were none.
    Call it on rank 0 right after :func:`evaluate`."""
    rows = eval_rows(task)
    if not rows:
        return None
    path = Path(output_dir) / EVAL_COMPLETIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps({"step": int(step), **r}, default=str) + "\n" for r in rows))
    return path


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


__all__ = ["EVAL", "EVAL_COMPLETIONS_FILE", "EvalLog", "eval_rows", "evaluate", "evaluates",
           "write_eval_completions"]

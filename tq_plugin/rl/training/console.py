"""What a run prints: a start banner that says where it writes, then one line per RL step.

In a terminal the step progress bar (``StepProgressBar``) is the per-step display; when the
output is not a terminal (a log file, CI, a pipe) the bar is off and :class:`StepLines`' one
line per RL step shows instead, never both. The step lines always reach the run's log file
(``tq-train.log``): in a terminal a filter keeps them off the console handlers only. The final
summary is the CLI's.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.training.evaluation import EVAL
from tq_plugin.rl.training.step_record import RL_STEP

STEP_LOG = logging.getLogger("tq_plugin.steps")


class _NotStepLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != STEP_LOG.name


def route_step_lines(*, terminal: bool) -> None:
    """Step lines go to every handler, except the console's when ``terminal`` (the bar shows
    the steps there). Idempotent."""
    for handler in logging.getLogger().handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler)
        ours = [f for f in handler.filters if isinstance(f, _NotStepLines)]
        if console and terminal and not ours:
            handler.addFilter(_NotStepLines())
        elif ours and not terminal:
            for f in ours:
                handler.removeFilter(f)


# Third-party loggers whose records go to the run dir's ``engines.log`` unless ``verbose=true``
# (the engines, Ray, TransferQueue, and the HTTP stack of task=agent's endpoint and clients).
QUIET_LOGGERS = ("vllm", "ray", "transfer_queue", "httpx", "httpx2", "httpcore", "openai", "uvicorn")
ENGINE_LOG = "engines.log"


class _LazyFileHandler(logging.FileHandler):
    """A file handler that creates its file (and folder) at its first record: a run that
    fails its checks at start leaves nothing behind."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, delay=True)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def quiet_third_party_logs(run_dir: Path, *, verbose: bool) -> Path | None:
    """Send vLLM's, Ray's and TransferQueue's own log records to ``run_dir/engines.log`` instead
    of the console, and switch transformers' progress bars off (``verbose``: leave them as they
    are). vLLM is told not to install its own console handler (``VLLM_CONFIGURE_LOGGING=0``, read
    when vLLM is imported, so call this first); Ray's driver-side records go through the handler
    added here once ``ray.init`` runs with ``logging_level`` warning (the recipe sets it).
    Returns the log file (None when ``verbose``)."""
    if verbose:
        return None
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # transformers' weight-loading and shard-writing bars (read when it is imported; switched
    # off in place where it was imported already).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    path = Path(run_dir) / ENGINE_LOG
    handler = _LazyFileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "_tq_engine_log", False)]:
            logger.removeHandler(old)
            old.close()
        handler._tq_engine_log = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    return path


def is_terminal() -> bool:
    """Whether the run's progress display goes to a terminal (tqdm writes to stderr)."""
    return sys.stderr.isatty()


def banner(*, run_dir: Any, recipe: str, model: str, engine: str, backend: str, topology: str,
           steps: int) -> str:
    """The start banner: the run dir first, then what runs."""
    return (f"[tq_plugin] run dir: {run_dir}\n"
            f"[tq_plugin] {recipe} | model {model} | engine {engine} | backend {backend} | "
            f"topology {topology} | {steps} RL steps")


def _figure(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value)


class StepLines(Callback):
    """One line per RL step on rank 0 (reward, loss, KL, tokens/s, held-out accuracy when the
    step evaluated, elapsed), from the figures the module logged for it (``rl/*`` in the
    trainer's ``callback_metrics``).

    The module logs a step's figures in its own ``on_train_batch_end``, which Lightning calls
    after every callback's: so the line of a step's last microbatch is written once they are
    there, at the next microbatch's start (or the fit's end), with the elapsed time taken at
    the step's end. With ``every`` (``recipe.log_every``) > 1, a line every ``every``-th step,
    the last step's and every step that evaluated."""

    def __init__(self, num_steps: int, every: int = 1) -> None:
        self.num_steps, self.every = num_steps, max(1, int(every))
        self._t0 = time.perf_counter()
        self._pending: tuple[int, float, dict[str, float]] | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        meta = pl_module.dp_meta
        info = meta.extra_info.get(MICROBATCH_INFO, {})
        if not info.get("last_in_step") or not trainer.is_global_zero:
            return
        evaluated = meta.extra_info.get(RL_STEP, {}).get(EVAL) or {}
        step = int(info["step"])
        if (step + 1) % self.every and step + 1 != self.num_steps and not evaluated:
            return
        self._pending = (step, time.perf_counter() - self._t0, dict(evaluated))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._flush(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer)

    def _flush(self, trainer: Trainer) -> None:
        if self._pending is None:
            return
        step, elapsed, evaluated = self._pending
        self._pending = None
        STEP_LOG.info(self.line(step, trainer.callback_metrics, elapsed=elapsed,
                                evaluated=evaluated))

    def line(self, step: int, metrics: dict[str, Any], *, elapsed: float | None = None,
             evaluated: dict[str, float] | None = None) -> str:
        """``RL step 3/5 | reward 0.093 | loss -0.0120 | kl 3.10e-04 | tok/s 14204 | 2.1 s``: the KL
        to the reference model when the loss has one (``recipe.beta > 0``), else the approximate
        KL to the rows' policy; ``eval acc 0.406`` when the step began with an evaluation; a
        figure the module did not log is left out."""
        kl = _figure(metrics, "rl/kl_ref")
        figures = [("reward", _figure(metrics, "rl/reward"), ".3f"),
                   ("loss", _figure(metrics, "rl/loss"), ".4f"),
                   ("kl", kl if kl is not None else _figure(metrics, "rl/approx_kl"), ".2e"),
                   ("tok/s", _figure(metrics, "rl/tokens_per_s"), ".0f"),
                   ("eval acc", (evaluated or {}).get("accuracy"), ".3f")]
        parts = [f"RL step {step + 1}/{self.num_steps}"]
        parts += [f"{label} {value:{fmt}}" for label, value, fmt in figures if value is not None]
        seconds = time.perf_counter() - self._t0 if elapsed is None else elapsed
        parts.append(f"{seconds:.1f} s")
        return " | ".join(parts)


__all__ = ["ENGINE_LOG", "QUIET_LOGGERS", "STEP_LOG", "StepLines", "banner", "is_terminal",
           "quiet_third_party_logs", "route_step_lines"]

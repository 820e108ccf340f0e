"""``tq_plugin.train``: one run of ``tq-train`` from Python (a script, a notebook), in this process.

The same config (``config_name`` and Hydra overrides, as a list of ``key=value`` strings or a
dict), the same run dir contents and the same console lines as the command line; what comes back
is a :class:`TrainResult`: the summary of ``result.json``, the run dir and the rows of
``metrics.csv``. Everything the run writes goes under its run dir (``output_dir``); the logging
set-up Hydra installs for the run (the console and ``tq-train.log`` handlers) is taken down after
it, so later records of the calling program go where they went before.

Errors are raised, not printed: an unknown key or option as a ``ConfigError`` whose message says
"did you mean" (what ``tq-train`` prints), the rest as the run raised them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin.cli import CONFIG_MODULE, PROG, check_overrides, output_dir, run
from tq_plugin.config import ConfigError
from tq_plugin.rl.training.console import QUIET_LOGGERS
from tq_plugin.rl.training.metrics import COMPLETIONS_FILE, RESULT_FILE

Overrides = Sequence["str | Mapping[str, Any]"] | Mapping[str, Any] | str | None
# A value Hydra's override grammar reads as written: numbers, names, paths, interpolations.
_PLAIN = re.compile(r"^[\w.:/+\-~@${}]+$")


@dataclass(frozen=True)
class TrainResult:
    """What one run left in its run dir.

    Attributes:
        run_dir: the run's folder (``metrics.csv``, ``result.json``, ``policy.safetensors``,
            ``checkpoints/``, ...; ``tq-train --help`` lists them).
        summary: ``result.json``: ``status``, ``steps``, ``reward_first``, ``reward_last``,
            ``tokens_per_s``, ``eval`` (with ``recipe.eval_every``), ...
        metrics: ``metrics.csv``, one dict per RL step (numbers as ``int``/``float``, an empty
            cell as ``None``).
    """

    run_dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(repr=False)

    @property
    def steps(self) -> int:
        """RL steps trained (the checkpointed ones of a resumed run included)."""
        return int(self.summary.get("steps", 0))

    @property
    def reward_first(self) -> float | None:
        """The first RL step's mean reward."""
        return self.summary.get("reward_first")

    @property
    def reward_last(self) -> float | None:
        """The last RL step's mean reward."""
        return self.summary.get("reward_last")

    @property
    def completions(self) -> list[dict[str, Any]]:
        """``completions.jsonl``: the sample completions logged every
        ``recipe.log_completions_every`` steps (and at the last step), with their rewards."""
        path = self.run_dir / COMPLETIONS_FILE
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @classmethod
    def load(cls, run_dir: str | Path) -> TrainResult:
        """The result of a finished run, read back from its run dir."""
        run_dir = Path(run_dir).resolve()
        summary = json.loads((run_dir / RESULT_FILE).read_text())
        return cls(run_dir=run_dir, summary=summary, metrics=_read_metrics(run_dir))


def train(config_name: str = "train", overrides: Overrides = None, *,
          output_dir: str | Path | None = None) -> TrainResult | None:
    """Run one ``tq-train`` run in this process and return its :class:`TrainResult`.

    Args:
        config_name: the primary config, as ``tq-train --config-name`` takes it: ``train``
            (PPO), ``grpo`` or ``grpo_real``.
        overrides: Hydra overrides, as on the command line: a list of ``"key=value"`` and
            ``"group=option"`` strings (``"+key=value"`` adds a key), a dict
            ``{"recipe.num_steps": 3, "task": "prompts"}``, or a list holding both.
        output_dir: the run dir (created; everything the run writes goes under it). ``None``:
            ``hydra.run.dir`` when the overrides set it, else ``tq-train``'s
            ``outputs/<algorithm>/<date>_<time>`` under the current folder.

    Returns:
        The run's result; ``None`` in a DDP rank other than 0 (the processes Lightning's DDP
        launches run the calling script again, so give every call the same ``output_dir``).

    Raises:
        ConfigError: an unknown key or option (the message says "did you mean"), a value a
            rule refuses (the message names the key).
        Exception: whatever the run raised (``RewardError``, ``EngineError``, ...).
    """
    args = _override_strings(overrides)
    if output_dir is not None:
        args.append(f"hydra.run.dir={_value(str(Path(output_dir).resolve()))}")
    with _own_hydra():
        lines = check_overrides(config_name, args)
        if lines:
            raise ConfigError("\n".join(line.replace(f"{PROG}: ", "", 1) for line in lines))
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3",
                                      job_name="tq-train"), _logging_restored():
            hydra = GlobalHydra.instance().hydra
            assert hydra is not None
            done = hydra.run(config_name=config_name, task_function=_job, overrides=args)
    summary, run_dir, error = done.return_value
    if error is not None:
        raise error
    if not summary:  # a DDP rank other than 0: rank 0 reports the run
        return None
    return TrainResult(run_dir=run_dir, summary=summary, metrics=_read_metrics(run_dir))


def _job(cfg: Any) -> tuple[dict[str, Any], Path, Exception | None]:
    """The run, its run dir and what it raised: handed back rather than raised, which Hydra
    would log as "Error executing job" before :func:`train` raises it."""
    try:
        return run(cfg), output_dir().resolve(), None
    except Exception as exc:  # noqa: BLE001  (raised again by train)
        return {}, output_dir().resolve(), exc


def _value(value: Any) -> str:
    """``value`` as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _override_strings(overrides: Overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, str | Mapping):
        overrides = [overrides]
    out: list[str] = []
    for item in overrides:
        if isinstance(item, Mapping):
            out += [f"{key}={_value(value)}" for key, value in item.items()]
        elif isinstance(item, str):
            out.append(item)
        else:
            raise TypeError(f"overrides: {item!r} is neither a 'key=value' string nor a dict")
    return out


def _number(cell: str) -> Any:
    if cell == "":
        return None
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(cell)
    return cell


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


@contextlib.contextmanager
def _own_hydra() -> Iterator[None]:
    """Hydra's global state for this run alone: a caller's own ``initialize`` (a notebook that
    composed a config) is set aside and put back after."""
    gh = GlobalHydra.instance()
    previous = gh.hydra if gh.is_initialized() else None
    gh.clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if previous is not None:
            GlobalHydra.instance().initialize(previous)


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """The root logger and the loggers a run re-routes (Lightning's, the engines') as they were
    before the run; the handlers the run added (the console, ``tq-train.log``, ``engines.log``)
    closed."""
    names = ["", "lightning.pytorch", *QUIET_LOGGERS]
    saved = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
    try:
        yield
    finally:
        for name, (handlers, level, propagate, disabled) in saved.items():
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if h not in handlers]:
                logger.removeHandler(handler)
                handler.close()
            for handler in handlers:
                if handler not in logger.handlers:
                    logger.addHandler(handler)
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, disabled


__all__ = ["TrainResult", "train"]

"""The recipe's own Lightning callbacks: per-step bookkeeping on every rank (``RLStepCallback``),
a SIGTERM stop that every rank takes at the same microbatch (``SigtermStop``), the periodic
checkpoints a killed run resumes from (``PeriodicCheckpoint``) and a finished run continued to a
larger ``recipe.num_steps`` (``ContinueRun``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from tq_plugin.config import ConfigError
from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.training import ranks
from tq_plugin.rl.training.metrics import MetricsLog, StepRecord
from tq_plugin.rl.training.step_record import RL_STEP

log = logging.getLogger(__name__)
_info_rank_zero = rank_zero_only(log.info)


class RLStepCallback(Callback):
    """The recipe's per-step bookkeeping inside the fit, on every rank.

    * ``on_train_batch_start``: from the microbatch's step meta (``RL_STEP``), set the module's
      loss normalizer (divided by the world size: DDP averages gradients over ranks) and, at a
      step's first microbatch, start the step's metrics record.
    * ``on_train_end``: reduce the metrics over ranks; rank 0 writes the artifacts.
    * ``on_exception`` (SIGTERM): the finished steps' artifacts, reduced over ranks.
    * checkpoint state: the rollout generator (a resumed run never replays random draws it
      already used) and the finished steps' metrics, reduced over ranks, so the resumed run's
      artifacts cover every step.

    Its collaborators: the run's step ``metrics``, the ``rollouts`` stream (an object with a
    ``generator``), the ``DataPlaneCallback`` (``dp_callback``: how many steps have finished)
    and ``write_artifacts(trainer, interrupted=...)``, which reduces and writes the artifacts.
    """

    def __init__(self, *, metrics: MetricsLog, rollouts: Any, dp_callback: Any,
                 write_artifacts: Callable[..., None]) -> None:
        self.metrics, self.rollouts, self.dp_callback = metrics, rollouts, dp_callback
        self.write_artifacts = write_artifacts
        self.world_size = 1
        self.step: int | None = None
        self.steps_trained = 0
        self.restored: list[StepRecord] = []  # finished steps' metrics from the checkpoint

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.world_size = trainer.world_size

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        meta = pl_module.dp_meta
        info = meta.extra_info[MICROBATCH_INFO]
        rl = meta.extra_info[RL_STEP]
        pl_module.loss_norm = rl["loss_norm"] / trainer.world_size
        rewards = torch.tensor(rl["rewards"])
        pl_module.current_reward = float(rewards.mean())
        if info["step"] == self.step:
            return
        self.step = info["step"]
        self.steps_trained += 1
        client = pl_module.dp_client
        self.metrics.on_step_ready(
            self.step, rewards=rewards, turn_scores=torch.tensor(rl["turn_scores"]),
            rollout_s=rl["rollout_s"], prepare_s=rl["prepare_s"], failed_calls=rl["failed_calls"],
            lp_gap=rl["lp_gap"], dp=client.snapshot() if hasattr(client, "snapshot") else None)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.world_size > 1:
            print(f"[tq_plugin] rank {trainer.global_rank}/{trainer.world_size}: "
                  f"{self.steps_trained} RL steps, {trainer.global_step} optimizer steps", flush=True)
        self.write_artifacts(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):  # raised on every rank at one microbatch
            self.write_artifacts(trainer, interrupted=True)

    def finished_steps(self) -> list[StepRecord]:
        """This rank's records of the steps whose last microbatch has trained."""
        done = self.dp_callback.completed_steps
        return [s for s in self.metrics.steps if s.step < done]

    @override
    def state_dict(self) -> dict[str, Any]:
        # Lightning asks every rank for its state before rank 0 writes the checkpoint.
        finished = ranks.gather_objects(self.finished_steps(), self.world_size)
        steps = self.restored + ranks.merge_rank_steps(finished)
        return {"rng_state": self.rollouts.generator.get_state(),
                "steps": [dataclasses.asdict(s) for s in steps]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts.generator.set_state(state_dict["rng_state"])
        make = getattr(self.metrics, "step_type", StepRecord)  # the disaggregated records
        self.restored = [make(**s) for s in state_dict["steps"]]
        self.metrics.restored = self.restored  # a live metrics.csv starts with them


class SigtermStop(Callback):
    """Stops the fit on SIGTERM after the same microbatch on every rank, with a checkpoint.

    Lightning's own handler broadcasts from inside the signal handler, which under DDP can
    interleave with the step's collectives and hang both ranks (observed with two CPU ranks).
    This handler only sets a flag. After each microbatch the ranks agree on it (one all-reduce
    max, in ``on_train_batch_end``); the recipe's step hook, the last thing the module runs for
    the microbatch (after every callback has advanced its cursor and the metrics have booked
    it), then calls :meth:`stop_if_requested`: save the checkpoint, raise ``SIGTERMException``.
    At that point the checkpoint's resume cursor, the data plane's last step meta (Lightning
    has prefetched the next microbatch) and the metrics all describe the same position.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requested = False
        self.stop = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Replaces the handler Lightning registered for this fit; Lightning restores the
        # process's own handler at teardown.
        self.requested = self.stop = False
        self.arm()

    def arm(self) -> None:
        """(Re)install the handler: starting Ray in this process (``ray.init``) replaces it with
        Ray's own, which kills the process, so what starts Ray mid-fit calls this after."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        stop = self.requested
        if trainer.world_size > 1:
            flag = torch.tensor([int(stop)], device=trainer.strategy.root_device)
            stop = bool(trainer.strategy.reduce(flag, reduce_op="max").item())
        self.stop = stop

    def stop_if_requested(self, trainer: Trainer) -> None:
        if self.stop:
            trainer.save_checkpoint(self.path)
            raise SIGTERMException


class PeriodicCheckpoint:
    """``recipe.checkpoint_every=K``: a checkpoint after every ``K``-th RL step, at the step's
    boundary, for any topology: ``checkpoints/rl-step-<n>.ckpt`` (``n`` steps finished) and
    ``checkpoints/last.ckpt`` (the same file, linked). A run killed without a SIGTERM (SIGKILL,
    a lost node) resumes from the last one with ``ckpt_path``.

    :class:`StepHooks` calls :meth:`save_if_due` where ``SigtermStop`` saves, after every
    other callback has advanced its cursor for the microbatch, so the resume cursor, the data plane's
    last step meta (the next step, already prepared) and the metrics describe the same
    position. Each file is written under a temporary name and renamed: a kill mid-save leaves
    the previous checkpoint whole.
    """

    def __init__(self, directory: Path, every: int) -> None:
        self.directory, self.every = directory, every
        self.saved: list[Path] = []

    def save_if_due(self, trainer: Trainer, info: dict[str, Any]) -> None:
        finished = int(info["step"]) + 1
        if not self.every or not info["last_in_step"] or finished % self.every:
            return
        path = self.directory / f"rl-step-{finished:06d}.ckpt"
        tmp = path.with_name(f".{path.name}.tmp")
        trainer.save_checkpoint(tmp)  # every rank calls it; rank 0 writes
        if trainer.is_global_zero:
            os.replace(tmp, path)
            link = self.directory / ".last.ckpt.tmp"
            link.unlink(missing_ok=True)
            if path.is_dir():  # a sharded checkpoint (trainer=fsdp_cpu): a folder, linked by name
                link.symlink_to(path.name, target_is_directory=True)
            else:
                os.link(path, link)
            os.replace(link, self.directory / "last.ckpt")
            _info_rank_zero("RL step %d: checkpoint %s", finished, path)  # 1-based, as the console
        self.saved.append(path)


class ContinueRun(Callback):
    """``ckpt_path``: how many RL steps the checkpoint finished, against ``num_steps``.

    A checkpoint saved after a run's last microbatch (the ``last.ckpt`` of a finished run)
    holds Lightning's mark that the epoch's last batch was reached: restored as it is, the fit
    loop ends at once and a run continued to a larger ``recipe.num_steps`` trains nothing. The
    mark is cleared here, before the loops are restored, when steps are left to train, so the
    datamodule goes on from the resume cursor (the steps ``done..num_steps-1``). With nothing
    left (``num_steps`` equal to the steps done) one line says so, Lightning skips the fit loop
    (``max_steps`` reached) and ``finish(trainer)`` writes the run's artifacts from the
    checkpointed steps instead of ``on_train_end``; fewer steps than done is a ``ConfigError``.
    ``dp_callback``: the ``DataPlaneCallback`` whose state holds the finished steps.
    """

    def __init__(self, *, num_steps: int, dp_callback: Callback,
                 finish: Callable[[Trainer], Any]) -> None:
        self.num_steps, self.dp_callback, self.finish = num_steps, dp_callback, finish
        self.steps_done: int | None = None  # from the checkpoint, once one is loaded

    @property
    def nothing_left(self) -> bool:
        return self.steps_done == self.num_steps

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("callbacks", {}).get(self.dp_callback.state_key)
        if not state:
            return
        done = self.steps_done = int(state["completed_steps"])
        path = getattr(trainer, "ckpt_path", None) or "the checkpoint"
        if done > self.num_steps:
            raise ConfigError(f"recipe.num_steps: {self.num_steps} is below the {done} RL steps "
                              f"{path} finished: set recipe.num_steps above {done} to continue it")
        if done == self.num_steps:
            rank_zero_only(print)(
                f"[tq_plugin] {path} finished all recipe.num_steps={done} RL steps: nothing more "
                f"to train (set recipe.num_steps above {done} to continue the run)", flush=True)
            return
        progress = (checkpoint.get("loops", {}).get("fit_loop", {})
                    .get("epoch_loop.batch_progress"))
        if progress and progress.get("is_last_batch"):
            progress["is_last_batch"] = False
            _info_rank_zero("continuing %s from RL step %d to recipe.num_steps=%d", path, done,
                            self.num_steps)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The checkpoint is loaded by now (the weights, the callbacks' state); the loops are not.
        if self.nothing_left:
            self.finish(trainer)


class StepHooks(Callback):
    """The recipe's work after each microbatch trains, as a callback Lightning calls (the last
    of the recipe's, so every other callback has advanced its cursor for the microbatch): book
    the microbatch's figures into the step ``metrics``, the ``periodic`` checkpoint, the HF
    policy every ``save_hf_every`` RL steps (``save_hf(directory)`` into
    ``checkpoints_dir/hf-step-<n>``) and the ``sigterm`` stop.

    The microbatch's figures are the module's (``RLModule.microbatch_stats``)."""

    def __init__(self, *, metrics: MetricsLog, periodic: PeriodicCheckpoint, sigterm: SigtermStop,
                 save_hf_every: int | None, save_hf: Callable[[Path], Any],
                 checkpoints_dir: Path) -> None:
        self.metrics, self.periodic, self.sigterm = metrics, periodic, sigterm
        self.save_hf_every, self.save_hf = save_hf_every, save_hf
        self.checkpoints_dir = Path(checkpoints_dir)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        client = getattr(pl_module, "dp_client", None)
        self.after_microbatch(trainer, pl_module.dp_meta, pl_module.microbatch_stats(),
                              client.snapshot() if hasattr(client, "snapshot") else None)

    def after_microbatch(self, trainer: Trainer, meta: Any, stats: dict[str, float],
                         dp: Any = None) -> None:
        self.metrics.on_microbatch(meta, stats)
        info = meta.extra_info[MICROBATCH_INFO]
        if info["last_in_step"] and trainer.world_size == 1:
            # one process: its row is the run's; with several ranks the rows are reduced when
            # the run ends
            self.metrics.step_finished(int(info["step"]), dp)
        self.periodic.save_if_due(trainer, info)
        finished = int(info["step"]) + 1
        if self.save_hf_every and info["last_in_step"] and finished % self.save_hf_every == 0:
            self.save_hf(self.checkpoints_dir / f"hf-step-{finished:06d}")
        self.sigterm.stop_if_requested(trainer)


__all__ = ["ContinueRun", "PeriodicCheckpoint", "RLStepCallback", "SigtermStop", "StepHooks"]

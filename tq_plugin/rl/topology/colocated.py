"""The colocated step source (``recipe.topology=colocated``): the trainer process generates each
step's rollouts itself, between RL steps, with the weights it trains.

Each RL step (``prepare_step``, called by the ``MetaDataModule`` inside the fit's dataloader):

1. the rollout engine (``engine=native|hf|vllm``) is brought to the trainer's weights of the step
   (``rl/weight_sync_s``);
2. the step's :class:`~tq_plugin.rl.training.pipeline.DrawLoop` (the generation side of every
   topology) runs the draws: multi-turn rollouts, every call staged through ``TQTokenSink``
   with the engine's own tokens, logprobs and weight version,
   ``RolloutReassembler.finalize_group`` writing the training rows into the train partition,
   the reward shaping (unscorable rows, ``recipe.mask_truncated_completions``,
   ``recipe.overlong_buffer``) and ``recipe.dynamic_sampling``'s further draws;
3. the step's :class:`~tq_plugin.rl.training.pipeline.StepTail` (the trainer side of every
   topology) writes the per-turn rewards, ``prev_logprobs`` (policy),
   ``reference_policy_logprobs`` (the frozen reference, ``recipe.beta > 0``) and ``values``
   (PPO's value model) back through the data plane, then the advantages and the step record.

A task with a reward log (``task=prompts``) gets its per-reward figures
(``rewards/<name>/mean``, ``/std``) into the step record, and every
``recipe.log_completions_every`` steps (and at the last step) a few sample completions into
``completions.jsonl`` and the loggers that take text.

Under DDP on the embedded store every rank replays the same rollouts (one rollout stream, the
same generator state on every rank) and keeps its length-balanced shard of the rows
(``ranks.replica_shard``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from tq_plugin.data_plane import KVBatchMeta
from tq_plugin.rl.models.weights import engine_weights
from tq_plugin.rl.topology.build import build_rollout_side, start_engine
from tq_plugin.rl.topology.source import StepSource, register_step_source
from tq_plugin.rl.training import ranks
from tq_plugin.rl.training.evaluation import EVAL, evaluate, write_eval_completions
from tq_plugin.rl.training.metrics import completion_rows, log_completions, reward_figures
from tq_plugin.rl.training.pipeline import DrawLoop, RowIO, StepTail

# Sample completions written every recipe.log_completions_every steps.
COMPLETIONS_PER_LOG = 4


class RolloutStream:
    """The run's one rollout generator, the same on every rank: what the colocated source draws
    seeds from and the step callback checkpoints. Pickles (``ddp_spawn``) as its state's bytes:
    ``torch.multiprocessing`` cannot rebuild a ``torch.Generator``."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed + 1009)

    def __getstate__(self) -> dict[str, Any]:
        return {"state": self.generator.get_state().numpy().tobytes()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        rng = torch.frombuffer(bytearray(state["state"]), dtype=torch.uint8)
        self.generator = torch.Generator().set_state(rng)


@register_step_source("colocated")
class Colocated(StepSource):
    """The step source of a colocated run (see the module docstring).

    Its ``module`` (:meth:`attach`): the trained ``RLModule`` (its policy is what
    ``engine=native`` samples, and what the other engines are synced to); ``rollouts``: the
    run's :class:`RolloutStream`; ``output_dir``: where an ``hf``/``vllm`` engine's starting
    checkpoint is written; ``replicated`` (:meth:`bind`): every rank replays the step into its
    own store and keeps its shard of a ``global_batch``."""

    def __init__(self, cfg: DictConfig, *, rc: Any, task: Any, output_dir: str | Path,
                 rollouts: RolloutStream) -> None:
        super().__init__(cfg, rc=rc, task=task, output_dir=output_dir, rollouts=rollouts)
        self.replicated, self.global_batch, self.sharded = False, 0, False
        self.engine: Any = None
        self.side: Any = None
        self.draws: DrawLoop | None = None
        self.tail: StepTail | None = None
        self.weight_sync_s: list[float] = []

    def __getstate__(self) -> dict[str, Any]:
        # each process builds its own
        return {**self.__dict__, "engine": None, "side": None, "draws": None, "tail": None}

    # ------------------------------------------------------------------ engine
    def start(self) -> None:
        """Staging sink, rollout worker and reassembler on the module's client, and the engine
        (by rank 0 when several ranks generate; a sharded policy's ranks gather it together)."""
        trainer, m = self.module.trainer, self.module
        self.side = build_rollout_side(self.cfg, self.task, m.dp_client)
        self.draws = DrawLoop(rc=self.rc, task=self.task, side=self.side, io=RowIO(
            read=lambda meta, fields: m.read_from_dataplane(meta, select_fields=fields),
            write=m.write_to_dataplane,
            clear=lambda meta: m.dp_client.clear_samples(partition_id=meta.partition_id,
                                                         sample_ids=meta.sample_ids)))
        self.tail = StepTail(m, rc=self.rc, turns=self.task.turns)
        if self.engine is None:
            self.engine = start_engine(
                self.cfg, self.module.policy, self.output_dir, weight_version=0, task=self.task,
                rank=trainer.global_rank,
                barrier=trainer.strategy.barrier if self.replicated else None)

    def sync_engine(self, version: int) -> None:
        """Bring the engine to the trainer's weights of ``version`` (those after the previous
        step's last optimizer step) before it generates; log ``rl/weight_sync_s``.

        Colocated, the engine generates only between RL steps, so one push per step is every
        push that can change a rollout: ``recipe.weights_every`` matters to the disaggregated
        topology, whose workers generate while the trainer trains."""
        if self.engine.weight_version == version:
            return
        t0 = time.perf_counter()
        self.engine.update_weights(engine_weights(self.module.policy, self.engine.name),
                                   version=version)
        seconds = time.perf_counter() - t0
        self.weight_sync_s.append(seconds)
        trainer = self.module.trainer
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"rl/weight_sync_s": seconds}, step=trainer.global_step)

    def evaluate(self, step: int) -> dict[str, float]:
        """``recipe.eval_every``: the task's held-out prompts, greedy, on the engine's weights;
        their completions appended to ``eval_completions.jsonl`` (rank 0)."""
        figures = evaluate(self.task, self.engine, max_new_tokens=self.rc.max_new_tokens)
        trainer = self.module._trainer if self.module is not None else None
        if trainer is None or trainer.is_global_zero:
            write_eval_completions(self.task, self.output_dir, step)
        return figures

    def final_evaluation(self, trainer: Any) -> dict[str, float] | None:
        """The trained weights' evaluation (a sharded policy: every rank's forwards)."""
        if self.engine is None or not (self.sharded or trainer.is_global_zero):
            return None
        self.sync_engine(self.rc.num_steps)  # the trained weights
        return self.evaluate(self.rc.num_steps)

    def summary(self) -> dict[str, Any]:
        syncs = self.weight_sync_s
        if not syncs:
            return {}
        return {"weight_syncs": len(syncs),
                "weight_sync_s_median": round(sorted(syncs)[len(syncs) // 2], 4)}

    def close(self) -> None:
        """Release the task's own rollout driver (an agent endpoint) and the engine
        (idempotent)."""
        driver_close = getattr(getattr(self.side, "rollout", None), "close", None)
        if driver_close is not None:
            driver_close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    # ------------------------------------------------------------------ one RL step
    def prepare_step(self, step: int, client: Any = None) -> KVBatchMeta:
        """Rollouts → staged calls → verified training rows → logprobs, values, advantages.

        Returns the step meta, or under DDP on the embedded store this rank's shard of it.
        ``client``: the data module's (the module's own, which this source writes through)."""
        if self.side is None:
            self.start()
        m, rc = self.module, self.rc
        self.sync_engine(step)
        evaluated = self.evaluate(step) if rc.eval_every and step % rc.eval_every == 0 else {}
        self.task.set_step(step, rc.num_steps)  # the reward functions' trainer_state
        t0 = time.perf_counter()
        batch = self.draws.run(self.engine, step=step, prompts=rc.prompts_per_step,
                               generator=self.rollouts.generator, partition_id=rc.train_partition)
        rollout_s = time.perf_counter() - t0
        figures = (batch.figures | self.reward_log(step)
                   | getattr(self.side.rollout, "figures", {})  # a task's own driver (agent/*)
                   | {f"eval/{k}": float(v) for k, v in evaluated.items()})
        meta = self.tail.run(batch.meta, batch, step=step, rollout_s=rollout_s, figures=figures,
                             **({EVAL: evaluated} if evaluated else {}))
        if self.replicated:
            meta = ranks.replica_shard(meta, m.dp_client, strategy=m.trainer.strategy,
                                       global_batch=self.global_batch)
        return meta

    def reward_log(self, step: int) -> dict[str, float]:
        """The task's per-reward figures of the step (a task with a reward log only) and, every
        ``recipe.log_completions_every`` steps and at the run's last step, its sample
        completions (rank 0 writes them)."""
        log = self.task.drain_reward_log()
        if not log:
            return {}
        every = self.rc.log_completions_every
        due = bool(every) and (step % every == 0 or step == self.rc.num_steps - 1)
        trainer = self.module._trainer
        if due and (trainer is None or trainer.is_global_zero):
            log_completions(completion_rows(log, step, COMPLETIONS_PER_LOG),
                            output_dir=self.output_dir,
                            loggers=list(trainer.loggers) if trainer is not None else [], step=step)
        return reward_figures(log)


__all__ = ["Colocated", "RolloutStream"]

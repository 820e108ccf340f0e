"""The colocated step source (``recipe.topology=colocated``): the trainer process generates each
step's rollouts itself, between RL steps, with the weights it trains.

Each RL step (``prepare_step``, called by the ``MetaDataModule`` inside the fit's dataloader):

1. the rollout engine (``engine=native|hf|vllm``) is brought to the trainer's weights of the step
   (``rl/weight_sync_s``) and generates multi-turn rollouts, every call staged through
   ``TQTokenSink`` with the engine's own tokens, logprobs and weight version;
2. ``RolloutReassembler.finalize_group`` verifies the staged calls against the receipts and
   writes the training rows into the train partition, returning the meta;
3. per-turn rewards, ``prev_logprobs`` (policy) and ``values`` (PPO's value model) are written
   back through the data plane; the advantages are computed from columns read back and written
   too (``RLModule.write_advantages``).

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
from tq_plugin.rl.training import ranks
from tq_plugin.rl.training.evaluation import EVAL, evaluate
from tq_plugin.rl.training.module import RLModule
from tq_plugin.rl.training.step_record import (
    GAP_FIELDS,
    RL_STEP,
    TURN_REWARDS,
    action_tokens_and_gap,
    step_record,
)


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


class Colocated:
    """The step source of a colocated run (see the module docstring).

    ``rc``: the typed ``recipe`` group; ``module``: the trained ``RLModule`` (its policy is what ``engine=native`` samples, and what
    the other engines are synced to); ``rollouts``: the run's :class:`RolloutStream`;
    ``output_dir``: where an ``hf``/``vllm`` engine's starting checkpoint is written;
    ``replicated``: every rank replays the step into its own store and keeps its shard of a
    ``global_batch``."""

    def __init__(self, cfg: DictConfig, *, rc: Any, task: Any, module: RLModule,
                 rollouts: RolloutStream,
                 output_dir: str | Path, replicated: bool = False, global_batch: int = 0) -> None:
        self.cfg, self.rc = cfg, rc
        self.task, self.module, self.rollouts = task, module, rollouts
        self.output_dir = Path(output_dir)
        self.replicated, self.global_batch = replicated, global_batch
        self.engine: Any = None
        self.side: Any = None
        self.weight_sync_s: list[float] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "engine": None, "side": None}  # each process builds its own

    # ------------------------------------------------------------------ engine
    def start(self) -> None:
        """Staging sink, rollout worker and reassembler on the module's client, and the engine
        (by rank 0 when several ranks generate; a sharded policy's ranks gather it together)."""
        trainer = self.module.trainer
        self.side = build_rollout_side(self.cfg, self.task, self.module.dp_client)
        if self.engine is None:
            self.engine = start_engine(
                self.cfg, self.module.policy, self.output_dir, weight_version=0,
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

    def evaluate(self) -> dict[str, float]:
        """``recipe.eval_every``: the task's held-out prompts, greedy, on the engine's weights."""
        return evaluate(self.task, self.engine, max_new_tokens=self.rc.max_new_tokens)

    def close(self) -> None:
        """Release the engine (idempotent)."""
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
        evaluated = self.evaluate() if rc.eval_every and step % rc.eval_every == 0 else {}
        t0 = time.perf_counter()
        batch = self.side.rollout.run(self.engine, step=step, prompts=rc.prompts_per_step,
                                      group_size=rc.group_size, generator=self.rollouts.generator)
        t1 = time.perf_counter()
        meta = self.side.reassembler.finalize_group(batch.receipts,
                                                    partition_id=rc.train_partition)
        m.write_to_dataplane(meta, {TURN_REWARDS: batch.turn_scores / self.task.turns})
        m.forward_pass(meta, role="policy", step=step)
        if m.value is not None:
            m.forward_pass(meta, role="value", step=step)
        m.write_advantages(meta)
        actions, lp_gap = action_tokens_and_gap(m.read_from_dataplane(
            meta, select_fields=list(GAP_FIELDS)))
        meta.extra_info[RL_STEP] = step_record(
            actions=actions, minibatches=rc.minibatches, rewards=batch.rewards.tolist(),
            turn_scores=batch.turn_scores.tolist(), rollout_s=t1 - t0,
            prepare_s=time.perf_counter() - t1, failed_calls=batch.failed_calls, lp_gap=lp_gap,
            **({EVAL: evaluated} if evaluated else {}))
        if self.replicated:
            meta = ranks.replica_shard(meta, m.dp_client, strategy=m.trainer.strategy,
                                       global_batch=self.global_batch)
        return meta


__all__ = ["Colocated", "RolloutStream"]

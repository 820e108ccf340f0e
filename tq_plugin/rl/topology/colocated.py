"""The colocated step source (``recipe.topology=colocated``): the trainer process generates each
step's rollouts itself, between RL steps, with the weights it trains.

Each RL step (``prepare_step``, called by the ``MetaDataModule`` inside the fit's dataloader):

1. the rollout engine (``engine=native|hf|vllm``) is brought to the trainer's weights of the step
   (``rl/weight_sync_s``) and generates multi-turn rollouts, every call staged through
   ``TQTokenSink`` with the engine's own tokens, logprobs and weight version;
2. ``RolloutReassembler.finalize_group`` verifies the staged calls against the receipts and
   writes the training rows into the train partition, returning the meta;
3. per-turn rewards, ``prev_logprobs`` (policy), ``ref_logprobs`` (the frozen reference,
   ``recipe.beta > 0``) and ``values`` (PPO's value model) are written back through the data
   plane; the advantages are computed from columns read back and written too
   (``RLModule.write_advantages``).

Reward shaping and selection, per draw of rollouts (:meth:`Colocated.draw`):
``recipe.mask_truncated_completions`` zeroes the ``sample_mask`` of rows whose last generated
token is not the stop token (their reward still enters the group baseline);
``recipe.overlong_buffer`` adds DAPO's soft overlong penalty to ``total_reward``;
``recipe.dynamic_sampling`` drops the groups whose rewards are all equal (cleared from the data
plane at once) and draws more prompts until ``prompts_per_step`` groups are kept or
``recipe.max_draws`` draws were made, then fills the rest with the last draw's zero-signal groups
(``sampling/*`` in the metrics). A task with a reward log (``task=prompts``) gets its per-reward
figures (``rewards/<name>/mean``, ``/std``) into the step record, and every
``recipe.log_completions_every`` steps a few sample completions into ``completions.jsonl`` and
the loggers that take text.

Under DDP on the embedded store every rank replays the same rollouts (one rollout stream, the
same generator state on every rank) and keeps its length-balanced shard of the rows
(``ranks.replica_shard``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from tq_plugin.data_plane import INPUT_IDS, SAMPLE_MASK, TOKEN_MASK, TOTAL_REWARD, KVBatchMeta
from tq_plugin.rl.algorithms.advantages import last_action_tokens, overlong_penalty
from tq_plugin.rl.models.weights import engine_weights
from tq_plugin.rl.topology.build import build_rollout_side, start_engine
from tq_plugin.rl.training import ranks
from tq_plugin.rl.training.evaluation import EVAL, evaluate
from tq_plugin.rl.training.metrics import completion_rows, log_completions, reward_figures
from tq_plugin.rl.training.module import RLModule
from tq_plugin.rl.training.step_record import (
    GAP_FIELDS,
    RL_STEP,
    STEP_FIGURES,
    TURN_REWARDS,
    action_tokens_and_gap,
    step_record,
)

# Rollout ids of a step's extra draws (dynamic sampling) are those of step + draw * this, so
# they never meet another step's.
DRAW_STRIDE = 10**9
# Sample completions written every recipe.log_completions_every steps.
COMPLETIONS_PER_LOG = 4


@dataclass
class Draw:
    """One draw of a step's rollouts, its rows written: the rows' meta, the rows' (shaped) total
    rewards and per-turn scores, and the draw's counts."""

    meta: KVBatchMeta
    rewards: torch.Tensor  # [B]
    turn_scores: torch.Tensor  # [B, turns]
    failed_calls: int
    figures: dict[str, float]

    def groups(self, group_size: int) -> torch.Tensor:
        """``[groups]``: True where a group's rewards are not all equal (NaN left out)."""
        r = self.rewards.float().view(-1, group_size)
        nan = torch.isnan(r)
        lo = torch.where(nan, torch.full_like(r, math.inf), r).min(dim=1).values
        hi = torch.where(nan, torch.full_like(r, -math.inf), r).max(dim=1).values
        return hi > lo

    def take(self, groups: list[int], group_size: int) -> Draw:
        rows = [g * group_size + i for g in groups for i in range(group_size)]
        return Draw(self.meta.subset(rows), self.rewards[rows], self.turn_scores[rows], 0, {})


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
        evaluated = self.evaluate() if rc.eval_every and step % rc.eval_every == 0 else {}
        if hasattr(self.task, "set_step"):  # the reward functions' trainer_state
            self.task.set_step(step, rc.num_steps)
        t0 = time.perf_counter()
        batch = self.dynamic_sample(step) if rc.dynamic_sampling else self.draw(step, 0)
        t1 = time.perf_counter()
        meta = batch.meta
        m.write_to_dataplane(meta, {TURN_REWARDS: batch.turn_scores / self.task.turns})
        m.forward_pass(meta, role="policy", step=step)
        if m.reference is not None:
            m.forward_pass(meta, role="reference", step=step)
        if m.value is not None:
            m.forward_pass(meta, role="value", step=step)
        m.write_advantages(meta)
        actions, lp_gap = action_tokens_and_gap(m.read_from_dataplane(
            meta, select_fields=list(GAP_FIELDS)))
        figures = (batch.figures | self.reward_log(step)
                   | getattr(self.side.rollout, "figures", {})  # a task's own driver (agent/*)
                   | {f"eval/{k}": float(v) for k, v in evaluated.items()})
        rewards = batch.rewards.nan_to_num(0.0)  # the metrics' reward: unscorable rows count 0
        meta.extra_info[RL_STEP] = step_record(
            actions=actions, minibatches=rc.minibatches, rewards=rewards.tolist(),
            turn_scores=batch.turn_scores.nan_to_num(0.0).tolist(), rollout_s=t1 - t0,
            prepare_s=time.perf_counter() - t1, failed_calls=batch.failed_calls, lp_gap=lp_gap,
            loss_type=rc.loss_type, max_new_tokens=rc.max_new_tokens,
            **({EVAL: evaluated} if evaluated else {}), **({STEP_FIGURES: figures} if figures else {}))
        if self.replicated:
            meta = ranks.replica_shard(meta, m.dp_client, strategy=m.trainer.strategy,
                                       global_batch=self.global_batch)
        return meta

    def draw(self, step: int, index: int) -> Draw:
        """One draw of ``prompts_per_step`` groups: generated, staged, written as rows, shaped
        (truncation mask, overlong penalty: the rows' ``total_reward`` and ``sample_mask``
        rewritten)."""
        rc, m = self.rc, self.module
        logged = len(getattr(self.task, "reward_log", ()))
        batch = self.side.rollout.run(self.engine, step=step + index * DRAW_STRIDE,
                                      prompts=rc.prompts_per_step, group_size=rc.group_size,
                                      generator=self.rollouts.generator)
        meta = self.side.reassembler.finalize_group(batch.receipts,
                                                    partition_id=rc.train_partition)
        rewards, figures = batch.rewards.clone(), {}
        written: dict[str, torch.Tensor] = {}
        # Rows no reward applied to in any turn (their receipts carry 0.0): NaN, kept out of
        # their groups' baselines (advantage 0), as TRL keeps its unscorable completions.
        calls = getattr(self.task, "reward_log", [])[logged:]
        if calls:
            unscorable = torch.stack([torch.tensor(c["total"]).isnan() for c in calls]).all(dim=0)
            if unscorable.any():
                rewards = torch.where(unscorable, torch.full_like(rewards, math.nan), rewards)
                written[TOTAL_REWARD] = rewards
        if rc.mask_truncated_completions or rc.overlong_buffer:
            td = m.read_from_dataplane(meta, select_fields=[INPUT_IDS, TOKEN_MASK, SAMPLE_MASK])
            mask = td[TOKEN_MASK] > 0
            truncated = (last_action_tokens(mask, td[INPUT_IDS]) != self.task.eos_token_id) \
                & mask.any(dim=1)
            figures["completions/truncated_fraction"] = float(truncated.float().mean())
            if rc.mask_truncated_completions:
                written[SAMPLE_MASK] = td[SAMPLE_MASK] * ~truncated
            if rc.overlong_buffer:
                penalty = overlong_penalty(mask.sum(dim=1), max_length=rc.max_new_tokens * self.task.turns,
                                           buffer=rc.overlong_buffer, factor=rc.overlong_penalty)
                rewards = rewards + penalty
                written[TOTAL_REWARD] = rewards
                figures["rewards/overlong_penalty/mean"] = float(penalty.mean())
        if written:
            m.write_to_dataplane(meta, written)
        return Draw(meta, rewards, batch.turn_scores, batch.failed_calls, figures)

    def dynamic_sample(self, step: int) -> Draw:
        """``recipe.dynamic_sampling`` (DAPO): draws until ``prompts_per_step`` groups whose
        rewards differ are kept, or ``max_draws`` draws were made; the rest is filled with the
        last draw's zero-signal groups. Every row not kept is cleared from the data plane."""
        rc, g = self.rc, self.rc.group_size
        kept: list[Draw] = []
        need, dropped, failed, figures = rc.prompts_per_step, 0, 0, {}
        draws = 0
        while need and draws < rc.max_draws:
            d = self.draw(step, draws)
            draws, failed, figures = draws + 1, failed + d.failed_calls, figures | d.figures
            signal = d.groups(g)
            useful = [i for i, s in enumerate(signal.tolist()) if s][:need]
            flat = [i for i, s in enumerate(signal.tolist()) if not s]
            need -= len(useful)
            # What the last draw leaves of its zero-signal groups fills a step the draws did
            # not fill; the rest (and an earlier draw's) is cleared now.
            fill = flat[:need] if (need and draws == rc.max_draws) else []
            kept += [d.take(useful + fill, g)] if useful or fill else []
            dropped += len(flat) - len(fill)
            need -= len(fill)
            unused = sorted(set(range(signal.numel())) - set(useful) - set(fill))
            self._clear(d.meta, [r for gi in unused for r in range(gi * g, gi * g + g)])
            figures["sampling/groups_filled"] = float(len(fill))
        meta = kept[0].meta.concat(*(k.meta for k in kept[1:]))
        figures |= {"sampling/draws": float(draws), "sampling/groups_dropped": float(dropped)}
        return Draw(meta, torch.cat([k.rewards for k in kept]),
                    torch.cat([k.turn_scores for k in kept]), failed, figures)

    def _clear(self, meta: KVBatchMeta, rows: list[int]) -> None:
        if rows:
            sub = meta.subset(rows)
            self.module.dp_client.clear_samples(
                partition_id=sub.partition_id, sample_ids=sub.sample_ids
            )

    def reward_log(self, step: int) -> dict[str, float]:
        """The task's per-reward figures of the step (a task with a reward log only) and, every
        ``recipe.log_completions_every`` steps, its sample completions (rank 0 writes them)."""
        drain = getattr(self.task, "drain_reward_log", None)
        if drain is None:
            return {}
        log = drain()
        every = self.rc.log_completions_every
        trainer = self.module._trainer
        if every and step % every == 0 and (trainer is None or trainer.is_global_zero):
            log_completions(completion_rows(log, step, COMPLETIONS_PER_LOG),
                            output_dir=self.output_dir,
                            loggers=list(trainer.loggers) if trainer is not None else [], step=step)
        return reward_figures(log)


__all__ = ["Colocated", "RolloutStream"]

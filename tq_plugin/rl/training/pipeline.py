"""One step pipeline for every topology: the draws on the generation side and the tail of a step
on the trainer side, written once and called by every step source (``tq_plugin.rl.topology``).

**Generation side** (:class:`DrawLoop`, where the groups are generated: the colocated trainer,
or each disaggregated rollout worker for the chunk its ticket orders). One *draw* runs the
rollouts of ``prompts`` groups (every call staged through ``TQTokenSink``), finalizes them into
training rows and shapes their rewards in place:

* rows no reward applied to in any turn (a task with a reward log: their receipts carry 0.0)
  get ``total_reward`` NaN, kept out of their groups' baselines (advantage 0), as TRL keeps its
  unscorable completions;
* ``recipe.mask_truncated_completions`` zeroes the ``sample_mask`` of rows whose last generated
  token is not the stop token (their reward still enters the group baseline);
* ``recipe.overlong_buffer`` adds DAPO's soft overlong penalty to ``total_reward``.

``recipe.dynamic_sampling`` (DAPO) draws until ``prompts`` groups whose rewards differ are kept
or ``recipe.max_draws`` draws were made, then fills the rest with the last draw's zero-signal
groups; every row not kept is cleared at once (``sampling/*`` in the figures).

**Trainer side** (:class:`StepTail`): given a step's rows in the trainer's store, the no-grad
passes (``prev_logprobs``, the frozen reference's ``reference_policy_logprobs`` when
``recipe.beta > 0``, PPO's ``values``: on a sharded policy each rank passes its shard of the
rows), the advantages, the logprob gap and the step record (``RL_STEP``) the trainer reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tq_plugin.data_plane import (
    INPUT_IDS,
    SAMPLE_MASK,
    TOKEN_MASK,
    TOTAL_REWARD,
    KVBatchMeta,
    shard_meta_for_dp,
)
from tq_plugin.lightning import max_over_ranks
from tq_plugin.rl.algorithms.advantages import last_action_tokens, overlong_penalty
from tq_plugin.rl.training.step_record import (
    GAP_FIELDS,
    RL_STEP,
    STEP_FIGURES,
    TURN_REWARDS,
    action_tokens_and_gap,
    ledger_gap,
    step_record,
)
from tq_plugin.staging import TOKEN_VERSIONS_FIELD

# Rollout ids of a step's extra draws (dynamic sampling) are those of step + draw * this, so
# they never meet another step's (or another ticket's).
DRAW_STRIDE = 10**9


@dataclass
class Draw:
    """One draw of rollouts, its rows written: the rows' meta, their (shaped) total rewards and
    per-turn scores, and the draw's counts and figures."""

    meta: KVBatchMeta
    rewards: torch.Tensor  # [B]
    turn_scores: torch.Tensor  # [B, turns]
    failed_calls: int = 0
    staged_calls: int = 0
    figures: dict[str, float] = field(default_factory=dict)

    def groups(self, group_size: int) -> torch.Tensor:
        """``[groups]``: True where a group's rewards are not all equal (NaN left out)."""
        r = self.rewards.float().view(-1, group_size)
        nan = torch.isnan(r)
        lo = torch.where(nan, torch.full_like(r, math.inf), r).min(dim=1).values
        hi = torch.where(nan, torch.full_like(r, -math.inf), r).max(dim=1).values
        return hi > lo

    def take(self, groups: list[int], group_size: int) -> Draw:
        rows = [g * group_size + i for g in groups for i in range(group_size)]
        return Draw(self.meta.subset(rows), self.rewards[rows], self.turn_scores[rows])


@dataclass
class RowIO:
    """How the generation side reads, writes and clears rows: the trainer module's data-plane
    methods (colocated) or a worker's client (disaggregated)."""

    read: Callable[[KVBatchMeta, list[str]], Any]
    write: Callable[[KVBatchMeta, dict[str, torch.Tensor]], None]
    clear: Callable[[KVBatchMeta], None]


def completion_length_figures(lengths: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """TRL's completion-length figures of a draw: the rows' generated (action) token counts,
    mean, smallest and largest, and ``clipped_ratio``, the fraction of rows that ended without
    the stop token (cut at ``recipe.max_new_tokens``)."""
    lengths = lengths.float()
    return {"completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(clipped.float().mean())}


class DrawLoop:
    """The generation side of a step (see the module docstring): ``rc`` is the typed ``recipe``
    group, ``task`` the run's task, ``side`` the rollout side (``topology.build.RolloutSide``),
    ``io`` how rows are read, written and cleared where they are generated."""

    def __init__(self, *, rc: Any, task: Any, side: Any, io: RowIO) -> None:
        self.rc, self.task, self.side, self.io = rc, task, side, io

    def run(self, engine: Any, *, step: int, prompts: int, generator: torch.Generator,
            partition_id: str) -> Draw:
        """``prompts`` groups for ``step`` (rollout ids from ``step``), shaped, drawn again
        under ``recipe.dynamic_sampling``."""
        if self.rc.dynamic_sampling:
            return self.dynamic_sample(engine, step=step, prompts=prompts, generator=generator,
                                       partition_id=partition_id)
        return self.draw(engine, step=step, prompts=prompts, generator=generator,
                         partition_id=partition_id)

    def draw(self, engine: Any, *, step: int, prompts: int, generator: torch.Generator,
             partition_id: str, index: int = 0) -> Draw:
        """One draw of ``prompts`` groups: generated, staged, written as rows, shaped
        (unscorable rows, truncation mask, overlong penalty: the rows' ``total_reward`` and
        ``sample_mask`` rewritten)."""
        rc, task = self.rc, self.task
        log = task.reward_log
        logged = len(log)
        batch = self.side.rollout.run(engine, step=step + index * DRAW_STRIDE, prompts=prompts,
                                      group_size=rc.group_size, generator=generator)
        meta = self.side.reassembler.finalize_group(batch.receipts, partition_id=partition_id)
        rewards, figures = batch.rewards.clone(), {}
        written: dict[str, torch.Tensor] = {}
        calls = log[logged:]
        if calls:
            unscorable = torch.stack([torch.tensor(c["total"]).isnan() for c in calls]).all(dim=0)
            if unscorable.any():
                rewards = torch.where(unscorable, torch.full_like(rewards, math.nan), rewards)
                written[TOTAL_REWARD] = rewards
        # The lengths every draw reports need the ids and the mask; the row mask only the
        # truncation mask rewrites.
        td = self.io.read(meta, [INPUT_IDS, TOKEN_MASK,
                                 *([SAMPLE_MASK] if rc.mask_truncated_completions else [])])
        mask = td[TOKEN_MASK] > 0
        truncated = (last_action_tokens(mask, td[INPUT_IDS]) != task.eos_token_id) \
            & mask.any(dim=1)
        figures.update(completion_length_figures(mask.sum(dim=1), truncated))
        if rc.mask_truncated_completions or rc.overlong_buffer:
            if rc.mask_truncated_completions:
                written[SAMPLE_MASK] = td[SAMPLE_MASK] * ~truncated
            if rc.overlong_buffer:
                penalty = overlong_penalty(mask.sum(dim=1), max_length=rc.max_new_tokens * task.turns,
                                           buffer=rc.overlong_buffer, factor=rc.overlong_penalty)
                rewards = rewards + penalty
                written[TOTAL_REWARD] = rewards
                figures["rewards/overlong_penalty/mean"] = float(penalty.mean())
        if written:
            self.io.write(meta, written)
        return Draw(meta, rewards, batch.turn_scores, batch.failed_calls,
                    getattr(batch, "staged_calls", 0), figures)

    def dynamic_sample(self, engine: Any, *, step: int, prompts: int,
                       generator: torch.Generator, partition_id: str) -> Draw:
        """``recipe.dynamic_sampling`` (DAPO): draws until ``prompts`` groups whose rewards
        differ are kept, or ``max_draws`` draws were made; the rest is filled with the last
        draw's zero-signal groups. Every row not kept is cleared at once."""
        rc, g = self.rc, self.rc.group_size
        kept: list[Draw] = []
        need, dropped, failed, staged, figures = prompts, 0, 0, 0, {}
        draws = 0
        while need and draws < rc.max_draws:
            d = self.draw(engine, step=step, prompts=prompts, generator=generator,
                          partition_id=partition_id, index=draws)
            draws, failed, figures = draws + 1, failed + d.failed_calls, figures | d.figures
            staged += d.staged_calls
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
            rows = [r for gi in unused for r in range(gi * g, gi * g + g)]
            if rows:
                self.io.clear(d.meta.subset(rows))
            figures["sampling/groups_filled"] = float(len(fill))
        meta = kept[0].meta.concat(*(k.meta for k in kept[1:]))
        figures |= {"sampling/draws": float(draws), "sampling/groups_dropped": float(dropped)}
        return Draw(meta, torch.cat([k.rewards for k in kept]),
                    torch.cat([k.turn_scores for k in kept]), failed, staged, figures)


class StepTail:
    """The trainer side of every step (see the module docstring), over the trained ``module``
    (an ``RLModule``): ``rc`` is the typed ``recipe`` group, ``turns`` the task's turns."""

    def __init__(self, module: Any, *, rc: Any, turns: int) -> None:
        self.module, self.rc, self.turns = module, rc, turns

    def roles(self) -> list[str]:
        """The no-grad passes of a step: the policy's, the reference's (``recipe.beta > 0``) and
        the value model's (PPO)."""
        m = self.module
        return ["policy", *(["reference"] if m.uses_reference else []),
                *(["value"] if m.value is not None else [])]

    def passes(self, meta: KVBatchMeta | None, *, step: int, sharded: bool = False) -> None:
        """The step's no-grad passes, written back through the data plane. ``sharded``: a
        sharded (FSDP) model whose ranks all run this: rank 0's meta is broadcast, each rank
        passes its length-balanced shard of the rows with as many forwards as the busiest
        rank (the collectives pair up: ``RLModule.forward_pass(pair_with=...)``), and the
        ranks meet once every rank's rows are written."""
        m = self.module
        if not sharded:
            for role in self.roles():
                m.forward_pass(meta, role=role, step=step)
            return
        trainer = m.trainer
        strategy = trainer.strategy
        meta = strategy.broadcast(meta, src=0)
        # The step's rows divide evenly over the ranks (ranks.check_parallel_run).
        mine = shard_meta_for_dp(meta, dp_world=trainer.world_size)[0][trainer.global_rank]
        for role in self.roles():
            m.forward_pass(mine, role=role, step=step,
                           pair_with=lambda n: max_over_ranks(strategy, [n])[0])
        strategy.barrier("tq_plugin.pipeline.passes")

    def finish(self, meta: KVBatchMeta, *, step: int, draw: Draw | None, rollout_s: float,
               t_prepare: float, failed_calls: int, figures: dict[str, Any] | None = None,
               **extra: Any) -> KVBatchMeta:
        """Advantages, the logprob gap (over rows with a per-token version ledger, the fresh
        tokens' too: :func:`~tq_plugin.rl.training.step_record.ledger_gap`) and the step
        record, once the passes are written.
        ``draw``: the step's rewards as generated here (colocated); ``None`` reads them from
        the rows (``total_reward``, ``turn_rewards``). ``t_prepare``: when the step's
        preparation after its rollouts began (``prepare_s``). Returns ``meta`` with its
        record in ``extra_info[RL_STEP]``."""
        m, rc = self.module, self.rc
        m.write_advantages(meta)
        ledger = TOKEN_VERSIONS_FIELD in meta.fields  # in-flight updates' per-token versions
        fields = [*GAP_FIELDS, *([] if draw is not None else [TOTAL_REWARD, TURN_REWARDS]),
                  *([TOKEN_VERSIONS_FIELD] if ledger else [])]
        td = m.read_from_dataplane(meta, select_fields=fields,
                                   **({"pad_value_dict": {TOKEN_VERSIONS_FIELD: -1}} if ledger else {}))
        actions, lp_gap = action_tokens_and_gap(td)
        if ledger:
            figures = {**(figures or {}), **ledger_gap(td, td[TOKEN_VERSIONS_FIELD], step)}
        if draw is not None:
            rewards, turn_scores = draw.rewards, draw.turn_scores
        else:
            rewards, turn_scores = td[TOTAL_REWARD], td[TURN_REWARDS] * self.turns
        # The metrics' reward: unscorable rows count 0.
        meta.extra_info[RL_STEP] = step_record(
            actions=actions, minibatches=rc.minibatches,
            rewards=rewards.nan_to_num(0.0).tolist(),
            turn_scores=turn_scores.nan_to_num(0.0).tolist(), rollout_s=rollout_s,
            prepare_s=time.perf_counter() - t_prepare, failed_calls=failed_calls, lp_gap=lp_gap,
            loss_type=rc.loss_type, max_new_tokens=rc.max_new_tokens,
            **extra, **({STEP_FIGURES: figures} if figures else {}))
        return meta

    def run(self, meta: KVBatchMeta, draw: Draw, *, step: int, rollout_s: float,
            figures: dict[str, Any] | None = None, **extra: Any) -> KVBatchMeta:
        """The whole tail of a step generated where it trains: the per-turn rewards written,
        the passes, then :meth:`finish`."""
        t1 = time.perf_counter()
        self.module.write_to_dataplane(meta, {TURN_REWARDS: draw.turn_scores / self.turns})
        self.passes(meta, step=step)
        return self.finish(meta, step=step, draw=draw, rollout_s=rollout_s, t_prepare=t1,
                           failed_calls=draw.failed_calls, figures=figures, **extra)


__all__ = ["DRAW_STRIDE", "Draw", "DrawLoop", "RowIO", "StepTail"]

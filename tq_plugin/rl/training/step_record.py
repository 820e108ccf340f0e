"""What a prepared RL step carries besides its rows: the step record.

Both step sources (``tq_plugin.rl.topology``: colocated and disaggregated) write one into the
step meta's ``extra_info[RL_STEP]``; the recipe's step callback reads it on every rank (it rides
the meta, so a broadcast step meta carries it too, and ``DataPlaneCallback`` checkpoints it with
the meta: its values are plain JSON).
"""

from __future__ import annotations

from typing import Any

import torch

from tq_plugin.data_plane import GENERATION_LOGPROBS, PREV_LOGPROBS, SAMPLE_MASK, TOKEN_MASK
from tq_plugin.rl.algorithms.losses import loss_normalizer

# extra_info key of a step meta (see the module docstring).
RL_STEP = "rl_step"
# Per-turn rewards of a training row (a fraction of the task's turns), written next to the rows.
TURN_REWARDS = "turn_rewards"
# extra entry of a record: the step's own figures, logged as they are (rewards/<name>/mean,
# rewards/<name>/std, rewards/unscorable, sampling/*), and columns of metrics.csv.
STEP_FIGURES = "figures"
# The columns :func:`action_tokens_and_gap` reads.
GAP_FIELDS = (TOKEN_MASK, SAMPLE_MASK, GENERATION_LOGPROBS, PREV_LOGPROBS)


def action_tokens_and_gap(td: Any) -> tuple[int, float]:
    """``(action tokens, largest |generation_logprobs - prev_logprobs| over them)`` of rows read
    with :data:`GAP_FIELDS`.

    The gap is the largest difference between the engine's staged logprobs and the policy's
    recomputation: colocated, the weights have not changed in between, so anything but ~0 means
    rows, masks or padding are misaligned between staging and the training partition."""
    mask = (td[TOKEN_MASK] > 0) & (td[SAMPLE_MASK] > 0).unsqueeze(1)
    gap = ((td[GENERATION_LOGPROBS] - td[PREV_LOGPROBS]).abs() * mask).max()
    return int(mask.sum()), float(gap)


def ledger_gap(td: Any, versions: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """The per-token ledger's alignment check (rows generated with in-flight weight updates):
    over the live action tokens whose ledger version is the trainer's own (``versions [B, L]``,
    aligned with the rows read with :data:`GAP_FIELDS`), ``|generation_logprobs -
    prev_logprobs|``, their largest (``fresh_logprob_gap``) and mean
    (``fresh_logprob_gap_mean``), and how many there are (``fresh_tokens``; both gaps 0 when
    there are none). Such a token was sampled by the very weights the step's no-grad pass
    scored it with, so its gap is ~0 when staging, ledger and rows line up, as the colocated
    ``logprob_gap`` is; with ``recipe.inflight.kv=keep`` a token decoded after a mid-generation
    load over the old weights' cache is the exception, and its gap measures what the kept cache
    changed (``docs/topologies.md``)."""
    mask = (td[TOKEN_MASK] > 0) & (td[SAMPLE_MASK] > 0).unsqueeze(1) & (versions == trainer_version)
    n = int(mask.sum())
    if not n:
        return {"fresh_tokens": 0, "fresh_logprob_gap": 0.0, "fresh_logprob_gap_mean": 0.0}
    diff = (td[GENERATION_LOGPROBS] - td[PREV_LOGPROBS]).abs()[mask]
    return {"fresh_tokens": n, "fresh_logprob_gap": float(diff.max()),
            "fresh_logprob_gap_mean": float(diff.mean())}


def step_record(*, actions: int, minibatches: int, rewards: list[float],
                turn_scores: list[list[float]], rollout_s: float, prepare_s: float,
                failed_calls: int, lp_gap: float, loss_type: str = "dapo",
                max_new_tokens: int = 0, **extra: Any) -> dict[str, Any]:
    """The ``RL_STEP`` record: ``loss_norm``, the global normaliser of ``loss_type``
    (:func:`~tq_plugin.rl.algorithms.losses.loss_normalizer`: one global batch's action tokens,
    sequences, or sequences x the longest completion, the same under every packing mode) and the
    totals it came from, the rollout figures the metrics book, and ``extra`` entries (eval,
    per-reward figures, dynamic-sampling counts)."""
    totals = {"actions": int(actions), "sequences": len(rewards), "minibatches": int(minibatches),
              "turns": len(turn_scores[0]) if turn_scores else 1}
    return {"loss_norm": record_loss_norm(totals, loss_type, max_new_tokens), "loss_type": loss_type,
            **totals, "rewards": rewards, "turn_scores": turn_scores, "rollout_s": rollout_s,
            "prepare_s": prepare_s, "failed_calls": failed_calls, "lp_gap": lp_gap, **extra}


def record_loss_norm(record: dict[str, Any], loss_type: str, max_new_tokens: int) -> float:
    """``loss_type``'s normaliser from a step record's totals (``max_new_tokens`` x its turns:
    the longest completion, Dr. GRPO's constant). A record from before the totals were kept
    holds only the action-token normaliser."""
    if "actions" not in record:
        return float(record["loss_norm"])
    return loss_normalizer(loss_type, action_tokens=record["actions"],
                           sequences=record["sequences"], minibatches=record["minibatches"],
                           max_completion_tokens=max(1, max_new_tokens * record["turns"]))


__all__ = ["GAP_FIELDS", "RL_STEP", "STEP_FIGURES", "TURN_REWARDS", "action_tokens_and_gap", "ledger_gap",
           "record_loss_norm", "step_record"]

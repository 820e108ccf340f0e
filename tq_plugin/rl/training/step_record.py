"""What a prepared RL step carries besides its rows: the step record.

Both step sources (``tq_plugin.rl.topology``: colocated and disaggregated) write one into the
step meta's ``extra_info[RL_STEP]``; the recipe's step callback reads it on every rank (it rides
the meta, so a broadcast step meta carries it too, and ``DataPlaneCallback`` checkpoints it with
the meta: its values are plain JSON).
"""

from __future__ import annotations

from typing import Any

from tq_plugin.data_plane import GENERATION_LOGPROBS, PREV_LOGPROBS, SAMPLE_MASK, TOKEN_MASK

# extra_info key of a step meta (see the module docstring).
RL_STEP = "rl_step"
# Per-turn rewards of a training row (a fraction of the task's turns), written next to the rows.
TURN_REWARDS = "turn_rewards"
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


def step_record(*, actions: int, minibatches: int, rewards: list[float],
                turn_scores: list[list[float]], rollout_s: float, prepare_s: float,
                failed_calls: int, lp_gap: float, **extra: Any) -> dict[str, Any]:
    """The ``RL_STEP`` record: the loss normalizer (a global batch's action tokens, the same under
    every packing mode), the rollout figures the metrics book, and ``extra`` entries (eval)."""
    return {"loss_norm": max(1, actions // minibatches), "rewards": rewards,
            "turn_scores": turn_scores, "rollout_s": rollout_s, "prepare_s": prepare_s,
            "failed_calls": failed_calls, "lp_gap": lp_gap, **extra}


__all__ = ["GAP_FIELDS", "RL_STEP", "TURN_REWARDS", "action_tokens_and_gap", "step_record"]

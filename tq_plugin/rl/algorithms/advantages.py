"""Advantage estimators on padded ``[B, S]`` step columns, vectorized over the batch.

Actions are the generated tokens (``token_mask == 1``); prompt and environment tokens in between
are not steps of the MDP. Both estimators therefore work on each row's *action sequence*: the
action positions are gathered into a dense ``[B, A]`` block, computed on, and scattered back.

The estimators a step may use are registered by name
(:func:`~tq_plugin.rl.algorithms.registry.register_advantage_estimator`, whose docstring states
their contract): ``gae`` (PPO's) and ``grpo``; :func:`compute_advantages` looks the name up.
"""

from __future__ import annotations

import math

import torch

from tq_plugin.rl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_ALIASES,
    register_advantage_estimator,
)


def _action_index(token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [B, A], valid [B, A])``: each row's action positions, left-aligned."""
    is_action = token_mask > 0
    width = int(is_action.sum(1).max()) if is_action.numel() else 0
    # A stable sort on "not an action" moves action positions to the front, in order.
    order = torch.sort((~is_action).to(torch.int8), dim=1, stable=True).indices[:, :width]
    valid = torch.arange(width).unsqueeze(0) < is_action.sum(1, keepdim=True)
    return order, valid


def turn_end_rewards(token_mask: torch.Tensor, turn_rewards: torch.Tensor) -> torch.Tensor:
    """Place turn ``k``'s reward on the last generated token of the row's ``k``-th turn."""
    m = token_mask > 0
    nxt = torch.nn.functional.pad(m[:, 1:], (0, 1), value=False)
    ends = m & ~nxt
    turn_of = torch.cumsum(ends.long(), dim=1) - ends.long()  # 0-based turn index at each end
    turn_of = turn_of.clamp(max=turn_rewards.shape[1] - 1)
    return torch.where(ends, turn_rewards.gather(1, turn_of), torch.zeros(()))


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's actions; returns ``(adv, returns)``.

    With ``delta_i = r_i + gamma * V_{i+1} - V_i`` (``V`` past the last action is 0),
    ``adv_i = sum_{j >= i} (gamma * lam)^(j - i) * delta_j``, computed as one matrix product.
    """
    pos, valid = _action_index(token_mask)
    r = rewards.gather(1, pos) * valid
    v = values.gather(1, pos) * valid
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = (r + gamma * v_next - v) * valid
    a = delta.shape[1]
    i = torch.arange(a)
    power = (i.unsqueeze(0) - i.unsqueeze(1)).clamp(min=0).to(delta.dtype)
    discount = torch.where(i.unsqueeze(0) >= i.unsqueeze(1), (gamma * lam) ** power,
                           torch.zeros((), dtype=delta.dtype))
    adv_actions = delta @ discount.T
    adv = torch.zeros_like(values).scatter(1, pos, adv_actions * valid)
    adv = adv * (token_mask > 0)
    return adv, (adv + values) * (token_mask > 0)


SCALE_REWARDS = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, mean: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Bessel-corrected std of the non-NaN entries (NaN with fewer than 2)."""
    valid = ~torch.isnan(x)
    dev = torch.where(valid, x - mean, torch.zeros_like(x)) ** 2
    if dim is None:
        n, total = valid.sum(), dev.sum()
    else:
        n, total = valid.sum(dim, keepdim=True), dev.sum(dim, keepdim=True)
    return torch.where(n > 1, (total / (n - 1).clamp(min=1)).sqrt(), torch.full_like(total, math.nan))


def group_relative(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                   scale: str = "group") -> torch.Tensor:
    """GRPO: each reward minus its group's mean (rows are group-major), divided by
    ``scale_rewards``' std: its group's (``group``, the GRPO paper's), the whole batch's
    (``batch``, Liu et al.'s and TRL's ``scale_rewards="batch"``) or none (``none``: Dr. GRPO).

    NaN rewards (no reward function applied, TRL's unscorable completions) are kept out of the
    means and stds (Bessel's n-1) and get advantage 0, as does a group with fewer than 2 valid
    rewards under ``group``."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"group_relative: scale must be one of {SCALE_REWARDS}, got {scale!r}")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    centred = grouped - mean
    if scale == "group":
        centred = centred / (_nanstd(grouped, mean, dim=1) + eps)
    elif scale == "batch":
        centred = centred / (_nanstd(rewards, torch.nanmean(rewards), dim=None) + eps)
    return torch.nan_to_num(centred, nan=0.0).view(-1)


def last_action_tokens(token_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's last action token id (-1 for a row with no action token)."""
    is_action = token_mask > 0
    width = token_mask.shape[1]
    last = width - 1 - torch.flip(is_action, dims=[1]).to(torch.int8).argmax(dim=1)
    ids = input_ids.gather(1, last.unsqueeze(1)).squeeze(1)
    return torch.where(is_action.any(dim=1), ids, torch.full_like(ids, -1))


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per row of ``lengths``
    generated tokens: 0 up to ``max_length - buffer``, then falling linearly to ``-factor`` at
    ``max_length``, ``-factor`` beyond."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_length - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalize ``values`` over the masked positions (PPO's advantage normalization)."""
    m = mask > 0
    if not m.any():
        return values
    sel = values[m]
    return torch.where(m, (values - sel.mean()) / (sel.std(unbiased=False) + eps), values)


@register_advantage_estimator("gae")
def gae_advantages(*, mask: torch.Tensor, turn_rewards: torch.Tensor | None = None,
                   values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                   **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's: per-turn rewards (``turn_rewards [B, turns]``) at each turn's last action token,
    GAE over the value model's ``values``, whitened advantages, with the returns."""
    if turn_rewards is None or values is None:
        raise ValueError("compute_advantages: gae needs turn_rewards and values (the value "
                         "model's: recipe.algorithm=ppo)")
    adv, returns = gae(turn_end_rewards(mask, turn_rewards), values, mask, gamma=gamma, lam=lam)
    return whiten(adv, mask), returns


@register_advantage_estimator("grpo")
def grpo_advantages(*, mask: torch.Tensor, total_reward: torch.Tensor, group_size: int = 1,
                    scale_rewards: str = "group", **_: object) -> tuple[torch.Tensor, None]:
    """GRPO's: each row's ``total_reward [B]`` against its group's (:func:`group_relative`,
    scaled by ``scale_rewards``) on every action token; no returns."""
    adv = group_relative(total_reward, group_size, scale=scale_rewards)
    return adv.unsqueeze(1) * mask, None


def compute_advantages(estimator: str, *, mask: torch.Tensor, total_reward: torch.Tensor,
                       turn_rewards: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, group_size: int = 1,
                       gamma: float = 1.0, lam: float = 1.0, scale_rewards: str = "group",
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(advantages, returns)`` of a step: the one dispatch both step sources use.

    ``estimator`` is a registered name (``gae``, ``grpo``, a user's; ``ppo`` is ``gae``);
    ``mask`` is the ``[B, S]`` action mask (token mask times sample mask). The arguments are
    passed on by keyword, as :func:`~tq_plugin.rl.algorithms.registry.register_advantage_estimator`
    states."""
    name = ESTIMATOR_ALIASES.get(estimator, estimator)
    try:
        fn = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"compute_advantages: estimator must be one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}, got {estimator!r}") from None
    return fn(mask=mask, total_reward=total_reward, turn_rewards=turn_rewards, values=values,
              group_size=group_size, gamma=gamma, lam=lam, scale_rewards=scale_rewards)

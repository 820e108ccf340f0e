"""``compute_advantages``: the one dispatch both step sources call, by the estimator's registered
name (``ppo`` is ``gae``, the name the dispatch had before the registry)."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.rl.algorithms.advantages import compute_advantages


def test_grpo_puts_each_rows_group_relative_reward_on_its_action_tokens():
    mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]], dtype=torch.float32)
    total = torch.tensor([1.0, 0.0, 3.0, 3.0])  # two groups of 2: (1, 0) and (3, 3)
    adv, returns = compute_advantages("grpo", mask=mask, total_reward=total, group_size=2)
    assert returns is None
    # group (1, 0): mean 0.5, std (unbiased) 0.7071 -> +-0.7071; group (3, 3): no signal -> 0.
    expected = torch.tensor([[0, 0.7071, 0.7071], [0, 0, -0.7071], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_ppo_is_gae_over_turn_end_rewards_then_whitened():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    values = torch.zeros(1, 4)
    # one turn, reward 1 at its last action token; gamma = lam = 1 and V = 0: every advantage
    # (and return) is 1 before whitening, and whitening a constant gives 0.
    adv, returns = compute_advantages("ppo", mask=mask, total_reward=torch.tensor([1.0]),
                                      turn_rewards=torch.tensor([[1.0]]), values=values)
    torch.testing.assert_close(returns, torch.ones(1, 4))
    torch.testing.assert_close(adv, torch.zeros(1, 4))


def test_gae_is_ppos_estimator_by_either_name():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    kw = {"mask": mask, "total_reward": torch.tensor([1.0]), "turn_rewards": torch.tensor([[0.5]]),
          "values": torch.tensor([[0.1, 0.4, 0.0, -0.2]]), "gamma": 0.9, "lam": 0.8}
    for a, b in zip(compute_advantages("ppo", **kw), compute_advantages("gae", **kw)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gae_needs_values_and_an_unknown_estimator_is_named():
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="gae needs turn_rewards and values"):
        compute_advantages("ppo", mask=mask, total_reward=torch.ones(1))
    with pytest.raises(ValueError, match=r"estimator must be one of \['gae', 'grpo'.*"
                                         r"got 'reinforce'"):
        compute_advantages("reinforce", mask=mask, total_reward=torch.ones(1))

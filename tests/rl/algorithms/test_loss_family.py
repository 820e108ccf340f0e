"""The policy loss family (``recipe.loss_type``), the sequence-level ratio, clip-higher, CISPO,
the reference KL estimators and ``scale_rewards``, each against a hand computation and the
formula its anchor publishes (cited per test; TRL 1.16.0's semantics as
``shared/reference/trl_conventions.md`` §4-§9 records them).

Fixture: two sequences, one action token (advantage 2) and three action tokens (advantage 1),
``pi == pi_old`` (ratio 1), so every clipped term is ``-A``: per-token terms ``[-2 | -1 -1 -1]``.
Each normaliser gives a different number on it, so a wrong normaliser fails."""

from __future__ import annotations

import math

import pytest
import torch

from tq_plugin.rl.algorithms.advantages import group_relative
from tq_plugin.rl.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    importance_log_ratio,
    kl_penalty,
    loss_normalizer,
    policy_loss,
    sequence_token_counts,
)

MASK = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
ADV = torch.tensor([[2.0] * 4, [1.0] * 4]) * MASK
LP = torch.full((2, 4), -0.5)


def _terms(loss_type: str = "dapo") -> torch.Tensor:
    terms, _ = policy_loss(loss_type, LP, LP, ADV, MASK, clip_eps=0.2, cispo_cap=5.0)
    return terms


def _loss(loss_type: str, *, max_completion_tokens: int = 4) -> float:
    norm = loss_normalizer(loss_type, action_tokens=4, sequences=2, minibatches=1,
                           max_completion_tokens=max_completion_tokens)
    return float(aggregate_loss(loss_type, _terms(loss_type), MASK, norm=norm))


def test_grpo_is_the_mean_over_sequences_of_each_sequences_token_mean():
    # DeepSeekMath (Shao et al. 2024) eq. 3: 1/G sum_i 1/|o_i| sum_t L_it; TRL grpo.
    assert _loss("grpo") == pytest.approx((-2 / 1 + -3 / 3) / 2)  # -1.5


def test_dapo_is_the_token_sum_over_the_global_batchs_action_tokens():
    # DAPO (Yu et al. 2025) eq. 8: 1 / sum_i |o_i| sum_i sum_t L_it; TRL dapo (its default).
    assert _loss("dapo") == pytest.approx(-5 / 4)


def test_dr_grpo_divides_the_token_sum_by_batch_times_max_completion_length():
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") eq. 3: a constant
    # (MAX_TOKENS) replaces |o_i|; TRL dr_grpo: sum / (B x max_completion_length).
    assert _loss("dr_grpo", max_completion_tokens=4) == pytest.approx(-5 / (2 * 4))
    assert _loss("dr_grpo", max_completion_tokens=8) == pytest.approx(-5 / (2 * 8))


def test_bnpo_is_each_microbatchs_token_mean_over_the_microbatches():
    # TRL bnpo: sum m L / sum m over the local (micro)batch, then / gradient-accumulation steps.
    terms = _terms("bnpo")
    whole = aggregate_loss("bnpo", terms, MASK, norm=1.0, microbatches=1)
    assert float(whole) == pytest.approx(-5 / 4)
    split = sum(float(aggregate_loss("bnpo", terms[i:i + 1], MASK[i:i + 1], norm=1.0,
                                     microbatches=2)) for i in range(2))
    assert split == pytest.approx((-2 / 1) / 2 + (-3 / 3) / 2)  # -1.5: not the token mean


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
def test_the_global_normalisers_do_not_depend_on_the_microbatch_cut(loss_type):
    norm = loss_normalizer(loss_type, action_tokens=4, sequences=2, minibatches=1,
                           max_completion_tokens=4)
    terms = _terms(loss_type)
    whole = float(aggregate_loss(loss_type, terms, MASK, norm=norm))
    split = sum(float(aggregate_loss(loss_type, terms[i:i + 1], MASK[i:i + 1], norm=norm))
                for i in range(2))
    assert split == pytest.approx(whole)


def test_a_packed_row_uses_its_segments_as_sequences():
    # The fixture's two sequences packed into one row: grpo's per-sequence means follow them.
    packed_terms = torch.tensor([[-2.0, -1.0, -1.0, -1.0]])
    packed_mask = torch.ones(1, 4)
    segments = torch.tensor([[0, 1, 1, 1]])
    assert sequence_token_counts(packed_mask, segments).tolist() == [[1.0, 3.0, 3.0, 3.0]]
    assert float(aggregate_loss("grpo", packed_terms, packed_mask, norm=2.0,
                                sequence_ids=segments)) == pytest.approx(-1.5)


def test_clip_higher_clips_each_side_at_its_own_epsilon():
    # PPO (Schulman et al. 2017) eq. 7 with DAPO's decoupled clip (Yu et al. 2025 eq. 10):
    # clip(r, 1 - eps_low, 1 + eps_high). r = 1.5 / 0.5, eps_low 0.2, eps_high 0.28.
    old = torch.zeros(1, 4)
    lp = torch.tensor([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, parts = clipped_policy_loss(lp, old, adv, torch.ones(1, 4), clip_eps=0.2,
                                      clip_eps_high=0.28)
    # A > 0, r high: capped at 1.28 (not 1.2); A < 0, r high: unclipped 1.5;
    # A > 0, r low: unclipped 0.5; A < 0, r low: floored at 0.8.
    assert loss[0].tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8])
    assert parts["clip_high"].tolist() == [[True, False, False, False]]
    assert parts["clip_low"].tolist() == [[False, False, False, True]]
    symmetric, _ = clipped_policy_loss(lp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    assert symmetric[0, 0] == pytest.approx(-1.2)


def test_the_sequence_ratio_is_the_length_normalised_geometric_mean():
    # GSPO (Zheng et al. 2025) eq. 7: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)
    # = exp(1/|y_i| sum_t log(pi / pi_old)); TRL importance_sampling_level="sequence".
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    lp = torch.tensor([[0.2, 0.4, 9.0]], requires_grad=True)  # the off-mask token is ignored
    log_r = importance_log_ratio(lp, old, mask, level="sequence")
    assert log_r[0].tolist() == pytest.approx([0.3, 0.3, 0.0])  # not the token ratios, not the product
    adv = torch.ones(1, 3)
    loss, parts = clipped_policy_loss(lp, old, adv, mask, clip_eps=10.0, level="sequence")
    assert parts["ratio"][0, :2].tolist() == pytest.approx([math.exp(0.3)] * 2)
    total = aggregate_loss("grpo", loss, mask, norm=1.0)
    total.backward()
    # d(-s A)/d log pi_t = -A s / |y| on each action token (grpo: the sequence's token mean).
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.3) / 2, -math.exp(0.3) / 2, 0.0])


def test_cispo_weights_the_reinforce_term_by_the_capped_detached_ratio():
    # MiniMax-M1 (2025) eq. 4-5: J = sg(clip(r, ., 1 + eps_high)) A log pi; TRL cispo
    # (-sg(min(r, cap)) A log pi). r = 1.2 under the cap, 2.0 over it (cap 1.5).
    old = torch.tensor([[-0.5 - math.log(1.2), -0.5 - math.log(2.0)]])
    lp = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    loss, parts = cispo_policy_loss(lp, old, adv, torch.ones(1, 2), cispo_cap=1.5)
    assert loss[0].tolist() == pytest.approx([-1.2 * -0.5, -1.5 * -0.5])
    loss.sum().backward()
    # Stop-gradient: d/d log pi is -w A, without the ratio's own derivative (-w A (1 + log pi)).
    assert lp.grad[0].tolist() == pytest.approx([-1.2, -1.5])
    assert parts["clip_high"].tolist() == [[False, True]]
    with pytest.raises(ValueError, match="cispo_cap must be >= 1.0"):
        cispo_policy_loss(lp, old, adv, torch.ones(1, 2), cispo_cap=0.2)


def test_every_loss_type_is_registered():
    assert {"grpo", "dr_grpo", "dapo", "bnpo", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        policy_loss("ppo2", LP, LP, ADV, MASK, clip_eps=0.2)


def test_kl_estimators():
    # Schulman (2020) "Approximating KL divergence", r = pi_ref / pi: k1 = -log r,
    # k2 = (log r)^2 / 2, k3 = r - 1 - log r (DeepSeekMath eq. 4, TRL's and verl's default).
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = -0.5
    assert float(kl_penalty(lp, ref, "k1")) == pytest.approx(0.5)
    assert float(kl_penalty(lp, ref, "k2")) == pytest.approx(0.125)
    assert float(kl_penalty(lp, ref, "k3")) == pytest.approx(math.exp(d) - d - 1)
    assert float(kl_penalty(lp, lp, "k3")) == 0.0
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_penalty(lp, ref, "k4")


def test_loss_normalizer_values_and_errors():
    kw = {"action_tokens": 40, "sequences": 8, "max_completion_tokens": 16}
    assert loss_normalizer("grpo", minibatches=2, **kw) == 4.0
    assert loss_normalizer("dr_grpo", minibatches=2, **kw) == 64.0
    assert loss_normalizer("dapo", minibatches=2, **kw) == 20.0
    with pytest.raises(ValueError, match="loss_type must be one of"):
        loss_normalizer("gspo", minibatches=1, **kw)


REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 1.0])


def test_scale_rewards_group_batch_none():
    # TRL §4: group: (R - mu_g) / (sigma_g + eps); batch: the batch's sigma, the group's mean;
    # none: R - mu_g (Dr. GRPO drops the std). Bessel's n - 1.
    g1 = (REWARDS[:4] - 0.25) / REWARDS[:4].std()
    g2 = (REWARDS[4:] - 1.5) / REWARDS[4:].std()
    assert group_relative(REWARDS, 4, scale="group").tolist() == pytest.approx(
        torch.cat([g1, g2]).tolist(), abs=1e-5)
    batch_std = float(REWARDS.std())
    centred = torch.cat([REWARDS[:4] - 0.25, REWARDS[4:] - 1.5])
    assert group_relative(REWARDS, 4, scale="batch").tolist() == pytest.approx(
        (centred / batch_std).tolist(), abs=1e-5)
    assert group_relative(REWARDS, 4, scale="none").tolist() == pytest.approx(centred.tolist())


def test_unscorable_rewards_are_kept_out_of_the_baseline_with_advantage_zero():
    rewards = torch.tensor([1.0, math.nan, 0.0, 0.0])
    adv = group_relative(rewards, 4, scale="none")
    mean = 1 / 3
    assert adv.tolist() == pytest.approx([1 - mean, 0.0, -mean, -mean])


def test_overlong_penalty_is_dapos_soft_punishment():
    # DAPO (Yu et al. 2025) eq. 13, L_max 8, L_cache 4: 0 up to 4, (4 - |y|) / 4 up to 8, -1 beyond.
    from tq_plugin.rl.algorithms.advantages import overlong_penalty

    lengths = torch.tensor([3, 4, 5, 7, 8, 9])
    got = overlong_penalty(lengths, max_length=8, buffer=4, factor=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    assert overlong_penalty(lengths, max_length=8, buffer=4, factor=0.5)[3] == pytest.approx(-0.375)
    assert overlong_penalty(lengths, max_length=8, buffer=0).tolist() == [0.0] * 6


def test_last_action_tokens_find_each_rows_last_generated_id():
    from tq_plugin.rl.algorithms.advantages import last_action_tokens

    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    ids = torch.tensor([[5, 6, 7, 0], [5, 8, 9, 2], [5, 5, 5, 5]])
    assert last_action_tokens(mask, ids).tolist() == [7, 2, -1]


class _Uniform(torch.nn.Module):
    """A policy whose every token has log-prob -ln 4 (logits 0 over 4 tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.bias.expand(*input_ids.shape, 4)


def _module_loss(loss_type: str, norm: float, **recipe) -> float:
    """RLModule.training_step on the fixture's two sequences (a prompt token first), with the
    policy's own logprobs as prev_logprobs (ratio 1) and ``norm`` as the step's normaliser."""
    from tq_plugin.config import PackingConfig, RecipeConfig
    from tq_plugin.data_plane import (
        ADVANTAGES,
        GENERATION_LOGPROBS,
        INPUT_IDS,
        INPUT_LENGTHS,
        PREV_LOGPROBS,
        SAMPLE_MASK,
        TOKEN_MASK,
    )
    from tq_plugin.data_plane import REFERENCE_POLICY_LOGPROBS as REF_LOGPROBS
    from tq_plugin.rl.training.module import RLModule

    rc = RecipeConfig(algorithm="grpo", loss_type=loss_type, **recipe)
    m = RLModule(policy=_Uniform(), value=None, recipe=rc, packing=PackingConfig())
    m.loss_norm = norm
    mask = torch.cat([torch.zeros(2, 1), MASK], dim=1)
    lp = torch.full((2, 5), -math.log(4.0)) * mask
    td = {INPUT_IDS: torch.zeros(2, 5, dtype=torch.int64), INPUT_LENGTHS: torch.tensor([2, 4]),
          TOKEN_MASK: mask, SAMPLE_MASK: torch.ones(2), PREV_LOGPROBS: lp,
          GENERATION_LOGPROBS: lp, ADVANTAGES: torch.cat([torch.zeros(2, 1), ADV], dim=1),
          REF_LOGPROBS: (lp - 0.5) * mask}
    return float(m.training_step(td, 0)["loss"].detach())


def test_the_training_step_calls_the_loss_types_aggregation():
    assert _module_loss("grpo", norm=2.0) == pytest.approx(-1.5)
    assert _module_loss("dapo", norm=4.0) == pytest.approx(-1.25)
    assert _module_loss("dr_grpo", norm=8.0) == pytest.approx(-0.625)


def test_the_training_step_adds_beta_times_the_reference_kl():
    # log pi_ref = log pi - 0.5 on every action token: k3 = e^-0.5 + 0.5 - 1 per token.
    k3 = math.exp(-0.5) - 0.5
    got = _module_loss("dapo", norm=4.0, beta=0.1)
    assert got == pytest.approx(-1.25 + 0.1 * k3)

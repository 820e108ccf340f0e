"""The RL objective pinned to numbers worked out by hand (issue 20).

Every expected value here comes from the formula's definition, written out in this file (or
in the comments, as arithmetic), never from calling the estimator or loss under test on other
inputs. The loss is computed by ``RLModule.training_step`` itself on tables of logits and
values chosen so that each token's ratio, advantage and value are known exactly: a stand-in
policy returns ``table[ids[:, 0]]``, so the first token of a row names its table row and a
microbatch of any rows finds its own.

The last two tests train PPO and GRPO a few optimizer steps through Lightning on a fixed batch
and compare the parameters with a plain PyTorch loop written from the equations below.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from tq_plugin.config import PackingConfig, RecipeConfig
from tq_plugin.data_plane import (
    ADVANTAGES,
    GENERATION_LOGPROBS,
    INPUT_IDS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    RETURNS,
    SAMPLE_MASK,
    TOKEN_MASK,
    VALUES,
    KVBatchMeta,
)
from tq_plugin.lightning.module import MICROBATCH_INFO
from tq_plugin.rl.algorithms.advantages import gae, group_relative, turn_end_rewards, whiten
from tq_plugin.rl.training.callbacks import RLStepCallback
from tq_plugin.rl.training.metrics import rl_metrics
from tq_plugin.rl.training.module import RLModule
from tq_plugin.rl.training.step_record import RL_STEP

LN4 = math.log(4.0)


# ---------------------------------------------------------------- advantage estimators
def test_group_relative_normalises_each_group_by_its_own_mean_and_std():
    # Three groups of four: different means, different spreads, and a constant group.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 7.0, 9.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_relative(rewards, group_size=4)
    # Group 1: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.577350 -> +-0.5 / 0.577350.
    # Group 2: mean 6, deviations -3 -1 1 3, sample std sqrt(20 / 3) = 2.581989.
    # Group 3: every reward equals the mean: advantage 0 (not 0 / 0).
    s1, s2 = math.sqrt(1.0 / 3.0), math.sqrt(20.0 / 3.0)
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1,
                -3 / s2, -1 / s2, 1 / s2, 3 / s2, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_gae_and_returns_on_a_short_trajectory():
    # Row 0: actions at positions 1, 2 and 4 (3 is an environment token), gamma 0.9, lambda 0.8.
    # Values off the actions are junk (9.0) and must not enter.
    mask = torch.tensor([[0, 1, 1, 0, 1, 0.0], [0, 0, 1, 1, 0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 9.0, 0.7, 9.0], [9.0, 9.0, 0.2, 0.4, 9.0, 9.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta = r + 0.9 V' - V: 0.9*0.6-0.5 = 0.04, 0.9*0.7-0.6 = 0.03, 1-0.7 = 0.3.
    # A2 = 0.3, A1 = 0.03 + 0.72*0.3 = 0.246, A0 = 0.04 + 0.72*0.246 = 0.21712.
    torch.testing.assert_close(adv[0], torch.tensor([0, 0.21712, 0.246, 0, 0.3, 0]))
    torch.testing.assert_close(ret[0], torch.tensor([0, 0.71712, 0.846, 0, 1.0, 0]))
    # Row 1, same gamma/lambda: delta 0.9*0.4-0.2 = 0.16, 1-0.4 = 0.6; A = 0.16+0.72*0.6, 0.6.
    torch.testing.assert_close(adv[1], torch.tensor([0, 0, 0.592, 0.6, 0, 0]))
    torch.testing.assert_close(ret[1], torch.tensor([0, 0, 0.792, 1.0, 0, 0]))


def test_gae_with_gamma_and_lambda_one_is_the_return_minus_the_value():
    mask = torch.tensor([[1, 1, 1.0]])
    adv, ret = gae(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[0.2, 0.4, 1.0]]), mask,
                   gamma=1.0, lam=1.0)
    # Reward to go 3, 3, 2 minus V.
    torch.testing.assert_close(adv, torch.tensor([[2.8, 2.6, 1.0]]))
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 2.0]]))


def test_whiten_uses_the_masked_positions_population_std():
    values = torch.tensor([[1.0, 2.0, 7.0], [3.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = whiten(values, mask)
    # Masked values 1 2 3: mean 2, population std sqrt(2/3); the others are left as they are.
    z = 1.0 / math.sqrt(2.0 / 3.0)
    torch.testing.assert_close(out, torch.tensor([[-z, 0.0, 7.0], [z, 5.0, 5.0]]),
                               atol=1e-5, rtol=1e-5)


def test_turn_end_rewards_of_three_turns_and_a_turn_at_the_row_end():
    mask = torch.tensor([[1, 0, 1, 1, 0, 1.0], [0, 1, 1, 1, 0, 0.0]])
    placed = turn_end_rewards(mask, torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.6, 0.7]]))
    torch.testing.assert_close(placed, torch.tensor([[0.1, 0, 0, 0.2, 0, 0.3],
                                                     [0, 0, 0, 0.5, 0, 0]]))


# ---------------------------------------------------------------- the loss on known inputs
class RowTable(nn.Module):
    """``table[ids[:, 0]]``: logits ``[B, S, V]`` (or values ``[B, S]``) chosen per row."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.table[input_ids[:, 0]]


def _module(policy: nn.Module, value: nn.Module | None = None, *, correct_is: bool = False,
            **recipe: object) -> RLModule:
    rc = RecipeConfig(algorithm="ppo" if value is not None else "grpo", **recipe)
    return RLModule(policy=policy, value=value, recipe=rc, packing=PackingConfig(),
                    correct_is=correct_is)


def _batch(ids, mask, sample_mask, old, adv, **extra) -> dict[str, torch.Tensor]:
    ids = torch.tensor(ids)
    old = torch.as_tensor(old, dtype=torch.float32)
    return {INPUT_IDS: ids, INPUT_LENGTHS: torch.full((ids.shape[0],), ids.shape[1]),
            TOKEN_MASK: torch.tensor(mask), SAMPLE_MASK: torch.tensor(sample_mask),
            PREV_LOGPROBS: old, GENERATION_LOGPROBS: extra.pop("gen", old),
            ADVANTAGES: torch.as_tensor(adv, dtype=torch.float32), **extra}


# Zero logits over V = 4: every token's logprob is -ln 4 and its dlp/dlogit is 1[k = id] - 1/4.
# (advantage, ratio) per action token, clip_eps 0.2; the unclipped ratio*A vs the clamped one:
#   a (+1, 1.5): min(1.5, 1.2)   = 1.2   -> -1.2   clipped: no gradient
#   b (+1, 0.5): min(0.5, 0.8)   = 0.5   -> -0.5
#   c (-1, 1.5): min(-1.5, -1.2) = -1.5  -> +1.5
#   d (-1, 0.5): min(-0.5, -0.8) = -0.8  -> +0.8   clipped below 1 - eps: no gradient
#   e (+2, 1.1): inside the range        -> -2.2
#   f (-0.5, 0.9): inside the range      -> +0.45
# Row 2 is a dropped sample (sample_mask 0): its huge terms must count nowhere.
TOKENS = {(0, 1): (1.0, 1.5), (0, 2): (1.0, 0.5), (0, 3): (-1.0, 1.5), (0, 4): (-1.0, 0.5),
          (1, 1): (2.0, 1.1), (1, 2): (-0.5, 0.9)}
PG_TERMS = {(0, 1): -1.2, (0, 2): -0.5, (0, 3): 1.5, (0, 4): 0.8, (1, 1): -2.2, (1, 2): 0.45}
CLIPPED = {(0, 1), (0, 4)}  # the clamped term is the one min() picks: no gradient
RATIO_CHANGED = {(0, 1), (0, 2), (0, 3), (0, 4)}  # clamp(r) != r


def _policy_batch():
    ids = [[0, 1, 2, 3, 0], [1, 1, 2, 0, 0], [2, 1, 1, 1, 1]]
    mask = [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    old = torch.full((3, 5), -LN4)
    adv = torch.zeros(3, 5)
    for (b, t), (a, r) in TOKENS.items():
        old[b, t] = -LN4 - math.log(r)  # so that exp(lp - old) = r
        adv[b, t] = a
    old[2, 1:] = -LN4 - math.log(3.0)
    adv[2, 1:] = 100.0
    return _batch(ids, mask, [1, 1, 0], old, adv), ids


def test_clipped_policy_loss_each_sign_and_each_side_of_the_clip():
    policy = RowTable(torch.zeros(3, 5, 4))
    m = _module(policy, clip_eps=0.2)
    m.loss_norm = 6.0
    td, ids = _policy_batch()
    loss = m.training_step(td, 0)["loss"]
    assert float(loss.detach()) == pytest.approx(sum(PG_TERMS.values()) / 6.0, rel=1e-5)  # -1.15 / 6
    loss.backward()
    grad = policy.table.grad
    for (b, t), (a, r) in TOKENS.items():
        dlp = 0.0 if (b, t) in CLIPPED else -a * r / 6.0  # d(-r A / N) / d lp = -r A / N
        for k in range(4):
            expected = dlp * ((1.0 if k == ids[b][t] else 0.0) - 0.25)
            assert float(grad[b, t - 1, k]) == pytest.approx(expected, abs=1e-6), (b, t, k)
    assert float(grad[2].abs().max()) == 0.0  # the dropped sample
    figures = rl_metrics(m._mb_stats, 1)
    assert figures["clipfrac"] == pytest.approx(len(RATIO_CHANGED) / 6.0)
    # approx KL: mean of r - 1 - ln r over the six action tokens.
    kl = sum(r - 1.0 - math.log(r) for _, r in TOKENS.values()) / 6.0
    assert figures["approx_kl"] == pytest.approx(kl, rel=1e-5)  # 0.0975691


def _boundary_batch(ratio: float):
    """One action token whose float32 ratio exp(lp - old) is exactly float32(ratio)."""
    lp = torch.log_softmax(torch.zeros(4), dim=-1)[1]  # -ln 4, the zero table's logprob
    target = torch.tensor(ratio)
    old = lp - torch.log(target)
    for _ in range(64):  # walk old by ulps until the ratio lands on the float32 value
        got = (lp - old).exp()
        if got == target:
            break
        old = torch.nextafter(old, old + (1 if got > target else -1))
    assert (lp - old).exp() == target
    return _one_token(float(old))


def _one_token(old: float):
    return _batch([[0, 1]], [[0, 1]], [1], [[0.0, old]], [[0.0, 1.0]])


def test_clipfrac_counts_the_tokens_the_clamp_changed_not_ratios_near_the_bound():
    # float32(1.2) - 1 = 0.2000000477 > 0.2, yet clamp(r, 0.8, 1.2) leaves r as it is.
    m = _module(RowTable(torch.zeros(1, 2, 4)), clip_eps=0.2)
    m.training_step(_boundary_batch(1.2), 0)
    assert m._mb_stats["clipped_tokens"] == 0.0
    for ratio, clipped in ((1.21, 1.0), (0.81, 0.0), (0.79, 1.0)):
        m.training_step(_one_token(-LN4 - math.log(ratio)), 0)
        assert m._mb_stats["clipped_tokens"] == clipped, ratio


def test_entropy_term_and_metric():
    # Row 0's first action sees logits [ln 3, 0, 0, 0]: p = 1/2, 1/6, 1/6, 1/6, entropy
    # 0.5 ln 2 + 0.5 ln 6; every other action sees uniform logits, entropy ln 4.
    table = torch.zeros(2, 5, 4)
    table[0, 0, 0] = math.log(3.0)
    policy = RowTable(table)
    m = _module(policy, entropy_coef=0.5)
    m.loss_norm = 6.0
    ids = [[0, 1, 2, 3, 0], [1, 1, 2, 0, 0]]
    old = torch.full((2, 5), -LN4)
    old[0, 1] = -math.log(6.0)  # id 1 under p = 1/6: ratio 1, advantages 0 -> no policy term
    td = _batch(ids, [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]], [1, 1], old, torch.zeros(2, 5))
    loss = m.training_step(td, 0)["loss"]
    h = [0.5 * math.log(2.0) + 0.5 * math.log(6.0)] + [LN4] * 6
    assert float(loss.detach()) == pytest.approx(-0.5 * sum(h) / 6.0, rel=1e-5)
    assert rl_metrics(m._mb_stats, 1)["entropy"] == pytest.approx(sum(h) / 7.0, rel=1e-5)


# (v, v_old, return) per action token, value_clip_eps 0.2; 0.5 * max(unclipped, clipped):
#   (0.5, 0, 1):   (0.5)^2 = .25 vs v_clip 0.2: (0.8)^2 = .64  -> .32    clipped: no gradient
#   (0.1, 0, 1):   inside                       (0.9)^2 = .81  -> .405   dL/dv = -0.9
#   (1.3, 1, 1):   (0.3)^2 = .09 vs v_clip 1.2: (0.2)^2 = .04  -> .045   dL/dv = 0.3
#   (-0.5, 0, -1): (0.5)^2 = .25 vs v_clip -0.2: (0.8)^2 = .64 -> .32    no gradient
#   (1.5, 1, 0):   2.25 vs v_clip 1.2: 1.44                    -> 1.125  dL/dv = 1.5
#   (0.9, 1, 0.8): inside                       (0.1)^2 = .01  -> .005   dL/dv = 0.1
VALUE_TOKENS = {(0, 1): (0.5, 0.0, 1.0, 0.32, 0.0), (0, 2): (0.1, 0.0, 1.0, 0.405, -0.9),
                (0, 3): (1.3, 1.0, 1.0, 0.045, 0.3), (0, 4): (-0.5, 0.0, -1.0, 0.32, 0.0),
                (1, 1): (1.5, 1.0, 0.0, 1.125, 1.5), (1, 2): (0.9, 1.0, 0.8, 0.005, 0.1)}


def test_clipped_value_loss():
    values = torch.zeros(2, 5)
    old_v, ret = torch.zeros(2, 5), torch.zeros(2, 5)
    for (b, t), (v, o, r, _, _) in VALUE_TOKENS.items():
        values[b, t - 1] = v  # the value head's output before token t is V(s_t)
        old_v[b, t], ret[b, t] = o, r
    value = RowTable(values)
    m = _module(RowTable(torch.zeros(2, 5, 4)), value, vf_coef=0.5, value_clip_eps=0.2)
    m.loss_norm = 6.0
    old = torch.full((2, 5), -LN4)
    td = _batch([[0, 1, 2, 3, 0], [1, 1, 2, 0, 0]], [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]], [1, 1],
                old, torch.zeros(2, 5), **{VALUES: old_v, RETURNS: ret})
    loss = m.training_step(td, 0)["loss"]
    total = sum(x[3] for x in VALUE_TOKENS.values())  # 2.22
    assert m._mb_stats["value_loss"] == pytest.approx(total / 6.0, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(0.5 * total / 6.0, rel=1e-5)
    loss.backward()
    for (b, t), (*_, dv) in VALUE_TOKENS.items():
        assert float(value.table.grad[b, t - 1]) == pytest.approx(0.5 * dv / 6.0, abs=1e-6)


# ---------------------------------------------------------------- normalisation
def _rank_meta(loss_norm: float) -> KVBatchMeta:
    return KVBatchMeta(partition_id="train", task_name="train", sample_ids=["a"], extra_info={
        MICROBATCH_INFO: {"step": 0}, RL_STEP: {"loss_norm": loss_norm, "rewards": [0.0]}})


def _grad_of(rows: list[int], world: int) -> tuple[float, torch.Tensor]:
    """The loss and table gradient of ``rows`` as one rank of ``world`` trains them, its loss
    normalizer set by the recipe's step callback from the step's 6 action tokens."""
    td_all, _ = _policy_batch()
    td = {k: v[rows] for k, v in td_all.items()}
    policy = RowTable(torch.zeros(3, 5, 4))
    m = _module(policy, clip_eps=0.2)
    m.dp_meta = _rank_meta(6.0)
    callback = RLStepCallback(metrics=None, rollouts=None, dp_callback=None,
                              write_artifacts=lambda *a, **k: None)
    callback.step = 0  # the step is under way: only the normalizer is set
    callback.on_train_batch_start(SimpleNamespace(world_size=world), m, None, 0)
    loss = m.training_step(td, 0)["loss"]
    loss.backward()
    return float(loss.detach()), policy.table.grad


def test_token_mean_over_microbatches_and_ranks():
    whole_loss, whole = _grad_of([0, 1, 2], world=1)
    assert whole_loss == pytest.approx(-1.15 / 6.0, rel=1e-5)
    # Two microbatches of one rank: losses and gradients add up to the global batch's.
    parts = [_grad_of(rows, world=1) for rows in ([0], [1, 2])]
    assert sum(p[0] for p in parts) == pytest.approx(whole_loss, rel=1e-5)
    torch.testing.assert_close(parts[0][1] + parts[1][1], whole)
    # Two ranks, one shard each: DDP averages their gradients, which is the one-process one.
    ranks = [_grad_of(rows, world=2) for rows in ([0], [1, 2])]
    torch.testing.assert_close((ranks[0][1] + ranks[1][1]) / 2, whole)


# ---------------------------------------------------------------- end to end
class Bigram(nn.Module):
    """Logits (or a value) from the current token and its position: small, and not project code."""

    def __init__(self, vocab: int, seq: int, out: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, out)
        self.pos = nn.Embedding(seq, out)
        self.out = out
        nn.init.normal_(self.tok.weight, std=0.5)
        nn.init.normal_(self.pos.weight, std=0.5)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        return x.squeeze(-1) if self.out == 1 else x


class FixedBatchModule(RLModule):
    """The module trained on plain tensor batches: no step metas, so no per-microbatch books."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


V, S, STEPS = 6, 6, 4
IDS = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 2, 2, 1, 5, 0], [1, 3, 4, 4, 0, 0],
                    [1, 3, 5, 2, 1, 3]])
MASK = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0],
                     [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
REWARDS = torch.tensor([1.0, 0.25, 0.0, 0.75])


def ref_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log pi(ids[t] | ids[<t]) at t, from logits at t - 1 (0 at t = 0)."""
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)


def ref_advantages_ppo(values: torch.Tensor, gamma: float, lam: float):
    """The reward on each row's last action; GAE by the backward recursion; then whitened."""
    adv, ret = torch.zeros_like(values), torch.zeros_like(values)
    for b in range(IDS.shape[0]):
        steps = [t for t in range(S) if MASK[b, t] > 0]
        running = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            r = float(REWARDS[b]) if i == len(steps) - 1 else 0.0
            v_next = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
            running = r + gamma * v_next - float(values[b, t]) + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + float(values[b, t])
    sel = adv[MASK > 0]
    mean, std = sel.mean(), (sel - sel.mean()).pow(2).mean().sqrt()
    return torch.where(MASK > 0, (adv - mean) / std, adv), ret


def ref_advantages_grpo(group: int) -> torch.Tensor:
    out = torch.zeros(IDS.shape[0])
    for g in range(0, IDS.shape[0], group):
        r = REWARDS[g:g + group]
        mean = r.sum() / group
        std = ((r - mean).pow(2).sum() / (group - 1)).sqrt()
        out[g:g + group] = (r - mean) / std
    return out[:, None] * MASK


def _fit(module: RLModule, td: dict[str, torch.Tensor]) -> None:
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader([td] * STEPS, batch_size=None)
    trainer.fit(module, train_dataloaders=loader)


def _reference_update(policy, value, *, old_lp, gen_lp, adv, old_v, ret, rc):
    """STEPS Adam steps on the fixed batch, written from the equations; grads clipped to norm 1."""
    groups = [{"params": list(policy.parameters()), "lr": rc.lr}]
    if value is not None:
        groups.append({"params": list(value.parameters()), "lr": rc.value_lr})
    opt = torch.optim.Adam(groups)
    n = MASK.sum()
    w = torch.minimum((old_lp - gen_lp).exp(), torch.tensor(rc.is_cap))
    clipped_any = False
    for _ in range(STEPS):
        logits = policy(IDS)
        lp = ref_logprobs(logits, IDS)
        ratio = (lp - old_lp).exp()
        lo, hi = 1 - rc.clip_eps, 1 + rc.clip_eps
        clipped_any |= bool((((ratio < lo) | (ratio > hi)) & (MASK > 0)).any())
        surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        loss = -(w * surrogate * MASK).sum() / n
        p = torch.softmax(logits[:, :-1], dim=-1)
        h = -(p * p.log()).sum(-1)
        loss = loss - rc.entropy_coef * (h * MASK[:, 1:]).sum() / n
        if value is not None:
            v = torch.cat([torch.zeros(IDS.shape[0], 1), value(IDS)[:, :-1]], dim=1)
            v_clip = old_v + (v - old_v).clamp(-rc.value_clip_eps, rc.value_clip_eps)
            v_loss = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
            loss = loss + rc.vf_coef * (v_loss * MASK).sum() / n
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for g in groups for q in g["params"]], 1.0)
        opt.step()
    assert clipped_any, "the steps never left the clip range: the test would not pin the clip"


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4, msg=name)


def test_ppo_update_matches_the_reference_loop():
    torch.manual_seed(0)
    policy, value = Bigram(V, S, V), Bigram(V, S, 1)
    ref_policy, ref_value = copy.deepcopy(policy), copy.deepcopy(value)
    rc = {"lr": 0.05, "value_lr": 0.05, "clip_eps": 0.2, "value_clip_eps": 0.2, "vf_coef": 0.5,
          "entropy_coef": 0.01, "gamma": 0.9, "gae_lambda": 0.8}
    with torch.no_grad():
        old_lp = ref_logprobs(policy(IDS), IDS) * MASK
        old_v = torch.cat([torch.zeros(4, 1), value(IDS)[:, :-1]], dim=1) * MASK
    # The project's side: its estimators write the columns, its module trains on them.
    adv, ret = gae(turn_end_rewards(MASK, REWARDS[:, None]), old_v, MASK,
                   gamma=rc["gamma"], lam=rc["gae_lambda"])
    module = FixedBatchModule(policy=policy, value=value, packing=PackingConfig(),
                              recipe=RecipeConfig(algorithm="ppo", **rc))
    module.loss_norm = float(MASK.sum())
    td = _batch(IDS.tolist(), MASK.tolist(), [1, 1, 1, 1], old_lp, whiten(adv, MASK),
                **{VALUES: old_v, RETURNS: ret})
    _fit(module, td)
    ref_adv, ref_ret = ref_advantages_ppo(old_v, rc["gamma"], rc["gae_lambda"])
    _reference_update(ref_policy, ref_value, old_lp=old_lp, gen_lp=old_lp, adv=ref_adv,
                      old_v=old_v, ret=ref_ret, rc=module.rc)
    _assert_same_params(policy, ref_policy)
    _assert_same_params(value, ref_value)


def test_grpo_update_with_is_correction_matches_the_reference_loop():
    torch.manual_seed(1)
    policy = Bigram(V, S, V)
    ref_policy = copy.deepcopy(policy)
    with torch.no_grad():
        old_lp = ref_logprobs(policy(IDS), IDS) * MASK
    # The engine's logprobs differ from the trainer's: token_tis weights min(pi_old/pi_gen, 1.5).
    gen_lp = old_lp + torch.linspace(-0.6, 0.6, IDS.numel()).view_as(old_lp) * MASK
    recipe = RecipeConfig(algorithm="grpo", group_size=2, lr=0.05, clip_eps=0.2,
                          is_correction={"mode": "token_tis", "cap": 1.5})
    module = FixedBatchModule(policy=policy, value=None, packing=PackingConfig(), recipe=recipe,
                              correct_is=True)
    module.loss_norm = float(MASK.sum())
    adv = group_relative(REWARDS, 2)[:, None] * MASK
    _fit(module, _batch(IDS.tolist(), MASK.tolist(), [1, 1, 1, 1], old_lp, adv, gen=gen_lp))
    _reference_update(ref_policy, None, old_lp=old_lp, gen_lp=gen_lp,
                      adv=ref_advantages_grpo(2), old_v=None, ret=None, rc=module.rc)
    _assert_same_params(policy, ref_policy)

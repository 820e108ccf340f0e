"""The recipes' building blocks: packed vs padded forward, advantage estimators, task scoring."""

from __future__ import annotations

import torch

from tq_plugin.rl.algorithms.advantages import gae, group_relative, turn_end_rewards
from tq_plugin.rl.models.tiny import TinyTransformer, token_logprobs
from tq_plugin.rl.tasks.pattern import EOS, NUM_SPECIAL, PatternTask


def test_packed_row_computes_what_padded_rows_compute():
    torch.manual_seed(0)
    model = TinyTransformer(20, n_layers=2)
    lengths = [5, 9, 3]
    rows = [torch.randint(0, 20, (n,)) for n in lengths]
    padded = model(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True))
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    position = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(torch.cat(rows)[None], position_ids=position, segment_ids=segment)
    expected = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    torch.testing.assert_close(packed[0], expected)


def test_output_restriction_keeps_logprobs_finite():
    model = TinyTransformer(12, output_token_ids=[2, 7, 8])
    ids = torch.tensor([[1, 7, 3, 8]])
    lp = token_logprobs(model(ids), ids)
    assert torch.isfinite(lp).all()
    assert lp[0, 1] > -10 and lp[0, 2] < -1000  # an allowed token vs a never-emitted one


def _gae_reference(r, v, gamma, lam):
    adv, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nxt = v[t + 1] if t + 1 < len(r) else 0.0
        running = r[t] + gamma * nxt - v[t] + gamma * lam * running
        adv[t] = running
    return adv


def test_gae_runs_over_generated_tokens_only():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0.0], [0, 0, 1, 1, 1, 0, 0, 0.0]])
    values = torch.rand(2, 8)
    rewards = torch.rand(2, 8) * mask
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for row in range(2):
        pos = mask[row].nonzero().flatten().tolist()
        ref = _gae_reference(rewards[row, pos].tolist(), values[row, pos].tolist(), 0.9, 0.8)
        torch.testing.assert_close(adv[row, pos], torch.tensor(ref))
        torch.testing.assert_close(ret[row, pos], adv[row, pos] + values[row, pos])
    assert (adv[mask == 0] == 0).all()


def test_turn_rewards_land_on_each_turns_last_generated_token():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0.0]])
    placed = turn_end_rewards(mask, torch.tensor([[0.25, 0.75]]))
    assert placed.tolist() == [[0, 0, 0.25, 0, 0, 0, 0, 0.75, 0]]


def test_group_relative_advantages_are_zero_mean_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4, 0.6, 0.8])
    adv = group_relative(rewards, group_size=4).view(2, 4)
    torch.testing.assert_close(adv.mean(1), torch.zeros(2), atol=1e-6, rtol=0)
    assert adv[0, 0] > 0 > adv[0, 1]


def test_pattern_task_scores_matches_over_the_longer_length():
    task = PatternTask(num_symbols=6)
    s = NUM_SPECIAL
    targets = torch.tensor([[s, s + 1, s + 2], [s + 3, s + 4, 0]])
    target_lens = torch.tensor([3, 2])
    responses = torch.tensor([[s, s + 1, s + 2, s], [s + 3, 0, 0, 0]])
    scores = task.score(responses, torch.tensor([3, 4]), targets, target_lens)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.25]))
    assert EOS in task.output_token_ids and task.vocab_size == NUM_SPECIAL + 6 + task.max_len


def test_media_episode_hides_the_symbol_from_the_text():
    task = PatternTask(media=True)
    episode = task.sample(1, torch.Generator().manual_seed(0))[0]
    assert episode.target[0] not in episode.prompt
    assert episode.image["imgs"].shape == (1, 1, task.patch_dim)
    assert episode.image["imgs_sizes"].tolist() == [[task.patch_size, task.patch_size]]

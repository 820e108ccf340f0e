"""The trainer's one route to the policy's logprobs (``protocol.score_tokens``): a model that
scores tokens from its hidden states (tiny, HF) gives the plain formula's logprobs, entropy and
gradients at the positions that carry a loss, 0 elsewhere; a logits-only model goes through the
same chunked reduction; ``check_model`` refuses a model whose two routes disagree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tq_plugin.rl.models.protocol import (
    ModelInterfaceError,
    TokenScoring,
    check_model,
    score_tokens,
    scores_tokens,
)
from tq_plugin.rl.models.tiny import TinyTransformer

V = 23


def plain(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0):
    """The formula the trainer used before: ``[B, S]``, position 0 gets 0."""
    lsm = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    lp = lsm.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    return F.pad(lp, (1, 0)), F.pad(ent, (1, 0))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 9), generator=g)
    mask = torch.zeros(3, 9)
    mask[0, 4:9] = 1
    mask[1, 2:6] = 1
    mask[2, 6:8] = 1  # prompt positions carry no loss
    return ids, mask


def models():
    torch.manual_seed(0)
    out = [TinyTransformer(V, d_model=16, n_heads=2, n_layers=2, output_token_ids=list(range(20)))]
    try:
        from tq_plugin.rl.models.hf import HFCausalLM
    except ImportError:
        return out
    out.append(HFCausalLM(V, d_model=32, n_heads=2, n_layers=1, max_seq_len=16,
                          output_token_ids=list(range(20))))
    return out


@pytest.mark.parametrize("model", models(), ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_from_hidden_states_equals_the_plain_formula(model, temperature):
    assert scores_tokens(model)
    ids, mask = batch()
    adv = torch.randn(3, 9, generator=torch.Generator().manual_seed(1))
    ref_lp, ref_ent = plain(model(ids), ids, temperature)
    ref_loss = -(ref_lp * adv * mask).sum() + 0.1 * (ref_ent * mask).sum()
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()), allow_unused=True)

    scoring = TokenScoring(mask=mask > 0, temperature=temperature, chunk_tokens=4,
                           with_entropy=True, entropy_grad=True)
    lp, ent = score_tokens(model, ids, scoring)
    on = mask > 0
    torch.testing.assert_close(lp[on], ref_lp[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[on], ref_ent[on], atol=1e-5, rtol=1e-5)
    assert not lp[~on].any() and not ent[~on].any()  # only the loss positions are scored
    loss = -(lp * adv * mask).sum() + 0.1 * (ent * mask).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads, strict=True):
        if b is None:
            assert a is None or not a.any(), name
            continue
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_is_a_detached_metric_unless_the_loss_uses_it():
    model = models()[0]
    ids, mask = batch()
    lp, ent = score_tokens(model, ids, TokenScoring(mask=mask > 0, with_entropy=True))
    assert lp.requires_grad and not ent.requires_grad
    _, ent = score_tokens(model, ids, TokenScoring(mask=mask > 0, with_entropy=True,
                                                   entropy_grad=True))
    assert ent.requires_grad
    lp, ent = score_tokens(model, ids, TokenScoring(mask=mask > 0))
    assert ent is None


class LogitsOnly(nn.Module):
    """A model that returns logits and knows nothing of scoring."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyTransformer(V, d_model=16, n_heads=2, n_layers=1)

    def forward(self, input_ids, *, position_ids=None, segment_ids=None, image_patches=None):
        return self.inner(input_ids, position_ids=position_ids, segment_ids=segment_ids)


def test_a_logits_only_model_goes_through_the_same_chunked_reduction():
    model = LogitsOnly()
    assert not scores_tokens(model)
    ids, mask = batch()
    lp, ent = score_tokens(model, ids, TokenScoring(mask=mask > 0, chunk_tokens=3,
                                                    with_entropy=True))
    ref_lp, ref_ent = plain(model(ids), ids)
    on = mask > 0
    torch.testing.assert_close(lp[on], ref_lp[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[on], ref_ent[on], atol=1e-5, rtol=1e-5)
    check_model(model, role="policy", vocab_size=V, layout="packed")


class WrongScores(TinyTransformer):
    """Scores tokens from another projection than its logits'."""

    def forward(self, input_ids, *, position_ids=None, segment_ids=None, image_patches=None,
                score=None):
        if score is None:
            return super().forward(input_ids, position_ids=position_ids, segment_ids=segment_ids)
        lp, ent = super().forward(input_ids, score=score)
        return lp * 0.5, ent


def test_check_model_refuses_scores_that_are_not_the_logits():
    torch.manual_seed(0)
    with pytest.raises(ModelInterfaceError, match=r"forward\(score=\.\.\.\) must give the "
                                                  r"logprobs of the logits forward returns"):
        check_model(WrongScores(V, d_model=16, n_heads=2, n_layers=1), role="policy",
                    vocab_size=V, layout="padded")


def test_the_packed_layout_scores_each_segment_alone():
    model = models()[0].eval()
    from tq_plugin.lightning.layout import PackedIndex

    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([6, 4])
    index = PackedIndex(lengths)
    real = torch.arange(6) < lengths.unsqueeze(1)
    row = ids[real].unsqueeze(0)
    mask = torch.ones_like(row, dtype=torch.bool)
    mask[0, index.position_ids == 0] = False  # a segment's first token is predicted by nothing
    packed, _ = score_tokens(model, row, TokenScoring(mask=mask),
                             position_ids=index.position_ids.unsqueeze(0),
                             segment_ids=index.segment_ids.unsqueeze(0))
    ref, _ = plain(model(ids), ids)
    torch.testing.assert_close(packed[0], torch.where(real[real], ref[real], 0.0)
                               .masked_fill(~mask[0], 0.0), atol=1e-5, rtol=1e-5)

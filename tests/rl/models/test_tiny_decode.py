"""``TinyTransformer.decode_step``, the native engine's KV-cached decoding: every step's logits
are the full forward's at the row's last token, whatever the left padding."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.rl.models.tiny import TinyTransformer
from tq_plugin.rollout.engine import SamplingParams
from tq_plugin.rollout.engines.native import cached_step, decode

V = 19
PROMPTS = [[1, 7, 14, 3], [1, 9, 3], [1, 8, 15, 3, 5, 3, 7]]


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(V, output_token_ids=[2, *range(7, 13)]).eval()


def test_each_cached_step_gives_the_full_forward_logits():
    model = _model()
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(width) >= width - torch.tensor([len(p) for p in PROMPTS])[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    rows, cache = [list(p) for p in PROMPTS], None
    for _ in range(4):
        last, cache = model.decode_step(ids, mask, positions, cache)
        with torch.no_grad():
            full = torch.stack([model(torch.tensor([r]))[0, -1] for r in rows])
        torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)
        tok = full.argmax(-1)
        rows = [r + [int(t)] for r, t in zip(rows, tok)]
        ids, positions = tok[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(len(PROMPTS), 1, dtype=mask.dtype)], dim=1)


def test_the_native_engine_samples_the_same_with_and_without_the_cache():
    model = _model()

    class NoCache(torch.nn.Module):  # the same model, seen without decode_step
        def __init__(self, inner: TinyTransformer) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
            return self.inner(input_ids, **kwargs)

    assert cached_step(model) is not None and cached_step(NoCache(model)) is None
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(),
                            allowed_token_ids=tuple(model.out_bias.eq(0).nonzero()[:, 0].tolist()))
    cached = decode(model, PROMPTS, params, seeds=[1, 2, 3])
    full = decode(NoCache(model), PROMPTS, params, seeds=[1, 2, 3])
    for a, b in zip(cached, full):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_the_value_model_has_no_decode_step():
    with pytest.raises(ValueError, match="decode_step is for the policy"):
        TinyTransformer(V, value_head=True).decode_step(
            torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
            torch.arange(2)[None], None)

"""The sampling controls (``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``) scored by the
trainer's chunked, vectorized path equal a brute-force reference (one position at a time, a
plain ``torch.softmax`` with explicit masking over a small vocabulary), in value and gradient;
the engines' sampler draws inside the kept set and reports the processed logprob, and a policy
sampled by the native engine is scored back to the same logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tq_plugin.rl.models.logprobs import (
    shifted_token_logprobs,
    shifted_token_logprobs_from_logits,
)
from tq_plugin.rl.models.protocol import TokenScoring
from tq_plugin.rl.models.tiny import TinyTransformer
from tq_plugin.rollout.engine import SamplingParams, sample_from
from tq_plugin.rollout.engines.native import decode
from tq_plugin.rollout.sampling import SamplingControls

V, H = 13, 6

CONTROLS = {
    "top_k": SamplingControls(top_k=4),
    "top_p": SamplingControls(top_p=0.7),
    "min_p": SamplingControls(min_p=0.2),
    "repetition_penalty": SamplingControls(repetition_penalty=1.7),
    "penalty_below_1": SamplingControls(repetition_penalty=0.6),
    "top_k+top_p": SamplingControls(top_k=5, top_p=0.8),
    "all": SamplingControls(top_k=6, top_p=0.85, min_p=0.05, repetition_penalty=1.3),
}


def reference_processed(z: torch.Tensor, seen: set[int], c: SamplingControls) -> torch.Tensor:
    """One position's processed log-distribution, the slow way: ``z [V]`` tempered logits
    (differentiable), ``seen`` the ids so far; vLLM's order (penalty, min-p, top-k, top-p)."""
    factor = torch.ones_like(z)
    for tok in seen:  # HF / vLLM: a positive logit is divided, a negative one multiplied
        factor[tok] = 1.0 / c.repetition_penalty if z[tok] > 0 else c.repetition_penalty
    z = z * factor
    keep = [True] * z.shape[0]
    probs = torch.softmax(z.detach(), -1).tolist()
    if c.min_p > 0:
        top = max(probs)
        keep = [k and p >= c.min_p * top for k, p in zip(keep, probs, strict=True)]
    if c.top_k:
        order = sorted(range(len(probs)), key=lambda i: -z[i].item())
        kth = z[order[c.top_k - 1]].item()
        keep = [k and z[i].item() >= kth for i, k in enumerate(keep)]
    if c.top_p < 1:
        kept = [i for i in range(len(keep)) if keep[i]]
        mass = torch.softmax(z.detach()[kept], -1).tolist()
        total = dict(zip(kept, mass, strict=True))
        for i in kept:  # kept when the mass strictly above it is below top_p
            above = sum(total[j] for j in kept if z[j].item() > z[i].item())
            keep[i] = above < c.top_p
    masked = z.masked_fill(~torch.tensor(keep), float("-inf"))
    return torch.log_softmax(masked, -1)


def reference(logits: torch.Tensor, ids: torch.Tensor, c: SamplingControls, temperature: float,
              starts: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, S]`` processed logprobs of ``ids[b, t]`` after position ``t - 1``, position by
    position; a packed row's sequences start where ``starts`` says (else at 0)."""
    b, s = ids.shape
    out = torch.zeros(b, s, dtype=logits.dtype)
    rows = []
    for i in range(b):
        for t in range(1, s):
            start = 0 if starts is None else int(starts[i, t - 1])
            seen = set(ids[i, start:t].tolist())
            lp = reference_processed(logits[i, t - 1] / temperature, seen, c)
            rows.append(((i, t), lp[ids[i, t]]))
    for (i, t), v in rows:
        out[i, t] = v
    return out


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 8, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 1.5
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (3, 8), generator=g)
    return hidden, weight, bias, ids


def _compare(got: torch.Tensor, want: torch.Tensor) -> None:
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), (got, want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", list(CONTROLS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scored_logprobs_equal_the_brute_force_reference(name, temperature):
    c = CONTROLS[name]
    hidden, weight, bias, ids = _case()
    logits = hidden @ weight.T + bias
    want = reference(logits, ids, c, temperature)
    want[:, 0] = 0.0
    got, _ = shifted_token_logprobs(hidden, ids, weight, bias, chunk_tokens=4,
                                    temperature=temperature, controls=c)
    _compare(got, want)
    got_l, _ = shifted_token_logprobs_from_logits(logits, ids, chunk_tokens=5,
                                                  temperature=temperature, controls=c)
    _compare(got_l, want)
    if name != "repetition_penalty" and name != "penalty_below_1":
        assert (~torch.isfinite(want)).any()  # the case does leave the kept set somewhere
    plain, _ = shifted_token_logprobs(hidden, ids, weight, bias, temperature=temperature)
    finite = torch.isfinite(want) & (torch.arange(8) > 0)
    assert not torch.allclose(got[finite], plain[finite])  # the processing changed the numbers


@pytest.mark.parametrize("name", ["top_p", "repetition_penalty", "all"])
def test_gradients_equal_the_brute_force_reference(name):
    """The kept set is a constant of the backward; the penalty's factor scales the gradient."""
    c = CONTROLS[name]
    hidden, weight, bias, ids = _case(1)
    weights = torch.randn(3, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = []
    for route in ("reference", "hidden", "logits"):
        h, w, b_ = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        if route == "reference":
            lp = reference(h @ w.T + b_, ids, c, 0.8)
        elif route == "hidden":
            lp, _ = shifted_token_logprobs(h, ids, w, b_, chunk_tokens=3, temperature=0.8,
                                           controls=c)
        else:
            lp, _ = shifted_token_logprobs_from_logits(h @ w.T + b_, ids, chunk_tokens=3,
                                                       temperature=0.8, controls=c)
        lp = lp.clone()
        lp[:, 0] = 0.0
        finite = torch.isfinite(lp)
        (torch.where(finite, lp, 0.0) * weights).sum().backward()
        grads.append((h.grad, w.grad, b_.grad))
    for got in grads[1:]:
        for g_got, g_want in zip(got, grads[0], strict=True):
            torch.testing.assert_close(g_got, g_want, rtol=1e-8, atol=1e-10)


def test_a_packed_row_penalises_only_its_own_sequence():
    """Two sequences back to back in one row: the second's seen tokens start at its own first
    position (``positions`` restart at 0), as two separate rows would see them."""
    c = CONTROLS["all"]
    hidden, weight, bias, ids = _case(3)
    logits = hidden @ weight.T + bias
    positions = torch.cat([torch.arange(3), torch.arange(5)]).unsqueeze(0)
    flat_ids = ids[:1]
    starts = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 3]])
    want = reference(logits[:1], flat_ids, c, 1.0, starts=starts)
    want[0, 0] = want[0, 3] = 0.0  # a segment's first token is not scored
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 0] = mask[0, 3] = False
    got, _ = shifted_token_logprobs(hidden[:1], flat_ids, weight, bias, mask=mask,
                                    controls=c, positions=positions)
    _compare(got, want)
    penalty = CONTROLS["repetition_penalty"]
    packed, _ = shifted_token_logprobs(hidden[:1], flat_ids, weight, bias, mask=mask,
                                       controls=penalty, positions=positions)
    unpacked, _ = shifted_token_logprobs(hidden[:1], flat_ids, weight, bias, mask=mask,
                                         controls=penalty)
    assert not torch.allclose(packed, unpacked)  # the second sequence's history differs


def test_no_controls_is_the_plain_path_bit_for_bit():
    hidden, weight, bias, ids = _case()
    plain, _ = shifted_token_logprobs(hidden, ids, weight, bias, temperature=0.7)
    off, _ = shifted_token_logprobs(hidden, ids, weight, bias, temperature=0.7,
                                    controls=SamplingControls())
    assert torch.equal(plain, off)
    g = torch.Generator().manual_seed(0)
    logits, u = torch.randn(5, V, generator=g), torch.rand(5, generator=g, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(sample_from(logits, 0.7, u),
                                                  sample_from(logits, 0.7, u, SamplingControls()),
                                                  strict=True))


@pytest.mark.parametrize("name", list(CONTROLS))
def test_the_engine_sampler_draws_inside_the_kept_set_with_the_processed_logprob(name):
    c = CONTROLS[name]
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, V, generator=g, dtype=torch.float64).float() * 2
    seen = torch.rand(64, V, generator=g) < 0.3
    u = torch.rand(64, generator=g, dtype=torch.float64)
    tok, lp = sample_from(logits, 0.9, u, c, seen)
    for i in range(64):
        want = reference_processed(logits[i].double() / 0.9,
                                   set(seen[i].nonzero().flatten().tolist()), c)
        assert math.isfinite(want[tok[i]].item())
        assert lp[i].item() == pytest.approx(want[tok[i]].item(), abs=1e-5)


class _NoCache(torch.nn.Module):
    """The tiny policy without its cached step: the native engine's full-forward loop."""

    def __init__(self, inner: TinyTransformer) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, **kwargs):
        return self.inner(input_ids, **kwargs)


@pytest.mark.parametrize("cached", [True, False], ids=["kv_cache", "full_forward"])
def test_the_native_engine_samples_what_the_trainer_scores_back(cached):
    """On one policy the engine's reported logprobs equal the trainer's processed scoring of
    the same tokens (the on-policy IS ratio is 1), and every sampled token is in the kept set."""
    torch.manual_seed(0)
    model = TinyTransformer(V, d_model=16, n_heads=2, n_layers=2).eval()
    sampler = model if cached else _NoCache(model)
    c = SamplingControls(top_k=6, top_p=0.8, min_p=0.02, repetition_penalty=1.4)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=c.top_k, top_p=c.top_p,
                            min_p=c.min_p, repetition_penalty=c.repetition_penalty)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = decode(sampler, prompts, params, seeds=[11, 12, 13])
    for prompt, comp in zip(prompts, out, strict=True):
        ids = torch.tensor([prompt + comp.token_ids])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt):] = True
        with torch.no_grad():
            lp, _ = model(ids, score=TokenScoring(mask=mask, temperature=0.8, controls=c))
        got = lp[0, len(prompt):]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.tensor(comp.logprobs), rtol=0, atol=1e-5)


def test_seen_from_prompts_marks_each_prompts_ids_and_ignores_ids_outside_the_vocabulary():
    from tq_plugin.rollout.sampling import seen_from_prompts

    prompts = [[3, 1, 3], [], [0, 9, -1, 12, 4], [7]]
    seen = seen_from_prompts(prompts, 10)
    expected = torch.zeros(4, 10, dtype=torch.bool)
    for i, p in enumerate(prompts):
        for t in p:
            if 0 <= t < 10:
                expected[i, t] = True
    assert torch.equal(seen, expected)
    assert seen_from_prompts([], 10).shape == (0, 10)
    assert not seen_from_prompts([[], []], 5).any()

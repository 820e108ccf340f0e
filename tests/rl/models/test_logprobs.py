"""tq_plugin.rl.models.logprobs: chunked logprobs/entropy equal the plain formula (values and
gradients) and never hold more than one chunk's [chunk, V]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from tq_plugin.rl.models.logprobs import (
    next_token_positions,
    shifted_token_logprobs,
    shifted_token_logprobs_from_logits,
    token_logprobs_from_hidden,
    token_logprobs_from_logits,
)


# ------------------------------------------------------------------ the plain formula (reference)
def plain(hidden, weight, bias, targets, temperature=1.0):
    """``log_softmax((h @ W.T + b).float() / T).gather``, and the entropy of the same softmax
    (float64 inputs stay float64: the truth other dtypes are held to)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if logits.dtype != torch.float64:
        logits = logits.float()
    lsm = torch.log_softmax(logits / temperature, dim=-1)
    return lsm.gather(1, targets.unsqueeze(1)).squeeze(1), -(lsm.exp() * lsm).sum(-1)


def plain_logits(logits, targets, temperature=1.0):
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lsm.gather(1, targets.unsqueeze(1)).squeeze(1), -(lsm.exp() * lsm).sum(-1)


def make(t=37, v=101, h=16, *, dtype=torch.float32, bias=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g)).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, b, targets


def grads(out_lp, out_ent, inputs, seed=1):
    """Gradients of a random weighted sum of the logprobs (and the entropy, when given)."""
    g = torch.Generator().manual_seed(seed)
    loss = (out_lp * torch.randn(out_lp.shape, generator=g)).sum()
    if out_ent is not None:
        loss = loss + (out_ent * torch.randn(out_ent.shape, generator=g)).sum()
    return torch.autograd.grad(loss, [x for x in inputs if x is not None], retain_graph=True)


def close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


# ------------------------------------------------------------------ values and gradients
@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_float32_values_and_gradients_equal_the_plain_formula(chunk, temperature, with_bias):
    hidden, weight, bias, targets = make(bias=with_bias, scale=3.0)
    inputs = (hidden, weight, bias)
    want_lp, want_ent = plain(hidden, weight, bias, targets, temperature)
    lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=chunk,
                                         temperature=temperature, with_entropy=True,
                                         entropy_grad=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (37,)
    close(lp, want_lp)
    close(ent, want_ent)
    for got, want in zip(grads(lp, ent, inputs), grads(want_lp, want_ent, inputs)):
        close(got, want)
    # logprobs alone (the usual loss): the entropy term is not in the gradient
    lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=chunk,
                                         temperature=temperature)
    assert ent is None
    for got, want in zip(grads(lp, None, inputs), grads(want_lp, None, inputs)):
        close(got, want)


def test_float64_is_computed_in_float64():
    hidden, weight, bias, targets = make(dtype=torch.float64)
    lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=5,
                                         with_entropy=True)
    want_lp, want_ent = plain(hidden, weight, bias, targets)
    assert lp.dtype == want_lp.dtype == torch.float64
    close(lp, want_lp, atol=1e-12, rtol=1e-12)
    close(ent, want_ent, atol=1e-12, rtol=1e-12)


def _err(a, truth):
    return float((a.detach().double() - truth.detach()).abs().max())


def test_bfloat16_gives_float32_as_accurate_as_the_plain_formula():
    hidden, weight, bias, targets = make(t=64, v=211, h=32, dtype=torch.bfloat16, scale=2.0)
    inputs = (hidden, weight, bias)
    # the truth: the same bf16 values, in float64
    exact = [x.detach().double().requires_grad_() for x in inputs]
    true_lp, true_ent = plain(*exact, targets)
    want_lp, want_ent = plain(hidden, weight, bias, targets)  # bf16 logits, upcast
    lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=10,
                                         with_entropy=True, entropy_grad=True)
    assert lp.dtype == ent.dtype == torch.float32
    # the plain formula's bf16 logits are off by up to ~1e-2 at this scale: same order here
    close(lp, want_lp, atol=5e-2, rtol=0)
    close(ent, want_ent, atol=5e-2, rtol=0)
    assert _err(lp, true_lp.detach()) <= _err(want_lp, true_lp.detach()) + 1e-3
    assert _err(ent, true_ent.detach()) <= _err(want_ent, true_ent.detach()) + 1e-3
    truth = grads(true_lp, true_ent, exact)
    got = grads(lp, ent, inputs)
    want = grads(want_lp, want_ent, inputs)
    for g, w, t in zip(got, want, truth):
        assert g.dtype == torch.bfloat16
        # float32 accumulation across chunks: at least as close to the truth as plain bf16
        assert _err(g, t) <= 1.5 * _err(w, t) + 1e-3, (_err(g, t), _err(w, t))


def test_autocast_bf16_gives_float32_logprobs_and_float32_gradients():
    """``trainer.precision=bf16-mixed``: float32 weights, a bf16 matmul, float32 results."""
    hidden, weight, bias, targets = make(t=40, v=97, scale=2.0)
    inputs = (hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=16)
        want, _ = plain(hidden, weight, bias, targets)
    # the truth: the matmul's bf16-rounded operands, in float64
    exact = [x.detach().to(torch.bfloat16).double().requires_grad_() for x in inputs[:2]]
    exact.append(bias.detach().double().requires_grad_())
    truth, _ = plain(*exact, targets)
    assert lp.dtype == torch.float32
    close(lp, want, atol=5e-2, rtol=0)
    assert _err(lp, truth) <= _err(want, truth) + 1e-3
    for g, w, t in zip(grads(lp, None, inputs), grads(want, None, inputs),
                       grads(truth, None, exact)):
        assert g.dtype == torch.float32
        assert _err(g, t) <= 1.5 * _err(w, t) + 1e-3, (_err(g, t), _err(w, t))


def test_no_grad_input_and_bias_buffer():
    """Only what requires a gradient gets one: a bias buffer (the policy's logit bias) none."""
    hidden, weight, _, targets = make()
    bias = torch.full((101,), -1e4)
    bias[:50] = 0.0
    targets = targets % 50
    lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=8,
                                         with_entropy=True, entropy_grad=True)
    want_lp, want_ent = plain(hidden, weight, bias, targets)
    close(lp, want_lp)
    close(ent, want_ent)
    for got, want in zip(grads(lp, ent, (hidden, weight)), grads(want_lp, want_ent, (hidden, weight))):
        close(got, want)


def test_masked_tokens_at_minus_infinity_have_no_probability_and_no_nan():
    hidden, weight, _, targets = make()
    bias = torch.zeros(101)
    bias[60:] = float("-inf")
    targets = targets % 60
    for kwargs in ({}, {"chunk_tokens": 8}):
        lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, with_entropy=True,
                                             entropy_grad=True, **kwargs)
        want_lp, want_ent = plain(hidden, weight[:60], bias[:60], targets)  # the finite part
        close(lp, want_lp)
        close(ent, want_ent)
        got = grads(lp, ent, (hidden, weight))
        want = grads(want_lp, want_ent, (hidden, weight))
        close(got[0], want[0])
        close(got[1], want[1])
        assert not got[1][60:].any()
        logits = (hidden @ weight.T + bias).detach().requires_grad_()
        lp2, ent2 = token_logprobs_from_logits(logits, targets, with_entropy=True,
                                               entropy_grad=True, **kwargs)
        close(lp2, want_lp)
        close(ent2, want_ent)
        (g,) = grads(lp2, ent2, [logits])
        assert torch.isfinite(g).all() and not g[:, 60:].any()


def test_empty_input():
    hidden, weight, bias, targets = make(t=0)
    lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    g_h, g_w, g_b = torch.autograd.grad(lp.sum(), [hidden, weight, bias])
    assert g_h.shape == (0, 16) and not g_w.any() and not g_b.any()
    lp, _ = token_logprobs_from_logits(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,)


def test_temperature_zero_is_untempered_and_bad_options_fail():
    hidden, weight, bias, targets = make()
    a, _ = token_logprobs_from_hidden(hidden, weight, bias, targets, temperature=0.0)
    b, _ = token_logprobs_from_hidden(hidden, weight, bias, targets, temperature=1.0)
    close(a, b, atol=0, rtol=0)
    for kwargs in ({"temperature": -1.0}, {"temperature": float("nan")}, {"chunk_tokens": 0},
                   {"chunk_tokens": 2.5}, {"entropy_grad": True}):
        with pytest.raises(ValueError):
            token_logprobs_from_hidden(hidden, weight, bias, targets, **kwargs)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_from_hidden(hidden, weight, bias, targets[:-1])


# ------------------------------------------------------------------ what is kept for backward
class Saved:
    """The tensors autograd saves for backward while active."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, t):
        self.tensors.append(t)
        return t

    def largest(self) -> int:
        return max((t.numel() for t in self.tensors), default=0)


def test_entropy_metric_holds_no_graph_and_saves_nothing_for_it():
    hidden, weight, bias, targets = make()
    with Saved() as without:
        token_logprobs_from_hidden(hidden, weight, bias, targets)
    with Saved() as metric:
        lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, with_entropy=True)
    assert lp.requires_grad and not ent.requires_grad and ent.grad_fn is None
    assert [t.shape for t in metric.tensors] == [t.shape for t in without.tensors]
    with Saved() as trained:
        _, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, with_entropy=True,
                                            entropy_grad=True)
    assert ent.requires_grad and len(trained.tensors) == len(without.tensors) + 1
    with torch.no_grad(), Saved() as none:
        lp, ent = token_logprobs_from_hidden(hidden, weight, bias, targets, with_entropy=True,
                                             entropy_grad=True)
    assert none.tensors == [] and lp.grad_fn is None and ent.grad_fn is None


def test_no_token_by_vocabulary_tensor_is_saved_for_backward():
    t, v, h, chunk = 256, 503, 8, 32
    hidden, weight, bias, targets = make(t=t, v=v, h=h)
    with Saved() as base:
        plain(hidden, weight, bias, targets)
    assert base.largest() >= t * v  # the detector sees the plain formula's [T, V]
    for kwargs in ({}, {"with_entropy": True, "entropy_grad": True}):
        with Saved() as ours:
            token_logprobs_from_hidden(hidden, weight, bias, targets, chunk_tokens=chunk, **kwargs)
        assert ours.largest() == v * h  # the weight itself, referenced
        assert all(t_.data_ptr() in {x.data_ptr() for x in (hidden, weight, bias)}
                   or t_.numel() <= t for t_ in ours.tensors)
    logits = (hidden @ weight.T).detach().requires_grad_()
    with Saved() as ours:
        token_logprobs_from_logits(logits, targets, chunk_tokens=chunk, with_entropy=True,
                                   entropy_grad=True)
    big = [x for x in ours.tensors if x.numel() > t]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()  # the input, not a copy


# ------------------------------------------------------------------ peak allocated bytes
def peak_allocated(fn) -> int:
    """Peak bytes allocated on the CPU while ``fn`` runs, above what was live at its start
    (the allocator's own events, via the profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("kwargs", "buffers"), [
    ({}, 1),  # logprobs alone: one float32 [chunk, V] at a time
    ({"with_entropy": True}, 2),  # + the softmax, for the entropy metric
    ({"with_entropy": True, "entropy_grad": True}, 2),
])
def test_peak_memory_is_one_chunk_not_tokens_by_vocabulary(kwargs, buffers):
    """Forward + backward: the peak is ``buffers`` chunks of ``[chunk, V]`` float32 plus the
    gradients, the same at T and 2T; the plain formula's is several ``[T, V]``."""
    v, h, chunk = 2003, 16, 32
    row = chunk * v * 4  # one chunk's [chunk, V] float32

    def run(fn, t):
        hidden, weight, bias, targets = make(t=t, v=v, h=h)

        def step():
            lp, ent = fn(hidden, weight, bias, targets)
            (lp.sum() + (ent.sum() if ent is not None and ent.requires_grad else 0)).backward()
        return peak_allocated(step)

    def ours(*a):
        return token_logprobs_from_hidden(*a, chunk_tokens=chunk, **kwargs)

    small, large = run(ours, 256), run(ours, 512)
    # beside the chunk's work: the weight / bias / hidden gradients and [T] scalars, 2x slack
    fixed = (v * h + v + 512 * h) * 4 * 2
    assert small < buffers * row + fixed, (small / row, fixed / row)
    assert large < buffers * row + fixed, (large / row, fixed / row)
    assert large - small < row / 4  # doubling T adds no [chunk, V]
    # and the detector sees the plain formula's [T, V] float32 tensors
    assert run(plain, 256) > 3 * 256 * v * 4


def test_logits_entry_point_allocates_one_chunk_in_forward():
    n, v, chunk = 512, 4001, 64
    logits = torch.randn(n, v)
    rows = torch.arange(0, n, 2)
    targets = torch.randint(0, v, rows.shape)
    peak = peak_allocated(lambda: token_logprobs_from_logits(
        logits, targets, rows=rows, chunk_tokens=chunk, with_entropy=True))
    assert peak < 3 * chunk * v * 4, peak
    assert peak_allocated(lambda: plain_logits(logits[rows], targets)) > 2 * len(rows) * v * 4


# ------------------------------------------------------------------ full logits entry point
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_rows", [False, True])
def test_logits_entry_point_equals_the_plain_formula(dtype, use_rows):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(50, 83, generator=g) * 3).to(dtype).requires_grad_()
    rows = torch.randperm(50, generator=g)[:29] if use_rows else None
    targets = torch.randint(0, 83, (29 if use_rows else 50,), generator=g)
    lp, ent = token_logprobs_from_logits(logits, targets, rows=rows, chunk_tokens=6,
                                         temperature=0.8, with_entropy=True, entropy_grad=True)
    picked = logits[rows] if use_rows else logits
    want_lp, want_ent = plain_logits(picked, targets, 0.8)
    assert lp.dtype == torch.float32
    close(lp, want_lp)
    close(ent, want_ent)
    (got,), (want,) = grads(lp, ent, [logits]), grads(want_lp, want_ent, [logits])
    assert got.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    close(got, want, atol=atol, rtol=0)
    if use_rows:
        unused = torch.ones(50, dtype=torch.bool)
        unused[rows] = False
        assert not got[unused].any()
    with torch.no_grad():
        lp2, ent2 = token_logprobs_from_logits(logits, targets, rows=rows, chunk_tokens=50,
                                               temperature=0.8, with_entropy=True)
    close(lp2, lp.detach(), atol=0, rtol=0)
    assert ent2.grad_fn is None
    assert logits.grad is None  # the input was never written to


# ------------------------------------------------------------------ next-token shift
def shifted_plain(logits, ids, temperature=1.0):
    """The trainer's plain ``token_logprobs`` / ``entropy`` ([B, S], position 0 gets 0)."""
    lsm = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    lp = F.pad(lsm.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1), (1, 0))
    return lp, F.pad(-(lsm.exp() * lsm).sum(-1), (1, 0))


def test_shifted_entry_points_equal_the_trainers_formula_on_the_mask():
    g = torch.Generator().manual_seed(4)
    b, s, h, v = 3, 11, 8, 29
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True)
    ids = torch.randint(0, v, (b, s), generator=g)
    mask = torch.rand(b, s, generator=g) > 0.4
    mask[:, 0] = True  # position 0 is never scored, even when the mask says so
    logits = hidden @ weight.T + bias
    want_lp, want_ent = shifted_plain(logits, ids, 0.9)
    keep = mask.clone()
    keep[:, 0] = False
    want_lp, want_ent = want_lp * keep, want_ent * keep
    lp, ent = shifted_token_logprobs(hidden, ids, weight, bias, mask=mask, chunk_tokens=4,
                                     temperature=0.9, with_entropy=True, entropy_grad=True)
    close(lp, want_lp)
    close(ent, want_ent)
    inputs = (hidden, weight, bias)
    for got, want in zip(grads(lp, ent, inputs), grads(want_lp, want_ent, inputs)):
        close(got, want)
    lp2, ent2 = shifted_token_logprobs_from_logits(logits, ids, mask=mask, chunk_tokens=4,
                                                   temperature=0.9, with_entropy=True)
    close(lp2, want_lp)
    close(ent2, want_ent)
    all_lp, _ = shifted_token_logprobs(hidden, ids, weight, bias, temperature=0.9)
    close(all_lp, shifted_plain(logits, ids, 0.9)[0])
    src, dst = next_token_positions(ids, mask)
    assert torch.equal(src + 1, dst) and not (dst % s == 0).any()

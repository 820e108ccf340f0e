"""Memory-bounded log-probs and entropy of the taken tokens: the policy's one number per token.

The plain formula, ``log_softmax((h @ W.T + b).float() / temperature).gather(-1, targets)``,
materializes ``[T, V]`` float32 tensors: the logits, their softmax output (saved for backward),
then in backward the softmax's gradient and the logits' gradient. At a 151,936-id vocabulary one
such tensor is 0.61 MB per token (2.5 GB at 4,096 tokens), and an entropy through ``softmax``
saves another. Here the same numbers come out of a loop over token chunks:

* :func:`token_logprobs_from_hidden` (the default route): from the final hidden states of the
  scored positions ``[T, H]`` and the output projection (``weight [V, H]``, optional
  ``bias [V]``). Per chunk of ``chunk_tokens`` rows it projects, upcasts to float32, scales by
  ``1 / temperature`` and reduces to the row's log-sum-exp, the taken token's logprob and
  (when asked) the entropy. Backward saves only the inputs plus three float32 numbers per token
  (log-sum-exp, entropy) and recomputes each chunk's logits, so backward too holds one chunk's
  ``[chunk, V]`` at a time. The weight and bias gradients are accumulated in float32 across
  chunks (rounding each chunk's product to bf16 biases training: TRL's finding), then cast to the
  parameter's dtype.
* :func:`token_logprobs_from_logits`: for a model that hands back full logits ``[N, V]``
  anyway. The same chunk loop over given rows, without any extra full-size copy: the logits are
  referenced (not copied) for backward, whose only full-size tensor is their gradient (one
  ``[N, V]`` in the logits' dtype, which any backward through them must produce).
* :func:`shifted_token_logprobs` / :func:`shifted_token_logprobs_from_logits`: the next-token
  shift the trainer needs, on ``[B, S]`` ids: ``lp[b, t] = log p(ids[b, t] | ids[b, :t])`` at
  the positions ``mask`` selects (``0`` at ``t = 0`` and outside the mask), the same numbers the
  plain ``token_logprobs(logits, ids, temperature)`` gives there; only the selected positions
  are projected, so prompt positions cost no logits.

**Memory bound.** With ``c = min(chunk_tokens, T)``, one float32 ``[c, V]`` work tensor is
alive at a time (two while an entropy is computed or differentiated), plus in a lower-precision
compute dtype (bf16 / fp16) the matmul's ``[c, V]`` output until its upcast, in forward and in
backward alike: ``<= c * V * 4`` bytes for the logprobs alone in float32, ``<= c * V * 10``
bytes in any case, whatever T is (``chunk_tokens=1024`` at V = 151,936: 0.62 / 1.56 GB). Beyond that: saved for backward, the inputs
themselves (referenced, not copied) and ``[T]`` float32 scalars; during backward, the input
gradients (``[T, H]``, ``[V, H]``, ``[V]``) and, when the weight is not float32, one float32
``[V, H]`` accumulator for its gradient. No ``[T, V]`` tensor of any dtype is created by
:func:`token_logprobs_from_hidden`.

**Entropy.** ``with_entropy=True`` returns ``H_t = -sum_v p_v log p_v`` of the same tempered
distribution the logprobs are taken from (the one the engine samples; TRL and verl take the
entropy of ``logits / temperature`` too), computed in the same chunk pass at no extra matmul.
By default it is a metric: detached, no graph, nothing saved for it. ``entropy_grad=True`` (only
when the loss uses it, ``entropy_coef != 0``) makes it differentiable; its backward term is
added to the same per-chunk recompute.

**Temperature.** ``logits / temperature`` in float32, as the trainer recomputes what the engine
reported (``tq_plugin.rollout.engine.sample_from``: ``log_softmax(logits.float() / (temperature
or 1.0))``); ``temperature=0`` (greedy) therefore means the untempered distribution, as there.

**Precision.** The projection runs in the compute dtype: the autocast dtype when autocast is on
for the device (``trainer.precision=bf16-mixed``), else the promoted dtype of ``hidden`` and
``weight``. Its output is upcast to float32 per chunk before the bias (in float32) and the
softmax, so bf16 weights or hidden states give float32 logprobs and entropy. float64 inputs are
computed in float64 (tests use it for the truth).

**Sampling controls.** ``processing`` (a :class:`~tq_plugin.rollout.sampling.RowProcessing`,
built by the shifted functions from ``controls``: ``top_k``, ``top_p``, ``min_p``,
``repetition_penalty``) is applied to each chunk's tempered logits before the reduction, in
forward and in the backward's recompute, so the logprobs (and entropy) are the processed,
renormalised distribution's, the one the engine sampled from (:mod:`tq_plugin.rollout.sampling`).
The kept set is a constant of the backward (as the sampling is); the repetition penalty's
factor (``1 / penalty`` or ``penalty`` on seen tokens) multiplies the logits' gradient. A
target outside the kept set gets ``-inf`` (the caller decides what that token trains:
``tq_plugin.rl.training.module`` drops it from the loss and counts it). Without controls the
path is the plain one, unchanged. The processing holds one more ``[c, V]`` bool (the penalty's
seen tokens) and, for ``top_p``, a sort of the chunk (``[c, V]`` values and int64 indices).

A ``-inf`` logit (a masked token) has probability 0 and adds nothing to the entropy or its
gradient (the plain ``-(p * log p).sum()`` gives nan there). The backward is once-differentiable
(no double backward).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from tq_plugin.rollout.sampling import RowProcessing, SamplingControls

DEFAULT_CHUNK_TOKENS = 1024


# ---------------------------------------------------------------------------- helpers
def _check_options(chunk_tokens: int, temperature: float, with_entropy: bool,
                   entropy_grad: bool) -> float:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be a whole number >= 1, got {chunk_tokens!r}")
    if not temperature >= 0:  # also catches nan
        raise ValueError(f"temperature: must be >= 0, got {temperature!r}")
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad=True needs with_entropy=True")
    return float(temperature) or 1.0  # 0: greedy, the untempered distribution (as sample_from)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 compute (never below float32)."""
    return torch.promote_types(dtype, torch.float32)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, ValueError):  # a device type autocast does not know
        pass
    return torch.promote_types(hidden.dtype, weight.dtype)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two ``[c, V]`` tensors without a third ``[c, V]``."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _reduce(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logprob, logsumexp, entropy | None)`` per row of the tempered logits ``z [c, V]``
    (consumed: ``z`` is overwritten). One more ``[c, V]`` is allocated for the entropy, none
    without it."""
    picked = z.gather(1, targets.unsqueeze(1)).squeeze(1)
    m = z.amax(1, keepdim=True)
    # A row whose logits are all -inf has no distribution: the plain formula gives nan there too.
    shifted = z.sub_(m)
    p = shifted.exp() if with_entropy else shifted.exp_()  # z is needed again only for H
    s = p.sum(1)
    log_s = s.log()
    m = m.squeeze(1)
    lse = m + log_s
    lp = picked - lse
    ent = None
    if with_entropy:
        # H = lse - sum p z = log s - sum p (z - m) / s: no cancellation against the max. A -inf
        # logit (a masked token) has p = 0 and adds 0, not 0 * -inf = nan.
        shifted.clamp_(min=torch.finfo(shifted.dtype).min)
        ent = log_s - _rowdot(p, shifted) / s
    return lp, lse, ent


def _grad_logits(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                 g_lp: torch.Tensor, ent: torch.Tensor | None, g_ent: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """The gradient w.r.t. the *untempered* logits of one chunk, from its tempered logits ``z``
    (consumed): ``d lp / dz = onehot - p``, ``d H / dz = -p (log p + H)``, then ``/ temperature``.
    One more ``[c, V]`` is allocated for the entropy's term, none without it."""
    logp = z.sub_(lse.unsqueeze(1))
    if g_ent is not None:
        p = logp.exp()
        grad = logp.clamp_(min=torch.finfo(logp.dtype).min).add_(ent.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))
        grad.sub_(p.mul_(g_lp.unsqueeze(1)))
        del p
    else:
        grad = logp.exp_().mul_(-g_lp.unsqueeze(1))
    grad.scatter_add_(1, targets.unsqueeze(1), g_lp.unsqueeze(1))
    if scale != 1.0:
        grad.div_(scale)
    return grad



def _saved_outputs(ctx: Any, saved: list[torch.Tensor], lp: torch.Tensor,
                   ent: torch.Tensor | None, *, entropy_grad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Save ``saved`` (and the entropy, when its gradient is wanted) for backward; the entropy
    is marked non-differentiable when it is only a metric."""
    if entropy_grad:
        saved.append(ent)
    ctx.save_for_backward(*saved)
    if ent is not None and not entropy_grad:
        ctx.mark_non_differentiable(ent)
    return lp, ent

class _Projection:
    """The per-chunk tempered float logits ``(h @ W.T + b).float() / temperature``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, cdtype: torch.dtype,
                 temperature: float) -> None:
        self.cdtype = cdtype
        self.work = _work_dtype(cdtype)
        self.weight = weight.to(cdtype)  # a no-op unless autocast / mixed dtypes ask for a cast
        self.bias = None if bias is None else bias.to(self.work)
        self.temperature = temperature

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(self.cdtype)
        if self.cdtype == self.work:  # float32 / float64: one fused addmm, as nn.Linear
            z = F.linear(h, self.weight, self.bias)
        else:  # bf16 / fp16 matmul, upcast, bias added in float32
            z = F.linear(h, self.weight).to(self.work)
            if self.bias is not None:
                z.add_(self.bias)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z


def _no_autocast(device_type: str):
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know: nothing to turn off
        return contextlib.nullcontext()


# ---------------------------------------------------------------------------- from hidden states
def _processed(z: torch.Tensor, processing: Any, s: int, e: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``z`` (rows ``s:e``) after ``processing`` (module docstring), with the penalty's factor."""
    return (z, None) if processing is None else processing(z, s, e)


def _hidden_forward(hidden, weight, bias, targets, chunk, temperature, cdtype, with_entropy,
                    processing=None):
    proj = _Projection(weight, bias, cdtype, temperature)
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=proj.work, device=hidden.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        lp_c, lse_c, ent_c = _reduce(_processed(proj(hidden[s:e]), processing, s, e)[0],
                                     targets[s:e], with_entropy)
        lp[s:e], lse[s:e] = lp_c, lse_c
        if ent is not None:
            ent[s:e] = ent_c
    return lp, lse, ent


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, temperature, cdtype, with_entropy,
                entropy_grad, processing):
        with _no_autocast(hidden.device.type):
            lp, lse, ent = _hidden_forward(hidden, weight, bias, targets, chunk, temperature,
                                           cdtype, with_entropy, processing)
        ctx.chunk, ctx.temperature, ctx.cdtype = chunk, temperature, cdtype
        ctx.processing = processing
        ctx.has_bias, ctx.entropy_grad = bias is not None, entropy_grad
        saved = [hidden, weight, targets, lse] + ([bias] if bias is not None else [])
        return _saved_outputs(ctx, saved, lp, ent, entropy_grad=entropy_grad)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        saved = list(ctx.saved_tensors)
        hidden, weight, targets, lse = saved[:4]
        bias = saved[4] if ctx.has_bias else None
        ent = saved[-1] if ctx.entropy_grad else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        if not ctx.entropy_grad:
            g_ent = None
        elif g_ent is None:
            g_ent = torch.zeros_like(lse)
        with _no_autocast(hidden.device.type):
            proj = _Projection(weight, bias, ctx.cdtype, ctx.temperature)
            work = proj.work
            grad_h = torch.empty_like(hidden) if need_h else None
            acc_w = torch.zeros(weight.shape, dtype=work, device=weight.device) if need_w else None
            acc_b = torch.zeros(weight.shape[0], dtype=work, device=weight.device) if need_b else None
            for s in range(0, n, ctx.chunk):
                e = min(s + ctx.chunk, n)
                h = hidden[s:e]
                z, factor = _processed(proj(h), ctx.processing, s, e)
                dz = _grad_logits(z, targets[s:e], lse[s:e], g_lp[s:e].to(work),
                                  None if ent is None else ent[s:e],
                                  None if g_ent is None else g_ent[s:e].to(work),
                                  ctx.temperature)
                del z  # dz is z's storage, worked in place: no second chunk stays alive
                if factor is not None:
                    dz.mul_(factor)
                if need_h:
                    grad_h[s:e] = (dz.to(proj.cdtype) @ proj.weight).to(hidden.dtype)
                if need_w:
                    acc_w.addmm_(dz.t(), h.to(work))
                if need_b:
                    acc_b += dz.sum(0)
                del dz
        grad_w = None if acc_w is None else acc_w.to(weight.dtype)
        grad_b = None if acc_b is None else acc_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    processing: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [T], entropy [T] | None)`` of ``targets`` under ``softmax((hidden @ weight.T +
    bias) / temperature)``, float32 (float64 for float64 inputs), never holding more than one
    chunk's ``[chunk_tokens, V]`` (see the module docstring for the exact bound).

    ``hidden [T, H]``: the final hidden states of the positions that carry a loss (for a causal
    LM, the position *before* each target). ``weight [V, H]`` / ``bias [V]`` (or ``None``): the
    output projection, e.g. ``lm_head.weight`` and the policy's logit bias. ``targets [T]``
    (int64): the taken token ids. ``with_entropy``: also return the entropy of the same
    distribution; ``entropy_grad``: make it differentiable (otherwise it is detached and nothing
    is saved for it). Gradients flow to ``hidden``, ``weight`` and ``bias`` (whichever require
    them) and equal the plain formula's. Under ``torch.no_grad`` (or when nothing requires a
    gradient) nothing is saved at all. ``processing``: the sampling controls' processing of
    each chunk (module docstring; ``None``: the plain distribution).
    """
    temperature = _check_options(chunk_tokens, temperature, with_entropy, entropy_grad)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, H] and weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    targets = targets.long()
    cdtype = _compute_dtype(hidden, weight)
    tracked = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not tracked:
        with torch.no_grad(), _no_autocast(hidden.device.type):
            lp, _, ent = _hidden_forward(hidden, weight, bias, targets, chunk_tokens,
                                         temperature, cdtype, with_entropy, processing)
        return lp, ent
    lp, ent = _HiddenLogprobs.apply(hidden, weight, bias, targets, chunk_tokens, temperature,
                                    cdtype, with_entropy, entropy_grad, processing)
    return lp, ent


# ---------------------------------------------------------------------------- from full logits
def _logit_rows(logits: torch.Tensor, rows: torch.Tensor | None, s: int, e: int,
                temperature: float) -> torch.Tensor:
    """Rows ``s:e`` (of ``rows``, or of ``logits``) as a fresh tempered float tensor."""
    work = _work_dtype(logits.dtype)
    if rows is None:
        z = logits[s:e].to(work, copy=True)  # a view otherwise: the caller's logits are not ours
    else:
        z = logits.index_select(0, rows[s:e]).to(work)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _logits_forward(logits, rows, targets, chunk, temperature, with_entropy, processing=None):
    n = targets.shape[0]
    work = _work_dtype(logits.dtype)
    lp = torch.empty(n, dtype=work, device=logits.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        z = _processed(_logit_rows(logits, rows, s, e, temperature), processing, s, e)[0]
        lp_c, lse_c, ent_c = _reduce(z, targets[s:e], with_entropy)
        lp[s:e], lse[s:e] = lp_c, lse_c
        if ent is not None:
            ent[s:e] = ent_c
    return lp, lse, ent


class _LogitsLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, targets, chunk, temperature, with_entropy, entropy_grad,
                processing):
        lp, lse, ent = _logits_forward(logits, rows, targets, chunk, temperature, with_entropy,
                                       processing)
        ctx.chunk, ctx.temperature, ctx.processing = chunk, temperature, processing
        ctx.has_rows, ctx.entropy_grad = rows is not None, entropy_grad
        saved = [logits, targets, lse] + ([rows] if rows is not None else [])
        return _saved_outputs(ctx, saved, lp, ent, entropy_grad=entropy_grad)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        saved = list(ctx.saved_tensors)
        logits, targets, lse = saved[:3]
        rows = saved[3] if ctx.has_rows else None
        ent = saved[-1] if ctx.entropy_grad else None
        n = targets.shape[0]
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        if not ctx.entropy_grad:
            g_ent = None
        elif g_ent is None:
            g_ent = torch.zeros_like(lse)
        # The logits' own gradient: the one full-size tensor any backward through them makes.
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            z, factor = _processed(_logit_rows(logits, rows, s, e, ctx.temperature),
                                   ctx.processing, s, e)
            dz = _grad_logits(z, targets[s:e], lse[s:e], g_lp[s:e].to(lse.dtype),
                              None if ent is None else ent[s:e],
                              None if g_ent is None else g_ent[s:e].to(lse.dtype),
                              ctx.temperature)
            del z
            if factor is not None:
                dz.mul_(factor)
            if rows is None:
                grad[s:e] = dz
            else:
                grad.index_add_(0, rows[s:e], dz.to(grad.dtype))
            del dz
        return grad, None, None, None, None, None, None, None


def token_logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    processing: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [T], entropy [T] | None)`` of ``targets [T]`` under ``softmax(logits[rows] /
    temperature)`` in float32, for a model that returns full ``logits [N, V]`` (any float dtype).

    ``rows [T]`` (int64, optional): which rows of ``logits`` score ``targets`` (default: all,
    ``T = N``); they are read one chunk at a time (``index_select`` of ``chunk_tokens`` rows), so
    selecting them costs no ``[T, V]`` copy. Forward allocates one chunk's float32 work at a time
    and saves a reference to ``logits`` (no copy) plus ``[T]`` scalars; backward writes the
    logits' gradient (``[N, V]`` in their dtype, zero outside ``rows``) chunk by chunk. Options
    as :func:`token_logprobs_from_hidden`.
    """
    temperature = _check_options(chunk_tokens, temperature, with_entropy, entropy_grad)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    if targets.dim() != 1:
        raise ValueError(f"targets must be [T], got {tuple(targets.shape)}")
    if rows is None and targets.shape[0] != logits.shape[0]:
        raise ValueError(f"targets must be [N] = [{logits.shape[0]}] without rows, got "
                         f"{tuple(targets.shape)}")
    if rows is not None:
        if rows.shape != targets.shape:
            raise ValueError(f"rows must be [T] like targets {tuple(targets.shape)}, got "
                             f"{tuple(rows.shape)}")
        rows = rows.long()
    targets = targets.long()
    if not (torch.is_grad_enabled() and logits.requires_grad):
        with torch.no_grad():
            lp, _, ent = _logits_forward(logits, rows, targets, chunk_tokens, temperature,
                                         with_entropy, processing)
        return lp, ent
    return _LogitsLogprobs.apply(logits, rows, targets, chunk_tokens, temperature, with_entropy,
                                 entropy_grad, processing)


# ---------------------------------------------------------------------------- next-token shift
def next_token_positions(input_ids: torch.Tensor, mask: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` flat indices into ``[B * S]`` for the next-token shift of ``input_ids
    [B, S]``: position ``dst = b * S + t`` (``t >= 1``, and ``mask[b, t]`` when given) is
    predicted from ``src = dst - 1``. A packed row's segment starts are predicted from the
    previous segment's last token, as the plain ``token_logprobs`` does; mask them out."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    keep = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
    keep[:, 0] = False
    if mask is not None:
        if mask.shape != input_ids.shape:
            raise ValueError(f"mask must be [B, S] = {tuple(input_ids.shape)}, got "
                             f"{tuple(mask.shape)}")
        keep &= mask.to(device=keep.device, dtype=torch.bool)
    dst = keep.view(-1).nonzero().squeeze(1)
    return dst - 1, dst


def _row_processing(controls: SamplingControls | None, input_ids: torch.Tensor,
                    positions: torch.Tensor | None, src: torch.Tensor) -> RowProcessing | None:
    """The processing of the scored rows (each predicting the token after flat position
    ``src``), or ``None`` without active controls. A sequence starts at its row's first
    position, or, given ``positions [B, S]`` (a packed row), where its position is 0."""
    if controls is None or not controls.active:
        return None
    if positions is None:
        start = src - src % input_ids.shape[1]
    else:
        start = src - positions.reshape(-1).to(src.device).index_select(0, src).long()
    return RowProcessing(controls, input_ids.reshape(-1), src, start)


def _scatter(values: torch.Tensor | None, dst: torch.Tensor, shape: torch.Size
             ) -> torch.Tensor | None:
    if values is None:
        return None
    # A tensor of its own, not a view: an FSDP2 module's returned view loses its pre-backward
    # hook to an in-place op (torch warns on every call).
    out = values.new_zeros(shape[0], shape[1])
    return out.index_put((dst // shape[1], dst % shape[1]), values)


def shifted_token_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    controls: SamplingControls | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(lp [B, S], entropy [B, S] | None)`` from the final hidden states ``[B, S, H]``:
    ``lp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``, computed only where ``mask [B, S]``
    is true (all positions when ``None``) and 0 at ``t = 0`` and elsewhere; ``entropy[b, t]`` is
    that distribution's entropy. At the selected positions these equal
    ``tiny.token_logprobs(hidden @ weight.T + bias, input_ids, temperature)`` (and ``entropy``),
    with :func:`token_logprobs_from_hidden`'s memory bound. ``controls``: score under the
    sampling controls' processing (module docstring); ``positions [B, S]``: a packed row's
    positions (each sequence's start, for the repetition penalty)."""
    if hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"hidden must be [B, S, H] over input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(hidden.shape)}")
    src, dst = next_token_positions(input_ids, mask)
    lp, ent = token_logprobs_from_hidden(
        hidden.reshape(-1, hidden.shape[-1]).index_select(0, src), weight, bias,
        input_ids.reshape(-1).index_select(0, dst), chunk_tokens=chunk_tokens,
        temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
        processing=_row_processing(controls, input_ids, positions, src))
    return _scatter(lp, dst, input_ids.shape), _scatter(ent, dst, input_ids.shape)


def shifted_token_logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    controls: SamplingControls | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`shifted_token_logprobs` for a model's full ``logits [B, S, V]`` (read in chunks
    through :func:`token_logprobs_from_logits`; no ``[B, S, V]`` copy when they are contiguous)."""
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits must be [B, S, V] over input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(logits.shape)}")
    src, dst = next_token_positions(input_ids, mask)
    lp, ent = token_logprobs_from_logits(
        logits.reshape(-1, logits.shape[-1]), input_ids.reshape(-1).index_select(0, dst),
        rows=src, chunk_tokens=chunk_tokens, temperature=temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad,
        processing=_row_processing(controls, input_ids, positions, src))
    return _scatter(lp, dst, input_ids.shape), _scatter(ent, dst, input_ids.shape)


__all__ = ["DEFAULT_CHUNK_TOKENS", "next_token_positions", "shifted_token_logprobs",
           "shifted_token_logprobs_from_logits", "token_logprobs_from_hidden",
           "token_logprobs_from_logits"]

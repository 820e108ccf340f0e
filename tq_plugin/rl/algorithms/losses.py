"""The policy and value losses, as pure functions of tensors.

The loss of one action token with ratio ``r = pi / pi_old`` and advantage ``A`` is
``-w * min(r A, clip(r, 1 - clip_eps, 1 + clip_eps) A)`` (:func:`clipped_policy_loss`); PPO adds
``vf_coef`` times the clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old,
±value_clip_eps) - R)^2)`` (:func:`clipped_value_loss`) and subtracts ``entropy_coef`` times the
entropy. ``w`` is the importance-sampling correction (``recipe.is_correction``,
:func:`is_correction_weights`) of tokens another policy generated: the disaggregated workers'
older weights, or an engine's other kernels; it is 1 elsewhere.

Every function returns per-token terms (zero off the mask where it matters); the caller sums
them over the action tokens and divides by the step's normalizer, so the update does not depend
on how the rows were cut into microbatches.
"""

from __future__ import annotations

import math

import torch


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip terms ``-w min(r A, clip(r) A)`` and their diagnostics.

    Returns ``(loss, parts)``; ``parts``: ``ratio``, ``log_ratio`` (0 off the mask) and
    ``clipped`` (True on the tokens whose ratio the clamp changed)."""
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    clamped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = -torch.minimum(ratio * advantages, clamped * advantages)
    if weights is not None:
        loss = loss * weights
    return loss, {"ratio": ratio, "log_ratio": log_ratio, "clipped": clamped != ratio}


def approx_kl(ratio: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token ``r - 1 - log r`` (k3): non-negative, 0 where the policies agree."""
    return ratio - 1.0 - log_ratio


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       *, clip_eps: float) -> torch.Tensor:
    """Per-token ``0.5 max((V - R)^2, (V_old + clip(V - V_old, ±clip_eps) - R)^2)``."""
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def truncated_is_weights(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                         mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token truncated importance weights ``min(pi_old / pi_gen, cap)``, 1 off the mask.

    ``pi_old`` is the trainer's recomputation (``prev_logprobs``, the weights the step starts
    from), ``pi_gen`` the engine's staged logprobs (the weights the worker had). Multiplying a
    token's advantage by its weight multiplies its clipped policy-gradient term by it (the
    weight is positive, so ``min(r A w, clip(r) A w) = w min(r A, clip(r) A)``).
    """
    if cap < 1.0:
        raise ValueError(f"truncated_is_weights: cap must be >= 1.0, got {cap}")
    if prev_logprobs.shape != generation_logprobs.shape or prev_logprobs.shape != mask.shape:
        raise ValueError(f"truncated_is_weights: shapes differ: prev {tuple(prev_logprobs.shape)}, "
                         f"generation {tuple(generation_logprobs.shape)}, mask {tuple(mask.shape)}")
    log_ratio = (prev_logprobs - generation_logprobs).clamp(max=float(torch.tensor(cap).log()))
    return torch.where(mask > 0, log_ratio.exp(), torch.ones_like(log_ratio))


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor,
                   sequence_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of ``values`` over the sequence's masked tokens."""
    ids = sequence_ids.reshape(-1).long()
    n = int(ids.max()) + 1 if ids.numel() else 0
    m = mask.reshape(-1).to(values.dtype)
    sums = values.new_zeros(n).index_add_(0, ids, values.reshape(-1) * m)
    counts = values.new_zeros(n).index_add_(0, ids, m)
    return (sums / counts.clamp(min=1.0))[ids].view_as(values)


def is_correction_weights(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                          mask: torch.Tensor, *, mode: str, cap: float = 1.0, low: float = 0.5,
                          high: float = 2.0, sequence_ids: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, masked)`` per token of ``recipe.is_correction.mode``, ``r = pi_old / pi_gen``.

    * ``token_tis``: ``min(r, cap)``;
    * ``seq_mask_tis``: ``min(r, cap)``, 0 on every token of a sequence whose ratio leaves
      ``[low, high]``. A sequence's ratio is the geometric mean of its action tokens' ``r``
      (``exp`` of their mean log-ratio), so the band means the same at every length: the
      product would leave any band once a sequence is long enough;
    * ``icepop``: ``r`` on tokens with ``r`` in ``[low, high]``, 0 on the others;
    * ``none``: 1.

    Off the mask the weight is 1 and nothing is masked. ``sequence_ids`` (same shape) names each
    token's sequence (a packed row's ``segment_ids``); by default each row is one sequence.
    ``masked`` is True on the action tokens the mode zeroed.
    """
    if prev_logprobs.shape != generation_logprobs.shape or prev_logprobs.shape != mask.shape:
        raise ValueError(f"is_correction_weights: shapes differ: prev {tuple(prev_logprobs.shape)}, "
                         f"generation {tuple(generation_logprobs.shape)}, mask {tuple(mask.shape)}")
    on = mask > 0
    ones = torch.ones_like(prev_logprobs)
    log_ratio = torch.where(on, prev_logprobs - generation_logprobs, torch.zeros_like(ones))
    log_low, log_high = math.log(low), math.log(high)
    if mode == "none":
        return ones, torch.zeros_like(on)
    if mode == "token_tis":
        return truncated_is_weights(prev_logprobs, generation_logprobs, mask, cap), torch.zeros_like(on)
    if mode == "icepop":
        keep = (log_ratio >= log_low) & (log_ratio <= log_high)
        weights = log_ratio.clamp(max=log_high).exp()
    elif mode == "seq_mask_tis":
        if sequence_ids is None:
            sequence_ids = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)
        seq = _sequence_mean(log_ratio, on, sequence_ids)
        keep = (seq >= log_low) & (seq <= log_high)
        weights = truncated_is_weights(prev_logprobs, generation_logprobs, mask, cap)
    else:
        raise ValueError(f"is_correction_weights: mode must be one of token_tis, seq_mask_tis, "
                         f"icepop, none; got {mode!r}")
    masked = on & ~keep
    return torch.where(masked, torch.zeros_like(weights), torch.where(on, weights, ones)), masked


__all__ = ["approx_kl", "clipped_policy_loss", "clipped_value_loss", "is_correction_weights",
           "truncated_is_weights"]

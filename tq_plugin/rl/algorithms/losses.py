"""The policy and value losses, as pure functions of tensors.

The policy loss family (``recipe.loss_type``, TRL's names and semantics; ``docs/losses.md`` has
the table with each anchor's formula). With ``r`` the importance ratio ``pi / pi_old`` of a token
(``recipe.importance_sampling_level=token``) or of its sequence (``sequence``: GSPO's
length-normalised ``exp(mean_t (log pi - log pi_old))``, differentiable, broadcast over the
sequence's tokens), ``A`` the advantage and ``w`` the importance-sampling correction
(``recipe.is_correction``, :func:`is_correction_weights`; 1 where the rows are on-policy):

* ``grpo``, ``dr_grpo``, ``dapo``, ``bnpo``: the PPO-clip term
  ``L = -w min(r A, clip(r, 1 - eps, 1 + eps_high) A)`` (:func:`clipped_policy_loss`;
  ``eps_high`` is ``recipe.clip_eps_high``, DAPO's clip-higher, ``eps`` when unset);
* ``cispo``: ``L = -w sg(min(r, cap)) A log pi`` (:func:`cispo_policy_loss`: the clipped
  importance weight, stop-gradient, times the REINFORCE term; ``cap`` is
  ``recipe.cispo_cap``, an absolute cap on ``r``).

They differ in what the token terms are summed over and divided by: each loss is registered
with its aggregation (:func:`~tq_plugin.rl.algorithms.registry.register_policy_loss`, verl's
``loss_agg_mode``), and :func:`aggregate_loss` and :func:`loss_normalizer` switch on it, not on
the name (:func:`loss_normalizer` computes the global normaliser when a step is prepared, so the
update does not depend on how the rows were cut into microbatches):

* ``seq_mean_token_mean`` (``grpo``): each sequence's token mean, then the mean over the global
  batch's sequences;
* ``seq_mean_token_sum_norm`` (``dr_grpo``): the token sum over (global batch sequences x max
  completion tokens);
* ``token_mean`` (``dapo``, ``cispo``): the token sum over the global batch's action tokens;
* ``microbatch_token_mean`` (``bnpo``): each microbatch's token mean, over the microbatches of
  its global batch (TRL's local-batch normalisation: it depends on the microbatch cut, as TRL's
  on the device batch).

``recipe.beta > 0`` adds ``beta * KL`` per token (:func:`kl_penalty`, ``k1``/``k2``/``k3``
against the frozen reference policy) before the aggregation, as TRL does. PPO adds ``vf_coef``
times the clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, ±value_clip_eps) -
R)^2)`` (:func:`clipped_value_loss`) and subtracts ``entropy_coef`` times the entropy.

Every function returns per-token terms (zero off the mask where it matters); the caller sums
them over the action tokens and divides by the step's normalizer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tq_plugin.rl.algorithms.registry import (
    AGGREGATIONS,
    POLICY_LOSSES,
    loss_aggregation,
    register_policy_loss,
)

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _row_sequence_ids(mask: torch.Tensor, sequence_ids: torch.Tensor | None) -> torch.Tensor:
    """Each token's sequence: ``sequence_ids`` (a packed row's ``segment_ids``), else its row."""
    if sequence_ids is not None:
        return sequence_ids.reshape(mask.shape).long()
    return torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)


def sequence_token_counts(mask: torch.Tensor, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per token: how many action tokens (``mask > 0``) its sequence has (0 on a sequence with
    none)."""
    ones = (mask > 0).to(torch.float32)
    return _sequence_sum(ones, _row_sequence_ids(mask, sequence_ids))


def _sequence_sum(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1)
    n = int(flat.max()) + 1 if flat.numel() else 0
    sums = values.new_zeros(n).index_add(0, flat, values.reshape(-1))
    return sums[flat].view_as(values)


def importance_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                         *, level: str = "token",
                         sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``log r`` per token (0 off the mask): ``token``: ``log pi - log pi_old``; ``sequence``
    (GSPO, Zheng et al. 2025, eq. 7): the sequence's mean over its action tokens,
    ``sum_t m (log pi - log pi_old) / max(sum_t m, 1)``, with its gradient, on each of them."""
    on = mask > 0
    diff = torch.where(on, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return diff
    if level != "sequence":
        raise ValueError(f"importance_log_ratio: level must be one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")
    seq = _sequence_mean(diff, on, _row_sequence_ids(mask, sequence_ids))
    return torch.where(on, seq, torch.zeros_like(diff))


@register_policy_loss("grpo", aggregation="seq_mean_token_mean")
@register_policy_loss("dr_grpo", aggregation="seq_mean_token_sum_norm")
@register_policy_loss("dapo", aggregation="token_mean")
@register_policy_loss("bnpo", aggregation="microbatch_token_mean")
def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float,
                        clip_eps_high: float | None = None, weights: torch.Tensor | None = None,
                        level: str = "token", sequence_ids: torch.Tensor | None = None,
                        **_: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip terms ``-w min(r A, clip(r, 1 - eps, 1 + eps_high) A)`` and their
    diagnostics (Schulman et al. 2017 eq. 7; clip-higher: DAPO, Yu et al. 2025 eq. 10).

    Returns ``(loss, parts)``; ``parts``: ``ratio``, ``log_ratio`` (0 off the mask),
    ``clipped`` (True on the tokens whose ratio the clamp changed), ``clip_low`` (``r < 1 - eps``
    with ``A < 0``: the clip took the gradient) and ``clip_high`` (``r > 1 + eps_high``, ``A > 0``)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, level=level,
                                     sequence_ids=sequence_ids)
    ratio = log_ratio.exp()
    clamped = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss = -torch.minimum(ratio * advantages, clamped * advantages)
    if weights is not None:
        loss = loss * weights
    with torch.no_grad():
        on = mask > 0
        clip_low = on & (ratio < 1.0 - clip_eps) & (advantages < 0)
        clip_high = on & (ratio > 1.0 + high) & (advantages > 0)
    return loss, {"ratio": ratio, "log_ratio": log_ratio, "clipped": clamped != ratio,
                  "clip_low": clip_low, "clip_high": clip_high}


@register_policy_loss("cispo", aggregation="token_mean")
def cispo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, *, cispo_cap: float,
                      weights: torch.Tensor | None = None, level: str = "token",
                      sequence_ids: torch.Tensor | None = None,
                      **_: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token CISPO terms ``-w sg(min(r, cap)) A log pi`` (MiniMax-M1, 2025, eq. 4 with no
    lower clip): every token keeps a gradient, its importance weight is clipped and detached.

    ``cap`` is an absolute cap on ``r`` (TRL's ``epsilon_high`` under ``loss_type="cispo"``,
    whose unset default 0.2 would weight every on-policy token by 0.2: hence ``>= 1``).
    ``parts`` as :func:`clipped_policy_loss`'s; ``clipped``/``clip_high``: ``r > cap``."""
    if cispo_cap < 1.0:
        raise ValueError(f"cispo_policy_loss: cispo_cap must be >= 1.0, got {cispo_cap}")
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, level=level,
                                     sequence_ids=sequence_ids)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=cispo_cap).detach()
    loss = -weight * advantages * logprobs
    if weights is not None:
        loss = loss * weights
    with torch.no_grad():
        capped = (mask > 0) & (ratio > cispo_cap)
    return loss, {"ratio": ratio, "log_ratio": log_ratio, "clipped": capped,
                  "clip_low": torch.zeros_like(capped), "clip_high": capped & (advantages > 0)}


def policy_loss(loss_type: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor,
                **options: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token terms of ``loss_type`` (:data:`POLICY_LOSSES`)."""
    loss_aggregation(loss_type)  # the one error for an unknown name
    return POLICY_LOSSES[loss_type].fn(logprobs, old_logprobs, advantages, mask, **options)


def loss_normalizer(loss_type: str, *, action_tokens: int, sequences: int, minibatches: int,
                    max_completion_tokens: int) -> float:
    """One global batch's normaliser of ``loss_type`` from the step's totals (every rank's rows),
    by the aggregation the loss was registered with: ``seq_mean_token_mean``: its sequences;
    ``seq_mean_token_sum_norm``: its sequences x ``max_completion_tokens`` (Dr. GRPO's
    constant); ``token_mean``: its action tokens; ``microbatch_token_mean``: its action tokens
    too (not used: its normaliser is each microbatch's own, :func:`aggregate_loss`)."""
    aggregation = loss_aggregation(loss_type)
    if minibatches < 1:
        raise ValueError(f"loss_normalizer: minibatches must be >= 1, got {minibatches}")
    per_batch_sequences = sequences / minibatches
    if aggregation == "seq_mean_token_mean":
        return max(1.0, per_batch_sequences)
    if aggregation == "seq_mean_token_sum_norm":
        if max_completion_tokens < 1:
            raise ValueError(f"loss_normalizer: max_completion_tokens must be >= 1, got "
                             f"{max_completion_tokens}")
        return max(1.0, per_batch_sequences * max_completion_tokens)
    if aggregation in ("token_mean", "microbatch_token_mean"):
        return float(max(1, action_tokens // minibatches))
    raise ValueError(f"loss_normalizer: aggregation must be one of {AGGREGATIONS}, got "
                     f"{aggregation!r}")


def aggregate_loss(loss_type: str, terms: torch.Tensor, mask: torch.Tensor, *, norm: float,
                   microbatches: int = 1, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One microbatch's share of its global batch's loss from per-token ``terms``, by the
    aggregation ``loss_type`` was registered with.

    ``norm``: :func:`loss_normalizer`'s value (per rank); ``microbatches``: how many microbatches
    the global batch has (``microbatch_token_mean``). Summed over a global batch's microbatches
    this is the type's loss of the whole global batch."""
    aggregation = loss_aggregation(loss_type)
    m = (mask > 0).to(terms.dtype)
    if aggregation == "seq_mean_token_mean":
        counts = sequence_token_counts(mask, sequence_ids).clamp(min=1.0)
        return (terms * m / counts).sum() / norm
    if aggregation == "microbatch_token_mean":
        return (terms * m).sum() / m.sum().clamp(min=1.0) / max(1, microbatches)
    if aggregation in ("seq_mean_token_sum_norm", "token_mean"):
        return (terms * m).sum() / norm
    raise ValueError(f"aggregate_loss: aggregation must be one of {AGGREGATIONS}, got "
                     f"{aggregation!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman 2020,
    "Approximating KL divergence"), with ``d = log pi_ref - log pi``: ``k1 = -d``,
    ``k2 = d^2 / 2``, ``k3 = exp(d) - d - 1`` (TRL's and verl's ``low_var_kl`` default;
    non-negative)."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return d.exp() - d - 1.0
    raise ValueError(f"kl_penalty: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def policy_objective(loss_type: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor, *, norm: float,
                     microbatches: int = 1, sequence_ids: torch.Tensor | None = None,
                     ref_logprobs: torch.Tensor | None = None, beta: float = 0.0,
                     kl_estimator: str = "k3",
                     **options: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One microbatch's policy loss: ``loss_type``'s per-token terms (:func:`policy_loss`, given
    ``options``: ``clip_eps``, ``clip_eps_high``, ``cispo_cap``, ``level``, ``weights``) plus
    ``beta`` times the reference KL (:func:`kl_penalty`, when ``ref_logprobs`` is given),
    aggregated by :func:`aggregate_loss`. ``parts`` adds ``kl_ref`` (per token, 0 off the mask)."""
    terms, parts = policy_loss(loss_type, logprobs, old_logprobs, advantages, mask,
                               sequence_ids=sequence_ids, **options)
    if ref_logprobs is not None:
        kl = torch.where(mask > 0, kl_penalty(logprobs, ref_logprobs, kl_estimator),
                         torch.zeros_like(logprobs))
        terms = terms + beta * kl
        parts["kl_ref"] = kl
    loss = aggregate_loss(loss_type, terms, mask, norm=norm, microbatches=microbatches,
                          sequence_ids=sequence_ids)
    return loss, parts


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
    ids = sequence_ids.reshape(values.shape).long()
    m = mask.to(values.dtype)
    return _sequence_sum(values * m, ids) / _sequence_sum(m, ids).clamp(min=1.0)


def is_correction_weights(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                          mask: torch.Tensor, *, mode: str, cap: float = 1.0, low: float = 0.5,
                          high: float = 2.0, sequence_ids: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, masked)`` per token of ``recipe.is_correction.mode``, ``r = pi_old / pi_gen``.

    * ``token_tis``: ``min(r, cap)``;
    * ``decoupled``: AReaL's decoupled objective, by name. The clip is taken against the proximal
      policy (``pi_old``: the trainer's logprobs at the start of the step, ``prev_logprobs``)
      and the behaviour policy (``pi_gen``) enters only through the capped weight
      ``min(pi_old / pi_gen, cap)``: the weights ``token_tis`` computes, here by their name;
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
    if mode in ("token_tis", "decoupled"):
        return truncated_is_weights(prev_logprobs, generation_logprobs, mask, cap), torch.zeros_like(on)
    if mode == "icepop":
        keep = (log_ratio >= log_low) & (log_ratio <= log_high)
        weights = log_ratio.clamp(max=log_high).exp()
    elif mode == "seq_mask_tis":
        seq = _sequence_mean(log_ratio, on, _row_sequence_ids(mask, sequence_ids))
        keep = (seq >= log_low) & (seq <= log_high)
        weights = truncated_is_weights(prev_logprobs, generation_logprobs, mask, cap)
    else:
        raise ValueError(f"is_correction_weights: mode must be one of token_tis, decoupled, "
                         f"seq_mask_tis, icepop, none; got {mode!r}")
    masked = on & ~keep
    return torch.where(masked, torch.zeros_like(weights), torch.where(on, weights, ones)), masked


def drop_outside_kept(lp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                      mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor,
                                 tuple[torch.Tensor, torch.Tensor]]:
    """Make the loss finite where the sampling controls' kept set moved (``recipe.top_k`` /
    ``top_p`` / ``min_p``): ``(lp, old, ref, mask, (dropped, ref_outside))``.

    Scored under the engine's processing, a token outside the kept set has logprob ``-inf``.
    On-policy every sampled token is inside it, but after an update the trainer's kept set
    (``lp``), or the one of the step's no-grad pass (``old``), can exclude a sampled token:
    such action tokens are **dropped** (mask 0: no policy-loss, KL or entropy term; ``lp`` and
    ``old`` set to 0 there, so nothing non-finite reaches the loss or its gradient) and counted
    (``dropped``; ``rl/outside_kept_fraction``). A token outside only the *reference's* kept set
    (``ref``, ``recipe.beta > 0``) keeps its policy term; its reference logprob becomes the
    policy's, detached (a zero KL term with a zero gradient), counted in ``ref_outside``."""
    actions = mask > 0
    dropped = actions & ~(torch.isfinite(lp) & torch.isfinite(old))
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    lp = torch.where(dropped, zero, lp)
    old = torch.where(dropped, zero.to(old.dtype), old)
    mask = mask * ~dropped
    ref_outside = torch.zeros_like(dropped)
    if ref is not None:
        ref_outside = (mask > 0) & ~torch.isfinite(ref)
        ref = torch.where(ref_outside, lp.detach().to(ref.dtype), ref)
    return lp, old, ref, mask, (dropped, ref_outside)


__all__ = ["IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS", "POLICY_LOSSES",
           "aggregate_loss", "approx_kl", "cispo_policy_loss", "clipped_policy_loss",
           "clipped_value_loss", "drop_outside_kept", "importance_log_ratio", "is_correction_weights", "kl_penalty",
           "loss_normalizer", "policy_loss", "policy_objective", "register_policy_loss",
           "sequence_token_counts", "truncated_is_weights"]

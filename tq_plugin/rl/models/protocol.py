"""What the recipes ask of ``model._target_``: the contract, and the start-up check that enforces it.

The recipe builds the policy (and PPO's value model) with ``hydra.utils.instantiate(cfg.model,
...)``, so ``model._target_`` is any callable following :class:`ModelFactory`, returning a module
following :class:`TokenModel`. One forward serves both training layouts (``tq.packing.layout``)
and generation:

* ``padded``: ``input_ids [B, S]``, one sequence per row, right-padded; no other input. Padding
  only ever follows a row's real tokens, so a causal model needs no attention mask.
* ``packed``: ``input_ids [1, T]``, several sequences back to back, with ``position_ids [1, T]``
  restarting at 0 per sequence and ``segment_ids [1, T]`` naming the sequence of each token.
  Attention must stay *within* a segment: a packed row must compute exactly what the sequences
  would alone (the recipe trains on either layout and expects the same update).
* media (``tq/staging=media``): ``image_patches [P, patch_dim]``, one patch per
  ``image_token_id`` placeholder in ``input_ids``, in order.

It returns one output per input token (the next-token distribution *after* each position, no
shift): logits ``[B, S, V]`` with ``V >= vocab_size`` for the policy, values ``[B, S]`` for the
value model. A model that drops or shifts a position breaks the column write-back much later,
far from the cause (``a packed tensor must have 1213 tokens ..., got shape (1, 1212, 19)``);
:func:`check_model` runs it on a tiny probe at start-up instead and names the rule it breaks.

**Scoring without logits** (optional, for large vocabularies). A policy whose ``forward`` takes
a ``score`` keyword (a :class:`TokenScoring`) returns, instead of logits, the next-token logprobs
(and entropy) of the tokens ``input_ids`` holds, ``([B, S], [B, S] | None)``, computed from its
final hidden states and output projection with :func:`TokenScoring.from_hidden` (memory-bounded:
only the scored positions are projected, one chunk of ``[chunk, V]`` at a time,
:mod:`tq_plugin.rl.models.logprobs`). It happens inside ``forward`` so a sharded (FSDP) model's
projection weights are gathered as for any forward. The trainer's no-grad logprob pass and its
training step both go through :func:`score_tokens`: that path for such a model, the same chunked
reduction over the full logits for any other. :func:`check_model` checks that both agree.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tq_plugin.config import ConfigError
from tq_plugin.lightning.layout import LAYOUTS, PackedIndex
from tq_plugin.rl.models.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    shifted_token_logprobs,
    shifted_token_logprobs_from_logits,
)
from tq_plugin.rollout.sampling import SamplingControls

ROLES = ("policy", "value")
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Probe sequences: two rows of different lengths, so padding and a segment boundary both occur.
_PROBE_LENGTHS = (5, 3)


class ModelInterfaceError(TypeError):
    """``model._target_`` built something that does not follow :class:`TokenModel`."""


@runtime_checkable
class TokenModel(Protocol):
    """The forward every recipe pass calls (generation, logprob/value passes, training)."""

    training: bool

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        image_patches: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Policy logits ``[B, S, V]`` (``V >= vocab_size``) or values ``[B, S]``; ``position_ids``
        and ``segment_ids`` come together, for a packed ``[1, T]`` row only."""
        ...

    def eval(self) -> nn.Module: ...

    def train(self, mode: bool = True) -> nn.Module: ...


class ModelFactory(Protocol):
    """``model._target_``: called with the ``model`` config's keys plus these keywords.

    ``output_token_ids`` (policy only): the tokens the policy may emit; sampling and training must
    see the same restricted distribution (e.g. a large negative logit bias elsewhere).
    The ``model`` schema's keys include ``gradient_checkpointing`` (recompute activations in
    backward) and ``dtype`` (the weights' dtype, :func:`weight_dtype`).
    ``value_head=True`` (value model only): return values ``[B, S]`` instead of logits.
    """

    def __call__(
        self,
        *,
        vocab_size: int,
        image_token_id: int,
        patch_dim: int | None,
        output_token_ids: list[int] | None = None,
        value_head: bool = False,
    ) -> TokenModel: ...


@dataclass(frozen=True)
class TokenScoring:
    """What ``forward(..., score=TokenScoring(...))`` computes instead of logits: the logprob of
    each token given the ones before it (``lp[b, t] = log p(ids[b, t] | ids[b, :t])``, 0 at
    ``t = 0``), under ``softmax(logits / temperature)`` in float32.

    ``mask [B, S]``: the positions that carry a loss (only they are projected; 0 elsewhere;
    ``None``: every position). ``chunk_tokens``: rows projected at a time
    (``tq.packing.logprob_chunk_tokens``). ``with_entropy``: also the entropy of the same
    distribution, a detached metric unless ``entropy_grad`` (the loss uses it). ``controls``:
    the sampling controls the engine applied after the temperature (``recipe.top_k`` /
    ``top_p`` / ``min_p`` / ``repetition_penalty``); when active the logprobs and entropy are
    the processed, renormalised distribution's (``-inf`` for a token outside its kept set;
    :mod:`tq_plugin.rl.models.logprobs`). ``positions [B, S]``: a packed batch's position ids
    (where each sequence starts, for the repetition penalty; ``None``: one sequence a row)."""

    mask: torch.Tensor | None = None
    temperature: float = 1.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    with_entropy: bool = False
    entropy_grad: bool = False
    controls: SamplingControls | None = None
    positions: torch.Tensor | None = None

    def _options(self) -> dict[str, Any]:
        return {"mask": self.mask, "chunk_tokens": self.chunk_tokens,
                "temperature": self.temperature, "with_entropy": self.with_entropy,
                "entropy_grad": self.entropy_grad, "controls": self.controls,
                "positions": self.positions}

    def from_hidden(self, hidden: torch.Tensor, input_ids: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """From the final hidden states ``[B, S, H]`` and the output projection
        (``logits = hidden @ weight.T + bias``)."""
        return shifted_token_logprobs(hidden, input_ids, weight, bias, **self._options())

    def from_logits(self, logits: torch.Tensor, input_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """From a model's full ``logits [B, S, V]`` (read a chunk of rows at a time)."""
        return shifted_token_logprobs_from_logits(logits, input_ids, **self._options())


def scores_tokens(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``score=`` (:class:`TokenScoring`)."""
    return "score" in inspect.signature(model.forward).parameters


def score_tokens(model: nn.Module, input_ids: torch.Tensor, scoring: TokenScoring,
                 **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [B, S], entropy [B, S] | None)`` of the policy ``model`` on ``input_ids``
    (``inputs``: the layout's and media's keywords): the one route of the trainer's logprob
    pass, training step and any recompute. A model that scores tokens itself
    (:func:`scores_tokens`) never builds the logits; any other's logits are reduced a chunk of
    rows at a time."""
    if scores_tokens(model):
        return model(input_ids, score=scoring, **inputs)
    return scoring.from_logits(model(input_ids, **inputs), input_ids)


def weight_dtype(dtype: str) -> torch.dtype:
    """``model.dtype``'s torch dtype (the weights'; a ``ConfigError`` naming the key otherwise)."""
    if dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"model.dtype: must be one of {list(WEIGHT_DTYPES)}, got {dtype!r}")
    return WEIGHT_DTYPES[dtype]


def output_bias(vocab_size: int, output_token_ids: list[int] | None) -> torch.Tensor:
    """The policy's logit bias ``[vocab_size]``: 0 on ``output_token_ids``, -1e4 elsewhere (all 0
    when ``None``). Sampling and the logprobs training recomputes then see the same restricted
    distribution, with no infinities."""
    if output_token_ids is None:
        return torch.zeros(vocab_size)
    bias = torch.full((vocab_size,), -1e4)
    bias[torch.tensor(output_token_ids)] = 0.0
    return bias


def scatter_patches(embeds: torch.Tensor, input_ids: torch.Tensor, image_token_id: int | None,
                    patch_embeds: torch.Tensor) -> torch.Tensor:
    """``embeds [B, S, D]`` with each ``image_token_id`` position replaced by the next row of
    ``patch_embeds [P, D]``, in order; the counts must match."""
    slots = input_ids == image_token_id
    if int(slots.sum()) != patch_embeds.shape[0]:
        raise ValueError(f"image_patches holds {patch_embeds.shape[0]} patches but the batch has "
                         f"{int(slots.sum())} image placeholder tokens")
    return embeds.masked_scatter(slots.unsqueeze(-1), patch_embeds.to(embeds.dtype))


def _fail(model: nn.Module, role: str, rule: str) -> None:
    raise ModelInterfaceError(
        f"model._target_ built {type(model).__qualname__} as the {role} model, which breaks the "
        f"model interface (tq_plugin.rl.models.protocol.TokenModel): {rule}"
    )


def _call(model: nn.Module, role: str, layout: str, ids: torch.Tensor, vocab_size: int,
          **kwargs) -> torch.Tensor:
    try:
        out = model(ids, **kwargs)
    except TypeError as exc:
        if kwargs and "keyword" in str(exc):
            _fail(model, role, f"the {layout} layout passes {sorted(kwargs)} as keywords ({exc})")
        raise
    except (IndexError, RuntimeError, ValueError) as exc:
        raise ModelInterfaceError(
            f"model._target_ built {type(model).__qualname__} as the {role} model, whose forward "
            f"fails on the {layout} probe (input_ids {tuple(ids.shape)} with token ids < the "
            f"task's vocab_size {vocab_size}): {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor):
        _fail(model, role, f"forward must return a tensor, got {type(out).__name__}")
    if not torch.isfinite(out).all():
        _fail(model, role, f"forward returned non-finite values for the {layout} probe")
    return out


def _expect_shape(model: nn.Module, role: str, layout: str, ids: torch.Tensor, out: torch.Tensor,
                  vocab_size: int) -> None:
    b, s = ids.shape
    if role == "value":
        ok, want = tuple(out.shape) == (b, s), f"values [{b}, {s}]"
    else:
        ok = out.dim() == 3 and tuple(out.shape[:2]) == (b, s) and out.shape[2] >= vocab_size
        want = f"logits [{b}, {s}, V] with V >= vocab_size ({vocab_size})"
    if not ok:
        _fail(model, role, f"{layout} input_ids {tuple(ids.shape)} must give {want} (one output "
                           f"per input token, not shifted), got {tuple(out.shape)}")


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    return torch.allclose(a, b, rtol=1e-3, atol=1e-4), float((a - b).abs().max())


def _check_scoring(model: nn.Module, ids: torch.Tensor, logits: torch.Tensor) -> None:
    """``forward(score=...)`` must give the logprobs and entropy of the logits ``forward``
    returns (the same hidden states and projection)."""
    try:
        lp, ent = model(ids, score=TokenScoring(with_entropy=True))
    except (TypeError, IndexError, RuntimeError, ValueError) as exc:
        raise ModelInterfaceError(
            f"model._target_ built {type(model).__qualname__} as the policy model, whose "
            f"forward(score=TokenScoring(...)) fails on the padded probe: "
            f"{type(exc).__name__}: {exc}") from exc
    plain = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    want_lp = plain.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    want_ent = -(plain.exp() * plain).sum(-1)
    for name, got, want in (("logprobs", lp, want_lp), ("entropy", ent, want_ent)):
        if got is None or tuple(got.shape) != tuple(ids.shape):
            _fail(model, "policy", f"forward(score=...) must return (logprobs, entropy) "
                                   f"[{ids.shape[0]}, {ids.shape[1]}], got {name} "
                                   f"{None if got is None else tuple(got.shape)}")
        ok, gap = _close(got[:, 1:].float(), want)
        if not ok:
            _fail(model, "policy", f"forward(score=...) must give the {name} of the logits "
                                   f"forward returns (the same hidden states and output "
                                   f"projection), but they differ by {gap:.3g}")


@torch.no_grad()
def check_model(
    model: nn.Module,
    *,
    role: str,
    vocab_size: int,
    layout: str,
    media: bool = False,
) -> None:
    """Run ``model`` on a tiny probe in every layout the run uses; raise
    :class:`ModelInterfaceError` naming the broken rule, before any rollout or write.

    Checks: the output shape per layout; causality (a later token never changes an earlier
    output, which generation on a right-padded buffer relies on); for a policy that scores
    tokens itself (``forward(score=...)``), that its logprobs and entropy are those of its
    logits; under ``layout="packed"``
    that a packed row equals its sequences run alone (no attention across segments); under
    media, that forward takes ``image_patches``. The model's train/eval mode is restored.
    """
    if role not in ROLES:
        raise ValueError(f"role: must be one of {list(ROLES)}, got {role!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be one of {list(LAYOUTS)}, got {layout!r}")
    if not isinstance(model, nn.Module):
        _fail(model, role, "it must be a torch.nn.Module (the recipe trains its parameters)")
    if media and "image_patches" not in inspect.signature(model.forward).parameters:
        _fail(model, role, "tq/staging=media needs forward(..., image_patches=[P, patch_dim])")
    device = next(model.parameters()).device
    lengths = torch.tensor(_PROBE_LENGTHS)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (len(_PROBE_LENGTHS), int(lengths.max())), generator=gen)
    ids = ids.masked_fill(torch.arange(ids.shape[1]) >= lengths.unsqueeze(1), 0).to(device)
    was_training = model.training
    model.eval()
    try:
        padded = _call(model, role, "padded", ids, vocab_size)
        _expect_shape(model, role, "padded", ids, padded, vocab_size)
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % vocab_size
        ok, gap = _close(_call(model, role, "padded", changed, vocab_size)[:, :-1], padded[:, :-1])
        if not ok:
            _fail(model, role, f"it must be causal: changing the last token moved earlier "
                               f"outputs by {gap:.3g}")
        if role == "policy" and scores_tokens(model):
            _check_scoring(model, ids, padded)
        if layout == "packed":
            index = PackedIndex(lengths)
            real = torch.arange(ids.shape[1]) < lengths.unsqueeze(1)
            row = ids[real.to(device)].unsqueeze(0)
            packed = _call(model, role, "packed", row, vocab_size,
                           position_ids=index.position_ids.unsqueeze(0).to(device),
                           segment_ids=index.segment_ids.unsqueeze(0).to(device))
            _expect_shape(model, role, "packed", row, packed, vocab_size)
            ok, gap = _close(packed[0], padded[real.to(device)])
            if not ok:
                _fail(model, role, f"a packed row must equal its sequences run alone (attention "
                                   f"only within a segment, positions from position_ids), but "
                                   f"they differ by {gap:.3g}; or train with "
                                   f"tq.packing.layout=padded")
    finally:
        model.train(was_training)


def check_models(policy: nn.Module, value: nn.Module | None, *, vocab_size: int, layout: str,
                 media: bool = False) -> None:
    """:func:`check_model` on the policy and, when there is one, the value model."""
    check_model(policy, role="policy", vocab_size=vocab_size, layout=layout, media=media)
    if value is not None:
        check_model(value, role="value", vocab_size=vocab_size, layout=layout, media=media)


__all__ = ["ModelFactory", "ModelInterfaceError", "TokenModel", "TokenScoring", "check_model",
           "check_models", "output_bias", "scatter_patches", "score_tokens", "scores_tokens",
           "weight_dtype"]

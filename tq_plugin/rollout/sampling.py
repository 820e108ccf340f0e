"""The sampling controls beyond temperature (``top_k``, ``top_p``, ``min_p``,
``repetition_penalty``) as one logits processing, shared by the engines that sample and by the
trainer that scores what they sampled.

An engine that samples from a processed distribution reports the logprob of the sampled token
under *that* distribution (``generation_logprobs``), and the trainer recomputes its logprobs
under the same processing (``tq_plugin.rl.models.logprobs``), so the on-policy importance
ratio ``pi_old / pi_gen`` is 1: scoring the full softmax instead would bias every ratio by the
kept mass (TRL fixed that in v1.17). One function, :func:`process_logits`, defines the
processing for both sides.

The order is vLLM's (``vllm.v1.sample.sampler``), the one engine whose processing is not ours:

1. ``repetition_penalty`` (1.0: off) on every token seen so far in the sequence (prompt and
   completion): a positive logit is divided by it, a negative one multiplied (HF's and vLLM's
   rule). It commutes with the temperature (``T > 0`` keeps the sign), so it is applied to the
   tempered logits here.
2. the temperature (the caller's: logits come in tempered);
3. ``min_p`` (0.0: off): tokens whose probability is below ``min_p`` times the largest are
   dropped (``z < z_max + log(min_p)``);
4. ``top_k`` (0: off, as TRL's ``top_k=0`` and vLLM's ``0``): the ``k`` largest logits are
   kept (ties with the k-th included);
5. ``top_p`` (1.0: off): over what is left, renormalised, the smallest set of the most likely
   tokens whose mass reaches ``top_p``: a token is dropped when the mass of the tokens below
   it (ascending cumulative sum, itself included) is at most ``1 - top_p``; the most likely
   token always stays.

Dropped tokens get ``-inf``: the renormalisation is the softmax over what is left. HF's
``generate`` applies ``min_p`` after ``top_p`` instead of before; the two orders differ only
when both are on, and no engine here uses HF's ``generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tq_plugin.config.recipe_schema import sampling_problem


@dataclass(frozen=True)
class SamplingControls:
    """The four controls (module docstring); the defaults leave the distribution untouched."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        problem = sampling_problem(self.top_k, self.top_p, self.min_p, self.repetition_penalty)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")

    @classmethod
    def of(cls, options: Any) -> SamplingControls:
        """The controls ``options`` (a ``recipe`` config) holds."""
        return cls(int(options.top_k), float(options.top_p), float(options.min_p),
                   float(options.repetition_penalty))

    @property
    def active(self) -> bool:
        """Whether any control changes the distribution."""
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0 \
            or self.repetition_penalty != 1.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0

    def active_keys(self) -> list[str]:
        """The names of the controls that are on, in the recipe's spelling."""
        on = {"top_k": bool(self.top_k), "top_p": self.top_p < 1.0, "min_p": self.min_p > 0.0,
              "repetition_penalty": self.repetition_penalty != 1.0}
        return [k for k, v in on.items() if v]


def penalty_factor(z: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``[c, V]`` multipliers of the repetition penalty: ``1 / penalty`` on seen tokens with a
    positive logit, ``penalty`` on seen tokens with a non-positive one, 1 elsewhere (also the
    derivative of the penalised logits with respect to ``z``)."""
    on_seen = torch.where(z > 0, z.new_tensor(1.0 / penalty), z.new_tensor(penalty))
    return torch.where(seen[:, : z.shape[-1]], on_seen, z.new_tensor(1.0))


def process_logits(z: torch.Tensor, controls: SamplingControls,
                   seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(processed [c, V], penalty factor [c, V] | None)`` of the tempered float logits
    ``z [c, V]`` (overwritten: pass a tensor of your own) under ``controls`` (module docstring).
    ``seen [c, V']`` (bool, ``V' >= V``): the tokens each row's sequence holds so far, needed
    when ``repetition_penalty != 1``. Dropped tokens are ``-inf``; the factor (the penalty's
    derivative, for a backward pass) is ``None`` without a penalty."""
    factor = None
    if controls.penalised:
        if seen is None:
            raise ValueError("repetition_penalty needs the tokens seen so far (seen=)")
        factor = penalty_factor(z, seen, controls.repetition_penalty)
        z.mul_(factor)
    if controls.min_p > 0.0:
        floor = z.amax(-1, keepdim=True) + math.log(controls.min_p)
        z.masked_fill_(z < floor, float("-inf"))
    if controls.top_k and controls.top_k < z.shape[-1]:
        kth = z.topk(controls.top_k, dim=-1).values[:, -1:]
        z.masked_fill_(z < kth, float("-inf"))
    if controls.top_p < 1.0:
        ascending = z.sort(dim=-1).values
        mass = ascending.softmax(dim=-1).cumsum_(dim=-1)
        dropped = (mass <= 1.0 - controls.top_p).sum(-1, keepdim=True)
        threshold = ascending.gather(-1, dropped.clamp_(max=z.shape[-1] - 1))
        del ascending, mass
        z.masked_fill_(z < threshold, float("-inf"))
    return z, factor


class RowProcessing:
    """:func:`process_logits` for the rows of a scoring pass, a chunk at a time: the trainer's
    side of the processing. Row ``i`` predicts the token after flat position ``last[i]`` of
    ``ids`` (the flattened ``[B, S]`` batch), and its sequence started at flat position
    ``start[i]``: the repetition penalty's tokens seen so far are ``ids[start[i] : last[i] +
    1]`` (prompt and completion so far, as the engine saw them). Called as
    ``processing(z, s, e)`` on the tempered logits of rows ``s:e``; one ``[e - s, V]`` bool and
    one ``[e - s, longest context]`` index tensor more per chunk, no loop over tokens."""

    def __init__(self, controls: SamplingControls, ids: torch.Tensor, last: torch.Tensor,
                 start: torch.Tensor) -> None:
        self.controls, self.ids, self.last, self.start = controls, ids, last, start

    def seen(self, s: int, e: int, vocab: int) -> torch.Tensor:
        """``[e - s, vocab]`` bool: the tokens rows ``s:e`` have seen."""
        last, start = self.last[s:e], self.start[s:e]
        width = int((last - start).max()) + 1 if e > s else 1
        at = last.unsqueeze(1) - torch.arange(width, device=last.device)
        toks = self.ids[at.clamp(min=0)]
        toks = toks.masked_fill((at < start.unsqueeze(1)) | (toks < 0) | (toks >= vocab), vocab)
        seen = torch.zeros(e - s, vocab + 1, dtype=torch.bool, device=last.device)
        return seen.scatter_(1, toks, True)[:, :vocab]

    def __call__(self, z: torch.Tensor, s: int, e: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seen = self.seen(s, e, z.shape[-1]) if self.controls.penalised else None
        return process_logits(z, self.controls, seen)


def seen_from_prompts(prompts: list[list[int]] | tuple, vocab: int,
                      device: torch.device | None = None) -> torch.Tensor:
    """``[B, vocab]`` bool: the ids each prompt holds (ids outside the vocabulary ignored)."""
    if not len(prompts):
        return torch.zeros(0, vocab, dtype=torch.bool, device=device)
    # One padded [B, longest] index tensor (each prompt converted whole, no loop over tokens);
    # padding and ids outside the vocabulary go to an extra column that is dropped.
    ids = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts], batch_first=True,
        padding_value=vocab).to(device)
    ids = ids.masked_fill((ids < 0) | (ids > vocab), vocab)
    seen = torch.zeros(len(prompts), vocab + 1, dtype=torch.bool, device=device)
    return seen.scatter_(1, ids, True)[:, :vocab]


__all__ = ["RowProcessing", "SamplingControls", "penalty_factor", "process_logits",
           "seen_from_prompts"]

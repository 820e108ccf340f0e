"""Batched sampling from a token model, as the recipes did before the engine seam.

The sampler itself is the native engine's (``tq_plugin.rollout.engines.native``); this keeps the
recipe-level call (a policy, contexts and the run's generator, stopping after the task's
``EOS``) for code and tests that sample a module directly.
"""

from __future__ import annotations

import torch

from tq_plugin.rl.tasks.pattern import EOS
from tq_plugin.rollout.engine import SamplingParams
from tq_plugin.rollout.engines.native import decode, device_of


def sample_continuations(
    policy: torch.nn.Module,
    contexts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    image_patches: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample up to ``max_new_tokens`` per context (stopping after ``EOS``), one seed per context
    drawn from ``generator``; returns the new tokens and their tempered logprobs."""
    seeds = torch.randint(0, 2**31 - 1, (len(contexts),), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=(EOS,))
    out = decode(policy, contexts, params, seeds=seeds, image_patches=image_patches)
    return [c.token_ids for c in out], [c.logprobs for c in out]


__all__ = ["device_of", "sample_continuations"]

"""``engine=native``: the recipes' own sampler over any token model.

A model with a cached step is decoded with its KV cache: one prefill of the left-padded prompts,
then one forward of the new tokens per step (:func:`~tq_plugin.rollout.engine.cached_decode`).
That is a model with ``decode_step`` (:class:`~tq_plugin.rl.models.tiny.TinyTransformer`'s) or a
policy wrapping a transformers causal LM (its ``backbone``, as ``model=hf_causal_lm``'s does,
with the policy's output bias), unless it reads pixels or its weights are sharded (the wrapper's
own forward gathers them). Any other model: all rows advance together on one right-padded
buffer, one full forward per new token; causal attention makes the padding after each row's
current end invisible to it. It serves any module
with the forward ``tq_plugin.rl.models.protocol.TokenModel`` documents (``input_ids [B, S]``,
optionally ``image_patches``; logits ``[B, S, V]`` for the next token after each position), so
it is the one engine that reads staged pixels. Colocated, it holds the trainer's own policy:
an update names the same tensors and copies nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tq_plugin.rollout.engine import (
    CachedStep,
    Completion,
    InflightUpdates,
    NamedWeights,
    SamplingParams,
    allowed_mask,
    cached_decode,
    completions,
    copy_named,
    draw_uniforms,
    restrict,
    sample_from,
)
from tq_plugin.rollout.engines.hf import transformers_step
from tq_plugin.rollout.sampling import seen_from_prompts

# Pads the token buffer; never read (causal attention, right padding).
_PAD = 0


def device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s weights live (the CPU for a model without parameters)."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def cached_step(model: nn.Module) -> CachedStep | None:
    """``model``'s cached decoding step (module docstring), else ``None``."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return None
    own = getattr(model, "decode_step", None)
    if own is not None:
        return own
    backbone = getattr(model, "backbone", None)
    can_generate = getattr(backbone, "can_generate", None)
    if backbone is None or can_generate is None or not can_generate():
        return None
    return transformers_step(backbone, getattr(model, "out_bias", None))


@torch.no_grad()
def decode(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
           seeds: Sequence[int], image_patches: torch.Tensor | None = None,
           inflight: InflightUpdates | None = None,
           version: Callable[[], int] | None = None) -> list[Completion]:
    """Sample up to ``params.max_new_tokens`` per prompt with ``model`` (module docstring).
    ``inflight``: weights applied between chunks of new tokens, each token's version recorded
    (:class:`~tq_plugin.rollout.engine.InflightUpdates`; without a cache, ``kv`` is moot: every
    step is a full forward under the weights of the moment).

    The token buffer lives on the model's device; each step's next-token distribution comes back
    to the host (one ``[rows, vocab]`` copy per token), where it is drawn at the request's
    uniforms (:func:`~tq_plugin.rollout.engine.draw_uniforms`).
    """
    step = cached_step(model) if image_patches is None else None
    if step is not None:
        was_training = model.training
        model.eval()
        try:
            return cached_decode(step, prompts, params, seeds=seeds, device=device_of(model),
                                 inflight=inflight, version=version)
        finally:
            model.train(was_training)
    device = device_of(model)
    b, steps = len(prompts), params.max_new_tokens
    lens = torch.tensor([len(p) for p in prompts])
    buf = torch.full((b, int(lens.max()) + steps), _PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(list(p))
    buf = buf.to(device)
    if image_patches is not None:
        image_patches = image_patches.to(device)
    u = draw_uniforms(seeds, steps)
    stop = torch.tensor(list(params.stop_token_ids) or [-1])
    rows = torch.arange(b)
    out_tok = torch.full((b, steps), _PAD, dtype=torch.long)
    out_lp = torch.zeros(b, steps)
    out_ver = None if inflight is None else torch.zeros(b, steps, dtype=torch.long)
    active = torch.ones(b, dtype=torch.bool)
    n_new = torch.zeros(b, dtype=torch.long)
    allowed, seen = None, None
    controls = params.controls
    was_training = model.training
    model.eval()
    try:
        for step in range(steps):
            if inflight is not None and inflight.due(step):
                inflight.poll()
            width = int(lens.max())
            kwargs = {} if image_patches is None else {"image_patches": image_patches}
            logits = model(buf[:, :width], **kwargs)
            last = logits[rows.to(device), (lens - 1).to(device)]
            if allowed is None:
                allowed = allowed_mask(last.shape[-1], params.allowed_token_ids)
            if seen is None and controls.penalised:
                seen = seen_from_prompts(prompts, last.shape[-1])
            tok, lp = sample_from(restrict(last, allowed), params.temperature, u[:, step],
                                  controls, seen)
            if seen is not None:
                seen[rows, tok] = True
            out_tok[active, step] = tok[active]
            out_lp[active, step] = lp[active]
            if out_ver is not None:
                out_ver[:, step] = version()
            buf[rows[active].to(device), lens[active].to(device)] = tok[active].to(device)
            lens = lens + active.long()
            n_new += active.long()
            active = active & ~torch.isin(tok, stop)
            if not active.any():
                break
    finally:
        model.train(was_training)
    return completions(out_tok, out_lp, n_new, out_ver)


class NativeEngine:
    """:class:`~tq_plugin.rollout.engine.RolloutEngine` over ``model`` (module docstring)."""

    name = "native"

    def __init__(self, model: nn.Module, *, weight_version: int = 0) -> None:
        self.model: nn.Module | None = model
        self.weight_version = weight_version
        # In-flight weight updates (``recipe.inflight_updates``): set by the rollout worker.
        self.inflight: InflightUpdates | None = None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Sequence[int], image_patches: torch.Tensor | None = None
                 ) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("engine=native: generate after close")
        return decode(self.model, prompts, params, seeds=seeds, image_patches=image_patches,
                      inflight=self.inflight, version=lambda: self.weight_version)

    def update_weights(self, weights: NamedWeights, *, version: int) -> None:
        """Copy ``weights`` (the model's parameter names) in; tensors that already are the
        model's own (the colocated trainer's policy) are skipped."""
        copy_named(self.model, weights, engine=self.name)
        self.weight_version = version

    def close(self) -> None:
        self.model = None


__all__ = ["NativeEngine", "cached_step", "decode", "device_of"]

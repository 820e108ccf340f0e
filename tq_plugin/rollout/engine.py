"""The rollout-engine seam: what the recipes ask of whatever generates their continuations.

An engine takes a batch of prompts as token ids and returns, per prompt, the sampled
continuation and the logprob of each sampled token under the distribution it was drawn from:
the temperature-scaled, output-restricted distribution, which is the one the trainer recomputes
(``generation_logprobs`` next to ``prev_logprobs``). It holds the ``weight_version`` of the
weights it serves, takes new ones through ``update_weights`` and releases what it holds in
``close``. Three engines follow it (``tq_plugin.rollout.engines``): ``native`` (the recipes'
own sampler over any token model), ``hf`` (a transformers causal LM with a KV cache) and
``vllm`` (vLLM in-process).

Sampling is reproducible per request: each prompt carries a seed, and the same prompt, seed and
weights give the same continuation whatever else is in the batch. ``native`` and ``hf`` draw
through :func:`draw_uniforms` / :func:`sample_from`, so on the same weights they agree token
for token; vLLM draws from its own per-request generators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from tq_plugin.config import ConfigError
from tq_plugin.config.recipe_schema import sampling_problem
from tq_plugin.rollout.sampling import (
    SamplingControls,
    process_logits,
    seen_from_prompts,
)

# Weights as an engine takes them: (name, tensor) pairs named as the engine's model names them
# (an HF checkpoint's names for ``hf`` and ``vllm``, the module's own for ``native``).
NamedWeights = Iterable[tuple[str, torch.Tensor]]
# Beside an engine's starting checkpoint: the PEFT adapter directory of a policy trained with
# LoRA (``model.lora``); the engine loads it onto the checkpoint's base and syncs only it.
ADAPTER_DIR = "adapter"


def synced_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a weight sync carries: a model with frozen weights (LoRA) syncs its
    trainable ones only (the adapters; the frozen base is the engine's from the start), any
    other model all of them."""
    named = list(model.named_parameters())
    trained = [(n, p) for n, p in named if p.requires_grad]
    return trained if trained and len(trained) < len(named) else named


class StreamedWeights:
    """Named weights produced one tensor at a time, whose names and shapes are known up front:
    an engine checks them all before it copies anything, then takes each tensor as it comes
    (and may drop it before the next is made). What a sharded trainer hands its engine: full
    tensors gathered from the shards a bounded bucket at a time, never the whole model at once.

    ``shapes``: every tensor's name and full shape, in stream order; ``stream()``: a fresh
    iterator of ``(name, tensor)`` over the same names, in that order. A stream that fails part
    way (a tensor that is not what was announced, a failed gather) raises with the engine's
    weights partly replaced and its ``weight_version`` unchanged: the sync did not happen, and
    the run stops on the error.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]],
                 stream: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.stream = stream

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.stream():
            if tuple(tensor.shape) != self.shapes.get(name):
                raise ValueError(f"StreamedWeights: {name!r} came as {tuple(tensor.shape)}, "
                                 f"announced as {self.shapes.get(name)}")
            yield name, tensor


class EngineError(ConfigError):
    """An engine cannot start or serve with this configuration; the message names ``engine``
    and what to do. A ``ConfigError``, so ``tq-train`` prints the message alone."""


@dataclass(frozen=True)
class SamplingParams:
    """How one batch is sampled.

    ``stop_token_ids``: a continuation ends after the first of these (the token included).
    ``allowed_token_ids``: the tokens the policy may emit (all when ``None``); the others get
    no probability, as the trainer's logit bias gives them none. ``temperature=0`` is greedy
    decoding (its logprobs are the untempered distribution's).
    ``top_k`` / ``top_p`` / ``min_p`` / ``repetition_penalty``: the processing of
    :mod:`tq_plugin.rollout.sampling` (the defaults leave the distribution untouched); the
    reported logprobs are the processed distribution's.
    """

    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        problem = sampling_problem(self.top_k, self.top_p, self.min_p, self.repetition_penalty)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")

    @property
    def controls(self) -> SamplingControls:
        """The processing beyond the temperature (:mod:`tq_plugin.rollout.sampling`)."""
        return SamplingControls(self.top_k, self.top_p, self.min_p, self.repetition_penalty)


@dataclass
class Completion:
    """One prompt's continuation: sampled ids (a stop token included when emitted), the
    logprob of each, and (with in-flight weight updates on) the weight version that produced
    each (``versions``; ``None`` otherwise)."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = None


# How the KV cache of the sequences in flight is treated when new weights arrive mid-generation.
INFLIGHT_KV = ("keep", "recompute")


@dataclass
class InflightUpdates:
    """Weights applied between decode steps (``recipe.inflight``): generation runs in chunks of
    ``chunk_tokens`` new tokens; before each chunk after the first, ``poll()`` loads newer
    weights into the engine if there are any (through its ``update_weights``, so its
    ``weight_version`` moves) and says whether it did. No sequence is dropped. ``kv``: the
    cache of the tokens so far is kept as the old weights computed it (``keep``: PipelineRL's
    and TRL's choice, no extra compute) or recomputed under the new weights with one prefill of
    every sequence so far (``recompute``: the next tokens see exactly the new policy's context).
    Each token's logprob is the one the weights that sampled it gave, and its version is
    recorded (:attr:`Completion.versions`)."""

    poll: Callable[[], bool]
    chunk_tokens: int = 4
    kv: str = "keep"

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"recipe.inflight.chunk_tokens: must be >= 1, got {self.chunk_tokens}")
        if self.kv not in INFLIGHT_KV:
            raise ValueError(f"recipe.inflight.kv: must be one of {list(INFLIGHT_KV)}, got {self.kv!r}")

    def due(self, t: int) -> bool:
        """Whether new weights are looked for before new token ``t`` (a chunk boundary)."""
        return t > 0 and t % self.chunk_tokens == 0


def completions(tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor,
                versions: torch.Tensor | None) -> list[Completion]:
    """Each row's first ``counts[i]`` tokens, logprobs and (when recorded) versions."""
    n = counts.tolist()
    return [Completion(tokens[i, : n[i]].tolist(), logprobs[i, : n[i]].tolist(),
                       None if versions is None else versions[i, : n[i]].tolist())
            for i in range(len(n))]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout worker drives (see the module docstring)."""

    name: str
    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Sequence[int], image_patches: torch.Tensor | None = None
                 ) -> list[Completion]:
        """One :class:`Completion` per prompt, in order. ``image_patches``: one row per image
        placeholder over all prompts, in order (engines that read pixels only)."""
        ...

    def update_weights(self, weights: NamedWeights, *, version: int) -> None:
        """Serve ``weights`` from the next call on, as ``version``; a partial update raises."""
        ...

    def close(self) -> None:
        """Release the engine's model and memory (idempotent)."""
        ...


def draw_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """``[len(seeds), steps]`` uniforms in [0, 1), row ``i`` from a generator seeded with
    ``seeds[i]``: one draw per request and call, never per token."""
    out = torch.empty(len(seeds), steps, dtype=torch.float64)
    for i, seed in enumerate(seeds):
        out[i] = torch.rand(steps, generator=torch.Generator().manual_seed(int(seed)),
                            dtype=torch.float64)
    return out


def restrict(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits [B, V]`` with every token outside ``allowed`` (a bool ``[V]`` mask) at -inf."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed[: logits.shape[-1]].to(logits.device), float("-inf"))


def allowed_mask(vocab: int, allowed_token_ids: Sequence[int] | None) -> torch.Tensor | None:
    if allowed_token_ids is None:
        return None
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.tensor(list(allowed_token_ids))] = True
    return mask


def sample_from(logits: torch.Tensor, temperature: float, u: torch.Tensor,
                controls: SamplingControls | None = None, seen: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B], logprobs [B])``: one draw per row from ``softmax(logits / T)`` by inverse
    CDF at ``u [B]``, and the draw's logprob under that distribution (host tensors).
    ``temperature=0``: the most likely token, with its untempered logprob. ``controls`` (when
    active): the tempered logits are processed first (``seen [B, V]``: each row's tokens so
    far, for the repetition penalty) and both the draw and its logprob are the processed
    distribution's (:func:`~tq_plugin.rollout.sampling.process_logits`)."""
    z = logits.float() / (temperature or 1.0)
    if controls is not None and controls.active:
        z, _ = process_logits(z, controls, None if seen is None else seen.to(z.device))
    logp = torch.log_softmax(z, dim=-1).cpu()
    if temperature == 0:
        tok = logp.argmax(-1)
        return tok, logp.gather(1, tok.unsqueeze(1)).squeeze(1)
    cdf = logp.double().exp().cumsum(-1)
    # The first token whose cdf passes u: a zero-probability token repeats its predecessor's
    # cdf, so it is never picked; scaling u by the total keeps rounding from running past the end.
    tok = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return tok, logp.gather(1, tok.unsqueeze(1)).squeeze(1)


# One cached decoding step: (new ids [B, s], attention mask [B, cached + s] (0: left padding),
# position ids [B, s], the cache the last step returned or None) -> (the last position's
# logits [B, V], the cache).
CachedStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any],
                      tuple[torch.Tensor, Any]]


@torch.no_grad()
def cached_decode(step: CachedStep, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  *, seeds: Sequence[int], device: torch.device,
                  inflight: InflightUpdates | None = None,
                  version: Callable[[], int] | None = None) -> list[Completion]:
    """Sample up to ``params.max_new_tokens`` per prompt: one prefill of the left-padded
    prompts, then one cached ``step`` per new token (``engine=hf``; ``engine=native`` for a model with a cached step).
    ``inflight``: new weights are looked for between chunks (:class:`InflightUpdates`), and
    each token's version (``version()`` when it was sampled) is recorded."""
    b, steps = len(prompts), params.max_new_tokens
    width = max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's next token is at the end
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    u = draw_uniforms(seeds, steps)
    stop = torch.tensor(list(params.stop_token_ids) or [-1])
    out_tok = torch.zeros(b, steps, dtype=torch.long)
    out_lp = torch.zeros(b, steps)
    out_ver = None if inflight is None else torch.zeros(b, steps, dtype=torch.long)
    fed = None if inflight is None else torch.zeros(b, steps, dtype=torch.long)
    prompt_ids = ids
    active = torch.ones(b, dtype=torch.bool)
    n_new = torch.zeros(b, dtype=torch.long)
    allowed, cache, seen = None, None, None
    controls = params.controls
    for t in range(steps):
        if inflight is not None and inflight.due(t) and inflight.poll() and inflight.kv == "recompute":
            # New weights: one prefill of every sequence so far under them (the left-padded
            # prompts and every token fed since), the cache of the old weights dropped.
            ids = torch.cat([prompt_ids, fed[:, :t].to(device)], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = None
        last, cache = step(ids, mask, positions, cache)
        last = last.float().cpu()
        if allowed is None:
            allowed = allowed_mask(last.shape[-1], params.allowed_token_ids)
        if seen is None and controls.penalised:
            seen = seen_from_prompts(prompts, last.shape[-1])
        tok, lp = sample_from(restrict(last, allowed), params.temperature, u[:, t], controls,
                              seen)
        if seen is not None:
            seen[torch.arange(b), tok] = True
        out_tok[active, t] = tok[active]
        out_lp[active, t] = lp[active]
        if out_ver is not None:
            out_ver[:, t] = version()
            fed[:, t] = tok
        n_new += active.long()
        active = active & ~torch.isin(tok, stop)
        if not active.any():
            break
        ids = tok.unsqueeze(1).to(device)
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=device)], dim=1)
    return completions(out_tok, out_lp, n_new, out_ver)


def copy_named(model: torch.nn.Module, weights: NamedWeights, *, engine: str,
               own: dict[str, torch.nn.Parameter] | None = None) -> None:
    """Copy ``weights`` into ``model``'s parameters by name; every synced parameter
    (:func:`synced_parameters`: all of them, or a LoRA model's adapters) must be named with its
    shape, checked before anything is copied. ``StreamedWeights`` are checked by their announced
    shapes and copied as they stream (each tensor dropped before the next is made). ``own``:
    ``dict(synced_parameters(model))`` kept by an engine whose model's parameters never change
    (else it is found again on each call)."""
    own = dict(synced_parameters(model)) if own is None else own
    if isinstance(weights, StreamedWeights):
        shapes, stream = weights.shapes, iter(weights)
    else:
        given = dict(weights)
        shapes, stream = {n: tuple(t.shape) for n, t in given.items()}, iter(given.items())
    missing, unknown = sorted(set(own) - set(shapes)), sorted(set(shapes) - set(own))
    if missing or unknown:
        raise ValueError(f"engine={engine}: update_weights must name every parameter "
                         f"(missing {missing[:3]}, unknown {unknown[:3]})")
    wrong = [n for n, shape in shapes.items() if tuple(shape) != tuple(own[n].shape)]
    if wrong:
        raise ValueError(f"engine={engine}: update_weights shapes differ for {wrong[:3]}")
    with torch.no_grad():
        if not isinstance(weights, StreamedWeights):  # one fused copy of every tensor
            pairs = [(own[n], t) for n, t in given.items() if t is not own[n]]
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
            return
        for name, tensor in stream:
            if tensor is not own[name]:  # the colocated native engine serves the policy itself
                own[name].copy_(tensor)
            del tensor


__all__ = ["ADAPTER_DIR", "INFLIGHT_KV", "CachedStep", "Completion", "EngineError", "InflightUpdates",
           "NamedWeights", "RolloutEngine", "SamplingParams", "StreamedWeights", "allowed_mask",
           "cached_decode", "completions", "copy_named", "draw_uniforms", "restrict", "sample_from",
           "synced_parameters"]

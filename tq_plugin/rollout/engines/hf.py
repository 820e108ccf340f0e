"""``engine=hf``: a transformers causal LM serving the policy, decoded with a KV cache.

The engine loads its own copy of the policy from an HF checkpoint directory (``config.json`` +
safetensors, written by ``save_pretrained``; nothing is downloaded) and decodes every batch in
one prefill (the last position's logits only) plus one cached forward per new token
(:func:`~tq_plugin.rollout.engine.cached_decode`, which ``engine=native`` uses too for a model
with a cached step).
Prompts are left-padded with an attention mask and positions counted from each row's first real
token, so a row computes what it would alone. Sampling shares the native engine's
draws (``tq_plugin.rollout.engine``): on the same weights, prompts and seeds both engines return
the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tq_plugin.rollout.engine import (
    ADAPTER_DIR,
    CachedStep,
    Completion,
    EngineError,
    InflightUpdates,
    NamedWeights,
    SamplingParams,
    cached_decode,
    copy_named,
    synced_parameters,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint_model(path: str | Path, dtype: str) -> torch.nn.Module:
    """The causal LM saved in ``path`` (local files and safetensors only), in eval mode."""
    try:
        import transformers
    except ImportError as exc:
        raise EngineError("engine=hf needs transformers: pip install 'tq_plugin[hf]'") from exc
    if dtype not in DTYPES:
        raise EngineError(f"engine.dtype: must be one of {list(DTYPES)}, got {dtype!r}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise EngineError(f"engine=hf: {path} holds no config.json (an HF checkpoint directory "
                          f"written by save_pretrained is needed)")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, use_safetensors=True, dtype=DTYPES[dtype])
    if (path / ADAPTER_DIR / "adapter_config.json").is_file():
        model = with_adapter(model, path / ADAPTER_DIR)
    return model.eval()


def with_adapter(model: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """``model`` (the frozen base) with the PEFT adapter in ``adapter`` injected in place; the
    adapter's tensors require gradients and the base's do not, so a sync names the adapter's
    only (:func:`~tq_plugin.rollout.engine.synced_parameters`)."""
    try:
        import peft
    except ImportError as exc:
        raise EngineError("engine=hf: a LoRA policy's adapter needs peft: pip install "
                          "'tq_plugin[lora]'") from exc
    return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True).get_base_model()


def transformers_step(model: torch.nn.Module, bias: torch.Tensor | None = None) -> CachedStep:
    """The :data:`CachedStep` of a transformers causal LM (its own KV cache; only the last
    position is projected, ``logits_to_keep=1``); ``bias`` is added to the logits (a policy's
    output restriction)."""
    def step(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             cache: Any) -> tuple[torch.Tensor, Any]:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        last = out.logits[:, -1].float()
        return (last if bias is None else last + bias.to(last.device)), out.past_key_values

    return step


class HFEngine:
    """:class:`~tq_plugin.rollout.engine.RolloutEngine` over a transformers causal LM."""

    name = "hf"

    def __init__(self, checkpoint: str | Path, *, dtype: str = "float32",
                 weight_version: int = 0) -> None:
        self.model: torch.nn.Module | None = load_checkpoint_model(checkpoint, dtype)
        # The parameters a sync copies into, by name: the engine's own model never changes
        # them after loading, and walking a LoRA model's ~1,000 modules took 5 of a sync's 7.6 ms.
        self.synced = dict(synced_parameters(self.model))
        self.weight_version = weight_version
        # In-flight weight updates (``recipe.inflight_updates``): set by the rollout worker.
        self.inflight: InflightUpdates | None = None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Sequence[int], image_patches: torch.Tensor | None = None
                 ) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("engine=hf: generate after close")
        if image_patches is not None:
            raise EngineError("engine=hf reads no pixels: use engine=native with tq/staging=media")
        return cached_decode(transformers_step(self.model), prompts, params, seeds=seeds,
                             device=next(self.model.parameters()).device,
                             inflight=self.inflight, version=lambda: self.weight_version)

    def update_weights(self, weights: NamedWeights, *, version: int) -> None:
        """Copy ``weights`` (the checkpoint's parameter names; a LoRA policy's: its adapter's
        only, onto the frozen base loaded at the start) in place."""
        if self.model is None:
            raise RuntimeError("engine=hf: update_weights after close")
        copy_named(self.model, weights, engine=self.name, own=self.synced)
        self.weight_version = version

    def close(self) -> None:
        self.model = None
        self.synced = {}


__all__ = ["DTYPES", "HFEngine", "load_checkpoint_model", "transformers_step", "with_adapter"]

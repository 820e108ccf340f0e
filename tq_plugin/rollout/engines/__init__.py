"""The three rollout engines and the one call that builds the configured one (``engine`` group).

``hf`` and ``vllm`` are imported only when built: ``vllm`` pulls in vLLM (seconds to import)
and ``hf`` transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from tq_plugin.config.schema import ENGINES
from tq_plugin.rollout.engine import EngineError, RolloutEngine
from tq_plugin.rollout.engines.native import NativeEngine
from tq_plugin.rollout.sampling import SamplingControls


def build_engine(options: Any, *, model: nn.Module | None = None,
                 checkpoint: str | Path | None = None, max_model_len: int = 0,
                 max_num_seqs: int = 0, weight_version: int = 0,
                 max_loras: int = 1) -> RolloutEngine:
    """The engine ``options.name`` names (an ``EngineConfig``), serving ``model`` (``native``)
    or the HF checkpoint directory ``checkpoint`` (``hf``, ``vllm``), holding
    ``weight_version``. ``vllm`` sizes its context and KV cache from ``max_model_len`` (the
    run's longest sequence; 0: the checkpoint's) and ``max_num_seqs`` (a step's sequences)
    unless ``options.kv_cache_memory_bytes`` is set (``engines.vllm.engine_sizes``), and keeps
    ``max_loras`` adapter versions loaded for a LoRA policy. Raises
    :class:`EngineError` naming ``engine`` when it cannot be built."""
    name = options.name
    if name not in ENGINES:
        raise EngineError(f"engine: must be one of {list(ENGINES)}, got {name!r}")
    if name == "native":
        if model is None:
            raise EngineError("engine=native needs the policy module to sample from")
        return NativeEngine(model, weight_version=weight_version)
    if checkpoint is None:
        raise EngineError(f"engine={name} serves an HF-format policy from its checkpoint: use "
                          f"model=hf_causal_lm (other models run with engine=native)")
    if name == "hf":
        from tq_plugin.rollout.engines.hf import HFEngine

        return HFEngine(checkpoint, dtype=options.dtype, weight_version=weight_version)
    from tq_plugin.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(checkpoint, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      dtype=options.dtype,
                      kv_cache_memory_bytes=getattr(options, "kv_cache_memory_bytes", None),
                      enforce_eager=options.enforce_eager, logprobs_mode=options.logprobs_mode,
                      threads=options.threads, weight_version=weight_version,
                      max_loras=max_loras)


def check_sampling(options: Any, controls: SamplingControls) -> None:
    """Refuse, before the engine starts, sampling controls (``recipe.top_k`` / ``top_p`` /
    ``min_p`` / ``repetition_penalty``) the configured engine cannot apply consistently with the
    trainer. ``native`` and ``hf`` apply all four (:mod:`tq_plugin.rollout.sampling`); ``vllm``
    applies them, but reports the processed distribution's logprobs only with
    ``engine.logprobs_mode=processed_logprobs``."""
    if not controls.active:
        return
    mode = getattr(options, "logprobs_mode", "processed_logprobs")
    if options.name == "vllm" and mode != "processed_logprobs":
        raise EngineError(f"engine=vllm: recipe.{controls.active_keys()[0]} needs "
                          f"engine.logprobs_mode=processed_logprobs (the logprob of the "
                          f"processed distribution the trainer scores), got {mode}")


__all__ = ["ENGINES", "NativeEngine", "build_engine", "check_sampling"]

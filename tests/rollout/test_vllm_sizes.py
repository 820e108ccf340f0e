"""``engine=vllm`` sizes its context and KV cache from the run, not the checkpoint
(``engines.vllm.engine_sizes``): pure arithmetic on ``config.json``, no vLLM started."""

from __future__ import annotations

import pytest

from tq_plugin.config.schema import ConfigError, EngineConfig
from tq_plugin.rollout.engine import EngineError
from tq_plugin.rollout.engines.vllm import (
    KV_BLOCK_TOKENS,
    KV_CACHE_FLOOR_BYTES,
    engine_sizes,
    kv_bytes_per_token,
)

# SmolLM2-135M-Instruct's config.json (the sizes that matter): 8,192 positions.
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576, "head_dim": 64, "max_position_embeddings": 8192}
# Gemma-3 as a multimodal config: the text model's sizes under text_config, head_dim 256.
GEMMA3 = {"text_config": {"num_hidden_layers": 18, "num_attention_heads": 4,
                          "num_key_value_heads": 1, "hidden_size": 640, "head_dim": 256,
                          "max_position_embeddings": 32768}}
TINY = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64,
        "max_position_embeddings": 64}
GiB = 1 << 30


def test_bytes_per_token_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(SMOLLM2, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(SMOLLM2, "bfloat16") == 23_040
    assert kv_bytes_per_token(GEMMA3, "float32") == 2 * 18 * 1 * 256 * 4
    assert kv_bytes_per_token(TINY, "float32") == 2 * 2 * 2 * 32 * 4  # head_dim from hidden/heads


def test_context_and_cache_follow_the_run_not_the_checkpoint():
    block = 46_080 * KV_BLOCK_TOKENS
    # A step of 4 prompts x 8 completions, 60 tokens at most: one block each, plus the reserved one.
    assert engine_sizes(SMOLLM2, max_model_len=60, max_num_seqs=32, memory_bytes=16 * GiB) == \
        (60, 33 * block)
    # 300 tokens: three blocks a sequence.
    assert engine_sizes(SMOLLM2, max_model_len=300, max_num_seqs=32,
                        memory_bytes=16 * GiB)[1] == (32 * 3 + 1) * block
    # Nothing known of the run: the checkpoint's context, one sequence of it (what vLLM checks
    # at start; the old fixed 64 MiB could not hold it and vLLM refused to start).
    length, cache = engine_sizes(SMOLLM2, memory_bytes=16 * GiB)
    assert length == 8192 and cache == (8192 // KV_BLOCK_TOKENS + 1) * block > KV_CACHE_FLOOR_BYTES


def test_floor_ceiling_cap_and_explicit_cache():
    # A tiny model's need is under the floor.
    assert engine_sizes(TINY, max_model_len=40, max_num_seqs=64) == (40, KV_CACHE_FLOOR_BYTES)
    # A context past the checkpoint's positions is capped at them.
    assert engine_sizes(TINY, max_model_len=500)[0] == 64
    # At most a quarter of the machine's memory, but never under one full-length sequence.
    block = 46_080 * KV_BLOCK_TOKENS
    assert engine_sizes(SMOLLM2, max_model_len=8192, max_num_seqs=64,
                        memory_bytes=4 * GiB)[1] == GiB
    assert engine_sizes(SMOLLM2, max_model_len=8192, max_num_seqs=64,
                        memory_bytes=GiB)[1] == 65 * block
    # Set by the user: taken as it is.
    assert engine_sizes(SMOLLM2, max_model_len=60, max_num_seqs=32,
                        kv_cache_memory_bytes=1_000_000_000) == (60, 1_000_000_000)
    assert engine_sizes(GEMMA3, max_model_len=100, max_num_seqs=8,
                        memory_bytes=16 * GiB)[0] == 100
    with pytest.raises(EngineError, match="max_position_embeddings"):
        engine_sizes({"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 32})


def test_engine_config_leaves_the_cache_to_the_run_by_default():
    assert EngineConfig(name="vllm").kv_cache_memory_bytes is None
    assert EngineConfig(name="vllm", kv_cache_memory_bytes=1 << 30).kv_cache_memory_bytes == 1 << 30
    with pytest.raises(ConfigError, match="engine.kv_cache_memory_bytes"):
        EngineConfig(name="vllm", kv_cache_memory_bytes=0)

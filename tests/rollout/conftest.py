"""Engines over one tiny HF policy, shared by the rollout tests.

vLLM starts once per module (``engines`` is module-scoped): in-process, one torch thread, a
64 MiB KV cache, eager, float32, its inductor cache under ``.pytest_cache`` so warm runs skip
the compile (17-26 s cold on the 2-core box).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tq_plugin.config.schema import EngineConfig
from tq_plugin.rl.models.weights import hf_backbone, write_engine_checkpoint
from tq_plugin.rl.tasks.pattern import EOS, PatternTask
from tq_plugin.rollout import build_engine

pytest.importorskip("transformers")
from tq_plugin.rl.models.hf import HFCausalLM

ENGINE_NAMES = ["native", "hf", "vllm"]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
TASK = PatternTask()
MAX_LEN = 64


def make_policy(seed: int = 0) -> HFCausalLM:
    """A 2-layer llama over the pattern task's vocabulary; head_dim 32 (vLLM's CPU attention
    needs a multiple of 32). Its output head is its input embedding (``tie_word_embeddings``, as
    in Qwen2.5-0.5B or Llama-3.2-1B): the checkpoint has no ``lm_head.weight``, and a weight
    sync must reach the head through the embedding."""
    torch.manual_seed(seed)
    policy = HFCausalLM(TASK.vocab_size, d_model=64, n_heads=2, n_layers=2, max_seq_len=MAX_LEN,
                        output_token_ids=TASK.output_token_ids).eval()
    backbone = hf_backbone(policy)
    backbone.config.tie_word_embeddings = True
    backbone.tie_weights()
    assert backbone.get_output_embeddings().weight is backbone.get_input_embeddings().weight
    return policy


def engine_param(name: str):
    marks = [pytest.mark.slow, pytest.mark.timeout(300)] if name == "vllm" else []
    if name == "vllm" and not HAS_VLLM:
        marks.append(pytest.mark.skip(reason="vLLM is not installed (make install puts it in)"))
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module", params=[engine_param(n) for n in ENGINE_NAMES])
def engine_case(request, tmp_path_factory):
    """``(engine, its own policy copy at the engine's weights)``; closed after the module."""
    name = request.param
    if name == "vllm":
        cache = Path(request.config.rootpath) / ".pytest_cache" / "inductor"
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    policy = make_policy()
    served = copy.deepcopy(policy)  # native samples the module it is given
    checkpoint = None
    if name != "native":
        checkpoint = write_engine_checkpoint(policy, tmp_path_factory.mktemp(f"ckpt_{name}"))
    engine = build_engine(EngineConfig(name=name), model=served, checkpoint=checkpoint,
                          max_model_len=MAX_LEN)
    yield engine, policy
    engine.close()


__all__ = ["EOS", "TASK", "make_policy"]


# The OpenAI endpoint tests' shared fixtures: a tiny chat policy, an hf engine over it, and
# harnesses stopped after each test.
from tq_plugin.rollout.engines.hf import HFEngine

from .openai_harness import Harness
from .openai_policy import build_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_policy(tmp_path_factory.mktemp("chat_policy"))


@pytest.fixture(scope="module")
def hf_engine(policy):
    engine = HFEngine(policy[1])
    yield engine
    engine.close()


@pytest.fixture
def make(policy):
    made = []

    def _make(engine, **kwargs):
        harness = Harness(engine, policy[0], **kwargs)
        made.append(harness)
        return harness

    yield _make
    for harness in made:
        harness.stop()

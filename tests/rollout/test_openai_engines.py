"""The agent endpoint over other engines and models: vLLM (slow), the project's tiny text
model (``make tiny-model``: a template with no EOS between turns), and NeMo Gym's own
``verify_and_linearize`` on what the endpoint staged (where nemo-gym is importable)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tq_plugin.data_plane import INPUT_IDS, TOKEN_MASK
from tq_plugin.rollout.engines.hf import HFEngine

from .openai_harness import Harness, Recorder
from .openai_policy import build_policy

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def run_session(h: Harness, rid: str, questions: list[str], *, max_tokens: int = 6):
    """One multi-turn chat (seeds 1, 2, ...); the responses."""
    async def run():
        client, messages, out = h.client(rid), [], []
        for turn, q in enumerate(questions):
            messages.append({"role": "user", "content": q})
            r = await client.chat.completions.create(
                model="p", messages=messages, max_tokens=max_tokens, seed=turn + 1,
                temperature=0.8, extra_body={"return_token_ids": True})
            out.append(r)
            messages.append(r.choices[0].message)
        return out

    return asyncio.run(run())


def check_exact(h: Harness, rec: Recorder, responses: list) -> None:
    """Each turn's engine prompt starts with the previous turn's prompt + sampled ids, and the
    reassembled row is the last prompt + its sampled ids, its mask covering every sampled id."""
    seeds = list(range(1, len(responses) + 1))
    for turn, r in enumerate(responses):
        prompt, completion = rec.by_seed[seeds[turn]]
        assert r.model_extra["prompt_token_ids"] == prompt
        assert r.choices[0].model_extra["token_ids"] == completion.token_ids
        if turn:
            prev_prompt, prev = rec.by_seed[seeds[turn - 1]]
            assert prompt[: len(prev_prompt) + len(prev.token_ids)] == prev_prompt + prev.token_ids
            assert r.model_extra["tq_staging"]["continuation"] == "extend"
    receipt = h.endpoint.close_rollout(responses[0].model_extra["tq_staging"]["rollout_id"],
                                       reward=1.0)
    meta, td = h.finalize([receipt])
    assert meta.tags[0]["staging_status"] == "ok"
    last_prompt, last = rec.by_seed[seeds[-1]]
    assert td[INPUT_IDS][0].tolist() == last_prompt + last.token_ids
    sampled = [t for s in seeds for t in rec.by_seed[s][1].token_ids]
    assert td[INPUT_IDS][0][td[TOKEN_MASK][0] > 0].tolist() == sampled


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make install puts it in)")
def test_the_endpoint_over_vllm_stages_exact_multi_turn_chains(tmp_path, request):
    """The endpoint's engine thread makes no torch call before vLLM's first step. With the
    process's torch thread count other than the core count (1 here: on a multi-core box, the
    case that hung this test in a CI run), vLLM's CPU attention refused every step until the
    engine read the count first (``VLLMEngine.generate``)."""
    from tq_plugin.rollout.engines.vllm import VLLMEngine

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(request.config.rootpath) / ".pytest_cache" / "inductor"))
    tokenizer, ckpt = build_policy(tmp_path / "policy", max_positions=512)
    engine = VLLMEngine(ckpt, max_model_len=512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rec = Recorder(engine)
    h = Harness(rec, tokenizer, max_model_len=512)
    try:
        rid = h.endpoint.open_rollout("vllm")
        responses = run_session(h, rid, ["What is 2 + 3?", "Hello, how are you today?",
                                         "reverse: a b c"])
        check_exact(h, rec, responses)
    finally:
        h.stop()
        engine.close()
        torch.set_num_threads(threads)


def test_the_tiny_text_model_chats_over_hf_with_its_own_template(tmp_path):
    """``make tiny-model``'s template renders turns back to back (``<|user|>...<|assistant|>``,
    no EOS): the sampled EOS stays in the chain and the next turn follows it."""
    pytest.importorskip("tokenizers", reason="the prompts extra is not installed")
    from transformers import AutoTokenizer

    from tq_plugin.rl.tasks.tiny_text import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", train_rows=64, eval_rows=8)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = HFEngine(model_dir)
    rec = Recorder(engine)
    h = Harness(rec, tokenizer, max_model_len=64)
    try:
        rid = h.endpoint.open_rollout("tiny")
        responses = run_session(h, rid, ["reverse: a b c", " Try again."], max_tokens=6)
        check_exact(h, rec, responses)
    finally:
        h.stop()
        engine.close()


def test_nemo_gym_verifies_and_linearizes_what_the_endpoint_staged(tmp_path):
    gym = pytest.importorskip(
        "nemo_gym.token_id_capture.staging",
        reason="nemo-gym 0.7.0 is not installed "
               "(pip install --no-deps --ignore-requires-python nemo-gym==0.7.0)")
    from tq_plugin.staging import TQTokenSource

    tokenizer, ckpt = build_policy(tmp_path / "policy")
    engine = HFEngine(ckpt)
    h = Harness(Recorder(engine), tokenizer)
    try:
        rid = h.endpoint.open_rollout("gym")
        responses = run_session(h, rid, ["What is 2 + 3?", "reverse: a b c"])
        receipt = h.endpoint.close_rollout(rid, reward=1.0)
        snapshots = TQTokenSource(h.dp, staging_partition="agent_staging").fetch(
            [row.staging_key for row in receipt.manifest])
        row = gym.verify_and_linearize(gym.RolloutReceipt.model_validate(receipt.model_dump()),
                                       snapshots)
        last = responses[-1]
        assert row.token_ids == last.model_extra["prompt_token_ids"] + \
            last.choices[0].model_extra["token_ids"]
    finally:
        h.stop()
        engine.close()

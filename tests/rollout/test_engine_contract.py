"""The rollout-engine contract, one test body over every engine (native, hf, vllm).

Each engine serves the same tiny HF policy; the trainer-side checks recompute with that
policy's own forward (its output restriction included).
"""

from __future__ import annotations

import pytest
import torch

from tq_plugin.rl.models.weights import engine_weights
from tq_plugin.rl.tasks.pattern import EOS, SEP
from tq_plugin.rollout import Completion, RolloutEngine, SamplingParams

from .conftest import TASK, make_policy

PROMPTS = [[1, 7, 14, SEP], [1, 9, 16, SEP, 8, 9, EOS, 5, SEP], [1, 12, 15, SEP]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.7, stop_token_ids=(EOS,),
                        allowed_token_ids=tuple(TASK.output_token_ids))
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(EOS,),
                        allowed_token_ids=tuple(TASK.output_token_ids))


@torch.no_grad()
def trainer_logprobs(policy, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    logits = policy(torch.tensor([prompt + tokens]))[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@torch.no_grad()
def trainer_greedy(policy, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        tok = int(policy(torch.tensor([ids]))[0, -1].argmax())
        ids.append(tok)
        if tok == EOS:
            break
    return ids[len(prompt):]


def test_engine_follows_the_protocol(engine_case):
    engine, _ = engine_case
    assert isinstance(engine, RolloutEngine)
    assert engine.name in ("native", "hf", "vllm") and isinstance(engine.weight_version, int)


def test_one_completion_per_prompt_stopping_after_eos_within_the_allowed_tokens(engine_case):
    engine, _ = engine_case
    out = engine.generate(PROMPTS, PARAMS, seeds=[1, 2, 3])
    assert len(out) == len(PROMPTS) and all(isinstance(c, Completion) for c in out)
    for c in out:
        assert 1 <= len(c.token_ids) <= PARAMS.max_new_tokens
        assert len(c.logprobs) == len(c.token_ids)
        assert set(c.token_ids) <= set(TASK.output_token_ids)
        assert EOS not in c.token_ids[:-1]  # a continuation ends at its first EOS
        assert all(lp <= 0.0 for lp in c.logprobs)


def test_logprobs_are_those_the_trainer_recomputes_at_the_temperature(engine_case):
    engine, policy = engine_case
    for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, PARAMS, seeds=[4, 5, 6])):
        want = trainer_logprobs(policy, prompt, c.token_ids, PARAMS.temperature)
        assert c.logprobs == pytest.approx(want, abs=2e-4)


def test_a_request_seed_fixes_its_continuation_whatever_the_batch(engine_case):
    engine, _ = engine_case
    alone = engine.generate(PROMPTS[:1], PARAMS, seeds=[11])[0]
    batched = engine.generate(PROMPTS, PARAMS, seeds=[11, 12, 13])[0]
    assert alone.token_ids == batched.token_ids
    assert alone.logprobs == pytest.approx(batched.logprobs, abs=1e-5)


def test_after_a_sync_the_engine_continues_as_the_trainer_does_with_the_new_weights(engine_case):
    """The weight-sync proof: greedy continuations equal the trainer model's under the new
    weights and differ from those under the old."""
    engine, policy = engine_case
    old = [trainer_greedy(policy, p, GREEDY.max_new_tokens) for p in PROMPTS]
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == old
    trained = make_policy(seed=1)  # stands in for the trainer's updated policy
    new = [trainer_greedy(trained, p, GREEDY.max_new_tokens) for p in PROMPTS]
    assert new != old
    version = engine.weight_version + 1
    engine.update_weights(engine_weights(trained, engine.name) if engine.name != "native"
                          else trained.named_parameters(), version=version)
    assert engine.weight_version == version
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == new
    # Sampled, every step's logprob is the new policy's (vLLM's CPU linears once kept the old
    # weights for batch sizes seen before the sync: right tokens under greedy, wrong logprobs).
    for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, PARAMS, seeds=[4, 5, 6])):
        want = trainer_logprobs(trained, prompt, c.token_ids, PARAMS.temperature)
        assert c.logprobs == pytest.approx(want, abs=2e-4)
    engine.update_weights(engine_weights(policy, engine.name) if engine.name != "native"
                          else policy.named_parameters(), version=version + 1)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == old


def test_a_partial_update_is_refused_and_the_engine_keeps_serving(engine_case):
    engine, _ = engine_case
    version = engine.weight_version
    source = make_policy(seed=2)
    named = list(engine_weights(source, engine.name) if engine.name != "native"
                 else source.named_parameters())
    before = engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])
    with pytest.raises(ValueError, match=f"engine={engine.name}"):
        engine.update_weights(named[1:], version=version + 1)
    assert engine.weight_version == version
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == \
        [c.token_ids for c in before]


def test_streamed_weights_sync_as_a_list_does_and_a_bad_announcement_copies_nothing(engine_case):
    """``StreamedWeights`` (what a sharded trainer hands its engine: full tensors made one at a
    time): the same sync as the whole list; names or shapes announced wrong are refused before
    a single tensor is made, and the engine keeps serving."""
    from tq_plugin.rollout.engine import StreamedWeights

    engine, policy = engine_case

    def streamed(model, *, drop: int = 0, made: list | None = None) -> StreamedWeights:
        named = list(engine_weights(model, engine.name) if engine.name != "native"
                     else model.named_parameters())

        def stream():
            for name, tensor in named:
                if made is not None:
                    made.append(name)
                yield name, tensor.detach().clone()

        return StreamedWeights({n: tuple(t.shape) for n, t in named[drop:]}, stream)

    old = [trainer_greedy(policy, p, GREEDY.max_new_tokens) for p in PROMPTS]
    trained = make_policy(seed=1)
    new = [trainer_greedy(trained, p, GREEDY.max_new_tokens) for p in PROMPTS]
    version = engine.weight_version
    made: list[str] = []
    with pytest.raises(ValueError, match=f"engine={engine.name}"):
        engine.update_weights(streamed(trained, drop=1, made=made), version=version + 1)
    assert made == [] and engine.weight_version == version
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == old
    engine.update_weights(streamed(trained), version=version + 1)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == new
    engine.update_weights(streamed(policy), version=version + 2)  # the module's weights back
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, seeds=[0, 0, 0])] == old


def test_weights_loaded_between_chunks_apply_from_the_next_one(engine_case):
    """In-flight weight updates with the prefix recomputed (``recipe.inflight.kv=recompute``;
    vLLM's by aborting and re-feeding each sequence): chunks of 2 new tokens, new weights loaded
    before the second, no sequence dropped; each token's version is the one that sampled it and
    its logprob that version's score of the whole sequence so far (a row that stops within the
    first chunk has only the first version's)."""
    from tq_plugin.rollout.engine import InflightUpdates

    engine, policy = engine_case
    params = PARAMS
    trained = make_policy(seed=1)
    version = engine.weight_version

    def named(model):
        return (engine_weights(model, engine.name) if engine.name != "native"
                else [(n, p.detach().clone()) for n, p in model.named_parameters()])

    polls = []

    def poll() -> bool:
        polls.append(engine.weight_version)
        if len(polls) > 1:
            return False
        engine.update_weights(named(trained), version=version + 1)
        return True

    engine.inflight = InflightUpdates(poll=poll, chunk_tokens=2, kv="recompute")
    try:
        out = engine.generate(PROMPTS, params, seeds=[4, 5, 6])
    finally:
        engine.inflight = None
        engine.update_weights(named(policy), version=version + 2)
    assert polls[0] == version and len(out) == len(PROMPTS)
    assert sum(len(c.token_ids) > 2 for c in out) >= 1, out  # the switch lands mid-sequence
    for prompt, c in zip(PROMPTS, out):
        assert c.versions == [version if t < 2 else version + 1 for t in range(len(c.token_ids))]
        old_lp = trainer_logprobs(policy, prompt, c.token_ids, params.temperature)
        new_lp = trainer_logprobs(trained, prompt, c.token_ids, params.temperature)
        assert c.logprobs[:2] == pytest.approx(old_lp[:2], abs=2e-4)
        assert c.logprobs[2:] == pytest.approx(new_lp[2:], abs=2e-4)
        if len(c.token_ids) > 2:
            assert c.logprobs[2:] != pytest.approx(old_lp[2:], abs=1e-3)

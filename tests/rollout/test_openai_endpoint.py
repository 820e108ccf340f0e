"""The agent endpoint with the real ``openai`` client over loopback: every call staged
token-exact before its answer, multi-turn prefixes read back from staging, tool calls through
the chat template, branches from edited histories, concurrent sessions, and the receipts the
reassembler verifies and linearizes."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tq_plugin.data_plane import GENERATION_LOGPROBS, INPUT_IDS, SAMPLE_MASK, TOKEN_MASK
from tq_plugin.rollout.engines.hf import HFEngine

from .openai_harness import Harness, Recorder, Scripted

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


def staged_equals_engine(h: Harness, rec: Recorder, response, seed: int) -> None:
    """The staged chain through this call is exactly what the engine saw plus what it
    sampled, read back from the store; the response's ids agree."""
    staging = response.model_extra["tq_staging"]
    prompt, completion = rec.by_seed[seed]
    rid = staging["rollout_id"]
    by_id = {s.model_call_id: s for s in h.source.fetch(h.staged_keys()) if s.rollout_id == rid}
    keys, node = [], by_id[staging["model_call_id"]]
    while node is not None:
        keys.insert(0, node.staging_key)
        node = by_id.get(node.parent_call_id) if node.parent_call_id else None
    assert h.chain_tokens(keys) == prompt + completion.token_ids
    assert response.model_extra["prompt_token_ids"] == prompt
    assert response.choices[0].model_extra["token_ids"] == completion.token_ids
    snap = by_id[staging["model_call_id"]]
    gen = [t for t, m in zip(snap.token_ids_delta, snap.token_mask_delta) if m == 1.0]
    lps = [lp for lp, m in zip(snap.generation_log_probs_delta, snap.token_mask_delta) if m == 1.0]
    assert gen == completion.token_ids
    assert lps == pytest.approx(completion.logprobs, abs=1e-6)
    assert snap.prev_len == staging["prev_len"] and snap.cum_len == staging["cum_len"]
    assert snap.weight_version == staging["weight_version"]


def test_single_turn_chat_is_a_text_root_staged_with_the_engines_ids_and_logprobs(make, hf_engine):
    rec = Recorder(hf_engine)
    h = make(rec)
    rid = h.endpoint.open_rollout("single")

    async def run():
        return await h.client(rid).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=8, temperature=0.9, seed=11, logprobs=True,
            extra_body={"return_token_ids": True})

    r = asyncio.run(run())
    staging = r.model_extra["tq_staging"]
    assert staging["mode"] == "text" and staging["continuation"] == "root"
    assert staging["parent_call_id"] is None and not staging["branched"]
    staged_equals_engine(h, rec, r, 11)
    lps = [c.logprob for c in r.choices[0].logprobs.content]
    assert lps == pytest.approx(rec.by_seed[11][1].logprobs, abs=1e-6)
    assert r.usage.completion_tokens == len(rec.by_seed[11][1].token_ids)
    assert r.choices[0].finish_reason in ("stop", "length")
    receipt = h.endpoint.close_rollout(rid, reward=0.5)
    meta, td = h.finalize([receipt])
    assert meta.tags[0]["staging_status"] == "ok"
    prompt, completion = rec.by_seed[11]
    assert td[INPUT_IDS][0].tolist() == prompt + completion.token_ids
    assert td[GENERATION_LOGPROBS][0][td[TOKEN_MASK][0] > 0].tolist() == \
        pytest.approx(completion.logprobs, abs=1e-6)


def test_multi_turn_prompts_are_the_staged_chain_plus_the_templated_tail(make, hf_engine):
    """Turn n's engine prompt = the chain staged through turn n-1 (read back) + the template's
    tail after the reply."""
    rec = Recorder(hf_engine)
    h = make(rec)
    rid = h.endpoint.open_rollout("multi")
    user_turns = ["What is 2 + 3?", "Hello, how are you today?", "reverse: a b c"]

    async def run():
        client, messages, out = h.client(rid), [], []
        for turn, text in enumerate(user_turns):
            messages.append({"role": "user", "content": text})
            r = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6 + turn, seed=100 + turn,
                extra_body={"return_token_ids": True})
            out.append(r)
            messages.append(r.choices[0].message)  # the openai-python way: the message as is
        return out, messages

    responses, _ = asyncio.run(run())
    for turn, r in enumerate(responses):
        staging = r.model_extra["tq_staging"]
        assert staging["continuation"] == ("root" if turn == 0 else "extend")
        assert staging["mode"] == ("text" if turn == 0 else "token_in")
        staged_equals_engine(h, rec, r, 100 + turn)
        if turn:
            prefix = rec.by_seed[99 + turn][0] + rec.by_seed[99 + turn][1].token_ids
            assert rec.by_seed[100 + turn][0][: len(prefix)] == prefix
            assert staging["prev_len"] == len(prefix)
    receipt = h.endpoint.close_rollout(rid, reward=1.0)
    assert [r.model_call_id for r in receipt.manifest] == ["call0", "call1", "call2"]
    _, td = h.finalize([receipt])
    last_prompt, last = rec.by_seed[102]
    assert td[INPUT_IDS][0].tolist() == last_prompt + last.token_ids
    generated = [t for s in (100, 101, 102) for t in rec.by_seed[s][1].token_ids]
    assert td[INPUT_IDS][0][td[TOKEN_MASK][0] > 0].tolist() == generated


def test_a_tool_call_goes_through_the_template_and_its_sampled_tokens_stay_exact(make, policy):
    tokenizer = policy[0]
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    eos = tokenizer.eos_token_id
    engine = Scripted([tokenizer(call_text)["input_ids"] + [eos],
                       tokenizer("The answer is 5.")["input_ids"] + [eos]])
    seen = []
    generate = engine.generate
    engine.generate = lambda prompts, params, **kw: (seen.extend(prompts), generate(prompts, params, **kw))[1]
    h = make(engine, default_max_tokens=64)
    rid = h.endpoint.open_rollout("tools")

    async def run():
        client = h.client(rid)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        r1 = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        call = r1.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        messages += [r1.choices[0].message,
                     {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
        r2 = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        return r1, r2

    r1, r2 = asyncio.run(run())
    assert r1.choices[0].finish_reason == "tool_calls"
    assert r1.choices[0].message.content is None
    assert r1.choices[0].message.tool_calls[0].function.name == "add"
    assert '"name": "add"' in tokenizer.decode(seen[0])  # the tools reached the template
    assert r2.model_extra["tq_staging"]["continuation"] == "extend"
    assert r2.choices[0].message.content == "The answer is 5."
    # The second prompt holds the tool call exactly as sampled, then the tool's answer.
    sampled = tokenizer(call_text)["input_ids"] + [eos]
    assert seen[1][: len(seen[0]) + len(sampled)] == seen[0] + sampled
    assert tokenizer.decode(seen[1][len(seen[0]) + len(sampled):]) == \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    receipt = h.endpoint.close_rollout(rid, reward=1.0)
    meta, td = h.finalize([receipt])
    assert meta.tags[0]["staging_status"] == "ok"
    assert td[INPUT_IDS][0].tolist() == seen[1] + tokenizer("The answer is 5.")["input_ids"] + [eos]


def test_an_edited_history_forks_or_starts_a_new_root_and_the_response_says_so(make, hf_engine):
    h = make(Recorder(hf_engine))
    rid = h.endpoint.open_rollout("branches")
    q1, q2, q3 = "What is 2 + 3?", "Hello, how are you today?", "reverse: a b c"

    async def run():
        client, out = h.client(rid), []
        m = [{"role": "user", "content": q1}]
        r = await client.chat.completions.create(model="policy", messages=m, seed=1)
        out.append(r)
        m += [r.choices[0].message, {"role": "user", "content": q2}]
        r = await client.chat.completions.create(model="policy", messages=m, seed=2)
        out.append(r)
        # Edited: the second question replaced, on top of the first answer -> fork of call0.
        edited = m[:2] + [{"role": "user", "content": q3}]
        raw = await client.chat.completions.with_raw_response.create(
            model="policy", messages=edited, seed=3)
        out.append(raw.parse())
        headers = raw.headers
        # Rewritten: the first answer edited -> nothing staged is extended: a new root.
        rewritten = [m[0], {"role": "assistant", "content": "The answer is 5."},
                     {"role": "user", "content": q2}]
        out.append(await client.chat.completions.create(model="policy", messages=rewritten, seed=4))
        return out, headers

    out, headers = asyncio.run(run())
    kinds = [r.model_extra["tq_staging"] for r in out]
    assert [k["continuation"] for k in kinds] == ["root", "extend", "fork", "new_root"]
    assert [k["branched"] for k in kinds] == [False, False, True, True]
    assert kinds[2]["parent_call_id"] == "call0" and kinds[2]["mode"] == "token_in"
    assert kinds[3]["parent_call_id"] is None and kinds[3]["mode"] == "text"
    assert headers["x-tq-branch"] == "fork"
    # The head (the call staged last) is the default terminal; any staged call may be
    # declared instead, and its ancestry becomes the training row.
    with pytest.raises(KeyError):
        h.endpoint.close_rollout(rid, reward=1.0, terminal_call_id="call9")
    receipt = h.endpoint.close_rollout(rid, reward=1.0, terminal_call_id="call2")
    assert receipt.terminal_model_call_id == "call2" and len(receipt.manifest) == 4
    assert h.endpoint.stats()["branches"] == 2
    meta, td = h.finalize([receipt])
    assert meta.tags[0]["staging_status"] == "ok"
    assert td[INPUT_IDS][0].tolist() == h.chain_tokens(["branches/call0", "branches/call2"])


def test_concurrent_sessions_are_staged_apart_and_all_verify(make, hf_engine):
    sessions, turns = 16, 3
    rec = Recorder(hf_engine)
    h = make(rec)
    rids = [h.endpoint.open_rollout(f"c{i}") for i in range(sessions)]

    async def session(i: int):
        client, messages = h.client(rids[i]), []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"reverse: {'abc'[turn]} {i}"})
            r = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6, seed=1000 * (i + 1) + turn,
                extra_body={"return_token_ids": True})
            assert r.model_extra["tq_staging"]["continuation"] == ("root" if turn == 0 else "extend")
            staged_equals_engine(h, rec, r, 1000 * (i + 1) + turn)
            messages.append(r.choices[0].message)
        return await h.endpoint.aclose_rollout(rids[i], reward=float(i))

    async def run():
        return await asyncio.gather(*(session(i) for i in range(sessions)))

    receipts = asyncio.run(run())
    assert len(h.staged_keys()) == sessions * turns
    assert h.endpoint.stats()["calls_staged"] == sessions * turns
    meta, td = h.finalize(receipts)
    assert all(t["staging_status"] == "ok" for t in meta.tags)
    assert bool((td[SAMPLE_MASK] > 0).all())


def test_the_answer_waits_for_the_stage(make, hf_engine):
    from .openai_harness import SinkWrapper

    gate = threading.Event()
    h = make(Recorder(hf_engine), sink_wrap=lambda s: SinkWrapper(s, gate=gate))
    rid = h.endpoint.open_rollout("ordered")

    async def run():
        task = asyncio.ensure_future(h.client(rid).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4))
        await asyncio.sleep(0.5)
        assert not task.done() and h.staged_keys() == []  # the engine answered; no stage yet
        gate.set()
        r = await task
        assert h.staged_keys() == [r.model_extra["tq_staging"]["staging_key"]]

    asyncio.run(run())


def test_completions_text_and_token_prompts_continue_their_chain(make, hf_engine, policy):
    tokenizer = policy[0]
    rec = Recorder(hf_engine)
    h = make(rec)
    rid = h.endpoint.open_rollout("completions")

    async def run():
        client = h.client(rid)
        r1 = await client.completions.create(model="policy", prompt="Q: 2 + 3?\nA:", max_tokens=5,
                                             seed=1, extra_body={"return_token_ids": True})
        prompt2 = "Q: 2 + 3?\nA:" + r1.choices[0].text + "\nQ: and 4?\nA:"
        r2 = await client.completions.create(model="policy", prompt=prompt2, max_tokens=5, seed=2,
                                             logprobs=1, extra_body={"return_token_ids": True})
        ids = r2.model_extra["prompt_token_ids"] + r2.choices[0].model_extra["token_ids"]
        r3 = await client.completions.create(model="policy", prompt=ids + [5, 6], max_tokens=5,
                                             seed=3, extra_body={"return_token_ids": True})
        return r1, r2, r3

    r1, r2, r3 = asyncio.run(run())
    assert [r.model_extra["tq_staging"]["continuation"] for r in (r1, r2, r3)] == \
        ["root", "extend", "extend"]
    assert rec.by_seed[2][0][len(rec.by_seed[1][0]):][: len(rec.by_seed[1][1].token_ids)] == \
        rec.by_seed[1][1].token_ids  # the first completion's sampled ids, not its re-encoding
    assert rec.by_seed[2][0][-len(tokenizer("\nQ: and 4?\nA:")["input_ids"]):] == \
        tokenizer("\nQ: and 4?\nA:")["input_ids"]
    assert rec.by_seed[3][0][-2:] == [5, 6]
    assert r2.choices[0].logprobs.token_logprobs == pytest.approx(rec.by_seed[2][1].logprobs, abs=1e-6)
    for r, seed in ((r1, 1), (r2, 2), (r3, 3)):
        staged_equals_engine(h, rec, r, seed)


def test_models_and_tokenize_preview_the_next_prompt_without_staging(make, hf_engine):
    rec = Recorder(hf_engine)
    h = make(rec, model_name="tiny-policy")
    rid = h.endpoint.open_rollout("preview")
    assert h.http.get("/v1/models").json()["data"][0]["id"] == "tiny-policy"

    async def run():
        client = h.client(rid)
        models = await client.models.list()
        m = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="tiny-policy", messages=m, seed=1)
        return models, m + [r.choices[0].message.model_dump(exclude_none=True)]

    models, history = asyncio.run(run())
    assert [m.id for m in models.data] == ["tiny-policy"]
    nxt = history + [{"role": "user", "content": "and then?"}]
    before = h.staged_keys()
    preview = h.post("/tokenize", {"messages": nxt}, headers={"X-Rollout-Id": rid}).json()
    assert preview["tq_staging"]["continuation"] == "extend" and h.staged_keys() == before
    asyncio.run(h.client(rid).chat.completions.create(model="x", messages=nxt, seed=2))
    assert rec.by_seed[2][0] == preview["tokens"]
    plain = h.post("/tokenize", {"prompt": "hello"}).json()
    assert plain["tokens"] == h.tokenizer("hello")["input_ids"] and plain["count"] == len(plain["tokens"])


def test_a_weight_sync_between_calls_is_stamped_on_the_next_call(make, policy):
    engine = HFEngine(policy[1])
    h = make(Recorder(engine))
    rid = h.endpoint.open_rollout("versions")
    weights = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]

    async def call(messages, seed):
        return await h.client(rid).chat.completions.create(model="p", messages=messages, seed=seed)

    r1 = asyncio.run(call([{"role": "user", "content": "hi"}], 1))
    h.endpoint.update_weights(weights, version=7)
    m = [{"role": "user", "content": "hi"}, r1.choices[0].message, {"role": "user", "content": "ok"}]
    r2 = asyncio.run(call(m, 2))
    assert r1.model_extra["tq_staging"]["weight_version"] == 0
    assert r2.model_extra["tq_staging"]["weight_version"] == 7
    receipt = h.endpoint.close_rollout(rid, reward=0.0)
    assert [c.weight_version for c in receipt.manifest] == [0, 7]
    engine.close()


def test_endpoint_over_native_sampling_matches_the_hf_engine(make, policy, hf_engine):
    """The engine seam is the engine's: the same request and seed give the same staged tokens
    over ``hf`` as the engine gives when called directly."""
    from tq_plugin.rollout import SamplingParams

    h = make(Recorder(hf_engine))
    rid = h.endpoint.open_rollout("direct")
    r = asyncio.run(h.client(rid).chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}], seed=5, max_tokens=6,
        temperature=0.7, extra_body={"return_token_ids": True}))
    direct = hf_engine.generate([r.model_extra["prompt_token_ids"]], SamplingParams(
        max_new_tokens=6, temperature=0.7, stop_token_ids=(policy[0].eos_token_id,)), seeds=[5])
    assert r.choices[0].model_extra["token_ids"] == direct[0].token_ids
    assert torch.tensor(direct[0].logprobs).isfinite().all()


def test_a_reply_is_kept_as_sampled_not_re_encoded(make, policy):
    """The engine sampled "The answer is 5." one character per token, which BPE would encode
    differently: the next prompt carries the sampled ids (re-tokenizing would drift)."""
    tokenizer = policy[0]
    text, eos = "The answer is 5.", tokenizer.eos_token_id
    chars = [tokenizer(ch)["input_ids"][0] for ch in text]
    assert tokenizer(text)["input_ids"] != chars
    engine = Scripted([chars + [eos], chars + [eos]])
    seen = []
    generate = engine.generate
    engine.generate = lambda prompts, params, **kw: (seen.extend(prompts), generate(prompts, params, **kw))[1]
    h = make(engine, default_max_tokens=64)
    rid = h.endpoint.open_rollout("drift")

    async def run():
        client = h.client(rid)
        m = [{"role": "user", "content": "What is 2 + 3?"}]
        r = await client.chat.completions.create(model="p", messages=m)
        m += [r.choices[0].message, {"role": "user", "content": "Sure?"}]
        return r, await client.chat.completions.create(model="p", messages=m)

    r1, _ = asyncio.run(run())
    assert r1.choices[0].message.content == text
    assert seen[1][: len(seen[0]) + len(chars) + 1] == seen[0] + chars + [eos]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": text},
         {"role": "user", "content": "Sure?"}], add_generation_prompt=True, tokenize=False)
    assert tokenizer(rendered)["input_ids"] != seen[1]  # what a re-templating server would send
    assert tokenizer.decode(seen[1]) == rendered  # ... for the very same text


def test_a_stop_string_cuts_the_answer_and_the_staged_tokens_end_where_it_completed(make, policy):
    tokenizer = policy[0]
    text = "The answer is 5. Hello"
    ids = [tokenizer(ch)["input_ids"][0] for ch in text]  # one token per character
    h = make(Scripted([ids, ids]), default_max_tokens=64)
    rid = h.endpoint.open_rollout("stops")

    async def run():
        client = h.client(rid)
        cut = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}], stop=["is 5"],
            extra_body={"return_token_ids": True})
        single = await client.completions.create(model="p", prompt="x", stop=["5"],
                                                 extra_body={"return_token_ids": True})
        return cut, single

    cut, single = asyncio.run(run())
    assert cut.choices[0].message.content == "The answer "
    assert cut.choices[0].finish_reason == "stop"
    # Staged: the sampled ids through the one that completed "is 5" (a prefix of the sample).
    assert cut.choices[0].model_extra["token_ids"] == ids[: text.index("is 5") + 4]
    assert single.choices[0].text == "The answer is "
    assert single.choices[0].model_extra["token_ids"] == ids[: text.index("5") + 1]


def test_a_template_that_rewrites_replies_starts_a_new_root_instead_of_drifting(make, policy):
    """The tail after a staged reply is found by rendering the reply's content as a sentinel;
    a template that transforms assistant content hides it, and the call is a new text root
    (exact, only not chained) rather than a guess."""
    import copy

    tokenizer = copy.deepcopy(policy[0])
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                               "{{ m.content | upper if m.role == 'assistant' else m.content }}"
                               "<|im_end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    eos = tokenizer.eos_token_id
    engine = Scripted([tokenizer("ok")["input_ids"] + [eos]] * 2)
    h = Harness(engine, tokenizer)
    try:
        rid = h.endpoint.open_rollout("rewrite")

        async def run():
            client, m = h.client(rid), [{"role": "user", "content": "hi"}]
            r = await client.chat.completions.create(model="p", messages=m)
            m += [r.choices[0].message, {"role": "user", "content": "more"}]
            return await client.chat.completions.create(model="p", messages=m)

        second = asyncio.run(run())
        assert second.model_extra["tq_staging"]["continuation"] == "new_root"
        assert h.endpoint.close_rollout(rid, reward=0.0).manifest[1].parent_call_id is None
    finally:
        h.stop()


def test_a_prompt_over_the_context_is_a_400_that_stages_nothing(make, hf_engine):
    h = make(Recorder(hf_engine), max_model_len=40)
    rid = h.endpoint.open_rollout("long")
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(h.client(rid).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "Hello, how are you today? " * 4}],
            max_tokens=8))
    assert err.value.code == "context_length_exceeded" and h.staged_keys() == []

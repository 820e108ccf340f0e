"""The agent endpoint under bad input and faults: OpenAI-style 4xx errors (never a 500 with a
traceback), the bearer token off loopback, a call that does not stage poisons its rollout, a
client that leaves before its call is staged leaves nothing behind, and a retried request is
answered from its first attempt, never staged twice."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from tq_plugin.data_plane import SAMPLE_MASK
from tq_plugin.rollout.openai.server import AgentEndpoint

from .openai_harness import Recorder, Scripted, SinkWrapper, is_openai_error

HI = [{"role": "user", "content": "hi"}]


def error_of(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert is_openai_error(body), body
    assert "Traceback" not in response.text
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def _until(condition) -> None:
    """Wait for ``condition()`` (the suite's per-test timeout ends a wait that never does)."""
    while not condition():
        time.sleep(0.01)


def test_bad_requests_get_openai_style_4xx_errors(make, hf_engine):
    h = make(Recorder(hf_engine), max_tokens_limit=32, max_body_bytes=4096)
    rid = h.endpoint.open_rollout("bad")
    named = {"X-Rollout-Id": rid}
    chat = "/v1/chat/completions"
    error_of(h.http.post(chat, content=b"{not json", headers=named), 400, "invalid_json")
    error_of(h.http.post(chat, content=b"NaN", headers=named), 400, "invalid_json")
    error_of(h.post(chat, [1, 2], headers=named), 400)
    error_of(h.post(chat, {"model": "p"}, headers=named), 400, param="messages")
    error_of(h.post(chat, {"messages": []}, headers=named), 400, param="messages")
    error_of(h.post(chat, {"messages": [{"role": "wizard", "content": "x"}]}, headers=named),
             400, param="messages[0].role")
    error_of(h.post(chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                    headers=named), 400, param="messages[0].content")
    error_of(h.post(chat, {"messages": HI, "temperature": "hot"}, headers=named), 400,
             param="temperature")
    error_of(h.post(chat, {"messages": HI, "max_tokens": 33}, headers=named), 400,
             "max_tokens_exceeded", "max_tokens")
    error_of(h.post(chat, {"messages": HI, "max_completion_tokens": 1000}, headers=named), 400,
             "max_tokens_exceeded", "max_completion_tokens")
    error_of(h.post(chat, {"messages": HI, "max_tokens": 0}, headers=named), 400, param="max_tokens")
    for field, value in (("n", 2), ("stream", True), ("top_p", 0.9), ("top_k", 5),
                         ("logit_bias", {"5": 1.0}), ("top_logprobs", 3),
                         ("presence_penalty", 0.5), ("response_format", {"type": "json_object"})):
        error_of(h.post(chat, {"messages": HI, field: value}, headers=named), 400,
                 "unsupported_parameter", field)
    error_of(h.post(chat, {"messages": HI, "stop_token_ids": [10**9]}, headers=named), 400,
             param="stop_token_ids")
    error_of(h.post("/v1/completions", {"prompt": [10**9]}, headers=named), 400, param="prompt")
    error_of(h.post("/v1/completions", {"prompt": ["a", "b"]}, headers=named), 400, param="prompt")
    error_of(h.post(chat, {"messages": HI * 200}, headers=named), 413, "request_too_large")

    def chunks():  # no content-length: the limit holds while the body streams in
        yield b'{"messages": ['
        for _ in range(200):
            yield b'{"role": "user", "content": "hi"},'
        yield b'{"role": "user", "content": "hi"}]}'

    error_of(h.http.post(chat, content=chunks(), headers=named), 413, "request_too_large")
    # Rollout naming.
    error_of(h.post(chat, {"messages": HI}), 400, "missing_rollout_id", "rollout_id")
    error_of(h.post(chat, {"messages": HI}, headers={"X-Rollout-Id": "nope"}), 404, "unknown_rollout")
    error_of(h.post(chat, {"messages": HI, "rollout_id": "other"}, headers=named), 400,
             "conflicting_rollout_id")
    error_of(h.post(chat, {"messages": HI}, headers={"X-Rollout-Id": "../etc"}), 400,
             param="rollout_id")
    error_of(h.post(f"/rollouts/{rid}/v1/chat/completions", {"messages": HI},
                    headers={"X-Rollout-Id": "other"}), 400, "conflicting_rollout_id")
    error_of(h.http.get("/v1/nothing"), 404, "not_found")
    error_of(h.http.get(chat), 405)
    assert h.engine.requests == 0 and h.staged_keys() == []  # nothing reached engine or store
    # Through the openai client: typed errors, no retries of a 4xx.
    client = h.client(rid)
    with pytest.raises(openai.BadRequestError) as bad:
        asyncio.run(client.chat.completions.create(model="p", messages=HI, max_tokens=500))
    assert bad.value.code == "max_tokens_exceeded"
    with pytest.raises(openai.NotFoundError):
        asyncio.run(h.client("ghost").chat.completions.create(model="p", messages=HI))
    # The body (extra_body) names the rollout as well as the header does; the URL prefix too.
    base = openai.AsyncOpenAI(base_url=h.base_url, api_key="unused")
    r = asyncio.run(base.chat.completions.create(model="p", messages=HI,
                                                 extra_body={"rollout_id": rid}))
    assert r.model_extra["tq_staging"]["rollout_id"] == rid
    prefixed = openai.AsyncOpenAI(base_url=h.endpoint.base_url_for(rid), api_key="unused")
    r = asyncio.run(prefixed.chat.completions.create(model="p", messages=HI + [
        r.choices[0].message, {"role": "user", "content": "more"}]))
    assert r.model_extra["tq_staging"]["continuation"] == "extend"
    # A closed rollout refuses further calls with a 409 the client does not retry.
    h.endpoint.close_rollout(rid)
    err = error_of(h.post(chat, {"messages": HI}, headers=named), 409, "rollout_closed")
    assert err["type"] == "invalid_request_error"
    with pytest.raises(ValueError, match="never reused"):
        h.endpoint.open_rollout(rid)
    counts = h.endpoint.stats()
    assert counts["calls_staged"] == 2 and counts["bad_requests"] >= 30


def test_off_loopback_needs_a_token_and_every_request_must_carry_it(make, hf_engine, policy):
    with pytest.raises(ValueError, match="api_key"):
        AgentEndpoint(hf_engine, object(), policy[0], host="0.0.0.0")
    with pytest.raises(ValueError, match="api_key"):
        AgentEndpoint(hf_engine, object(), policy[0], host="10.1.2.3")
    h = make(Recorder(hf_engine), api_key="s3cret")
    rid = h.endpoint.open_rollout("auth")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}):
        error_of(h.post("/v1/chat/completions", {"messages": HI},
                        headers={"X-Rollout-Id": rid, **headers}), 401, "invalid_api_key")
        error_of(h.http.get("/v1/models", headers=headers), 401, "invalid_api_key")
    async def list_models(key: str):
        return await openai.AsyncOpenAI(base_url=h.base_url, api_key=key).models.list()

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(list_models("wrong"))
    assert [m.id for m in asyncio.run(list_models("s3cret")).data] == ["policy"]
    r = asyncio.run(h.client(rid).chat.completions.create(model="p", messages=HI))  # the key
    assert r.choices[0].message.role == "assistant"
    assert h.engine.requests == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_host_serves_without_a_token_on_loopback_only(make, host):
    """``localhost`` and ``::1`` count as loopback (no api_key asked for), and the socket the
    endpoint listens on is a loopback address; ``::`` and ``0.0.0.0`` are not."""
    import ipaddress

    import psutil

    for everywhere in ("::", "0.0.0.0"):
        with pytest.raises(ValueError, match="api_key"):
            make(Scripted([]), host=everywhere)
    h = make(Recorder(Scripted([[5, 6, 7]])), host=host)
    bound = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == h.endpoint.port}
    assert bound and all(ipaddress.ip_address(ip).is_loopback for ip in bound), bound
    assert [m["id"] for m in h.http.get("/v1/models").json()["data"]] == ["policy"]
    rid = h.endpoint.open_rollout("loopback")
    r = asyncio.run(h.client(rid).chat.completions.create(model="p", messages=HI))
    assert r.choices[0].message.role == "assistant"


def test_a_call_that_does_not_stage_is_an_error_and_poisons_its_rollout(make, hf_engine):
    h = make(Recorder(hf_engine), sink_wrap=lambda s: SinkWrapper(s, fail_on=(2,)))
    rid = h.endpoint.open_rollout("poison")
    other = h.endpoint.open_rollout("healthy")

    async def run():
        client = h.client(rid)
        r1 = await client.chat.completions.create(model="p", messages=HI, seed=1)
        m = HI + [r1.choices[0].message, {"role": "user", "content": "again"}]
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(model="p", messages=m, seed=2)
        with pytest.raises(openai.ConflictError) as refused:
            await client.chat.completions.create(model="p", messages=m + [
                {"role": "user", "content": "and?"}], seed=3)
        ok = await h.client(other).chat.completions.create(model="p", messages=HI, seed=4)
        return failed.value, refused.value, ok

    failed, refused, ok = asyncio.run(run())
    assert failed.code == "staging_failed" and refused.code == "rollout_poisoned"
    assert h.engine.requests == 3  # the failed call was not retried by the client
    assert ok.model_extra["tq_staging"]["model_call_id"] == "call0"
    receipt = h.endpoint.close_rollout(rid, reward=1.0)
    assert receipt.capture_poisoned and len(receipt.manifest) == 1
    meta, td = h.finalize([receipt, h.endpoint.close_rollout(other, reward=1.0)])
    assert [t["staging_status"] for t in meta.tags] == ["capture_poisoned", "ok"]
    assert td[SAMPLE_MASK].tolist() == [0.0, 1.0]
    assert h.endpoint.stats()["stage_failures"] == 1
    # A rollout that staged nothing closes as a failed receipt: a placeholder, not an error.
    empty = h.endpoint.close_rollout(h.endpoint.open_rollout("empty"))
    assert empty.capture_poisoned and empty.failure_reason == "no_staged_calls"


def test_a_sink_that_raises_is_a_stage_failure_too(make, hf_engine):
    class Raising(SinkWrapper):
        def stage(self, record, *, attachments=None):
            raise OSError("disk gone")

    h = make(Recorder(hf_engine), sink_wrap=Raising)
    rid = h.endpoint.open_rollout("raising")
    with pytest.raises(openai.InternalServerError) as failed:
        asyncio.run(h.client(rid).chat.completions.create(model="p", messages=HI))
    assert failed.value.code == "staging_failed" and "Traceback" not in str(failed.value.body)
    assert h.endpoint.close_rollout(rid).capture_poisoned


def test_an_engine_failure_is_a_retryable_error_that_stages_nothing(make, hf_engine):
    rec = Recorder(hf_engine)
    rec.fail = RuntimeError("CUDA error: device lost")
    h = make(rec)
    rid = h.endpoint.open_rollout("engine-down")
    with pytest.raises(openai.InternalServerError) as failed:
        asyncio.run(h.client(rid, max_retries=1).chat.completions.create(model="p", messages=HI))
    assert failed.value.status_code == 503 and failed.value.code == "engine_error"
    assert "device lost" not in str(failed.value.body)  # no internals in the answer
    assert rec.requests == 2 and h.staged_keys() == []  # retried once, nothing staged
    rec.fail = None
    r = asyncio.run(h.client(rid).chat.completions.create(model="p", messages=HI))
    assert r.model_extra["tq_staging"]["continuation"] == "root"


def test_a_client_that_leaves_before_its_call_is_staged_leaves_no_row(make, hf_engine):
    rec = Recorder(hf_engine)
    rec.gate = threading.Event()
    h = make(rec)
    rid = h.endpoint.open_rollout("leaver")
    client = h.client(rid, max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        asyncio.run(client.chat.completions.create(model="p", messages=HI, seed=1))
    rec.gate.set()  # the engine answers after the client left
    _until(lambda: h.endpoint.stats().get("abandoned", 0) >= 1)
    assert h.endpoint.stats()["abandoned"] == 1 and h.staged_keys() == []
    # The rollout is not poisoned: the same request again is a fresh call, staged once.
    r = asyncio.run(h.client(rid).chat.completions.create(model="p", messages=HI, seed=1))
    assert r.model_extra["tq_staging"]["model_call_id"] == "call0"
    assert len(h.staged_keys()) == 1
    receipt = h.endpoint.close_rollout(rid, reward=1.0)
    assert not receipt.capture_poisoned and len(receipt.manifest) == 1


class _FirstAttemptLeaves(httpx.AsyncBaseTransport):
    """The first request goes out and then "times out" (the connection dropped, an
    ``httpx.ReadTimeout`` raised, as a client timeout does) once ``staging`` is set; later
    requests pass. So the first attempt leaves after its call began staging, whatever the clock."""

    def __init__(self, staging: threading.Event) -> None:
        self.inner, self.staging, self.sent = httpx.AsyncHTTPTransport(), staging, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        if self.sent > 1:
            return await self.inner.handle_async_request(request)
        attempt = asyncio.ensure_future(self.inner.handle_async_request(request))
        await asyncio.to_thread(self.staging.wait)
        attempt.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await attempt
        raise httpx.ReadTimeout("the first attempt left once its call was staging",
                                request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_retried_request_is_answered_from_its_first_attempt(make, hf_engine):
    """The openai client retries a timed-out call with the same body: a retry joins the call
    in flight (here held in ``stage``), gets its answer, and the call is staged once. The first
    attempt times out once its call is staging (``_FirstAttemptLeaves``): a client that left
    earlier leaves nothing behind (the test above), so no clock may decide which case runs."""
    gate = threading.Event()
    h = make(Recorder(Scripted([[5, 6, 7]] * 8)), sink_wrap=lambda s: SinkWrapper(s, gate=gate))
    rid = h.endpoint.open_rollout("retry")
    transport = _FirstAttemptLeaves(h.sink.entered)
    client = h.client(rid, max_retries=1, timeout=60,
                      http_client=httpx.AsyncClient(transport=transport))
    answer = {}

    def call():
        answer["r"] = asyncio.run(client.chat.completions.create(model="p", messages=HI, seed=1))

    caller = threading.Thread(target=call)
    caller.start()
    # the retry joined the call (or, wrongly, started a second one)
    _until(lambda: h.endpoint.stats().get("replays", 0) or h.sink.stages > 1)
    assert h.endpoint.stats()["replays"] == 1 and h.sink.stages == 1
    assert "r" not in answer  # the call is still held in its stage
    gate.set()
    caller.join()
    assert transport.sent == 2
    r = answer["r"]
    assert h.endpoint.stats()["replays"] == 1
    assert h.staged_keys() == [r.model_extra["tq_staging"]["staging_key"]]
    assert h.engine.requests == 1 and h.sink.stages == 1
    # The same body again (a client that retries on its own) gets the same answer, replayed.
    raw = h.post("/v1/chat/completions", {"model": "p", "messages": HI, "seed": 1},
                 headers={"X-Rollout-Id": rid})
    assert raw.headers["x-tq-replay"] == "true"
    assert raw.json()["choices"] == r.model_dump()["choices"] or \
        raw.json()["choices"][0]["message"]["content"] == r.choices[0].message.content
    # An Idempotency-Key names a request: the same key and body replay, a new key samples anew.
    body = {"model": "p", "messages": HI, "seed": 1}
    first = h.post("/v1/chat/completions", body, headers={"X-Rollout-Id": rid,
                                                          "Idempotency-Key": "k1"})
    again = h.post("/v1/chat/completions", body, headers={"X-Rollout-Id": rid,
                                                          "Idempotency-Key": "k1"})
    assert again.headers["x-tq-replay"] == "true" and again.json() == first.json()
    error_of(h.post("/v1/chat/completions", {**body, "seed": 2},
                    headers={"X-Rollout-Id": rid, "Idempotency-Key": "k1"}), 400,
             "idempotency_key_reused")
    assert len(h.staged_keys()) == 2 and h.engine.requests == 2
    receipt = h.endpoint.close_rollout(rid, reward=1.0)
    assert len(receipt.manifest) == 2  # two distinct calls, each staged once
    meta, _ = h.finalize([receipt])
    assert meta.tags[0]["staging_status"] == "ok"


def test_close_waits_for_calls_in_flight(make, hf_engine):
    rec = Recorder(hf_engine)
    rec.gate = threading.Event()
    h = make(rec)
    rid = h.endpoint.open_rollout("inflight")

    async def run():
        task = asyncio.ensure_future(h.client(rid).chat.completions.create(model="p", messages=HI))
        await asyncio.sleep(0.3)
        closing = asyncio.ensure_future(h.endpoint.aclose_rollout(rid, reward=1.0))
        await asyncio.sleep(0.2)
        assert not closing.done()
        late = await asyncio.to_thread(h.post, "/v1/chat/completions",
                                       {"messages": HI + HI}, headers={"X-Rollout-Id": rid})
        rec.gate.set()
        return await task, await closing, late

    r, receipt, late = asyncio.run(run())
    error_of(late, 409, "rollout_closed")
    assert [c.model_call_id for c in receipt.manifest] == [r.model_extra["tq_staging"]["model_call_id"]]

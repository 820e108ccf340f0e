"""An OpenAI-compatible HTTP endpoint over a rollout engine that stages every call token-exact.

Any agent written against the OpenAI API can be trained: point its client at the endpoint,
name the rollout each call belongs to, and every call's tokens are staged through
``TQTokenSink`` before the answer is sent, so the reassembler trains on exactly the tokens
the engine saw and sampled.

Python API (what a recipe calls)::

    endpoint = AgentEndpoint(engine, sink, tokenizer, model_name="policy")
    base_url = endpoint.start()                 # http://127.0.0.1:<free port>/v1
    rid = endpoint.open_rollout("s0-p3-g1")      # ids: [A-Za-z0-9][A-Za-z0-9._-]*
    client = endpoint.client(rid)               # openai.AsyncOpenAI bound to the rollout
    reward = await solve(client, row)           # any agent loop: tools, turns, branches
    receipt = await endpoint.aclose_rollout(rid, reward=reward)   # or close_rollout (sync)
    RolloutReassembler(...).finalize_group([receipt, ...], partition_id=...)
    endpoint.update_weights(named_weights, version=step)          # between engine batches
    endpoint.stats()                            # counts for metrics.csv
    endpoint.stop()                             # the engine and the sink stay the caller's

Routes: ``POST /v1/chat/completions`` (messages, temperature, max_tokens /
max_completion_tokens, stop, stop_token_ids, seed, n=1, tools through the tokenizer's chat
template, logprobs, return_token_ids, return_tokens_as_token_ids), ``POST /v1/completions``
(a text or token-id prompt), ``GET /v1/models``, ``POST /tokenize`` (vLLM's: with a rollout
id, the prompt the next chat call would get, nothing staged), ``GET /health``. The same
routes also live under ``/rollouts/<rollout_id>/`` (``base_url_for``) for agents that only
take a ``base_url``.

A request names its rollout by the ``X-Rollout-Id`` header, ``rollout_id`` in the body
(``extra_body={"rollout_id": ...}``) or the URL prefix; a rollout is opened by
``open_rollout`` first (``auto_open=True`` opens unknown ids on their first call). Its first
call is staged as a ``text`` root; a call whose messages extend a staged call's conversation
is a ``token_in`` child whose prefix is that call's staging chain (read back from staging)
followed by the newly templated messages (:mod:`tq_plugin.rollout.openai.template`); an
edited history forks or starts a new root, and the response says so
(:mod:`tq_plugin.rollout.openai.session`). The engine's sampled ids and logprobs and the
``weight_version`` it served with are staged before the response is sent; a call that does
not stage is answered with an error (500, ``staging_failed``) and poisons its rollout (its
receipt is ``capture_poisoned``: a placeholder row, never a silent gap). A retried request
(the same body, or the same ``Idempotency-Key``) is answered from the first attempt and never
staged twice; a request whose client disconnects before its call is staged is dropped whole.

Security: loopback (127.0.0.1) by default; binding anything else needs ``api_key``, and with
a key every request must carry ``Authorization: Bearer <key>``. Bad input gets an OpenAI-style
4xx JSON error; nothing answers with a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
import logging
import random
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tq_plugin.rollout.engine import RolloutEngine
from tq_plugin.rollout.openai.batcher import EngineBatcher
from tq_plugin.rollout.openai.calls import CallSpec, chat_spec, completion_spec
from tq_plugin.rollout.openai.pipeline import CallPipeline, CallTiming
from tq_plugin.rollout.openai.protocol import (
    ROLLOUT_ID,
    TOOL_PARSERS,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    bad_request,
    parse,
)
from tq_plugin.rollout.openai.session import Rollout
from tq_plugin.rollout.openai.template import PromptBuilder
from tq_plugin.staging import ChainPrefixCache, RolloutReceipt, TQTokenSource

log = logging.getLogger(__name__)
_CLOSED_KEPT = 100_000


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AgentEndpoint(CallPipeline):
    """The endpoint (module docstring). ``engine`` is a :class:`RolloutEngine`, ``sink`` a
    ``TQTokenSink`` (any ``StagingSink``; with ``prefix_from_store`` the prefix of every
    ``token_in`` call is read back through the sink's data plane), ``tokenizer`` an HF
    tokenizer with a chat template.

    ``stop_token_ids`` end every continuation (default: the tokenizer's EOS);
    ``allowed_token_ids`` restricts what the policy may emit (as ``SamplingParams`` does);
    ``max_tokens_limit`` caps ``max_tokens``; ``max_model_len`` caps prompt + ``max_tokens``;
    ``tool_parser``: ``"hermes"`` (``<tool_call>{json}</tool_call>`` → ``tool_calls``),
    ``None`` (text only) or a callable ``text -> (content, tool_calls)``.
    """

    def __init__(self, engine: RolloutEngine, sink: Any, tokenizer: Any, *,
                 model_name: str = "policy", host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, stop_token_ids: Sequence[int] | None = None,
                 allowed_token_ids: Sequence[int] | None = None, default_max_tokens: int = 256,
                 max_tokens_limit: int = 4096, max_model_len: int | None = None,
                 max_body_bytes: int = 4 << 20,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 tool_parser: Any = "hermes", auto_open: bool = False, seed: int = 0,
                 max_batch: int = 64, batch_wait_s: float = 0.0,
                 prefix_from_store: bool = True, io_threads: int = 4) -> None:
        if not is_loopback(host) and not api_key:
            raise ValueError(f"AgentEndpoint: binding {host!r} (not loopback) needs api_key: "
                             "every request must then carry 'Authorization: Bearer <key>'")
        if isinstance(tool_parser, str):
            if tool_parser not in TOOL_PARSERS:
                raise ValueError(f"tool_parser must be one of {list(TOOL_PARSERS)}, None or a "
                                 "callable")
            tool_parser = TOOL_PARSERS[tool_parser]
        elif tool_parser is not None and not callable(tool_parser):
            raise ValueError("tool_parser must be a parser name, None or a callable")
        eos = getattr(tokenizer, "eos_token_id", None)
        stops = list(stop_token_ids) if stop_token_ids is not None else [eos] if eos is not None \
            else []
        if not stops:
            raise ValueError("AgentEndpoint needs stop_token_ids (the tokenizer has no EOS)")
        self.engine, self.sink, self.tokenizer = engine, sink, tokenizer
        self.model_name, self.host, self.port, self.api_key = model_name, host, port, api_key
        self.stop_token_ids = tuple(stops)
        self.allowed_token_ids = None if allowed_token_ids is None else tuple(allowed_token_ids)
        self.default_max_tokens, self.max_tokens_limit = default_max_tokens, max_tokens_limit
        self.max_model_len, self.max_body_bytes = max_model_len, max_body_bytes
        self.auto_open, self.tool_parser = auto_open, tool_parser
        self.builder = PromptBuilder(tokenizer, chat_template_kwargs=chat_template_kwargs)
        self.vocab = len(tokenizer)
        self._batcher = EngineBatcher(engine, max_batch=max_batch, batch_wait_s=batch_wait_s)
        self.io_threads = io_threads
        self._io: ThreadPoolExecutor | None = None
        self._prefixes = None
        store = getattr(sink, "store", None)
        if prefix_from_store and store is not None:
            self._prefixes = ChainPrefixCache(TQTokenSource(
                store.dp_client, staging_partition=sink.staging_partition,
                capture_media=getattr(sink, "capture_media", False)))
        self._rng = random.Random(seed)
        self._rollouts: dict[str, Rollout] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.timings: collections.deque[CallTiming] = collections.deque(maxlen=100_000)
        self.counts = collections.Counter()

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The ``base_url`` an OpenAI client takes (``.../v1``)."""
        return f"{self.url}/v1"

    def base_url_for(self, rollout_id: str) -> str:
        """A ``base_url`` that names the rollout itself, for agents that take nothing else."""
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def start(self, timeout: float = 30.0) -> str:
        """Bind (port 0: a free port), serve on a background thread and return ``base_url``."""
        if self._thread is not None:
            return self.base_url
        import uvicorn

        from tq_plugin.rollout.openai.app import build_app

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._batcher.start()
        self._io = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tq-agent-staging")
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            ready.set()
            try:
                loop.run_until_complete(self._server.serve(sockets=[sock]))
            finally:
                loop.close()
                sock.close()

        self._thread = threading.Thread(target=serve, name="tq-agent-endpoint", daemon=True)
        self._thread.start()
        ready.wait(timeout)
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("AgentEndpoint: the HTTP server did not start")
            time.sleep(0.01)
        return self.base_url

    def stop(self) -> None:
        """Stop serving (open requests get up to 5 s) and the engine thread; idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._server.should_exit = True
            thread.join(15)
        self._batcher.stop()
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def __enter__(self) -> AgentEndpoint:  # noqa: PYI034 - Self needs Python 3.11
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- rollouts --------------------------------------------------------------------------
    def open_rollout(self, rollout_id: str | None = None) -> str:
        """Register a rollout (a fresh id when ``None``); an id is never reused, as its staging
        keys stay in the store until the reassembler clears them."""
        rid = rollout_id or f"r-{random.getrandbits(64):016x}"
        if not ROLLOUT_ID.match(rid):
            raise ValueError(f"rollout id {rid!r} must match {ROLLOUT_ID.pattern}")
        with self._lock:
            if rid in self._rollouts or rid in self._closed:
                raise ValueError(f"rollout {rid!r} was opened before (ids are never reused)")
            self._rollouts[rid] = Rollout(rid)
            self.counts["rollouts_opened"] += 1
        return rid

    def client(self, rollout_id: str, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` whose every call names ``rollout_id`` (``X-Rollout-Id``)."""
        import openai

        headers = {**kwargs.pop("default_headers", {}), "X-Rollout-Id": rollout_id}
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused",
                                  default_headers=headers, **kwargs)

    def close_rollout(self, rollout_id: str, *, reward: float | None = None,
                      terminal_call_id: str | None = None, timeout: float | None = None
                      ) -> RolloutReceipt:
        """Close a rollout and return its receipt (declared terminal: ``terminal_call_id``,
        else the call staged last). New requests for it are refused (409); calls in flight
        are waited for (``timeout``: then those not yet staging are dropped)."""
        if self._loop is None or self._thread is None:
            raise RuntimeError("AgentEndpoint is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("close_rollout would block the server's loop: await aclose_rollout")
        future = asyncio.run_coroutine_threadsafe(
            self._close(rollout_id, reward, terminal_call_id, timeout), self._loop)
        return future.result()

    async def aclose_rollout(self, rollout_id: str, *, reward: float | None = None,
                             terminal_call_id: str | None = None, timeout: float | None = None
                             ) -> RolloutReceipt:
        """:meth:`close_rollout` for an event loop (the recipe's or the server's own)."""
        if self._loop is None:
            raise RuntimeError("AgentEndpoint is not running")
        coro = self._close(rollout_id, reward, terminal_call_id, timeout)
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _close(self, rid: str, reward: float | None, terminal: str | None,
                     timeout: float | None) -> RolloutReceipt:
        rollout = self._rollouts.get(rid)
        if rollout is None:
            raise KeyError(f"rollout {rid!r} is not open")
        rollout.closing = True
        pending = [e.done for e in rollout.entries.values() if not e.done.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                rollout.closed = True  # not yet staging: dropped when the engine answers
                staging = [e.done for e in rollout.entries.values()
                           if e.staging and not e.done.done()]
                if staging:
                    await asyncio.wait(staging)
        rollout.closed = True
        receipt = rollout.receipt(reward=reward, terminal_call_id=terminal)
        with self._lock:
            self._rollouts.pop(rid, None)
            self._closed[rid] = None
            while len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)
        self.counts["rollouts_closed"] += 1
        self.counts["rollouts_poisoned"] += int(receipt.capture_poisoned)
        self.counts["branches"] += rollout.branches
        return receipt

    def update_weights(self, weights: Any, *, version: int) -> None:
        """``engine.update_weights`` on the engine thread, between two engine calls."""
        self._batcher.call(lambda engine: engine.update_weights(weights, version=version))

    def stats(self) -> dict[str, int]:
        """Counts since start: ``calls_staged``, ``stage_failures``, ``engine_failures``,
        ``replays``, ``abandoned``, ``branches``, ``bad_requests``, ``rollouts_*``."""
        return {**self.counts, "rollouts_open": len(self._rollouts)}

    # -- requests (on the server's loop) ------------------------------------------------------
    def rollout_for(self, rid: str | None) -> Rollout:
        if rid is None:
            raise bad_request("name the call's rollout: an X-Rollout-Id header or 'rollout_id' "
                              "in the body (extra_body)", param="rollout_id",
                              code="missing_rollout_id")
        if not ROLLOUT_ID.match(rid):
            raise bad_request(f"rollout_id must match {ROLLOUT_ID.pattern}", param="rollout_id")
        rollout = self._rollouts.get(rid)
        if rollout is None and rid in self._closed:
            raise OpenAIError(409, f"rollout {rid!r} is closed", code="rollout_closed", retry=False)
        if rollout is None and self.auto_open:
            with self._lock:
                rollout = self._rollouts.get(rid)
                if rollout is None and rid not in self._closed:
                    rollout = self._rollouts[rid] = Rollout(rid)
                    self.counts["rollouts_opened"] += 1
        if rollout is None:
            raise OpenAIError(404, f"rollout {rid!r} is not open", param="rollout_id",
                              code="unknown_rollout", retry=False)
        if rollout.closing:
            raise OpenAIError(409, f"rollout {rid!r} is closed", code="rollout_closed", retry=False)
        if rollout.poisoned:
            raise OpenAIError(409, f"rollout {rid!r} is poisoned ({rollout.poisoned}): a call "
                              "of it did not stage", code="rollout_poisoned", retry=False)
        return rollout

    def spec(self, route: str, body: dict[str, Any]) -> CallSpec:
        limits = {"stop_ids": self.stop_token_ids, "allowed": self.allowed_token_ids,
                  "default_max_tokens": self.default_max_tokens,
                  "max_tokens_limit": self.max_tokens_limit, "vocab": self.vocab}
        if route == "chat":
            return chat_spec(parse(ChatRequest, body), self.builder, **limits)
        return completion_spec(parse(CompletionRequest, body), self.builder, **limits)

    def authorize(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "a valid 'Authorization: Bearer <key>' header is required",
                              code="invalid_api_key", retry=False)

__all__ = ["AgentEndpoint", "CallTiming", "is_loopback"]

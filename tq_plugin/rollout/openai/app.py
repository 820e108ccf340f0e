"""The FastAPI app of :class:`~tq_plugin.rollout.openai.server.AgentEndpoint`: routes, body
limits, rollout ids, retries joining their first attempt, disconnects, OpenAI-style errors.

FastAPI is imported only here (the ``serve`` extra), when an endpoint starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from tq_plugin.rollout.openai.protocol import OpenAIError, bad_request, fingerprint, json_loads
from tq_plugin.rollout.openai.session import Answer, Entry

log = logging.getLogger(__name__)
ROLLOUT_HEADER = "x-rollout-id"
IDEMPOTENCY_HEADER = "idempotency-key"


async def read_json(request: Any, limit: int) -> Any:
    """The body as JSON, refused past ``limit`` bytes (413) whether or not it says its length."""
    declared = request.headers.get("content-length")
    too_big = OpenAIError(413, f"the request body is over this endpoint's limit of {limit} bytes",
                          code="request_too_large", retry=False)
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    try:
        return json_loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None


def rollout_id_of(request: Any, body: Any, path_rid: str | None) -> str | None:
    """The rollout a request names (header, body or URL); two that disagree are refused."""
    named = {request.headers.get(ROLLOUT_HEADER), path_rid,
             body.get("rollout_id") if isinstance(body, dict) else None} - {None}
    if len(named) > 1:
        raise bad_request(f"the request names several rollouts: {sorted(map(str, named))}",
                          param="rollout_id", code="conflicting_rollout_id")
    rid = next(iter(named), None)
    if rid is not None and not isinstance(rid, str):
        raise bad_request("rollout_id must be a string", param="rollout_id")
    return rid


async def _disconnected(request: Any) -> None:
    """Returns when the client goes away (the body has been read: only a disconnect is left)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def build_app(endpoint: Any) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers())

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error(OpenAIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(bad_request(f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("agent endpoint: unhandled %s", type(exc).__name__, exc_info=exc)
        return error(OpenAIError(500, "internal error", type="server_error", code="internal_error"))

    async def guarded(fn: Any, request: Request, *args: Any) -> Any:
        try:
            endpoint.authorize(request.headers.get("authorization"))
            return await fn(request, *args)
        except OpenAIError as exc:
            endpoint.counts["bad_requests" if exc.status < 500 else "server_errors"] += 1
            return error(exc)
        except Exception as exc:
            log.exception("agent endpoint: %s failed", request.url.path)
            endpoint.counts["server_errors"] += 1
            return error(OpenAIError(500, f"internal error ({type(exc).__name__})",
                                     type="server_error", code="internal_error"))

    async def call(request: Request, route: str, path_rid: str | None) -> Any:
        body = await read_json(request, endpoint.max_body_bytes)
        rid = rollout_id_of(request, body, path_rid)
        spec = endpoint.spec(route, body)
        rollout = endpoint.rollout_for(rid)
        body_fp = fingerprint(route, body)
        idem = request.headers.get(IDEMPOTENCY_HEADER)
        key = f"idem:{idem}" if idem else body_fp
        entry = rollout.entries.get(key)
        replay = entry is not None
        if entry is not None and entry.body_fp != body_fp:
            raise bad_request("this Idempotency-Key was used with another request body",
                              code="idempotency_key_reused")
        if entry is None:
            entry = Entry(key, asyncio.get_running_loop().create_future(), body_fp=body_fp)
            rollout.entries[key] = entry
            asyncio.get_running_loop().create_task(endpoint.run_call(rollout, entry, spec))
        else:
            endpoint.counts["replays"] += 1
        entry.waiters += 1
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({entry.done, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            entry.waiters -= 1
        answer: Answer | None = entry.done.result() if entry.done.done() else None
        if answer is None:  # the client left (or its call was dropped): nobody reads this
            return Response(status_code=499)
        headers = dict(answer.headers)
        if replay:
            headers["x-tq-replay"] = "true"
        return JSONResponse(answer.body, answer.status, headers=headers)

    async def models(request: Request, _: str | None = None) -> Any:
        return JSONResponse({"object": "list", "data": [{
            "id": endpoint.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tq_plugin", "max_model_len": endpoint.max_model_len}]})

    async def tokenize(request: Request, path_rid: str | None) -> Any:
        body = await read_json(request, endpoint.max_body_bytes)
        rid = rollout_id_of(request, body, path_rid)
        return JSONResponse(await endpoint.tokenize(body, rid))

    for prefix, has_rid in (("", False), ("/rollouts/{rollout_id}", True)):
        def route(fn: Any, *args: Any, has_rid: bool = has_rid) -> Any:
            if has_rid:
                async def handler(request: Request, rollout_id: str) -> Any:
                    return await guarded(fn, request, *args, rollout_id)
            else:
                async def handler(request: Request) -> Any:
                    return await guarded(fn, request, *args, None)
            return handler

        app.add_api_route(f"{prefix}/v1/chat/completions", route(call, "chat"), methods=["POST"])
        app.add_api_route(f"{prefix}/v1/completions", route(call, "completion"), methods=["POST"])
        app.add_api_route(f"{prefix}/v1/models", route(models), methods=["GET"])
        app.add_api_route(f"{prefix}/tokenize", route(tokenize), methods=["POST"])
        app.add_api_route(f"{prefix}/v1/tokenize", route(tokenize), methods=["POST"])

    async def health(request: Request, _: str | None = None) -> Any:
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", route(health, has_rid=False), methods=["GET"])

    return app


__all__ = ["IDEMPOTENCY_HEADER", "ROLLOUT_HEADER", "build_app", "read_json", "rollout_id_of"]

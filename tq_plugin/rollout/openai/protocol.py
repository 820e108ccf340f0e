"""The OpenAI wire format the agent endpoint speaks: request parsing, errors, messages, tool calls.

Pure functions and pydantic models, no server: :mod:`tq_plugin.rollout.openai.server` drives
them. What a request may ask for is what the engine can serve on-policy: sampling knobs the
trainer does not recompute (``top_p``, ``top_k``, penalties, ``logit_bias``), more than one
choice, streaming or top-k logprobs are refused with a 400 naming the field, never ignored.
Fields an OpenAI client sends that change nothing here (``user``, ``metadata``, ``store``,
``tool_choice``, ``parallel_tool_calls``, ...) are accepted and ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# [A-Za-z0-9][A-Za-z0-9._-]*: NeMo Gym's rollout-id alphabet (it is part of every staging key).
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``.

    ``retry=False`` adds ``x-should-retry: false``, which stops the ``openai`` client's
    automatic retries (it retries 408/409/429/5xx otherwise).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.retry = param, code, retry

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


class _Request(BaseModel):
    """Fields shared by chat and text completions; unknown fields are kept and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = None
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    rollout_id: str | None = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (rendered as a chat call is)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    rollout_id: str | None = None


def json_loads(raw: bytes) -> Any:
    """Strict JSON: ``NaN`` and ``Infinity`` are refused like any other non-JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(raw, parse_constant=refuse)


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` (decoded JSON) as ``model``, or a 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise bad_request(f"{param or 'body'}: {err.get('msg', 'invalid value')}",
                          param=param) from None


_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("n", lambda v: v not in (None, 1), "only n=1 is served (one staged call per request)"),
    ("best_of", lambda v: v not in (None, 1), "best_of is not served (n=1 only)"),
    ("stream", lambda v: bool(v),
     "streaming is not served: every call is staged before its response is sent"),
    ("top_p", lambda v: v not in (None, 1, 1.0),
     "top_p is not served: the engine samples the tempered distribution the trainer recomputes"),
    ("top_k", lambda v: v not in (None, -1, 0),
     "top_k is not served (the trainer recomputes the whole tempered distribution)"),
    ("min_p", lambda v: v not in (None, 0, 0.0), "min_p is not served"),
    ("presence_penalty", lambda v: v not in (None, 0, 0.0), "presence_penalty is not served"),
    ("frequency_penalty", lambda v: v not in (None, 0, 0.0), "frequency_penalty is not served"),
    ("repetition_penalty", lambda v: v not in (None, 1, 1.0), "repetition_penalty is not served"),
    ("logit_bias", lambda v: bool(v), "logit_bias is not served"),
    ("ignore_eos", lambda v: bool(v), "ignore_eos is not served"),
    ("min_tokens", lambda v: v not in (None, 0), "min_tokens is not served"),
    ("top_logprobs", lambda v: v not in (None, 0),
     "only the sampled token's logprob is served (top_logprobs=0)"),
    ("continue_final_message", lambda v: bool(v), "continue_final_message is not served"),
    ("add_generation_prompt", lambda v: v is False, "add_generation_prompt=false is not served"),
    ("echo", lambda v: bool(v), "echo is not served"),
    ("suffix", lambda v: v is not None, "suffix is not served"),
)


def check_supported(req: _Request) -> None:
    """A 400 for any field set to something the endpoint does not serve (module docstring)."""
    for name, bad, why in _UNSUPPORTED:
        if bad(getattr(req, name, None)):
            raise bad_request(why, param=name, code="unsupported_parameter")
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is served",
                          param="response_format", code="unsupported_parameter")
    if isinstance(req, CompletionRequest) and req.logprobs not in (None, 0, 1):
        raise bad_request("only the sampled token's logprob is served (logprobs <= 1)",
                          param="logprobs", code="unsupported_parameter")


def requested_max_tokens(req: _Request, *, default: int, limit: int) -> int:
    """``max_completion_tokens`` (else ``max_tokens``, else ``default``), at most ``limit``."""
    value = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if value is None:
        value, param = req.max_tokens, "max_tokens"
    if value is None:
        return min(default, limit)
    if value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param=param)
    if value > limit:
        raise bad_request(f"{param} is {value}, over this endpoint's limit of {limit}",
                          param=param, code="max_tokens_exceeded")
    return value


def stop_strings(req: _Request) -> list[str]:
    stop = req.stop
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > 16 or any(not s for s in strings):
        raise bad_request("stop: at most 16 non-empty strings", param="stop")
    return strings


def _text_of(content: Any, where: str) -> str | None:
    """Message content as text: a string, None, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{i}]: only text parts are served",
                                  param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string, a list of text parts or null",
                      param=f"{where}.content")


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the chat template wants them: a dict when the string is JSON."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated messages as plain dicts for ``apply_chat_template``: text content, and
    tool-call arguments parsed from their JSON string into the dict templates render."""
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise bad_request(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {list(ROLES)}, got {role!r}",
                              param=f"{where}.role")
        item: dict[str, Any] = {"role": role, "content": _text_of(msg.get("content"), where)}
        if item["content"] is None and not (role == "assistant" and msg.get("tool_calls")):
            item["content"] = ""
        for key in ("name", "tool_call_id"):
            if msg.get(key) is not None:
                if not isinstance(msg[key], str):
                    raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
                item[key] = msg[key]
        calls = msg.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls: a list, on assistant messages only",
                                  param=f"{where}.tool_calls")
            item["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{where}.tool_calls[{j}].function.name is required",
                                      param=f"{where}.tool_calls")
                item["tool_calls"].append({
                    "id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}})
        out.append(item)
    return out


def canonical_message(msg: Mapping[str, Any]) -> str:
    """What identifies a templated message when a client sends history back: role, text
    (null and "" alike), name, tool_call_id and each tool call's name and arguments (their
    JSON compared as values; call ids are ignored, as frameworks re-number them)."""
    calls = [[c["function"]["name"], c["function"]["arguments"]]
             for c in msg.get("tool_calls") or ()]
    key = [msg["role"], msg.get("content") or "", msg.get("name"), msg.get("tool_call_id"), calls]
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(route: str, body: Mapping[str, Any]) -> str:
    """The identity of a request within its rollout: route plus body (its rollout id left out,
    so a header- and a body-named retry agree). The ``openai`` client's retries resend the
    exact body, so they share it."""
    rest = {k: v for k, v in body.items() if k != "rollout_id"}
    return hashlib.sha256(f"{route}\n{canonical_json(rest)}".encode()).hexdigest()


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks become OpenAI ``tool_calls`` (arguments as a JSON string) and leave ``content``
    (``None`` when nothing else was said). A block that is not such JSON stays in the text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            continue
        args = payload.get("arguments", payload.get("parameters", {}))
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": payload["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


TOOL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes_tool_calls,
}


__all__ = ["ROLES", "ROLLOUT_ID", "TOOL_PARSERS", "ChatRequest", "CompletionRequest",
           "OpenAIError", "TokenizeRequest", "bad_request", "canonical_json",
           "canonical_message", "check_supported", "fingerprint", "json_loads", "parse",
           "parse_hermes_tool_calls", "requested_max_tokens", "stop_strings",
           "template_messages"]

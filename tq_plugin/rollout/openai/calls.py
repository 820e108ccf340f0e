"""One endpoint call from request to response body: what it asks the engine for, how the
sampled ids become the answer's text, and the OpenAI-shaped bodies.

:class:`CallSpec` is a validated request reduced to what the engine and the staging need;
:func:`finish` cuts a completion at the first stop string (the staged tokens end with the
token that completed it: a prefix of a sample is a sample, so nothing is re-tokenized) and
decodes the text the client sees; :func:`chat_body` / :func:`completion_body` write the
responses, with the token ids (``return_token_ids``) and logprobs when asked, and the
``tq_staging`` block that says where the call was staged.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tq_plugin.rollout.engine import SamplingParams
from tq_plugin.rollout.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    bad_request,
    canonical_json,
    canonical_message,
    check_supported,
    requested_max_tokens,
    stop_strings,
    template_messages,
)
from tq_plugin.rollout.openai.template import PromptBuilder


@dataclass
class CallSpec:
    """A validated request: ``kind`` is ``chat`` (messages), ``text`` or ``ids`` (a text or
    token-id completion prompt)."""

    route: str
    kind: str
    params: SamplingParams
    seed: int | None
    stops: list[str]
    logprobs: bool = False
    return_token_ids: bool = False
    as_token_ids: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    canon: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    context: str = ""
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)


def _params(req: Any, builder: PromptBuilder, *, stop_ids: Sequence[int],
            allowed: tuple[int, ...] | None, default_max_tokens: int,
            max_tokens_limit: int, vocab: int) -> tuple[SamplingParams, list[str]]:
    check_supported(req)
    max_tokens = requested_max_tokens(req, default=default_max_tokens, limit=max_tokens_limit)
    stops = stop_strings(req)
    ids = set(stop_ids)
    for i, tok in enumerate(req.stop_token_ids or ()):
        if not 0 <= tok < vocab:
            raise bad_request(f"stop_token_ids[{i}]: {tok} is not a token id of this model",
                              param="stop_token_ids")
        ids.add(tok)
    for s in stops:
        one = builder.single_token(s)
        if one is not None:
            ids.add(one)
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                            stop_token_ids=tuple(sorted(ids)), allowed_token_ids=allowed)
    return params, stops


def chat_spec(req: ChatRequest, builder: PromptBuilder, **limits: Any) -> CallSpec:
    params, stops = _params(req, builder, **limits)
    messages = template_messages(req.messages)
    kwargs = dict(req.chat_template_kwargs or {})
    return CallSpec(
        route="chat", kind="chat", params=params, seed=req.seed, stops=stops,
        logprobs=req.logprobs, return_token_ids=req.return_token_ids,
        as_token_ids=req.return_tokens_as_token_ids, messages=messages,
        canon=[canonical_message(m) for m in messages], tools=req.tools or None,
        template_kwargs=kwargs or None, context=canonical_json([req.tools or None, kwargs]))


def completion_spec(req: CompletionRequest, builder: PromptBuilder, **limits: Any) -> CallSpec:
    params, stops = _params(req, builder, **limits)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("one prompt per request (n=1)", param="prompt")
        prompt = prompt[0]
    spec = CallSpec(route="completion", kind="text", params=params, seed=req.seed, stops=stops,
                    logprobs=bool(req.logprobs is not None), return_token_ids=req.return_token_ids,
                    as_token_ids=req.return_tokens_as_token_ids)
    if isinstance(prompt, str):
        spec.prompt_text = prompt
        return spec
    vocab = limits["vocab"]
    if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt: token ids must be a non-empty list of ints in [0, {vocab})",
                          param="prompt")
    spec.kind, spec.prompt_ids = "ids", list(prompt)
    return spec


@dataclass
class Finished:
    """The staged generation (ids, logprobs) and what the client is told."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


def finish(ids: Sequence[int], logprobs: Sequence[float], spec: CallSpec,
           decode: Callable[[Sequence[int]], str]) -> Finished:
    """Cut at the first stop string (module docstring) and decode."""
    ids, logprobs = list(ids), [float(x) for x in logprobs]
    text = decode(ids)
    hit = [s for s in spec.stops if s in text]
    if hit:
        lo, hi = 0, len(ids) - 1  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(ids[: mid + 1]) for s in spec.stops):
                hi = mid
            else:
                lo = mid + 1
        ids, logprobs = ids[: lo + 1], logprobs[: lo + 1]
        text = decode(ids)
        text = text[: min(text.find(s) for s in spec.stops if s in text)]
        return Finished(ids, logprobs, text, "stop")
    stopped = bool(ids) and ids[-1] in spec.params.stop_token_ids
    return Finished(ids, logprobs, text, "stop" if stopped else "length")


def staging_block(record: Any, key: str, continuation: str) -> dict[str, Any]:
    return {"rollout_id": record.rollout_id, "model_call_id": record.model_call_id,
            "parent_call_id": record.parent_call_id, "mode": record.mode,
            "continuation": continuation, "branched": continuation in ("fork", "new_root"),
            "staging_key": key, "prev_len": record.prev_len, "cum_len": record.cum_len,
            "weight_version": record.weight_version}


def _token_strs(ids: Sequence[int], spec: CallSpec, token_text: Callable[[int], str]) -> list[str]:
    return [f"token_id:{t}" if spec.as_token_ids else token_text(t) for t in ids]


def chat_body(spec: CallSpec, fin: Finished, *, model: str, prompt: list[int],
              message: dict[str, Any], finish_reason: str, staging: dict[str, Any],
              token_text: Callable[[int], str]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason,
                              "logprobs": None}
    if spec.logprobs:
        choice["logprobs"] = {"content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace")),
             "top_logprobs": []}
            for s, lp in zip(_token_strs(fin.ids, spec, token_text), fin.logprobs)]}
    body = _envelope("chatcmpl", "chat.completion", model, prompt, fin, staging, spec)
    if spec.return_token_ids:
        choice["token_ids"] = fin.ids
    body["choices"] = [choice]
    return body


def completion_body(spec: CallSpec, fin: Finished, *, model: str, prompt: list[int],
                    staging: dict[str, Any], token_text: Callable[[int], str]
                    ) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": fin.text, "finish_reason": fin.finish_reason,
                              "logprobs": None}
    if spec.logprobs:
        strs = _token_strs(fin.ids, spec, token_text)
        offsets, at = [], 0
        for s in strs:
            offsets.append(at)
            at += len(s)
        choice["logprobs"] = {"tokens": strs, "token_logprobs": fin.logprobs,
                              "top_logprobs": [{s: lp} for s, lp in zip(strs, fin.logprobs)],
                              "text_offset": offsets}
    body = _envelope("cmpl", "text_completion", model, prompt, fin, staging, spec)
    if spec.return_token_ids:
        choice["token_ids"] = fin.ids
    body["choices"] = [choice]
    return body


def _envelope(prefix: str, obj: str, model: str, prompt: list[int], fin: Finished,
              staging: dict[str, Any], spec: CallSpec) -> dict[str, Any]:
    body = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": model,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(fin.ids),
                      "total_tokens": len(prompt) + len(fin.ids)},
            "tq_staging": staging}
    if spec.return_token_ids:  # vLLM's return_token_ids: the engine's prompt, the sampled ids
        body["prompt_token_ids"] = prompt
    return body


__all__ = ["CallSpec", "Finished", "chat_body", "chat_spec", "completion_body",
           "completion_spec", "finish", "staging_block"]

"""Prompt tokens for the agent endpoint: chat templating and the splice that keeps turns exact.

A rollout's first call is templated and tokenized whole (a ``text`` root). A later call that
extends a staged call's conversation is never re-tokenized: its prompt is the staged chain
(every token the engine saw or sampled so far, read back from staging) followed by the
*tail*, the tokens of what the template renders after the staged assistant reply (the
reply's closing tokens, the new user / tool messages and the generation prompt). The tail is
found by rendering the conversation with the staged reply's content replaced by a sentinel
and taking the text after it, so the reply is never re-rendered: a tool call the template
lays out differently, whitespace the model emitted, bytes after EOS (Qwen's ``<|im_end|>\\n``)
or a template that strips earlier reasoning cannot make the tokens drift (the failures
TRL, verl and SkyRL document). When the chain ends on a stop token the template also
closes the reply with, that token is not repeated.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from tq_plugin.rollout.openai.protocol import OpenAIError, bad_request


class SpliceError(ValueError):
    """The template does not render the staged reply's content verbatim exactly once, so the
    tail after it cannot be found; the call starts a new root instead."""


class PromptBuilder:
    """Tokenizer-side work of the endpoint (one instance, used from the server's event loop:
    HF fast tokenizers are not safe to share across threads)."""

    def __init__(self, tokenizer: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def single_token(self, text: str) -> int | None:
        """The id of ``text`` when it is exactly one token (a special token included)."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               generation_prompt: bool, kwargs: Mapping[str, Any] | None = None) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt,
                tokenize=False, **{**self.chat_template_kwargs, **(kwargs or {})})
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's own raise
            raise bad_request(f"the chat template refused these messages: {exc}",
                              param="messages", code="chat_template_error") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render text", param="messages")
        return text

    def chat_root(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The whole conversation templated with the generation prompt, tokenized once."""
        return self.encode(self.render(messages, tools, generation_prompt=True, kwargs=kwargs))

    def chat_tail(self, messages: list[dict[str, Any]], reply_index: int,
                  tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any] | None,
                  *, chain_last: int | None, stop_ids: Sequence[int]) -> list[int]:
        """The tokens after the staged reply ``messages[reply_index]`` (module docstring)."""
        sentinel = f"TQSPLICE{uuid.uuid4().hex}"
        marked = list(messages)
        marked[reply_index] = {"role": "assistant", "content": sentinel}
        text = self.render(marked, tools, generation_prompt=True, kwargs=kwargs)
        if text.count(sentinel) != 1:
            raise SpliceError("the chat template does not render assistant content verbatim")
        return self.after_chain(self.encode(text.split(sentinel, 1)[1]), chain_last, stop_ids)

    def after_chain(self, tail: list[int], chain_last: int | None,
                    stop_ids: Sequence[int]) -> list[int]:
        """``tail`` without the closing stop token the chain already ends with (and the
        whitespace a template puts before it)."""
        if chain_last is None or chain_last not in stop_ids or chain_last not in tail:
            return tail
        j = tail.index(chain_last)
        if j == 0 or not self.tokenizer.decode(tail[:j], skip_special_tokens=False).strip():
            return tail[j + 1:]
        return tail


__all__ = ["PromptBuilder", "SpliceError"]

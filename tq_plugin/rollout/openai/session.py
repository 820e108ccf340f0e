"""Per-rollout state of the agent endpoint: staged calls, where a new call attaches, retries.

A rollout is a tree of staged calls (NeMo Gym's lineage: a ``text`` root, ``token_in``
children whose prefix is their parent's staging chain). Each staged call remembers the
conversation *state* it leaves behind: for a chat call the request's messages plus the reply
as it was sent (canonicalized, :func:`~tq_plugin.rollout.openai.protocol.canonical_message`),
for a text completion the prompt plus the completion text; a token-id prompt extends any
call whose full token sequence it starts with.
A new request attaches to the staged call with the longest state its own messages / prompt
extend:

* ``root``: the rollout's first call (a ``text`` root);
* ``extend``: a child of the rollout's head (the call staged last): the ordinary next turn;
* ``fork``: a child of an earlier call: the agent edited its history back to that point;
* ``new_root``: the request extends no staged state (history rewritten or compacted,
  different tools): another ``text`` root in the same rollout.

``fork`` and ``new_root`` are branches; the response says so (``tq_staging.continuation``,
header ``X-TQ-Branch``). The receipt names the head as terminal by default, so the reassembler
trains on the head's ancestry; the other branches stay in the manifest and are verified.

Requests are identified by :func:`~tq_plugin.rollout.openai.protocol.fingerprint` (or an
``Idempotency-Key``): a retry of a request already answered gets the same answer, and one
still in flight is joined, so a call is never staged twice. Everything here runs on the
server's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tq_plugin.staging import RolloutReceipt, make_rollout_receipt


@dataclass
class StagedCall:
    """A staged call: its record, key, the full token sequence after it and its state."""

    record: Any
    staging_key: str
    full_ids: list[int]
    kind: str  # "chat" | "text" | "ids"
    context: str  # chat: tools + template kwargs; "" otherwise
    state: Any  # chat: tuple of canonical messages; text: str; ids: tuple[int, ...]
    chain: list[str]  # root-first staging keys, this call's own last

    @property
    def model_call_id(self) -> str:
        return self.record.model_call_id


@dataclass
class Answer:
    """What a request is answered with: status, JSON body, extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Entry:
    """One request identity in a rollout: the first arrival runs it, retries join it."""

    fingerprint: str  # the key it is kept under: the body's fingerprint or the idempotency key
    done: asyncio.Future
    body_fp: str = ""
    waiters: int = 0
    staging: bool = False  # past the last point where it can be dropped


def prefix_hashes(canon: Sequence[str]) -> list[str]:
    """``h[i]`` identifies ``canon[:i]`` (``h[0]`` the empty prefix)."""
    out, running = [""], hashlib.sha256()
    for item in canon:
        running.update(item.encode("utf-8", "surrogatepass"))
        running.update(b"\x00")
        out.append(running.copy().hexdigest())
    return out


class Rollout:
    """One rollout's staged calls, in-flight requests and status (module docstring)."""

    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = rollout_id
        self.calls: list[StagedCall] = []
        self.head: StagedCall | None = None
        self.entries: dict[str, Entry] = {}
        self.poisoned: str | None = None
        self.closing = False  # no new requests
        self.closed = False  # in-flight requests that have not begun staging are dropped
        self.branches = 0
        self._next_call = 0
        self._chat: dict[tuple[str, str], StagedCall] = {}

    def next_call_id(self) -> str:
        call = f"call{self._next_call}"
        self._next_call += 1
        return call

    # -- where a request attaches -------------------------------------------------------
    def chat_parent(self, context: str, canon: Sequence[str]) -> tuple[StagedCall | None, int]:
        """The staged chat call whose state is the longest prefix of ``canon`` (the latest
        staged among equals), and the length of that state."""
        hashes = prefix_hashes(canon)
        for n in range(len(canon), 0, -1):
            call = self._chat.get((context, hashes[n]))
            if call is not None:
                return call, n
        return None, 0

    def text_parent(self, prompt: str) -> StagedCall | None:
        best = None
        for call in self.calls:
            if call.kind == "text" and prompt.startswith(call.state) and \
                    (best is None or len(call.state) >= len(best.state)):
                best = call
        return best

    def ids_parent(self, prompt: Sequence[int]) -> StagedCall | None:
        """A token-id prompt extends any staged call whose full token sequence it starts with
        (whatever route staged it: this is token-in, token-out)."""
        best = None
        for call in self.calls:
            n = len(call.full_ids)
            if n <= len(prompt) and list(prompt[:n]) == call.full_ids and \
                    (best is None or n >= len(best.full_ids)):
                best = call
        return best

    def continuation(self, parent: StagedCall | None) -> str:
        if parent is None:
            return "root" if not self.calls else "new_root"
        return "extend" if parent is self.head else "fork"

    def add(self, call: StagedCall, continuation: str) -> None:
        self.calls.append(call)
        self.head = call
        if continuation in ("fork", "new_root"):
            self.branches += 1
        if call.kind == "chat":
            self._chat[(call.context, prefix_hashes(call.state)[-1])] = call

    # -- the receipt ---------------------------------------------------------------------
    def receipt(self, *, reward: float | None, terminal_call_id: str | None) -> RolloutReceipt:
        """The declared-terminal receipt over every staged call, in staging order; poisoned
        when a call failed to stage, failed (``no_staged_calls``) when nothing was staged."""
        if not self.calls:
            return RolloutReceipt(rollout_id=self.rollout_id, reward=reward, manifest=[],
                                  capture_poisoned=True,
                                  failure_reason=self.poisoned or "no_staged_calls")
        ids = {c.model_call_id for c in self.calls}
        if terminal_call_id is not None and terminal_call_id not in ids:
            raise KeyError(f"rollout {self.rollout_id!r} staged no call {terminal_call_id!r} "
                           f"(staged: {sorted(ids)})")
        receipt = make_rollout_receipt(
            [c.record for c in self.calls], reward=reward,
            terminal_model_call_id=terminal_call_id or self.head.model_call_id,
            staging_keys=[c.staging_key for c in self.calls])
        if self.poisoned:
            # A call that did not stage poisons its rollout: the reassembler writes a
            # sample_mask = 0 placeholder row instead of training on a chain with a hole.
            receipt = receipt.model_copy(update={"capture_poisoned": True})
        return receipt


__all__ = ["Answer", "Entry", "Rollout", "StagedCall", "prefix_hashes"]

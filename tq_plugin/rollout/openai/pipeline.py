"""The call pipeline of :class:`~tq_plugin.rollout.openai.server.AgentEndpoint`: where a call
attaches in its rollout, the exact prompt, the engine call, the stage, the answer.

One task runs each distinct request (:meth:`CallPipeline.run_call`); every client waiting on it
(the first attempt and any retry that joined) gets its
:class:`~tq_plugin.rollout.openai.session.Answer`:

1. plan: the staged call the request extends (if any), its staging chain read back from the
   store (a chain that reads back different from what was staged poisons the rollout), and the
   templated tail (:mod:`tq_plugin.rollout.openai.template`); the context length is checked;
2. the engine call, batched with other requests (:mod:`tq_plugin.rollout.openai.batcher`); an
   engine failure is a retryable 503 and stages nothing;
3. if every client left meanwhile (or the rollout was closed), the call is dropped here: the
   last point where nothing has been written;
4. the record (``token_in`` under the parent's chain, or a ``text`` root), staged through the
   sink on a worker thread; a failed stage poisons the rollout and answers 500 (not retried);
5. the call joins the rollout's tree and the response body is built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from tq_plugin.rollout.engine import SamplingParams
from tq_plugin.rollout.openai.calls import (
    CallSpec,
    chat_body,
    completion_body,
    finish,
    staging_block,
)
from tq_plugin.rollout.openai.protocol import (
    OpenAIError,
    TokenizeRequest,
    bad_request,
    canonical_json,
    canonical_message,
    parse,
    template_messages,
)
from tq_plugin.rollout.openai.session import Answer, Entry, Rollout, StagedCall
from tq_plugin.rollout.openai.template import SpliceError
from tq_plugin.staging import CaptureAdmission, make_staged_call_record

log = logging.getLogger(__name__)
_SEED_RANGE = 2**31 - 1


@dataclass
class CallTiming:
    """Where one staged call's time went (seconds). ``engine_s``: the engine call it was
    batched into (``batch_size`` requests); ``template_s``: templating and tokenizing (any
    server does it); the staging overhead proper: ``prefix_s`` (the chain read back from the
    store) and ``stage_s`` (the record with its digests, and ``sink.stage``); ``total_s``: the
    request from its first arrival to its answer (queueing for the engine included)."""

    engine_s: float
    template_s: float
    prefix_s: float
    stage_s: float
    staging_wall_s: float
    total_s: float
    batch_size: int

    @property
    def staging_s(self) -> float:
        """The staging work (read-back + record + stage), without waiting for a thread."""
        return self.prefix_s + self.stage_s


@dataclass
class _Plan:
    parent: StagedCall | None
    prefix: list[int]
    carry: list[int]
    continuation: str
    template_s: float = 0.0
    prefix_s: float = 0.0
    prefix_wall_s: float = 0.0

    @property
    def prompt(self) -> list[int]:
        return self.prefix + self.carry


class _StoreMismatch(Exception):
    """The staging chain read back from the store is not what was staged."""


class CallPipeline:
    """The pipeline's methods, mixed into ``AgentEndpoint`` (whose attributes they use:
    ``builder``, ``tokenizer``, ``sink``, ``engine``, ``_batcher``, ``_prefixes``, ``_rng``,
    ``stop_token_ids``, ``max_model_len``, ``model_name``, ``tool_parser``, ``counts``,
    ``timings``, ``rollout_for``)."""

    async def plan(self, rollout: Rollout | None, spec: CallSpec) -> _Plan:
        """Where the call attaches and the exact prompt the engine gets (session docstring)."""
        b, parent, carry = self.builder, None, []
        t0 = time.perf_counter()
        if spec.kind == "chat":
            if rollout is not None:
                parent, n = rollout.chat_parent(spec.context, spec.canon)
                if parent is not None:
                    try:
                        carry = b.chat_tail(spec.messages, n - 1, spec.tools, spec.template_kwargs,
                                            chain_last=parent.full_ids[-1],
                                            stop_ids=self.stop_token_ids)
                    except SpliceError as exc:
                        log.warning("rollout %s: %s; the call starts a new root",
                                    rollout.rollout_id, exc)
                        parent = None
            if parent is None:
                carry = b.chat_root(spec.messages, spec.tools, spec.template_kwargs)
        elif spec.kind == "text":
            parent = rollout.text_parent(spec.prompt_text) if rollout else None
            carry = b.encode(spec.prompt_text[len(parent.state):]) if parent else \
                list(self.tokenizer(spec.prompt_text)["input_ids"])
        else:
            parent = rollout.ids_parent(spec.prompt_ids) if rollout else None
            carry = spec.prompt_ids[len(parent.full_ids):] if parent else list(spec.prompt_ids)
        prefix: list[int] = []
        prefix_s = 0.0
        t1 = time.perf_counter()
        if parent is not None:
            prefix = parent.full_ids
            if self._prefixes is not None:
                prefix, prefix_s = await self._on_io(self._prefixes.fetch, parent.chain)
                if prefix != parent.full_ids:
                    raise _StoreMismatch(f"the staging chain of {parent.model_call_id!r} read back "
                                         "from the store differs from what was staged")
        plan = _Plan(parent, prefix, carry, rollout.continuation(parent) if rollout else "root",
                     template_s=t1 - t0, prefix_s=prefix_s,
                     prefix_wall_s=time.perf_counter() - t1)
        if not plan.prompt:
            raise bad_request("the prompt is empty", param="prompt")
        total = len(plan.prompt) + spec.params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise bad_request(f"prompt ({len(plan.prompt)} tokens) + max_tokens "
                              f"({spec.params.max_new_tokens}) is over the model's context of "
                              f"{self.max_model_len}", param="max_tokens",
                              code="context_length_exceeded")
        return plan

    async def run_call(self, rollout: Rollout, entry: Entry, spec: CallSpec) -> None:
        """Plan, generate, stage, answer: the one task behind every waiter of ``entry``."""
        t0 = time.perf_counter()
        try:
            answer = await self._call(rollout, entry, spec, t0)
        except OpenAIError as exc:
            self.counts["bad_requests" if exc.status < 500 else "server_errors"] += 1
            answer = Answer(exc.status, exc.body(), exc.headers())
        except Exception:
            log.exception("agent endpoint: call of rollout %s failed", rollout.rollout_id)
            self.counts["server_errors"] += 1
            err = OpenAIError(500, "internal error", type="server_error", code="internal_error")
            answer = Answer(500, err.body(), err.headers())
        if answer is None or answer.status != 200 and not entry.staging:
            rollout.entries.pop(entry.fingerprint, None)  # nothing staged: a retry runs afresh
        entry.done.set_result(answer)

    async def _call(self, rollout: Rollout, entry: Entry, spec: CallSpec, t0: float
                    ) -> Answer | None:
        try:
            plan = await self.plan(rollout, spec)
        except _StoreMismatch as exc:
            return self._poison(rollout, entry, f"prefix_mismatch: {exc}")
        if entry.waiters == 0 or rollout.closed:
            self.counts["abandoned"] += 1
            return None
        seed = self._rng.randrange(_SEED_RANGE) if spec.seed is None else spec.seed % _SEED_RANGE
        try:
            gen = await asyncio.wrap_future(self._batcher.submit(plan.prompt, spec.params, seed))
        except Exception as exc:  # noqa: BLE001 - the engine failed: nothing staged, retryable
            self.counts["engine_failures"] += 1
            raise OpenAIError(503, f"engine={getattr(self.engine, 'name', '?')} failed the call: "
                              f"{type(exc).__name__}", type="server_error",
                              code="engine_error") from None
        fin = finish(gen.completion.token_ids, gen.completion.logprobs, spec, self.builder.decode)
        if not fin.ids:
            raise OpenAIError(503, "the engine sampled no token", type="server_error",
                              code="engine_error")
        if entry.waiters == 0 or rollout.closed:
            self.counts["abandoned"] += 1  # every client left before staging: nothing staged
            return None
        entry.staging = True
        t1 = time.perf_counter()
        parent = plan.parent
        admission = CaptureAdmission(
            rollout_id=rollout.rollout_id, model_call_id=rollout.next_call_id(),
            parent_call_id=None if parent is None else parent.model_call_id,
            prev_len=0 if parent is None else parent.record.cum_len,
            mode="text" if parent is None else "token_in",
            staging_chain=[] if parent is None else list(parent.chain),
            parent_chain_hash=None if parent is None else parent.record.chain_hash)

        def stage() -> Any:
            record = make_staged_call_record(
                admission, prompt_ids=plan.prompt, generated_ids=fin.ids,
                generated_logprobs=fin.logprobs, prefix_token_ids=plan.prefix,
                weight_version=gen.weight_version)
            return record, self.sink.stage(record)

        try:
            (record, result), stage_s = await self._on_io(stage)
            ok, key, error = bool(result.ok), result.staging_key, result.error
        except Exception as exc:  # noqa: BLE001 - a sink that raised: the call did not stage
            ok, key, error = False, None, f"{type(exc).__name__}: {exc}"
        if not ok or not key:
            return self._poison(rollout, entry, f"stage_failed: {error}")
        self.counts["calls_staged"] += 1
        timing = CallTiming(gen.engine_s, plan.template_s, plan.prefix_s, stage_s,
                            plan.prefix_wall_s + time.perf_counter() - t1, 0.0, gen.batch_size)
        return self._answer(rollout, spec, plan, fin, record, key, timing, t0)

    async def _on_io(self, fn: Any, *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` on the store's threads (a sink or source may block on a remote
        store), and the seconds it ran there."""
        def timed() -> tuple[Any, float]:
            start = time.perf_counter()
            out = fn(*args)
            return out, time.perf_counter() - start

        return await asyncio.get_running_loop().run_in_executor(self._io, timed)

    def _answer(self, rollout: Rollout, spec: CallSpec, plan: _Plan, fin: Any, record: Any,
                key: str, timing: CallTiming, t0: float) -> Answer:
        full = plan.prompt + fin.ids
        chain = [*(plan.parent.chain if plan.parent else []), key]
        # Relative to the head as it is now: a call staged meanwhile from the same parent
        # (a concurrent request of the rollout) makes this one a sibling, a fork.
        continuation = rollout.continuation(plan.parent)
        staging = staging_block(record, key, continuation)
        common = {"model": self.model_name, "prompt": plan.prompt, "staging": staging,
                  "token_text": self.builder.token_text}
        if spec.kind == "chat":
            content, calls = fin.text, []
            if spec.tools and self.tool_parser is not None:
                content, calls = self.tool_parser(fin.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            reason = "tool_calls" if calls else fin.finish_reason
            body = chat_body(spec, fin, message=message, finish_reason=reason, **common)
            state = (*spec.canon, *self._canon_reply(message))
            call = StagedCall(record, key, full, "chat", spec.context, state, chain)
        else:
            body = completion_body(spec, fin, **common)
            state = spec.prompt_text + fin.text if spec.kind == "text" else tuple(full)
            call = StagedCall(record, key, full, spec.kind, "", state, chain)
        rollout.add(call, continuation)
        headers = {"x-tq-rollout-id": rollout.rollout_id, "x-tq-call-id": record.model_call_id}
        if staging["branched"]:
            headers["x-tq-branch"] = continuation
        timing.total_s = time.perf_counter() - t0
        self.timings.append(timing)
        return Answer(200, body, headers)

    @staticmethod
    def _canon_reply(message: dict[str, Any]) -> list[str]:
        return [canonical_message(m) for m in template_messages([message])]

    def _poison(self, rollout: Rollout, entry: Entry, reason: str) -> Answer:
        """A call that did not stage: the rollout is poisoned, the client gets a 500 it does
        not retry (a retry of the same request gets the same answer)."""
        log.error("rollout %s poisoned: %s", rollout.rollout_id, reason)
        rollout.poisoned = rollout.poisoned or reason.split(":", 1)[0]
        entry.staging = True  # the answer stands for retries
        self.counts["stage_failures"] += 1
        err = OpenAIError(500, f"the call could not be staged ({reason}); rollout "
                          f"{rollout.rollout_id!r} is poisoned", type="server_error",
                          code="staging_failed", retry=False)
        return Answer(500, err.body(), err.headers())

    async def tokenize(self, body: dict[str, Any], rid: str | None) -> dict[str, Any]:
        req = parse(TokenizeRequest, body)
        rollout = self.rollout_for(rid) if rid is not None else None
        if req.messages is not None:
            if not req.add_generation_prompt:
                raise bad_request("add_generation_prompt=false is not served",
                                  param="add_generation_prompt")
            spec = CallSpec(route="chat", kind="chat", params=_probe(), seed=None, stops=[],
                            messages=template_messages(req.messages), tools=req.tools or None,
                            template_kwargs=req.chat_template_kwargs or None)
            spec.canon = [canonical_message(m) for m in spec.messages]
            spec.context = canonical_json([req.tools or None, dict(req.chat_template_kwargs or {})])
        elif req.prompt is not None:
            spec = CallSpec(route="completion", kind="text", params=_probe(), seed=None, stops=[],
                            prompt_text=req.prompt)
        else:
            raise bad_request("/tokenize needs 'prompt' or 'messages'", param="prompt")
        try:
            plan = await self.plan(rollout, spec)
        except _StoreMismatch as exc:
            raise OpenAIError(500, str(exc), type="server_error", code="staging_failed") from None
        out: dict[str, Any] = {"count": len(plan.prompt), "max_model_len": self.max_model_len,
                               "tokens": plan.prompt, "token_strs": None}
        if rollout is not None:
            parent = plan.parent.model_call_id if plan.parent else None
            out["tq_staging"] = {"rollout_id": rollout.rollout_id,
                                 "continuation": plan.continuation, "parent_call_id": parent,
                                 "prev_len": len(plan.prefix)}
        return out


def _probe() -> SamplingParams:
    return SamplingParams(max_new_tokens=1)


__all__ = ["CallPipeline", "CallTiming"]

"""Shared pieces of the agent-endpoint tests: an engine wrapper that records what the engine
saw, sink wrappers that fail or stall, and a harness around one started endpoint."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.rollout.engine import Completion
from tq_plugin.rollout.openai.server import AgentEndpoint
from tq_plugin.staging import (
    RolloutReassembler,
    StagedCallBaseSnapshot,
    StageResult,
    TQTokenSource,
)
from tq_plugin.staging.factory import build_token_sink

PARTITION = "agent_staging"


class Recorder:
    """A ``RolloutEngine`` around another: keeps each request's prompt and completion by its
    seed (the tests give every call its own), can hold calls at a gate or fail them."""

    name = "recorder"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.by_seed: dict[int, tuple[list[int], Completion]] = {}
        self.requests = 0
        self.gate: threading.Event | None = None
        self.fail: Exception | None = None

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts, params, *, seeds, image_patches=None):
        if self.gate is not None:
            self.gate.wait(30)
        self.requests += len(prompts)
        if self.fail is not None:
            raise self.fail
        out = self.engine.generate(prompts, params, seeds=seeds)
        for prompt, seed, completion in zip(prompts, seeds, out):
            self.by_seed[int(seed)] = (list(prompt), completion)
        return out

    def update_weights(self, weights, *, version):
        self.engine.update_weights(weights, version=version)

    def close(self):
        pass


class Scripted:
    """An engine that answers with scripted token ids (logprob -0.5 each), in order."""

    name = "scripted"

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)
        self.weight_version = 0

    def generate(self, prompts, params, *, seeds, image_patches=None):
        out = []
        for _ in prompts:
            ids = self.replies.pop(0)[: params.max_new_tokens]
            out.append(Completion(list(ids), [-0.5] * len(ids)))
        return out

    def update_weights(self, weights, *, version):
        self.weight_version = version

    def close(self):
        pass


class SinkWrapper:
    """A sink around ``TQTokenSink``: ``fail_on`` (1-based stage numbers) answer ``ok=False``,
    ``delay_s`` stalls each stage, ``gate`` holds stages until set; ``entered`` is set once a
    stage has begun."""

    def __init__(self, sink: Any, *, fail_on: tuple[int, ...] = (), delay_s: float = 0.0,
                 gate: threading.Event | None = None) -> None:
        self.inner, self.fail_on, self.delay_s, self.gate = sink, fail_on, delay_s, gate
        self.stages = 0
        self.lock = threading.Lock()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stage(self, record, *, attachments=None):
        with self.lock:
            self.stages += 1
            n = self.stages
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay_s:
            time.sleep(self.delay_s)
        if n in self.fail_on:
            return StageResult(ok=False, staging_key=None, error="injected: the store is down")
        return self.inner.stage(record)


class Harness:
    """One started endpoint over a fresh local data plane."""

    def __init__(self, engine: Any, tokenizer: Any, *, sink_wrap: Any = None, **kwargs: Any):
        self.dp = LocalDataPlane()
        self.sink = build_token_sink(self.dp, staging_partition=PARTITION)
        if sink_wrap is not None:
            self.sink = sink_wrap(self.sink)
        self.engine = engine
        self.tokenizer = tokenizer
        kwargs.setdefault("max_model_len", 1024)
        kwargs.setdefault("default_max_tokens", 12)
        self.endpoint = AgentEndpoint(engine, self.sink, tokenizer, **kwargs)
        self.base_url = self.endpoint.start()
        self.http = httpx.Client(base_url=self.endpoint.url, timeout=60)
        self.source = TQTokenSource(self.dp, staging_partition=PARTITION,
                                    snapshot_cls=StagedCallBaseSnapshot)

    def stop(self) -> None:
        self.http.close()
        self.endpoint.stop()

    def client(self, rollout_id: str, **kwargs: Any):
        return self.endpoint.client(rollout_id, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs)

    def staged_keys(self) -> list[str]:
        return list(self.dp.list_sample_ids(partition_id=PARTITION))

    def chain_tokens(self, keys: list[str]) -> list[int]:
        return self.source.fetch_prefix_token_ids(keys)

    def finalize(self, receipts: list[Any]) -> tuple[Any, Any]:
        """The reassembler's rows for ``receipts`` (and their tags)."""
        from tq_plugin.data_plane import GENERATION_LOGPROBS, INPUT_IDS, SAMPLE_MASK, TOKEN_MASK

        if "train" not in getattr(self, "_registered", set()):
            self.dp.register_partition("train", fields=[])
            self._registered = {"train"}
        meta = RolloutReassembler(self.dp, staging_partition=PARTITION).finalize_group(
            receipts, partition_id="train")
        td = self.dp.get_data(meta, [INPUT_IDS, TOKEN_MASK, SAMPLE_MASK, GENERATION_LOGPROBS])
        return meta, td


def is_openai_error(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}

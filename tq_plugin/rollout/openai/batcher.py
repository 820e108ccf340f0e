"""One thread owns the engine: concurrent agent calls become batched ``generate`` calls.

Requests queue up while the engine is busy; each round takes what is queued (up to
``max_batch``), groups it by sampling parameters (an engine call has one
:class:`~tq_plugin.rollout.engine.SamplingParams`) and runs each group as one
``engine.generate``, every request with its own seed, so a continuation does not depend on
what it was batched with. ``engine.weight_version`` is read on this thread right before each
``generate``, which makes it the version the call was served with. Work that must not overlap
a ``generate`` (a weight sync) runs on the same thread between rounds (:meth:`call`). Neither
``hf`` nor ``vllm`` is called from two threads at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tq_plugin.rollout.engine import Completion, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Generated:
    """One request's completion, the weight version it was sampled with and the wall time of
    the engine call it was part of."""

    completion: Completion
    weight_version: int
    engine_s: float
    batch_size: int


@dataclass
class _Job:
    prompt: list[int] | None
    params: SamplingParams | None
    seed: int
    future: Future
    fn: Callable[[RolloutEngine], Any] | None = None


_STOP = object()


class EngineBatcher:
    """Serializes and batches calls to ``engine`` on one thread (module docstring)."""

    def __init__(self, engine: RolloutEngine, *, max_batch: int = 64,
                 batch_wait_s: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.batches = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tq-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish what is queued, then end the thread (the engine is not closed)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()

    def submit(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Future:
        """A future of :class:`Generated`; cancelling it before its round drops the request."""
        if self._thread is None:
            raise RuntimeError("the engine batcher is not running")
        future: Future = Future()
        self._queue.put(_Job(list(prompt), params, int(seed), future))
        return future

    def call(self, fn: Callable[[RolloutEngine], Any], *, timeout: float | None = None) -> Any:
        """Run ``fn(engine)`` on the engine thread between rounds and return its result."""
        if self._thread is None:
            return fn(self.engine)
        if threading.current_thread() is self._thread:
            raise RuntimeError("EngineBatcher.call from the engine thread would deadlock")
        future: Future = Future()
        self._queue.put(_Job(None, None, 0, future, fn=fn))
        return future.result(timeout)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            jobs, stop = [first], False
            deadline = time.monotonic() + self.batch_wait_s
            while len(jobs) < self.max_batch:
                try:
                    wait = deadline - time.monotonic()
                    job = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is _STOP:
                    stop = True
                    break
                jobs.append(job)
            self._round(jobs)
            if stop:
                return

    def _round(self, jobs: list[_Job]) -> None:
        """Generate groups in arrival order of their first request; ``call`` jobs run after the
        generates that were queued before them."""
        pending: dict[SamplingParams, list[_Job]] = {}
        for job in jobs:
            if job.fn is not None:
                self._flush(pending)
                pending = {}
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(job.fn(self.engine))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        job.future.set_exception(exc)
                continue
            if job.future.set_running_or_notify_cancel():  # a cancelled request is dropped
                pending.setdefault(job.params, []).append(job)
        self._flush(pending)

    def _flush(self, groups: dict[SamplingParams, list[_Job]]) -> None:
        for params, group in groups.items():
            version = self.engine.weight_version
            start = time.perf_counter()
            try:
                out = self.engine.generate([j.prompt for j in group], params,
                                           seeds=[j.seed for j in group])
                if len(out) != len(group) or any(len(c.token_ids) != len(c.logprobs)
                                                 for c in out):
                    raise RuntimeError(f"engine={self.engine.name} returned a malformed batch")
            except BaseException as exc:  # noqa: BLE001 - every request of the group fails
                log.warning("engine=%s failed a batch of %d: %r", getattr(self.engine, "name", "?"),
                            len(group), exc)
                for job in group:
                    job.future.set_exception(exc)
                continue
            elapsed = time.perf_counter() - start
            self.batches += 1
            for job, completion in zip(group, out):
                job.future.set_result(Generated(completion, version, elapsed, len(group)))


__all__ = ["EngineBatcher", "Generated"]

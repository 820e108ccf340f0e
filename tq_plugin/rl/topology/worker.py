"""Rollout-worker processes of the disaggregated topology (``recipe.topology=disaggregated``).

Each worker is one process on one torch thread, started where the shared store's backend
says (``tq_plugin.data_plane.processes.launcher_for``): a Ray actor of the trainer on the
``ray`` and ``transferqueue`` backends, a ``multiprocessing`` spawn process otherwise. It
attaches to the trainer's shared store (the pickled client re-attaches by name). Everything it
exchanges with the trainer goes through that store:

* **tickets** (partition ``rollout_tickets_w{k}``, task ``generate``): the trainer's orders. A
  ticket names its prompts (a slot of the run's prompt stream, which seeds the rollouts'
  generator), the training step it aims at and the oldest weights it may be generated with
  (``min_version``; see ``tq_plugin.rl.topology.staleness``). The worker claims tickets as they come and
  runs, of those it holds, the lowest target the newest weights allow;
* **weights** (partition ``policy_weights``): one row per version (``v{n}``: the flat parameter
  vector, of a LoRA policy the adapters' alone, and its ``weight_version``). Before each ticket the worker loads the newest version
  into its policy module and from there into its rollout engine (``engine=native`` samples
  that module itself; ``hf`` and ``vllm`` hold their own copy, started from an HF checkpoint
  of the worker's policy written to a temporary directory, and take the new weights in place);
  with ``recipe.inflight_updates=true`` it also looks for a newer publish every
  ``recipe.inflight.chunk_tokens`` decoded tokens and loads it mid-generation
  (``tq_plugin.rollout.engine.InflightUpdates``), every call then staging each token's version;
  the look reads what a :class:`PublishWatch` thread, waiting in a claim of that partition,
  saw last (no store round trip), or, on a store whose claims poll (TransferQueue), lists the
  partition at most every ``POLL_EVERY_S``; while every ticket it holds waits for newer
  weights it blocks on a claim of that partition (its own consumer task: the watch's, when it
  has one), which returns when the trainer publishes;
* **rows**: the worker stages every call through ``TQTokenSink`` (``RolloutWorker`` stamps the
  weights' version on each; ``recipe.worker_staging=local`` keeps the staged calls in the
  worker's own embedded store, ``shared`` in the shared one), hands the finished groups to
  ``RolloutReassembler``, which writes the training rows into the shared ``rollouts``
  partition, then writes ``turn_rewards`` and the per-row ``weight_version`` in one more put,
  tagged with the ticket. That put is the rows' ready signal: the trainer claims rows whose
  ``weight_version`` is written, so it never sees a chunk half done.

Ray is not imported here (only the backend adapters may, ``tests/test_architecture.py``): the
backend's launcher decides where the worker runs, and everything Ray-specific happens there and
inside the client the worker attaches with.

A worker stops when its stop signal is set (the trainer stops it; a spawned worker's signal is
also set once its parent process is gone, a Ray actor dies with the driver that created it), or
on an error (its traceback goes to stderr and its exit code tells the trainer it died).
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils import vector_to_parameters

from tq_plugin.config import ConfigError
from tq_plugin.data_plane import (
    KVBatchMeta,
    LocalDataPlane,
    read_columns,
    stamp_global_forward_pad_seqlen,
    write_columns,
)
from tq_plugin.data_plane.processes import StopSignal
from tq_plugin.rl.algorithms.registry import import_user_modules
from tq_plugin.rl.models.weights import engine_weights
from tq_plugin.rl.topology.build import (
    RolloutSide,
    build_model,
    build_rollout_side,
    build_task,
    start_engine,
)
from tq_plugin.rl.topology.exchange import (
    CALLS_TAG,
    FAILED_TAG,
    FIGURE_TAG_PREFIX,
    GENERATE_TASK,
    ROLLOUTS_PARTITION,
    SLOT_TAG,
    TICKET_FIELDS,
    TICKET_TAG,
    TURN_REWARDS,
    VERSION_TAG,
    WEIGHT_VERSION,
    WEIGHTS,
    WEIGHTS_PARTITION,
    SplitClient,
    newest_weights,
    parse_weights_id,
    tickets_partition,
    weights_id,
    weights_task,
)
from tq_plugin.rl.training.pipeline import DrawLoop, RowIO
from tq_plugin.rollout import RolloutWorker
from tq_plugin.rollout.engine import InflightUpdates, synced_parameters


@dataclass
class WorkerSpec:
    """What a worker process is built from (pickled to it)."""

    index: int
    client: Any  # a shared-store client; pickles to an attach-by-name
    cfg: Any  # the run's DictConfig (task, model, tq.staging, recipe)


def _build(spec: WorkerSpec, workdir: str) -> tuple[Any, Any, Any, RolloutSide]:
    """The worker's task, policy, engine and rollout side: the colocated run's builder, on the
    worker's client (its staging kept local under ``recipe.worker_staging=local``)."""
    cfg = spec.cfg
    import_user_modules(cfg.recipe.imports)  # the run's own losses and estimators, by name
    task = build_task(cfg)
    policy = build_model(cfg, task)
    client = spec.client
    if cfg.recipe.worker_staging == "local":
        client = SplitClient(client, LocalDataPlane(), {ROLLOUTS_PARTITION})
    side = build_rollout_side(cfg, task, client)
    # Version -1 until the first publish loads: no ticket runs on the initial random weights.
    engine = start_engine(cfg, policy, workdir, weight_version=-1, task=task)
    return task, policy, engine, side


# In-flight weight updates: the shortest time between two listings of the weights partition.
POLL_EVERY_S = 0.02


class PublishWatch:
    """The newest weights publish a worker has seen, kept current by a thread of its own.

    The thread waits in a blocking claim of the worker's consumer task on the weights partition
    (``weights_task``), which wakes once per publish; so an in-flight look for new weights
    (``_Weights.poll``) reads a field instead of making a store round trip between decode
    chunks, and a worker whose tickets wait for a version sleeps on :meth:`wait_for`. It is the
    task's only consumer while it runs. Used where the store's blocking claim sleeps in the
    store (``claims_wait_in_store``: the embedded and Ray stores; TransferQueue's claim polls
    from the client, so there the worker lists the partition instead). While it runs it holds
    one of the store's call threads (the Ray store actor's ``max_concurrency``), as a waiting
    worker's claim does.

    A claim that fails other than by its timeout, while the worker is not stopping, is raised
    from the next :attr:`newest` or :meth:`wait_for` (the worker dies with it, and the trainer
    reassigns its tickets).
    """

    def __init__(self, client: Any, worker: int, stop: StopSignal, *, wait_s: float = 0.5) -> None:
        self._client, self._task, self._stop, self._wait_s = client, weights_task(worker), stop, wait_s
        self._cond = threading.Condition()
        self._newest: tuple[int, int] | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tq-weights-watch-{worker}",
                                        daemon=True)
        self._thread.start()

    def _stopping(self) -> bool:
        return self._closed or self._stop.is_set()

    def _run(self) -> None:
        while not self._stopping():
            try:
                meta = self._client.claim_meta(WEIGHTS_PARTITION, self._task, [WEIGHT_VERSION],
                                               batch_size=1, blocking=True,
                                               timeout_s=self._wait_s)
            except TimeoutError:
                continue
            except BaseException as e:  # noqa: BLE001 - handed to the worker's thread
                with self._cond:
                    if not self._stopping():
                        self._error = e
                    self._cond.notify_all()
                return
            if not meta.size:
                continue
            seen = max(parse_weights_id(i) for i in meta.sample_ids)
            with self._cond:
                if self._newest is None or seen > self._newest:
                    self._newest = seen
                    self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None and not self._stop.is_set():
            raise RuntimeError(f"the weights watch's claim of {WEIGHTS_PARTITION!r} failed: "
                               f"{self._error!r}") from self._error

    @property
    def newest(self) -> tuple[int, int] | None:
        """``(publish, version)`` of the newest publish seen (None before the first)."""
        self._raise()
        return self._newest

    def wait_for(self, version: int, timeout_s: float = 0.5) -> None:
        """Return once a publish of ``version`` or newer is seen, or after ``timeout_s`` (the
        bound on how late a reassigned ticket or the stop signal is noticed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (
                self._newest is not None and self._newest[1] >= version), timeout=timeout_s)
        self._raise()

    def close(self) -> None:
        """Stop the thread (it leaves at its claim's next timeout; a daemon, never waited on
        longer than that)."""
        self._closed = True
        self._thread.join(timeout=self._wait_s + 1.0)


class _Weights:
    """The worker's copy of the policy: the publish it loaded and that publish's version, kept
    in its policy module and pushed from there into its engine. ``watch``: the worker's
    :class:`PublishWatch`, where its store has one."""

    def __init__(self, client: Any, policy: torch.nn.Module, engine: Any) -> None:
        self.client, self.policy, self.engine = client, policy, engine
        self.publish, self.version = -1, -1
        self.watch: PublishWatch | None = None
        self._named = lambda: engine_weights(policy, engine.name)
        self._polled = float("-inf")
        # Publishes ``poll`` loaded while a ticket generated (its ``inflight/weights_taken``
        # figure): a publish after one of a step's earlier optimizer steps carries the version
        # the step started from, so the ledger shows only the loads that moved the version.
        self.taken = 0

    def poll(self) -> bool:
        """In-flight weight updates (``recipe.inflight_updates``), between two chunks of
        decoding: load the newest publish if it is not the one held; whether it did. With a
        :class:`PublishWatch` the newest is a field its thread keeps; without one it is a
        listing of the partition, a store round trip, made at most every ``POLL_EVERY_S`` (the
        trainer publishes once per optimizer step, far less often)."""
        held = self.publish
        if self.watch is not None:
            newest = self.watch.newest
            if newest is None or newest[0] <= held:
                return False
        else:
            now = time.monotonic()
            if now - self._polled < POLL_EVERY_S:
                return False
            self._polled = now
            newest = newest_weights(self.client)
        self.load_newest(newest)
        moved = self.publish != held
        self.taken += moved
        return moved

    def load_newest(self, newest: tuple[int, int] | None) -> int:
        """Load ``newest`` (``newest_weights``, just listed) if it is not the publish held, or a
        newer one if it was cleared meanwhile; the version held."""
        while True:
            if newest is None or newest[0] == self.publish:
                return self.version
            try:
                td = self.client.get_samples(
                    partition_id=WEIGHTS_PARTITION,
                    sample_ids=[weights_id(*newest)],
                    select_fields=[WEIGHTS],
                )
            except KeyError:  # replaced by a newer publish between the listing and the read
                newest = newest_weights(self.client)
                continue
            # the trainer's synced_parameters, in its order (a LoRA policy's: the adapters)
            vector_to_parameters(td[WEIGHTS][0], [p for _, p in synced_parameters(self.policy)])
            self.engine.update_weights(self._named(), version=newest[1])
            self.publish, self.version = newest
            return self.version


def row_io(client: Any) -> RowIO:
    """How a worker's draws read (padded to the rows' own longest), rewrite and clear rows of
    the shared store."""
    def read(meta: KVBatchMeta, fields: list[str]) -> Any:
        meta = dataclasses.replace(meta, extra_info=dict(meta.extra_info))
        stamp_global_forward_pad_seqlen(meta)
        return read_columns(client, meta, fields)

    return RowIO(read=read, write=lambda meta, fields: write_columns(client, meta, fields),
                 clear=lambda meta: client.clear_samples(partition_id=meta.partition_id,
                                                         sample_ids=meta.sample_ids))


def figure_tags(figures: dict[str, float]) -> dict[str, float]:
    """A draw's shaping and sampling figures as row tags (``fig:<name>``), which the trainer's
    collector averages (fractions, means) or sums (counts) into the step's figures."""
    return {f"{FIGURE_TAG_PREFIX}{k}": float(v) for k, v in figures.items()}


def next_ticket(held: list[dict[str, int]], newest: int | None) -> dict[str, int] | None:
    """The held ticket to run now: the lowest target among those the newest weights may
    generate (``min_version <= newest``). A ticket still waiting for weights never blocks one
    behind it (a reassigned ticket may be needed before the next version can exist)."""
    runnable = [t for t in held if newest is not None and t["min_version"] <= newest]
    return min(runnable, key=lambda t: (t["target"], t["ticket"])) if runnable else None


def _claim_tickets(client: Any, partition: str, *, blocking: bool) -> list[dict[str, Any]]:
    """Every ticket waiting in ``partition``, claimed one row at a time: a backend may hand out
    full batches only (TransferQueue's fetch returns ``batch_size`` rows or none), and a worker
    holds a few tickets at most. ``blocking``: wait (``TimeoutError`` after 0.2 s) for the first."""
    held: list[dict[str, Any]] = []
    while True:
        meta = client.claim_meta(partition, GENERATE_TASK, list(TICKET_FIELDS), batch_size=1,
                                 blocking=blocking and not held, timeout_s=0.2)
        if not meta.size:
            return held
        order = client.get_data(meta, list(TICKET_FIELDS))
        held.append({f: int(order[f][0]) for f in TICKET_FIELDS} | {"id": meta.sample_ids[0]})


def _wait_for_version(client: Any, worker: int, version: int, stop: StopSignal) -> None:
    """Block until weights of ``version`` or newer are published, at most ~0.5 s (the bound
    on how late a reassigned ticket or the stop signal is noticed).

    Each publish wakes the claim once (one row: TransferQueue's claim returns full batches
    only); a publish labelled older than ``version`` (one after a mid-step optimizer step) is
    read off the claimed id and waited past, without the ticket and listing round trips the
    caller's loop would make."""
    while not stop.is_set():
        try:
            meta = client.claim_meta(WEIGHTS_PARTITION, weights_task(worker), [WEIGHT_VERSION],
                                     batch_size=1, blocking=True, timeout_s=0.5)
        except TimeoutError:
            return
        if not meta.size or max(parse_weights_id(i)[1] for i in meta.sample_ids) >= version:
            return


def worker_main(spec: WorkerSpec, *, stop: StopSignal) -> None:
    """A worker process's loop: claim tickets, pick a runnable one, generate with the newest
    weights, deliver; returns once ``stop`` is set (its launcher calls it so)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tq-rollout-") as workdir:
        task, policy, engine, side = _build(spec, workdir)
        try:
            _serve(spec, stop, task, _Weights(spec.client, policy, engine), side)
        finally:
            if hasattr(side.rollout, "close"):  # a task's own driver (task=agent's endpoint)
                side.rollout.close()
            engine.close()


def _serve(spec: WorkerSpec, stop: StopSignal, task: Any, weights: _Weights,
           side: RolloutSide) -> None:
    client, rc = spec.client, spec.cfg.recipe
    draws = DrawLoop(rc=rc, task=task, side=side, io=row_io(client))
    inflight = bool(getattr(rc, "inflight_updates", False))
    if inflight:
        if not isinstance(side.rollout, RolloutWorker):
            raise ConfigError("recipe.inflight_updates=true: this task drives its own rollouts "
                              f"({type(side.rollout).__name__}), which stage no per-token "
                              "version ledger; run it with recipe.inflight_updates=false")
        weights.engine.inflight = InflightUpdates(
            poll=weights.poll, chunk_tokens=int(rc.inflight.chunk_tokens), kv=str(rc.inflight.kv))
        if getattr(client, "claims_wait_in_store", False):
            weights.watch = PublishWatch(client, spec.index, stop)
    try:
        _run_tickets(spec, stop, task, weights, draws, inflight)
    finally:
        if weights.watch is not None:
            weights.watch.close()


def _run_tickets(spec: WorkerSpec, stop: StopSignal, task: Any, weights: _Weights,
                 draws: DrawLoop, inflight: bool) -> None:
    """Claim tickets, pick a runnable one, generate it, deliver, until ``stop``."""
    client, rc = spec.client, spec.cfg.recipe
    partition = tickets_partition(spec.index)
    held: list[dict[str, int]] = []
    while not stop.is_set():
        try:
            held += _claim_tickets(client, partition, blocking=not held)
        except TimeoutError:
            continue
        except Exception:
            if stop.is_set():  # the trainer closed the store while we waited
                return
            raise
        newest = newest_weights(client)
        ticket = next_ticket(held, None if newest is None else newest[1])
        if ticket is None:  # every held ticket waits for newer weights: wait for a publish
            needed = min(t["min_version"] for t in held)
            if weights.watch is not None:
                weights.watch.wait_for(needed)
            else:
                _wait_for_version(client, spec.index, needed, stop)
            continue
        held.remove(ticket)
        version = weights.load_newest(newest)
        weights.taken = 0
        generator = torch.Generator().manual_seed(rc.seed * 1_000_003 + 7919 * ticket["slot"] + 1)
        # A dataset task draws the slot's rows of the run's prompt stream; the reward
        # functions' trainer_state is the target step.
        task.seek(ticket["slot"] * ticket["prompts"])
        task.set_step(ticket["target"], rc.num_steps)
        batch = draws.run(weights.engine, step=ticket["ticket"], prompts=ticket["prompts"],
                          generator=generator, partition_id=ROLLOUTS_PARTITION)
        task.drain_reward_log()  # the draws read what they need of it; nothing else does here
        rows = batch.meta
        n = rows.size
        tag = {TICKET_TAG: ticket["ticket"], VERSION_TAG: version, CALLS_TAG: batch.staged_calls,
               FAILED_TAG: batch.failed_calls, "target": ticket["target"], "worker": spec.index,
               SLOT_TAG: ticket["slot"], **figure_tags(
                   batch.figures | ({"inflight/weights_taken": weights.taken} if inflight else {}))}
        client.put_samples(
            partition_id=ROLLOUTS_PARTITION,
            sample_ids=rows.sample_ids,
            fields={TURN_REWARDS: batch.turn_scores / task.turns,
                    WEIGHT_VERSION: torch.full((n,), version, dtype=torch.int64)},
            tags=[tag] * n)
        client.clear_samples(partition_id=partition, sample_ids=[ticket["id"]])


__all__ = ["PublishWatch", "WorkerSpec", "next_ticket", "worker_main"]

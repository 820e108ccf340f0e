"""Rollout-worker processes of the disaggregated topology (``recipe.topology=disaggregated``).

Each worker is one process on one torch thread, started where the shared store's backend
says (``tq_plugin.data_plane.processes.launcher_for``): a Ray actor of the trainer on the
``ray`` and ``transferqueue`` backends, a ``multiprocessing`` spawn process otherwise. It
attaches to the trainer's shared store (the pickled client re-attaches by name). Everything it
exchanges with the trainer goes through that store:

* **tickets** (partition ``rollout_tickets_w{k}``, task ``generate``): the trainer's orders. A
  ticket names its prompts (a slot of the run's prompt stream, which seeds the rollouts'
  generator), the training step it aims at and the oldest weights it may be generated with
  (``min_version``; see ``tq_plugin.rl.staleness``). The worker claims tickets as they come and
  runs, of those it holds, the lowest target the newest weights allow;
* **weights** (partition ``policy_weights``): one row per version (``v{n}``: the flat parameter
  vector and its ``weight_version``). Before each ticket the worker loads the newest version
  into its policy module and from there into its rollout engine (``engine=native`` samples
  that module itself; ``hf`` and ``vllm`` hold their own copy, started from an HF checkpoint
  of the worker's policy written to a temporary directory, and take the new weights in place);
  while every ticket it holds waits for newer weights it blocks on a claim of that partition
  (its own consumer task), which returns when the trainer publishes;
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

import inspect
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from torch.nn.utils import vector_to_parameters

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.data_plane.processes import StopSignal
from tq_plugin.rl import sharding

WEIGHTS_PARTITION = "policy_weights"
# The shared partition the workers deliver finished training rows into (the trainer claims
# them there and copies each chunk into its own store).
ROLLOUTS_PARTITION = "rollouts"
WEIGHTS = "weights"
WEIGHT_VERSION = "weight_version"
# Per-turn rewards of a training row (a fraction of the task's turns), written next to the rows.
TURN_REWARDS = "turn_rewards"
TICKET_FIELDS = ("ticket", "target", "min_version", "prompts", "slot")
GENERATE_TASK = "generate"
# Tags on each training row the worker delivers (the trainer reads them from its claim).
TICKET_TAG, VERSION_TAG, CALLS_TAG, FAILED_TAG = "ticket", "weight_version", "calls", "failed_calls"
# The ticket's prompt-stream slot (``tq_plugin.rl.staleness``): it seeds the rollouts' generator,
# so a slot ordered again (a resumed run, a dropped chunk) draws the same prompts.
SLOT_TAG = "slot"


def tickets_partition(worker: int) -> str:
    return f"rollout_tickets_w{worker}"


def weights_id(publish: int, version: int) -> str:
    """The weights row of publish number ``publish`` (they count up from 0), labelled with the
    version its rows are stamped with (see ``WeightPublisher``)."""
    return f"w{publish}v{version}"


def parse_weights_id(sample_id: str) -> tuple[int, int]:
    """``(publish, version)`` of a :func:`weights_id`."""
    publish, version = sample_id[1:].split("v")
    return int(publish), int(version)


def weights_task(worker: int) -> str:
    """Worker ``worker``'s consumer task on the weights partition: a blocking claim there
    returns when a new version lands (no polling)."""
    return f"weights_w{worker}"


def newest_weights(client: Any) -> tuple[int, int] | None:
    """``(publish, version)`` of the newest weights published (None before the first)."""
    published = [parse_weights_id(i) for i in client.list_sample_ids(WEIGHTS_PARTITION)]
    return max(published) if published else None


def weights_snapshot(model: torch.nn.Module, *, keep: bool = True) -> torch.Tensor | None:
    """``model``'s parameters as one float32 row ``[1, P]`` on the CPU: a copy, so the next
    optimizer step does not change what is being published.

    A sharded (FSDP2) model's parameters are gathered into that row a bounded bucket of full
    tensors at a time (``sharding.iter_full_tensors``): a collective, so every rank calls it
    in step; only a rank with ``keep`` builds the row (the others join the gathers and return
    ``None``), and none holds more than its shard, the row and one bucket at once. A whole
    model's tensors pass through the same loop (one copy each into the row)."""
    if not keep and not sharding.is_sharded(model):
        return None  # no gather to join
    named = list(model.named_parameters())
    flat = torch.empty(1, sum(p.numel() for _, p in named), dtype=torch.float32) if keep else None
    offset = 0
    for _, full in sharding.iter_full_tensors(named, device="cpu"):
        if flat is not None:
            flat[0, offset:offset + full.numel()] = full.reshape(-1)
        offset += full.numel()
        del full
    return flat


def put_weights(client: Any, flat: torch.Tensor, publish: int, version: int,
                drop: Sequence[str] = ()) -> None:
    """Put a :func:`weights_snapshot` as publish ``publish`` labelled ``version``; then clear
    the ``drop`` rows (publishes too old to keep)."""
    client.put_samples([weights_id(publish, version)], WEIGHTS_PARTITION,
                       fields={WEIGHTS: flat, WEIGHT_VERSION: torch.tensor([version])})
    if drop:
        client.clear_samples(list(drop), WEIGHTS_PARTITION)


class WeightPublisher:
    """The trainer's side of the weights exchange.

    The trainer publishes after every optimizer step. Versions count RL steps (as NeMo RL's
    ``max_trajectory_age_steps`` counts training steps): the weights after step ``s``'s last
    optimizer step are version ``s + 1``; those after one of its earlier optimizer steps are
    labelled ``s``, the version the step started from. They are newer than that, so a row's
    staleness as the trainer counts it is never less than its true staleness (the bound stays
    safe), while the workers always generate with the newest weights there are. Each publish is
    one row; at least the newest ``keep`` are kept (older ones are cleared ``keep`` at a time).
    ``writer``: where the puts run (a ``BackgroundWriter``: off the trainer's thread).
    """

    def __init__(self, client: Any, *, keep: int = 2, writer: Any = None) -> None:
        if keep < 1:
            raise ValueError(f"WeightPublisher: keep must be >= 1, got {keep}")
        self.client, self.keep = client, keep
        self.writer = writer or InlineWriter()
        self.count = 0  # publishes so far: the next one's number
        self.published: list[str] = []  # the ids kept, oldest first

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.publish_snapshot(weights_snapshot(model), version)

    def publish_snapshot(self, flat: torch.Tensor, version: int) -> None:
        """Publish a :func:`weights_snapshot` taken already (a sharded model's, gathered by
        every rank) as ``version``."""
        publish, self.count = self.count, self.count + 1
        self.published.append(weights_id(publish, version))
        drop: list[str] = []
        if len(self.published) >= 2 * self.keep:  # clear in batches: one clear per keep publishes
            drop, self.published = self.published[:-self.keep], self.published[-self.keep:]
        self.writer.submit(put_weights, self.client, flat, publish, version, drop)


class InlineWriter:
    """``BackgroundWriter``'s interface, writing on the caller's thread (its failures raise
    at once)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)

    def close(self) -> None:
        pass


class BackgroundWriter:
    """Store writes the trainer does not wait for, on one background thread, in submission order:
    weights publishes, ticket puts, clears of rows it has copied or dropped.

    A write that failed raises from the next ``submit`` or from ``close``: it is never lost
    silently. ``close`` waits for every write in flight.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tq-writes")
        self._pending: list[Future] = []

    def _reap(self, *, wait: bool) -> None:
        """Raise the first failure among the writes that are done (all, with ``wait``)."""
        done = [f for f in self._pending if wait or f.done()]
        self._pending = [f for f in self._pending if f not in done]
        for future in done:
            future.result()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> None:
        self._reap(wait=False)
        self._pending.append(self._pool.submit(fn, *args, **kwargs))

    def close(self) -> None:
        """Wait for the writes in flight (raising the first failure) and stop the thread."""
        try:
            self._reap(wait=True)
        finally:
            self._pool.shutdown(wait=True)


# Where each client method takes its partition: (keyword, position).
_PARTITION_ARG = {
    "register_partition": 0, "put_samples": 1, "get_samples": 1, "get_tags": 1,
    "clear_samples": 1, "list_sample_ids": 0, "claim_meta": 0, "check_consumption_status": 0,
}


class SplitClient:
    """A client that keeps a worker's staging partitions in an embedded store of its own and
    sends every other partition (training rows, tickets, weights) to the shared store.

    ``recipe.worker_staging=local``: a worker's staged calls are read back only by that worker
    (its prefix cache and its reassembler), so keeping them in its own memory saves the shared
    store two round trips per call; what the trainer needs, the finished training rows, still
    goes to the shared store in one put per chunk. A worker that dies loses only staged calls
    of rollouts it had not finished (their ticket is reassigned either way).
    """

    def __init__(self, shared: Any, local: Any, shared_partitions: set[str]) -> None:
        self._shared, self._local, self._partitions = shared, local, shared_partitions

    def _route(self, partition_id: str) -> Any:
        return self._shared if partition_id in self._partitions else self._local

    def __getattr__(self, name: str) -> Any:
        shared = getattr(self._shared, name)
        if name == "get_data":
            return lambda meta, *a, **kw: self._route(meta.partition_id).get_data(meta, *a, **kw)
        if name not in _PARTITION_ARG:
            return shared  # attributes (supports_put_mode, ...): both stores agree
        where = _PARTITION_ARG[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            pid = kwargs["partition_id"] if "partition_id" in kwargs else args[where]
            return getattr(self._route(pid), name)(*args, **kwargs)

        # accepts_put_mode reads the signature: the shared store's is the one that counts.
        call.__signature__ = inspect.signature(shared)  # type: ignore[attr-defined]
        return call


@dataclass
class WorkerSpec:
    """What a worker process is built from (pickled to it)."""

    index: int
    client: Any  # a shared-store client; pickles to an attach-by-name
    cfg: Any  # the run's DictConfig (task, model, tq.staging, recipe)


def _build(spec: WorkerSpec, workdir: str) -> tuple[Any, Any, Any, Any, Any]:
    from tq_plugin.config.schema import EngineConfig
    from tq_plugin.rl.task import EOS, IMG, PAD
    from tq_plugin.rl.weights import write_engine_checkpoint
    from tq_plugin.rollout import RolloutWorker, build_engine
    from tq_plugin.staging import RolloutReassembler

    cfg, rc = spec.cfg, spec.cfg.recipe
    media = bool(cfg.tq.staging.capture_media)
    task = instantiate(cfg.task, media=media, seed=rc.seed)
    policy = instantiate(cfg.model, output_token_ids=task.output_token_ids,
                         vocab_size=task.vocab_size, image_token_id=IMG,
                         patch_dim=task.patch_dim if media else None)
    client = spec.client
    if rc.worker_staging == "local":
        client = SplitClient(client, LocalDataPlane(), {ROLLOUTS_PARTITION})
    sink = instantiate(cfg.tq.staging)(client)
    rollout = RolloutWorker(task=task, sink=sink, temperature=rc.temperature,
                            max_new_tokens=rc.max_new_tokens, stop_token_id=EOS,
                            allowed_token_ids=task.output_token_ids)
    reassembler = RolloutReassembler(client, staging_partition=sink.staging_partition,
                                     capture_media=media, pad_token_id=PAD, clear_staged=True)
    options = EngineConfig(**cfg.engine) if cfg.get("engine") is not None else EngineConfig()
    checkpoint = (None if options.name == "native"
                  else write_engine_checkpoint(policy, f"{workdir}/engine_init"))
    # Version -1 until the first publish loads: no ticket runs on the initial random weights.
    engine = build_engine(options, model=policy, checkpoint=checkpoint,
                          max_model_len=int(cfg.model.max_seq_len), weight_version=-1)
    return task, policy, engine, rollout, reassembler


class _Weights:
    """The worker's copy of the policy: the publish it loaded and that publish's version, kept
    in its policy module and pushed from there into its engine."""

    def __init__(self, client: Any, policy: torch.nn.Module, engine: Any) -> None:
        from tq_plugin.rl.weights import engine_weights

        self.client, self.policy, self.engine = client, policy, engine
        self.publish, self.version = -1, -1
        self._named = lambda: engine_weights(policy, engine.name)

    def load_newest(self, newest: tuple[int, int] | None) -> int:
        """Load ``newest`` (``newest_weights``, just listed) if it is not the publish held, or a
        newer one if it was cleared meanwhile; the version held."""
        while True:
            if newest is None or newest[0] == self.publish:
                return self.version
            try:
                td = self.client.get_samples([weights_id(*newest)], WEIGHTS_PARTITION, [WEIGHTS])
            except KeyError:  # replaced by a newer publish between the listing and the read
                newest = newest_weights(self.client)
                continue
            vector_to_parameters(td[WEIGHTS][0], self.policy.parameters())
            self.engine.update_weights(self._named(), version=newest[1])
            self.publish, self.version = newest
            return self.version


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
        task, policy, engine, rollout, reassembler = _build(spec, workdir)
        try:
            _serve(spec, stop, task, _Weights(spec.client, policy, engine), rollout, reassembler)
        finally:
            engine.close()


def _serve(spec: WorkerSpec, stop: StopSignal, task: Any, weights: _Weights, rollout: Any,
           reassembler: Any) -> None:
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
            _wait_for_version(client, spec.index, min(t["min_version"] for t in held), stop)
            continue
        held.remove(ticket)
        version = weights.load_newest(newest)
        generator = torch.Generator().manual_seed(rc.seed * 1_000_003 + 7919 * ticket["slot"] + 1)
        batch = rollout.run(weights.engine, step=ticket["ticket"], prompts=ticket["prompts"],
                            group_size=rc.group_size, generator=generator)
        rows = reassembler.finalize_group(batch.receipts, partition_id=ROLLOUTS_PARTITION)
        n = rows.size
        tag = {TICKET_TAG: ticket["ticket"], VERSION_TAG: version, CALLS_TAG: batch.staged_calls,
               FAILED_TAG: batch.failed_calls, "target": ticket["target"], "worker": spec.index,
               SLOT_TAG: ticket["slot"]}
        client.put_samples(
            rows.sample_ids, ROLLOUTS_PARTITION,
            fields={TURN_REWARDS: batch.turn_scores / task.turns,
                    WEIGHT_VERSION: torch.full((n,), version, dtype=torch.int64)},
            tags=[tag] * n)
        client.clear_samples([ticket["id"]], partition)


__all__ = ["ROLLOUTS_PARTITION", "TURN_REWARDS", "BackgroundWriter", "InlineWriter", "SplitClient",
           "WeightPublisher", "WorkerSpec", "newest_weights",
           "next_ticket", "parse_weights_id", "put_weights", "tickets_partition", "weights_snapshot",
           "weights_task", "worker_main"]

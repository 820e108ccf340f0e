"""The exchange between the disaggregated trainer and its rollout workers, through the shared
store: partition and row names, the weights rows (one per publish) and their publisher, the
background writer of the trainer's puts, and the client that keeps a worker's staging local.

See ``tq_plugin.rl.topology.worker`` for the protocol as a worker runs it.
"""


from __future__ import annotations

import inspect
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tq_plugin.data_plane.calls import OLD_ORDER, as_keywords, partition_of
from tq_plugin.rl.models import fsdp as sharding
from tq_plugin.rl.training.step_record import TURN_REWARDS
from tq_plugin.rollout.engine import synced_parameters

WEIGHTS_PARTITION = "policy_weights"
# The shared partition the workers deliver finished training rows into (the trainer claims
# them there and copies each chunk into its own store).
ROLLOUTS_PARTITION = "rollouts"
# On a journaled store: one row per prompt-stream slot the trainer took delivery of
# (``slot<n>``), the record a resumed run counts rollouts generated twice by.
DELIVERED_PARTITION = "rollouts_delivered"
WEIGHTS = "weights"
WEIGHT_VERSION = "weight_version"
TICKET_FIELDS = ("ticket", "target", "min_version", "prompts", "slot")
GENERATE_TASK = "generate"
# Tags on each training row the worker delivers (the trainer reads them from its claim).
TICKET_TAG, VERSION_TAG, CALLS_TAG, FAILED_TAG = "ticket", "weight_version", "calls", "failed_calls"
# The ticket's prompt-stream slot (``tq_plugin.rl.topology.staleness``): it seeds the rollouts' generator,
# so a slot ordered again (a resumed run, a dropped chunk) draws the same prompts.
SLOT_TAG = "slot"
# Tags of a chunk's rows that carry its draws' figures (``fig:<name>``: truncated fraction,
# overlong penalty, dynamic sampling's draws and drops), booked into the step's figures.
FIGURE_TAG_PREFIX = "fig:"


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
    optimizer step does not change what is being published. Those a weight sync carries
    (``synced_parameters``): of a LoRA policy its adapters alone, the workers holding the same
    frozen base.

    A sharded (FSDP2) model's parameters are gathered into that row a bounded bucket of full
    tensors at a time (``sharding.iter_full_tensors``): a collective, so every rank calls it
    in step; only a rank with ``keep`` builds the row (the others join the gathers and return
    ``None``), and none holds more than its shard, the row and one bucket at once. A whole
    model's tensors pass through the same loop (one copy each into the row)."""
    if not keep and not sharding.is_sharded(model):
        return None  # no gather to join
    named = synced_parameters(model)
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
    client.put_samples(
        partition_id=WEIGHTS_PARTITION,
        sample_ids=[weights_id(publish, version)],
        fields={WEIGHTS: flat, WEIGHT_VERSION: torch.tensor([version])},
    )
    if drop:
        client.clear_samples(partition_id=WEIGHTS_PARTITION, sample_ids=list(drop))


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


# The client methods routed by the partition they name (``calls.partition_of`` reads it).
_ROUTED = frozenset({
    "register_partition", "put_samples", "get_samples", "get_tags", "clear_samples",
    "list_sample_ids", "claim_meta", "check_consumption_status",
})


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
        if name not in _ROUTED:
            return shared  # attributes (supports_put_mode, ...): both stores agree

        def call(*args: Any, **kwargs: Any) -> Any:
            if args and name in OLD_ORDER:  # the deprecated order: warn here, at our caller
                args, kwargs = (), as_keywords(name, args, kwargs, stacklevel=2)
            pid = partition_of(name, args, kwargs)
            return getattr(self._route(pid), name)(*args, **kwargs)

        # accepts_put_mode reads the signature: the shared store's is the one that counts.
        call.__signature__ = inspect.signature(shared)  # type: ignore[attr-defined]
        return call


__all__ = ["CALLS_TAG", "DELIVERED_PARTITION", "FAILED_TAG", "FIGURE_TAG_PREFIX", "GENERATE_TASK", "ROLLOUTS_PARTITION", "SLOT_TAG",
           "TICKET_FIELDS", "TICKET_TAG", "TURN_REWARDS", "VERSION_TAG", "WEIGHTS",
           "WEIGHTS_PARTITION", "WEIGHT_VERSION", "BackgroundWriter", "InlineWriter",
           "SplitClient", "WeightPublisher", "newest_weights", "parse_weights_id", "put_weights",
           "tickets_partition", "weights_id", "weights_snapshot", "weights_task"]

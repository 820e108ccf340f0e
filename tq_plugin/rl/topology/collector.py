"""``ChunkCollector``: the disaggregated trainer's side of the exchange with its rollout workers,
free of Lightning (``tq_plugin.rl.topology.disaggregated`` drives it; the property tests drive it against
simulated workers of random speeds).

It orders chunks of whole prompt groups from the workers (tickets, ``tq_plugin.rl.topology.staleness``),
claims the rows they deliver into the shared ``rollouts`` partition (task ``async_ready``),
books deliveries, watches the workers (a dead one is reported and its undelivered tickets go to
the others), and assembles each step's rows under the staleness bound, copying each admitted
chunk into the trainer's own store.

Step ``s`` trains exactly the prompt-stream slots the ledger assigns it (``TicketLedger.slots``):
a chunk that arrives early waits in the buffer for its step, a chunk of a slot already held or
trained (a dead worker's rows landing after its ticket was reassigned) is cleared and counted
(``rows_duplicate``), a dropped chunk's slot is ordered again. So every prompt group of steps
``0..N-1`` trains once, whatever the workers' speeds, deaths or a resume (``restart``: the
orders in flight died with the previous run's store; their slots are ordered again and draw the
same prompts).

**On a journaled shared store** (``tq.backend.journal_dir``, ``docs/durability.md``) a resume
replays no rollout. With ``keep_taken`` (the journal and ``recipe.checkpoint_every``) a chunk
copied into the trainer's store stays in the shared one until a checkpoint holds its step
(``release``), and every delivered slot is booked in ``DELIVERED_PARTITION``. A resumed
trainer's store is the journal's recovery, and ``register(recover=True)`` + ``recover`` take
back every chunk delivered for a step the checkpoint has not trained, claimed before the kill
or not, so only the slots whose chunk was never delivered (in flight at the kill) are ordered
again. ``rollouts_generated_twice`` counts the rows delivered again for a slot delivered before
the resume, by that independent record (the goal is 0).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import torch

from tq_plugin.data_plane import KVBatchMeta, first_write
from tq_plugin.rl.topology.exchange import (
    CALLS_TAG,
    DELIVERED_PARTITION,
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
    InlineWriter,
    tickets_partition,
    weights_task,
)
from tq_plugin.rl.topology.staleness import StalenessFilter, Ticket, TicketLedger
from tq_plugin.staging.reassembler import FINALIZED_FIELDS_TAG

log = logging.getLogger(__name__)
READY_TASK = "async_ready"
# A rollout id's prompt index within its chunk and its place in the prompt's group.
_ROW_IN_ID = re.compile(r"-p(\d+)-g(\d+)$")
# Its draw's rollout step (``s<n>``: a dynamic-sampling draw past the first is step + k x
# ``DRAW_STRIDE``), so a chunk of several draws keeps each draw's groups apart.
_STEP_IN_ID = re.compile(r"s(\d+)-p\d+-g\d+$")


def chunk_figures(chunks: list[KVBatchMeta]) -> dict[str, float]:
    """The step's figures from its chunks' ``fig:<name>`` tags (the workers' draws): fractions,
    ratios and means weighted by the chunks' rows, ``max_length`` / ``min_length`` the largest
    and smallest, counts summed."""
    sums: dict[str, float] = {}
    rows = sum(c.size for c in chunks)
    for chunk in chunks:
        for key, value in chunk.tags[0].items():
            if key.startswith(FIGURE_TAG_PREFIX):
                name, value = key[len(FIGURE_TAG_PREFIX):], float(value)
                if name.endswith(("max_length", "min_length")):
                    pick = max if name.endswith("max_length") else min
                    sums[name] = pick(sums.get(name, value), value)
                    continue
                averaged = name.endswith(("fraction", "ratio", "mean", "mean_length"))
                sums[name] = sums.get(name, 0.0) + value * (chunk.size / rows if averaged else 1)
    return sums


def in_row_order(chunk: KVBatchMeta) -> KVBatchMeta:
    """A chunk's rows in the order the worker wrote them: by prompt, then by place in the
    prompt's group (their ids' ``-p<i>-g<j>`` ending), so each group's rows are contiguous
    (``group_relative`` reads groups as consecutive rows)."""
    keys = [(int(_STEP_IN_ID.search(sid).group(1)), *(int(x) for x in _ROW_IN_ID.search(sid).groups()))
            for sid in chunk.sample_ids]
    order = sorted(range(chunk.size), key=keys.__getitem__)
    return chunk if order == list(range(chunk.size)) else chunk.subset(order)


class ChunkCollector:
    """The trainer's side of the exchange, without Lightning: orders chunks, books deliveries,
    watches the workers and assembles each step's rows under the staleness bound.

    ``procs[k]`` is worker ``k``'s process (anything with ``exitcode`` and ``pid``). ``writer``
    runs the writes nothing waits for (ticket puts, clears of copied or dropped rows): inline by
    default; ``Disaggregated.start`` sets a ``BackgroundWriter``, off the trainer's critical
    path. (Claiming and reading chunks on a background thread as well was measured
    slower: the thread's Ray calls contend with the trainer for the GIL.)
    """

    def __init__(self, client: Any, local: Any, *, train_partition: str, prompts_per_step: int,
                 group_size: int, workers: int, max_staleness: int, procs: list[Any],
                 keep_taken: bool = False) -> None:
        self.client = client  # the shared store: tickets, weights, delivered rows
        self.local = local  # the trainer's own store: the rows of the steps it trains
        self.train_partition = train_partition
        self.group_size = group_size
        self.rows_per_step = prompts_per_step * group_size
        self.chunk_prompts = prompts_per_step // workers if prompts_per_step % workers == 0 else prompts_per_step
        self.chunk_rows = self.chunk_prompts * group_size
        self.ledger = TicketLedger(workers=workers, chunks_per_step=prompts_per_step // self.chunk_prompts,
                                   max_staleness=max_staleness)
        self.filter = StalenessFilter(max_staleness)
        self.buffer: list[KVBatchMeta] = []  # claimed chunks not trained yet, one meta each
        self.partial: dict[int, list[KVBatchMeta]] = {}  # ticket -> its rows claimed so far
        self.partial_claims = 0  # claims that handed out part of a chunk (TransferQueue)
        self.open_from = 0  # the first slot not trained yet
        self.received: set[int] = set()  # slots >= open_from held in the buffer or taken
        self.rows_duplicate = 0
        self.procs = procs
        self.workers_lost = 0
        self.waited_s = 0.0
        self._last_ready = time.perf_counter()
        self.writer: Any = InlineWriter()
        # A journaled store: taken chunks' shared rows wait for a checkpoint (``release``).
        self.keep_taken = keep_taken
        self.kept: list[list[str]] = []  # the shared row ids of each chunk taken, not released
        self.delivered_before: set[int] = set()  # slots delivered before this run (a resume)
        self.rollouts_generated_twice = 0
        self.outstanding_before: set[int] = set()  # slots ordered, not delivered, at the kill
        self.orders_reissued = 0  # slots whose order was outstanding at the kill, ordered again
        self.recovered_rows = 0

    def _rows(self, partition: str) -> list[str] | None:
        try:
            return self.client.list_sample_ids(partition)
        except KeyError:  # never registered
            return None

    def register(self, *, recover: bool = False) -> None:
        """The exchange partitions (before any worker starts). Rows an earlier trainer left in
        them (one that died before closing a store of the same name) are dropped first: a claim
        would otherwise hand this run another run's tickets, weights or rollouts. ``recover``
        (a resume on a journaled store): the delivered rollouts and the delivery record are
        kept for :meth:`recover`, and the previous run's tickets are read first (their
        numbers are not used again; their slots are the chunks in flight at the kill)."""
        workers = range(self.ledger.workers)
        if recover:
            self._read_tickets([tickets_partition(k) for k in workers])
        exchange = [WEIGHTS_PARTITION, *(tickets_partition(k) for k in workers)]
        if not recover:
            exchange += [ROLLOUTS_PARTITION, DELIVERED_PARTITION]
        for partition in exchange:
            stale = self._rows(partition)
            if stale:
                log.warning("dropping %d rows an earlier run left in %r of the shared store",
                            len(stale), partition)
                self.client.clear_samples(partition_id=partition, sample_ids=None)
        if self.keep_taken or recover:
            self.client.register_partition(DELIVERED_PARTITION, [SLOT_TAG])
        self.client.register_partition(
            WEIGHTS_PARTITION, [WEIGHTS, WEIGHT_VERSION],
            consumer_tasks=[weights_task(k) for k in range(self.ledger.workers)])
        self.client.register_partition(ROLLOUTS_PARTITION, [], consumer_tasks=[READY_TASK])
        for k in range(self.ledger.workers):
            self.client.register_partition(tickets_partition(k), list(TICKET_FIELDS),
                                           consumer_tasks=[GENERATE_TASK])

    def _read_tickets(self, partitions: list[str]) -> None:
        """The previous run's outstanding tickets (a resume): numbers above them only from now
        on, and their slots noted (``outstanding_before``)."""
        for partition in partitions:
            ids = self._rows(partition)
            if not ids:
                continue
            td = self.client.get_samples(partition_id=partition, sample_ids=ids,
                                         select_fields=[TICKET_TAG, SLOT_TAG])
            self.ledger.next_ticket = max(self.ledger.next_ticket, 1 + int(td[TICKET_TAG].max()))
            self.outstanding_before.update(td[SLOT_TAG].tolist())

    def recover(self) -> None:
        """Take back, after :meth:`restart` on a journaled store recovered by the backend, every
        chunk delivered for a step from ``open_from`` on: claimed by the trainer that died or
        not, each goes to the buffer as if claimed now, and the ledger orders none of their
        slots again (``TicketLedger.hold``). Rows of steps the checkpoint holds or trained are cleared,
        and so are rows of a chunk never signalled ready (no ``slot`` tag: never delivered)."""
        while self.client.claim_meta(ROLLOUTS_PARTITION, READY_TASK, [WEIGHT_VERSION],
                                     batch_size=self.chunk_rows, blocking=False).size:
            pass  # unclaimed deliveries: this run takes every one by its tags below
        ids = self._rows(ROLLOUTS_PARTITION) or []
        tags = self.client.get_tags(partition_id=ROLLOUTS_PARTITION, sample_ids=ids) if ids else []
        delivered = self._rows(DELIVERED_PARTITION)
        self.delivered_before = set() if not delivered else set(self.client.get_samples(
            partition_id=DELIVERED_PARTITION, sample_ids=delivered,
            select_fields=[SLOT_TAG])[SLOT_TAG].tolist())
        by_ticket: dict[int, list[int]] = {}
        drop: list[str] = []
        for i, tag in enumerate(tags):
            if SLOT_TAG in tag:
                by_ticket.setdefault(int(tag[TICKET_TAG]), []).append(i)
            else:
                drop.append(ids[i])
        for ticket, rows in sorted(by_ticket.items()):
            self.ledger.next_ticket = max(self.ledger.next_ticket, ticket + 1)
            slot = int(tags[rows[0]][SLOT_TAG])
            self.delivered_before.add(slot)
            # A version newer than its step: a dead worker's late duplicate, never trainable.
            too_new = int(tags[rows[0]][VERSION_TAG]) > slot // self.ledger.chunks_per_step
            if (slot < self.open_from or slot in self.received or too_new
                    or len(rows) != self.chunk_rows):
                drop.extend(ids[i] for i in rows)
                continue
            chunk = KVBatchMeta(partition_id=ROLLOUTS_PARTITION, task_name=READY_TASK,
                                sample_ids=[ids[i] for i in rows], fields=[WEIGHT_VERSION],
                                tags=[tags[i] for i in rows])
            self.buffer.append(in_row_order(chunk))
            self.received.add(slot)
            self.ledger.hold(slot)
            self.recovered_rows += len(rows)
        if drop:
            self.client.clear_samples(partition_id=ROLLOUTS_PARTITION, sample_ids=drop)
        self.orders_reissued = len({s for s in self.outstanding_before
                                       if s >= self.open_from and s not in self.received})

    def release(self, chunks: int) -> None:
        """Clear from the shared store the rows of the first ``chunks`` chunks taken and kept
        (``keep_taken``): a checkpoint now holds or has trained their steps."""
        done, self.kept = self.kept[:chunks], self.kept[chunks:]
        ids = [sid for chunk in done for sid in chunk]
        if ids:
            self.writer.submit(self.client.clear_samples, partition_id=ROLLOUTS_PARTITION,
                               sample_ids=ids)

    def send(self, tickets: list[Ticket]) -> None:
        """One put per worker with tickets."""
        for worker in sorted({t.worker for t in tickets}):
            mine = [t for t in tickets if t.worker == worker]
            self.writer.submit(
                self.client.put_samples, partition_id=tickets_partition(worker),
                sample_ids=[f"t{t.ticket}" for t in mine],
                fields={"ticket": torch.tensor([t.ticket for t in mine]),
                        "target": torch.tensor([t.target for t in mine]),
                        "min_version": torch.tensor([t.min_version for t in mine]),
                        "prompts": torch.full((len(mine),), self.chunk_prompts),
                        "slot": torch.tensor([t.slot for t in mine])})

    def check_workers(self) -> None:
        """Report each newly dead worker (a ``WorkerHandle`` whose ``exitcode`` is set: it
        raised, was killed, or its actor died) and reassign its undelivered tickets;
        ``RuntimeError`` once none is left."""
        for k, proc in enumerate(self.procs):
            if k in self.ledger.alive and proc.exitcode is not None:
                while self.claim(blocking=False):  # book what it delivered before reassigning
                    pass
                msg = (f"[tq_plugin] rollout worker {k} (pid {proc.pid}) died with exit code "
                       f"{proc.exitcode}; ")
                self.workers_lost += 1
                try:
                    reissued = self.ledger.worker_lost(k)
                except RuntimeError as e:
                    print(msg + "none left", file=sys.stderr, flush=True)
                    raise RuntimeError(f"recipe.topology=disaggregated: {e}") from None
                print(msg + f"continuing on {len(self.ledger.alive)}, {len(reissued)} "
                      "undelivered tickets reassigned", file=sys.stderr, flush=True)
                log.error(msg)
                self.send(reissued)

    def claim(self, *, blocking: bool) -> int:
        """Claim ``chunk_rows`` ready rows, and buffer every chunk they complete; returns the
        rows claimed. A chunk's rows are written ready together (the worker's one ready-signal
        put), which on ``local`` and ``ray`` makes them claimable together, so a claim takes one
        whole chunk. TransferQueue's controller may hand out part of a put that is landing
        (seen once in four CI runs: 3 of a chunk's 8 rows beside 5 of another's): such rows
        wait in ``partial`` under their ticket until the rest of the chunk is claimed (every
        chunk has ``chunk_rows`` rows, so once every delivered row is ready a claim of
        ``chunk_rows`` always completes one). Every chunk is buffered in the worker's row order
        (``in_row_order``), whatever order its rows were claimed in. The time spent blocked
        adds to ``waited_s``."""
        t0 = time.perf_counter()
        try:
            meta = self.client.claim_meta(ROLLOUTS_PARTITION, READY_TASK, [WEIGHT_VERSION],
                                          batch_size=self.chunk_rows, blocking=blocking,
                                          timeout_s=0.5)
        except TimeoutError:
            meta = None
        finally:
            self.waited_s += time.perf_counter() - t0
        if meta is None:
            return 0
        by_ticket: dict[int, list[int]] = {}
        for i, tag in enumerate(meta.tags or []):
            by_ticket.setdefault(int(tag[TICKET_TAG]), []).append(i)
        for ticket, rows in by_ticket.items():
            chunk = meta.subset(rows)
            if len(rows) != self.chunk_rows or ticket in self.partial:
                chunk = self._complete(ticket, chunk)
                if chunk is None:
                    continue
            chunk = in_row_order(chunk)
            self.ledger.delivered(ticket)
            slot = int(chunk.tags[0][SLOT_TAG])
            if slot in self.delivered_before:  # acknowledged before the resume, made again
                self.rollouts_generated_twice += chunk.size
            if self.keep_taken:
                self.writer.submit(self.client.put_samples, partition_id=DELIVERED_PARTITION,
                                   sample_ids=[f"slot{slot}"],
                                   fields={SLOT_TAG: torch.tensor([slot])})
            if slot < self.open_from or slot in self.received:  # its prompts are held already
                self.writer.submit(self.client.clear_samples, partition_id=ROLLOUTS_PARTITION,
                                   sample_ids=chunk.sample_ids)
                self.rows_duplicate += chunk.size
                continue
            self.received.add(slot)
            self.buffer.append(chunk)
        return meta.size

    def _complete(self, ticket: int, rows: KVBatchMeta) -> KVBatchMeta | None:
        """Hold part of ``ticket``'s chunk; the whole chunk, in row order, once its last rows
        are here (``None`` before). More rows than a chunk has is a broken exchange."""
        self.partial_claims += 1
        held = self.partial.setdefault(ticket, [])
        held.append(rows)
        got = sum(part.size for part in held)
        if got < self.chunk_rows:
            return None
        del self.partial[ticket]
        if got > self.chunk_rows:
            raise RuntimeError(f"ticket {ticket}: claimed {got} rows, expected "
                               f"{self.chunk_rows} (whole groups)")
        return held[0].concat(*held[1:])

    def _take(self, chunk: KVBatchMeta) -> KVBatchMeta:
        """Copy a delivered chunk into the trainer's store (one read, one put), then clear it
        from the shared one; the meta of the trainer's copy."""
        tag = chunk.tags[0]
        fields = [*str(tag[FINALIZED_FIELDS_TAG]).split(","), TURN_REWARDS]
        td = self.client.get_samples(
            partition_id=ROLLOUTS_PARTITION, sample_ids=chunk.sample_ids, select_fields=fields
        )
        local = first_write(dict(td.items()), sample_ids=chunk.sample_ids, client=self.local,
                            partition_id=self.train_partition, tags=chunk.tags)
        if self.keep_taken:  # until a checkpoint holds its step (``release``)
            self.kept.append(list(chunk.sample_ids))
        else:
            self.writer.submit(self.client.clear_samples, partition_id=ROLLOUTS_PARTITION,
                               sample_ids=chunk.sample_ids)
        return local

    def restart(self, step: int, next_ticket: int) -> None:
        """A resumed run's first step is ``step``: nothing is held or ordered (the previous
        run's workers and shared store are gone), tickets number on from ``next_ticket``."""
        self.ledger.restart(step, next_ticket)
        self.open_from = self.ledger.slots(step).start
        self.received.clear()
        self.buffer.clear()
        self.partial.clear()

    def prompt_groups(self, chunk: KVBatchMeta) -> list[int]:
        """The prompt-stream indices of a chunk's groups (``slot * chunk_prompts + i``)."""
        base = int(chunk.tags[0][SLOT_TAG]) * self.chunk_prompts
        return sorted({base + int(_ROW_IN_ID.search(sid).group(1)) for sid in chunk.sample_ids})

    def collect(self, step: int) -> tuple[list[KVBatchMeta], dict[str, Any]]:
        """This step's chunks (its slots, in slot order: ``rows_per_step`` rows, whole groups)
        and their figures."""
        self.send(self.ledger.issue(step))
        want = set(self.ledger.slots(step))
        chunks: list[KVBatchMeta] = []
        dropped = calls = failed = 0
        self.waited_s = 0.0
        while True:
            for chunk in [c for c in self.buffer if int(c.tags[0][SLOT_TAG]) in want]:
                self.buffer.remove(chunk)
                tag = chunk.tags[0]
                slot = int(tag[SLOT_TAG])
                calls += int(tag[CALLS_TAG])
                if not self.filter.admits(step, int(tag[VERSION_TAG]), chunk.size):
                    self.writer.submit(self.client.clear_samples, partition_id=ROLLOUTS_PARTITION,
                                       sample_ids=chunk.sample_ids)
                    dropped += chunk.size
                    self.received.discard(slot)
                    if self.keep_taken:  # not a delivery that counts: its slot is ordered again
                        self.writer.submit(self.client.clear_samples,
                                           partition_id=DELIVERED_PARTITION,
                                           sample_ids=[f"slot{slot}"])
                    self.send([self.ledger.replace(slot)])
                    continue
                failed += int(tag[FAILED_TAG])
                chunks.append(self._take(chunk))
                want.discard(slot)
            if not want:
                break
            self.check_workers()
            self.claim(blocking=True)
        chunks.sort(key=lambda c: int(c.tags[0][SLOT_TAG]))
        self.open_from = self.ledger.slots(step).stop
        self.received = {s for s in self.received if s >= self.open_from}
        lags = [step - int(c.tags[0][VERSION_TAG]) for c in chunks for _ in range(c.size)]
        now = time.perf_counter()
        figures = {
            "staleness_max": max(lags), "staleness_mean": round(sum(lags) / len(lags), 4),
            "rows_dropped_stale": dropped, "trainer_wait_s": round(self.waited_s, 4),
            "rollout_calls_per_s": round(calls / max(now - self._last_ready, 1e-9), 2),
            "workers_alive": len(self.ledger.alive), "failed_calls": failed,
            "prompt_groups": [g for c in chunks for g in self.prompt_groups(c)],
            "draw_figures": chunk_figures(chunks),
        }
        self._last_ready = now
        return chunks, figures


__all__ = ["READY_TASK", "ChunkCollector"]

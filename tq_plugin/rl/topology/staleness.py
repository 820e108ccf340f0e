"""The bookkeeping of asynchronous RL, free of processes: who generates what, how stale a row
may be. (How off-policy tokens are weighted is the loss's: ``tq_plugin.rl.algorithms.losses``.) ``tq_plugin.rl.topology.disaggregated`` drives it; the
property tests drive it under random worker speeds.

Versions count RL steps: the trainer's version while it prepares and trains step ``s`` is ``s``
(the policy after ``s`` finished steps); it publishes version ``s + 1`` once step ``s``'s last
microbatch has trained (and, after each earlier optimizer step of step ``s``, weights labelled
``s``: newer than that, so a row's counted staleness never undercounts). A row's staleness is
``trainer_version - row.weight_version``.

* ``TicketLedger``: the trainer's orders to the rollout workers. The run's prompt stream is cut
  into chunks (``slot`` ``c``: prompts ``c * chunk_prompts`` onwards, ``group_size`` rollouts
  each; the worker seeds its generator from the slot, so a slot's prompts are the same whoever
  generates them and however often); step ``s`` trains slots ``s * chunks_per_step`` to
  ``(s + 1) * chunks_per_step - 1``. A ticket orders one slot for its step (``target``); a worker
  starts it only with weights of version ``>= target - max_staleness``, so a ticket trained at
  its target step is within the bound by construction. Tickets are assigned to the least-loaded
  live worker; a dead worker's undelivered tickets are reassigned under new numbers (rows it
  delivered stay). Ticket numbers are unique over a run and its resumes (``restart``): worker
  row ids are built from them.
* ``StalenessFilter``: what the trainer checks anyway. A chunk trains at its target step (the
  collector assembles each step from its own slots), so a ticket's ``min_version`` bounds it by
  construction; a chunk over the bound all the same (a worker that did not honour it) is
  dropped and counted, never trained, and its slot ordered again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ticket:
    ticket: int  # unique per run; the rollout ids of its rows start with ``s{ticket}-``
    target: int  # the training step it is aimed at
    worker: int  # the worker it is assigned to
    min_version: int  # the oldest weights it may be generated with: target - max_staleness
    slot: int  # its chunk of the prompt stream (``TicketLedger``); target = slot // chunks_per_step


@dataclass
class TicketLedger:
    """Tickets issued, delivered and outstanding, per worker.

    ``issue(step)`` tops up the tickets aimed at steps ``<= step + max_staleness``
    (``chunks_per_step`` slots per step); ``replace(slot)`` orders a slot again (its chunk was
    dropped); ``restart(step)`` forgets every order (a resumed run's workers and store are new)
    and issues from ``step``'s slots on, numbering tickets on from the checkpointed
    ``next_ticket``.
    """

    workers: int
    chunks_per_step: int
    max_staleness: int
    next_ticket: int = 0
    next_slot: int = 0
    outstanding: dict[int, Ticket] = field(default_factory=dict)
    alive: set[int] = field(default_factory=set)
    reassigned: set[int] = field(default_factory=set)  # tickets of dead workers, reissued

    def __post_init__(self) -> None:
        if self.workers < 1 or self.chunks_per_step < 1 or self.max_staleness < 0:
            raise ValueError(f"TicketLedger: workers ({self.workers}) and chunks_per_step "
                             f"({self.chunks_per_step}) must be >= 1, max_staleness "
                             f"({self.max_staleness}) >= 0")
        self.alive = set(range(self.workers))

    def _least_loaded(self) -> int:
        if not self.alive:
            raise RuntimeError("no rollout worker is alive")
        load = dict.fromkeys(sorted(self.alive), 0)
        for t in self.outstanding.values():
            load[t.worker] += 1
        return min(load, key=load.__getitem__)

    @property
    def next_target(self) -> int:
        """The first step with a slot not issued yet."""
        return self.next_slot // self.chunks_per_step

    def slots(self, step: int) -> range:
        """The prompt-stream slots step ``step`` trains."""
        return range(step * self.chunks_per_step, (step + 1) * self.chunks_per_step)

    def _new(self, slot: int) -> Ticket:
        target = slot // self.chunks_per_step
        t = Ticket(self.next_ticket, target, self._least_loaded(),
                   max(0, target - self.max_staleness), slot)
        self.next_ticket += 1
        self.outstanding[t.ticket] = t
        return t

    def issue(self, step: int) -> list[Ticket]:
        out = []
        while self.next_target <= step + self.max_staleness:
            out.append(self._new(self.next_slot))
            self.next_slot += 1
        return out

    def replace(self, slot: int) -> Ticket:
        return self._new(slot)

    def restart(self, step: int, next_ticket: int) -> None:
        """Resume at ``step``: no order is outstanding, the next issue starts at ``step``'s
        slots, and no ticket number repeats one used before ``next_ticket``."""
        self.outstanding.clear()
        self.reassigned.clear()
        self.next_slot = step * self.chunks_per_step
        self.next_ticket = max(self.next_ticket, next_ticket)

    def delivered(self, ticket: int) -> Ticket | None:
        """Book a ticket's rows as arrived. ``None`` for one reassigned after its worker died
        (its rows landed after all: they are kept, the replacement's rows too); ``KeyError`` for
        one never issued or already booked."""
        if ticket in self.reassigned:
            self.reassigned.discard(ticket)
            return None
        return self.outstanding.pop(ticket)

    def worker_lost(self, worker: int) -> list[Ticket]:
        """Take ``worker`` out; its undelivered tickets, reissued to the others (new numbers,
        same slots). ``RuntimeError`` when no worker is left."""
        self.alive.discard(worker)
        lost = [t for t in self.outstanding.values() if t.worker == worker]
        for t in lost:
            del self.outstanding[t.ticket]
            self.reassigned.add(t.ticket)
        if not self.alive:
            raise RuntimeError(
                f"every rollout worker has died ({self.workers} started); the run cannot continue")
        return [self._new(t.slot) for t in lost]


@dataclass
class StalenessFilter:
    """Keeps chunks whose ``weight_version`` lags the trainer's by at most ``max_staleness``.

    ``rows_dropped`` counts every row dropped over the run; ``kept`` the staleness of each row
    let through (the step's ``staleness_max`` / ``staleness_mean``).
    """

    max_staleness: int
    rows_dropped: int = 0

    def staleness(self, trainer_version: int, weight_version: int) -> int:
        lag = trainer_version - weight_version
        if lag < 0:
            raise ValueError(f"a row of weight_version {weight_version} is newer than the "
                             f"trainer's version {trainer_version}")
        return lag

    def admits(self, trainer_version: int, weight_version: int, rows: int) -> bool:
        if self.staleness(trainer_version, weight_version) > self.max_staleness:
            self.rows_dropped += rows
            return False
        return True


__all__ = ["StalenessFilter", "Ticket", "TicketLedger"]

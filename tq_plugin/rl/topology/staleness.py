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
* ``check_token_ledger``: the bound token by token, at run time, over the per-token version
  ledger of rows generated with in-flight weight updates (``recipe.inflight_updates``): the rule
  is in its docstring.
* ``StalenessFilter``: what the trainer checks anyway. A chunk trains at its target step (the
  collector assembles each step from its own slots), so a ticket's ``min_version`` bounds it by
  construction; a chunk over the bound all the same (a worker that did not honour it) is
  dropped and counted, never trained, and its slot ordered again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


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
    ``next_ticket``; ``hold(slot)`` marks a slot whose chunk is already delivered (a resume on a
    journaled store took it back), which ``issue`` then passes over without a ticket.
    """

    workers: int
    chunks_per_step: int
    max_staleness: int
    next_ticket: int = 0
    next_slot: int = 0
    outstanding: dict[int, Ticket] = field(default_factory=dict)
    alive: set[int] = field(default_factory=set)
    reassigned: set[int] = field(default_factory=set)  # tickets of dead workers, reissued
    held: set[int] = field(default_factory=set)  # slots delivered already, never to be issued

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
            if self.next_slot in self.held:
                self.held.discard(self.next_slot)
            else:
                out.append(self._new(self.next_slot))
            self.next_slot += 1
        return out

    def hold(self, slot: int) -> None:
        """``slot``'s chunk is delivered already (taken back on a resume): ``issue`` orders
        it no ticket. Only a slot not issued yet can be held."""
        if slot < self.next_slot:
            raise ValueError(f"TicketLedger.hold: slot {slot} is issued already (next slot "
                             f"{self.next_slot})")
        self.held.add(slot)

    def replace(self, slot: int) -> Ticket:
        return self._new(slot)

    def restart(self, step: int, next_ticket: int) -> None:
        """Resume at ``step``: no order is outstanding, the next issue starts at ``step``'s
        slots, and no ticket number repeats one used before ``next_ticket``."""
        self.outstanding.clear()
        self.reassigned.clear()
        self.held.clear()
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


class LedgerError(ValueError):
    """A per-token version ledger that contradicts itself; the message names the row."""


@dataclass
class LedgerCheck:
    """What :func:`check_token_ledger` decided: the step's new ``token_mask`` and
    ``sample_mask`` and its figures (``metrics.csv`` columns)."""

    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    figures: dict[str, float]


def check_token_ledger(versions: torch.Tensor, token_mask: torch.Tensor,
                       sample_mask: torch.Tensor, *, trainer_version: int, max_staleness: int,
                       sample_ids: Sequence[str]) -> LedgerCheck:
    """The staleness bound per token, at run time, over a step's rows.

    ``versions [B, L]``: each position's weight version (the reassembled ``token_versions``
    column: -1 off the generated tokens and on padding), aligned with ``token_mask [B, L]``
    (1 on the generated tokens the loss reads); ``sample_mask [B]``. A token's staleness is
    ``trainer_version - its version``.

    * **Contradiction fails the step** (``LedgerError``, naming the row's sample id, its
      position and versions): a generated token of a live row without a version (< 0), a
      version newer than the trainer's, or versions decreasing along a sequence (weights are
      only ever replaced by newer ones while it is generated).
    * **The bound masks tokens**: a token staler than ``max_staleness`` leaves the loss (its
      ``token_mask`` becomes 0; the rest of its row still trains), and a row left with no
      token in the loss is masked whole (``sample_mask`` 0, so it weighs nothing in its group's
      advantages either). Both are counted: ``tokens_masked_stale``, ``rows_masked_stale``.

    Figures (over the live rows' generated tokens, before masking): ``token_staleness_max``,
    ``token_staleness_mean``, ``multi_version_fraction`` (the share of live rows whose tokens
    span more than one version), and the two counts.
    """
    live = sample_mask > 0
    gen = (token_mask > 0) & live[:, None]
    unversioned = gen & (versions < 0)
    if unversioned.any():
        _name(unversioned, sample_ids, versions, "a generated token has no version")
    newer = gen & (versions > trainer_version)
    if newer.any():
        _name(newer, sample_ids, versions,
              f"a token's version is newer than the trainer's ({trainer_version})")
    v = torch.where(gen, versions, torch.full_like(versions, -1))
    decreasing = gen & (v < v.cummax(dim=1).values)
    if decreasing.any():
        _name(decreasing, sample_ids, versions, "versions decrease along the sequence")
    lag = (trainer_version - versions).masked_fill(~gen, 0)
    over = gen & (lag > max_staleness)
    new_token_mask = token_mask.masked_fill(over, 0)
    emptied = live & ~(new_token_mask > 0).any(dim=1) & (token_mask > 0).any(dim=1)
    new_sample_mask = sample_mask.masked_fill(emptied, 0)
    tokens = int(gen.sum())
    top = torch.where(gen, versions, torch.full_like(versions, torch.iinfo(versions.dtype).min))
    bottom = torch.where(gen, versions, torch.full_like(versions, torch.iinfo(versions.dtype).max))
    spans = (top.max(dim=1).values > bottom.min(dim=1).values) & gen.any(dim=1)
    rows = int((gen.any(dim=1)).sum())
    figures = {
        "token_staleness_max": int(lag[gen].max()) if tokens else 0,
        "token_staleness_mean": round(float(lag[gen].float().mean()), 4) if tokens else 0.0,
        "multi_version_fraction": round(int(spans.sum()) / rows, 4) if rows else 0.0,
        "tokens_masked_stale": int(over.sum()),
        "rows_masked_stale": int(emptied.sum()),
    }
    return LedgerCheck(new_token_mask, new_sample_mask, figures)


def _name(bad: torch.Tensor, sample_ids: Sequence[str], versions: torch.Tensor, what: str) -> None:
    row, position = (int(x) for x in bad.nonzero()[0])
    seen = versions[row][versions[row] >= 0].tolist()
    raise LedgerError(f"the per-token version ledger contradicts itself: {what}, in row "
                      f"{sample_ids[row]!r} at position {position} (version "
                      f"{int(versions[row, position])}; the row's versions {seen})")


__all__ = ["LedgerCheck", "LedgerError", "StalenessFilter", "Ticket", "TicketLedger",
           "check_token_ledger"]

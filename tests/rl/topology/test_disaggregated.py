"""recipe.topology=disaggregated: the staleness bound, the IS correction, and real runs.

Fast tier: the trainer's real ``ChunkCollector`` against an embedded store, with simulated
rollout workers of random speeds (and deaths) writing rows the way ``tq_plugin.rl.topology.worker``
does; the truncated importance weights; the config refusals.
Slow tier (Ray, the workers are Ray actors): a 2-worker GRPO run on each shared backend (Ray,
TransferQueue), one whose worker is killed mid-run, and one whose trainer is killed (its worker
actors go with it).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch import Callback

from tq_plugin.data_plane import INPUT_IDS, INPUT_LENGTHS, SAMPLE_MASK, LocalDataPlane
from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.algorithms.losses import truncated_is_weights
from tq_plugin.rl.recipe import RLRecipe
from tq_plugin.rl.topology.collector import ChunkCollector
from tq_plugin.rl.topology.disaggregated import PROMPT_GROUPS_FILE
from tq_plugin.rl.topology.exchange import (
    CALLS_TAG,
    FAILED_TAG,
    GENERATE_TASK,
    ROLLOUTS_PARTITION,
    SLOT_TAG,
    TICKET_FIELDS,
    TICKET_TAG,
    VERSION_TAG,
    WEIGHT_VERSION,
    tickets_partition,
)
from tq_plugin.rl.topology.staleness import TicketLedger
from tq_plugin.rl.topology.worker import next_ticket
from tq_plugin.staging.reassembler import FINALIZED_FIELDS_TAG

FAST = ["recipe.prompts_per_step=4", "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false"]


# ---------------------------------------------------------------- simulated workers
@dataclass
class FakeProc:
    pid: int
    exitcode: int | None = None


@dataclass
class SimWorker:
    speed: float
    alive: bool = True
    held: list = field(default_factory=list)  # claimed tickets not started
    job: dict | None = None  # the ticket being generated: finish time, version


class SimClient(LocalDataPlane):
    """An embedded store whose blocking claim, instead of sleeping, runs the simulated workers
    until one delivers (the trainer is waiting: nothing else happens meanwhile)."""

    sim: Sim

    def claim_meta(self, partition_id, task_name, required_fields, batch_size, dp_rank=None,
                   blocking=True, timeout_s=60.0):
        meta = super().claim_meta(partition_id, task_name, required_fields, batch_size,
                                  blocking=False)
        if meta.size or not blocking or partition_id.startswith("rollout_tickets"):
            return meta
        if not self.sim.advance():  # the claim times out: no worker could make progress
            self.sim.stalls += 1
            assert self.sim.stalls < 5, "deadlock: the trainer waits and no worker can start"
            raise TimeoutError("claim_meta timed out")
        self.sim.stalls = 0
        return super().claim_meta(partition_id, task_name, required_fields, batch_size,
                                  blocking=False)


@dataclass
class Sim:
    client: SimClient
    workers: list[SimWorker]
    rng: random.Random
    group_size: int
    now: float = 0.0
    published: int = 0
    stalls: int = 0
    procs: list[FakeProc] = field(default_factory=list)
    orphans: list[dict] = field(default_factory=list)  # puts a dead worker sent, landing late
    # TransferQueue's partial claims: a chunk's rows become ready in two parts, the second
    # after the next chunk's first (so one claim mixes two chunks, out of row order).
    split_puts: bool = False
    held_part: tuple | None = None  # the second part of the last delivery, not landed yet
    delivered: Counter = field(default_factory=Counter)  # slot -> chunks delivered for it

    def __post_init__(self) -> None:
        self.procs = [FakeProc(pid=1000 + k) for k in range(len(self.workers))]

    def _start_idle(self) -> None:
        for k, w in enumerate(self.workers):
            if not w.alive or w.job is not None:
                continue
            meta = self.client.claim_meta(tickets_partition(k), GENERATE_TASK,
                                          list(TICKET_FIELDS), 64, blocking=False)
            if meta.size:
                td = self.client.get_data(meta, list(TICKET_FIELDS))
                w.held += [{f: int(td[f][i]) for f in TICKET_FIELDS} for i in range(meta.size)]
            ticket = next_ticket(w.held, self.published)
            if ticket is not None:
                w.held.remove(ticket)
                w.job = {**ticket, "version": self.published,
                         "finish": self.now + w.speed * self.rng.uniform(0.5, 1.5)}

    def advance(self, until: float | None = None) -> bool:
        """Run until one delivery (``until=None``; False when none can happen) or until time
        ``until``."""
        while True:
            self._start_idle()
            busy = [(w.job["finish"], k) for k, w in enumerate(self.workers) if w.alive and w.job]
            busy += [(job["finish"], -1 - i) for i, job in enumerate(self.orphans)]
            if not busy and self.held_part is not None:
                self._land(*self.held_part)
                self.held_part = None
                if until is None:
                    return True
            if not busy or (until is not None and min(busy)[0] > until):
                self.now = self.now if until is None else until
                return False
            self.now, k = min(busy)
            self._deliver(k)
            if until is None:
                return True

    def _deliver(self, k: int) -> None:
        if k < 0:
            job = self.orphans.pop(-1 - k)
        else:
            job, self.workers[k].job = self.workers[k].job, None
        n = job["prompts"] * self.group_size
        self.delivered[job["slot"]] += 1
        ids = [f"s{job['ticket']}-p{i // self.group_size}-g{i % self.group_size}" for i in range(n)]
        tag = {TICKET_TAG: job["ticket"], VERSION_TAG: job["version"], CALLS_TAG: n, SLOT_TAG: job["slot"],
               FAILED_TAG: 0, FINALIZED_FIELDS_TAG: f"{INPUT_IDS},{INPUT_LENGTHS},{SAMPLE_MASK}"}
        rows = list(range(n))
        if not self.split_puts:
            self._land(ids, rows, tag, job["version"])
            return
        cut = self.rng.randrange(1, n)
        first, second = (rows[cut:], rows[:cut]) if self.rng.random() < 0.5 else (rows[:cut],
                                                                                   rows[cut:])
        self._land(ids, first, tag, job["version"])
        if self.held_part is not None:
            self._land(*self.held_part)
        self.held_part = (ids, second, tag, job["version"])

    def _land(self, ids: list[str], rows: list[int], tag: dict, version: int) -> None:
        n = len(rows)
        self.client.put_samples(partition_id=ROLLOUTS_PARTITION, sample_ids=[ids[i] for i in rows], fields={
            INPUT_IDS: torch.zeros(n, 3, dtype=torch.int64),
            INPUT_LENGTHS: torch.full((n,), 3), SAMPLE_MASK: torch.ones(n),
            "turn_rewards": torch.rand(n, 2),
            WEIGHT_VERSION: torch.full((n,), version, dtype=torch.int64)}, tags=[tag] * n)

    def kill(self, k: int, *, land_late: bool = False) -> None:
        if land_late and self.workers[k].job is not None:
            self.orphans.append({**self.workers[k].job,
                                 "finish": self.now + 5 * self.workers[k].speed})
        self.workers[k].alive = False
        self.workers[k].job = None
        self.workers[k].held = []
        self.procs[k].exitcode = -9


def _simulate(seed: int, workers: int, staleness: int, prompts: int, steps: int,
              kill: int | None, land_late: bool = False, split_puts: bool = False
              ) -> ChunkCollector:
    rng = random.Random(seed)
    client = SimClient()
    sim = Sim(client, [SimWorker(speed=rng.uniform(0.1, 3.0)) for _ in range(workers)], rng,
              group_size=2, split_puts=split_puts)
    client.sim = sim
    local = LocalDataPlane()
    local.register_partition("train", [])  # the DataPlaneCallback does this in the recipe
    collector = ChunkCollector(client, local, train_partition="train", prompts_per_step=prompts,
                               group_size=2, workers=workers, max_staleness=staleness,
                               procs=sim.procs)
    collector.register()
    trained: set[str] = set()
    dropped = 0
    for step in range(steps):
        if kill is not None and step == kill:
            sim.kill(0, land_late=land_late)
        chunks, figures = collector.collect(step)
        ids = [s for c in chunks for s in c.sample_ids]
        assert len(ids) == prompts * 2
        assert not trained & set(ids), "a row trained twice"
        trained |= set(ids)
        for c in chunks:
            lag = step - c.tags[0][VERSION_TAG]
            assert 0 <= lag <= staleness, f"step {step}: a row {lag} steps stale trained"
            groups = {sid.rsplit("-g", 1)[0] for sid in c.sample_ids}
            assert len(c.sample_ids) == 2 * len(groups), "a chunk split a group"
            # In the worker's row order: each group's rows together (group_relative needs it).
            order = [tuple(map(int, re.search(r"-p(\d+)-g(\d+)$", sid).groups()))
                     for sid in c.sample_ids]
            assert order == sorted(order), f"step {step}: a chunk's rows out of order"
        assert figures["staleness_max"] <= staleness
        # the step's own prompt groups of the run's prompt stream, in order, once each
        assert figures["prompt_groups"] == list(range(step * prompts, (step + 1) * prompts))
        dropped += figures["rows_dropped_stale"]
        assert not set(ids) & set(client.list_sample_ids(ROLLOUTS_PARTITION))  # moved, not copied
        local.clear_samples(
            partition_id="train", sample_ids=ids
        )  # as the DataPlaneCallback does after the step
        sim.published = step  # step - 1's last microbatch trains after prepare(step)
        sim.advance(until=sim.now + rng.uniform(0.05, 2.0))  # the step trains
    assert dropped == collector.filter.rows_dropped  # every drop counted, in the step it happened
    return collector


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), workers=st.integers(1, 3), staleness=st.integers(1, 3),
       prompts=st.sampled_from([2, 4, 6]))
def test_staleness_bound_holds_under_random_worker_speeds(seed, workers, staleness, prompts):
    _simulate(seed, workers, staleness, prompts, steps=10, kill=None)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), workers=st.integers(1, 3), prompts=st.sampled_from([2, 4]))
def test_chunks_claimed_in_parts_train_whole_and_in_row_order(seed, workers, prompts):
    """TransferQueue's controller once handed out part of a worker's chunk beside part of
    another's (``ticket 4: claimed 3 rows, expected 8``): rows of a chunk that become
    claimable in two parts, the second after the next chunk's first, still train as whole
    chunks, once each, in the worker's row order, within the staleness bound (``_simulate``)."""
    collector = _simulate(seed, workers, 1, prompts, steps=8, kill=None, split_puts=True)
    assert collector.partial_claims > 0 and not collector.partial


def test_rows_landing_after_their_ticket_was_reassigned_train_once(capsys):
    """A worker killed while its put is in flight: its ticket goes to the other worker under a
    new number (same slot, same prompts), and the orphaned rows land later. Whichever of the
    two arrives first fills the slot; the other is cleared and counted (``rows_duplicate``),
    never trained: every step still trains exactly its own prompt groups (``_simulate``)."""
    collectors = [_simulate(seed, 2, 1, 4, steps=12, kill=2, land_late=True) for seed in range(20)]
    assert sum(c.rows_duplicate for c in collectors) > 0
    assert sum(c.filter.rows_dropped for c in collectors) == 0  # gated tickets are never stale


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), kill=st.integers(0, 6))
def test_a_dead_worker_is_reported_and_the_run_continues_on_the_rest(seed, kill, capsys):
    collector = _simulate(seed, 2, 1, 4, steps=8, kill=kill)
    assert collector.workers_lost == 1 and collector.ledger.alive == {1}
    assert "rollout worker 0 (pid 1000) died with exit code -9; continuing on 1" in capsys.readouterr().err


def test_no_worker_left_stops_with_a_clear_error():
    with pytest.raises(RuntimeError, match="every rollout worker has died"):
        _simulate(0, 1, 1, 4, steps=3, kill=1)


def test_ledger_refuses_unknown_deliveries():
    ledger = TicketLedger(workers=2, chunks_per_step=2, max_staleness=1)
    issued = ledger.issue(0)
    assert [t.target for t in issued] == [0, 0, 1, 1] and {t.worker for t in issued} == {0, 1}
    assert [t.min_version for t in issued] == [0, 0, 0, 0]
    ledger.delivered(issued[0].ticket)
    with pytest.raises(KeyError):
        ledger.delivered(issued[0].ticket)
    assert ledger.issue(0) == []  # topped up already
    assert [t.min_version for t in ledger.issue(1)] == [1, 1]  # aimed at step 2


def test_a_restarted_ledger_orders_the_resumed_steps_slots_under_new_numbers():
    """A resumed run: nothing outstanding survives, the first step's slots are ordered again
    (same slots: same prompts) under ticket numbers above every one used before."""
    ledger = TicketLedger(workers=2, chunks_per_step=2, max_staleness=1)
    ledger.issue(0)
    ledger.issue(1)
    assert ledger.next_ticket == 6
    ledger.restart(3, next_ticket=20)
    assert not ledger.outstanding
    issued = ledger.issue(3)
    assert [(t.ticket, t.slot, t.target, t.min_version) for t in issued] == [
        (20, 6, 3, 2), (21, 7, 3, 2), (22, 8, 4, 3), (23, 9, 4, 3)]
    assert ledger.replace(7).slot == 7 and ledger.next_ticket == 25


def test_a_held_slot_is_passed_over_and_only_an_unissued_one_can_be_held():
    """A resume on a journaled store took back slot 7's chunk: the ledger orders the others."""
    ledger = TicketLedger(workers=2, chunks_per_step=2, max_staleness=1)
    ledger.restart(3, next_ticket=20)
    ledger.hold(7)
    assert [(t.ticket, t.slot) for t in ledger.issue(3)] == [(20, 6), (21, 8), (22, 9)]
    assert not ledger.held and 7 not in {t.slot for t in ledger.outstanding.values()}
    with pytest.raises(ValueError, match="slot 8 is issued already"):
        ledger.hold(8)


# ---------------------------------------------------------------- importance weights
def test_truncated_is_weights_formula():
    prev = torch.tensor([[0.0, -1.0, -0.5, -3.0]])
    gen = torch.tensor([[0.0, -1.0 - torch.log(torch.tensor(1.5)).item(), 0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_is_weights(prev, gen, mask, cap=2.0)
    # equal -> 1; pi_old/pi_gen = 1.5 -> 1.5; e^-1 -> e^-1; off the mask -> 1 (not e^6 capped)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.5, torch.exp(torch.tensor(-1.0)).item(), 1.0]]))
    w = truncated_is_weights(torch.tensor([[0.0]]), torch.tensor([[-5.0]]), torch.tensor([[1]]), 2.0)
    assert float(w) == pytest.approx(2.0)  # truncated at the cap
    with pytest.raises(ValueError, match="cap must be >= 1.0"):
        truncated_is_weights(prev, gen, mask, cap=0.5)


def test_is_weight_on_advantages_scales_the_clipped_policy_gradient_term():
    """Why multiplying advantages is the correction: min(r A w, clip(r) A w) = w min(r A, clip(r) A)."""
    g = torch.Generator().manual_seed(0)
    ratio = torch.rand(64, generator=g) * 2
    adv = torch.randn(64, generator=g)
    w = truncated_is_weights(torch.randn(64, generator=g), torch.randn(64, generator=g),
                             torch.ones(64), cap=2.0)

    def pg(a):
        return -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)

    torch.testing.assert_close(pg(adv * w), w * pg(adv))


# ---------------------------------------------------------------- config
@pytest.fixture
def _clean_hydra():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _compose(*overrides: str):
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        return compose("grpo", overrides=[*FAST, *overrides])


@pytest.mark.usefixtures("_clean_hydra")
@pytest.mark.parametrize(("overrides", "match"), [
    (["recipe.topology=disaggregated"], "needs a store shared across processes: use tq/backend=ray"),
    (["recipe.topology=disaggregated", "tq/backend=ray", "recipe.max_staleness=0"],
     "recipe.max_staleness=0: topology=disaggregated needs >= 1"),
    (["recipe.topology=async"], "recipe.topology: must be one of"),
    (["recipe.is_truncation=0.5"], "recipe.is_truncation: must be >= 1.0"),
    (["recipe.rollout_workers=0"], "recipe.rollout_workers: must be > 0"),
    (["recipe.weights_every=epoch"], "recipe.weights_every: must be one of"),
    (["recipe.checkpoint_every=-1"], "recipe.checkpoint_every: must be >= 0"),
])
def test_disaggregated_config_is_refused_before_anything_starts(tmp_path, overrides, match):
    cfg = _compose(*overrides)
    with pytest.raises(ValueError, match=match):
        RLRecipe(cfg, tmp_path).setup()
    assert not list(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------- real runs (Ray, processes)
RAY = ["tq/backend=ray", "recipe.topology=disaggregated", "recipe.max_staleness=1",
       "tq.backend.ray_init.num_cpus=null"]


class KillWorker(Callback):
    """SIGKILLs rollout worker ``k`` when step ``at`` starts training."""

    def __init__(self, recipe: RLRecipe, k: int, at: int) -> None:
        self.recipe, self.k, self.at = recipe, k, at
        self.killed: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.killed is None and pl_module.dp_meta.extra_info[MICROBATCH_INFO]["step"] == self.at:
            self.killed = self.recipe.source.procs[self.k].pid
            os.kill(self.killed, signal.SIGKILL)


def _run(tmp_path: Path, *overrides: str, kill: tuple[int, int] | None = None,
         backend: tuple[str, ...] = RAY):
    cfg = _compose(*backend, *overrides)
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    killer = None
    if kill is not None:
        killer = KillWorker(recipe, *kill)
        recipe.trainer.callbacks.append(killer)
    try:
        recipe.train()
    finally:
        recipe.source.stop()
    procs = recipe.source.procs
    assert procs and not any(p.is_alive() for p in procs), "a worker outlived the trainer"
    assert all(type(p).__name__ == "RayActorHandle" for p in procs), "workers are Ray actors"
    result = json.loads((tmp_path / "result.json").read_text())
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return recipe, result, rows, killer


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_clean_hydra")
def test_two_worker_grpo_run(tmp_path, ray_session):
    recipe, result, rows, _ = _run(tmp_path, "recipe.rollout_workers=2", "recipe.num_steps=4",
                                   "recipe.ppo_epochs=2")
    # Weights went out after every optimizer step (2 per RL step), the last as version 4.
    from tq_plugin.rl.topology.exchange import parse_weights_id

    assert [parse_weights_id(i) for i in recipe.source.publisher.published][-2:] == \
        [(7, 3), (8, 4)]
    assert result["status"] == "ok" and result["steps"] == 4 and len(rows) == 4
    assert result["topology"] == "disaggregated" and result["workers_lost"] == 0
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert 0 <= int(r["staleness_max"]) <= 1
        assert float(r["trainer_wait_s"]) >= 0 and int(r["workers_alive"]) == 2
    assert int(rows[-1]["staleness_max"]) == 1  # rows were generated while the trainer trained
    assert float(rows[-1]["rollout_calls_per_s"]) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("_clean_hydra")
def test_the_reference_kl_and_reward_shaping_run_disaggregated(tmp_path, ray_session):
    """recipe.beta, the truncation mask, the overlong penalty and dynamic sampling together on
    two workers: the reference pass runs in the trainer's step tail, the shaping and the draws
    in each worker's draw loop (its chunk), and their figures reach every step's row. The
    shared store is sharded (two storage units hold the bytes: the weights rows go there), and
    every step trains once within the staleness bound."""
    recipe, result, rows, _ = _run(
        tmp_path, "recipe.rollout_workers=2", "recipe.num_steps=3", "recipe.ppo_epochs=2",
        "recipe.beta=0.04",
        "recipe.mask_truncated_completions=true", "recipe.overlong_buffer=2",
        "recipe.dynamic_sampling=true", "tq.backend.num_storage_units=2")
    import ray

    backend = recipe.cfg.tq.backend
    units = [ray.get_actor(f"{backend.actor_name}_unit{k}", namespace=backend.namespace)
             for k in range(2)]  # started beside the store actor, alive with this driver
    assert len({ray.get(u.pid.remote()) for u in units}) == 2
    assert result["status"] == "ok" and result["steps"] == 3 and result["workers_lost"] == 0
    assert result["rows_duplicate"] == 0 and result["staleness_max"] <= 1
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for r in rows:
        # Two epochs: even step 0 trains its second on a policy off the reference.
        assert float(r["kl_ref"]) > 0, r
        assert 0 <= float(r["completions/clipped_ratio"]) <= 1
        assert float(r["rewards/overlong_penalty/mean"]) <= 0
        assert float(r["sampling/draws"]) >= 1


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_clean_hydra")
def test_a_worker_killed_mid_run(tmp_path, ray_session, capfd):
    _, result, rows, killer = _run(tmp_path, "recipe.rollout_workers=2", "recipe.num_steps=5",
                                   "recipe.worker_staging=shared", kill=(0, 2))
    assert killer.killed is not None
    assert result["status"] == "ok" and len(rows) == 5 and result["workers_lost"] == 1
    assert int(rows[-1]["workers_alive"]) == 1
    err = capfd.readouterr().err
    assert f"rollout worker 0 (pid {killer.killed}) died with exit code -9; continuing on 1" in err
    print(err[-2000:], file=sys.stderr)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_clean_hydra")
def test_two_worker_run_on_transferqueue(tmp_path, tq_session):
    address = tq_session.get_runtime_context().gcs_address
    # A claim here may hand out part of one worker's chunk beside part of the other's: the
    # collector holds such rows until their chunk is whole (test_chunks_claimed_in_parts_...).
    recipe, result, rows, _ = _run(
        tmp_path, "recipe.rollout_workers=2", "recipe.num_steps=3", "recipe.ppo_epochs=2",
        "recipe.weights_every=rl_step",
        backend=("tq/backend=transferqueue", *RAY[1:3], f"tq.backend.address={address}"))
    from tq_plugin.rl.topology.exchange import parse_weights_id

    # weights_every=rl_step: one publish per RL step (versions 0..3), none after the step's
    # first optimizer step.
    assert [parse_weights_id(i) for i in recipe.source.publisher.published] == \
        [(2, 2), (3, 3)]
    assert result["status"] == "ok" and result["steps"] == 3 and result["workers_lost"] == 0
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(int(r["workers_alive"]) == 2 and int(r["staleness_max"]) <= 1 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainer_killed_leaves_no_worker_behind(tmp_path, ray_session):
    """SIGKILL the trainer process mid-run: Ray kills its rollout-worker actors (they are not
    detached), so no process of the run is left behind. The trainer logs each worker's pid."""
    import psutil  # a Ray dependency

    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "tq_plugin.cli", "--config-name", "grpo",
           f"hydra.run.dir={tmp_path}", *FAST, *RAY, "recipe.rollout_workers=2",
           "recipe.num_steps=10000", f"tq.backend.address={address}",
           "++tq.backend.ray_init.log_to_driver=false"]
    err = tmp_path / "trainer.err"
    with open(err, "w") as err_file:
        trainer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file)
    pids: list[int] = []
    log = tmp_path / "tq-train.log"  # the run's log: the trainer logs each worker's pid there
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and trainer.poll() is None:
            text = log.read_text() if log.exists() else ""
            pids = [int(p) for p in re.findall(
                r"rollout worker \d started \(pid (\d+), RayActorHandle\)", text)]
            time.sleep(0.5)
        assert len(pids) == 2, f"the trainer did not start two worker actors:\n{err.read_text()[-3000:]}"
        workers = [psutil.Process(p) for p in pids]
        assert all(w.ppid() != trainer.pid for w in workers)  # Ray's processes, not its children
        time.sleep(5)  # mid-run: workers generating
        assert trainer.poll() is None and all(w.is_running() for w in workers)
        trainer.kill()
        trainer.wait(10)
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"workers outlived the trainer: {[p.pid for p in alive]}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        for pid in pids:  # only the worker processes this test's trainer started
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- weights
def test_weights_are_published_after_every_optimizer_step_in_order():
    """Each publish is one row (the newest ``keep`` kept), labelled with its RL-step version; a
    background publish snapshots the weights at once and a failed one is never lost."""
    from tq_plugin.rl.topology.exchange import (
        WEIGHTS_PARTITION,
        BackgroundWriter,
        InlineWriter,
        WeightPublisher,
        newest_weights,
        weights_id,
    )

    client = LocalDataPlane()
    client.register_partition(WEIGHTS_PARTITION, [])
    model = torch.nn.Linear(3, 2)
    writer = BackgroundWriter()
    publisher = WeightPublisher(client, keep=2, writer=writer)
    # Step 0 has 3 optimizer steps: labelled 0, 0, then 1 after its last.
    for version in (0, 0, 1):
        publisher.publish(model, version)
        with torch.no_grad():
            model.weight.add_(1.0)  # the next optimizer step: must not reach the snapshot
    writer.close()
    assert newest_weights(client) == (2, 1)
    assert client.list_sample_ids(WEIGHTS_PARTITION) == [weights_id(0, 0), weights_id(1, 0),
                                                         weights_id(2, 1)]
    got = client.get_samples(
        partition_id=WEIGHTS_PARTITION, sample_ids=[weights_id(2, 1)], select_fields=["weights"]
    )["weights"][0]
    assert float(got[0]) == pytest.approx(float(model.weight.detach()[0, 0]) - 1.0)  # at publish
    publisher.writer = InlineWriter()
    publisher.publish(model, 1)  # a 4th row: the oldest 2 are cleared
    assert client.list_sample_ids(WEIGHTS_PARTITION) == [weights_id(2, 1), weights_id(3, 1)]

    class Failing(LocalDataPlane):
        def put_samples(self, *args, **kwargs):
            raise ConnectionError("store gone")

    failing = BackgroundWriter()
    WeightPublisher(Failing(), writer=failing).publish(model, 1)
    with pytest.raises(ConnectionError, match="store gone"):
        failing.close()  # or the next submit: never silent


def test_a_waiting_worker_skips_publishes_older_than_the_version_it_needs():
    """Mid-step publishes carry the label of the step they started from: a worker whose tickets
    need the next version reads the label off each claimed id and keeps waiting, and returns
    once the version it needs lands (or after its ~0.5 s bound, to re-check its tickets)."""
    import threading

    from tq_plugin.rl.topology.exchange import WEIGHTS_PARTITION, WeightPublisher, weights_task
    from tq_plugin.rl.topology.worker import _wait_for_version

    client = LocalDataPlane()
    client.register_partition(WEIGHTS_PARTITION, [], consumer_tasks=[weights_task(0)])
    publisher = WeightPublisher(client, keep=8)
    model = torch.nn.Linear(2, 2)
    for version in (0, 0, 0):
        publisher.publish(model, version)
    stop = threading.Event()
    _wait_for_version(client, 0, 1, stop)  # only version-0 publishes: waits past them, times out
    assert client.check_consumption_status(WEIGHTS_PARTITION, [weights_task(0)])
    publisher.publish(model, 0)
    publisher.publish(model, 1)
    _wait_for_version(client, 0, 1, stop)  # returns at the version-1 publish
    assert client.check_consumption_status(WEIGHTS_PARTITION, [weights_task(0)])


def test_the_publish_watch_sees_each_publish_without_a_round_trip_per_look():
    """In-flight looks for new weights read the watch's field (its thread waits in the claim):
    it follows every publish, ``wait_for`` returns at the version asked for (or after its
    bound), and a claim that fails while the worker is not stopping is raised from the next
    look, naming the partition; once the worker stops it is not."""
    import threading

    from tq_plugin.rl.topology.exchange import WEIGHTS_PARTITION, WeightPublisher, weights_task
    from tq_plugin.rl.topology.worker import PublishWatch

    client = LocalDataPlane()
    assert client.claims_wait_in_store
    client.register_partition(WEIGHTS_PARTITION, [], consumer_tasks=[weights_task(0)])
    publisher = WeightPublisher(client, keep=8)
    model = torch.nn.Linear(2, 2)
    stop = threading.Event()
    watch = PublishWatch(client, 0, stop, wait_s=0.1)
    try:
        assert watch.newest is None
        publisher.publish(model, 0)
        watch.wait_for(0, timeout_s=5)
        assert watch.newest == (0, 0)
        t0 = time.monotonic()
        watch.wait_for(1, timeout_s=0.2)  # only version 0 so far: returns at its bound
        assert time.monotonic() - t0 >= 0.15 and watch.newest == (0, 0)
        publisher.publish(model, 0)  # a mid-step publish: a newer publish, the same label
        publisher.publish(model, 1)
        watch.wait_for(1, timeout_s=5)
        assert watch.newest == (2, 1)
        assert client.check_consumption_status(WEIGHTS_PARTITION, [weights_task(0)])
        client.close()  # the store gone while the worker runs: the next look says so
        deadline = time.monotonic() + 5
        while watch._error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="policy_weights"):
            _ = watch.newest
        stop.set()  # a stopping worker is not failed by it
        assert watch.newest == (2, 1)
    finally:
        stop.set()
        watch.close()
    assert not watch._thread.is_alive()


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), workers=st.integers(1, 3), staleness=st.integers(1, 2),
       kill_at=st.integers(2, 8))
def test_a_resume_on_a_journaled_store_makes_no_delivered_rollout_again(seed, workers, staleness,
                                                                          kill_at):
    """A trainer killed on a journaled shared store (keep_taken: chunks it took stay until a
    checkpoint holds their step) and resumed from its last checkpoint: the resumed collector
    takes back every chunk delivered for a step the checkpoint has not trained, so every slot
    trains once across the runs and every delivery the workers made is used, except the stale
    ones the bound dropped: deliveries = slots + stale drops, counted by the simulated workers
    themselves (a slot ordered again after the kill would add one)."""
    import tempfile

    steps, prompts, every = 10, 2, 2
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as journal:
        def run(sim_client: SimClient) -> tuple[Sim, ChunkCollector, LocalDataPlane]:
            sim = Sim(sim_client, [SimWorker(speed=rng.uniform(0.1, 3.0)) for _ in range(workers)],
                      rng, group_size=2)
            sim_client.sim = sim
            local = LocalDataPlane()
            local.register_partition("train", [])
            collector = ChunkCollector(sim_client, local, train_partition="train",
                                       prompts_per_step=prompts, group_size=2, workers=workers,
                                       max_staleness=staleness, procs=sim.procs, keep_taken=True)
            return sim, collector, local

        def train(sim: Sim, collector: ChunkCollector, local: LocalDataPlane, step: int) -> None:
            chunks, figures = collector.collect(step)
            trained[step] = figures["prompt_groups"]
            local.clear_samples(partition_id="train",
                                sample_ids=[s for c in chunks for s in c.sample_ids])
            sim.published = step
            sim.advance(until=sim.now + rng.uniform(0.05, 2.0))

        trained: dict[int, list[int]] = {}
        sim1, first_run, local = run(SimClient(journal_dir=journal))
        first_run.register()
        checkpoint = None
        for step in range(kill_at + 1):
            train(sim1, first_run, local, step)
            # Step ``step - 1`` finishes with ``step`` prepared: a save every ``every`` steps
            # holds steps < step + 1 (the prepared one with its rows); the next prepare releases.
            if step and step % every == 0:
                checkpoint = {"first": step + 1, "next_ticket": first_run.ledger.next_ticket}
                first_run.release(len(first_run.kept))
        dropped = first_run.filter.rows_dropped
        sim1.client.close()  # the kill: what the journal holds is all that is left
        assert checkpoint is not None
        first = checkpoint["first"]
        trained = {s: g for s, g in trained.items() if s < first}  # the checkpoint's steps

        sim2, resumed, local = run(SimClient(journal_dir=journal))
        sim2.published = first - 1
        resumed.restart(first, checkpoint["next_ticket"])
        resumed.register(recover=True)
        resumed.recover()
        for step in range(first, steps):
            train(sim2, resumed, local, step)
        dropped += resumed.filter.rows_dropped
        sim2.client.close()

    assert [trained[s] for s in range(steps)] == [
        list(range(s * prompts, (s + 1) * prompts)) for s in range(steps)]
    assert resumed.rollouts_generated_twice == 0
    chunks_of_slots = steps * (prompts // first_run.chunk_prompts)
    # (the slots past the last step, ordered ahead by the staleness bound, are not counted)
    delivered = sum(n for sim in (sim1, sim2) for slot, n in sim.delivered.items()
                    if slot < chunks_of_slots)
    assert delivered == chunks_of_slots + dropped // first_run.chunk_rows, (
        f"{delivered} deliveries for {chunks_of_slots} slots and "
        f"{dropped // first_run.chunk_rows} stale drops: a delivered rollout was made again "
        f"(first run {dict(sim1.delivered)}, resumed from step {first} {dict(sim2.delivered)})")


def test_rows_an_earlier_run_left_in_the_exchange_are_dropped_at_start():
    """A trainer that died before closing a store of the same name left rollouts behind; the
    next run's first claim must not hand them out (CI saw a chunk mixing two runs' tickets)."""
    import torch

    from tq_plugin.data_plane import LocalDataPlane
    from tq_plugin.rl.topology.collector import ChunkCollector
    from tq_plugin.rl.topology.exchange import ROLLOUTS_PARTITION

    shared = LocalDataPlane()
    shared.register_partition(ROLLOUTS_PARTITION, [])
    shared.put_samples(
        partition_id=ROLLOUTS_PARTITION,
        sample_ids=["old-0", "old-1"],
        fields={"weight_version": torch.zeros(2)},
    )
    collector = ChunkCollector(shared, LocalDataPlane(), train_partition="train", prompts_per_step=2,
                               group_size=2, workers=1, max_staleness=1, procs=[])
    collector.register()
    assert shared.list_sample_ids(ROLLOUTS_PARTITION) == []
    collector.register()  # idempotent on a clean exchange


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_clean_hydra")
def test_prompts_task_runs_disaggregated(tmp_path, ray_session):
    """task=prompts with workers: each worker builds the task from the config (the one builder,
    no task constants in the worker) and seeks its ticket's slot of the prompt stream."""
    from tq_plugin.rl.tasks.tiny_text import make_tiny_model

    data = tmp_path / "data"
    model = make_tiny_model(data, train_rows=64, eval_rows=8)
    run = tmp_path / "run"
    _, result, rows, _ = _run(
        run, "task=prompts", f"task.path={data / 'train.jsonl'}",
        "task.reward._target_=tq_plugin.rl.tasks.rewards.token_match", "model=hf_causal_lm",
        f"model.pretrained_path={model}", "recipe.rollout_workers=2", "recipe.num_steps=3",
        "recipe.prompts_per_step=4")
    assert result["status"] == "ok" and result["steps"] == 3 and result["workers_lost"] == 0
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(int(r["staleness_max"]) <= 1 for r in rows)
    groups = [json.loads(line)["prompt_groups"]
              for line in (run / PROMPT_GROUPS_FILE).read_text().splitlines()]
    assert groups == [list(range(4 * s, 4 * s + 4)) for s in range(3)]

"""``recipe.topology=disaggregated``: rollout workers generate ahead while the trainer trains.

``recipe.rollout_workers=K`` worker processes (``tq_plugin.rl.topology.worker``; Ray actors of the
trainer on the ``ray`` and ``transferqueue`` backends, started through the backend's launcher,
``tq_plugin.data_plane.processes.launcher_for``) generate continuously, each with the newest
weights it has, every call staged through ``TQTokenSink`` and every finished
group written as training rows by ``RolloutReassembler`` into the ``rollouts`` partition of the
shared store (``tq.backend``, opened and owned by the trainer). The trainer never runs a
rollout: each RL step (the ``MetaDataModule``'s step source) claims ready rows through the
task-mediated claims (``claim_meta``, task ``async_ready``), so it waits only when no chunk is
ready. Each admitted chunk is read once and copied into the trainer's own embedded store (the
``DataPlaneCallback``'s client), then cleared from the shared one ("1-hop": bulk goes from the
worker to the store to the trainer; the step's logprob, advantage and microbatch reads and
writes then stay in the trainer's process). What the trainer does with the rows:

1. **staleness** (``recipe.max_staleness=S``): a chunk of rows generated with weights of
   version ``v`` trains at step ``s`` only if ``s - v <= S``; a staler chunk is cleared and
   counted (``rows_dropped_stale``), and a replacement is ordered. Versions count RL steps:
   the trainer publishes its flat parameters through the data plane after every optimizer
   step, as version ``s + 1`` after step ``s``'s last and labelled ``s`` after its earlier ones
   (``WeightPublisher``: newer than their label, so the bound stays safe;
   ``recipe.weights_every=rl_step`` publishes after each step's last only); workers load the
   newest before each ticket.
   Lightning prepares step ``s + 1`` before step ``s``'s last microbatch trains, so generation
   that overlaps training lags by at least one step: ``S >= 1``.
2. the step's :class:`~tq_plugin.rl.training.pipeline.StepTail`, as colocated:
   ``prev_logprobs`` (the policy the step starts from), ``reference_policy_logprobs`` (the
   frozen reference, ``recipe.beta > 0``), PPO's ``values``, the advantages; then the
   **importance-sampling correction** in the policy loss (``RLModule``, ``recipe.is_correction``;
   by default ``token_tis``): each action token's clipped policy-gradient term is multiplied by
   ``w = min(exp(prev_logprobs - generation_logprobs), cap)`` (``cap``: ``is_correction.cap``,
   else ``recipe.is_truncation``), or masked (``seq_mask_tis``, ``icepop``). The weight is
   positive (``min(r A w, clip(r) A w) = w min(r A, clip(r) A)``): tokens the staler engine
   made likelier than the trainer's policy would are down-weighted, the rest count up to the
   cap. On fresh rows ``w`` is 1 (the logprob gap of a colocated run is ~0). The default cap is
   2.0 (``recipe.is_truncation``): on the GRPO pattern task (2 workers, ``max_staleness=1``,
   seeds 0-2, 120 steps, the preset's lr 7e-4) it took the last-20-step reward from 0.31 (cap
   1.0) to 0.45, against 0.54 colocated (``docs/CONTRIBUTING.md``, known gaps).

Each worker runs a :class:`~tq_plugin.rl.training.pipeline.DrawLoop` per ticket, so the reward
shaping (``recipe.mask_truncated_completions``, ``recipe.overlong_buffer``) and
``recipe.dynamic_sampling`` run where the groups are generated, per chunk: a worker draws until
its chunk's groups have reward variance. With a dataset task the extra draws read the prompts
after the slot's, so under dynamic sampling a prompt may be drawn twice across the run. The
draws' figures ride the chunk's tags (``fig:<name>``); the collector averages fractions and
means by rows and sums counts into the step's figures (``collector.chunk_figures``).

Tickets (``tq_plugin.rl.topology.staleness.TicketLedger``): the trainer orders chunks of
``prompts_per_step / K`` prompts (whole groups; each a slot of the run's prompt stream, whose
prompts the slot seeds) aimed at steps up to ``s + S``, each to the least-loaded live worker;
step ``s`` trains exactly its own slots (``ChunkCollector``), and ``prompt_groups.jsonl`` records
the prompt-stream indices each trained step held. A worker that dies is reported (stderr and ``workers_lost`` in
``result.json``); the rows it delivered stay in the store and train, the tickets it had not
delivered go to the others, and once no worker is left the run stops with an error. The trainer
stopping (end of fit, an exception, SIGTERM) stops the workers; when the trainer process dies
Ray kills its worker actors (they are not detached; a spawned worker whose parent is gone exits
on its own).

**Resume** (``ckpt_path``; ``recipe.checkpoint_every=K`` writes ``checkpoints/last.ckpt`` every
K steps, SIGTERM ``checkpoints/sigterm.ckpt``): the trainer's checkpoint holds its weights, the
resume cursor and its own store (the step it was training or had prepared, rows included:
``DataPlaneCallback``), and this class's state: the next ticket number, the drop/duplicate/loss
counts, the figures of the unfinished steps. The shared store and the workers are not kept: the
resumed trainer opens a new store, publishes its weights as the version of the steps it has
finished, starts new workers, and orders again every slot from the first step it prepares (the
rows in flight died with the old store; a slot draws the same prompts whoever generates it), with
ticket numbers above every one used before (row ids are built from them). So every prompt group
of steps ``0..num_steps-1`` trains exactly once across the runs (every slot, under dynamic
sampling), and the staleness bound holds
(``tests/rl/topology/test_async_resume.py``).

**Resume without replay** (``tq.backend.journal_dir``: the shared store journaled,
``docs/durability.md``): the resumed trainer's store is the journal's recovery, so what the
workers delivered survives the kill. With ``recipe.checkpoint_every`` the rows of a chunk the
trainer took stay in the shared store until a checkpoint holds their step (they are released
after the next save), and on resume every chunk delivered for a step the checkpoint has not
trained is taken back (``ChunkCollector.recover``): only the slots whose chunk was in flight
at the kill are ordered again. ``result.json`` counts ``rollouts_generated_twice`` (rows
delivered again for a slot delivered before the resume, from the store's own record of
deliveries: the goal is 0), ``rollouts_recovered``, ``orders_reissued`` (orders outstanding at
the kill, ordered again: their chunks were never delivered, so nothing acknowledged is made
twice) and ``calls_staged_twice`` with its reason: a chunk in flight at the kill is generated
again whole, so the calls its worker had staged are made again (with
``recipe.worker_staging=local``, the default, those calls lived in the worker's memory and
their count is not known: ``null``).

metrics.csv gains ``staleness_max``, ``staleness_mean``, ``rows_dropped_stale``,
``trainer_wait_s`` (time blocked in claims), ``rollout_calls_per_s`` (staged calls delivered
per second of the step's wall time) and ``workers_alive``.

Requires a store shared across processes (``tq/backend=ray`` or ``tq/backend=transferqueue``);
the embedded ``local`` store cannot be reached from a worker process.

**Several trainer ranks** (``trainer=ddp_cpu``): rank 0 alone runs this class's trainer side
(it starts the workers, claims, prepares each step and publishes the weights, which DDP keeps
equal on every rank). The step's rows go into the train partition of the shared store rather
than an embedded one, and every rank reads its length-balanced shard of the broadcast step meta
(``MetaDataModule(rows="shared")``, as a colocated run on a shared store), so each optimizer
step trains the one-process global batch.

**Sharded trainer** (``trainer=fsdp_cpu``, ``trainer=fsdp``): every forward of an FSDP2 model
all-gathers its parameters, so the other ranks join what rank 0 did alone under DDP. Every rank
runs the step source (``MetaDataModule(source_on_every_rank=True)``): rank 0 claims the rows and
broadcasts their meta, each rank runs the ``prev_logprobs`` and value passes over its
length-balanced shard of the rows and writes them (padding with throwaway forwards to the
busiest rank's count, so the collectives pair up), and once every rank's rows are written rank 0
computes the advantages.
Each publish gathers the policy's full parameters into the flat weights row a bounded bucket at
a time (``weights_snapshot``: every rank joins the gathers, rank 0 keeps the row), so no rank
holds a second whole copy of its model beside the row the workers read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from typing import Any

from hydra.utils import get_class, instantiate
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from tq_plugin.config import ConfigError
from tq_plugin.data_plane import SAMPLE_MASK, TOKEN_MASK, KVBatchMeta, LocalDataPlane
from tq_plugin.data_plane.processes import launcher_for
from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.topology.collector import ChunkCollector
from tq_plugin.rl.topology.exchange import BackgroundWriter, WeightPublisher, weights_snapshot
from tq_plugin.rl.topology.source import StepSource, register_step_source
from tq_plugin.rl.topology.staleness import check_token_ledger
from tq_plugin.rl.topology.worker import WorkerSpec, worker_main
from tq_plugin.rl.training.metrics import MetricsLog, StepRecord
from tq_plugin.rl.training.pipeline import StepTail
from tq_plugin.rl.training.ranks import is_sharded_run, shares_rows
from tq_plugin.staging import TOKEN_VERSIONS_FIELD

log = logging.getLogger(__name__)
PROMPT_GROUPS_FILE = "prompt_groups.jsonl"
# result.json's counts of what a resume on a journaled store made again (``replay_totals``).
REPLAY_KEYS = ("rollouts_generated_twice", "rollouts_recovered", "orders_reissued",
               "calls_staged_twice")
# The per-token figures of the step (``staleness.check_token_ledger``); without a ledger every
# token of a row has its chunk's version, so they are the row figures.
LEDGER_COLUMNS = ("token_staleness_max", "token_staleness_mean", "multi_version_fraction",
                  "tokens_masked_stale", "rows_masked_stale")
ASYNC_COLUMNS = ("staleness_max", "staleness_mean", "rows_dropped_stale", "trainer_wait_s",
                 "rollout_calls_per_s", "workers_alive", *LEDGER_COLUMNS)


@dataclasses.dataclass
class AsyncStepRecord(StepRecord):
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {**super().row(), **{k: self.extra.get(k, 0) for k in ASYNC_COLUMNS}}


class AsyncMetricsLog(MetricsLog):
    """``MetricsLog`` whose rows carry the disaggregated columns (set by ``prepare_step``).

    ``write`` adds ``prompt_groups.jsonl``: per trained step, the prompt-stream indices of the
    groups it trained and its ``staleness_max`` (what a resumed run's record is checked by).
    """

    step_type = AsyncStepRecord  # what RLStepCallback rebuilds the checkpointed records as

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[int, dict[str, Any]] = {}
        self.run_totals: dict[str, Any] = {}

    def on_step_ready(self, step: int, **kwargs: Any) -> None:
        super().on_step_ready(step, **kwargs)
        base = self.steps[-1]
        row = AsyncStepRecord(**{f.name: getattr(base, f.name) for f in dataclasses.fields(StepRecord)},
                         extra=self.pending.pop(step, {}))
        self.steps[-1] = self._by_step[step] = row

    def summary(self, dp_total_bytes: int) -> dict[str, Any]:
        out = super().summary(dp_total_bytes)
        extras = [s.extra for s in self.steps if isinstance(s, AsyncStepRecord)]
        out.update(self.run_totals)
        out["staleness_max"] = max((e.get("staleness_max", 0) for e in extras), default=0)
        out["trainer_wait_s"] = round(sum(e.get("trainer_wait_s", 0.0) for e in extras), 3)
        return out

    def write(self, cfg: Any, summary: dict[str, Any]) -> None:
        super().write(cfg, summary)
        lines = [json.dumps({"step": s.step, "prompt_groups": s.extra.get("prompt_groups", []),
                             "staleness_max": s.extra.get("staleness_max", 0)})
                 for s in self.steps if isinstance(s, AsyncStepRecord)]
        (self.output_dir / PROMPT_GROUPS_FILE).write_text("".join(f"{line}\n" for line in lines))


def check_disaggregated(cfg: Any) -> None:
    """Refuse what the disaggregated topology cannot run, before anything starts."""
    rc = cfg.recipe
    if rc.max_staleness < 1:
        raise ConfigError(
            f"recipe.max_staleness={rc.max_staleness}: topology=disaggregated needs >= 1 (rows "
            "generated while the trainer trains lag it by one step; colocated is on-policy)")
    engine = (cfg.get("engine") or {}).get("name", "native")
    if getattr(rc, "inflight_updates", False) and engine not in ("native", "hf", "vllm"):
        raise ConfigError(
            f"recipe.inflight_updates=true runs with engine=native, hf or vllm, not "
            f"engine={engine}")
    if getattr(rc, "inflight_updates", False) and engine == "vllm" and rc.inflight.kv != "recompute":
        raise ConfigError(
            f"recipe.inflight_updates=true with engine=vllm needs recipe.inflight.kv=recompute, "
            f"not {rc.inflight.kv!r}: the engine drives vLLM's offline LLM.generate, which runs "
            "a batch to its end, so it applies new weights by aborting and re-feeding each "
            "sequence's prefix, whose KV cache is then recomputed (docs/topologies.md)")
    model = cfg.model
    if (model.get("lora") or {}).get("r") is not None and model.get("pretrained_path") is None:
        raise ConfigError(
            "model.lora with recipe.topology=disaggregated needs model.pretrained_path: the "
            "workers receive the adapters alone over their own copy of the frozen base, which "
            "only a checkpoint makes the trainer's (a random init differs per process)")
    backend = cfg.tq.backend
    if not shares_rows(get_class(backend._target_)):
        raise ConfigError(
            f"recipe.topology=disaggregated needs a store shared across processes: use "
            f"tq/backend=ray or tq/backend=transferqueue (tq.backend._target_="
            f"{backend._target_} is embedded in the trainer process)")


@register_step_source("disaggregated")
class Disaggregated(StepSource, Callback):
    """The trainer side: starts and stops the workers, claims each step's rows, publishes weights.

    The step source of ``recipe.topology=disaggregated``, and a Lightning callback of the
    recipe's trainer (publish after each step's last microbatch, stop the workers when the fit
    ends or fails). Its collaborators (:meth:`attach`): the trained ``module``, the step
    ``metrics`` (an :class:`AsyncMetricsLog`), the ``DataPlaneCallback`` (``dp_callback``: how
    many steps the run has finished) and the ``SigtermStop`` to re-arm once Ray has started.
    """

    metrics_type = AsyncMetricsLog
    off_policy = True
    checkpoints_task = False  # the ledger's prompt-stream slots say which rows come next
    inflight_updates = True  # workers may take new weights mid-generation (the per-token ledger)

    def __init__(self, cfg: Any, *, rc: Any, task: Any, output_dir: Any, rollouts: Any) -> None:
        check_disaggregated(cfg)
        super().__init__(cfg, rc=rc, task=task, output_dir=output_dir, rollouts=rollouts)
        self.turns = task.turns
        self.procs: list[Any] = []
        self.client: Any = None
        self.collector: ChunkCollector | None = None
        self.writer: BackgroundWriter | None = None
        self.publisher: WeightPublisher | None = None
        self.resumed: dict[str, Any] | None = None  # this class's state from ckpt_path
        # Every rank that prepares steps: the first was prepared (weights go out from then on).
        self.started = False
        self.world_size, self.sharded = 1, False
        self.journaled = cfg.tq.backend.get("journal_dir") is not None
        self.covered = 0  # chunks kept in the shared store that the last checkpoint holds

    def attach(self, *, module: Any, metrics: Any, dp_callback: Any, sigterm: Any) -> None:
        super().attach(module=module, metrics=metrics, dp_callback=dp_callback, sigterm=sigterm)
        self.tail = StepTail(module, rc=self.rc, turns=self.turns)

    def callbacks(self) -> list[Any]:
        return [self]

    def own_store(self) -> Any:
        """One trainer process keeps its rows in an embedded store of its own (one hop from
        the workers' shared store); several ranks share ``tq.backend``."""
        return LocalDataPlane() if self.world_size == 1 else None

    def every_rank(self) -> bool:
        """A sharded policy's no-grad passes need every rank."""
        return self.sharded

    def close(self) -> None:
        self.stop()

    # ------------------------------------------------------------------ workers
    def start(self, local: Any, step: int, weights: Any) -> None:
        """Open the shared store (``tq.backend``, owned here), register the exchange partitions,
        publish the trainer's weights, start the workers where the backend runs them
        (``launcher_for``: Ray actors on the Ray backends) and print each one's pid. ``local``:
        the trainer's own store; ``step``: the first step to prepare; ``weights``: the policy's
        ``weights_snapshot``, the first version the workers load.

        Resumed (``ckpt_path``): the weights go out as the version of the steps the checkpoint
        finished (the trainer's version, as if it had never stopped), so the bound holds across
        the resume; the ledger restarts at ``step`` with ticket numbers above every one used
        before (worker row ids are built from them; the restored step's rows keep theirs), and
        the slots in flight when the run stopped are ordered again."""
        rc = self.rc
        self.client = client = instantiate(self.cfg.tq.backend)
        self.sigterm.arm()  # starting Ray here replaced the SIGTERM stop's handler
        self.collector = c = ChunkCollector(
            client, local, train_partition=rc.train_partition, prompts_per_step=rc.prompts_per_step,
            group_size=rc.group_size, workers=rc.rollout_workers, max_staleness=rc.max_staleness,
            procs=self.procs, keep_taken=self.journaled and bool(rc.checkpoint_every))
        version = self.dp_callback.completed_steps  # 0, unless resumed
        if self.resumed is None:
            c.register()
        else:
            c.restart(step, int(self.resumed["next_ticket"]))
            c.register(recover=self.journaled)
            if self.journaled:
                c.recover()
                self.replay_totals()
            c.filter.rows_dropped = int(self.resumed["rows_dropped"])
            c.rows_duplicate = int(self.resumed["rows_duplicate"])
            c.workers_lost = int(self.resumed["workers_lost"])
            msg = (f"[tq_plugin] disaggregated run resumed at step {step}: weights published as "
                   f"version {version}, tickets numbered from {c.ledger.next_ticket}")
            print(msg, file=sys.stderr, flush=True)
            log.info(msg)
        self.publisher = WeightPublisher(client)
        self.publisher.publish_snapshot(weights, version)  # inline: before any worker starts
        self.writer = self.collector.writer = self.publisher.writer = BackgroundWriter()
        launcher = launcher_for(client)
        for k in range(rc.rollout_workers):
            spec = WorkerSpec(index=k, client=client, cfg=self.cfg)
            self.procs.append(launcher.start(worker_main, (spec,), name=f"tq-rollout-{k}"))
        for k, proc in enumerate(self.procs):  # every worker started before the first pid wait
            log.info("[tq_plugin] rollout worker %d started (pid %d, %s)", k, proc.pid,
                     type(proc).__name__)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every worker this trainer started (idempotent): ask them all, then each gets
        what is left of ``timeout_s`` to return before its handle forces it. The background
        writes still in flight land first; one that failed is reported on stderr (training is
        over, or already failing)."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001 - reported, and the shutdown goes on
                msg = f"[tq_plugin] a background write to the shared store failed: {e!r}"
                print(msg, file=sys.stderr, flush=True)
                log.error(msg)
        for proc in self.procs:
            proc.request_stop()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.stop(max(0.0, deadline - time.monotonic()))
        if self.client is not None:
            self.client.close()  # the owner drops the shared store (idempotent)

    def prepare_step(self, step: int, client: Any = None) -> KVBatchMeta | None:
        """The step source under the disaggregated topology (see the module docstring); under
        DDP it runs on rank 0 only. Under FSDP (``ranks.is_sharded_run``) every rank runs it: rank 0
        claims the step's rows and broadcasts their meta, every rank runs the no-grad passes
        over all of them in step (each forward of a sharded model is a collective) and rank 0
        alone writes their output and returns the step meta (``None`` on the others)."""
        m = self.module
        trainer = m.trainer
        writer = trainer.global_rank == 0
        if not self.started:  # the first version: gathered by every rank of a sharded policy
            weights = weights_snapshot(m.policy, keep=writer)
            if writer:
                self.start(m.dp_client, step, weights)
            self.started = True
        t0 = time.perf_counter()
        meta = figures = None
        if writer:
            if self.covered:  # the last save holds their steps: off the shared store
                self.collector.release(self.covered)
                self.covered = 0
            chunks, figures = self.collector.collect(step)
            meta = chunks[0].concat(*chunks[1:])
            meta = dataclasses.replace(meta, task_name="train", extra_info={})
            figures.update(self.check_ledger(meta, step, figures))
        t1 = time.perf_counter()
        self.tail.passes(meta, step=step, sharded=is_sharded_run(trainer))
        if not writer:
            return None  # the data module broadcasts rank 0's step meta
        draw_figures = figures.pop("draw_figures")
        meta = self.tail.finish(meta, step=step, draw=None, rollout_s=t1 - t0, t_prepare=t1,
                                failed_calls=figures.pop("failed_calls"), figures=draw_figures)
        self.metrics.pending[step] = figures
        c = self.collector
        self.metrics.run_totals = {
            "topology": "disaggregated", "rollout_workers": self.rc.rollout_workers,
            "max_staleness": self.rc.max_staleness, "rows_dropped_stale": c.filter.rows_dropped,
            "rows_duplicate": c.rows_duplicate, "workers_lost": c.workers_lost,
            "partial_claims": c.partial_claims,
            "collect_s_total": round(
                self.metrics.run_totals.get("collect_s_total", 0.0) + t1 - t0, 3)}
        if self.journaled:
            self.replay_totals()
        return meta

    def replay_totals(self) -> None:
        """``result.json``'s replay counts on a journaled store, summed over the resumes."""
        c, totals = self.collector, self.metrics.run_totals
        base = (self.resumed or {}).get("replay", {})
        mine = {"rollouts_generated_twice": c.rollouts_generated_twice,
                "rollouts_recovered": c.recovered_rows, "orders_reissued": c.orders_reissued}
        for key, value in mine.items():
            totals[key] = int(base.get(key) or 0) + value
        if self.resumed is None:
            totals.setdefault("calls_staged_twice", 0)
            return
        if c.orders_reissued == 0:
            calls, why = 0, "no chunk was in flight at the kill"
        else:
            n = c.orders_reissued
            chunks = f"{n} chunk{'s' * (n != 1)} in flight at the kill {'are' if n != 1 else 'is'}"
            calls, why = None, (
                f"{chunks} generated again whole; recipe.worker_staging=local kept the calls "
                "their workers had staged in the workers' memory, so how many is not known"
                if self.rc.worker_staging == "local" else
                f"{chunks} generated again whole under new tickets; the calls staged for them "
                "before the kill are not resumed")
        prior = base.get("calls_staged_twice", 0)
        totals["calls_staged_twice"] = None if calls is None or prior is None else prior + calls
        totals["calls_staged_twice_why"] = why

    def check_ledger(self, meta: KVBatchMeta, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        """The staleness bound token by token over the step's rows before anything reads them
        (``staleness.check_token_ledger``: a contradictory ledger fails the step naming the
        row; a token over the bound leaves the loss, a row left empty is masked; the new masks
        are written back). Rows without a ledger: the row figures."""
        if TOKEN_VERSIONS_FIELD not in meta.fields:
            return {"token_staleness_max": figures["staleness_max"],
                    "token_staleness_mean": figures["staleness_mean"],
                    "multi_version_fraction": 0.0, "tokens_masked_stale": 0,
                    "rows_masked_stale": 0}
        m = self.module
        td = m.read_from_dataplane(meta, select_fields=[TOKEN_VERSIONS_FIELD, TOKEN_MASK, SAMPLE_MASK],
                                   pad_value_dict={TOKEN_VERSIONS_FIELD: -1})
        check = check_token_ledger(td[TOKEN_VERSIONS_FIELD], td[TOKEN_MASK], td[SAMPLE_MASK],
                                   trainer_version=step, max_staleness=self.rc.max_staleness,
                                   sample_ids=meta.sample_ids)
        if check.figures["tokens_masked_stale"]:
            m.write_to_dataplane(meta, {TOKEN_MASK: check.token_mask, SAMPLE_MASK: check.sample_mask})
        return check.figures

    # ------------------------------------------------------------------ checkpoint state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The ledger's next ticket number, the run's drop and loss counts, and the figures of
        the steps the checkpoint has not finished (prepared, or training: the resumed run books
        them from the restored step meta). Rows in flight are not kept: their slots are ordered
        again on resume."""
        c, metrics = self.collector, self.metrics
        done = self.dp_callback.completed_steps
        figures = {s.step: s.extra for s in metrics.steps
                   if isinstance(s, AsyncStepRecord) and s.step >= done}
        figures.update(metrics.pending)
        counts = (self.resumed or {}) if c is None else {
            "next_ticket": c.ledger.next_ticket, "rows_dropped": c.filter.rows_dropped,
            "rows_duplicate": c.rows_duplicate, "workers_lost": c.workers_lost}
        if c is not None:  # this save holds the steps of every chunk taken so far
            self.covered = len(c.kept)
        return {"next_ticket": 0, "rows_dropped": 0, "rows_duplicate": 0, "workers_lost": 0,
                **counts, "run_totals": dict(metrics.run_totals),
                "figures": {str(k): v for k, v in figures.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resumed = {k: v for k, v in state_dict.items() if k not in ("run_totals", "figures")}
        metrics = self.metrics
        metrics.run_totals = dict(state_dict["run_totals"])
        self.resumed["replay"] = {k: metrics.run_totals[k] for k in REPLAY_KEYS
                                  if k in metrics.run_totals}
        metrics.pending.update({int(k): v for k, v in state_dict["figures"].items()})

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        info = pl_module.dp_meta.extra_info[MICROBATCH_INFO]
        if not self.started or not info["last_in_global_batch"]:  # no optimizer step
            return
        step = int(info["step"])
        if info["last_in_step"]:
            version = step + 1
        elif self.rc.weights_every == "optimizer_step":
            version = step
        else:
            return
        # A sharded policy's ranks all join the gather; rank 0 (the publisher) keeps the row.
        weights = weights_snapshot(pl_module.policy, keep=self.publisher is not None)
        if self.publisher is not None:
            self.publisher.publish_snapshot(weights, version)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        self.stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop()


__all__ = ["PROMPT_GROUPS_FILE", "AsyncMetricsLog", "Disaggregated", "check_disaggregated"]

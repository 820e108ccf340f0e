"""``RLRecipe``: PPO or GRPO on the synthetic pattern task, one Lightning fit over RL steps.

torchtune-style: one class, ``setup`` / ``train`` / ``cleanup``, private ``_setup_*`` helpers.
Each RL step (``prepare_step``), inside the fit's dataloader:

1. the rollout engine (``engine=native|hf|vllm``, ``tq_plugin.rollout``) generates multi-turn
   rollouts, every call staged through ``TQTokenSink`` with the engine's own tokens, logprobs
   and weight version. An ``hf`` or ``vllm`` engine holds its own copy of the policy, started
   from an HF checkpoint the recipe writes into the run dir (``engine_init/``) and brought to
   the trainer's weights before each step's rollouts (``rl/weight_sync_s``);
2. ``RolloutReassembler.finalize_group`` verifies the staged calls against the receipts and
   writes the training rows (``first_write``) into the train partition, returning the meta;
3. per-turn rewards, ``prev_logprobs`` (policy) and ``values`` (PPO's value model) are written
   back through the data plane; advantages are computed from columns read back and written too;
4. ``MetaDataModule`` cuts the step into microbatch metas under the configured packing, once
   per ``ppo_epochs``; the module reads each microbatch's columns through ``MetaBatchMixin``.

``DataPlaneCallback`` owns the client (built from ``tq.backend``), meters what crosses it and
clears each step's rows after its last microbatch. ``RLStepCallback`` carries each step's loss
normalizer and rollout metrics from the step meta to the module and the metrics on every rank,
reduces the metrics over ranks and writes the artifacts on rank 0; it checkpoints the rollout
generator and the finished steps' metrics, so ``ckpt_path=...`` resumes a run to
``recipe.num_steps``. SIGTERM saves ``checkpoints/sigterm.ckpt`` and exits with status 143.
``recipe.checkpoint_every=K`` also saves ``checkpoints/last.ckpt`` every K RL steps
(``PeriodicCheckpoint``): what a killed run resumes from.

Under DDP (``trainer=ddp_cpu``) each rank trains on its length-balanced shard of the same global
batch one process would train on; ``tq_plugin.rl.ranks`` says how the step is split per backend.
"""

from __future__ import annotations

import copy
import json
import logging
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, open_dict

from tq_plugin.config import ConfigError, PackingConfig, RecipeConfig, validate_config
from tq_plugin.config.schema import EngineConfig
from tq_plugin.data_plane import (
    ADVANTAGES,
    GENERATION_LOGPROBS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    RETURNS,
    SAMPLE_MASK,
    TOKEN_MASK,
    TOTAL_REWARD,
    VALUES,
    KVBatchMeta,
    LocalDataPlane,
)
from tq_plugin.lightning import MICROBATCH_INFO, DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.instantiators import instantiate_callbacks, instantiate_loggers
from tq_plugin.rl import ranks, sharding
from tq_plugin.rl.advantages import gae, group_relative, turn_end_rewards, whiten
from tq_plugin.rl.disaggregated import Disaggregated
from tq_plugin.rl.evaluation import EVAL, EvalLog, evaluate
from tq_plugin.rl.metrics import RESULT_FILE, MetricsLog
from tq_plugin.rl.model_protocol import check_models
from tq_plugin.rl.module import RLModule
from tq_plugin.rl.prompts import TaskState
from tq_plugin.rl.step_callbacks import RL_STEP, PeriodicCheckpoint, RLStepCallback, SigtermStop
from tq_plugin.rl.task import IMG
from tq_plugin.rl.weights import (
    engine_weights,
    hf_backbone,
    save_final_weights,
    write_engine_checkpoint,
)
from tq_plugin.rl.workers import TURN_REWARDS
from tq_plugin.rollout import EngineError, RolloutWorker, build_engine
from tq_plugin.staging import RolloutReassembler

log = logging.getLogger(__name__)
SIGTERM_EXIT = 128 + signal.SIGTERM


def action_tokens_and_gap(td: Any) -> tuple[int, float]:
    """``(action tokens, largest |generation_logprobs - prev_logprobs| over them)`` of rows read
    with their token and sample masks (``RLRecipe._check_rows``)."""
    mask = (td[TOKEN_MASK] > 0) & (td[SAMPLE_MASK] > 0).unsqueeze(1)
    gap = ((td[GENERATION_LOGPROBS] - td[PREV_LOGPROBS]).abs() * mask).max()
    return int(mask.sum()), float(gap)


class RLRecipe:
    """PPO (``recipe.algorithm=ppo``: policy + value, GAE) or GRPO (policy only, group baselines)."""

    def __init__(self, cfg: DictConfig, output_dir: str | Path) -> None:
        typed = validate_config(cfg)
        self.output_dir = Path(output_dir)
        self.cfg = self._pin_logger_dirs(cfg)
        self.rc: RecipeConfig = typed["recipe"]
        self.engine_cfg: EngineConfig = typed.get("engine") or EngineConfig()
        self.packing: PackingConfig = instantiate(cfg.tq.packing)
        self.media = bool(cfg.tq.staging.capture_media)
        self.ppo = self.rc.algorithm == "ppo"

    def _pin_logger_dirs(self, cfg: DictConfig) -> DictConfig:
        """A copy of ``cfg`` whose loggers write under this run's output dir: their
        ``${hydra:runtime.output_dir}`` cannot resolve where Hydra is not running (a
        ``ddp_spawn`` rank, a config composed in a test)."""
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            for node in (cfg.get("logger") or {}).values():
                if isinstance(node, DictConfig) and "save_dir" in node:
                    node.save_dir = str(self.output_dir)
        return cfg

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the recipe (the step source is its bound method) through
        # torch.multiprocessing, which cannot rebuild a torch.Generator: ship its state as bytes
        # (a tensor made here would be freed before the child maps its shared memory).
        state = dict(self.__dict__)
        if "generator" in state:
            state["generator"] = state["generator"].get_state().numpy().tobytes()
        state["engine"] = None  # each process builds its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            rng = torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8)
            state["generator"] = torch.Generator().set_state(rng)
        self.__dict__.update(state)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        # MetaBatchMixin overrides the module's batch-transfer hooks on purpose.
        warnings.filterwarnings("ignore", message=r"You have overridden `(on_before_batch_transfer|"
                                r"transfer_batch_to_device)` in `LightningModule`")
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        if self.rc.num_threads:
            torch.set_num_threads(self.rc.num_threads)
        torch.manual_seed(self.rc.seed)
        self.task = instantiate(self.cfg.task, media=self.media, seed=self.rc.seed)
        if self.rc.topology == "disaggregated" and hasattr(self.task, "state_dict"):
            raise ConfigError(f"task={self.task.name} runs with recipe.topology=colocated (the "
                              f"rollout workers build the pattern task)")
        # One rollout stream for the run, the same on every rank (see tq_plugin.rl.ranks).
        self.generator = torch.Generator().manual_seed(self.rc.seed + 1009)
        self.summary: dict[str, Any] | None = None
        self._setup_models()
        self._check_engine()
        self.engine: Any = None
        self.weight_sync_s: list[float] = []
        self.disaggregated = Disaggregated(self) if self.rc.topology == "disaggregated" else None
        self._setup_trainer()
        self.metrics = MetricsLog(self.output_dir, packing=self.packing.mode)
        if self.disaggregated is not None:  # rollout workers; metrics gain their columns
            self.metrics = self.disaggregated.metrics_log(self.metrics)
        self.module.step_hook = self._after_microbatch
        self.sink = self.reassembler = self.worker = None

    def _after_microbatch(self, meta: KVBatchMeta, stats: dict[str, float]) -> None:
        self.metrics.on_microbatch(meta, stats)
        self.periodic.save_if_due(self.module.trainer, meta.extra_info[MICROBATCH_INFO])
        self.sigterm.stop_if_requested(self.module.trainer)

    def _setup_models(self) -> None:
        max_len = self.task.max_sequence_length(self.rc.max_new_tokens)
        common = {"vocab_size": self.task.vocab_size, "image_token_id": IMG,
                  "patch_dim": self.task.patch_dim if self.media else None}
        if max_len > self.cfg.model.max_seq_len:
            raise ValueError(f"model.max_seq_len={self.cfg.model.max_seq_len} is shorter than the "
                             f"task's longest episode ({max_len} tokens)")
        policy = instantiate(self.cfg.model, output_token_ids=self.task.output_token_ids, **common)
        value = instantiate(self.cfg.model, value_head=True, **common) if self.ppo else None
        check_models(policy, value, vocab_size=self.task.vocab_size, layout=self.packing.layout,
                     media=self.media)
        # The IS correction is on where the rows' generating policy is not the trained module:
        # disaggregated workers (older weights) and the hf/vllm engines (other kernels).
        correct_is = self.rc.topology == "disaggregated" or self.engine_cfg.name != "native"
        self.module = RLModule(policy=policy, value=value, recipe=self.rc, packing=self.packing,
                               media=self.media, correct_is=correct_is)

    def _check_engine(self) -> None:
        """Refuse an engine that cannot serve this run, before anything starts (one
        ``EngineError`` naming ``engine`` and what to do)."""
        name = self.engine_cfg.name
        if name == "native":
            return
        if hf_backbone(self.module.policy) is None:
            raise EngineError(f"engine={name} serves an HF-format policy: use model=hf_causal_lm "
                              f"(model={self.cfg.model.get('name')} runs with engine=native)")
        if self.media:
            raise EngineError(f"engine={name} reads no pixels: tq/staging=media runs with "
                              f"engine=native")
        if name == "vllm":
            import importlib.util

            hf_cfg = hf_backbone(self.module.policy).config
            head_dim = (getattr(hf_cfg, "head_dim", None)
                        or hf_cfg.hidden_size // hf_cfg.num_attention_heads)
            if head_dim % 32 and not torch.cuda.is_available():
                raise EngineError(
                    f"engine=vllm: vLLM's CPU attention fails on head_dim={head_dim} (model.d_model "
                    f"/ model.n_heads); pick sizes whose head_dim is a multiple of 32 (e.g. "
                    f"model.n_heads=2 with model.d_model=64) or use engine=hf")

            if importlib.util.find_spec("vllm") is None:
                from tq_plugin.rollout.engines.vllm import INSTALL_HINT

                raise EngineError(f"engine=vllm: vLLM is not installed; {INSTALL_HINT}, or use "
                                  f"engine=hf")

    def _build_engine(self) -> Any:
        """The colocated run's engine: the policy itself (``native``), or a copy started from
        the HF checkpoint written into the run dir (by rank 0; when every rank generates, each
        rank's engine starts from it, and a sharded policy's ranks gather it together)."""
        policy, name = self.module.policy, self.engine_cfg.name
        checkpoint = None
        if name != "native":
            checkpoint = write_engine_checkpoint(
                policy, self.output_dir / "engine_init", rank=self.trainer.global_rank,
                barrier=self.trainer.strategy.barrier if self.replicated else None)
        return build_engine(self.engine_cfg, model=policy, checkpoint=checkpoint,
                            max_model_len=int(self.cfg.model.max_seq_len), weight_version=0)

    def _sync_engine(self, step: int) -> None:
        """Bring the engine to the trainer's weights of ``step`` (those after the previous
        step's last optimizer step) before it generates; log ``rl/weight_sync_s``.

        Colocated, the engine generates only between RL steps, so one push per step is every
        push that can change a rollout: ``recipe.weights_every`` matters to the disaggregated
        topology, whose workers generate while the trainer trains."""
        if self.engine.weight_version == step:
            return
        t0 = time.perf_counter()
        self.engine.update_weights(engine_weights(self.module.policy, self.engine.name),
                                   version=step)
        seconds = time.perf_counter() - t0
        self.weight_sync_s.append(seconds)
        if self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics({"rl/weight_sync_s": seconds}, step=self.trainer.global_step)

    def close_engine(self) -> None:
        """Release the engine (idempotent); the recipe's cleanup and a failed fit call it."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()

    def _setup_trainer(self) -> None:
        self.callback = DataPlaneCallback(  # the store is chosen once the world size is known
            self._train_store, role="policy",
            partitions=[{"partition_id": self.rc.train_partition, "fields": []}],
        )
        self.step_callback = RLStepCallback(self)
        self.sigterm_checkpoint = self.output_dir / "checkpoints" / "sigterm.ckpt"
        max_steps = self.rc.num_steps * self.rc.ppo_epochs * self.rc.minibatches
        self.sigterm = SigtermStop(self.sigterm_checkpoint)
        self.periodic = PeriodicCheckpoint(self.sigterm_checkpoint.parent,
                                           self.rc.checkpoint_every or 0)
        # The task's own state (task=prompts: its dataset cursor) rides the checkpoint too.
        own = [TaskState(self.task)] if hasattr(self.task, "state_dict") else []
        callbacks = [self.callback, self.step_callback, self.sigterm, *own, EvalLog(),
                     *([self.disaggregated] if self.disaggregated else []), *instantiate_callbacks(
            self.cfg.get("callbacks"),
            progress_bar=bool(self.cfg.trainer.get("enable_progress_bar", True)))]
        self.trainer = instantiate(self.cfg.trainer, max_steps=max_steps,
                                   default_root_dir=str(self.output_dir),
                                   callbacks=callbacks, logger=self._loggers())
        self.global_batch = self.rc.prompts_per_step * self.rc.group_size // self.rc.minibatches
        ranks.check_parallel_run(self.trainer, backend=self.cfg.tq.backend,
                                 global_batch=self.global_batch,
                                 save_artifacts=self.rc.save_artifacts,
                                 topology=self.rc.topology)
        self.world_size = self.trainer.world_size
        # FSDP2 over several ranks: every forward of the models is a collective all ranks join.
        self.sharded = (self.world_size > 1
                        and type(self.trainer.strategy).__name__ == "ModelParallelStrategy")
        if self.world_size > 1 and self.engine_cfg.name == "vllm":
            raise EngineError("engine=vllm runs with one trainer process: use engine=hf or "
                              "engine=native with several ranks (trainer=ddp_cpu, fsdp_cpu)")
        # Every rank attaches to one store: started here, before the ranks exist, when the
        # config names no cluster (see tq_plugin.rl.ranks).
        self.cluster_address = (ranks.share_store_across_ranks(self.cfg.tq.backend)
                                if self.world_size > 1 else None)
        shared = ranks.rank_shared_store(self.cfg.tq.backend)
        if self.world_size > 1:
            rank_zero_info(
                f"[tq_plugin] {self.world_size} DDP ranks: "
                + ("rank 0 generates each step into the shared store" if shared else
                   "every rank replays each step's rollouts into its embedded store")
                + "; each rank trains on a length-balanced shard of the global batch")
        self.datamodule = MetaDataModule(
            self.prepare_step,
            num_steps=self.rc.num_steps, fields=self.module.train_fields, task_name="train",
            role="policy", epochs_per_step=self.rc.ppo_epochs,
            global_batch_size=self.global_batch,
            micro_batch_size=self.packing.micro_batch_size,
            rows="shared" if shared else "local",
            # The disaggregated step's no-grad passes of a sharded model need every rank.
            source_on_every_rank=self.sharded and self.disaggregated is not None,
        )
        self.replicated = not shared and self.world_size > 1

    def _train_store(self) -> Any:
        """The store the steps' training rows live in: the ``DataPlaneCallback``'s client, which
        it builds in its ``setup`` on every rank. ``tq.backend``, except for one disaggregated
        trainer process: its rows stay in an embedded store of its own (one hop from the
        workers' shared store). A bound method, so it pickles for ``ddp_spawn``."""
        if self.disaggregated is not None and self.world_size == 1:
            return LocalDataPlane()
        return instantiate(self.cfg.tq.backend)

    def _loggers(self) -> list[Any] | bool:
        """The ``logger`` group's loggers (``False``: none)."""
        if self.cfg.trainer.get("logger") is False:
            return False
        return instantiate_loggers(self.cfg.get("logger")) or False

    def _setup_data_path(self) -> None:
        """Staging sink, rollout worker and reassembler, on the client the callback built."""
        client = self.module.dp_client
        self.sink = instantiate(self.cfg.tq.staging)(client)
        self.worker = RolloutWorker(task=self.task, sink=self.sink, temperature=self.rc.temperature,
                                    max_new_tokens=self.rc.max_new_tokens,
                                    stop_token_id=self.task.eos_token_id,
                                    allowed_token_ids=self.task.output_token_ids)
        if self.engine is None:
            self.engine = self._build_engine()
        self.reassembler = RolloutReassembler(client, staging_partition=self.sink.staging_partition,
                                              capture_media=self.media,
                                              pad_token_id=self.task.pad_token_id,
                                              clear_staged=True)

    # ------------------------------------------------------------------ one RL step
    def prepare_step(self, step: int, client: Any = None) -> KVBatchMeta:
        """Rollouts → staged calls → verified training rows → logprobs, values, advantages.

        The step source of the ``MetaDataModule`` (a bound method, so it pickles for
        ``ddp_spawn``). Returns the step meta, or under DDP on the embedded store this rank's
        shard of it.
        """
        if getattr(self, "disaggregated", None) is not None:
            return self.disaggregated.prepare_step(step)
        if self.worker is None:
            self._setup_data_path()
        m = self.module
        self._sync_engine(step)
        evaluated = self._evaluate() if self.rc.eval_every and step % self.rc.eval_every == 0 else {}
        t0 = time.perf_counter()
        batch = self.worker.run(self.engine, step=step, prompts=self.rc.prompts_per_step,
                                group_size=self.rc.group_size, generator=self.generator)
        t1 = time.perf_counter()
        meta = self.reassembler.finalize_group(batch.receipts, partition_id=self.rc.train_partition)
        m.write_to_dataplane(meta, {TURN_REWARDS: batch.turn_scores / self.task.turns})
        m.forward_pass(meta, role="policy", step=step)
        if self.ppo:
            m.forward_pass(meta, role="value", step=step)
        self._write_advantages(meta)
        actions, lp_gap = self._check_rows(meta)
        # Plain JSON values: DataPlaneCallback checkpoints the step meta (a resume reuses it).
        meta.extra_info[RL_STEP] = {
            # Loss normalizer: a global batch's action tokens (the same under every packing mode).
            "loss_norm": max(1, actions // self.rc.minibatches),
            "rewards": batch.rewards.tolist(), "turn_scores": batch.turn_scores.tolist(),
            "rollout_s": t1 - t0,
            "prepare_s": time.perf_counter() - t1, "failed_calls": batch.failed_calls,
            "lp_gap": lp_gap, **({EVAL: evaluated} if evaluated else {}),
        }
        if self.replicated:
            meta = ranks.replica_shard(meta, m.dp_client, strategy=self.trainer.strategy,
                                       global_batch=self.global_batch)
        return meta

    def _evaluate(self) -> dict[str, float]:
        """``recipe.eval_every``: the task's held-out prompts, greedy, on the engine's weights."""
        return evaluate(self.task, self.engine, max_new_tokens=self.rc.max_new_tokens)

    def _check_rows(self, meta: KVBatchMeta) -> tuple[int, float]:
        """``(action tokens, logprob gap)``. The gap is the largest difference between the
        engine's staged logprobs and the policy's recomputation over the training rows: the
        weights have not changed in between, so anything but ~0 means rows, masks or padding
        are misaligned somewhere between staging and the training partition."""
        return action_tokens_and_gap(self.module.read_from_dataplane(
            meta, select_fields=[TOKEN_MASK, SAMPLE_MASK, GENERATION_LOGPROBS, PREV_LOGPROBS]))

    def _write_advantages(self, meta: KVBatchMeta) -> None:
        fields = [TOKEN_MASK, SAMPLE_MASK, TOTAL_REWARD, TURN_REWARDS, INPUT_LENGTHS]
        if self.ppo:
            fields.append(VALUES)
        td = self.module.read_from_dataplane(meta, select_fields=fields)
        mask = td[TOKEN_MASK] * td[SAMPLE_MASK].unsqueeze(1)
        if self.ppo:
            rewards = turn_end_rewards(mask, td[TURN_REWARDS])
            adv, returns = gae(rewards, td[VALUES], mask, gamma=self.rc.gamma, lam=self.rc.gae_lambda)
            out = {ADVANTAGES: whiten(adv, mask), RETURNS: returns}
        else:
            per_row = group_relative(td[TOTAL_REWARD], self.rc.group_size)
            out = {ADVANTAGES: per_row.unsqueeze(1) * mask}
        self.module.write_to_dataplane(meta, out)

    # ------------------------------------------------------------------ train / cleanup
    def train(self) -> None:
        """Fit to ``recipe.num_steps``, from ``ckpt_path`` when the config names one.

        SIGTERM (``SigtermStop``: the ranks stop together after one microbatch) saves
        ``checkpoints/sigterm.ckpt`` and exits with status 143, never 0.
        """
        ckpt_path = self.cfg.get("ckpt_path")
        try:
            with ranks.exported_address(self.cluster_address):  # the ranks Lightning launches
                self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=ckpt_path)
        except SIGTERMException:
            log.error("SIGTERM: resume with ckpt_path=%s", self.sigterm_checkpoint)
            raise SystemExit(SIGTERM_EXIT) from None
        finally:
            self.close_engine()
        if self.cluster_address is not None:  # this process hosts the ranks' cluster
            ranks.wait_for_launched_ranks(self.trainer)

    def cleanup(self) -> dict[str, Any] | None:
        """The run's summary where rank 0's results are (rank 0, or the process that spawned
        the ranks, which reads ``result.json``); ``None`` on the other ranks."""
        if self.summary is not None or not self.trainer.is_global_zero:
            return self.summary
        return json.loads((self.output_dir / RESULT_FILE).read_text())

    def write_artifacts(self, trainer: Trainer, *, interrupted: bool = False) -> None:
        """Reduce every rank's step metrics; rank 0 writes metrics.csv, result.json, the plot.

        ``interrupted`` (SIGTERM, every rank at the same microbatch): the finished steps only,
        ``status: interrupted``.
        """
        total = self._dp_bytes()
        if interrupted:
            steps = self.step_callback.finished_steps()
        else:
            self.metrics.finish(self.cfg, total, save=False)  # closes this rank's last step
            steps = self.metrics.steps
        per_rank = ranks.gather_objects((steps, total), trainer.world_size)
        sharded = sharding.is_sharded(self.module.policy)
        if sharded and self.rc.save_artifacts and not interrupted:  # every rank joins the gathers
            sharding.save_final_full_weights(self.output_dir, policy=self.module.policy,
                                             value=self.module.value, rank=trainer.global_rank)
        evaluated = None
        if (self.rc.eval_every and not interrupted and self.engine is not None
                and (sharded or trainer.is_global_zero)):  # sharded: every rank's forwards
            self._sync_engine(self.rc.num_steps)  # the trained weights
            evaluated = self._evaluate()
        if not trainer.is_global_zero:
            return
        merged = ranks.merge_rank_steps([rank_steps for rank_steps, _ in per_rank])
        self.metrics.steps = self.step_callback.restored + merged
        summary = self.metrics.summary(sum(t for _, t in per_rank))
        summary["engine"] = self.engine_cfg.name
        if evaluated is not None:
            summary[EVAL] = evaluated
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{k}": v for k, v in summary[EVAL].items()},
                                   step=trainer.global_step)
        if self.weight_sync_s:
            summary["weight_syncs"] = len(self.weight_sync_s)
            summary["weight_sync_s_median"] = round(sorted(self.weight_sync_s)[
                len(self.weight_sync_s) // 2], 4)
        if interrupted:
            summary["status"] = "interrupted"
        else:
            self.summary = summary
        if self.rc.save_artifacts:
            self.metrics.write(self.cfg, summary)
            if not interrupted and not sharded:
                save_final_weights(self.output_dir, policy=self.module.policy,
                                   value=self.module.value)

    def _dp_bytes(self) -> int:
        counters = self.callback.client.snapshot() if self.callback.client is not None else None
        return 0 if counters is None else int(counters.bytes_read + counters.bytes_written)

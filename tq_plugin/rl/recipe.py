"""``RLRecipe``: PPO or GRPO on the synthetic pattern task, one Lightning fit over RL steps.

torchtune-style: one class, ``setup`` / ``train`` / ``cleanup``, private ``_setup_*`` helpers.
Each RL step comes from a step source (``tq_plugin.rl.topology``): ``Colocated`` generates the
step's rollouts in this process with the rollout engine (``engine=native|hf|vllm``), every call
staged through ``TQTokenSink``, then writes the verified rows, ``prev_logprobs``, values and
advantages through the data plane; ``Disaggregated`` claims rows that rollout workers generated
ahead. ``MetaDataModule`` cuts each step into microbatch metas under the configured packing, once
per ``ppo_epochs``; the module (``tq_plugin.rl.training.RLModule``) reads each microbatch's
columns through ``MetaBatchMixin``.

``DataPlaneCallback`` owns the client (built from ``tq.backend``), meters what crosses it and
clears each step's rows after its last microbatch. ``RLStepCallback`` carries each step's loss
normalizer and rollout metrics from the step meta to the module and the metrics on every rank,
reduces the metrics over ranks and writes the artifacts on rank 0; it checkpoints the rollout
generator and the finished steps' metrics, so ``ckpt_path=...`` resumes a run to
``recipe.num_steps``. SIGTERM saves ``checkpoints/sigterm.ckpt`` and exits with status 143.
``recipe.checkpoint_every=K`` also saves ``checkpoints/last.ckpt`` every K RL steps
(``PeriodicCheckpoint``): what a killed run resumes from.

The trained weights: ``policy.safetensors`` (and ``value.safetensors``) in the run dir; with
``model=hf_causal_lm`` also ``hf_policy/``, a ``save_pretrained`` directory with the task's
tokenizer that ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load as it is
(``recipe.save_hf_every=K``: ``checkpoints/hf-step-<n>/`` every K RL steps too).

Under DDP (``trainer=ddp_cpu``) each rank trains on its length-balanced shard of the same global
batch one process would train on; ``tq_plugin.rl.training.ranks`` says how the step is split per backend.
"""

from __future__ import annotations

import copy
import json
import logging
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from omegaconf import DictConfig, open_dict

from tq_plugin.config import ConfigError, PackingConfig, RecipeConfig, validate_config
from tq_plugin.config.schema import EngineConfig
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.instantiators import instantiate_callbacks, instantiate_loggers
from tq_plugin.rl.algorithms.registry import check_registered, import_user_modules
from tq_plugin.rl.models import fsdp as sharding
from tq_plugin.rl.models.lora import ADAPTER_DIR, peft_model_of, trainable_parameters
from tq_plugin.rl.models.protocol import check_models
from tq_plugin.rl.models.weights import (
    HF_POLICY_DIR,
    hf_backbone,
    save_final_full_weights,
    save_final_weights,
    write_adapter,
    write_hf_checkpoint,
)
from tq_plugin.rl.tasks.prompts import TaskState
from tq_plugin.rl.topology.build import build_model, build_task, engine_config
from tq_plugin.rl.topology.colocated import RolloutStream
from tq_plugin.rl.topology.sources import build_step_source
from tq_plugin.rl.training import console, ranks
from tq_plugin.rl.training.callbacks import (
    ContinueRun,
    PeriodicCheckpoint,
    RLStepCallback,
    SigtermStop,
    StepHooks,
)
from tq_plugin.rl.training.evaluation import EVAL, EvalLog
from tq_plugin.rl.training.metrics import RESULT_FILE
from tq_plugin.rl.training.module import RLModule
from tq_plugin.rollout import EngineError
from tq_plugin.rollout.engines import check_sampling
from tq_plugin.rollout.sampling import SamplingControls

log = logging.getLogger(__name__)
HF_MODEL_TARGET = "tq_plugin.rl.models.hf.HFCausalLM"
SIGTERM_EXIT = 128 + signal.SIGTERM


class RLRecipe:
    """PPO (``recipe.algorithm=ppo``: policy + value, GAE) or GRPO (policy only, group baselines)."""

    def __init__(self, cfg: DictConfig, output_dir: str | Path) -> None:
        typed = validate_config(cfg)
        self.output_dir = Path(output_dir)
        self.cfg = self._resolve_model_sizes(self._pin_logger_dirs(cfg))
        self.rc: RecipeConfig = typed["recipe"]
        # The user's own losses and advantage estimators register on import; then every name
        # the recipe selects must be registered (one line naming the registered ones).
        import_user_modules(self.rc.imports)
        check_registered(self.rc)
        self.engine_cfg: EngineConfig = typed.get("engine") or engine_config(cfg)
        self.packing: PackingConfig = instantiate(cfg.tq.packing)
        self.media = bool(cfg.tq.staging.capture_media)

    def _pin_logger_dirs(self, cfg: DictConfig) -> DictConfig:
        """A copy of ``cfg`` whose loggers write under this run's output dir: their
        ``${hydra:runtime.output_dir}`` cannot resolve where Hydra is not running (a
        ``ddp_spawn`` rank, a config composed in a test)."""
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            for node in (cfg.get("logger") or {}).values():
                if isinstance(node, DictConfig) and "save_dir" in node:
                    node.save_dir = str(self.output_dir)
            # Ray's workers' own output stays off the console unless verbose=true (it is in
            # Ray's session logs; the engines' records go to engines.log, see setup).
            ray_init = cfg.tq.backend.get("ray_init")
            if not cfg.get("verbose", False) and ray_init is not None:
                ray_init.setdefault("log_to_driver", False)
                ray_init.setdefault("logging_level", "warning")
        return cfg

    @staticmethod
    def _resolve_model_sizes(cfg: DictConfig) -> DictConfig:
        """``model=hf_causal_lm``: the sizes the config leaves unset, from the checkpoint
        (``model.pretrained_path``) or the group's defaults, written into ``cfg`` (the engines
        and the rollout workers read ``model.max_seq_len`` there); a contradiction is a
        ``ConfigError`` naming the key."""
        model = cfg.get("model")
        if model is None or model.get("_target_") != HF_MODEL_TARGET:
            return cfg
        from tq_plugin.rl.models.hf import DEFAULT_SIZES, resolve_sizes

        sizes = resolve_sizes(model.get("pretrained_path"),
                              **{k: model.get(k) for k in DEFAULT_SIZES})
        with open_dict(cfg):
            for key, value in sizes.items():
                cfg.model[key] = value
        return cfg

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        # MetaBatchMixin overrides the module's batch-transfer hooks on purpose.
        warnings.filterwarnings("ignore", message=r"You have overridden `(on_before_batch_transfer|"
                                r"transfer_batch_to_device)` in `LightningModule`")
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        if self.rc.num_threads:
            torch.set_num_threads(self.rc.num_threads)
        torch.manual_seed(self.rc.seed)
        rank_zero_only(print)(console.banner(
            run_dir=self.output_dir, recipe=self.rc.algorithm,
            model=self.cfg.model.get("name", "?"), engine=self.engine_cfg.name,
            backend=str(self.cfg.tq.backend._target_).rsplit(".", 1)[-1],
            topology=self.rc.topology, steps=self.rc.num_steps), flush=True)
        console.quiet_third_party_logs(self.output_dir, verbose=bool(self.cfg.get("verbose", False)))
        self.task = build_task(self.cfg)
        self.task.check_recipe(self.rc)  # a task may refuse settings it cannot train
        if self.rc.eval_every and not self.task.evaluates:  # it would log no eval at all
            raise ConfigError(
                f"recipe.eval_every: task={self.task.name} holds no held-out "
                f"prompts to evaluate: set task.eval_path (a file) or task.eval_size (rows held "
                f"out of task.path), or drop recipe.eval_every")
        # One rollout stream for the run, the same on every rank (see tq_plugin.rl.training.ranks).
        self.rollouts = RolloutStream(self.rc.seed)
        self.summary: dict[str, Any] | None = None
        # The topology: one step source, built by name (tq_plugin.rl.topology.source).
        self.source = build_step_source(self.cfg, rc=self.rc, task=self.task,
                                        output_dir=self.output_dir, rollouts=self.rollouts)
        self._setup_models()
        self._check_engine()
        self.metrics = self.source.metrics_type(self.output_dir, packing=self.packing.mode)
        self.metrics.live = bool(self.rc.save_artifacts)  # metrics.csv grows step by step
        self._setup_trainer()

    def _setup_models(self) -> None:
        max_len = self.task.max_sequence_length(self.rc.max_new_tokens)
        if max_len > self.cfg.model.max_seq_len:
            raise ConfigError(f"model.max_seq_len: {self.cfg.model.max_seq_len} is shorter than "
                              f"the task's longest episode ({max_len} tokens: the longest prompt "
                              f"and recipe.max_new_tokens per turn)")
        policy = build_model(self.cfg, self.task)
        value = build_model(self.cfg, self.task, value_head=True) if self.rc.algorithm == "ppo" else None
        check_models(policy, value, vocab_size=self.task.vocab_size, layout=self.packing.layout,
                     media=self.media)
        # The IS correction is on where the rows' generating policy is not the trained module:
        # older weights (an off-policy source's workers) and the hf/vllm engines (other kernels).
        off_policy = self.source.off_policy
        self.module = RLModule(policy=policy, value=value, recipe=self.rc, packing=self.packing,
                               media=self.media,
                               correct_is=off_policy or self.engine_cfg.name != "native",
                               on_policy=not off_policy)

    def _check_engine(self) -> None:
        """Refuse an engine that cannot serve this run, before anything starts (one
        ``EngineError`` naming ``engine`` and what to do)."""
        name = self.engine_cfg.name
        check_sampling(self.engine_cfg, SamplingControls.of(self.rc))
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

    def _setup_trainer(self) -> None:
        self.callback = DataPlaneCallback(  # the store is chosen once the world size is known
            self._train_store, role="policy",
            partitions=[{"partition_id": self.rc.train_partition, "fields": []}],
        )
        self.step_callback = RLStepCallback(metrics=self.metrics, rollouts=self.rollouts,
                                            dp_callback=self.callback,
                                            write_artifacts=self.write_artifacts)
        self.sigterm_checkpoint = self.output_dir / "checkpoints" / "sigterm.ckpt"
        max_steps = self.rc.num_steps * self.rc.ppo_epochs * self.rc.minibatches
        self.sigterm = SigtermStop(self.sigterm_checkpoint)
        self.periodic = PeriodicCheckpoint(self.sigterm_checkpoint.parent,
                                           self.rc.checkpoint_every or 0)
        self.source.attach(module=self.module, metrics=self.metrics, dp_callback=self.callback,
                           sigterm=self.sigterm)
        self.step_hooks = StepHooks(metrics=self.metrics, periodic=self.periodic,
                                    sigterm=self.sigterm, save_hf_every=self.rc.save_hf_every,
                                    save_hf=self.save_hf_policy,
                                    checkpoints_dir=self.output_dir / "checkpoints")
        # The task's own state (task=prompts: its dataset cursor) rides the checkpoint too,
        # unless the step source keeps its own (the disaggregated ledger's prompt-stream slots).
        own = ([TaskState(self.task)]
               if self.task.stateful and self.source.checkpoints_task else [])
        # The bar in a terminal, one plain line per step elsewhere (console.py): never both.
        self.terminal = console.is_terminal()
        bar = bool(self.cfg.trainer.get("enable_progress_bar", True)) and self.terminal
        console.route_step_lines(terminal=bar)
        self.continue_run = ContinueRun(num_steps=self.rc.num_steps, dp_callback=self.callback,
                                        finish=self.write_artifacts)
        callbacks = [self.callback, self.step_callback, self.sigterm, *own, EvalLog(),
                     self.continue_run,
                     console.StepLines(self.rc.num_steps, self.rc.log_every),
                     *self.source.callbacks(), *instantiate_callbacks(
                         self.cfg.get("callbacks"), progress_bar=bar),
                     # last: after every other callback, as the module's own hook was
                     self.step_hooks]
        for key, instead in (("gradient_clip_val", "recipe.max_grad_norm"),
                             ("gradient_clip_algorithm", "recipe.max_grad_norm (a norm clip)")):
            if self.cfg.trainer.get(key) is not None:
                raise ConfigError(f"trainer.{key}: the RL module clips its gradients itself; "
                                  f"set {instead} instead")
        self.trainer = instantiate(self.cfg.trainer, max_steps=max_steps,
                                   default_root_dir=str(self.output_dir), callbacks=callbacks,
                                   logger=self._loggers(), enable_progress_bar=bar)
        self.global_batch = self.rc.prompts_per_step * self.rc.group_size // self.rc.minibatches
        ranks.check_parallel_run(self.trainer, backend=self.cfg.tq.backend,
                                 global_batch=self.global_batch,
                                 save_artifacts=self.rc.save_artifacts,
                                 workers_generate=self.source.off_policy)
        self.world_size = self.trainer.world_size
        self.sharded = ranks.is_sharded_run(self.trainer)
        if self.world_size > 1 and self.engine_cfg.name == "vllm":
            raise EngineError("engine=vllm runs with one trainer process: use engine=hf or "
                              "engine=native with several ranks (trainer=ddp_cpu, fsdp_cpu)")
        # Every rank attaches to one store: started here, before the ranks exist, when the
        # config names no cluster (see tq_plugin.rl.training.ranks).
        self.cluster_address = (ranks.share_store_across_ranks(self.cfg.tq.backend)
                                if self.world_size > 1 else None)
        shared = ranks.rank_shared_store(self.cfg.tq.backend)
        if self.world_size > 1:
            rank_zero_info(
                f"[tq_plugin] {self.world_size} DDP ranks: "
                + ("rank 0 generates each step into the shared store" if shared else
                   "every rank replays each step's rollouts into its embedded store")
                + "; each rank trains on a length-balanced shard of the global batch")
        self.replicated = not shared and self.world_size > 1
        self.source.bind(world_size=self.world_size, replicated=self.replicated,
                         global_batch=self.global_batch, sharded=self.sharded)
        self.datamodule = MetaDataModule(
            self.source.prepare_step,
            num_steps=self.rc.num_steps, fields=self.module.train_fields, task_name="train",
            role="policy", epochs_per_step=self.rc.ppo_epochs,
            global_batch_size=self.global_batch,
            micro_batch_size=self.packing.micro_batch_size,
            rows="shared" if shared else "local",
            source_on_every_rank=self.source.every_rank(),
        )

    def _train_store(self) -> Any:
        """The store the steps' training rows live in: the ``DataPlaneCallback``'s client, which
        it builds in its ``setup`` on every rank. ``tq.backend``, unless the step source keeps
        them in a store of its own (one disaggregated trainer process: an embedded store, one
        hop from the workers' shared store). A bound method, so it pickles for ``ddp_spawn``."""
        own = self.source.own_store()
        return own if own is not None else instantiate(self.cfg.tq.backend)

    def _loggers(self) -> list[Any] | bool:
        """The ``logger`` group's loggers (``False``: none)."""
        if self.cfg.trainer.get("logger") is False:
            return False
        return instantiate_loggers(self.cfg.get("logger")) or False

    def close_engine(self) -> None:
        """Release what the step source started (idempotent); cleanup and a failed fit call
        it."""
        source = getattr(self, "source", None)
        if source is not None:
            source.close()

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
            save_final_full_weights(self.output_dir, policy=self.module.policy,
                                    value=self.module.value, rank=trainer.global_rank)
            self.save_hf_policy(self.output_dir / HF_POLICY_DIR)
            self.save_adapter(trainer.global_rank)
        evaluated = None
        if self.rc.eval_every and not interrupted:  # sharded: every rank's forwards
            evaluated = self.source.final_evaluation(trainer)
        if not trainer.is_global_zero:
            return
        merged = ranks.merge_rank_steps([rank_steps for rank_steps, _ in per_rank])
        self.metrics.steps = self.step_callback.restored + merged
        summary = self.metrics.summary(sum(t for _, t in per_rank))
        summary["engine"] = self.engine_cfg.name
        summary["trainable_parameters"] = trainable_parameters(self.module.policy,
                                                               self.module.value)
        opening = {k[len("eval/"):]: v for k, v in
                   (self.metrics.steps[0].figures if self.metrics.steps else {}).items()
                   if k.startswith("eval/")}
        if opening:  # the first step's evaluation: the starting weights' held-out figures
            summary["eval_first"] = opening
        if evaluated:
            summary[EVAL] = evaluated
            # The trained weights' evaluation closes the last step's row of metrics.csv (the
            # plot's last eval point), as the step-0 one opens the first.
            if self.metrics.steps:
                self.metrics.steps[-1].figures.update(
                    {f"eval/{k}": float(v) for k, v in evaluated.items()})
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{k}": v for k, v in summary[EVAL].items()},
                                   step=trainer.global_step)
        summary.update(self.source.summary())
        if interrupted:
            summary["status"] = "interrupted"
        else:
            self.summary = summary
        if self.rc.save_artifacts:
            self.metrics.write(self.cfg, summary)
            if not interrupted and not sharded:
                save_final_weights(self.output_dir, policy=self.module.policy,
                                   value=self.module.value)
                self.save_hf_policy(self.output_dir / HF_POLICY_DIR)
                self.save_adapter(trainer.global_rank)

    def save_adapter(self, rank: int) -> None:
        """A LoRA policy's adapter as the run dir's PEFT directory (``adapter/``; a sharded
        policy's gathered, every rank joining); nothing for full fine-tuning."""
        if peft_model_of(self.module.policy) is not None:
            write_adapter(self.module.policy, self.output_dir / ADAPTER_DIR, rank=rank)

    def save_hf_policy(self, directory: Path) -> Path | None:
        """An HF-format policy as a ``save_pretrained`` directory with the task's tokenizer
        (``write_hf_checkpoint``; every rank calls it, a sharded policy's ranks join the
        gathers, rank 0 writes); ``None`` for another model."""
        if hf_backbone(self.module.policy) is None:
            return None
        return write_hf_checkpoint(self.module.policy, directory,
                                   rank=self.module.trainer.global_rank,
                                   tokenizer=getattr(self.task, "tokenizer", None))

    def _dp_bytes(self) -> int:
        counters = self.callback.client.snapshot() if self.callback.client is not None else None
        return 0 if counters is None else int(counters.bytes_read + counters.bytes_written)

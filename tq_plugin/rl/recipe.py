"""``RLRecipe``: PPO or GRPO on the synthetic pattern task, one Lightning fit over RL steps.

torchtune-style: one class, ``setup`` / ``train`` / ``cleanup``, private ``_setup_*`` helpers.
Each RL step (``prepare_step``), inside the fit's dataloader:

1. the policy generates multi-turn rollouts, every call staged through ``TQTokenSink``;
2. ``RolloutReassembler.finalize_group`` verifies the staged calls against the receipts and
   writes the training rows (``first_write``) into the train partition, returning the meta;
3. per-turn rewards, ``prev_logprobs`` (policy) and ``values`` (PPO's value model) are written
   back through the data plane; advantages are computed from columns read back and written too;
4. ``MetaDataModule`` cuts the step into microbatch metas under the configured packing, once
   per ``ppo_epochs``; the module reads each microbatch's columns through ``MetaBatchMixin``.

``DataPlaneCallback`` owns the client (built from ``tq.backend``), meters what crosses it and
clears each step's rows after its last microbatch.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from tq_plugin.config import PackingConfig, RecipeConfig, validate_config
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
)
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule
from tq_plugin.rl.advantages import gae, group_relative, turn_end_rewards, whiten
from tq_plugin.rl.metrics import MetricsLog
from tq_plugin.rl.module import RLModule
from tq_plugin.rl.rollout import RolloutWorker
from tq_plugin.rl.task import IMG, PAD
from tq_plugin.staging import RolloutReassembler

log = logging.getLogger(__name__)
TURN_REWARDS = "turn_rewards"


class RLRecipe:
    """PPO (``recipe.algorithm=ppo``: policy + value, GAE) or GRPO (policy only, group baselines)."""

    def __init__(self, cfg: DictConfig, output_dir: str | Path) -> None:
        typed = validate_config(cfg)
        self.cfg = cfg
        self.rc: RecipeConfig = typed["recipe"]
        self.packing: PackingConfig = instantiate(cfg.tq.packing)
        self.media = bool(cfg.tq.staging.capture_media)
        self.output_dir = Path(output_dir)
        self.ppo = self.rc.algorithm == "ppo"

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
        self._setup_models()
        self._setup_trainer()
        self.metrics = MetricsLog(self.output_dir, packing=self.packing.mode)
        self.module.step_hook = self.metrics.on_microbatch
        self.sink = self.reassembler = self.worker = None

    def _setup_models(self) -> None:
        max_len = self.task.max_sequence_length(self.rc.max_new_tokens)
        common = {"vocab_size": self.task.vocab_size, "image_token_id": IMG,
                  "patch_dim": self.task.patch_dim if self.media else None}
        if max_len > self.cfg.model.max_seq_len:
            raise ValueError(f"model.max_seq_len={self.cfg.model.max_seq_len} is shorter than the "
                             f"task's longest episode ({max_len} tokens)")
        policy = instantiate(self.cfg.model, output_token_ids=self.task.output_token_ids, **common)
        value = instantiate(self.cfg.model, value_head=True, **common) if self.ppo else None
        self.module = RLModule(policy=policy, value=value, recipe=self.rc, packing=self.packing,
                               media=self.media)

    def _setup_trainer(self) -> None:
        self.callback = DataPlaneCallback(
            self.cfg.tq.backend, role="policy",
            partitions=[{"partition_id": self.rc.train_partition, "fields": []}],
        )
        max_steps = self.rc.num_steps * self.rc.ppo_epochs * self.rc.minibatches
        extra = {}
        if self.cfg.trainer.get("logger") is True:  # CSV under the output dir, no tensorboard needed
            from lightning.pytorch.loggers import CSVLogger

            extra["logger"] = CSVLogger(str(self.output_dir), name="lightning_logs")
        self.trainer = instantiate(self.cfg.trainer, max_steps=max_steps,
                                   default_root_dir=str(self.output_dir),
                                   callbacks=[self.callback], **extra)
        self.datamodule = MetaDataModule(
            lambda step, client: self.prepare_step(step),
            num_steps=self.rc.num_steps, fields=self.module.train_fields, task_name="train",
            role="policy", epochs_per_step=self.rc.ppo_epochs,
            global_batch_size=self.rc.prompts_per_step * self.rc.group_size // self.rc.minibatches,
            micro_batch_size=self.packing.micro_batch_size,
        )

    def _setup_data_path(self) -> None:
        """Staging sink, rollout worker and reassembler, on the client the callback built."""
        client = self.module.dp_client
        # Under DDP every rank generates its own rollouts: give each rank its own stream.
        self.generator = torch.Generator().manual_seed(self.rc.seed + 1009 * self.trainer.global_rank)
        self.sink = instantiate(self.cfg.tq.staging)(client)
        self.worker = RolloutWorker(task=self.task, sink=self.sink, temperature=self.rc.temperature,
                                    max_new_tokens=self.rc.max_new_tokens)
        self.reassembler = RolloutReassembler(client, staging_partition=self.sink.staging_partition,
                                              capture_media=self.media, pad_token_id=PAD,
                                              clear_staged=True)

    # ------------------------------------------------------------------ one RL step
    def prepare_step(self, step: int) -> KVBatchMeta:
        """Rollouts → staged calls → verified training rows → logprobs, values, advantages."""
        if self.worker is None:
            self._setup_data_path()
        m = self.module
        t0 = time.perf_counter()
        batch = self.worker.run(m.policy, step=step, prompts=self.rc.prompts_per_step,
                                group_size=self.rc.group_size, generator=self.generator)
        t1 = time.perf_counter()
        m.current_reward = float(batch.rewards.mean())
        meta = self.reassembler.finalize_group(batch.receipts, partition_id=self.rc.train_partition)
        m.write_to_dataplane(meta, {TURN_REWARDS: batch.turn_scores / self.task.turns})
        m.forward_pass(meta, role="policy", step=step)
        if self.ppo:
            m.forward_pass(meta, role="value", step=step)
        self._write_advantages(meta)
        actions, lp_gap = self._check_rows(meta)
        # Loss normalizer: a global batch's action tokens (the same under every packing mode).
        m.loss_norm = max(1, actions // self.rc.minibatches)
        self.metrics.on_step_ready(step, rewards=batch.rewards, turn_scores=batch.turn_scores,
                                   rollout_s=t1 - t0, prepare_s=time.perf_counter() - t1,
                                   failed_calls=batch.failed_calls, lp_gap=lp_gap,
                                   dp=m.dp_client.snapshot() if hasattr(m.dp_client, "snapshot") else None)
        return meta

    def _check_rows(self, meta: KVBatchMeta) -> tuple[int, float]:
        """``(action tokens, logprob gap)``. The gap is the largest difference between the
        engine's staged logprobs and the policy's recomputation over the training rows: the
        weights have not changed in between, so anything but ~0 means rows, masks or padding
        are misaligned somewhere between staging and the training partition."""
        td = self.module.read_from_dataplane(
            meta, select_fields=[TOKEN_MASK, SAMPLE_MASK, GENERATION_LOGPROBS, PREV_LOGPROBS])
        mask = (td[TOKEN_MASK] > 0) & (td[SAMPLE_MASK] > 0).unsqueeze(1)
        gap = ((td[GENERATION_LOGPROBS] - td[PREV_LOGPROBS]).abs() * mask).max()
        return int(mask.sum()), float(gap)

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
        self.trainer.fit(self.module, datamodule=self.datamodule)

    def cleanup(self) -> dict[str, Any]:
        """Write the artifacts and return the run's summary."""
        counters = self.callback.client.snapshot() if self.callback.client is not None else None
        total = 0 if counters is None else int(counters.bytes_read + counters.bytes_written)
        return self.metrics.finish(self.cfg, total, save=self.rc.save_artifacts)

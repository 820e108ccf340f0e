"""The LightningModule the PPO and GRPO recipes train: policy (+ value) over data-plane metas.

``MetaBatchMixin`` turns each microbatch meta the dataloader yields into tensors in the configured
layout (``padded`` to the step's pad target, ``padded`` to the microbatch's own length under
dynamic batching, or one ``packed`` row with ``position_ids``/``segment_ids``); ``TQDriverMixin``
supplies the pad-target minting and the column reads/writes of the pre-training passes.

Optimization is manual: a global batch may be cut into a different number of microbatches
under each packing mode, so every microbatch's loss is a token *sum* divided by the global
batch's action-token count, gradients accumulate, and the optimizer steps on the global batch's
last microbatch. The update is therefore the same whatever the packing; only its cost changes.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

from tq_plugin.config import PackingConfig, RecipeConfig
from tq_plugin.data_plane import (
    ADVANTAGES,
    INPUT_IDS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    RETURNS,
    SAMPLE_MASK,
    TOKEN_MASK,
    VALUES,
    KVBatchMeta,
    read_columns,
)
from tq_plugin.lightning.driver import TQDriverMixin
from tq_plugin.lightning.layout import POSITION_IDS, SEGMENT_IDS
from tq_plugin.lightning.module import MICROBATCH_INFO, MetaBatchMixin
from tq_plugin.lightning.plan import plan_step
from tq_plugin.rl.metrics import add_stats, rl_metrics
from tq_plugin.rl.model import TinyTransformer, entropy, shift_values, token_logprobs
from tq_plugin.staging import MEDIA_IMGS_FIELD

POLICY_TRAIN_FIELDS = [INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK, PREV_LOGPROBS, ADVANTAGES]
VALUE_TRAIN_FIELDS = [VALUES, RETURNS]


class RLModule(MetaBatchMixin, TQDriverMixin, pl.LightningModule):
    def __init__(
        self,
        *,
        policy: TinyTransformer,
        value: TinyTransformer | None,
        recipe: RecipeConfig,
        packing: PackingConfig,
        media: bool = False,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.value = value
        self.rc = recipe
        self.media = media
        self.cfg = packing.model_cfg()
        self.configure_packing(**packing.host_attributes())
        self.dp_layout = packing.layout
        self.dp_pad_to = "microbatch" if packing.use_dynamic_batches else "target"
        # What a training microbatch reads; other passes read what their meta names.
        self.train_fields = POLICY_TRAIN_FIELDS + (VALUE_TRAIN_FIELDS if value is not None else [])
        self.automatic_optimization = False
        self.step_hook: Any = None  # called with (meta, stats) after each microbatch
        self.train_seconds = 0.0
        # Per RL step, keyed by step: the dataloader prepares step s + 1 (and the recipe sets
        # its normalizer and reward) before step s's last microbatch has trained.
        self._loss_norms: dict[int, float] = {}
        self._rewards: dict[int, float] = {}
        self._preparing: int | None = None
        self._pending_reward = 0.0
        self._gb_stats: dict[str, float] = {}

    # The recipe sets both while it prepares a step (reward first, the normalizer after the
    # step's forward passes): they are recorded against that step, not "the latest" one.
    @property
    def loss_norm(self) -> float:
        """Action tokens of one global batch of the step being prepared (the loss normalizer)."""
        return self._loss_norms.get(self._preparing, 1.0)

    @loss_norm.setter
    def loss_norm(self, value: float) -> None:
        self._loss_norms[self._preparing] = float(value)

    @property
    def current_reward(self) -> float:
        """The mean rollout reward of the step being prepared (logged as ``rl/reward``)."""
        return self._rewards.get(self._preparing, self._pending_reward)

    @current_reward.setter
    def current_reward(self, value: float) -> None:
        self._pending_reward = float(value)

    def _begin_step(self, step: int) -> None:
        if self._preparing != step:
            self._preparing = step
            self._rewards[step] = self._pending_reward
            for old in [k for k in self._rewards if k < step - 2]:
                self._rewards.pop(old, None)
                self._loss_norms.pop(old, None)

    # ------------------------------------------------------------------ model inputs
    def _inputs(self, td: Any, meta: KVBatchMeta) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if POSITION_IDS in td.keys():  # noqa: SIM118  (a TensorDict has no `in`)
            kwargs = {"position_ids": td[POSITION_IDS], "segment_ids": td[SEGMENT_IDS]}
        if self.media:
            kwargs["image_patches"] = self.read_patches(meta).to(self.device)
        return kwargs

    def read_patches(self, meta: KVBatchMeta) -> torch.Tensor:
        """The rows' staged pixel patches, concatenated in row order (one per image token)."""
        td = read_columns(self.dp_client, meta, [MEDIA_IMGS_FIELD], layout="jagged")
        imgs = td[MEDIA_IMGS_FIELD]
        return imgs.values() if imgs.is_nested else imgs.reshape(-1, imgs.shape[-1])

    # ------------------------------------------------------------------ pre-training passes
    @torch.no_grad()
    def forward_pass(self, meta: KVBatchMeta, *, role: str, step: int) -> None:
        """One no-grad pass over the step, written back through the data plane.

        ``role="policy"`` writes ``prev_logprobs``, ``role="value"`` writes ``values``. The pass
        runs on its own isolated meta (so the value model's pad target never comes from the
        policy's dispatch), in microbatches under the ``logprob_mb_tokens`` budget and in the
        training layout; each microbatch's output goes back as rows (``dp_rows``).
        """
        self._begin_step(step)
        model, field = (self.policy, PREV_LOGPROBS) if role == "policy" else (self.value, VALUES)
        task = "prev_lp" if role == "policy" else "value_fwd"
        was_training = model.training
        model.eval()
        for mb in plan_step(meta, host=self, fields=[INPUT_IDS, INPUT_LENGTHS], task_name=task,
                            step=step, mb_tokens_key="logprob_mb_tokens",
                            micro_batch_size=self.cfg["train_micro_batch_size"]):
            if not mb.size:
                continue
            td = self.dp_materialize(mb)
            ids = td[INPUT_IDS]
            out = model(ids, **self._inputs(td, mb))
            out = token_logprobs(out, ids, self.rc.temperature) if role == "policy" else shift_values(out)
            self.write_to_dataplane(mb, {field: self.dp_rows(out)})
        model.train(was_training)

    # ------------------------------------------------------------------ training
    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [{"params": self.policy.parameters(), "lr": self.rc.lr}]
        if self.value is not None:
            groups.append({"params": self.value.parameters(), "lr": self.rc.value_lr})
        return torch.optim.Adam(groups)

    def training_step(self, td: Any, batch_idx: int) -> dict[str, Any]:
        start = time.perf_counter()
        meta = self.dp_meta
        info = meta.extra_info[MICROBATCH_INFO]
        step = int(info["step"])
        norm = self._loss_norms.get(step, 1.0)
        mask = td[TOKEN_MASK].float()
        mask = mask * self._row_values(td[SAMPLE_MASK], mask)
        ids = td[INPUT_IDS]
        inputs = self._inputs(td, meta)
        logits = self.policy(ids, **inputs)
        lp = token_logprobs(logits, ids, self.rc.temperature)
        old = td[PREV_LOGPROBS]
        adv = td[ADVANTAGES]
        log_ratio = torch.where(mask > 0, lp - old, torch.zeros_like(lp))
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1.0 - self.rc.clip_eps, 1.0 + self.rc.clip_eps)
        pg = -torch.minimum(ratio * adv, clipped * adv)
        loss = (pg * mask).sum() / norm
        ent = entropy(logits) * mask
        if self.rc.entropy_coef:
            loss = loss - self.rc.entropy_coef * ent.sum() / norm
        with torch.no_grad():
            stats = {
                "clipped_tokens": float((((ratio - 1.0).abs() > self.rc.clip_eps).float() * mask).sum()),
                "action_tokens": float(mask.sum()),
                "kl_sum": float(((ratio - 1.0 - log_ratio) * mask).sum()),
                "entropy_sum": float(ent.detach().sum()),
            }
        if self.value is not None:
            v = shift_values(self.value(ids, **inputs))
            old_v, ret = td[VALUES], td[RETURNS]
            v_clip = old_v + (v - old_v).clamp(-self.rc.value_clip_eps, self.rc.value_clip_eps)
            v_loss = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
            v_loss = (v_loss * mask).sum() / norm
            loss = loss + self.rc.vf_coef * v_loss
            stats["value_loss"] = float(v_loss.detach())
        self.manual_backward(loss)
        if info["last_in_global_batch"]:
            opt = self.optimizers()
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        elapsed = time.perf_counter() - start + self.dp_batch_stats.get("layout_s", 0.0)
        self.train_seconds += elapsed
        stats.update(loss=float(loss.detach()), seconds=elapsed, **self.dp_batch_stats)
        if self.step_hook is not None:
            self.step_hook(meta, stats)
        self._log_global_batch(info, stats, batch_size=max(meta.size, 1))
        return {"loss": loss.detach()}

    def _log_global_batch(self, info: dict[str, Any], stats: dict[str, float],
                          batch_size: int) -> None:
        """``rl/*`` through ``self.log``, once per global batch (one optimizer step), so every
        configured Lightning logger receives the same figures the recipe's CSV holds."""
        add_stats(self._gb_stats, stats)
        if not info["last_in_global_batch"]:
            return
        figures = rl_metrics(self._gb_stats, 1)
        self._gb_stats = {}
        if self.value is None:
            figures.pop("value_loss")
        step = int(info["step"])
        logged = {f"rl/{k}": v for k, v in figures.items()}
        logged["rl/step"] = float(step)
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=batch_size)
        self.log_dict({"rl/reward": self._rewards.get(step, self._pending_reward)},
                      prog_bar=True, on_step=True, on_epoch=False, batch_size=batch_size)

    @staticmethod
    def _row_values(per_row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A per-row ``[B]`` column broadcast over tokens of a padded ``[B, S]`` or packed row."""
        if like.shape[0] == per_row.shape[0]:
            return per_row.float().unsqueeze(1)
        return torch.ones_like(like)  # packed: placeholder rows carry token_mask 0 already

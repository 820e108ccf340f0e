"""The LightningModule the PPO and GRPO recipes train: policy (+ value) over data-plane metas.

``MetaBatchMixin`` turns each microbatch meta the dataloader yields into tensors in the configured
layout (``padded`` to the step's pad target, ``padded`` to the microbatch's own length under
dynamic batching, or one ``packed`` row with ``position_ids``/``segment_ids``); ``TQDriverMixin``
supplies the pad-target minting and the column reads/writes of the pre-training passes.

A global batch may be cut into a different number of microbatches under each packing mode, so
every microbatch's loss is a *sum* divided by its global batch's normaliser, computed when the
step was prepared (the step record's ``loss_norm``: action tokens, sequences or sequences x the
longest completion, by ``recipe.loss_type``), and ``MetaBatchMixin`` accumulates gradients over
the global batch's microbatches (automatic optimization, one optimizer step per global batch).
The update is therefore the same whatever the packing; only its cost changes (``bnpo``, TRL's
per-batch token mean, is the one type that depends on the cut, as it does in TRL).

The loss is :func:`tq_plugin.rl.algorithms.losses.policy_objective`: ``recipe.loss_type``'s
per-token terms (weighted by the importance-sampling correction where ``correct_is``:
disaggregated workers' older weights, an engine's other kernels), plus ``beta`` times the KL to
the frozen reference (``recipe.beta > 0``: ``reference_policy_logprobs``, written by the no-grad pass); then
PPO's clipped value loss (a token mean) and the entropy bonus. ``clipfrac`` counts the action
tokens whose ratio the clamp changed, ``clip_low`` / ``clip_high`` those whose gradient either
clip took, ``approx_kl`` is the mean of ``r - 1 - log r``, ``kl_ref`` the mean reference KL.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from tq_plugin.config import ConfigError, PackingConfig, RecipeConfig
from tq_plugin.data_plane import (
    ADVANTAGES,
    GENERATION_LOGPROBS,
    INPUT_IDS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    RETURNS,
    SAMPLE_MASK,
    TOKEN_MASK,
    TOTAL_REWARD,
    VALUES,
    KVBatchMeta,
    read_columns,
)
from tq_plugin.lightning.driver import TQDriverMixin
from tq_plugin.lightning.layout import POSITION_IDS, SEGMENT_IDS
from tq_plugin.lightning.module import MICROBATCH_INFO, MetaBatchMixin
from tq_plugin.lightning.plan import plan_step
from tq_plugin.rl.algorithms.advantages import compute_advantages
from tq_plugin.rl.algorithms.losses import (
    aggregate_loss,
    approx_kl,
    clipped_value_loss,
    drop_outside_kept,
    is_correction_weights,
    policy_objective,
)
from tq_plugin.rl.algorithms.registry import advantage_estimator_name
from tq_plugin.rl.models.fsdp import shard_model
from tq_plugin.rl.models.lora import adapter_disabled, peft_model_of
from tq_plugin.rl.models.protocol import TokenScoring, score_tokens
from tq_plugin.rl.models.tiny import TinyTransformer, shift_values
from tq_plugin.rl.models.weights import hf_backbone, load_weights
from tq_plugin.rl.training.evaluation import EVAL
from tq_plugin.rl.training.metrics import (
    add_is_stats,
    add_stats,
    is_metrics,
    peak_memory_mb,
    rl_metrics,
    warn_if_unsynced,
)
from tq_plugin.rl.training.optim import build_optimizer, build_scheduler, grad_norm_value
from tq_plugin.rl.training.ranks import reduce_over_ranks
from tq_plugin.rl.training.step_record import (
    RL_STEP,
    STEP_FIGURES,
    TURN_REWARDS,
    record_loss_norm,
)
from tq_plugin.rollout.engines.native import device_of
from tq_plugin.rollout.sampling import SamplingControls
from tq_plugin.staging import MEDIA_IMGS_FIELD

POLICY_TRAIN_FIELDS = [INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK, PREV_LOGPROBS, ADVANTAGES,
                       GENERATION_LOGPROBS]
VALUE_TRAIN_FIELDS = [VALUES, RETURNS]


def build_reference(policy: torch.nn.Module, recipe: RecipeConfig) -> torch.nn.Module | None:
    """The frozen reference policy of ``recipe.beta > 0``: a copy of the initial ``policy``, or
    with ``recipe.reference_path`` that copy loaded with its weights (a ``policy.safetensors``
    an earlier run wrote, or an HF checkpoint directory for ``model=hf_causal_lm``). A policy
    with LoRA adapters has none: its reference is its own base, the adapters switched off for
    the reference's pass (no second copy of the weights)."""
    path = recipe.reference_path
    if peft_model_of(policy) is not None:
        if path is not None:
            raise ConfigError(f"recipe.reference_path: {path} cannot be the reference of a LoRA "
                              f"policy (model.lora.r is set), whose reference is its base model "
                              f"with the adapter disabled; drop one of them")
        return None
    reference = copy.deepcopy(policy)
    if path is not None:
        p = Path(path)
        if p.is_file():
            load_weights(reference, p)
        elif p.is_dir() and hf_backbone(reference) is not None:
            import transformers

            loaded = transformers.AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True)
            hf_backbone(reference).load_state_dict(loaded.state_dict())
        else:
            raise ConfigError(f"recipe.reference_path: {path} must be a policy.safetensors file, or "
                              f"with model=hf_causal_lm an HF checkpoint directory")
    return reference.requires_grad_(False)  # forward_pass puts it in eval mode for its pass


class RLModule(MetaBatchMixin, TQDriverMixin, pl.LightningModule):
    def __init__(
        self,
        *,
        policy: TinyTransformer,
        value: TinyTransformer | None,
        recipe: RecipeConfig,
        packing: PackingConfig,
        media: bool = False,
        correct_is: bool = False,
        on_policy: bool = True,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.value = value
        self.rc = recipe
        self.media = media
        # Whether recipe.is_correction weights the policy loss: the recipe turns it on where
        # the rows' generating policy is not the trained module (an off-policy step source's
        # older weights, the hf and vllm engines' other kernels).
        self.is_mode = recipe.is_correction.mode if correct_is else "none"
        # On-policy rows (the step source generates with the trained weights): their IS
        # figures stay near 1 and 0 unless the engine serves other weights (warn_if_unsynced).
        self.on_policy = on_policy
        self._off_band_steps = 0
        self.cfg = packing.model_cfg()
        self.logprob_chunk_tokens = packing.logprob_chunk_tokens
        self.configure_packing(**packing.host_attributes())
        self.dp_layout = packing.layout
        self.dp_pad_to = "microbatch" if packing.use_dynamic_batches else "target"
        # What a training microbatch reads; other passes read what their meta names.
        self.train_fields = POLICY_TRAIN_FIELDS + (VALUE_TRAIN_FIELDS if value is not None else [])
        # recipe.beta > 0: a frozen copy of the initial policy (or recipe.reference_path's
        # weights), whose logprobs the step's no-grad pass writes as reference_policy_logprobs. A submodule,
        # so a resumed run's checkpoint brings it back; never trained, never sharded.
        # A LoRA policy's reference is the policy itself with its adapters disabled.
        self.reference = build_reference(policy, recipe) if recipe.beta > 0 else None
        self.uses_reference = recipe.beta > 0
        if self.uses_reference:
            self.train_fields = [*self.train_fields, REFERENCE_POLICY_LOGPROBS]
        self._mb_booked: dict[str, float] | None = None  # microbatch_stats, once a microbatch
        self._mb_lr = float(recipe.lr)  # the policy's lr as the microbatch started
        self._grad_norm: float | None = None  # before the clip, on a global batch's last
        self.train_seconds = 0.0
        # Set by the recipe's step callback before each microbatch trains, from the step's meta
        # (read per microbatch: the meta, not the module, holds each step's values).
        self.loss_norm = 1.0  # recipe.loss_type's normaliser of one global batch (per rank)
        self.current_reward = 0.0  # the step's mean rollout reward, logged as rl/reward
        self._gb_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ model inputs
    def _inputs(self, td: Any, meta: KVBatchMeta) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if POSITION_IDS in td.keys():  # noqa: SIM118  (a TensorDict has no `in`)
            kwargs = {"position_ids": td[POSITION_IDS], "segment_ids": td[SEGMENT_IDS]}
        if self.media:  # the patches go where the token ids are (the model's device)
            kwargs["image_patches"] = self.read_patches(meta).to(td[INPUT_IDS].device)
        return kwargs

    def read_patches(self, meta: KVBatchMeta) -> torch.Tensor:
        """The rows' staged pixel patches, concatenated in row order (one per image token)."""
        td = read_columns(self.dp_client, meta, [MEDIA_IMGS_FIELD], layout="jagged")
        imgs = td[MEDIA_IMGS_FIELD]
        return imgs.values() if imgs.is_nested else imgs.reshape(-1, imgs.shape[-1])

    # ------------------------------------------------------------------ pre-training passes
    @torch.no_grad()
    def forward_pass(self, meta: KVBatchMeta, *, role: str, step: int,
                     pair_with: Callable[[int], int] | None = None) -> None:
        """One no-grad pass over the step, written back through the data plane.

        ``role="policy"`` writes ``prev_logprobs``, ``role="reference"`` (``recipe.beta > 0``) the
        frozen reference's ``reference_policy_logprobs``, ``role="value"`` writes ``values``. The pass
        runs on its own isolated meta (so the value model's pad target never comes from the
        policy's dispatch), in microbatches under the ``logprob_mb_tokens`` budget and in the
        training layout; each microbatch's output goes back as rows (``dp_rows``). The columns
        are moved to the model's device and its output back to the host before the write.

        ``pair_with``: the ranks of a sharded (FSDP) model each passing their own shard of a
        step; given this rank's microbatch count it returns the most any rank runs, and this
        rank pads with that many throwaway one-token forwards less its own, so every rank's
        forwards (each one a collective) pair up.
        """
        model, field, task = {"policy": (self.policy, PREV_LOGPROBS, "prev_lp"),
                              "reference": (self.policy if self.reference is None
                                            else self.reference, REFERENCE_POLICY_LOGPROBS,
                                            "ref_lp"),
                              "value": (self.value, VALUES, "value_fwd")}[role]
        with (adapter_disabled(model) if role == "reference" else contextlib.nullcontext()):
            self._forward_pass(model, meta, field=field, task=task, scores=role != "value",
                               step=step, pair_with=pair_with)

    def _forward_pass(self, model: torch.nn.Module, meta: KVBatchMeta, *, field: str, task: str,
                      scores: bool, step: int, pair_with: Callable[[int], int] | None) -> None:
        was_training = model.training
        model.eval()
        device = device_of(model)
        planned = [] if not meta.size else [
            mb for mb in plan_step(meta, host=self, fields=[INPUT_IDS, INPUT_LENGTHS,
                                                            *([TOKEN_MASK] if scores else [])],
                                   task_name=task, step=step, mb_tokens_key="logprob_mb_tokens",
                                   micro_batch_size=self.cfg["train_micro_batch_size"])
            if mb.size]
        for mb in planned:
            td = self.dp_materialize(mb).to(device)
            ids = td[INPUT_IDS]
            with self._precision_context():
                if scores:  # the action tokens' logprobs only (0 elsewhere)
                    inputs = self._inputs(td, mb)
                    out, _ = score_tokens(model, ids, self._scoring(
                        td[TOKEN_MASK], positions=inputs.get("position_ids")), **inputs)
                else:
                    out = shift_values(model(ids, **self._inputs(td, mb))).float()
            self.write_to_dataplane(mb, {field: self.dp_rows(out.cpu())})
        if pair_with is not None:
            for _ in range(pair_with(len(planned)) - len(planned)):
                model(torch.zeros(1, 1, dtype=torch.int64, device=device))
        model.train(was_training)

    def _scoring(self, mask: torch.Tensor, *, with_entropy: bool = False,
                 positions: torch.Tensor | None = None) -> TokenScoring:
        """The positions ``mask`` selects, scored in ``tq.packing.logprob_chunk_tokens`` chunks;
        the entropy (a metric) is differentiated only when the loss uses it. The policy's passes
        and the reference's alike score under the engine's sampling controls (``recipe.top_k``
        / ``top_p`` / ``min_p`` / ``repetition_penalty``; ``positions``: a packed batch's): the
        reference's too, so its KL to the policy is 0 where they agree (docs/losses.md)."""
        controls = SamplingControls.of(self.rc)
        return TokenScoring(mask=mask > 0, temperature=self.rc.temperature,
                            chunk_tokens=self.logprob_chunk_tokens, with_entropy=with_entropy,
                            entropy_grad=with_entropy and bool(self.rc.entropy_coef),
                            controls=controls if controls.active else None,
                            positions=positions if controls.active else None)

    def _precision_context(self) -> Any:
        """The trainer's forward precision (``trainer.precision=bf16-mixed``: autocast), so the
        no-grad pass computes what the training step will; none without a trainer."""
        trainer = self._trainer
        if trainer is None:
            return contextlib.nullcontext()
        return trainer.precision_plugin.forward_context()

    def write_advantages(self, meta: KVBatchMeta) -> None:
        """Read the step's rewards (and PPO's values), compute the advantages
        (:func:`~tq_plugin.rl.algorithms.advantages.compute_advantages`) and write them (and
        PPO's returns) back through the data plane."""
        ppo = self.value is not None
        fields = [TOKEN_MASK, SAMPLE_MASK, TOTAL_REWARD, TURN_REWARDS, INPUT_LENGTHS]
        td = self.read_from_dataplane(meta, select_fields=[*fields, *([VALUES] if ppo else [])])
        adv, returns = compute_advantages(
            advantage_estimator_name(self.rc), mask=td[TOKEN_MASK] * td[SAMPLE_MASK].unsqueeze(1),
            total_reward=td[TOTAL_REWARD], turn_rewards=td[TURN_REWARDS],
            values=td[VALUES] if ppo else None, group_size=self.rc.group_size,
            gamma=self.rc.gamma, lam=self.rc.gae_lambda, scale_rewards=self.rc.scale_rewards)
        self.write_to_dataplane(meta, {ADVANTAGES: adv, **({RETURNS: returns} if ppo else {})})

    # ------------------------------------------------------------------ training
    def configure_optimizers(self) -> dict[str, Any]:
        """``recipe.optimizer`` over the policy (``recipe.lr``) and PPO's value model
        (``recipe.value_lr``), ``recipe.weight_decay`` on their matrices, and
        ``recipe.lr_scheduler`` stepped after every optimizer step over the trainer's
        ``max_steps`` (:mod:`tq_plugin.rl.training.optim`)."""
        models = [(self.policy, self.rc.lr)]
        if self.value is not None:
            models.append((self.value, self.rc.value_lr))
        optimizer = build_optimizer(self.rc, models)
        total = int(self.trainer.max_steps) if self._trainer is not None else 1
        scheduler = build_scheduler(self.rc, optimizer, max(total, 1))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (``trainer=fsdp_cpu``, ``trainer=fsdp``) shard the
        policy and the value model with FSDP2 over the data-parallel mesh
        (:func:`tq_plugin.rl.models.fsdp.shard_model`); the optimizer is built afterwards, on the
        shards. Other strategies have no mesh and leave the models whole, and so does a mesh of
        one rank (nothing to shard over; the engines and the weight files then see plain
        tensors)."""
        mesh = self.device_mesh
        if mesh is None:
            return
        dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        if dp.size() == 1:
            return
        for model in (self.policy, self.value):
            if model is not None:
                shard_model(model, dp)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradient norm over every trained parameter to ``recipe.max_grad_norm``
        (``null``: no clipping) and keep the norm before the clip (``grad_norm``). Sharded
        (``DTensor``) gradients too: ``clip_grad_norm_``'s norm of shards is a partial
        ``DTensor`` summed over the mesh, so every rank scales by the one-process factor
        (``tests/rl/models/test_fsdp.py`` checks it against the whole model). The Trainer's own
        ``gradient_clip_val`` is refused at start (``RLRecipe``): one key holds the clip."""
        if self.rc.max_grad_norm is None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, float(self.rc.max_grad_norm))
        self._grad_norm = grad_norm_value(norm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        self._mb_start = time.perf_counter()
        self._mb_booked = None
        self._grad_norm = None
        self._mb_lr = float(self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().on_train_batch_start(batch, batch_idx)

    def training_step(self, td: Any, batch_idx: int) -> dict[str, Any]:
        meta = self.dp_meta
        norm, token_norm = self._loss_norms(meta)
        mask = td[TOKEN_MASK].float()
        mask = mask * self._row_values(td[SAMPLE_MASK], mask)
        ids = td[INPUT_IDS]
        inputs = self._inputs(td, meta)
        lp, ent = score_tokens(self.policy, ids, self._scoring(
            mask, with_entropy=True, positions=inputs.get("position_ids")), **inputs)
        old, gen = td[PREV_LOGPROBS], td[GENERATION_LOGPROBS]
        ref = td[REFERENCE_POLICY_LOGPROBS] if self.uses_reference else None
        outside = None
        if SamplingControls.of(self.rc).active:
            lp, old, ref, mask, outside = drop_outside_kept(lp, old, ref, mask)
        ic = self.rc.is_correction
        is_w, is_masked = is_correction_weights(
            old, gen, mask, mode=self.is_mode, cap=self.rc.is_cap, low=ic.min, high=ic.max,
            sequence_ids=td[SEGMENT_IDS] if SEGMENT_IDS in td.keys() else None)  # noqa: SIM118
        rc, seq_ids = self.rc, td[SEGMENT_IDS] if SEGMENT_IDS in td.keys() else None  # noqa: SIM118
        extra = meta.extra_info if meta is not None else {}
        microbatches = int(extra.get(MICROBATCH_INFO, {}).get("count", 1))
        loss, parts = policy_objective(
            rc.loss_type, lp, old, td[ADVANTAGES], mask, norm=norm, microbatches=microbatches,
            sequence_ids=seq_ids, clip_eps=rc.clip_eps, clip_eps_high=rc.clip_eps_high,
            cispo_cap=rc.cispo_cap, level=rc.importance_sampling_level, weights=is_w,
            ref_logprobs=ref, beta=rc.beta,
            kl_estimator=rc.kl_estimator)
        ent = ent * mask
        if self.rc.entropy_coef:
            loss = loss - self.rc.entropy_coef * aggregate_loss(
                rc.loss_type, ent, mask, norm=norm, microbatches=microbatches, sequence_ids=seq_ids)
        with torch.no_grad():
            actions = mask > 0
            gen_ratio = torch.where(actions, (old - gen).exp(), torch.zeros_like(old))
            stats = {
                "clipped_tokens": float((parts["clipped"] & actions).sum()),
                "clip_low_tokens": float(parts["clip_low"].sum()),
                "clip_high_tokens": float(parts["clip_high"].sum()),
                "kl_ref_sum": float((parts["kl_ref"] * mask).sum()) if "kl_ref" in parts else 0.0,
                "action_tokens": float(mask.sum()),
                "kl_sum": float((approx_kl(parts["ratio"], parts["log_ratio"]) * mask).sum()),
                "entropy_sum": float(ent.detach().sum()),
                "is_ratio_sum": float(gen_ratio.sum()),
                "is_ratio_max": float(gen_ratio.max()) if gen_ratio.numel() else 0.0,
                "is_masked_tokens": float(is_masked.sum()),
                "gen_lp_abs_diff_sum": float(((gen - old).abs() * mask).sum()),
            }
            if outside is not None:
                stats["outside_kept_tokens"] = float(outside[0].sum())
                stats["ref_outside_kept_tokens"] = float(outside[1].sum())
        if self.value is not None:
            v = shift_values(self.value(ids, **inputs))
            v_loss = clipped_value_loss(v, td[VALUES], td[RETURNS], clip_eps=self.rc.value_clip_eps)
            v_loss = (v_loss * mask).sum() / token_norm
            loss = loss + self.rc.vf_coef * v_loss
            stats["value_loss"] = float(v_loss.detach())
        stats["loss"] = float(loss.detach())
        self._mb_stats = stats
        return {"loss": loss}

    def _loss_norms(self, meta: KVBatchMeta) -> tuple[float, float]:
        """``(recipe.loss_type's normaliser, the action-token one)`` of this microbatch's global
        batch, per rank: the step callback sets ``loss_norm`` from the step record (computed
        for its ``loss_type`` when the step was prepared); a record of another type (or none)
        is recomputed from its totals. The value loss is always a token mean."""
        rl = meta.extra_info.get(RL_STEP) if meta is not None else None
        if rl is None:  # a microbatch trained outside a recipe (tests): loss_norm as set
            return float(self.loss_norm), float(self.loss_norm)
        world = self.trainer.world_size if self._trainer is not None else 1
        norm = (float(self.loss_norm) if rl.get("loss_type", "dapo") == self.rc.loss_type
                else record_loss_norm(rl, self.rc.loss_type, self.rc.max_new_tokens) / world)
        return norm, record_loss_norm(rl, "dapo", self.rc.max_new_tokens) / world

    def microbatch_stats(self) -> dict[str, float]:
        """The microbatch just trained, booked once (forward, backward and, on a global batch's
        last, the optimizer step): its loss figures, seconds and the data plane's counts. The
        recipe's ``StepHooks`` callback reads it before this module's own hook logs it."""
        if self._mb_booked is None:
            elapsed = (time.perf_counter() - self._mb_start
                       + self.dp_batch_stats.get("layout_s", 0.0))
            self.train_seconds += elapsed
            self._mb_booked = {**self._mb_stats, "seconds": elapsed, **self.dp_batch_stats,
                               "peak_mem_mb": peak_memory_mb(self.device), "lr": self._mb_lr,
                               **({} if self._grad_norm is None
                                  else {"grad_norm": self._grad_norm})}
        return self._mb_booked

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the microbatch's figures once per global batch."""
        meta = self.dp_meta
        self._log_global_batch(meta.extra_info[MICROBATCH_INFO], self.microbatch_stats(),
                               batch_size=max(meta.size, 1))

    def _log_global_batch(self, info: dict[str, Any], stats: dict[str, float],
                          batch_size: int) -> None:
        """``rl/*`` through ``self.log``, once per global batch (one optimizer step), so every
        configured Lightning logger receives the same figures the recipe's CSV holds."""
        add_stats(self._gb_stats, stats)
        add_is_stats(self._gb_stats, stats)
        if not info["last_in_global_batch"]:
            return
        totals = reduce_over_ranks(self.trainer, self._gb_stats)
        figures = rl_metrics(totals, 1) | is_metrics(totals)
        self._gb_stats = {}
        if self.on_policy and totals.get("action_tokens", 0.0) > 0:
            self._off_band_steps = warn_if_unsynced(figures, self._off_band_steps)
        if self.value is None:
            figures.pop("value_loss")
        if not self.uses_reference:
            figures.pop("kl_ref")
        step = int(info["step"])
        logged = {f"rl/{k}": v for k, v in figures.items()}
        logged |= {"rl/step": float(step), "rl/reward": float(self.current_reward)}
        # To every logger in one call, not through self.log: Lightning's result collection costs
        # a few hundred microseconds a key, ~20 keys an optimizer step (a sixth of a toy step).
        # The progress bar gets the reward through self.log; the console line and callbacks that
        # monitor a key (ModelCheckpoint, EarlyStopping) find every one in
        # trainer.callback_metrics, as self.log would have put it there.
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in logged.items()})
        every = self.trainer.log_every_n_steps
        if self.trainer.is_global_zero and (not every or self.trainer.global_step % every == 0):
            for logger in self.trainer.loggers:
                logger.log_metrics(logged, step=self.trainer.global_step)
        self.log("rl/reward", logged["rl/reward"], prog_bar=True, logger=False, on_step=True,
                 on_epoch=False, batch_size=batch_size)
        # The step's own figures (rewards/<name>/mean and /std, dynamic sampling: step_record),
        # once per RL step, straight to the loggers as the eval figures go (through self.log a
        # figure would be repeated on later rows); eval/* are EvalLog's to log.
        figures = {k: float(v) for k, v in
                   (self.dp_meta.extra_info.get(RL_STEP, {}).get(STEP_FIGURES) or {}).items()
                   if not k.startswith(f"{EVAL}/")}
        if figures and info.get("last_in_step") and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(figures, step=self.trainer.global_step)

    @staticmethod
    def _row_values(per_row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A per-row ``[B]`` column broadcast over tokens of a padded ``[B, S]`` or packed row."""
        if like.shape[0] == per_row.shape[0]:
            return per_row.float().unsqueeze(1)
        return torch.ones_like(like)  # packed: placeholder rows carry token_mask 0 already

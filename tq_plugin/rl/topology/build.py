"""One builder for what generation needs, used by the colocated step source and by every
disaggregated rollout worker: the task, the policy the engine starts from, the engine, and the
rollout worker and reassembler over a staging sink.

Everything task-specific comes from the task object (its token ids, vocabulary, output tokens,
patch size), so the same code builds any task's generation side, wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from tq_plugin.config.schema import EngineConfig
from tq_plugin.rl.models.weights import write_engine_checkpoint
from tq_plugin.rollout import RolloutWorker, build_engine
from tq_plugin.rollout.engines import check_sampling
from tq_plugin.rollout.sampling import SamplingControls
from tq_plugin.staging import RolloutReassembler


def captures_media(cfg: DictConfig) -> bool:
    """Whether the run stages pixels (``tq/staging=media``)."""
    return bool(cfg.tq.staging.capture_media)


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The run's ``engine`` group, typed (``native`` when the config has none)."""
    return EngineConfig(**cfg.engine) if cfg.get("engine") is not None else EngineConfig()


def build_task(cfg: DictConfig) -> Any:
    """The run's ``task`` (seeded with ``recipe.seed``; media-enabled under ``tq/staging=media``)."""
    return instantiate(cfg.task, media=captures_media(cfg), seed=cfg.recipe.seed)


def build_model(cfg: DictConfig, task: Any, *, value_head: bool = False) -> nn.Module:
    """The ``model`` group's policy (or, ``value_head``, value model), sized for ``task``."""
    media = captures_media(cfg)
    common = {"vocab_size": task.vocab_size, "image_token_id": task.image_token_id,
              "patch_dim": task.patch_dim if media else None}
    if value_head:
        return instantiate(cfg.model, value_head=True, **common)
    return instantiate(cfg.model, output_token_ids=task.output_token_ids, **common)


def start_engine(cfg: DictConfig, policy: nn.Module, workdir: str | Path, *, weight_version: int,
                 task: Any = None, rank: int = 0, barrier: Any = None) -> Any:
    """The rollout engine: ``policy`` itself (``engine=native``), or a copy started from the HF
    checkpoint of ``policy`` written to ``workdir/engine_init`` (``hf``, ``vllm``; by ``rank``
    0, the others waiting at ``barrier`` when several ranks generate)."""
    options = engine_config(cfg)
    check_sampling(options, SamplingControls.of(cfg.recipe))
    checkpoint = None
    if options.name != "native":
        checkpoint = write_engine_checkpoint(policy, Path(workdir) / "engine_init", rank=rank,
                                             barrier=barrier)
    # The engine's context and cache follow what the run needs (the task's longest call and a
    # step's sequences), not the checkpoint's positions.
    rc, model_len = cfg.recipe, int(cfg.model.max_seq_len)
    context = model_len if task is None else task.engine_context(rc.max_new_tokens, model_len)
    return build_engine(options, model=policy, checkpoint=checkpoint, max_model_len=context,
                        max_num_seqs=int(rc.prompts_per_step) * int(rc.group_size),
                        weight_version=weight_version,
                        # a LoRA policy on vllm: every version a rollout in flight may use
                        max_loras=int(rc.get("max_staleness", 0)) + 1)


@dataclass
class RolloutSide:
    """A staging sink on one client, the rollout worker that stages every call through it and
    the reassembler that turns the finished groups into training rows."""

    sink: Any
    rollout: Any  # a RolloutWorker, or the task's own driver with its ``run``
    reassembler: RolloutReassembler


def build_rollout_side(cfg: DictConfig, task: Any, client: Any) -> RolloutSide:
    """The sink (``tq.staging``), rollout driver and reassembler for ``task`` on ``client``: the
    task's own driver where it has one (``rollout_driver``: ``task=agent`` serves the engine to
    the user's agent), else a ``RolloutWorker`` running the task's episodes."""
    rc = cfg.recipe
    sink = instantiate(cfg.tq.staging)(client)
    # A task that drives its own rollouts (task=agent) returns its driver; else None.
    rollout = task.rollout_driver(sink, temperature=rc.temperature,
                                  max_new_tokens=rc.max_new_tokens,
                                  max_model_len=int(cfg.model.max_seq_len))
    if rollout is None:
        rollout = RolloutWorker(task=task, sink=sink, temperature=rc.temperature,
                                max_new_tokens=rc.max_new_tokens, stop_token_id=task.eos_token_id,
                                allowed_token_ids=task.output_token_ids,
                                controls=SamplingControls.of(rc))
    reassembler = RolloutReassembler(client, staging_partition=sink.staging_partition,
                                     capture_media=captures_media(cfg),
                                     pad_token_id=task.pad_token_id, clear_staged=True)
    return RolloutSide(sink, rollout, reassembler)


__all__ = ["RolloutSide", "build_model", "build_rollout_side", "build_task", "captures_media",
           "engine_config", "start_engine"]

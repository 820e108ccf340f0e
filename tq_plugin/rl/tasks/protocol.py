"""The task contract, declared: what every task gives the rollout side, the step sources and the
recipe, with the hooks a task may leave at their defaults.

A task is what the rollout worker samples episodes from and scores them with, and what sizes
the models (its vocabulary, its special token ids). Subclass :class:`Task` and fill in the
abstract members; override a hook only where the task has something to say:

* ``set_step``: nothing (a task whose reward reads the RL step: ``trainer_state``);
* ``seek``: nothing (a task with a prompt stream: a disaggregated worker's slot);
* ``reward_log``: empty (a task that keeps each score call: per-reward figures, NaN rewards);
  ``drain_reward_log``: ``[]``;
* ``stateful``: ``False``; ``True``: ``state_dict`` / ``load_state_dict`` ride the Lightning
  checkpoint (:class:`~tq_plugin.rl.tasks.prompts.TaskState`);
* ``rollout_driver``: ``None``, a ``RolloutWorker`` runs the task's episodes; else the task's
  own driver (``task=agent`` serves the engine to the user's agent);
* ``evaluates``: ``False``; ``True`` with ``evaluate``: ``recipe.eval_every`` scores it;
* ``check_recipe``: accepts every recipe.

A task built from a dataset file of prompts subclasses
:class:`~tq_plugin.rl.tasks.prompts.DatasetTask` (the rows, the tokenizer, the seeded prompt
stream and its cursor): ``task=prompts`` and ``task=agent`` do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch


class Task(ABC):
    """The declared task contract (see the module docstring)."""

    name: str = "task"
    turns: int = 1
    eos_token_id: int
    pad_token_id: int
    image_token_id: int | None = None
    patch_dim: int = 0
    # Whether episodes carry pixels (tq/staging=media); a text task leaves it False.
    media: bool = False
    tokenizer: Any = None
    # A task that keeps its score calls (task=prompts) sets its own list.
    reward_log: Sequence[dict[str, Any]] = ()
    # Whether state_dict/load_state_dict ride the checkpoint (a prompt stream's cursor).
    stateful: bool = False

    # ---------------------------------------------------------------- what every task gives
    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The vocabulary the models are sized for."""

    @property
    def output_token_ids(self) -> list[int] | None:
        """Token ids the policy may emit; ``None``: every token."""
        return None

    @abstractmethod
    def max_sequence_length(self, max_new_tokens: int) -> int:
        """The longest episode (prompt, completions and feedback of every turn) in tokens."""

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator) -> list[Any]:
        """``n`` episodes (``Episode``: ``target``, ``prompt`` ids, optional ``image``)."""

    @abstractmethod
    def score(self, responses: torch.Tensor, response_lens: torch.Tensor,
              targets: torch.Tensor, target_lens: torch.Tensor) -> torch.Tensor:
        """Per-row reward of right-padded ``responses`` against the episodes' ``targets``."""

    def engine_context(self, max_new_tokens: int, model_max_len: int) -> int:
        """The context a rollout engine serves this task with: its longest episode (a task
        whose calls may grow past it, an agent's, says more)."""
        return self.max_sequence_length(max_new_tokens)

    def feedback(self, scores: torch.Tensor) -> list[list[int]]:
        """The environment's reply token ids after each row's turn (multi-turn tasks)."""
        raise NotImplementedError(f"task={self.name} has one turn: it gives no feedback")

    # ---------------------------------------------------------------- hooks with defaults
    def set_step(self, step: int, max_steps: int = 0) -> None:
        """The RL step the next rollouts are generated for."""

    def seek(self, position: int) -> None:
        """Put the prompt stream's cursor at ``position`` (a worker's ticket slot)."""

    def drain_reward_log(self) -> list[dict[str, Any]]:
        """The score calls kept since the last drain, emptied."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (a ``stateful`` task's)."""

    def rollout_driver(self, sink: Any, **options: Any) -> Any:
        """The task's own rollout driver on ``sink``; ``None``: a ``RolloutWorker``."""
        return None

    @property
    def evaluates(self) -> bool:
        """Whether the task holds held-out prompts :meth:`evaluate` scores."""
        return False

    def evaluate(self, generate: Any, *, max_new_tokens: int) -> dict[str, float]:
        """Scores of greedy completions (``generate(prompt_ids) -> completion ids``) of the
        held-out prompts: ``{"reward": ..., "accuracy": ...}``."""
        return {}

    def check_recipe(self, recipe: Any) -> None:
        """Refuse (``ConfigError``, naming the key) a recipe setting the task cannot train."""


__all__ = ["Task"]

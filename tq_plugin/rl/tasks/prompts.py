"""``task=prompts``: prompts from a local dataset file, a tokenizer, and reward functions.

The file (``task.path``: json/jsonl, parquet or csv, read with HF ``datasets``) holds one prompt
per row under ``task.prompt_key``: plain text (TRL's *standard* format: tokenized as is, with the
tokenizer's own special tokens) or chat messages (*conversational*: ``[{"role": ..., "content":
...}, ...]``, rendered with the tokenizer's chat template and its generation prompt). The reward
functions (:mod:`tq_plugin.rl.tasks.rewards`) are called as TRL calls them: ``prompts`` (the
dataset prompts, strings or message lists), ``completions`` (decoded with special tokens
skipped: strings, or ``[{"role": "assistant", "content": text}]`` for conversational data),
``completion_ids``, every other column (``answer``, ``solution``, metadata) and
``trainer_state``. The tokenizer (``task.tokenizer``, by default ``model.pretrained_path``) gives
the vocabulary and the EOS / pad ids.

Every training score call is kept in :attr:`PromptTask.reward_log` (each reward's values, the
weighted total, the texts, what the functions logged) until the step source drains it
(:meth:`PromptTask.drain_reward_log`) into the step's per-reward metrics and sample completions.

Prompts are drawn in a seeded shuffle of the rows, one epoch after another; the position in it
(:meth:`PromptTask.state_dict`) rides the Lightning checkpoint (:class:`TaskState`), so a resumed
run continues where the checkpoint left off. The held-out split (``task.eval_path``, or the last
``task.eval_size`` rows of a shuffle with its own seed) is never trained on; the recipe's
``recipe.eval_every`` scores greedy completions of it.

It follows the rollout worker's task interface (``sample`` / ``score`` / ``feedback`` /
``turns``): an episode's ``target`` is its row number, which the worker hands back to
``score`` in the ``targets`` tensor, where the row's prompt and columns are looked up. Turns
after the first see ``task.feedback`` (good / bad, by the reward) and are scored again.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.pattern import Episode
from tq_plugin.rl.tasks.protocol import Task
from tq_plugin.rl.tasks.rewards import Reward, RewardCall, TrainerState, combine, load_rewards
from tq_plugin.rl.tasks.stream import PromptStream

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# A completion at least this rewarded counts as correct (eval/accuracy).
CORRECT = 1.0
log = logging.getLogger(__name__)


def load_rows(path: str | Path, *, prompt_key: str, key: str = "task.path") -> list[dict]:
    """The file's rows as dicts, through HF ``datasets``; a missing or empty file, an unknown
    extension, a missing ``prompt_key`` or a prompt that is neither text nor chat messages is a
    ``ConfigError`` naming ``key`` and the file."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{key}: {path} must end in one of {sorted(FORMATS)}")
    if not path.is_file():
        raise ConfigError(f"{key}: {path} does not exist")
    if path.stat().st_size == 0:
        raise ConfigError(f"{key}: {path} is empty")
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("task=prompts needs HF datasets: pip install 'tq_plugin[prompts]'") from exc
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as exc:
        raise ConfigError(f"{key}: {path} does not read as {fmt} ({type(exc).__name__}: "
                          f"{exc})") from exc
    if len(ds) == 0:
        raise ConfigError(f"{key}: {path} holds no rows")
    if prompt_key not in ds.column_names:
        raise ConfigError(f"task.prompt_key: {path} has no column {prompt_key!r} "
                          f"(columns: {ds.column_names})")
    rows = ds.to_list()
    for i, row in enumerate(rows):
        if not _is_prompt(row[prompt_key]):
            raise ConfigError(f"task.prompt_key: row {i} of {path}: {prompt_key!r} must be text "
                              f"or a list of {{role, content}} messages, got "
                              f"{type(row[prompt_key]).__name__} {str(row[prompt_key])[:60]!r}")
    return rows


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value))


def load_tokenizer(path: str | Path | None) -> Any:
    """``AutoTokenizer`` from a local directory (never the hub); it (or the directory's
    generation config, :func:`special_ids`) must name an EOS token."""
    if path is None:
        raise ConfigError("task.tokenizer: task=prompts needs a tokenizer directory (set "
                          "model.pretrained_path, or task.tokenizer=DIR)")
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"task.tokenizer: {path} is not a directory")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                              "tokenizer.model", "vocab.json")):
        raise ConfigError(f"task.tokenizer: {path} holds no tokenizer files (tokenizer.json, "
                          f"tokenizer_config.json): save one with tokenizer.save_pretrained")
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("task=prompts needs transformers: pip install 'tq_plugin[hf]'") from exc
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    special_ids(tok, path)  # refuses a tokenizer with no EOS anywhere
    return tok


def _first(value: Any) -> int | None:
    """An id of a config (``int``, a list of them: the first, or ``None``)."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def special_ids(tokenizer: Any, path: str | Path) -> tuple[int, int]:
    """``(eos, pad)``: the tokenizer's own, else the checkpoint's ``generation_config.json`` in
    ``path`` (a model that names its stop and pad ids only there), pad falling back to EOS.
    No EOS in either is a ``ConfigError`` naming ``task.tokenizer``."""
    gen_path = Path(path) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else _first(
        gen.get("eos_token_id"))
    if eos is None:
        raise ConfigError(f"task.tokenizer: neither the tokenizer in {path} nor its "
                          f"generation_config.json names an eos token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _first(
        gen.get("pad_token_id"))
    return int(eos), int(eos if pad is None else pad)


def render(tokenizer: Any, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template (with the generation
    prompt), plain text as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("task.prompt_key: the prompts are chat messages but the tokenizer has "
                          "no chat_template")
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt's text for a log line: the text, or the last message's content."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def is_conversational(prompt: Any) -> bool:
    """TRL's test: a list whose first element is a message (a dict with a ``role``)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) \
        and "role" in prompt[0]


class DatasetTask(Task):
    """A task over the rows of a dataset file (``task.path``: json/jsonl, parquet, csv): the
    tokenizer (``task.tokenizer``) and its special ids, the rows, and a seeded prompt stream
    (one shuffle per epoch) whose cursor rides the checkpoint and which a disaggregated worker
    seeks to its ticket's slot."""

    stateful = True

    def __init__(self, *, path: str | Path | None, prompt_key: str, tokenizer: str | None,
                 shuffle: bool, seed: int, name: str, path_hint: str = "",
                 rows: list[dict] | None = None, size_key: str = "task.path") -> None:
        """``rows`` instead of ``path``: rows a task made itself (``task=reasoning_gym``); the
        prompt stream's errors then name ``size_key``."""
        if path is None and rows is None:
            raise ConfigError(f"task.path: task={name} needs a dataset file (json/jsonl, "
                              f"parquet, csv){path_hint}")
        self.name, self.prompt_key = name, prompt_key
        self.tokenizer = load_tokenizer(tokenizer)
        self.eos_token_id, self.pad_token_id = special_ids(self.tokenizer, tokenizer)
        self.seed, self.shuffle, self._size_key = seed, shuffle, size_key
        self.set_rows(load_rows(path, prompt_key=prompt_key) if rows is None else rows)

    def set_rows(self, rows: list[dict]) -> None:
        """The training rows, and a fresh prompt stream over them."""
        self.rows = rows
        self.stream = PromptStream(len(rows), seed=self.seed, shuffle=self.shuffle,
                                   key=self._size_key)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def next_rows(self, n: int) -> list[int]:
        """The next ``n`` row numbers of the run's prompt stream (a new shuffle each epoch)."""
        return self.stream.next_rows(n)

    def seek(self, position: int) -> None:
        """Put the cursor at ``position`` of the run's prompt stream: a disaggregated worker
        draws the rows of its ticket's slot this way, whichever worker runs it and however
        often it is ordered."""
        self.stream.seek(position)

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.stream.load_state_dict(state)


class PromptTask(DatasetTask):
    """Prompts from a file, scored by reward functions (see the module docstring)."""

    def __init__(
        self,
        *,
        path: str,
        prompt_key: str = "prompt",
        tokenizer: str | None = None,
        reward: Mapping[str, Any] | None = None,
        rewards: Mapping[str, Mapping[str, Any]] | None = None,
        eval_path: str | None = None,
        eval_size: int = 0,
        turns: int = 1,
        feedback_good: str = " Correct.",
        feedback_bad: str = " Try again.",
        shuffle: bool = True,
        name: str = "prompts",
        media: bool = False,
        seed: int = 0,
    ) -> None:
        if media:
            raise ConfigError("task=prompts reads no pixels: drop tq/staging=media")
        super().__init__(path=path, prompt_key=prompt_key, tokenizer=tokenizer, shuffle=shuffle,
                         seed=seed, name=name)
        rows = self.rows
        if eval_path is not None:
            held_out = load_rows(eval_path, prompt_key=prompt_key, key="task.eval_path")
        elif eval_size:
            if eval_size >= len(rows):
                raise ConfigError(f"task.eval_size: must be below the file's {len(rows)} rows")
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 17))
            held = set(order[:eval_size].tolist())
            held_out = [r for i, r in enumerate(rows) if i in held]
            rows = [r for i, r in enumerate(rows) if i not in held]
        else:
            held_out = []
        if len(rows) != len(self.rows):
            self.set_rows(rows)
        self.prepare(rewards=load_rewards(reward, rewards), eval_rows=held_out, turns=turns,
                     feedback=(feedback_bad, feedback_good))

    def prepare(self, *, rewards: list[Reward], eval_rows: list[dict], turns: int,
                feedback: tuple[str, str]) -> None:
        """What every prompts task holds once its rows are set: the rewards, the held-out rows,
        both splits' prompt ids, the feedback ids (bad, good) of multi-turn tasks, the reward
        functions' ``trainer_state`` and the reward log."""
        self.media, self.turns = False, turns
        self.rewards: list[Reward] = rewards
        self.eval_rows = eval_rows
        self.ids = [render(self.tokenizer, r[self.prompt_key]) for r in self.rows]
        self.eval_ids = [render(self.tokenizer, r[self.prompt_key]) for r in eval_rows]
        self.feedback_ids = [list(self.tokenizer(t, add_special_tokens=False).input_ids)
                             for t in feedback]
        # Set by the step source before each step's rollouts (trainer_state.global_step).
        self.trainer_state = TrainerState()
        self.reward_log: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- the worker's interface
    def max_sequence_length(self, max_new_tokens: int) -> int:
        longest = max(len(p) for p in self.ids + self.eval_ids)
        feedback = max(len(f) for f in self.feedback_ids)
        return longest + self.turns * max_new_tokens + (self.turns - 1) * feedback

    def sample(self, n: int, generator: torch.Generator) -> list[Episode]:
        """``n`` episodes from the shuffle (``generator`` is not drawn from: the cursor is the
        task's own state)."""
        return [Episode(target=[i], prompt=list(self.ids[i])) for i in self.next_rows(n)]

    def set_step(self, step: int, max_steps: int = 0) -> None:
        """The RL step the next rollouts are generated for (the reward functions'
        ``trainer_state``)."""
        self.trainer_state = TrainerState(global_step=int(step), max_steps=int(max_steps))

    def score(self, responses: torch.Tensor, response_lens: torch.Tensor,
              targets: torch.Tensor, target_lens: torch.Tensor) -> torch.Tensor:
        """The weighted reward of each decoded completion (``targets[:, 0]``: its row); 0.0 for a
        completion no reward applies to (a rollout receipt carries a finite reward): the reward
        log's ``total`` keeps its NaN, from which the colocated step source puts NaN in the
        row's ``total_reward`` (kept out of its group's baseline, advantage 0)."""
        rows = [self.rows[i] for i in targets[:, 0].tolist()]
        total = torch.tensor(self.reward_rows(rows, responses, response_lens), dtype=torch.float32)
        return total.nan_to_num(0.0)

    def reward_call(self, rows: Sequence[Mapping[str, Any]], responses: torch.Tensor,
                    response_lens: torch.Tensor) -> RewardCall:
        """The reward functions' arguments for ``rows`` and their completions, TRL's way."""
        ids = [r[:n].tolist() for r, n in zip(responses, response_lens.tolist())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        prompts = [r[self.prompt_key] for r in rows]
        completions: list[Any] = texts
        if prompts and is_conversational(prompts[0]):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        skip = {self.prompt_key, "completion", "completion_ids"}
        columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in skip} if rows else {}
        return RewardCall(prompts=prompts, completions=completions, completion_ids=ids,
                          columns=columns, trainer_state=self.trainer_state)

    def reward_rows(self, rows: Sequence[Mapping[str, Any]], responses: torch.Tensor,
                    response_lens: torch.Tensor, *, record: bool = True) -> list[float]:
        """Each completion's weighted reward; ``record``: keep the call in the reward log."""
        call = self.reward_call(rows, responses, response_lens)
        total, each = combine(self.rewards, call)
        unscorable = sum(math.isnan(t) for t in total)
        if unscorable:
            log.warning("%d of %d completions: no reward applies (every reward function returned "
                        "None); they are kept out of their groups' baselines (advantage 0)",
                        unscorable, len(total))
        if record:
            texts = [c if isinstance(c, str) else c[-1]["content"] for c in call.completions]
            self.reward_log.append({
                "step": call.trainer_state.global_step, "prompts": call.prompts,
                "completions": texts, "rewards": each, "total": total, "extra": call.extra,
                "metrics": call.metrics, "unscorable": unscorable})
        return total

    def drain_reward_log(self) -> list[dict[str, Any]]:
        """The score calls recorded since the last drain (and forget them)."""
        out, self.reward_log = self.reward_log, []
        return out

    def feedback(self, scores: torch.Tensor) -> list[list[int]]:
        return [list(self.feedback_ids[int(s >= CORRECT)]) for s in scores.tolist()]

    # ---------------------------------------------------------------- evaluation
    @property
    def evaluates(self) -> bool:
        """Held-out rows to evaluate: ``task.eval_path`` or ``task.eval_size``."""
        return bool(self.eval_rows)

    def evaluate(self, generate: Any, *, max_new_tokens: int) -> dict[str, float]:
        """Greedy completions of the held-out rows through ``generate(prompts) -> [ids]`` (stop
        token included when emitted): ``{"reward": mean, "accuracy": fraction >= 1}``."""
        if not self.eval_rows:
            return {}
        outs = generate(self.eval_ids)
        answers = [o[:-1] if o and o[-1] == self.eos_token_id else o for o in outs]
        lens = torch.tensor([len(a) for a in answers])
        padded = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(a if a else [self.pad_token_id]) for a in answers], batch_first=True)
        rewards = [r for r in self.reward_rows(self.eval_rows, padded, lens, record=False)
                   if not math.isnan(r)]  # unscorable rows are neither right nor wrong
        if not rewards:
            return {}
        return {"reward": sum(rewards) / len(rewards),
                "accuracy": sum(r >= CORRECT for r in rewards) / len(rewards)}


class TaskState(Callback):
    """Checkpoints a task's own state (the dataset cursor) beside the rollout generator's, so a
    resumed run draws the prompts the interrupted one would have drawn next."""

    def __init__(self, task: Any) -> None:
        self.task = task

    @property
    @override
    def state_key(self) -> str:
        return f"TaskState[{self.task.name}]"

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self.task.state_dict())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.task.load_state_dict(state_dict)


__all__ = ["FORMATS", "DatasetTask", "PromptTask", "TaskState", "is_conversational", "load_rows", "load_tokenizer",
           "prompt_text", "render", "special_ids"]

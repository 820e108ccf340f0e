"""``task=reasoning_gym``: prompts and verifiable rewards from a `reasoning-gym
<https://github.com/open-thought/reasoning-gym>`_ generator (the ``gym`` extra).

The rows are ``reasoning_gym.create_dataset(task.dataset, size=task.size,
seed=task.dataset_seed, **task.config)``: the generator's own options pass through under
``task.config`` (``+task.config.min_digits=2 +task.config.max_terms=3``). Each row's question
becomes one user message (the question, then ``task.instruction``: how to state the answer),
after an optional ``task.system_prompt``, rendered through the tokenizer's chat template.

The reward is the dataset's own ``score_answer(extracted, entry)`` on the answer extracted from
the completion (``task.answer_format``: ``last_number``, ``last_line`` or ``answer_tag``, the
text inside the last ``<answer>...</answer>``), named ``score`` in the metrics
(``rewards/score/mean``). Many datasets give partial credit (``basic_arithmetic``: 0.67 for
``138`` against ``38``, the gold a substring of the answer); ``task.partial_credit=false``
trains on the fully right answers only (1 where ``score_answer`` is 1, else 0), which is what
held-out accuracy counts. ``task.format_bonus`` (0: off) adds a reward ``format`` worth 1 when an
answer could be extracted at all. More reward functions go under ``task.rewards.<name>`` as with
``task=prompts``; they see the columns ``question``, ``answer`` and ``metadata``.

The held-out split (``task.eval_size`` rows, ``recipe.eval_every``) comes from the same
generator with a seed of its own (``task.eval_seed``; by default ``dataset_seed + size``, past
the training rows' seeds), and any question that is also a training question is skipped, so the
two never overlap. Its greedy completions are scored like the training ones:
``accuracy`` (the fraction the dataset scores fully right), ``score`` (the mean score, partial
credit included) and ``reward``; each row (prompt, completion, extracted answer, gold answer,
score) is kept in :attr:`ReasoningGymTask.last_eval_rows`, which
:func:`tq_plugin.rl.training.evaluation.write_eval_completions` appends to
``eval_completions.jsonl`` in the run dir.

``task.dataset_seed``, not ``task.seed``: the recipe passes ``recipe.seed`` to every task as
``seed`` (here: the order the rows are drawn in), so runs with different recipe seeds train and
evaluate on the same questions.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.prompts import DatasetTask, PromptTask
from tq_plugin.rl.tasks.rewards import Reward, completion_text, load_rewards

ANSWER_FORMATS = ("last_number", "last_line", "answer_tag")
# What the user message asks for after the question, per answer format.
INSTRUCTIONS = {
    "last_number": "Reply with just the final number.",
    "last_line": "Reply with only the final answer.",
    "answer_tag": "Give the final answer inside <answer></answer> tags, e.g. <answer>42</answer>.",
}
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract_answer(text: str, answer_format: str) -> str | None:
    """The answer stated in ``text`` (``None``: none found).

    * ``last_number``: the last number (sign, thousands commas and decimals kept);
    * ``last_line``: the last non-empty line, stripped;
    * ``answer_tag``: the text inside the last ``<answer>...</answer>``, or after a last
      ``<answer>`` left open (a completion cut at ``max_new_tokens`` or stopped early).
    """
    if answer_format == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].rstrip(",") if numbers else None
    if answer_format == "last_line":
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else None
    if answer_format == "answer_tag":
        tags = _TAG.findall(text)
        if tags:
            return tags[-1].strip()
        _, opened, rest = text.rpartition("<answer>")
        return rest.strip() or None if opened else None
    raise ConfigError(f"task.answer_format: must be one of {list(ANSWER_FORMATS)}, got "
                      f"{answer_format!r}")


def registry() -> dict[str, Any]:
    """reasoning-gym's datasets by name (``ConfigError`` without the ``gym`` extra)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ConfigError("task=reasoning_gym needs reasoning-gym: pip install "
                          "'tq_plugin[gym]'") from exc
    return DATASETS


def check_dataset(name: str) -> None:
    """A one-line ``ConfigError`` for a name reasoning-gym does not know, listing close ones."""
    names = registry()
    if name in names:
        return
    close = difflib.get_close_matches(str(name), list(names), n=5, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close
            else f"{len(names)} names in reasoning_gym.factory.DATASETS")
    raise ConfigError(f"task.dataset: reasoning-gym has no dataset {name!r}; {hint}")


def create(name: str, *, size: int, seed: int, config: Mapping[str, Any]) -> Any:
    """``reasoning_gym.create_dataset(name, size=, seed=, **config)``; an option the generator
    does not take or refuses is a ``ConfigError`` naming ``task.config``."""
    check_dataset(name)
    import reasoning_gym

    config = dict(config)
    clash = sorted({"size", "seed"} & set(config))
    if clash:
        raise ConfigError(f"task.config: {clash} are set by task.size / task.dataset_seed, "
                          f"not task.config")
    config_cls = registry()[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ConfigError(f"task.config: {name} takes no option(s) {unknown}; its options: "
                          f"{fields}")
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except (AssertionError, TypeError, ValueError) as exc:
        raise ConfigError(f"task.config: {name} refuses {config}: {exc or type(exc).__name__}"
                          ) from exc


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain containers (the generators check ``list`` / ``tuple``)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover (hydra brings omegaconf)
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


class ReasoningGymTask(PromptTask):
    """A reasoning-gym generator's questions, scored by its ``score_answer`` (see the module
    docstring). The worker's interface, the prompt stream and its checkpoint are
    :class:`~tq_plugin.rl.tasks.prompts.PromptTask`'s."""

    def __init__(
        self,
        *,
        dataset: str = "chain_sum",
        size: int = 1000,
        dataset_seed: int = 0,
        eval_size: int = 64,
        eval_seed: int | None = None,
        config: Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
        system_prompt: str | None = None,
        instruction: str | None = None,
        answer_format: str = "last_number",
        format_bonus: float = 0.0,
        partial_credit: bool = True,
        rewards: Mapping[str, Mapping[str, Any]] | None = None,
        turns: int = 1,
        feedback_good: str = " Correct.",
        feedback_bad: str = " Try again.",
        shuffle: bool = True,
        name: str = "reasoning_gym",
        media: bool = False,
        seed: int = 0,
    ) -> None:
        if media:
            raise ConfigError("task=reasoning_gym reads no pixels: drop tq/staging=media")
        if answer_format not in ANSWER_FORMATS:
            raise ConfigError(f"task.answer_format: must be one of {list(ANSWER_FORMATS)}, got "
                              f"{answer_format!r}")
        if size < 1:
            raise ConfigError(f"task.size: must be >= 1, got {size}")
        if eval_size < 0:
            raise ConfigError(f"task.eval_size: must be >= 0, got {eval_size}")
        if not math.isfinite(float(format_bonus)):
            raise ConfigError(f"task.format_bonus: must be finite, got {format_bonus!r}")
        if not isinstance(partial_credit, bool):
            raise ConfigError(f"task.partial_credit: must be true or false, got "
                              f"{partial_credit!r}")
        self.dataset_name = dataset
        self.answer_format = answer_format
        self.partial_credit = partial_credit
        self.system_prompt = system_prompt
        self.instruction = INSTRUCTIONS[answer_format] if instruction is None else instruction
        config = _plain(config) or {}
        self.dataset = create(dataset, size=size, seed=dataset_seed, config=config)
        rows = [self.row(entry) for entry in self.dataset]
        seen = {r["question"] for r in rows}
        eval_seed = dataset_seed + size if eval_seed is None else eval_seed
        held_out = self.held_out(eval_size, seed=eval_seed, config=config, seen=seen)
        DatasetTask.__init__(self, path=None, rows=rows, prompt_key="prompt", tokenizer=tokenizer,
                             shuffle=shuffle, seed=seed, name=name, size_key="task.size")
        own = [Reward(name="score", fn=self.score_reward, weight=1.0, accepts=None)]
        if format_bonus:
            own.append(Reward(name="format", fn=self.format_reward, weight=float(format_bonus),
                              accepts=None))
        own += load_rewards(None, rewards) if rewards else []
        names = [r.name for r in own]
        if len(set(names)) != len(names):
            raise ConfigError(f"task.rewards: {names}: 'score' and 'format' are the task's own")
        self.prepare(rewards=own, eval_rows=held_out, turns=turns,
                     feedback=(feedback_bad, feedback_good))
        # The latest evaluation's rows (evaluation.write_eval_completions drains them).
        self.last_eval_rows: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- rows and the split
    def messages(self, question: str) -> list[dict[str, str]]:
        """The chat prompt of one question."""
        content = f"{question}\n{self.instruction}" if self.instruction else question
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    def row(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        return {"prompt": self.messages(entry["question"]), "question": entry["question"],
                "answer": entry["answer"], "metadata": entry.get("metadata", {})}

    def held_out(self, n: int, *, seed: int, config: Mapping[str, Any],
                 seen: set[str]) -> list[dict[str, Any]]:
        """``n`` rows from the generator at ``seed`` whose questions are not in ``seen`` (the
        training questions) nor repeated; a generator with too few distinct questions left is a
        ``ConfigError``."""
        if not n:
            return []
        rows: list[dict[str, Any]] = []
        questions = set(seen)
        drawn = 0
        for size in (2 * n, 8 * n, 32 * n):
            ds = create(self.dataset_name, size=size, seed=seed, config=config)
            for idx in range(drawn, size):
                entry = ds[idx]
                if entry["question"] not in questions:
                    questions.add(entry["question"])
                    rows.append(self.row(entry))
                    if len(rows) == n:
                        return rows
            drawn = size
        raise ConfigError(f"task.eval_size: {self.dataset_name} gave only {len(rows)} questions "
                          f"outside the {len(seen)} training ones in {drawn} draws; lower "
                          f"task.eval_size or task.size, or widen task.config")

    # ---------------------------------------------------------------- rewards
    def extract(self, text: str) -> str | None:
        return extract_answer(text, self.answer_format)

    def score_entry(self, extracted: str | None, row: Mapping[str, Any]) -> float:
        """The dataset's ``score_answer`` on ``extracted`` for ``row`` (0 for ``None``)."""
        entry = {"question": row["question"], "answer": row["answer"],
                 "metadata": row["metadata"]}
        return float(self.dataset.score_answer(extracted, entry)) if extracted is not None \
            else 0.0

    def score_reward(self, completions: list[Any], question: list[str], answer: list[str],
                     metadata: list[Any], **_: Any) -> list[float]:
        """The ``score`` reward: ``score_answer`` on each completion's extracted answer (without
        ``partial_credit``: 1 where it is 1, else 0)."""
        scores = [self.score_entry(self.extract(completion_text(c)),
                                   {"question": q, "answer": a, "metadata": m})
                  for c, q, a, m in zip(completions, question, answer, metadata)]
        return scores if self.partial_credit else [float(s >= 1.0) for s in scores]

    def format_reward(self, completions: list[Any], **_: Any) -> list[float]:
        """The ``format`` reward: 1 when an answer could be extracted."""
        return [float(self.extract(completion_text(c)) is not None) for c in completions]

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, generate: Any, *, max_new_tokens: int) -> dict[str, float]:
        """Greedy completions of the held-out rows through ``generate(prompts) -> [ids]``:
        ``{"accuracy": fraction scored 1, "score": mean score, "reward": mean total reward}``;
        the rows themselves in :attr:`last_eval_rows`."""
        if not self.eval_rows:
            return {}
        outs = generate(self.eval_ids)
        answers = [o[:-1] if o and o[-1] == self.eos_token_id else list(o) for o in outs]
        texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True)
        extracted = [self.extract(t) for t in texts]
        scores = [self.score_entry(x, r) for x, r in zip(extracted, self.eval_rows)]
        lens = torch.tensor([len(a) for a in answers])
        padded = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(a if a else [self.pad_token_id]) for a in answers], batch_first=True)
        totals = self.reward_rows(self.eval_rows, padded, lens, record=False)
        self.last_eval_rows = [
            {"prompt": r["question"], "completion": t, "extracted": x, "answer": r["answer"],
             "score": round(s, 6), "reward": None if math.isnan(v) else round(v, 6)}
            for r, t, x, s, v in zip(self.eval_rows, texts, extracted, scores, totals)]
        rewards = [v for v in totals if not math.isnan(v)]
        return {"accuracy": sum(s >= 1.0 for s in scores) / len(scores),
                "score": sum(scores) / len(scores),
                **({"reward": sum(rewards) / len(rewards)} if rewards else {})}


__all__ = ["ANSWER_FORMATS", "INSTRUCTIONS", "ReasoningGymTask", "check_dataset", "create",
           "extract_answer", "registry"]

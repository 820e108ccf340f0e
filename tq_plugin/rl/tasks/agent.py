"""``task=agent``: train a user's own agent, written against the OpenAI API.

``task.agent._target_=mypkg.agent.solve`` names ``async def solve(client, row, **kwargs)``: it
gets an ``openai.AsyncOpenAI`` client bound to one rollout and one dataset row, runs any loop
(tools, several turns, branches) and returns the rollout's reward, or a dict with ``reward`` and
more figures. The other keys of ``task.agent`` are passed to it as keyword arguments.

Each step, :class:`AgentRunner` serves the rollout engine through the OpenAI-compatible
endpoint (:class:`tq_plugin.rollout.openai.server.AgentEndpoint`, on loopback, port 0), which
stages every call token-exact through the run's ``TQTokenSink`` before it answers; it runs
``group_size`` rollouts of each of the step's rows, ``task.concurrency`` at a time, closes each
with its receipt, and hands the receipts to the reassembler as the built-in tasks' are. It works
colocated and in every disaggregated worker (each serves its own engine).

One reward per rollout: train it with ``recipe=grpo`` (PPO's per-turn credit assignment needs
turns the task defines; an agent's calls are not those).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import get_method

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.prompts import DatasetTask, render
from tq_plugin.rollout.sampling import SamplingControls
from tq_plugin.rollout.worker import RolloutBatch


class AgentError(RuntimeError):
    """The user's agent function raised or returned something that is not a reward; the
    message names the function and where it is defined."""


def _where(fn: Any) -> str:
    target = inspect.unwrap(getattr(fn, "func", fn))
    try:
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (OSError, TypeError):
        return getattr(target, "__module__", "?")


def load_agent(spec: Mapping[str, Any] | None) -> tuple[Any, str]:
    """``(function, name)`` of ``task.agent``: ``_target_`` an ``async def``, its other keys
    bound as keyword arguments."""
    if not spec or not spec.get("_target_"):
        raise ConfigError("task.agent._target_: task=agent needs an agent function "
                          "(async def solve(client, row) -> float | dict)")
    target = str(spec["_target_"])
    try:
        fn = get_method(target)
    except Exception as exc:
        raise ConfigError(f"task.agent._target_: cannot import {target!r} ({exc})") from exc
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"task.agent._target_: {target} must be an async def "
                          f"(async def solve(client, row) -> float | dict)")
    extra = {k: v for k, v in spec.items() if k != "_target_"}
    return (functools.partial(fn, **extra) if extra else fn), target


def reward_of(out: Any, *, agent: str) -> tuple[float, dict[str, float]]:
    """``(reward, figures)`` from what the agent returned: a number, or a dict whose
    ``reward`` is one (its other numeric entries are figures)."""
    figures: dict[str, float] = {}
    if isinstance(out, Mapping):
        figures = {str(k): float(v) for k, v in out.items()
                   if k != "reward" and isinstance(v, int | float) and not isinstance(v, bool)}
        out = out.get("reward")
    if isinstance(out, bool) or not isinstance(out, int | float):
        raise AgentError(f"agent {agent}: returned {type(out).__name__} {str(out)[:60]!r}; "
                         f"return the reward (a number) or a dict with 'reward'")
    return float(out), figures


class AgentTask(DatasetTask):
    """Rows of a local dataset, each solved by the user's agent (see the module docstring)."""

    media = False
    turns = 1  # one reward per rollout

    def __init__(self, *, path: str, agent: Mapping[str, Any], prompt_key: str = "prompt",
                 tokenizer: str | None = None, concurrency: int = 8,
                 max_context: int | None = None,
                 shuffle: bool = True, name: str = "agent", media: bool = False,
                 seed: int = 0) -> None:
        if media:
            raise ConfigError("task=agent reads no pixels: drop tq/staging=media")
        if concurrency < 1:
            raise ConfigError(f"task.concurrency: must be >= 1, got {concurrency}")
        if max_context is not None and max_context < 2:
            raise ConfigError(f"task.max_context: must be >= 2, got {max_context}")
        self.agent, self.agent_name = load_agent(agent)
        self.concurrency, self.max_context = concurrency, max_context
        super().__init__(path=path, prompt_key=prompt_key, tokenizer=tokenizer, shuffle=shuffle,
                         seed=seed, name=name,
                         path_hint=": one row per problem, handed to the agent whole")

    def max_sequence_length(self, max_new_tokens: int) -> int:
        """What one rollout may grow to: ``task.max_context``, else its first call (the longest
        prompt and ``max_new_tokens``); past the model's context the endpoint refuses a call
        (a 400 the agent sees), so no training row is longer than the model takes."""
        if self.max_context is not None:
            return self.max_context
        longest = max(len(render(self.tokenizer, r[self.prompt_key])) for r in self.rows)
        return longest + max_new_tokens

    def engine_context(self, max_new_tokens: int, model_max_len: int) -> int:
        """An agent's calls may grow to ``task.max_context``, else the model's context."""
        return self.max_context or model_max_len

    def sample(self, n: int, generator: torch.Generator) -> list[Any]:
        """The agent draws its own rows (:class:`AgentRunner`): no episodes to sample."""
        raise NotImplementedError("task=agent: rollouts run through its rollout_driver")

    def score(self, responses: torch.Tensor, response_lens: torch.Tensor,
              targets: torch.Tensor, target_lens: torch.Tensor) -> torch.Tensor:
        """The agent's own reward scores its rollouts (:class:`AgentRunner`)."""
        raise NotImplementedError("task=agent: the agent returns each rollout's reward")

    def check_recipe(self, recipe: Any) -> None:
        """Refuse what one reward per rollout cannot train."""
        if recipe.algorithm != "grpo":
            raise ConfigError(f"task=agent trains with recipe=grpo (one reward per rollout; "
                              f"recipe.algorithm={recipe.algorithm} needs per-turn rewards)")
        active = SamplingControls.of(recipe).active_keys()
        if active:  # the endpoint samples as each of the agent's requests asks
            raise ConfigError(f"recipe.{active[0]}: task=agent samples as the agent's requests "
                              f"ask (the OpenAI endpoint), not with the recipe's sampling "
                              f"controls; leave recipe.{active[0]} at its default")

    def rollout_driver(self, sink: Any, *, max_new_tokens: int, max_model_len: int | None = None,
                       **_: Any) -> AgentRunner:
        """What drives this task's rollouts on an engine (the builder asks for it): calls stay
        within ``task.max_context``, else the model's ``max_model_len``."""
        return AgentRunner(self, sink, max_new_tokens=max_new_tokens,
                           max_model_len=self.max_context or max_model_len)


class AgentRunner:
    """Runs a step's agent rollouts through an :class:`AgentEndpoint` over the engine; the
    ``RolloutWorker`` interface (``run``) the step sources call."""

    def __init__(self, task: AgentTask, sink: Any, *, max_new_tokens: int,
                 max_model_len: int | None = None) -> None:
        self.task, self.sink, self.max_new_tokens = task, sink, max_new_tokens
        self.max_model_len = max_model_len
        self.endpoint: Any = None
        self.figures: dict[str, float] = {}

    def _serve(self, engine: Any, generator: torch.Generator) -> Any:
        from tq_plugin.rollout.openai.server import AgentEndpoint

        if self.endpoint is None or self.endpoint.engine is not engine:
            self.close()
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            self.endpoint = AgentEndpoint(
                engine, self.sink, self.task.tokenizer, stop_token_ids=[self.task.eos_token_id],
                default_max_tokens=self.max_new_tokens, max_tokens_limit=self.max_new_tokens,
                max_model_len=self.max_model_len, seed=seed)
            self.endpoint.start()
        return self.endpoint

    def run(self, engine: Any, *, step: int, prompts: int, group_size: int,
            generator: torch.Generator) -> RolloutBatch:
        endpoint = self._serve(engine, generator)
        before = dict(endpoint.stats())
        rows = [self.task.rows[i] for i in self.task.stream.next_rows(prompts)]
        jobs = [(f"s{step}-p{p}-g{g}", rows[p]) for p in range(prompts) for g in range(group_size)]
        results = asyncio.run(self._run_all(endpoint, jobs))
        after = endpoint.stats()
        counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        rewards = torch.tensor([reward for _, reward, _ in results], dtype=torch.float32)
        self.figures = {"agent/calls_staged": float(counts.get("calls_staged", 0)),
                        "agent/rollouts_closed": float(counts.get("rollouts_closed", 0)),
                        "agent/rollouts_poisoned": float(counts.get("rollouts_poisoned", 0)),
                        "agent/branches": float(counts.get("branches", 0))}
        for key in sorted({k for _, _, figs in results for k in figs}):
            values = [figs[key] for _, _, figs in results if key in figs]
            self.figures[f"agent/{key}"] = sum(values) / len(values)
        failed = counts.get("stage_failures", 0) + counts.get("engine_failures", 0)
        return RolloutBatch(receipts=[r for r, _, _ in results], turn_scores=rewards.unsqueeze(1),
                            rewards=rewards, staged_calls=int(counts.get("calls_staged", 0)),
                            failed_calls=int(failed))

    async def _run_all(self, endpoint: Any, jobs: list[tuple[str, dict]]) -> list[tuple]:
        """Every job runs to its end, each closing its rollout, before an agent's error stops
        the step: one that raised first does not leave the others cancelled mid-call with their
        rollouts open on the endpoint."""
        gate = asyncio.Semaphore(self.task.concurrency)
        results = await asyncio.gather(*(self._one(endpoint, rid, row, gate)
                                         for rid, row in jobs), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) > 1:
                errors[0].add_note(f"{len(errors)} of the step's {len(jobs)} rollouts failed; "
                                   f"every rollout was closed")
            raise errors[0]
        return list(results)

    async def _one(self, endpoint: Any, rid: str, row: dict, gate: asyncio.Semaphore) -> tuple:
        agent = self.task.agent_name
        async with gate:
            endpoint.open_rollout(rid)
            client = endpoint.client(rid)
            try:
                out = await self.task.agent(client, dict(row))
            except Exception as exc:
                await endpoint.aclose_rollout(rid, reward=0.0)
                raise AgentError(f"agent {agent} ({_where(self.task.agent)}): raised "
                                 f"{type(exc).__name__}: {exc}") from exc
            finally:
                await client.close()
            reward, figures = reward_of(out, agent=agent)
            receipt = await endpoint.aclose_rollout(rid, reward=reward)
            return receipt, reward, figures

    def close(self) -> None:
        """Stop the endpoint (idempotent); the engine and the sink stay the caller's."""
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.stop()


__all__ = ["AgentError", "AgentRunner", "AgentTask", "load_agent", "reward_of"]

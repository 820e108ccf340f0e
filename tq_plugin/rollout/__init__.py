"""The rollout side of the recipes: engines behind one seam, the multi-turn rollout worker that
stages every engine call, the OpenAI-compatible agent endpoint that stages every call an
agent makes (``AgentEndpoint``, the ``serve`` extra), and what an engine takes weights through.

Layering: ``tq_plugin.rl`` → ``tq_plugin.rollout`` → ``tq_plugin.lightning`` → staging → data
plane → config. Nothing here imports ``tq_plugin.rl``: an engine gets the policy module (or its
HF checkpoint) from the recipe.
"""

from tq_plugin.rollout.engine import (
    Completion,
    EngineError,
    NamedWeights,
    RolloutEngine,
    SamplingParams,
)
from tq_plugin.rollout.engines import ENGINES, build_engine
from tq_plugin.rollout.openai.server import AgentEndpoint  # FastAPI is imported when it starts
from tq_plugin.rollout.worker import RolloutBatch, RolloutWorker

__all__ = ["ENGINES", "AgentEndpoint", "Completion", "EngineError", "NamedWeights", "RolloutBatch",
           "RolloutEngine", "RolloutWorker", "SamplingParams", "build_engine"]

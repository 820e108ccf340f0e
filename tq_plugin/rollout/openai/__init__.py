"""The OpenAI-compatible agent endpoint (``AgentEndpoint``, the ``serve`` extra): every call an
agent makes is templated, batched into the engine and staged, and a rollout's calls come back as
one training row.

``server`` (the endpoint and its lifecycle), ``app`` (the FastAPI routes), ``pipeline`` (one
call from body to staged answer), ``calls`` (chat and completion call specs), ``batcher`` (engine
calls batched across requests), ``template`` (prompt splicing), ``session`` (a rollout's calls),
``protocol`` (the wire models and pure helpers).
"""

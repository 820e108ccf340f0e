"""An example agent trained by ``tq-train``: a multi-turn loop with a tool, written with the plain
``openai`` client and nothing of tq_plugin.

The task is the tiny text task's (``make tiny-model``): reverse a few letters. The agent offers
the model a ``hint`` tool; when the model calls it, or answers wrong, the agent gives a hint
(the next letter it got wrong) and asks again, up to ``max_turns`` calls. The reward is the
fraction of letters in the right place in the last answer, so a better policy needs fewer hints
and scores more.

    PYTHONPATH=examples/agents tq-train --config-name grpo task=agent \\
        task.path=outputs/tiny_text/train.jsonl task.agent._target_=reverse_hint.solve \\
        model=hf_causal_lm model.pretrained_path=outputs/tiny_text/model engine=hf

Any agent works the same way: ``async def solve(client, row) -> float | dict``, where
``client`` is an ``openai.AsyncOpenAI`` bound to one rollout and ``row`` one dataset row.
"""

from __future__ import annotations

import json
from typing import Any

import openai

HINT_TOOL = {
    "type": "function",
    "function": {
        "name": "hint",
        "description": "Reveal the letter at a position (0-based) of the reversed text.",
        "parameters": {"type": "object", "properties": {"position": {"type": "integer"}},
                       "required": ["position"]},
    },
}


def letters(text: str) -> list[str]:
    return [c for c in text if c.isalpha()]


def score(answer: str, target: str) -> float:
    """The fraction of the target's letters that the answer has in the same place."""
    got, want = letters(answer), letters(target)
    return sum(a == b for a, b in zip(got, want)) / len(want) if want else 0.0


def first_wrong(answer: str, target: str) -> int:
    got, want = letters(answer), letters(target)
    return next((i for i, w in enumerate(want) if i >= len(got) or got[i] != w), len(want))


async def solve(client: Any, row: dict, *, max_turns: int = 3) -> dict:
    messages = list(row["prompt"]) if isinstance(row["prompt"], list) else [
        {"role": "user", "content": row["prompt"]}]
    target, answer, hints = row["answer"], "", 0
    for turn in range(max_turns):
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[HINT_TOOL])  # max_tokens: the recipe's
        except openai.BadRequestError:  # the conversation outgrew the model's context: stop here
            break
        message = reply.choices[0].message
        if message.tool_calls:  # the model asked for a hint: answer the tool call
            messages.append({"role": "assistant", "content": message.content or "",
                             "tool_calls": [c.model_dump() for c in message.tool_calls]})
            for call in message.tool_calls:
                position = int(json.loads(call.function.arguments or "{}").get("position", 0))
                wanted = letters(target)
                found = wanted[position] if 0 <= position < len(wanted) else ""
                messages.append({"role": "tool", "tool_call_id": call.id, "content": found})
            hints += 1
            continue
        answer = message.content or ""
        if score(answer, target) == 1.0 or turn == max_turns - 1:
            break
        # Wrong: say which letter to fix, and ask again (the conversation keeps every turn).
        i = first_wrong(answer, target)
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": f"hint: letter {i} is {letters(target)[i]}"})
        hints += 1
    return {"reward": score(answer, target), "hints": hints, "turns": turn + 1}

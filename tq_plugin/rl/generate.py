"""Batched sampling from the policy (the rollout engine of the recipes)."""

from __future__ import annotations

import torch

from tq_plugin.rl.model import TinyTransformer
from tq_plugin.rl.task import EOS, PAD


@torch.no_grad()
def sample_continuations(
    policy: TinyTransformer,
    contexts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    image_patches: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample up to ``max_new_tokens`` per context (stopping after ``EOS``).

    All rows advance together on one right-padded buffer; causal attention makes the padding after
    each row's current end invisible to it. The    returned logprobs are those of the tempered distribution, the one training recomputes.
    Returns the new tokens (``EOS`` included when emitted) and their logprobs.
    """
    b = len(contexts)
    lens = torch.tensor([len(c) for c in contexts])
    buf = torch.full((b, int(lens.max()) + max_new_tokens), PAD, dtype=torch.long)
    for i, c in enumerate(contexts):
        buf[i, : len(c)] = torch.tensor(c)
    rows = torch.arange(b)
    out_tok = torch.full((b, max_new_tokens), PAD, dtype=torch.long)
    out_lp = torch.zeros(b, max_new_tokens)
    active = torch.ones(b, dtype=torch.bool)
    n_new = torch.zeros(b, dtype=torch.long)
    was_training = policy.training
    policy.eval()
    for step in range(max_new_tokens):
        width = int(lens.max())
        logits = policy(buf[:, :width], image_patches=image_patches)
        logp = torch.log_softmax(logits[rows, lens - 1].float() / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        lp = logp[rows, tok]
        out_tok[active, step] = tok[active]
        out_lp[active, step] = lp[active]
        buf[rows[active], lens[active]] = tok[active]
        lens = lens + active.long()
        n_new += active.long()
        active = active & (tok != EOS)
        if not active.any():
            break
    policy.train(was_training)
    counts = n_new.tolist()
    return ([out_tok[i, : counts[i]].tolist() for i in range(b)],
            [out_lp[i, : counts[i]].tolist() for i in range(b)])

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
    each row's current end invisible to it. The returned logprobs are those of the tempered
    distribution, the one training recomputes. Returns the new tokens (``EOS`` included when
    emitted) and their logprobs.

    The token buffer the policy reads lives on the policy's device (``image_patches`` are moved
    there); the bookkeeping stays on the host, where each step's next-token distribution comes
    back (one ``[rows, vocab]`` copy per token) to be drawn from ``generator`` (the recipes' is a
    CPU generator: a run draws the same stream on every device and its state checkpoints as bytes).
    """
    device = device_of(policy)
    b = len(contexts)
    lens = torch.tensor([len(c) for c in contexts])
    buf = torch.full((b, int(lens.max()) + max_new_tokens), PAD, dtype=torch.long)
    for i, c in enumerate(contexts):
        buf[i, : len(c)] = torch.tensor(c)
    buf = buf.to(device)
    if image_patches is not None:
        image_patches = image_patches.to(device)
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
        last = logits[rows.to(device), (lens - 1).to(device)].float()
        logp = torch.log_softmax(last / temperature, dim=-1).cpu()
        tok = torch.multinomial(logp.exp().to(generator.device), 1,
                                generator=generator).squeeze(1).cpu()
        lp = logp[rows, tok]
        out_tok[active, step] = tok[active]
        out_lp[active, step] = lp[active]
        buf[rows[active].to(device), lens[active].to(device)] = tok[active].to(device)
        lens = lens + active.long()
        n_new += active.long()
        active = active & (tok != EOS)
        if not active.any():
            break
    policy.train(was_training)
    counts = n_new.tolist()
    return ([out_tok[i, : counts[i]].tolist() for i in range(b)],
            [out_lp[i, : counts[i]].tolist() for i in range(b)])


def device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live (the CPU for a model without parameters)."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")

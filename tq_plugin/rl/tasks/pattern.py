"""The synthetic task: produce a target pattern of variable length, over several turns.

The pattern is an ascending run of symbols (mod ``num_symbols``): a start symbol and a length. The
prompt is ``BOS, start, LEN_n, SEP``; in media mode the start symbol is not in the text at all:
the prompt holds an image placeholder token and the symbol is drawn as a coloured pixel patch the
policy must read. The policy answers with symbols and ``EOS``. Each turn is scored by the fraction of positions that match
the target (a wrong length counts as misses), the environment replies ``GOOD``/``BAD`` + ``SEP``,
and the next turn asks again with the whole conversation as context. A random policy scores ~0.1;
a policy that learned to copy scores 1.0, so the reward curve shows whether the pipeline trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tq_plugin.rl.tasks.protocol import Task

PAD, BOS, EOS, SEP, GOOD, BAD, IMG = range(7)
NUM_SPECIAL = 7


@dataclass
class Episode:
    """One prompt's target; ``image`` holds its staged pixels in media mode."""

    target: list[int]
    prompt: list[int]
    image: dict[str, torch.Tensor] | None = None


class PatternTask(Task):
    # The token ids the rollout worker, reassembler and models are given.
    eos_token_id = EOS
    pad_token_id = PAD
    image_token_id = IMG

    def __init__(
        self,
        *,
        num_symbols: int = 6,
        min_len: int = 2,
        max_len: int = 5,
        turns: int = 2,
        patch_size: int = 2,
        name: str = "pattern",
        media: bool = False,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.num_symbols = num_symbols
        self.min_len = min_len
        self.max_len = max_len
        self.turns = turns
        self.patch_size = patch_size
        self.media = media
        palette = torch.Generator().manual_seed(1234 + seed)
        # One distinct colour per symbol; patches get light noise so the encoder has to generalize.
        self.palette = torch.rand(num_symbols, 3, generator=palette)

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + self.num_symbols + self.max_len

    def length_token(self, n: int) -> int:
        return NUM_SPECIAL + self.num_symbols + n - 1

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens the policy may emit: the symbols and EOS."""
        return [EOS, *range(NUM_SPECIAL, NUM_SPECIAL + self.num_symbols)]

    def max_sequence_length(self, max_new_tokens: int) -> int:
        return 4 + self.turns * (max_new_tokens + 2)

    def sample(self, n: int, generator: torch.Generator) -> list[Episode]:
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator).tolist()
        starts = torch.randint(0, self.num_symbols, (n,), generator=generator).tolist()
        episodes = []
        for start, length in zip(starts, lengths):
            target = [NUM_SPECIAL + (start + i) % self.num_symbols for i in range(length)]
            if self.media:
                prompt = [BOS, IMG, self.length_token(length), SEP]
                episodes.append(Episode(target, prompt, self.draw(start, generator)))
            else:
                prompt = [BOS, NUM_SPECIAL + start, self.length_token(length), SEP]
                episodes.append(Episode(target, prompt))
        return episodes

    def draw(self, symbol: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Media attachments for one call: one ``P x P`` RGB patch in the symbol's colour,
        ``imgs [1, 1, 3*P*P]`` float32 and ``imgs_sizes [[P, P]]`` int32."""
        p = self.patch_size
        patch = self.palette[symbol][:, None].expand(3, p * p).reshape(1, 1, -1)
        noise = 0.05 * torch.randn(patch.shape, generator=generator)
        imgs = (patch + noise).to(torch.float32).contiguous()
        return {"imgs": imgs, "imgs_sizes": torch.tensor([[p, p]], dtype=torch.int32)}

    @staticmethod
    def score(responses: torch.Tensor, response_lens: torch.Tensor,
              targets: torch.Tensor, target_lens: torch.Tensor) -> torch.Tensor:
        """Per-row fraction of matched positions over ``max(len(response), len(target))``.

        ``responses [B, R]`` / ``targets [B, T]`` are right-padded; lengths exclude ``EOS``.
        """
        width = max(responses.shape[1], targets.shape[1])
        r = torch.nn.functional.pad(responses, (0, width - responses.shape[1]), value=PAD)
        t = torch.nn.functional.pad(targets, (0, width - targets.shape[1]), value=PAD)
        pos = torch.arange(width).unsqueeze(0)
        valid = pos < torch.minimum(response_lens, target_lens).unsqueeze(1)
        hits = ((r == t) & valid).sum(1).float()
        return hits / torch.maximum(response_lens, target_lens).clamp(min=1).float()

    @property
    def evaluates(self) -> bool:
        """Held-out episodes of a generator of their own (none in media mode)."""
        return not self.media

    def evaluate(self, generate, *, max_new_tokens: int, size: int = 64) -> dict[str, float]:
        """First-turn scores of greedy completions (``generate(prompts) -> [ids]``) of ``size``
        episodes drawn from a generator of their own (the same every time, never trained on
        as such): ``{"reward": mean, "accuracy": fraction matched in full}``."""
        if self.media:
            return {}  # the engines that read pixels take them per call, not here
        episodes = self.sample(size, torch.Generator().manual_seed(987_654_321))
        outs = [o[:-1] if o and o[-1] == EOS else o for o in generate([e.prompt for e in episodes])]
        padded = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(o if o else [PAD]) for o in outs], batch_first=True)
        targets = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(e.target) for e in episodes], batch_first=True)
        scores = self.score(padded, torch.tensor([len(o) for o in outs]), targets,
                            torch.tensor([len(e.target) for e in episodes]))
        return {"reward": float(scores.mean()), "accuracy": float((scores >= 1.0).float().mean())}

    @staticmethod
    def feedback(scores: torch.Tensor) -> list[list[int]]:
        return [[GOOD if s >= 1.0 else BAD, SEP] for s in scores.tolist()]

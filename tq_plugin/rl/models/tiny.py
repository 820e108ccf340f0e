"""A small causal transformer over the synthetic task's vocabulary, CPU-friendly.

One forward serves both training layouts the Lightning mixin produces:

* ``padded``: ``input_ids [B, S]``; every row is one sequence (segment 0).
* ``packed``: ``input_ids [1, T]`` holding several sequences back to back, with ``position_ids``
  restarting at 0 and ``segment_ids`` telling the sequences apart. Attention is causal *within* a
  segment only, so a packed row computes exactly what the padded rows would. The linear layers
  run on the packed tokens; attention scatters them into a ``[segments, longest]`` block for the
  one causal SDPA call and gathers them back (a CPU stand-in for varlen attention kernels), so a
  packed row never pays a ``T x T`` mask.

Media: positions whose token is ``image_token_id`` take their embedding from the row's staged
pixel patches (one patch per placeholder, in order), so the model conditions on the pixels.

``forward(..., score=TokenScoring(...))`` (:mod:`tq_plugin.rl.models.protocol`) returns the
tokens' logprobs (and entropy) from the final hidden states and the head, never the logits.
``gradient_checkpointing=True`` recomputes each block in backward (``torch.utils.checkpoint``)
instead of keeping its activations; ``dtype`` is the weights' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tq_plugin.rl.models.protocol import TokenScoring, weight_dtype


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.dropout = dropout

    def forward(self, x: torch.Tensor, unpack: tuple[torch.Tensor, int, int] | None) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, d // self.n_heads)
        if unpack is not None:  # packed row: attend per segment in a [segments, longest] block
            slot, segments, longest = unpack
            block = qkv.new_zeros(segments * longest, 3, self.n_heads, d // self.n_heads)
            block[slot] = qkv[0]
            qkv = block.view(segments, longest, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        ).transpose(1, 2)
        if unpack is not None:
            y = y.reshape(-1, self.n_heads, d // self.n_heads)[unpack[0]].unsqueeze(0)
        x = x + self.proj(y.reshape(b, s, d))
        return x + self.mlp(self.ln2(x))

    def cached(self, x: torch.Tensor, allowed: torch.Tensor,
               past: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The block on new positions ``x [B, s, d]`` after the cached keys and values ``past``
        (``[B, heads, cached, d / heads]`` each); ``allowed [B, 1, s, cached + s]``: which keys
        each new position sees. Returns the output and the keys and values with the new ones."""
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, d // self.n_heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)
        x = x + self.proj(y.reshape(b, s, d))
        return x + self.mlp(self.ln2(x)), (k, v)


class TinyTransformer(nn.Module):
    """Causal LM trunk with an LM head (policy) or a scalar head (value, ``value_head=True``)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        max_seq_len: int = 64,
        dropout: float = 0.0,
        value_head: bool = False,
        image_token_id: int | None = None,
        patch_dim: int | None = None,
        output_token_ids: list[int] | None = None,
        gradient_checkpointing: bool = False,
        dtype: str = "float32",
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.gradient_checkpointing = gradient_checkpointing
        self.max_seq_len = max_seq_len
        self.image_token_id = image_token_id
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.patch = nn.Linear(patch_dim, d_model) if patch_dim else None
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 1 if value_head else vocab_size)
        # Tokens the policy may never emit get a large negative bias: sampling and the logprobs
        # training recomputes see the same restricted distribution, with no infinities.
        bias = torch.zeros(vocab_size)
        if output_token_ids is not None and not value_head:
            bias.fill_(-1e4)
            bias[torch.tensor(output_token_ids)] = 0.0
        self.register_buffer("out_bias", bias, persistent=False)
        self.apply(self._init)
        self.to(weight_dtype(dtype))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        image_patches: torch.Tensor | None = None,
        score: TokenScoring | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, S, V]`` (or values ``[B, S]``) for the next token after each position;
        with ``score``: the tokens' ``(logprobs, entropy)`` instead (policy only)."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        x = self.tok(input_ids) + self.pos(position_ids.clamp(max=self.max_seq_len - 1))
        if self.patch is not None and image_patches is not None and image_patches.numel():
            slots = input_ids == self.image_token_id
            if int(slots.sum()) != image_patches.shape[0]:
                raise ValueError(
                    f"image_patches holds {image_patches.shape[0]} patches but the batch has "
                    f"{int(slots.sum())} image placeholder tokens"
                )
            x = x.masked_scatter(slots.unsqueeze(-1), self.patch(image_patches.to(x.dtype)))
        unpack = None
        if segment_ids is not None:
            if b != 1:
                raise ValueError(f"a packed batch is one row [1, T], got input_ids {tuple(input_ids.shape)}")
            segments = int(segment_ids.max()) + 1
            longest = int(position_ids.max()) + 1
            unpack = ((segment_ids[0] * longest + position_ids[0]), segments, longest)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, unpack, use_reentrant=False)
            else:
                x = block(x, unpack)
        hidden = self.ln_f(x)
        if score is not None:
            if self.head.out_features == 1:
                raise ValueError("score= is for the policy: the value model returns values")
            return score.from_hidden(hidden, input_ids, self.head.weight,
                                     self.head.bias + self.out_bias)
        out = self.head(hidden)
        return out.squeeze(-1) if out.shape[-1] == 1 else out + self.out_bias

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, cache: list | None
                    ) -> tuple[torch.Tensor, list]:
        """One cached decoding step of the policy (``engine=native``'s KV cache): the logits
        ``[B, V]`` after the last of the new tokens ``input_ids [B, s]`` (at ``position_ids``),
        and the cache with their keys and values. ``attention_mask [B, cached + s]``: 0 on left
        padding, which no real token attends to; ``cache``: the last call's, ``None`` first."""
        if self.head.out_features == 1:
            raise ValueError("decode_step is for the policy: the value model returns values")
        s, total = input_ids.shape[1], attention_mask.shape[1]
        keys = torch.arange(total, device=input_ids.device)
        new = keys[total - s:].unsqueeze(1)
        # Causal over the real keys; each position sees itself too, so a padding position's
        # attention is never empty (its output is never read).
        allowed = ((keys <= new) & attention_mask.bool()[:, None, :]) | (keys == new)
        x = self.tok(input_ids) + self.pos(position_ids.clamp(max=self.max_seq_len - 1))
        cache = cache or [None] * len(self.blocks)
        out = []
        for block, past in zip(self.blocks, cache):
            x, kv = block.cached(x, allowed.unsqueeze(1), past)
            out.append(kv)
        return self.head(self.ln_f(x[:, -1])) + self.out_bias, out


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``lp[:, t] = log p(input_ids[:, t] | tokens < t)``; position 0 gets 0."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0))


def shift_values(values: torch.Tensor) -> torch.Tensor:
    """Align a value head with actions: the value of the state *before* token t, at t."""
    return F.pad(values[:, :-1], (1, 0))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return F.pad(-(lp.exp() * lp).sum(-1), (1, 0))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["TinyTransformer", "count_params", "entropy", "shift_values", "token_logprobs"]

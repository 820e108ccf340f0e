"""``model=hf_causal_lm``: a Hugging Face ``transformers`` causal LM as the recipes' policy or value.

Needs the ``hf`` extra (``pip install 'tq_plugin[hf]'``). The backbone is built either from a
config (``model_type``, random init, nothing downloaded) or from a local ``pretrained_path``
(a ``save_pretrained`` directory in safetensors; the hub is never asked, pickled ``.bin``
weights are refused).

Layouts (:mod:`tq_plugin.rl.models.protocol`): a padded batch goes in as is (right padding after
causal tokens needs no mask). A packed row (``segment_ids`` or ``cu_seqlens``) runs the backbone
as its sequences side by side, one per row of a right-padded ``[segments, longest]`` block with
the row's ``position_ids``, and its outputs are gathered back into the row: each sequence sees
only itself (what a block-diagonal causal mask gives) at the cost of its own length, not the
``T x T`` of one masked attention over the row (2x the training step at toy shapes on CPU).

The value model is the same backbone class without its LM head plus a linear head giving one
value per token, so ``pretrained_path`` initializes both from the same checkpoint.

Sizes (``d_model``, ``n_layers``, ``n_heads``, ``head_dim``, ``max_seq_len``) the config leaves
unset (``null``) come from the checkpoint's ``config.json`` with ``pretrained_path``, else from
:data:`DEFAULT_SIZES`; a size set to another value than the checkpoint's is a ``ConfigError``
naming the key (``max_seq_len`` may be set below the checkpoint's, as a cap on the run's
episodes). A Hub id in ``pretrained_path`` is refused with the command that downloads it.

``forward(..., score=TokenScoring(...))`` runs the trunk alone and takes the tokens' logprobs
from its last hidden states and the LM head in chunks (:mod:`tq_plugin.rl.models.logprobs`):
the ``[B, S, V]`` logits are never built. Models whose logits are not ``hidden @ W.T`` (a logit
scale or final soft-capping) reduce their full logits instead. ``gradient_checkpointing=True``
is the transformers model's own (``gradient_checkpointing_enable``); ``dtype`` the weights'.
``lora`` (``model.lora``, the ``lora`` extra): PEFT's LoRA adapters injected into the backbone,
the base frozen (:mod:`tq_plugin.rl.models.lora`); ``r: null`` builds the model as without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_plugin.config.schema import ConfigError, check_pretrained_path
from tq_plugin.rl.models.lora import attach_lora, lora_options
from tq_plugin.rl.models.protocol import TokenScoring, output_bias, scatter_patches, weight_dtype

try:
    import transformers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("model=hf_causal_lm needs transformers: pip install 'tq_plugin[hf]'") from exc

# Attention kernels that honour a custom 4-D mask on CPU; flash-attention kernels take packed
# rows through position_ids alone and are not wired here.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# The model group's sizes without pretrained_path (null in the config: these).
DEFAULT_SIZES = {"d_model": 64, "n_layers": 2, "n_heads": 2, "head_dim": None, "max_seq_len": 64}
# model.<key> -> the transformers config attribute it must equal.
_CHECKPOINT_KEYS = {"d_model": "hidden_size", "n_layers": "num_hidden_layers",
                    "n_heads": "num_attention_heads", "head_dim": "head_dim",
                    "max_seq_len": "max_position_embeddings"}
_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                 "summary_first_dropout")


def _config(model_type: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
            max_seq_len: int, dropout: float, head_dim: int | None = None) -> Any:
    try:
        cfg = transformers.AutoConfig.for_model(model_type)
    except ValueError as exc:
        raise ValueError(f"model.model_type: transformers has no model type {model_type!r}") from exc
    cfg.update({"vocab_size": vocab_size, "hidden_size": d_model, "num_hidden_layers": n_layers,
                "num_attention_heads": n_heads, "max_position_embeddings": max_seq_len})
    if hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = n_heads
    # Configs with their own head_dim default (llama: 128) would otherwise project d_model to
    # n_heads * 128 whatever d_model is: one head is d_model / n_heads wide unless asked.
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = head_dim if head_dim is not None else d_model // n_heads
    if hasattr(cfg, "intermediate_size"):
        cfg.intermediate_size = 4 * d_model
    # Several configs default to 0.1 dropout: the recipe's ratio of new to old logprobs must be 1
    # before the first update, so dropout is whatever model.dropout says, everywhere.
    cfg.update({k: dropout for k in _DROPOUT_KEYS if hasattr(cfg, k)})
    return cfg


def checkpoint_config(pretrained_path: str | Path) -> Any:
    """The transformers config of a local ``save_pretrained`` directory (checked first: a Hub id
    gets the download command, a directory without ``config.json`` or safetensors is named)."""
    check_pretrained_path(str(pretrained_path))
    path = Path(pretrained_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.pretrained_path: {path} holds no config.json "
                                f"(a local save_pretrained directory is needed)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model.pretrained_path: {path} holds no safetensors "
                                f"weights (model.safetensors or its shards); pickled "
                                f".bin weights are refused")
    return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)


def checkpoint_sizes(cfg: Any) -> dict[str, int]:
    """The model group's sizes as a transformers config holds them."""
    sizes = {key: getattr(cfg, attr, None) for key, attr in _CHECKPOINT_KEYS.items()}
    if sizes["head_dim"] is None:
        sizes["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    return sizes


def resolve_sizes(pretrained_path: str | Path | None, **given: int | None) -> dict[str, int | None]:
    """The model group's sizes (``given``: the config's, ``None`` where unset), completed from the
    checkpoint's config (``pretrained_path``) or :data:`DEFAULT_SIZES`. A size that contradicts the
    checkpoint is a ``ConfigError`` naming ``model.<key>``; ``max_seq_len`` may be lower than the
    checkpoint's ``max_position_embeddings`` (a cap), never higher."""
    unknown = sorted(set(given) - set(DEFAULT_SIZES))
    if unknown:
        raise ValueError(f"resolve_sizes: unknown size(s) {unknown}")
    if pretrained_path is None:
        return {k: given[k] if given.get(k) is not None else v for k, v in DEFAULT_SIZES.items()}
    ckpt = checkpoint_sizes(checkpoint_config(pretrained_path))
    out: dict[str, int | None] = {}
    for key, theirs in ckpt.items():
        mine = given.get(key)
        attr = _CHECKPOINT_KEYS[key]
        if mine is None or mine == theirs:
            out[key] = theirs
        elif key == "max_seq_len" and mine < theirs:
            out[key] = mine
        elif key == "max_seq_len":
            raise ConfigError(f"model.max_seq_len={mine} exceeds the checkpoint's {attr} "
                              f"({theirs}); leave model.max_seq_len unset to take the "
                              f"checkpoint's")
        else:
            raise ConfigError(f"model.{key}={mine} contradicts the checkpoint's {attr}={theirs} "
                              f"({pretrained_path}/config.json): leave model.{key} unset to take "
                              f"the checkpoint's")
    return out


def packed_slots(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(slot [T], segments, longest)`` of a packed ``[1, T]`` row: token ``t`` of the row is
    slot ``t`` of the flattened right-padded ``[segments, longest]`` block (its sequence's
    row, its offset in the sequence). A sequence is a run of equal ``segment_ids``."""
    _, counts = torch.unique_consecutive(segment_ids[0], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    run = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    longest = int(counts.max())
    offset = torch.arange(segment_ids.shape[1], device=counts.device) - starts[run]
    return run * longest + offset, counts.numel(), longest


def _block(row: torch.Tensor, slot: torch.Tensor, segments: int, longest: int) -> torch.Tensor:
    """A packed row's ``[1, T, ...]`` tensor as the ``[segments, longest, ...]`` block (0 in
    the padding)."""
    block = row.new_zeros((segments * longest, *row.shape[2:]))
    block[slot] = row[0]
    return block.view(segments, longest, *row.shape[2:])


def _unblock(block: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The block's ``[segments, longest, ...]`` outputs back in the row's ``[1, T, ...]``: a
    tensor of its own (indexed with ``[1, T]``), not a view, since an FSDP2 root module's
    returned view loses its pre-backward hook to an in-place op."""
    return block.reshape(-1, *block.shape[2:])[slot.unsqueeze(0)]


class HFCausalLM(nn.Module):
    """A transformers causal LM (policy: logits ``[B, S, V]``) or its backbone plus a scalar head
    (``value_head=True``: values ``[B, S]``), following :class:`~tq_plugin.rl.models.protocol.TokenModel`."""

    def __init__(
        self,
        vocab_size: int,
        *,
        model_type: str = "llama",
        pretrained_path: str | None = None,
        attn_implementation: str = "sdpa",
        d_model: int | None = None,
        n_layers: int | None = None,
        n_heads: int | None = None,
        max_seq_len: int | None = None,
        dropout: float = 0.0,
        head_dim: int | None = None,
        value_head: bool = False,
        image_token_id: int | None = None,
        patch_dim: int | None = None,
        output_token_ids: list[int] | None = None,
        gradient_checkpointing: bool = False,
        dtype: str = "float32",
        lora: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"model.attn_implementation: must be one of "
                             f"{list(ATTN_IMPLEMENTATIONS)}, got {attn_implementation!r}")
        auto = transformers.AutoModel if value_head else transformers.AutoModelForCausalLM
        torch_dtype = weight_dtype(dtype)
        # The sizes are checked on the config alone, before any weight is read.
        sizes = resolve_sizes(pretrained_path, d_model=d_model, n_layers=n_layers,
                              n_heads=n_heads, head_dim=head_dim, max_seq_len=max_seq_len)
        self.max_seq_len = sizes["max_seq_len"]
        if pretrained_path is not None:
            cfg = checkpoint_config(pretrained_path)
            if cfg.vocab_size < vocab_size:
                raise ValueError(f"model.pretrained_path: the checkpoint's vocab_size "
                                 f"({cfg.vocab_size}) is smaller than the task's ({vocab_size})")
            self.backbone = auto.from_pretrained(
                str(pretrained_path), local_files_only=True, use_safetensors=True,
                dtype=torch_dtype, attn_implementation=attn_implementation)
        else:
            cfg = _config(model_type, vocab_size=vocab_size, dropout=dropout, **{
                k: sizes[k] for k in ("d_model", "n_layers", "n_heads", "max_seq_len", "head_dim")})
            cfg._attn_implementation = attn_implementation
            self.backbone = auto.from_config(cfg, dtype=torch_dtype)
        # model.lora: adapters injected into the backbone in place, the base frozen; the
        # PeftModel kept beside it, not as a submodule (lora.py says why).
        options = lora_options(lora)
        self.__dict__["peft_model"] = (None if options is None else
                                       attach_lora(self.backbone, options, causal_lm=not value_head))
        if gradient_checkpointing:
            self.backbone.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        hidden = cfg.hidden_size
        self.image_token_id = image_token_id
        self.patch = nn.Linear(patch_dim, hidden) if patch_dim else None
        self.head = nn.Linear(hidden, 1) if value_head else None
        if self.head is not None:
            nn.init.normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
        for extra in (self.patch, self.head):
            if extra is not None:
                extra.to(torch_dtype)
        self.register_buffer("out_bias", output_bias(
            cfg.vocab_size, None if value_head else output_token_ids), persistent=False)

    def sharding_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (:func:`tq_plugin.rl.models.fsdp.shard_model`): the
        backbone's decoder layers, so one layer's full weights exist at a time in forward and
        backward; what is left (embeddings, final norm, heads) is sharded with the whole model."""
        inner = self.backbone
        for name in ("model", "transformer"):  # llama-like / gpt2-like causal LMs wrap a trunk
            inner = getattr(inner, name, inner)
        layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
        return list(layers) if layers is not None else []

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        image_patches: torch.Tensor | None = None,
        score: TokenScoring | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, S, V]`` (or values ``[B, S]``) for the next token after each position;
        with ``score``: the tokens' ``(logprobs, entropy)`` instead (policy only)."""
        kwargs: dict[str, Any] = {"use_cache": False}
        if self.patch is not None and image_patches is not None and image_patches.numel():
            embeds = self.backbone.get_input_embeddings()(input_ids)
            kwargs["inputs_embeds"] = scatter_patches(embeds, input_ids, self.image_token_id,
                                                      self.patch(image_patches.to(embeds.dtype)))
        else:
            kwargs["input_ids"] = input_ids
        if segment_ids is None and cu_seqlens is not None:
            counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            segment_ids = torch.repeat_interleave(
                torch.arange(counts.shape[0], device=input_ids.device), counts).unsqueeze(0)
        unpack = None
        if segment_ids is not None:
            if input_ids.shape[0] != 1 or position_ids is None:
                raise ValueError(f"a packed batch is one row [1, T] with position_ids, got "
                                 f"input_ids {tuple(input_ids.shape)}")
            unpack = packed_slots(segment_ids)
            kwargs = {k: _block(v, *unpack) if torch.is_tensor(v) else v
                      for k, v in (kwargs | {"position_ids": position_ids}).items()}
        elif position_ids is not None:
            kwargs["position_ids"] = position_ids
        if score is not None:
            return self._score(kwargs, input_ids, score, unpack)
        out = self.backbone(**kwargs)
        if self.head is not None:
            values = self.head(out.last_hidden_state).squeeze(-1)
            # A new tensor, not a view of the head's output: an FSDP2 root module's returned
            # view loses its pre-backward hook to an in-place op (torch warns on every call).
            return values.clone() if unpack is None else _unblock(values, unpack[0])
        logits = out.logits if unpack is None else _unblock(out.logits, unpack[0])
        return logits + self.out_bias


    def _projection(self) -> nn.Module | None:
        """The LM head when the logits are ``hidden @ W.T (+ b)``; ``None`` for a model that
        scales or soft-caps them (its full logits are reduced instead)."""
        cfg = self.backbone.config
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) \
                not in (None, 1, 1.0) or getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0):
            return None
        return self.backbone.get_output_embeddings()

    def _score(self, kwargs: dict[str, Any], input_ids: torch.Tensor, score: TokenScoring,
               unpack: tuple[torch.Tensor, int, int] | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.head is not None:
            raise ValueError("score= is for the policy: the value model returns values")

        def row(t: torch.Tensor) -> torch.Tensor:
            return t if unpack is None else _unblock(t, unpack[0])

        head = self._projection()
        if head is None:
            return score.from_logits(row(self.backbone(**kwargs).logits) + self.out_bias,
                                     input_ids)
        hidden = row(self.backbone.base_model(**kwargs).last_hidden_state)
        bias = self.out_bias if head.bias is None else head.bias + self.out_bias
        return score.from_hidden(hidden, input_ids, head.weight, bias)


__all__ = ["ATTN_IMPLEMENTATIONS", "DEFAULT_SIZES", "HFCausalLM", "checkpoint_config",
           "checkpoint_sizes", "packed_slots", "resolve_sizes"]

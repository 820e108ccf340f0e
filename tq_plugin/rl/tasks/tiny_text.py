"""``make tiny-model``: the shipped text task's data, a tokenizer trained on it, and a small
random-init HF causal LM, all written locally (nothing is downloaded).

The task (``reverse``): a prompt asks for a few space-separated letters in reverse order
(``reverse: c a d`` -> ``d a c``), a verifiable reward scores the completion
(:func:`tq_plugin.rl.tasks.rewards.token_match`: the fraction of letters in the right place). Prompts
are chat messages, so the tokenizer's chat template renders them.

Written under ``--out`` (default ``outputs/tiny_text``): ``train.jsonl``, ``eval.jsonl`` (a
held-out split) and ``model/`` (``save_pretrained``: config, safetensors, tokenizer with its
chat template). The last line printed is the model directory::

    python -m tq_plugin.rl.tasks.tiny_text --out outputs/tiny_text
    tq-train --config-name grpo task=prompts task.path=outputs/tiny_text/train.jsonl \\
        task.eval_path=outputs/tiny_text/eval.jsonl model=hf_causal_lm \\
        model.pretrained_path=outputs/tiny_text/model
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|endoftext|>"]  # the last: what Qwen2Tokenizer adds when it is missing
# Renders messages as <|role|>content...; add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def reverse_rows(n: int, *, letters: str = "abcde", min_len: int = 2, max_len: int = 3,
                 seed: int = 0) -> list[dict]:
    """``n`` rows ``{"prompt": [user message], "answer": ...}`` of the reverse task."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = [rng.choice(letters) for _ in range(rng.randint(min_len, max_len))]
        rows.append({"prompt": [{"role": "user", "content": "reverse: " + " ".join(word)}],
                     "answer": " ".join(reversed(word))})
    return rows


def _texts(rows: list[dict]) -> list[str]:
    # The task=prompts feedback lines too, so a multi-turn run can tokenize them.
    return ([m["content"] for r in rows for m in r["prompt"]] + [r["answer"] for r in rows]
            + [" Correct.", " Try again."])


def train_tokenizer(texts: list[str], *, vocab_size: int = 48):
    """A byte-level BPE tokenizer trained on ``texts`` with ``tokenizers``, wrapped as a
    transformers fast tokenizer with EOS/pad/BOS and the chat template.

    Its pre-tokenizer is Qwen2's (the regex split, then byte-level), so ``AutoTokenizer``, which
    rebuilds a ``qwen2`` checkpoint's tokenizer from its vocab and merges, gets the same one back.
    Its alphabet is the bytes the text holds, not all 256: a random policy over ~50 tokens finds
    the letters far sooner than over 300."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, *, model_type: str = "qwen2", d_model: int = 64, n_layers: int = 2,
                n_heads: int = 2, max_positions: int = 64, seed: int = 0):
    """A random-init causal LM sized for the CPU (``n_heads=2``: head_dim 32, which vLLM's CPU
    attention needs), with the tokenizer's special ids in its config."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=d_model, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=d_model // n_heads,
        intermediate_size=4 * d_model, max_position_embeddings=max_positions,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    for key in ("attention_dropout", "hidden_dropout"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_tiny_model(out: str | Path, *, train_rows: int = 2000, eval_rows: int = 64,
                    model_type: str = "qwen2", seed: int = 0) -> Path:
    """Write the task's ``train.jsonl`` / ``eval.jsonl`` and ``model/`` under ``out``; returns
    the model directory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train = reverse_rows(train_rows, seed=seed)
    held_out = reverse_rows(eval_rows, seed=seed + 1)
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "eval.jsonl", held_out)
    tokenizer = train_tokenizer(_texts(train))
    model = build_model(tokenizer, model_type=model_type, seed=seed)
    model_dir = out / "model"
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    return model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/tiny_text")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model_dir = make_tiny_model(args.out, seed=args.seed)
    out = Path(args.out)
    print(f"data: {out / 'train.jsonl'} {out / 'eval.jsonl'}")
    print(model_dir)


if __name__ == "__main__":
    main()


__all__ = ["CHAT_TEMPLATE", "build_model", "make_tiny_model", "reverse_rows", "train_tokenizer"]

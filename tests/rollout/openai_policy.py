"""A chat policy for the endpoint tests, built locally (nothing downloaded): a byte-level BPE
tokenizer over every byte with a Qwen-style chat template (``<|im_start|>role\\n...<|im_end|>\\n``,
tools declared in a system block, Hermes ``<tool_call>`` blocks), and a random-init 2-layer
qwen2 causal LM over its vocabulary, saved as an HF checkpoint the ``hf`` and ``vllm``
engines load. The template closes every message with EOS then a newline, the case where a
re-templated history drifts from the sampled tokens (bytes after EOS).
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "reverse: a b c", "What is 2 + 3?", "The answer is 5.", "Hello, how are you today?",
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
    '{"type": "function", "function": {"name": "add", "parameters": {}}}',
    string.printable * 4,
]


def build_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_policy(out: str | Path, *, max_positions: int = 1024, seed: int = 0):
    """``(tokenizer, checkpoint dir)``: the tokenizer above and a random qwen2 LM saved with it."""
    import torch
    import transformers

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=128,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = Path(out)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return tokenizer, out

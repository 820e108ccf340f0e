"""What the policy is trained on: the synthetic pattern task (``pattern``), prompts from a
dataset file (``prompts``) scored by reward functions (``rewards``), the tiny text task and its
locally built tokenizer and model (``tiny_text``), and a direct sampler (``generate``)."""

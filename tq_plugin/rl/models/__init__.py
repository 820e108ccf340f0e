"""The models a recipe trains: the model protocol (``protocol``), the tiny transformer
(``tiny``), the Hugging Face causal LM (``hf``), FSDP2 sharding (``fsdp``), the weight files and
what an engine is given of the policy (``weights``), and memory-bounded logprobs (``logprobs``)."""

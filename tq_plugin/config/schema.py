"""Typed schemas for the shipped Hydra config groups, and their ConfigStore registrations.

This module is imported by the ``hydra_plugins.tq_plugin`` search-path plugin, i.e. on *every*
Hydra start in an environment where tq_plugin is installed, so it imports nothing heavy: no torch,
no lightning, no tensordict. ``_target_`` values are plain strings; the classes they name are only
imported when a component is instantiated.

Each YAML option under ``conf/`` lists one of these schemas first in its defaults, so a composed
option is a typed, struct-mode node: a wrong type or an unknown key fails when the override is
applied, with Hydra's message naming the full key. Rules that span several keys live in the
dataclasses' ``__post_init__`` and run when :func:`tq_plugin.config.validate_config` converts the
node to its dataclass, which every entry point does right after composing, before anything is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from tq_plugin.config.recipe_schema import RecipeConfig
from tq_plugin.config.rules import ConfigError  # noqa: F401  (re-exported: its historic home)
from tq_plugin.config.rules import fail as _fail
from tq_plugin.config.rules import one_of as _one_of
from tq_plugin.config.rules import positive as _positive

PROVIDER = "tq_plugin"

PACKING_ALGORITHMS = ("modified_first_fit_decreasing", "first_fit_decreasing")
MICROBATCH_ORDERS = ("packer", "largest_first")
LAYOUTS = ("padded", "packed")
PACKING_MODES = ("none", "sequence_packing", "dynamic_batching")
PIXEL_DTYPES = ("float32", "float16", "bfloat16")
# Attention kernels tq_plugin.rl.models.hf runs on CPU (packed rows as a padded block).
HF_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
JOURNAL_SYNC_MODES = ("off", "batch", "always")


@dataclass
class BackendConfig:
    """``tq/backend``: the data-plane client. ``local`` is the embedded, in-process store."""

    _target_: str = "tq_plugin.data_plane.LocalDataPlane"
    # A directory for the store's journal: every acknowledged call is recorded there first, and
    # a store opened on it recovers them (docs/durability.md). None: no journal.
    journal_dir: str | None = None
    # off (written, never flushed: survives a killed process), batch (group commit: an fsync
    # covers each call before it returns) or always (an fsync per call).
    journal_sync: str = "off"

    def __post_init__(self) -> None:
        _one_of("tq.backend.journal_sync", self.journal_sync, JOURNAL_SYNC_MODES)


@dataclass
class RayBackendConfig:
    """``tq/backend=ray``: the columnar store in a named Ray actor, shared by every process of
    the Ray cluster (needs the ``ray`` extra)."""

    _target_: str = "tq_plugin.data_plane.RayDataPlane"
    store: str = "tq_train"
    actor_name: str = "tq_plugin_data_plane"
    namespace: str = "tq_plugin"
    # A cluster's GCS address (host:port) to attach to; None starts Ray on loopback.
    address: str | None = None
    op_timeout_s: float = 300.0
    # Attach to (or start) a Ray cluster that answers callers without its token (SECURITY.md).
    allow_unauthenticated: bool = False
    # Passed to ray.init when Ray is not running yet.
    ray_init: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 2,
                                                              "include_dashboard": False})
    # Storage-unit actors holding the bytes beside the one actor that keeps metadata and claims
    # (docs/scale.md); 1 is the single store actor.
    num_storage_units: int = 1
    # The store actor's journal directory, on the actor's node (docs/durability.md); None: none.
    journal_dir: str | None = None
    # off, batch or always: as tq.backend.journal_sync of the local backend.
    journal_sync: str = "off"

    def __post_init__(self) -> None:
        for key in ("store", "actor_name", "namespace"):
            if not getattr(self, key):
                _fail(f"tq.backend.{key}", "must be a non-empty string")
        _positive("tq.backend.op_timeout_s", self.op_timeout_s)
        if self.num_storage_units < 1:
            _fail("tq.backend.num_storage_units", f"must be >= 1, got {self.num_storage_units}")
        _one_of("tq.backend.journal_sync", self.journal_sync, JOURNAL_SYNC_MODES)
        if self.journal_dir is not None and self.num_storage_units > 1:
            _fail("tq.backend.journal_dir", "needs tq.backend.num_storage_units=1 (a sharded "
                  "store's bytes live in its storage units, which keep no journal yet)")


@dataclass
class TransferQueueBackendConfig:
    """``tq/backend=transferqueue``: TransferQueue 0.1.11 behind the data-plane protocol (needs
    the ``tq`` extra)."""

    _target_: str = "tq_plugin.data_plane.backends.transferqueue.TransferQueueDataPlane"
    store: str = "tq_train"
    num_storage_units: int = 1
    init_timeout_s: float = 60.0
    op_timeout_s: float = 120.0
    address: str | None = None
    allow_non_loopback: bool = False
    allow_unauthenticated: bool = False
    ray_init: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 2,
                                                              "include_dashboard": False})

    def __post_init__(self) -> None:
        if not self.store:
            _fail("tq.backend.store", "must be a non-empty string")
        if self.num_storage_units < 1:
            _fail("tq.backend.num_storage_units", f"must be >= 1, got {self.num_storage_units}")
        _positive("tq.backend.init_timeout_s", self.init_timeout_s)
        _positive("tq.backend.op_timeout_s", self.op_timeout_s)


@dataclass
class StagingConfig:
    """``tq/staging``: the token sink every model call is staged through.

    Instantiated with ``_partial_: true``; the caller supplies the data-plane client:
    ``instantiate(cfg.tq.staging)(client)`` registers the staging partition (with the media
    columns when ``capture_media``) and returns its ``TQTokenSink``.
    """

    _target_: str = "tq_plugin.staging.factory.build_token_sink"
    _partial_: bool = True
    staging_partition: str = "rollout_staging"
    capture_media: bool = False
    media_pixel_dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.staging_partition:
            _fail("tq.staging.staging_partition", "must be a non-empty partition id")
        if self.media_pixel_dtype is not None:
            _one_of("tq.staging.media_pixel_dtype", self.media_pixel_dtype, PIXEL_DTYPES)
        if self.capture_media and self.media_pixel_dtype is None:
            _fail(
                "tq.staging.media_pixel_dtype",
                "must be set when tq.staging.capture_media is true (e.g. float32)",
            )


@dataclass
class PackingConfig:
    """``tq/packing``: how training and logprob steps are cut into microbatches.

    Every option has exactly these keys, so a sweep such as
    ``-m tq/packing=none,sequence_packing,dynamic_batching tq.packing.train_mb_tokens=2048,8192``
    applies each override to each option. ``use_sequence_packing`` and ``use_dynamic_batches`` are
    the host attributes the Lightning mixin reads; enabling both is a configuration error.
    """

    _target_: str = "tq_plugin.config.schema.PackingConfig"
    name: str = "none"
    use_sequence_packing: bool = False
    use_dynamic_batches: bool = False
    # Token budget of one training microbatch and of one logprob/value forward microbatch.
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int = 8192
    # Rows of [tokens, vocabulary] logits the policy's logprobs are computed from at a time
    # (tq_plugin.rl.models.logprobs): the logits' memory is bounded by this, not by the
    # microbatch (1024 at a 151,936-id vocabulary: 0.62 GB of float32 work, whatever the budgets).
    logprob_chunk_tokens: int = 1024
    # Rows per microbatch when neither mode is on.
    micro_batch_size: int = 16
    # Dynamic batching rounds each microbatch's padded length up to this multiple.
    sequence_length_round: int = 8
    # Sequence packing pads each packed sequence to this multiple.
    sequence_length_pad_multiple: int = 1
    algorithm: str = "modified_first_fit_decreasing"
    microbatch_order: str | None = None
    # What a training step receives: "padded" [B, S] tensors or one "packed" row with cu_seqlens.
    layout: str = "padded"

    def __post_init__(self) -> None:
        if self.use_sequence_packing and self.use_dynamic_batches:
            _fail(
                "tq.packing.use_sequence_packing / tq.packing.use_dynamic_batches",
                "sequence packing and dynamic batching are mutually exclusive; enable at most one "
                "(pick tq/packing=sequence_packing or tq/packing=dynamic_batching)",
            )
        for key in ("train_mb_tokens", "logprob_mb_tokens", "logprob_chunk_tokens",
                    "micro_batch_size", "sequence_length_round", "sequence_length_pad_multiple"):
            _positive(f"tq.packing.{key}", getattr(self, key))
        _one_of("tq.packing.algorithm", self.algorithm, PACKING_ALGORITHMS)
        if self.microbatch_order is not None:
            _one_of("tq.packing.microbatch_order", self.microbatch_order, MICROBATCH_ORDERS)
        _one_of("tq.packing.layout", self.layout, LAYOUTS)
        if self.layout == "packed" and not self.use_sequence_packing:
            _fail("tq.packing.layout", "'packed' needs tq.packing.use_sequence_packing=true")

    @property
    def mode(self) -> str:
        if self.use_sequence_packing:
            return "sequence_packing"
        if self.use_dynamic_batches:
            return "dynamic_batching"
        return "none"

    def model_cfg(self) -> dict[str, Any]:
        """The per-model config blocks the driver mixin's ``_packing_args`` reads."""
        tokens = {"train_mb_tokens": self.train_mb_tokens,
                  "logprob_mb_tokens": self.logprob_mb_tokens}
        return {
            "dynamic_batching": {"enabled": self.use_dynamic_batches,
                                 "sequence_length_round": self.sequence_length_round, **tokens},
            "sequence_packing": {"enabled": self.use_sequence_packing,
                                 "algorithm": self.algorithm,
                                 "sequence_length_round": self.sequence_length_round, **tokens},
            "make_sequence_length_divisible_by": self.sequence_length_pad_multiple,
            "train_micro_batch_size": self.micro_batch_size,
            # Errors about a budget name the key the user set, e.g. tq.packing.train_mb_tokens.
            "config_key_prefix": "tq.packing",
        }

    def host_attributes(self) -> dict[str, Any]:
        """The attribute pairs a ``TQDriverMixin`` host sets (reference section 8.1)."""
        attrs: dict[str, Any] = {"use_sequence_packing": self.use_sequence_packing,
                                 "use_dynamic_batches": self.use_dynamic_batches}
        if self.use_dynamic_batches:
            attrs["dynamic_batching_args"] = {
                "input_key": "input_ids", "input_lengths_key": "input_lengths",
                "sequence_length_round": self.sequence_length_round,
                "max_tokens_per_microbatch": 0,
            }
        if self.use_sequence_packing:
            spa = {"algorithm": self.algorithm, "input_key": "input_ids",
                   "input_lengths_key": "input_lengths",
                   "sequence_length_pad_multiple": self.sequence_length_pad_multiple}
            if self.microbatch_order is not None:
                spa["microbatch_order"] = self.microbatch_order
            attrs["sequence_packing_args"] = spa
        return attrs


@dataclass
class TaskConfig:
    """``task``: the synthetic environment the policy is trained on."""

    _target_: str = "tq_plugin.rl.tasks.pattern.PatternTask"
    name: str = "pattern"
    num_symbols: int = 6
    min_len: int = 2
    max_len: int = 5
    turns: int = 2
    # Media mode: each pattern symbol is drawn as one patch_size x patch_size RGB patch.
    patch_size: int = 2

    def __post_init__(self) -> None:
        for key in ("num_symbols", "min_len", "max_len", "turns", "patch_size"):
            _positive(f"task.{key}", getattr(self, key))
        if self.min_len > self.max_len:
            _fail("task.min_len", f"must be <= task.max_len ({self.max_len}), got {self.min_len}")


def _default_reward() -> dict[str, Any]:
    return {"_target_": "tq_plugin.rl.tasks.rewards.exact_match", "weight": 1.0}


@dataclass
class PromptsTaskConfig:
    """``task=prompts``: prompts from a local dataset file (json/jsonl, parquet, csv), a tokenizer
    directory and reward functions ``f(prompts, completions, **columns) -> list[float]``
    (``tq_plugin.rl.tasks.prompts``, ``tq_plugin.rl.tasks.rewards``)."""

    _target_: str = "tq_plugin.rl.tasks.prompts.PromptTask"
    # The reward specs are passed as they are (the task imports and checks them).
    _recursive_: bool = False
    name: str = "prompts"
    path: str | None = None
    prompt_key: str = "prompt"
    # A local tokenizer directory; the config's default is model.pretrained_path.
    tokenizer: str | None = None
    # One reward {_target_, weight}; more under rewards.<name>; a rollout's reward is their
    # weighted sum.
    reward: Any = field(default_factory=_default_reward)
    rewards: Any = field(default_factory=dict)
    # The held-out split: its own file, else eval_size rows held out of path.
    eval_path: str | None = None
    eval_size: int = 0
    turns: int = 1
    feedback_good: str = " Correct."
    feedback_bad: str = " Try again."
    shuffle: bool = True

    def __post_init__(self) -> None:
        _positive("task.turns", self.turns)
        _positive("task.eval_size", self.eval_size, allow_zero=True)
        if not self.prompt_key:
            _fail("task.prompt_key", "must name the dataset column that holds the prompts")
        for key, spec in (("task.reward", self.reward),
                          *((f"task.rewards.{k}", v) for k, v in (self.rewards or {}).items())):
            if spec is not None and not isinstance(spec, dict):
                _fail(key, f"must be a {{_target_, weight}} node, got {spec!r}")


REASONING_GYM_ANSWER_FORMATS = ("last_number", "last_line", "answer_tag")


@dataclass
class ReasoningGymTaskConfig:
    """``task=reasoning_gym``: questions from a reasoning-gym generator (the ``gym`` extra),
    scored by its own ``score_answer`` on the extracted answer, with a held-out split of its own
    (``tq_plugin.rl.tasks.reasoning_gym``)."""

    _target_: str = "tq_plugin.rl.tasks.reasoning_gym.ReasoningGymTask"
    _recursive_: bool = False
    name: str = "reasoning_gym"
    # A reasoning-gym dataset name (reasoning_gym.factory.DATASETS): chain_sum, basic_arithmetic,
    # countdown, gsm_symbolic, ...
    dataset: str = "chain_sum"
    # Training rows: create_dataset(dataset, size=size, seed=dataset_seed, **config).
    size: int = 1000
    # Not task.seed: the recipe hands recipe.seed to the task as seed (the draw order).
    dataset_seed: int = 0
    # Held-out rows for recipe.eval_every, from eval_seed (None: dataset_seed + size), never a
    # training question.
    eval_size: int = 64
    eval_seed: int | None = None
    # The generator's own options: +task.config.min_digits=2 +task.config.max_terms=3
    config: Any = field(default_factory=dict)
    # A local tokenizer directory with a chat template; the config's default is the model's.
    tokenizer: str | None = None
    system_prompt: str | None = None
    # What follows the question in the user message; None: the answer format's own request.
    instruction: str | None = None
    # last_number, last_line, or answer_tag (inside <answer></answer>).
    answer_format: str = "last_number"
    # Weight of a reward worth 1 when an answer could be extracted; 0: off.
    format_bonus: float = 0.0
    # false: the score reward is 1 where score_answer is 1 (fully right), else 0 (no partial
    # credit, e.g. basic_arithmetic's 0.67 for 138 against 38).
    partial_credit: bool = True
    # More reward functions, as task=prompts' task.rewards.<name>.
    rewards: Any = field(default_factory=dict)
    turns: int = 1
    feedback_good: str = " Correct."
    feedback_bad: str = " Try again."
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not self.dataset:
            _fail("task.dataset", "must name a reasoning-gym dataset (e.g. chain_sum)")
        _positive("task.size", self.size)
        _positive("task.eval_size", self.eval_size, allow_zero=True)
        _positive("task.turns", self.turns)
        _one_of("task.answer_format", self.answer_format, REASONING_GYM_ANSWER_FORMATS)
        if self.config is not None and not isinstance(self.config, dict):
            _fail("task.config", f"must be a node of the generator's options, got {self.config!r}")
        for key, spec in (self.rewards or {}).items():
            if not isinstance(spec, dict):
                _fail(f"task.rewards.{key}", f"must be a {{_target_, weight}} node, got {spec!r}")


@dataclass
class AgentTaskConfig:
    """``task=agent``: a local dataset of problems, each handed whole to the user's agent
    ``async def solve(client, row, **agent_kwargs) -> float | dict`` (``task.agent._target_``),
    which talks to the policy through an OpenAI-compatible endpoint that stages every call
    (``tq_plugin.rl.tasks.agent``)."""

    _target_: str = "tq_plugin.rl.tasks.agent.AgentTask"
    _recursive_: bool = False
    name: str = "agent"
    path: str | None = None
    prompt_key: str = "prompt"
    # A local tokenizer directory with a chat template; the config's default is the model's.
    tokenizer: str | None = None
    # {_target_: the agent function, any other key: its keyword arguments}.
    agent: Any = field(default_factory=lambda: {"_target_": None})
    # Rollouts in flight at once (each one agent loop).
    concurrency: int = 8
    # The longest a rollout may grow (prompt, every call and its answer): the endpoint refuses
    # a call past it (a 400 the agent sees). None: the model's context (model.max_seq_len).
    max_context: int | None = None
    shuffle: bool = True

    def __post_init__(self) -> None:
        _positive("task.concurrency", self.concurrency)
        if self.max_context is not None:
            _positive("task.max_context", self.max_context)
        if not isinstance(self.agent, dict):
            _fail("task.agent", f"must be a {{_target_, ...keyword arguments}} node, got "
                  f"{self.agent!r}")


@dataclass
class ModelConfig:
    """``model``: the policy (and, for PPO, value) network."""

    _target_: str = "tq_plugin.rl.models.tiny.TinyTransformer"
    name: str = "tiny_transformer"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 64
    dropout: float = 0.0
    # Recompute each block's activations in backward instead of keeping them (less memory,
    # one more forward): torch.utils.checkpoint per block, or a transformers model's own.
    gradient_checkpointing: bool = False
    # The weights' dtype (float32, bfloat16, float16); trainer.precision=bf16-mixed computes in
    # bf16 over float32 weights. The logprobs are float32 either way.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for key in ("d_model", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, key) is not None:
                _positive(f"model.{key}", getattr(self, key))
        if self.d_model is not None and self.n_heads is not None and self.d_model % self.n_heads:
            _fail("model.d_model", f"must be divisible by model.n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.dropout", f"must be in [0, 1), got {self.dropout!r}")
        _one_of("model.dtype", self.dtype, MODEL_DTYPES)


# A Hugging Face Hub id: ``name`` or ``owner/name`` (what a user types for a model to download).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def check_pretrained_path(path: str) -> None:
    """``model.pretrained_path`` must be a local directory; a Hub id (not an existing path) gets
    one message saying how to download it (nothing is ever downloaded); an empty one is refused
    (``Path("")`` is the working directory)."""
    if not path.strip():
        _fail("model.pretrained_path", "is empty: name a local save_pretrained directory "
              "(model.pretrained_path=<dir>), or null for a model initialised at random")
    if Path(path).exists() or not _HUB_ID.fullmatch(path) or path.startswith("."):
        return
    _fail("model.pretrained_path", f"{path!r} is not a local directory; it looks like a Hugging "
          f"Face Hub id, and nothing is downloaded here. Download it first "
          f"(huggingface-cli download {path} --local-dir <dir>) and pass the directory "
          f"(model.pretrained_path=<dir>)")


@dataclass
class LoraConfig:
    """``model.lora``: LoRA adapters (PEFT's ``LoraConfig``, its names) on the transformers model;
    only they (and a value head) train, the base weights stay frozen. ``r: null`` (the default)
    or ``model.lora=null``: full fine-tuning."""

    # The adapters' rank; null: no adapters.
    r: int | None = None
    # PEFT's lora_alpha: the update is scaled by alpha / r.
    alpha: float = 8.0
    # PEFT's lora_dropout (0: the trainer's logprobs equal the engine's before an update).
    dropout: float = 0.0
    # Module names (or one regex, or "all-linear") the adapters wrap; null: PEFT's default for
    # the model type (llama, qwen2: q_proj and v_proj).
    target_modules: Any = None

    def __post_init__(self) -> None:
        if self.r is not None:
            _positive("model.lora.r", self.r)
        _positive("model.lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.lora.dropout", f"must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if targets is None or (isinstance(targets, str) and targets):
            return
        if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets) \
                or not list(targets):
            _fail("model.lora.target_modules", f"must be null, a module name pattern, "
                  f"'all-linear' or a non-empty list of module names, got {targets!r}")

    @property
    def enabled(self) -> bool:
        return self.r is not None


@dataclass
class HFCausalLMConfig(ModelConfig):
    """``model=hf_causal_lm``: a transformers causal LM (the ``hf`` extra), built from
    ``model_type``'s config sized by the keys above, or loaded from ``pretrained_path`` (a local
    ``save_pretrained`` directory in safetensors; nothing is downloaded)."""

    _target_: str = "tq_plugin.rl.models.hf.HFCausalLM"
    name: str = "hf_causal_lm"
    # The sizes: None takes the checkpoint's (pretrained_path) or the model group's defaults
    # (tq_plugin.rl.models.hf.DEFAULT_SIZES); a size the checkpoint contradicts is refused.
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    max_seq_len: int | None = None
    model_type: str = "llama"
    pretrained_path: str | None = None
    attn_implementation: str = "sdpa"
    # Width of one attention head; None: d_model / n_heads (not the transformers config's own
    # default, which for llama is 128 whatever the hidden size), or the checkpoint's.
    head_dim: int | None = None
    # LoRA adapters instead of full fine-tuning (LoraConfig; r null: none).
    lora: LoraConfig | None = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.lora, dict):  # validate_config builds the node's fields as dicts
            self.lora = LoraConfig(**self.lora)
        if self.pretrained_path is not None:
            check_pretrained_path(self.pretrained_path)
        if self.head_dim is not None:
            _positive("model.head_dim", self.head_dim)
        if not self.model_type:
            _fail("model.model_type", "must name a transformers model type (e.g. llama, gpt2)")
        _one_of("model.attn_implementation", self.attn_implementation, HF_ATTN_IMPLEMENTATIONS)


ENGINES = ("native", "hf", "vllm")
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass
class EngineConfig:
    """``engine``: what generates the rollouts (``tq_plugin.rollout.engines``). ``native`` (the
    recipes' sampler, any model), ``hf`` (transformers with a KV cache) or ``vllm`` (vLLM
    in-process, the ``vllm`` extra); ``hf`` and ``vllm`` need ``model=hf_causal_lm``. Every
    option has every key (a sweep over ``engine=`` applies each override to each); the keys
    after ``dtype`` are vLLM's."""

    name: str = "native"
    # hf / vllm: the engine's copy of the weights (float32 matches the trainer's logprobs).
    dtype: str = "float32"
    # vllm: the KV cache's size in bytes; None sizes it from the run (a step's sequences at its
    # longest prompt + recipe.max_new_tokens: tq_plugin.rollout.engines.vllm.engine_sizes). On
    # CPU vLLM would otherwise ask for most of the memory.
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = True
    # processed_logprobs: after temperature and the allowed-token restriction (what the trainer
    # recomputes); raw_logprobs would be the unscaled log-softmax.
    logprobs_mode: str = "processed_logprobs"
    # vllm: torch threads its forward runs on (0: the process's).
    threads: int = 1

    def __post_init__(self) -> None:
        _one_of("engine.name", self.name, ENGINES)
        _one_of("engine.dtype", self.dtype, ENGINE_DTYPES)
        _one_of("engine.logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if self.kv_cache_memory_bytes is not None:
            _positive("engine.kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("engine.threads", self.threads, allow_zero=True)


@dataclass
class TQConfig:
    backend: BackendConfig = field(default_factory=BackendConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)


# group -> schema. Each YAML option extends its schema by listing ``/<SCHEMA_PREFIX><name>``
# (e.g. ``/tq_schema_packing@_here_``) first in its defaults.
SCHEMAS: dict[str, type] = {
    "tq/backend": BackendConfig,
    "tq/staging": StagingConfig,
    "tq/packing": PackingConfig,
    "task": TaskConfig,
    "model": ModelConfig,
    "recipe": RecipeConfig,
    "engine": EngineConfig,
}


# Schemas of options that differ from their group's default schema.
EXTRA_SCHEMAS: dict[str, type] = {"backend_ray": RayBackendConfig,
                                  "backend_transferqueue": TransferQueueBackendConfig,
                                  "model_hf_causal_lm": HFCausalLMConfig,
                                  "task_prompts": PromptsTaskConfig,
                                  "task_agent": AgentTaskConfig,
                                  "task_reasoning_gym": ReasoningGymTaskConfig}

# Schemas are stored as root configs, not in a group: a group would be listed in every Hydra
# app's --help (the plugin registers them on every start), and a schema is not an option.
SCHEMA_PREFIX = "tq_schema_"


def schema_name(group_or_option: str) -> str:
    """The root config name a YAML option lists to extend its schema (``tq_schema_packing``)."""
    return SCHEMA_PREFIX + group_or_option.split("/")[-1]


def register_configs() -> None:
    """Store every schema as a root config. Pure and idempotent: Hydra may rerun it."""
    cs = ConfigStore.instance()
    nodes = {group.split("/")[-1]: node for group, node in SCHEMAS.items()} | EXTRA_SCHEMAS
    for name, node in nodes.items():
        cs.store(name=schema_name(name), node=node, provider=PROVIDER)


register_configs()

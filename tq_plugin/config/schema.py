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

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException

PROVIDER = "tq_plugin"

PACKING_ALGORITHMS = ("modified_first_fit_decreasing", "first_fit_decreasing")
MICROBATCH_ORDERS = ("packer", "largest_first")
LAYOUTS = ("padded", "packed")
PACKING_MODES = ("none", "sequence_packing", "dynamic_batching")
PIXEL_DTYPES = ("float32", "float16", "bfloat16")
ALGORITHMS = ("ppo", "grpo")
TOPOLOGIES = ("colocated", "disaggregated")
# Attention kernels tq_plugin.rl.hf_model feeds a block-diagonal mask (packed rows) on CPU.
HF_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


class ConfigError(CompactHydraException, ValueError):
    """A config value breaks a rule; the message names the user-facing key and the rule.

    A ``CompactHydraException``, so a Hydra app that lets it escape prints the message alone
    (Hydra's convention for config errors); ``HYDRA_FULL_ERROR=1`` shows the whole trace. It is
    also a ``ValueError``, so ``except ValueError`` keeps working.
    """


def _fail(key: str, rule: str) -> None:
    raise ConfigError(f"{key}: {rule}")


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        _fail(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        _fail(key, f"must be one of {list(allowed)}, got {value!r}")


@dataclass
class BackendConfig:
    """``tq/backend``: the data-plane client. ``local`` is the embedded, in-process store."""

    _target_: str = "tq_plugin.data_plane.LocalDataPlane"


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
    # Passed to ray.init when Ray is not running yet.
    ray_init: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 2,
                                                              "include_dashboard": False})

    def __post_init__(self) -> None:
        for key in ("store", "actor_name", "namespace"):
            if not getattr(self, key):
                _fail(f"tq.backend.{key}", "must be a non-empty string")
        _positive("tq.backend.op_timeout_s", self.op_timeout_s)


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
        for key in ("train_mb_tokens", "logprob_mb_tokens", "micro_batch_size",
                    "sequence_length_round", "sequence_length_pad_multiple"):
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

    _target_: str = "tq_plugin.rl.task.PatternTask"
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


@dataclass
class ModelConfig:
    """``model``: the policy (and, for PPO, value) network."""

    _target_: str = "tq_plugin.rl.model.TinyTransformer"
    name: str = "tiny_transformer"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for key in ("d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_heads:
            _fail("model.d_model", f"must be divisible by model.n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.dropout", f"must be in [0, 1), got {self.dropout!r}")


@dataclass
class HFCausalLMConfig(ModelConfig):
    """``model=hf_causal_lm``: a transformers causal LM (the ``hf`` extra), built from
    ``model_type``'s config sized by the keys above, or loaded from ``pretrained_path`` (a local
    ``save_pretrained`` directory in safetensors; nothing is downloaded)."""

    _target_: str = "tq_plugin.rl.hf_model.HFCausalLM"
    name: str = "hf_causal_lm"
    model_type: str = "llama"
    pretrained_path: str | None = None
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_type:
            _fail("model.model_type", "must name a transformers model type (e.g. llama, gpt2)")
        _one_of("model.attn_implementation", self.attn_implementation, HF_ATTN_IMPLEMENTATIONS)


@dataclass
class RecipeConfig:
    """``recipe``: the RL algorithm and its hyper-parameters (``ppo`` or ``grpo``)."""

    _target_: str = "tq_plugin.rl.recipe.RLRecipe"
    algorithm: str = "ppo"
    seed: int = 0
    # torch intra-op threads; the tiny model's ops are too small to gain from more (0: torch's default).
    num_threads: int = 1
    # RL iterations: each generates rollouts, writes them through the data plane, then trains.
    num_steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 4
    ppo_epochs: int = 4
    # Optimizer steps per epoch: the step's rows are split into this many minibatches.
    minibatches: int = 1
    lr: float = 3e-3
    value_lr: float = 3e-3
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    gamma: float = 1.0
    gae_lambda: float = 0.95
    temperature: float = 1.0
    max_new_tokens: int = 8
    train_partition: str = "train"
    log_every: int = 1
    # Write metrics.csv, resolved config and reward_curve.png into the output dir.
    save_artifacts: bool = True
    # colocated: each step generates, then trains. disaggregated: rollout_workers processes
    # generate ahead while the trainer trains (tq_plugin.rl.disaggregated; a shared backend).
    topology: str = "colocated"
    rollout_workers: int = 1
    # disaggregated: no row trains whose weight_version lags the trainer's by more (RL steps).
    max_staleness: int = 1
    # disaggregated: truncated importance-sampling weight min(pi_old / pi_gen, is_truncation).
    # 1.0 (down-weight only, as V-trace's rho-bar): with 2.0 the GRPO pattern run learned slower
    # and turned down after ~90 steps (see tq_plugin.rl.disaggregated).
    is_truncation: float = 1.0
    # disaggregated: where a worker stages its calls: "local" (its own embedded store; only it
    # reads them back) or "shared" (the run's store). Training rows always go to the shared one.
    worker_staging: str = "local"
    # disaggregated: when the trainer publishes its weights to the workers: after every
    # "optimizer_step" (the newest weights reach them soonest) or once per "rl_step" (a
    # quarter of the transfers with 4 PPO epochs: for models whose refit is costly).
    weights_every: str = "optimizer_step"

    def __post_init__(self) -> None:
        _one_of("recipe.algorithm", self.algorithm, ALGORITHMS)
        _one_of("recipe.topology", self.topology, TOPOLOGIES)
        _one_of("recipe.worker_staging", self.worker_staging, ("local", "shared"))
        _one_of("recipe.weights_every", self.weights_every, ("optimizer_step", "rl_step"))
        _positive("recipe.rollout_workers", self.rollout_workers)
        _positive("recipe.max_staleness", self.max_staleness, allow_zero=True)
        if self.is_truncation < 1.0:
            _fail("recipe.is_truncation", "must be >= 1.0 (the weight of an on-policy token)")
        _positive("recipe.num_threads", self.num_threads, allow_zero=True)
        for key in ("num_steps", "prompts_per_step", "group_size", "ppo_epochs", "minibatches",
                    "lr", "max_new_tokens", "temperature", "log_every"):
            _positive(f"recipe.{key}", getattr(self, key))
        if self.algorithm == "grpo" and self.group_size < 2:
            _fail("recipe.group_size", "GRPO needs at least 2 samples per prompt")
        if self.algorithm == "ppo":
            _positive("recipe.value_lr", self.value_lr)
        _positive("recipe.clip_eps", self.clip_eps)
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.gae_lambda <= 1.0):
            _fail("recipe.gamma / recipe.gae_lambda", "must both be in [0, 1]")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            _fail("recipe.minibatches", "must divide prompts_per_step * group_size")


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
}


# Schemas of options that differ from their group's default schema.
EXTRA_SCHEMAS: dict[str, type] = {"backend_ray": RayBackendConfig,
                                  "backend_transferqueue": TransferQueueBackendConfig,
                                  "model_hf_causal_lm": HFCausalLMConfig}

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

"""Torch-free configuration: typed schemas, ConfigStore registrations and validation.

Importing this package registers the schemas in Hydra's ConfigStore (root configs named
``tq_schema_<name>``, which the shipped YAML options extend).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tq_plugin.config.schema import (
    SCHEMAS,
    BackendConfig,
    ConfigError,
    ModelConfig,
    PackingConfig,
    PromptsTaskConfig,
    RayBackendConfig,
    RecipeConfig,
    StagingConfig,
    TaskConfig,
    TQConfig,
    register_configs,
)

__all__ = [
    "SCHEMAS",
    "BackendConfig",
    "ConfigError",
    "ModelConfig",
    "PackingConfig",
    "PromptsTaskConfig",
    "RayBackendConfig",
    "RecipeConfig",
    "StagingConfig",
    "TQConfig",
    "TaskConfig",
    "register_configs",
    "validate_config",
]


def _node(cfg: DictConfig, dotted: str) -> Any:
    return OmegaConf.select(cfg, dotted, default=None)


def validate_config(cfg: DictConfig) -> dict[str, Any]:
    """Check a composed config before anything is built; return the typed sections.

    * A top-level key with a ``/`` in it is an override such as ``+tq/packng=none`` that named a
      config group Hydra does not know: Hydra silently turns it into a plain string key.
    * Every schema-backed section present is converted to its dataclass, which runs the
      cross-field rules (``__post_init__``), e.g. both packing modes enabled.

    Raises ``ConfigError`` (a ``ValueError``) naming the key and the rule.
    """
    stray = [k for k in cfg if isinstance(k, str) and "/" in k]
    if stray:
        known = ", ".join(sorted(SCHEMAS))
        hints = [f"{k} -> {m[0]}" for k in stray
                 if (m := difflib.get_close_matches(k, list(SCHEMAS), n=1, cutoff=0.6))]
        raise ConfigError(
            f"unknown config group(s) {stray}: Hydra added them as plain keys "
            f"({', '.join(f'{k}={cfg[k]!r}' for k in stray)}). "
            + (f"Did you mean: {', '.join(hints)}? " if hints else "")
            + f"Known groups: {known}"
        )
    _check_bool_overrides(cfg)
    typed: dict[str, Any] = {}
    for group, schema in SCHEMAS.items():
        dotted = group.replace("/", ".")
        node = _node(cfg, dotted)
        if node is None:
            continue
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{dotted}: must be a config node, got {node!r}")
        # The option's own schema when it extends one (tq/backend=ray), else the group's.
        declared = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(declared):
            schema = declared
        data = OmegaConf.to_container(node, resolve=True)
        unknown = sorted(set(data) - {f for f in schema.__dataclass_fields__})
        if unknown:
            raise ConfigError(f"{dotted}: unknown key(s) {unknown}")
        typed[dotted] = schema(**data)
    return typed


# What a boolean key may be set to on the command line. OmegaConf would turn any number into a
# bool (``recipe.save_artifacts=-1`` is True), and a bare true given to a text key into 'True':
# silent casts, refused here instead.
_BOOL_WORDS = frozenset({"true", "false"})


def _check_bool_overrides(cfg: DictConfig) -> None:
    """``ConfigError`` naming a boolean key set to anything but true/false on the command line.

    Reads the run's overrides from Hydra (a run started by ``@hydra.main``, or a compose with
    ``HydraConfig`` set); without them there is nothing to check.
    """
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError, AttributeError):
        return
    sections = {group.replace("/", "."): schema for group, schema in SCHEMAS.items()}
    for override in overrides:
        key, sep, raw = override.lstrip("+~").partition("=")
        section, _, name = key.rpartition(".")
        node = _node(cfg, section) if sep and section else None
        declared = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        schema = declared if dataclasses.is_dataclass(declared) else sections.get(section)
        field = getattr(schema, "__dataclass_fields__", {}).get(name)
        word = raw.strip().lower()
        if field is not None and field.type == "bool" and word not in _BOOL_WORDS:
            raise ConfigError(f"{key}: must be true or false, got {raw!r}")
        if field is not None and field.type.startswith("str") and word in _BOOL_WORDS:
            # Hydra reads true as a bool and OmegaConf would store the text 'True'.
            raise ConfigError(f"{key}: is text; quote it to mean the word ({key}='{raw}')")

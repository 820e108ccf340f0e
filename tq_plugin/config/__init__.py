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

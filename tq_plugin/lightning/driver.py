"""``TQDriverMixin``: pad-target minting and column read/write against the data plane.

Shared by the Policy and the Value model. The host provides ``cfg`` (the model config: the
``dynamic_batching`` / ``sequence_packing`` blocks with their ``*_mb_tokens`` budgets),
``dp_client``, and the ``use_dynamic_batches`` / ``use_sequence_packing`` attribute pairs with
``dynamic_batching_args`` / ``sequence_packing_args`` when the matching flag is on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

from tq_plugin.config.schema import ConfigError
from tq_plugin.data_plane.column_io import read_columns, round_up, write_columns
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN, PAD_TO_MULTIPLE

MB_TOKENS_KEYS = ("logprob_mb_tokens", "train_mb_tokens")


class PackingConfigError(ConfigError):
    """The host's packing attributes contradict each other, or a token budget cannot hold a row.

    A ``ConfigError`` (so a ``ValueError``): a Hydra app prints its message alone.
    """


def _check_packing_modes(use_sequence_packing: bool, use_dynamic_batches: bool) -> None:
    if use_sequence_packing and use_dynamic_batches:
        raise PackingConfigError(
            "use_sequence_packing and use_dynamic_batches are both true; sequence packing and "
            "dynamic batching are mutually exclusive: enable at most one"
        )


class TQDriverMixin:
    """Pad-target minting and column read/write against the data plane."""

    cfg: Mapping[str, Any]
    dp_client: Any

    def configure_packing(
        self,
        *,
        use_sequence_packing: bool = False,
        use_dynamic_batches: bool = False,
        sequence_packing_args: Mapping[str, Any] | None = None,
        dynamic_batching_args: Mapping[str, Any] | None = None,
    ) -> None:
        """Set the host attribute pairs (``PackingConfig.host_attributes()`` fits as kwargs).

        Both modes on is refused here, at construction, before any step runs.
        """
        _check_packing_modes(use_sequence_packing, use_dynamic_batches)
        for flag, args, name in (
            (use_sequence_packing, sequence_packing_args, "sequence_packing_args"),
            (use_dynamic_batches, dynamic_batching_args, "dynamic_batching_args"),
        ):
            if flag and args is None:
                raise PackingConfigError(f"{name} is required when its mode is enabled")
        self.use_sequence_packing = bool(use_sequence_packing)
        self.use_dynamic_batches = bool(use_dynamic_batches)
        self.sequence_packing_args = dict(sequence_packing_args) if sequence_packing_args else None
        self.dynamic_batching_args = dict(dynamic_batching_args) if dynamic_batching_args else None

    def packing_args(
        self, mb_tokens_key: str
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Resolve ``(sequence_packing_args, dynamic_batching_args)`` for a given stage.

        The stage is identified by ``mb_tokens_key`` (``"logprob_mb_tokens"`` or
        ``"train_mb_tokens"``). Each call returns fresh copies, so the host's dicts are never
        mutated; a budget missing from ``cfg`` raises ``KeyError``.
        """
        if mb_tokens_key not in MB_TOKENS_KEYS:
            raise ValueError(
                f"packing_args: mb_tokens_key must be one of {list(MB_TOKENS_KEYS)}, "
                f"got {mb_tokens_key!r}"
            )
        dynamic = bool(getattr(self, "use_dynamic_batches", False))
        packing = bool(getattr(self, "use_sequence_packing", False))
        _check_packing_modes(packing, dynamic)
        if dynamic:
            args = dict(self.dynamic_batching_args)  # type: ignore[attr-defined]
            args["max_tokens_per_microbatch"] = self.cfg["dynamic_batching"][mb_tokens_key]
            return None, args
        if packing:
            args = dict(self.sequence_packing_args)  # type: ignore[attr-defined]
            args["max_tokens_per_microbatch"] = self.cfg["sequence_packing"][mb_tokens_key]
            return args, None
        return None, None

    def packing_config_key(self, mb_tokens_key: str) -> str:
        """The user-facing name of a token budget, for error messages.

        ``cfg["config_key_prefix"]`` (``PackingConfig.model_cfg()`` sets ``"tq.packing"``) gives
        ``tq.packing.train_mb_tokens``; without it, the path inside ``cfg``.
        """
        cfg = getattr(self, "cfg", None) or {}
        prefix = cfg.get("config_key_prefix")
        if prefix:
            return f"{prefix}.{mb_tokens_key}"
        mode = "sequence_packing" if getattr(self, "use_sequence_packing", False) else "dynamic_batching"
        return f"cfg[{mode!r}][{mb_tokens_key!r}]"

    def stamp_pad_seqlen(self, meta: KVBatchMeta) -> None:
        """Mint ``GLOBAL_FORWARD_PAD_SEQLEN`` onto ``meta.extra_info`` (idempotent).

        Cross-DP forward pad target: the max over the *whole* meta, so shards cut from it
        inherit one value through their ``extra_info`` copies. First writer wins: an existing
        target is never changed.
        """
        if not meta.sequence_lengths or GLOBAL_FORWARD_PAD_SEQLEN in meta.extra_info:
            return
        _, dynamic_args = self.packing_args("train_mb_tokens")
        seq_round = int(dynamic_args["sequence_length_round"]) if dynamic_args else 1
        pad_multiple = int(meta.extra_info.get(PAD_TO_MULTIPLE, 1))
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = round_up(
            max(meta.sequence_lengths), max(pad_multiple, seq_round)
        )

    def isolated_meta(
        self, meta: KVBatchMeta, *, fields: Sequence[str], task_name: str
    ) -> KVBatchMeta:
        """Narrow ``meta`` for one model's dispatch and mint it a fresh pad target.

        The mint is idempotent, so sharing or inheriting the target would let whichever model
        dispatches first decide the forward pad for the rest -- and with ``ppo_epochs > 1`` the
        caller's meta is already stamped when the critic dispatches again. The caller's meta is
        left untouched.
        """
        extra = dict(meta.extra_info)
        extra.pop(GLOBAL_FORWARD_PAD_SEQLEN, None)
        isolated = dataclasses.replace(
            meta,
            sample_ids=list(meta.sample_ids),
            fields=list(fields),
            task_name=task_name,
            sequence_lengths=None if meta.sequence_lengths is None else list(meta.sequence_lengths),
            extra_info=extra,
            tags=None if meta.tags is None else [dict(t) for t in meta.tags],
        )
        self.stamp_pad_seqlen(isolated)
        return isolated

    def read_from_dataplane(
        self,
        meta: KVBatchMeta,
        *,
        select_fields: Sequence[str],
        pad_value_dict: Mapping[str, Any] | None = None,
    ) -> TensorDict:
        """Fetch and materialize columns, padded to the meta's pad target.

        Stamps the caller's meta in place (idempotently) first, so driver reads come back at
        the same dim 1 the training steps use.
        """
        self.stamp_pad_seqlen(meta)
        return read_columns(
            self.dp_client, meta, list(select_fields), pad_value_dict=pad_value_dict
        )

    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, Any]) -> None:
        """Write driver-computed columns under ``meta``'s keys (per-token ones land jagged)."""
        write_columns(self.dp_client, meta, fields)

    # The seed's (NeMo RL's) underscored names, kept for code written against it.
    _packing_args = packing_args
    _stamp_pad_seqlen = stamp_pad_seqlen
    _isolated_meta = isolated_meta

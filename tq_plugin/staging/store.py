"""The staging row schema and the keyed-row transport every token-capture codec shares.

A staging partition holds one row per model-call delta, keyed by the call's staging key.
Per-token and byte columns are declared jagged, so each one-row put hands plain dense
``[1, L]`` tensors and the store keeps them ragged across rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tq_plugin.data_plane import (
    ROUTED_EXPERTS_ENCODING_FIELD,
    ROUTED_EXPERTS_FIELD,
    ROUTED_EXTRAS_METADATA_FIELD,
    ROUTED_LEN_FIELD,
    batch_of,
    call_dp,
)
from tq_plugin.data_plane.client import accepts_put_mode
from tq_plugin.staging.media import (
    MEDIA_IMGS_FIELD,
    MEDIA_IMGS_SIZES_FIELD,
    MEDIA_NUM_FRAMES_FIELD,
    MEDIA_STAGING_FIELDS,
)

TOKEN_IDS_DELTA_FIELD = "token_ids_delta"
TOKEN_MASK_DELTA_FIELD = "token_mask_delta"
GENERATION_LOGPROBS_DELTA_FIELD = "generation_logprobs_delta"
PER_TOKEN_STAGING_FIELDS = [
    TOKEN_IDS_DELTA_FIELD,
    TOKEN_MASK_DELTA_FIELD,
    GENERATION_LOGPROBS_DELTA_FIELD,
]
UTF8_FIELDS = ["rollout_id_utf8", "model_call_id_utf8", "parent_call_id_utf8"]
# The per-token version ledger (``records.TOKEN_VERSIONS``): one int64 per generated token of
# the call, empty for a call staged without one. Its digest cover is the call's extras digest.
TOKEN_VERSIONS_FIELD = "token_versions"

# The columns every staged row carries, in order (digest inputs, identity, lineage, routes).
STAGING_FIELDS = [
    *PER_TOKEN_STAGING_FIELDS,
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id_utf8",
    "model_call_id_utf8",
    "parent_call_id_utf8",
    "parent_call_id_present",
    "capture_mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest_bytes",
    "extras_digest_bytes",
    "chain_hash_bytes",
    "chain_hash_present",
    "cumulative_hash_bytes",
    "cumulative_hash_present",
    ROUTED_EXTRAS_METADATA_FIELD,
    ROUTED_EXPERTS_ENCODING_FIELD,
    ROUTED_LEN_FIELD,
    TOKEN_VERSIONS_FIELD,
]
STAGING_JAGGED_FIELDS = [
    *PER_TOKEN_STAGING_FIELDS,
    TOKEN_VERSIONS_FIELD,
    *UTF8_FIELDS,
    ROUTED_EXTRAS_METADATA_FIELD,
    ROUTED_EXPERTS_FIELD,
]
MEDIA_JAGGED_FIELDS = [MEDIA_IMGS_FIELD, MEDIA_IMGS_SIZES_FIELD, MEDIA_NUM_FRAMES_FIELD]

_MODE_TO_CODE = {"text": 0, "token_in": 1}
_CODE_TO_MODE = {code: mode for mode, code in _MODE_TO_CODE.items()}


def staging_partition_fields(*, capture_media: bool = False) -> list[str]:
    """Every field a staging partition must accept: the row schema, routes, media if enabled."""
    fields = [*STAGING_FIELDS, ROUTED_EXPERTS_FIELD]
    return fields + MEDIA_STAGING_FIELDS if capture_media else fields


def register_staging_partition(
    dp_client: Any,
    partition_id: str,
    *,
    capture_media: bool = False,
    num_samples: int | None = None,
    consumer_tasks: Sequence[str] | None = ("finalize",),
) -> None:
    """Register a staging partition whose schema matches what ``TQTokenSink`` writes."""
    jagged = STAGING_JAGGED_FIELDS + (MEDIA_JAGGED_FIELDS if capture_media else [])
    call_dp(
        dp_client,
        "register_partition",
        partition_id=partition_id,
        fields=staging_partition_fields(capture_media=capture_media),
        num_samples=num_samples,
        consumer_tasks=None if consumer_tasks is None else list(consumer_tasks),
        jagged_fields=jagged,
    )


def _one_row(field_dict: Mapping[str, torch.Tensor]) -> TensorDictBase:
    """A batch-``[1]`` ``TensorDict`` over ``field_dict``; plain tensors whose first dimension
    is 1 skip the constructor's per-leaf checks, anything else gets them (and its error)."""
    columns = dict(field_dict)
    try:  # two set builds: ~3x cheaper than a per-leaf all(...)
        plain = {type(v) for v in columns.values()} == {torch.Tensor} and {
            v.shape[0] for v in columns.values()
        } == {1}
    except IndexError:  # a 0-d tensor
        plain = False
    return batch_of(columns, 1) if plain else TensorDict(columns, batch_size=[1])


class TQStagingStore:
    """Shared keyed-row transport for all token-capture codecs: one row per staging key.

    Every call goes through ``call_dp`` with keyword arguments, so a local client and a Ray
    actor handle are driven alike.
    """

    def __init__(self, dp_client: Any, *, staging_partition: str) -> None:
        self.dp_client = dp_client
        self.staging_partition = staging_partition
        self._insert_only = accepts_put_mode(dp_client)
        self._mode = {"mode": "insert"} if self._insert_only else {}

    def put(
        self,
        key: str,
        field_dict: Mapping[str, torch.Tensor],
        *,
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Write one row (all its fields in one atomic put); returns once acknowledged.

        The payload is a ``TensorDict`` of batch size ``[1]``, as the data-plane contract types
        ``put_samples(fields=...)``, so a client written to that contract (one that calls
        ``fields.select(...)``, say) works under the sink. It is built unchecked (the store
        takes plain one-row tensors unchecked, ~8 us a row less than the checked constructor). Where the client takes a put
        ``mode``, the put is ``"insert"``: it never writes over a live key (a re-stage of an
        acknowledged call is refused whole, and the sink reads the row back instead), so a
        backend that stops part-way can never leave half of another call in an
        acknowledged row. Clients of the reference contract (no ``mode``) get a plain put.
        """
        self._put(key, _one_row(field_dict), dict(tags or {}))

    def put_built(self, key: str, fields: dict[str, torch.Tensor], tags: dict[str, Any]) -> None:
        """``put`` of a row the sink has just built: one-row CPU tensors and tags in dicts of
        their own, so the payload is wrapped without ``_one_row``'s per-leaf check and nothing
        is copied first (the store validates and copies what it keeps, as for every put)."""
        self._put(key, batch_of(fields, 1), tags)

    def _put(self, key: str, fields: TensorDictBase, tags: dict[str, Any]) -> None:
        call_dp(
            self.dp_client,
            "put_samples",
            sample_ids=[key],
            partition_id=self.staging_partition,
            fields=fields,
            tags=[tags],
            **self._mode,
        )

    def get(self, keys: Sequence[str], *, select_fields: Sequence[str]) -> TensorDictBase:
        """One batched read of ``select_fields`` for ``keys``, in request order."""
        return call_dp(
            self.dp_client,
            "get_samples",
            sample_ids=list(keys),
            partition_id=self.staging_partition,
            select_fields=list(select_fields),
        )

    def clear(self, keys: Sequence[str]) -> None:
        """Drop rows (idempotent: unknown keys are ignored); an empty list makes no call."""
        if keys:
            call_dp(
                self.dp_client,
                "clear_samples",
                sample_ids=list(keys),
                partition_id=self.staging_partition,
            )

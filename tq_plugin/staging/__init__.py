"""Token staging over the data plane.

Every inference call's token delta (and, on media partitions, its pixels) becomes durable
and digest-verifiable in one put before the call is acknowledged (``TQTokenSink``); the
trainer reads it back in batched, request-ordered fetches (``TQTokenSource``), verifies it
against the rollout's receipt and linearizes it into training rows (``RolloutReassembler``).
Digests are byte-compatible with NeMo-Gym's staging scheme (wire versions 2/2/1).
"""

from tq_plugin.staging.capture import (
    build_staging_delta,
    call_record_for,
    make_rollout_receipt,
    make_staged_call_record,
    make_staged_chain,
)
from tq_plugin.staging.conformance import assert_golden_vectors, load_golden_vectors
from tq_plugin.staging.digest import (
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from tq_plugin.staging.encoding import encode_token_ids
from tq_plugin.staging.factory import build_token_sink
from tq_plugin.staging.media import (
    MEDIA_FLAG_FIELDS,
    MEDIA_HAS_FRAMES_FIELD,
    MEDIA_IMGS_FIELD,
    MEDIA_IMGS_SIZES_FIELD,
    MEDIA_METADATA_DIGEST_FIELD,
    MEDIA_METADATA_FIELDS,
    MEDIA_NUM_FRAMES_FIELD,
    MEDIA_PATCH_SIZE_FIELD,
    MEDIA_PRESENT_FIELD,
    MEDIA_STAGING_FIELDS,
    MEDIA_TENSOR_COLUMNS,
    MediaMetadataIntegrityError,
    StagedMediaTensors,
    validate_media_tensors,
)
from tq_plugin.staging.prefix_cache import ChainPrefixCache, resolve_admission_prefix
from tq_plugin.staging.protocols import StagingSink, StagingSource, WeightVersionProvider
from tq_plugin.staging.reassembler import (
    REASSEMBLED_FIELDS,
    REASSEMBLED_MEDIA_FIELDS,
    STATUS_TAG,
    RolloutReassembler,
)
from tq_plugin.staging.rebuild import (
    ExtrasCommitment,
    LinearizedRow,
    RebuildError,
    ReceiptVerificationError,
    WeightVersionSpan,
    verify_and_linearize,
)
from tq_plugin.staging.records import (
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    check_token_versions,
    staging_key,
)
from tq_plugin.staging.sink import TQTokenSink
from tq_plugin.staging.source import (
    FetchedStagedCall,
    RouteFragment,
    StagingReadError,
    TQTokenSource,
)
from tq_plugin.staging.store import (
    STAGING_FIELDS,
    TOKEN_VERSIONS_FIELD,
    TQStagingStore,
    register_staging_partition,
    staging_partition_fields,
)

__all__ = [
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_VERSION",
    "MEDIA_FLAG_FIELDS",
    "MEDIA_HAS_FRAMES_FIELD",
    "MEDIA_IMGS_FIELD",
    "MEDIA_IMGS_SIZES_FIELD",
    "MEDIA_METADATA_DIGEST_FIELD",
    "MEDIA_METADATA_FIELDS",
    "MEDIA_NUM_FRAMES_FIELD",
    "MEDIA_PATCH_SIZE_FIELD",
    "MEDIA_PRESENT_FIELD",
    "MEDIA_STAGING_FIELDS",
    "MEDIA_TENSOR_COLUMNS",
    "REASSEMBLED_FIELDS",
    "REASSEMBLED_MEDIA_FIELDS",
    "STAGING_DIGEST_VERSION",
    "STAGING_FIELDS",
    "STAGING_SCHEMA_VERSION",
    "STATUS_TAG",
    "TOKEN_VERSIONS_FIELD",
    "CallRecord",
    "CaptureAdmission",
    "ChainPrefixCache",
    "CommitCoords",
    "ExtrasCommitment",
    "FetchedStagedCall",
    "LinearizedRow",
    "ManifestFailure",
    "MediaMetadataIntegrityError",
    "RebuildError",
    "ReceiptVerificationError",
    "RolloutManifest",
    "RolloutReassembler",
    "RolloutReceipt",
    "RouteFragment",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "StagedMediaTensors",
    "StagingReadError",
    "StagingSink",
    "StagingSource",
    "TQStagingStore",
    "TQTokenSink",
    "TQTokenSource",
    "WeightVersionProvider",
    "WeightVersionSpan",
    "assert_golden_vectors",
    "build_staging_delta",
    "build_token_sink",
    "call_record_for",
    "check_token_versions",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "encode_token_ids",
    "hash_token_ids",
    "load_golden_vectors",
    "make_rollout_receipt",
    "make_staged_call_record",
    "make_staged_chain",
    "register_staging_partition",
    "resolve_admission_prefix",
    "staging_key",
    "staging_partition_fields",
    "validate_media_tensors",
    "verify_and_linearize",
]

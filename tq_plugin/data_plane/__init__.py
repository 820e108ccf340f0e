"""The data plane: a keyed columnar store, its metadata receipt and the helpers above it.

Layering is one-way: column I/O, packing and sharding talk to a backend only through the
``DataPlaneClient`` methods (``call_dp``); only an adapter imports Ray or transferqueue.
"""

from tq_plugin.data_plane.backends.local import LocalDataPlane
from tq_plugin.data_plane.backends.ray_actor import RayDataPlane  # imports Ray only when built
from tq_plugin.data_plane.calls import uniform_call
from tq_plugin.data_plane.checkpoint import CheckpointError, Restored, load_into
from tq_plugin.data_plane.client import (
    CapacityError,
    DataPlaneClient,
    DataPlaneClosedError,
    DataPlaneCorruptionError,
    call_dp,
)
from tq_plugin.data_plane.column_io import (
    first_write,
    read_columns,
    stamp_global_forward_pad_seqlen,
    write_columns,
)
from tq_plugin.data_plane.jagged import (
    batch_of,
    jaggedize,
    nested_from_lengths,
    payload_bytes,
    round_up,
)
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.microbatches import (
    micro_batch_lengths,
    padded_token_fraction,
    plan_microbatches,
)
from tq_plugin.data_plane.packing import (
    plan_dynamic_batches,
    plan_sequence_packing,
)
from tq_plugin.data_plane.padding import materialize
from tq_plugin.data_plane.schema import (
    ADVANTAGES,
    DP_TRAIN_FIELDS,
    DP_VALUE_TRAIN_FIELDS,
    ELEM_COUNTS_PER_GB,
    GENERATION_LOGPROBS,
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    INPUT_LENGTHS,
    INVALID_TOOL_CALL_MASK,
    MALFORMED_THINKING_MASK,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
    OPD_FULL_FIELDS,
    OPD_FULL_HIDDEN_STATES_FIELD,
    OPD_FULL_LOGITS_FIELD,
    PAD_TO_MULTIPLE,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    RETURNS,
    ROLLOUT_METRICS,
    ROUTE_ENCODING_ENVELOPE,
    ROUTE_ENCODING_LIST,
    ROUTE_ENCODING_NONE,
    ROUTED_EXPERTS_ENCODING_FIELD,
    ROUTED_EXPERTS_FIELD,
    ROUTED_EXTRAS_METADATA_FIELD,
    ROUTED_LEN_FIELD,
    SAMPLE_MASK,
    TEACHER_REFERENCE_LOGPROBS,
    TOKEN_ALIGNED_FIELDS,
    TOKEN_MASK,
    TOTAL_REWARD,
    VALUE_SEED_FIELDS,
    VALUES,
    Layout,
)
from tq_plugin.data_plane.sharding import shard_meta_for_dp

# Listed explicitly (tests/test_architecture.py checks the list matches the imports above).
__all__ = [  # noqa: RUF022  (grouped by kind, not sorted)
    # store and protocol
    "CapacityError",
    "DataPlaneClient",
    "DataPlaneClosedError",
    "DataPlaneCorruptionError",
    "KVBatchMeta",
    "LocalDataPlane",
    "RayDataPlane",
    "call_dp",
    "uniform_call",
    # checkpoints (the format and its guarantees: tq_plugin.data_plane.checkpoint)
    "CheckpointError",
    "Restored",
    "load_into",
    # column I/O, packing, sharding
    "batch_of",
    "first_write",
    "jaggedize",
    "materialize",
    "micro_batch_lengths",
    "nested_from_lengths",
    "padded_token_fraction",
    "payload_bytes",
    "plan_dynamic_batches",
    "plan_microbatches",
    "plan_sequence_packing",
    "read_columns",
    "round_up",
    "shard_meta_for_dp",
    "stamp_global_forward_pad_seqlen",
    "write_columns",
    # schema: field names, field lists and extra_info keys (NeMo RL's exact strings)
    "ADVANTAGES",
    "DP_TRAIN_FIELDS",
    "DP_VALUE_TRAIN_FIELDS",
    "ELEM_COUNTS_PER_GB",
    "GENERATION_LOGPROBS",
    "GLOBAL_FORWARD_PAD_SEQLEN",
    "INPUT_IDS",
    "INPUT_LENGTHS",
    "INVALID_TOOL_CALL_MASK",
    "MALFORMED_THINKING_MASK",
    "MICRO_BATCH_INDICES",
    "MICRO_BATCH_LENGTHS",
    "OPD_FULL_FIELDS",
    "OPD_FULL_HIDDEN_STATES_FIELD",
    "OPD_FULL_LOGITS_FIELD",
    "PAD_TO_MULTIPLE",
    "PREV_LOGPROBS",
    "REFERENCE_POLICY_LOGPROBS",
    "RETURNS",
    "ROLLOUT_METRICS",
    "ROUTE_ENCODING_ENVELOPE",
    "ROUTE_ENCODING_LIST",
    "ROUTE_ENCODING_NONE",
    "ROUTED_EXPERTS_ENCODING_FIELD",
    "ROUTED_EXPERTS_FIELD",
    "ROUTED_EXTRAS_METADATA_FIELD",
    "ROUTED_LEN_FIELD",
    "SAMPLE_MASK",
    "TEACHER_REFERENCE_LOGPROBS",
    "TOKEN_ALIGNED_FIELDS",
    "TOKEN_MASK",
    "TOTAL_REWARD",
    "VALUES",
    "VALUE_SEED_FIELDS",
    "Layout",
]

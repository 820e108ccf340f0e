"""Field names, field lists and ``extra_info`` keys shared by every layer (exact strings).

The names match NeMo RL's data plane, so a user moving from it finds the same columns.
"""

from __future__ import annotations

from typing import Literal

Layout = Literal["padded", "jagged"]

# extra_info keys
MICRO_BATCH_INDICES = "micro_batch_indices"
MICRO_BATCH_LENGTHS = "micro_batch_lengths"
ELEM_COUNTS_PER_GB = "elem_counts_per_gb"
GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
PAD_TO_MULTIPLE = "pad_to_multiple"
ROLLOUT_METRICS = "rollout_metrics"

# columns
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
SAMPLE_MASK = "sample_mask"
TOKEN_MASK = "token_mask"
GENERATION_LOGPROBS = "generation_logprobs"
PREV_LOGPROBS = "prev_logprobs"
REFERENCE_POLICY_LOGPROBS = "reference_policy_logprobs"
ADVANTAGES = "advantages"
VALUES = "values"
RETURNS = "returns"
TOTAL_REWARD = "total_reward"
TEACHER_REFERENCE_LOGPROBS = "teacher_reference_logprobs"
INVALID_TOOL_CALL_MASK = "invalid_tool_call_mask"
MALFORMED_THINKING_MASK = "malformed_thinking_mask"
OPD_FULL_HIDDEN_STATES_FIELD = "teacher_full_hidden_states"
OPD_FULL_LOGITS_FIELD = "teacher_full_logits"
OPD_FULL_FIELDS = (OPD_FULL_HIDDEN_STATES_FIELD, OPD_FULL_LOGITS_FIELD)

ROUTED_EXPERTS_FIELD = "routed_experts"
ROUTED_LEN_FIELD = "routed_len"
ROUTED_EXPERTS_ENCODING_FIELD = "routed_experts_encoding"
ROUTED_EXTRAS_METADATA_FIELD = "extras_metadata_json"
ROUTE_ENCODING_NONE = 0
ROUTE_ENCODING_ENVELOPE = 1
ROUTE_ENCODING_LIST = 2


# field lists, in order
DP_TRAIN_FIELDS = (
    INPUT_IDS,
    INPUT_LENGTHS,
    GENERATION_LOGPROBS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    ADVANTAGES,
    TOKEN_MASK,
    SAMPLE_MASK,
)
# what a value model's forward reads, and what its training step reads
VALUE_SEED_FIELDS = (INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK)
DP_VALUE_TRAIN_FIELDS = (INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK, VALUES, RETURNS)

# Per-token columns: one element per token of the row, stored jagged at the row's input length.
# sample_mask is listed (as upstream) but is per-row, so it stays rectangular.
TOKEN_ALIGNED_FIELDS = frozenset(
    {
        INPUT_IDS,
        GENERATION_LOGPROBS,
        PREV_LOGPROBS,
        REFERENCE_POLICY_LOGPROBS,
        ADVANTAGES,
        TOKEN_MASK,
        SAMPLE_MASK,
        ROUTED_EXPERTS_FIELD,
        TEACHER_REFERENCE_LOGPROBS,
        *OPD_FULL_FIELDS,
        RETURNS,
        VALUES,
        INVALID_TOOL_CALL_MASK,
        MALFORMED_THINKING_MASK,
    }
)

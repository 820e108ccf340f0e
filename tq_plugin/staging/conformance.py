"""The staging scheme's golden vectors, as data, and a self-check against them.

The inputs and expected SHA-256 digests every compatible implementation must reproduce
(NeMo-Gym 0.7.0 ships the same data as ``conformance/golden_vectors.json``): the keys of
``staged_call`` are exactly the keyword arguments of ``compute_staging_digest``.
"""

from __future__ import annotations

import copy
from typing import Any

from tq_plugin.staging.digest import compute_extras_digest, compute_staging_digest

_EXTRAS_DIGEST = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
_GOLDEN_VECTORS: dict[str, Any] = {
    "extras": {"routed_experts": [[[1, 2]], [[3, 4]]]},
    "extras_digest": _EXTRAS_DIGEST,
    "staged_call": {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": "parent-1",
        "mode": "token_in",
        "prev_len": 3,
        "delta_len": 2,
        "cum_len": 5,
        "weight_version": 7,
        "token_ids_delta": [10, 11],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.25],
        "extras_digest": _EXTRAS_DIGEST,
        "chain_hash": "1" * 64,
        "cumulative_hash": "2" * 64,
    },
    "staged_call_digest": "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27",
}


def load_golden_vectors() -> dict[str, Any]:
    """A fresh copy of the golden vectors (callers may mutate it)."""
    return copy.deepcopy(_GOLDEN_VECTORS)


def assert_golden_vectors() -> None:
    """Recompute both golden digests; ``AssertionError`` names the one that differs."""
    vectors = load_golden_vectors()
    extras = compute_extras_digest(vectors["extras"])
    if extras != vectors["extras_digest"]:
        raise AssertionError(f"extras digest {extras} != golden {vectors['extras_digest']}")
    call = compute_staging_digest(**vectors["staged_call"])
    if call != vectors["staged_call_digest"]:
        raise AssertionError(f"staged-call digest {call} != golden {vectors['staged_call_digest']}")

"""The digest scheme: golden vectors, constants, rejections, and bit-exactness traps."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import pathlib
import re
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch

from tq_plugin.staging import (
    EMPTY_EXTRAS_DIGEST,
    assert_golden_vectors,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    encode_token_ids,
    hash_token_ids,
    load_golden_vectors,
)

# NeMo Gym 0.7.0's own conformance data, committed as data (tests/data/nemo_gym_0.7.0/): the
# expected digests come from Gym, not from tq_plugin.staging.conformance.
GYM_VECTORS_PATH = (pathlib.Path(__file__).resolve().parents[1] / "data" / "nemo_gym_0.7.0"
                    / "golden_vectors.json")
GYM_VECTORS = json.loads(GYM_VECTORS_PATH.read_text())
GOLDEN = json.loads(GYM_VECTORS_PATH.read_text())  # mutated copies are made from it
GOLDEN_EXTRAS = GOLDEN["extras"]
GOLDEN_EXTRAS_DIGEST = GOLDEN["extras_digest"]
GOLDEN_CALL = GOLDEN["staged_call"]
GOLDEN_CALL_DIGEST = GOLDEN["staged_call_digest"]


def test_gyms_golden_vectors_reproduce() -> None:
    assert compute_extras_digest(GYM_VECTORS["extras"]) == GYM_VECTORS["extras_digest"]
    assert compute_staging_digest(**GYM_VECTORS["staged_call"]) == GYM_VECTORS["staged_call_digest"]


def test_the_conformance_module_carries_gyms_vectors() -> None:
    assert load_golden_vectors() == GYM_VECTORS
    assert_golden_vectors()


def test_the_committed_vectors_are_the_installed_gyms() -> None:
    spec = importlib.util.find_spec("nemo_gym")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nemo-gym 0.7.0 is not installed (make install installs it)")
    shipped = (pathlib.Path(next(iter(spec.submodule_search_locations))) / "token_id_capture"
               / "staging" / "conformance" / "golden_vectors.json")
    assert shipped.read_bytes() == GYM_VECTORS_PATH.read_bytes()


def test_reference_constants() -> None:
    assert EMPTY_EXTRAS_DIGEST == compute_extras_digest(None)
    assert EMPTY_EXTRAS_DIGEST == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
    assert hash_token_ids([]) == "17088fc6f8fd317bf02bd83e106f7ca2dfb7b9cfc63927c2387d4c87f29578ef"
    assert compute_chain_hash(None, [10, 11, 12]) == (
        "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65"
    )


def test_extras_digest_ignores_key_order_and_token_encoding_counts_length() -> None:
    assert compute_extras_digest({"a": 1, "b": 2}) == compute_extras_digest({"b": 2, "a": 1})
    assert compute_extras_digest(OrderedDict(a=1)) == compute_extras_digest({"a": 1})
    assert encode_token_ids([1]) != encode_token_ids([1, 0])


@pytest.mark.parametrize("value", [1, 1.0, True, {}, None, [], "1", -0.0, 0.0])
def test_extras_values_that_look_alike_hash_apart(value: object) -> None:
    others = [1, 1.0, True, {}, None, [], "1", -0.0, 0.0]
    digests = {repr(v): compute_extras_digest({"k": v}) for v in others}
    assert len(set(digests.values())) == len(others)
    assert compute_extras_digest({"k": value}) == digests[repr(value)]
    assert compute_extras_digest({}) != compute_extras_digest(None)


def _scalar_tokens(ids: list[int]) -> bytes:
    """The spec read literally: one struct pack per id (the oracle for the vectorized encoder)."""
    return struct.pack(">Q", len(ids)) + b"".join(struct.pack(">Q", i) for i in ids)


def test_vectorized_token_encoding_matches_the_spec_and_accepts_tensors() -> None:
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(0, 2**63 - 1, size=300)] + [2**64 - 1, 0]
    assert encode_token_ids(ids) == _scalar_tokens(ids)
    small = ids[:-2]
    assert encode_token_ids(torch.tensor(small)) == _scalar_tokens(small)
    assert encode_token_ids(np.asarray(small, dtype=np.int64)) == _scalar_tokens(small)


def test_tensor_columns_hash_like_python_lists() -> None:
    call = dict(GOLDEN_CALL)
    call["token_ids_delta"] = torch.tensor([10, 11])
    call["token_mask_delta"] = torch.tensor([0.0, 1.0])
    call["generation_log_probs_delta"] = torch.tensor([0.0, -0.25])
    assert compute_staging_digest(**call) == GOLDEN_CALL_DIGEST


_MUTATIONS = {
    "rollout_id": "rollout-2",
    "model_call_id": "call-2",
    "parent_call_id": "parent-2",
    "mode": "text",
    "prev_len": 4,
    "delta_len": 3,
    "cum_len": 6,
    "weight_version": 8,
    "token_ids_delta": [10, 12],
    "token_mask_delta": [1.0, 1.0],
    "generation_log_probs_delta": [0.0, -0.5],
    "extras_digest": EMPTY_EXTRAS_DIGEST,
    "chain_hash": "3" * 64,
    "cumulative_hash": "4" * 64,
}


# Mutations that break a cross-field rule on their own: refused, and the error says which rule.
_REFUSED = {
    "cum_len": "cum_len 6 does not equal prev_len + delta_len",
    "prev_len": "cum_len 5 does not equal prev_len + delta_len",
    "delta_len": "delta_len 3 does not match 2 token IDs",
    "mode": "a child call must use token_in mode",
}


@pytest.mark.parametrize("field", sorted(set(_MUTATIONS) - set(_REFUSED)))
def test_every_mutable_field_changes_the_digest(field: str) -> None:
    call = {**GOLDEN_CALL, field: _MUTATIONS[field]}
    assert compute_staging_digest(**call) != GOLDEN_CALL_DIGEST


@pytest.mark.parametrize("field", sorted(_REFUSED))
def test_a_mutation_that_breaks_a_rule_is_refused_naming_it(field: str) -> None:
    call = {**GOLDEN_CALL, field: _MUTATIONS[field]}
    with pytest.raises(ValueError, match=re.escape(_REFUSED[field])):
        compute_staging_digest(**call)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("schema_version", 1, "unsupported staging schema"),
        ("digest_version", 1, "unsupported staging digest"),
        ("extras_digest_version", 2, "unsupported extras digest"),
        ("schema_version", True, "unsupported staging schema"),
    ],
)
def test_unknown_versions_are_rejected(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_staging_digest(**{**GOLDEN_CALL, field: value})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_numbers_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        compute_staging_digest(**{**GOLDEN_CALL, "generation_log_probs_delta": [0.0, bad]})
    with pytest.raises(ValueError, match="finite"):
        compute_extras_digest({"x": [bad]})


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"rollout_id": ""}, "non-empty"),
        ({"parent_call_id": ""}, "parent_call_id must be non-empty"),
        ({"mode": "x"}, "unsupported capture mode"),
        ({"parent_call_id": None}, "parentless call must be a text-mode root"),
        ({"mode": "text"}, "child call must use token_in"),
        ({"delta_len": 3}, "delta_len 3 does not match 2 token IDs"),
        ({"token_mask_delta": [0.0]}, "equal lengths"),
        ({"token_mask_delta": [0.5, 1.0]}, "only 0.0 or 1.0"),
        ({"generation_log_probs_delta": [-0.1, -0.25]}, "prompt-carry"),
        ({"cum_len": 9}, r"cum_len 9 does not equal prev_len \+ delta_len \(5\)"),
        ({"extras_digest": "A" * 64}, "lowercase SHA-256"),
        ({"chain_hash": "xyz"}, "lowercase SHA-256"),
        ({"token_ids_delta": [10, -1]}, "unsigned 64-bit"),
        ({"token_ids_delta": [10, 2**64]}, "unsigned 64-bit"),
        ({"token_ids_delta": [10, True]}, "unsigned 64-bit"),
        ({"generation_log_probs_delta": [0.0, -1e39]}, "cannot be represented as float32"),
        ({"generation_log_probs_delta": [0.0, -1]}, "finite Python floats"),
        ({"weight_version": -1}, "unsigned 64-bit"),
    ],
)
def test_digest_prechecks_name_the_rule(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_staging_digest(**{**GOLDEN_CALL, **changes})


def test_extras_reject_ambiguous_or_unsupported_types() -> None:
    with pytest.raises(TypeError, match="string keys"):
        compute_extras_digest({"a": {1: 2}})
    for bad in [(1, 2), b"x", {1, 2}, np.int64(3), OrderedDict(a=1)]:
        with pytest.raises(TypeError, match="unsupported"):
            compute_extras_digest({"a": bad})
    with pytest.raises(TypeError, match="mapping or None"):
        compute_extras_digest([1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signed 64-bit"):
        compute_extras_digest({"a": 2**80})
    with pytest.raises(ValueError, match="signed 64-bit"):
        compute_extras_digest({"a": list(range(20)) + [2**63]})


def test_long_int_lists_in_extras_hash_like_the_per_value_encoding() -> None:
    values = list(range(-20, 40))
    short_digest = hashlib.sha256(
        b"nemo-gym-staging-extras-v1\x01D"
        + struct.pack(">Q", 1)
        + struct.pack(">Q", 1)
        + b"a"
        + b"L"
        + struct.pack(">Q", len(values))
        + b"".join(b"I" + struct.pack(">q", v) for v in values)
    ).hexdigest()
    assert compute_extras_digest({"a": values}) == short_digest


def test_negative_zero_keeps_its_sign_bit_and_sub_float32_noise_collides() -> None:
    positive = compute_staging_digest(**{**GOLDEN_CALL, "generation_log_probs_delta": [0.0, 0.0]})
    negative = compute_staging_digest(**{**GOLDEN_CALL, "generation_log_probs_delta": [0.0, -0.0]})
    assert positive != negative
    a = compute_staging_digest(**{**GOLDEN_CALL, "generation_log_probs_delta": [0.0, -0.1]})
    b = compute_staging_digest(
        **{**GOLDEN_CALL, "generation_log_probs_delta": [0.0, -0.1000000001]}
    )
    assert a == b


def test_chain_hash_marks_roots_apart_from_children() -> None:
    root = compute_chain_hash(None, [1, 2])
    child = compute_chain_hash(root, [3])
    assert child != compute_chain_hash(None, [3])
    with pytest.raises(ValueError, match="lowercase SHA-256"):
        compute_chain_hash("F" * 64, [1])


@pytest.mark.parametrize("n", [3, 511, 512, 2000])
def test_long_and_short_float_columns_hash_alike_and_reject_alike(n: int) -> None:
    rng = np.random.default_rng(n)
    ids = [int(x) for x in rng.integers(0, 2**40, n)]
    mask = [0.0] + [1.0] * (n - 1)
    logprobs = [0.0] + [float(-x) for x in rng.random(n - 1)]
    logprobs[-1] = -(2.0**128 - 2.0**104)  # float32 max, exactly representable
    call = {
        **GOLDEN_CALL,
        "delta_len": n,
        "cum_len": 3 + n,
        "token_ids_delta": ids,
        "token_mask_delta": mask,
        "generation_log_probs_delta": logprobs,
    }
    wire = {
        **call,
        "token_ids_delta": torch.tensor(ids),
        "token_mask_delta": torch.tensor(mask, dtype=torch.float32),
        "generation_log_probs_delta": torch.tensor(logprobs, dtype=torch.float32),
    }
    assert compute_staging_digest(**call) == compute_staging_digest(**wire)
    for bad, match in (
        (math.nan, "finite"),
        (-1e39, "cannot be represented as float32"),
        (-(2.0**128 - 2.0**103), "cannot be represented as float32"),
    ):
        with pytest.raises(ValueError, match=match):
            compute_staging_digest(**{**call, "generation_log_probs_delta": logprobs[:-1] + [bad]})
    with pytest.raises(ValueError, match="prompt-carry"):
        compute_staging_digest(**{**call, "generation_log_probs_delta": [-0.5] + logprobs[1:]})
    with pytest.raises(ValueError, match="only 0.0 or 1.0"):
        compute_staging_digest(**{**call, "token_mask_delta": mask[:-1] + [0.5]})


@pytest.mark.parametrize(
    "mask,logprobs,ok",
    [
        ([0.0, 0.0, 1.0], [0.0, -0.0, -1.0], True),
        ([1.0, 0.0, 1.0], [-1.0, 0.0, -1.0], True),  # interleaved carry (the verifier's concern)
        ([1.0, 0.0, 1.0], [-1.0, -1e-50, -1.0], False),
        ([0.0, 0.0, 0.0], [0.0, 0.0, 1e-300], False),
        ([1.0, 1.0], [-1.0, -2.0], True),
        ([0.0, 1.0, 0.0], [0.0, -1.0, 5e-324], False),
        ([0.0, 1.0, -0.0], [0.0, -1.0, 0.0], True),
    ],
)
def test_carry_rule_holds_for_every_mask_layout(mask, logprobs, ok) -> None:
    call = {**GOLDEN_CALL, "delta_len": 3, "cum_len": 6, "token_ids_delta": [1, 2, 3][: len(mask)]}
    call.update(
        delta_len=len(mask),
        cum_len=3 + len(mask),
        token_mask_delta=mask,
        generation_log_probs_delta=logprobs,
    )
    wire = {
        **call,
        "token_mask_delta": np.asarray(mask),
        "generation_log_probs_delta": np.asarray(logprobs),
    }
    for fields in (call, wire):
        if ok:
            compute_staging_digest(**fields)
        else:
            with pytest.raises(ValueError, match="prompt-carry"):
                compute_staging_digest(**fields)


class _Id(int):
    pass


class _Real(float):
    pass


@pytest.mark.parametrize("n", [2, 300])
@pytest.mark.parametrize(
    "column,bad,match",
    [
        ("token_ids_delta", True, "unsigned 64-bit"),
        ("token_ids_delta", False, "unsigned 64-bit"),
        ("token_ids_delta", np.int64(5), "unsigned 64-bit"),
        ("token_ids_delta", np.uint32(5), "unsigned 64-bit"),
        ("token_ids_delta", _Id(5), "unsigned 64-bit"),
        ("token_ids_delta", 5.0, "unsigned 64-bit"),
        ("token_ids_delta", -3, "unsigned 64-bit"),
        ("token_ids_delta", [5], "unsigned 64-bit"),
        ("generation_log_probs_delta", np.float64(-0.5), "finite Python floats"),
        ("generation_log_probs_delta", _Real(-0.5), "finite Python floats"),
        ("generation_log_probs_delta", True, "finite Python floats"),
        ("generation_log_probs_delta", -1, "finite Python floats"),
        ("generation_log_probs_delta", "x", "finite Python floats"),
        ("token_mask_delta", np.float64(1.0), "finite Python floats"),
        ("token_mask_delta", 1, "finite Python floats"),
    ],
)
def test_list_columns_keep_exact_types_wherever_the_odd_value_sits(
    n: int, column: str, bad: object, match: str
) -> None:
    """The one-pass list reader refuses every non-exact element, first, middle or last."""
    call = {
        **GOLDEN_CALL,
        "delta_len": n,
        "cum_len": 3 + n,
        "token_ids_delta": list(range(7, 7 + n)),
        "token_mask_delta": [0.0] + [1.0] * (n - 1),
        "generation_log_probs_delta": [0.0] + [-0.5] * (n - 1),
    }
    compute_staging_digest(**call)
    for at in (n - 1, n // 2, 1):
        column_values = list(call[column])
        column_values[at] = bad
        with pytest.raises(ValueError, match=match) as caught:
            compute_staging_digest(**{**call, column: column_values})
        assert column in str(caught.value)


@pytest.mark.parametrize("n", [3, 700])
def test_list_reader_and_struct_fallback_hash_alike(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids on both sides of 2**31 (the one-pass reader's range), shared float objects,
    -0.0 and float32 rounding hash the same through the one-pass reader and through the
    struct path it falls back to (forced here by disabling the reader)."""
    from tq_plugin.staging import encoding as digest_module  # the list reader lives there

    rng = np.random.default_rng(n)
    one = 1.0
    for ids in (
        [int(x) for x in rng.integers(0, 2**31 - 1, n)],
        [int(x) for x in rng.integers(0, 2**31 - 1, n - 1)] + [2**31],
        [0] * n,
    ):
        call = {
            **GOLDEN_CALL,
            "delta_len": n,
            "cum_len": 3 + n,
            "token_ids_delta": ids,
            "token_mask_delta": [0.0, -0.0] + [one] * (n - 2),
            "generation_log_probs_delta": [0.0, -0.0] + [-0.1000000001] * (n - 2),
        }
        fast = compute_staging_digest(**call)
        monkeypatch.setattr(digest_module, "_MARSHAL_OK", False)
        assert compute_staging_digest(**call) == fast
        monkeypatch.setattr(digest_module, "_MARSHAL_OK", True)
    assert digest_module._MARSHAL_OK is digest_module._marshal_layout_holds()


@pytest.mark.parametrize(
    "bad",
    ["ab" * 31 + " a", "ab" * 31 + "AB", "ab " * 21 + "a", "\u0660" * 64, "ab" * 31 + "a", "ab" * 33],
)
def test_hex_digests_must_be_exactly_64_lowercase_hex_characters(bad: str) -> None:
    with pytest.raises(ValueError, match="chain_hash must be a lowercase SHA-256 hex digest"):
        compute_chain_hash(bad, [1])
    assert compute_chain_hash("ab" * 32, [1]) != compute_chain_hash(None, [1])

"""Fuzzing records, admissions and media bundles: every bad input is refused by field, nothing lands.

Each case ends in one documented outcome:

* a record: ``StagedCallRecord`` validation raises pydantic's ``ValidationError`` (a
  ``ValueError``) naming the field; ``TQTokenSink.stage`` never raises and returns
  ``ok=False`` with an error naming the field (or a field bound to it by a cross-field rule,
  or ``digest`` when the bytes no longer match it), and the store is unchanged. The one
  documented deferral: extras that carry routes are checked against ``extras_digest`` at the
  point of use (``RouteFragment.verify``), not by the sink;
* an admission: ``CaptureAdmission`` raises ``ValidationError`` naming the field;
* a media bundle: ``validate_media_tensors`` raises ``TypeError`` / ``ValueError`` naming the
  attachment key, and staging it fails the same way with the store unchanged.

Failures found by the fuzzer are kept below as explicit ``@example`` regression cases.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import (
    CaptureAdmission,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    TQTokenSink,
    TQTokenSource,
    make_staged_chain,
    register_staging_partition,
    validate_media_tensors,
)

STAGING, MEDIA = "rollout_staging", "media_staging"
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)

# Fields bound by a cross-field rule: an error may name any field of the mutated one's group.
_GROUPS = [
    {"rollout_id", "model_call_id"},
    {"parent_call_id", "mode", "prev_len"},
    {
        "prev_len",
        "delta_len",
        "cum_len",
        "token_ids_delta",
        "token_mask_delta",
        "generation_log_probs_delta",
    },
    {"extras", "extras_digest", "routed_experts"},
]
RECORD_FIELDS = list(StagedCallRecord.model_fields)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["x\ud800", "a/b", "%2F", "", "text", "token_in", "0" * 64, "A" * 64]),
    st.binary(max_size=4),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(
        st.one_of(st.just("routed_experts"), st.text(max_size=3)),
        st.one_of(
            scalars, st.lists(st.lists(st.lists(scalars, max_size=2), max_size=2), max_size=3)
        ),
        max_size=2,
    ),
)


def _accepted_names(field: str) -> set[str]:
    names = {field, "digest"}
    for group in _GROUPS:
        if field in group:
            names |= group
    return names


def _chain(child: bool) -> list[StagedCallRecord]:
    turns = [([1, 2], [3], [-0.5]), ([4], [5, 6], [-0.25, -0.125])]
    return make_staged_chain("r", turns[: 2 if child else 1])


def _state(store: LocalDataPlane, partition: str) -> tuple[list[str], Any]:
    keys = store.list_sample_ids(partition_id=partition)
    if not keys:
        return keys, None
    digests = store.get_samples(
        sample_ids=keys, partition_id=partition, select_fields=["digest_bytes"]
    )
    return keys, digests["digest_bytes"].tolist()


@FUZZ
@given(
    field=st.sampled_from(RECORD_FIELDS),
    value=values,
    child=st.booleans(),
    acked_first=st.booleans(),
)
@example(field="token_ids_delta", value=[1.0, 2.0], child=False, acked_first=False)  # finding 8
@example(field="rollout_id", value="r\ud800", child=False, acked_first=True)  # finding 7
# Found by this fuzzer (each failed before its fix): errors that named no field, or raised.
@example(field="schema_version", value=None, child=False, acked_first=False)
@example(field="parent_call_id", value=False, child=True, acked_first=False)
@example(field="token_mask_delta", value=[], child=False, acked_first=False)
@example(field="token_ids_delta", value=0.5, child=True, acked_first=False)
@example(field="token_mask_delta", value=[0, 0, 0], child=False, acked_first=False)
@example(field="extras", value=[], child=True, acked_first=False)
@example(field="extras", value={"": b""}, child=False, acked_first=False)
@example(field="extras", value={"routed_experts": [[[1]]] * 3}, child=False, acked_first=False)
@example(field="extras", value={"": "x\ud800"}, child=False, acked_first=False)
@example(
    field="extras", value={"routed_experts": [[[1]]] * 3, "k": b""}, child=False, acked_first=False
)
def test_a_mutated_record_is_refused_by_field_and_never_lands(field, value, child, acked_first):
    record = _chain(child)[-1]
    mutated = record.model_copy(update={field: value})
    store = LocalDataPlane()
    register_staging_partition(store, STAGING)
    sink = TQTokenSink(store, staging_partition=STAGING)
    if acked_first:
        assert sink.stage(record).ok
    before = _state(store, STAGING)

    result = sink.stage(mutated)  # must never raise
    try:
        StagedCallRecord.model_validate(mutated.model_dump(warnings=False))
        valid = True
    except ValidationError as exc:
        valid = False
        names = {str(part) for err in exc.errors() for part in err["loc"]} | {str(exc)}
        assert any(name in text for name in _accepted_names(field) for text in names), str(exc)

    if result.ok:
        source = TQTokenSource(
            store, staging_partition=STAGING, snapshot_cls=StagedCallBaseSnapshot
        )
        (fetched,) = source.fetch_for_finalization(
            [result.staging_key], include_route_fragments=True
        )
        assert fetched.snapshot.digest == mutated.digest
        if not valid:
            # Documented deferral: extras carrying routes are hashed at the point of use, not
            # by the sink (MoE routes are large); such a row must fail that check.
            assert field == "extras" and fetched.fragment is not None, (
                f"the sink acknowledged an invalid record ({field}={value!r})"
            )
            with pytest.raises(ValueError, match="extras_digest"):
                fetched.fragment.verify(fetched.snapshot.extras_digest)
        return
    assert isinstance(result.error, str) and result.error
    assert any(name in result.error for name in _accepted_names(field)), result.error
    assert _state(store, STAGING) == before, "a refused stage changed the store"


admission_fields = {
    "rollout_id": st.one_of(st.just("r"), scalars),
    "model_call_id": st.one_of(st.just("c"), scalars),
    "parent_call_id": st.one_of(st.none(), st.just("p"), scalars),
    "prev_len": st.one_of(st.integers(0, 3), scalars),
    "mode": st.one_of(st.sampled_from(["text", "token_in"]), scalars),
    "required_prefix_token_ids": st.one_of(st.lists(st.integers(-2, 5), max_size=3), values),
    "staging_chain": st.one_of(st.lists(st.text(max_size=3), max_size=2), values),
    "parent_chain_hash": st.one_of(st.none(), st.just("a" * 64), scalars),
}


@FUZZ
@given(kwargs=st.fixed_dictionaries({}, optional=admission_fields))
@example(kwargs={"mode": "text", "rollout_id": "r", "staging_chain": [""], "model_call_id": "c"})
def test_an_admission_is_valid_or_refused_naming_a_field(kwargs):
    try:
        admission = CaptureAdmission(**kwargs)
    except ValidationError as exc:
        for err in exc.errors():
            named = {str(p) for p in err["loc"]} & set(admission_fields)
            assert named or any(f in err["msg"] for f in admission_fields), err
        return
    if admission.mode == "token_in":
        assert admission.parent_call_id is not None and admission.prev_len > 0
        assert admission.parent_chain_hash is not None
    else:
        assert admission.parent_call_id is None and admission.prev_len == 0


dtypes = st.sampled_from(
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.uint8,
    ]
)


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    dtype = draw(dtypes)
    if dtype.is_floating_point:
        fill = draw(st.floats(allow_nan=True, allow_infinity=True, width=16))
    else:
        fill = draw(st.integers(-3, 20))
    return torch.full(shape, fill).to(dtype)


@st.composite
def bundles(draw):
    """Media bundles near the valid shape: a still or a video, with one part perturbed."""
    patch = draw(st.sampled_from([1, 2]))
    frames = draw(st.integers(1, 2))
    bundle: dict[str, Any] = {
        "imgs": torch.randn(1, 4 * frames, 3 * patch * patch).to(torch.bfloat16),
        "imgs_sizes": torch.tensor([[2 * patch, 2 * patch]] * frames, dtype=torch.int32),
    }
    if draw(st.booleans()):
        bundle["num_frames"] = torch.tensor([frames], dtype=torch.int32)
    key = draw(st.sampled_from(["imgs", "imgs_sizes", "num_frames", "bogus", None]))
    if key is not None:
        bundle[key] = draw(st.one_of(tensors(), scalars))
    return bundle


def _media_names(bundle: Any) -> list[str]:
    return ["attachment", "imgs", "imgs_sizes", "num_frames", *map(str, bundle)]


@FUZZ
@given(bundle=st.one_of(bundles(), scalars))
def test_a_media_bundle_is_valid_or_refused_naming_the_attachment(bundle):
    try:
        validate_media_tensors(bundle)
        valid = True
    except (TypeError, ValueError) as exc:
        valid = False
        assert any(
            name in str(exc) for name in _media_names(bundle if isinstance(bundle, dict) else {})
        ), str(exc)
    store = LocalDataPlane()
    register_staging_partition(store, MEDIA, capture_media=True)
    sink = TQTokenSink(
        store, staging_partition=MEDIA, capture_media=True, media_pixel_dtype=torch.bfloat16
    )
    (record,) = _chain(child=False)
    result = sink.stage(record, attachments=bundle)
    if result.ok:
        assert valid
        return
    names = _media_names(bundle if isinstance(bundle, dict) else {})
    assert any(name in result.error for name in names) or "dtype" in result.error, result.error
    assert store.list_sample_ids(partition_id=MEDIA) == []
    if valid:  # only the column dtype can refuse a valid bundle
        assert "dtype" in result.error and not math.isnan(0.0)

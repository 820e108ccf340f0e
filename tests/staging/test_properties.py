"""Property tests: random chains and random media bundles round-trip stage → fetch → verify →
linearize, byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import (
    StagedCallBaseSnapshot,
    TQTokenSink,
    TQTokenSource,
    make_rollout_receipt,
    make_staged_chain,
    register_staging_partition,
    verify_and_linearize,
)

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

token = st.integers(min_value=0, max_value=2**63 - 1)
logprob = st.one_of(
    st.floats(min_value=-50.0, max_value=0.0, allow_nan=False, width=64),
    st.sampled_from([-0.0, -1e-45, -3.4e38]),
)


@st.composite
def turns(draw):
    """1-5 calls: each carries 0-6 new prompt tokens (a root at least 1 token) and generates 1-8."""
    out = []
    for i in range(draw(st.integers(1, 5))):
        carry = draw(st.lists(token, min_size=0 if i else 1, max_size=6))
        generated = draw(st.lists(token, min_size=1, max_size=8))
        out.append(
            (
                carry,
                generated,
                draw(st.lists(logprob, min_size=len(generated), max_size=len(generated))),
            )
        )
    return out


extras_value = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=5),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _fresh(capture_media: bool = False):
    dp = LocalDataPlane()
    register_staging_partition(dp, "s", capture_media=capture_media)
    return dp


@SETTINGS
@given(
    chain_turns=turns(),
    extras=st.one_of(st.none(), st.dictionaries(st.text(max_size=4), extras_value, max_size=3)),
)
def test_random_chains_round_trip_and_verify(chain_turns, extras) -> None:
    dp = _fresh()
    records = make_staged_chain(
        "rollout",
        chain_turns,
        weight_versions=list(range(len(chain_turns))),
        extras=[extras] * len(chain_turns),
    )
    sink = TQTokenSink(dp, staging_partition="s")
    assert all(sink.stage(r).ok for r in records)
    source = TQTokenSource(dp, staging_partition="s", snapshot_cls=StagedCallBaseSnapshot)
    fetched = source.fetch_for_finalization([r.staging_key for r in records])
    for record, item in zip(records, fetched):
        assert item.snapshot.digest == record.digest
        assert item.snapshot.token_ids_delta == record.token_ids_delta
        want32 = np.asarray(record.generation_log_probs_delta, dtype=np.float32).view(np.uint32)
        got32 = np.asarray(item.snapshot.generation_log_probs_delta, dtype=np.float32).view(
            np.uint32
        )
        assert np.array_equal(want32, got32)
        assert item.extras == extras
    row = verify_and_linearize(make_rollout_receipt(records), [i.snapshot for i in fetched])
    expected = [t for carry, gen, _ in chain_turns for t in (*carry, *gen)]
    assert row.token_ids == expected
    assert source.fetch_prefix_token_ids([r.staging_key for r in records]) == expected


@st.composite
def media_bundles(draw):
    patch = draw(st.sampled_from([1, 2, 3]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    frames = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=4))
    sizes = torch.tensor(
        [[h * patch, w * patch] for h, w in frames],
        dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )
    total = sum(h * w for h, w in frames)
    seed = draw(st.integers(0, 2**16))
    imgs = torch.randn(
        1, total, 3 * patch * patch, generator=torch.Generator().manual_seed(seed)
    ).to(dtype)
    bundle = {"imgs": imgs, "imgs_sizes": sizes}
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(frames) - 1))
        counts = [c for c in (cut, len(frames) - cut) if c]
        bundle["num_frames"] = torch.tensor(counts, dtype=torch.int32)
    return bundle


@SETTINGS
@given(bundles=st.lists(media_bundles(), min_size=1, max_size=4), text_calls=st.integers(0, 2))
def test_random_media_bundles_round_trip_bit_exact(bundles, text_calls) -> None:
    dtype = bundles[0]["imgs"].dtype
    bundles = [b for b in bundles if b["imgs"].dtype == dtype]
    dp = _fresh(capture_media=True)
    sink = TQTokenSink(dp, staging_partition="s", capture_media=True, media_pixel_dtype=dtype)
    keys = []
    for i, bundle in enumerate(bundles + [None] * text_calls):
        (record,) = make_staged_chain(f"r{i}", [([1], [2], [-0.5])])
        assert sink.stage(record, attachments=bundle).ok
        keys.append(record.staging_key)
    source = TQTokenSource(
        dp, staging_partition="s", capture_media=True, snapshot_cls=StagedCallBaseSnapshot
    )
    items = source.fetch_for_finalization(keys)
    assert [i.media_present for i in items] == [True] * len(bundles) + [False] * text_calls
    for has_frames in (False, True):
        chosen = [(item, b) for item, b in zip(items, bundles) if ("num_frames" in b) is has_frames]
        got = source.fetch_media([item for item, _ in chosen])
        for media, (_, bundle) in zip(got, chosen):
            assert media.imgs.dtype == bundle["imgs"].dtype and torch.equal(
                media.imgs, bundle["imgs"]
            )
            assert torch.equal(
                media.imgs_sizes.to(torch.int64), bundle["imgs_sizes"].to(torch.int64)
            )
            if has_frames:
                assert torch.equal(media.num_frames, bundle["num_frames"])
            else:
                assert media.num_frames is None


@pytest.mark.parametrize("bad_position", [0, 1, 2])
def test_any_flipped_stored_token_is_caught(bad_position: int) -> None:
    dp = _fresh()
    records = make_staged_chain(
        "r", [([1, 2], [3], [-0.5]), ([4], [5], [-0.5]), ([6], [7], [-0.5])]
    )
    sink = TQTokenSink(dp, staging_partition="s")
    assert all(sink.stage(r).ok for r in records)
    victim = records[bad_position]
    flipped = torch.tensor([victim.token_ids_delta], dtype=torch.int64)
    flipped[0, 0] ^= 1
    dp.put_samples(
        sample_ids=[victim.staging_key], partition_id="s", fields={"token_ids_delta": flipped}
    )
    source = TQTokenSource(dp, staging_partition="s", snapshot_cls=StagedCallBaseSnapshot)
    with pytest.raises(ValueError, match="digest does not match"):
        source.fetch([r.staging_key for r in records])

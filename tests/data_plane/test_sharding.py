"""``shard_meta_for_dp``: keys disjoint and covering, balanced, same microbatch count per rank."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_plugin.data_plane.column_io import round_up, stamp_global_forward_pad_seqlen
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import (
    ELEM_COUNTS_PER_GB,
    GLOBAL_FORWARD_PAD_SEQLEN,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
    ROLLOUT_METRICS,
)
from tq_plugin.data_plane.sharding import shard_meta_for_dp

SEQPACK = {
    "algorithm": "modified_first_fit_decreasing",
    "input_key": "input_ids",
    "input_lengths_key": "input_lengths",
    "sequence_length_pad_multiple": 64,
    "max_tokens_per_microbatch": 4096,
}
DYNBATCH = {
    "input_key": "input_ids",
    "input_lengths_key": "input_lengths",
    "sequence_length_round": 64,
    "max_tokens_per_microbatch": 8192,
}


def make_meta(lengths, *, tags=True, extra=None) -> KVBatchMeta:
    n = len(lengths)
    return KVBatchMeta(
        partition_id="train",
        task_name="prev_lp",
        sample_ids=[f"uid{i // 4}_g{i % 4}" for i in range(n)],
        fields=["input_ids", "input_lengths"],
        sequence_lengths=list(lengths),
        extra_info=dict(extra or {}),
        tags=[{"row": i, "std": float(i % 3)} for i in range(n)] if tags else None,
    )


def standard_lengths(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 2001, (n,), generator=g).tolist()


def check_invariants(meta, shards, unsorted, *, dp_world, batch_size, mode, args):
    """Everything that must hold for any valid call."""
    assert len(shards) == dp_world
    ids = [s for sh in shards for s in sh.sample_ids]
    # keys disjoint and covering, never minted
    assert sorted(ids) == sorted(meta.sample_ids) and len(set(ids)) == len(ids)
    # inverse permutation restores the original order
    if unsorted is None:
        assert ids == meta.sample_ids
    else:
        assert sorted(unsorted) == list(range(meta.size))
        assert [ids[j] for j in unsorted] == meta.sample_ids
    pos = {s: i for i, s in enumerate(meta.sample_ids)}
    n_gb = meta.size // batch_size
    for sh in shards:
        assert sh.partition_id == meta.partition_id and sh.task_name == meta.task_name
        assert sh.fields == meta.fields
        rows = [pos[s] for s in sh.sample_ids]
        # lengths and tags follow rows
        assert sh.sequence_lengths == [meta.sequence_lengths[r] for r in rows]
        if meta.tags is not None:
            assert sh.tags == [meta.tags[r] for r in rows]
        # shallow copy of extra_info (pad target carried), rollout metrics dropped
        for key, value in meta.extra_info.items():
            if key in (
                ROLLOUT_METRICS,
                MICRO_BATCH_INDICES,
                MICRO_BATCH_LENGTHS,
                ELEM_COUNTS_PER_GB,
            ):
                continue
            assert sh.extra_info[key] is value
        assert ROLLOUT_METRICS not in sh.extra_info
        # each global batch's rows are contiguous in the shard, batch by batch
        gbs = [r // batch_size for r in rows]
        assert gbs == sorted(gbs)
        if mode is None:
            assert sh.size == meta.size // dp_world
            assert [gbs.count(g) for g in range(n_gb)] == [batch_size // dp_world] * n_gb
            assert MICRO_BATCH_INDICES not in sh.extra_info
            assert MICRO_BATCH_LENGTHS not in sh.extra_info
            continue
        mbi, mbl = sh.extra_info[MICRO_BATCH_INDICES], sh.extra_info[MICRO_BATCH_LENGTHS]
        counts = sh.extra_info[ELEM_COUNTS_PER_GB]
        assert len(mbi) == len(mbl) == len(counts) == n_gb
        start = 0
        for g in range(n_gb):
            assert counts[g] == gbs.count(g)
            assert len(mbi[g]) == len(mbl[g]) >= 1
            for (s, e), length in zip(mbi[g], mbl[g]):
                assert s == start and e > s  # consecutive, covering, non-empty
                start = e
                lens = sh.sequence_lengths[s:e]
                assert all(rows[k] // batch_size == g for k in range(s, e))
                if mode == "seqpack":
                    m = args["sequence_length_pad_multiple"]
                    assert length == sum(round_up(x, m) for x in lens)
                    assert length <= args["max_tokens_per_microbatch"]
                else:
                    assert length == round_up(max(lens), args["sequence_length_round"])
                    assert length * (e - s) <= args["max_tokens_per_microbatch"]
        assert start == sh.size
    if mode is not None:  # every rank has the same microbatch count per global batch
        for g in range(n_gb):
            assert len({len(sh.extra_info[MICRO_BATCH_INDICES][g]) for sh in shards}) == 1


# ---------------------------------------------------------------------------- unit tests
def test_partitions_keys_disjointly_and_keeps_partition_id():
    meta = make_meta([10, 20, 30, 40, 50, 60, 70, 80])
    shards, _ = shard_meta_for_dp(meta, dp_world=4)
    assert len(shards) == 4 and all(sh.size == 2 for sh in shards)
    assert sorted(s for sh in shards for s in sh.sample_ids) == sorted(meta.sample_ids)
    assert {(sh.partition_id, sh.task_name) for sh in shards} == {("train", "prev_lp")}


def test_length_balanced_equal_counts_without_packing():
    meta = make_meta([1000, 900, 800, 700, 10, 20, 30, 40])
    shards, unsorted = shard_meta_for_dp(meta, dp_world=2)
    loads = sorted(sum(sh.sequence_lengths) for sh in shards)
    assert [sh.size for sh in shards] == [4, 4]
    assert loads == [1750, 1750]  # a contiguous split would give 3400 / 100
    check_invariants(meta, shards, unsorted, dp_world=2, batch_size=8, mode=None, args=None)


def test_unsorted_round_trip_restores_results_order():
    meta = make_meta(standard_lengths(64))
    shards, unsorted = shard_meta_for_dp(meta, dp_world=4, sequence_packing_args=SEQPACK)
    assert unsorted is not None
    per_rank = [torch.tensor(sh.sequence_lengths) for sh in shards]  # a "result" per row
    restored = torch.cat(per_rank)[torch.tensor(unsorted)]
    assert restored.tolist() == meta.sequence_lengths


def test_identity_order_returns_none():
    meta = make_meta([5, 7, 9])
    shards, unsorted = shard_meta_for_dp(meta, dp_world=1)
    assert unsorted is None and shards[0].sample_ids == meta.sample_ids
    assert shards[0] is not meta


def test_tags_keep_row_identity_and_are_copies():
    meta = make_meta(standard_lengths(32))
    shards, _ = shard_meta_for_dp(meta, dp_world=4, dynamic_batching_args=DYNBATCH)
    for sh in shards:
        for sid, tag in zip(sh.sample_ids, sh.tags):
            assert meta.sample_ids[tag["row"]] == sid
    shards[0].tags[0]["std"] = -1.0
    assert -1.0 not in [t["std"] for t in meta.tags]


def test_keys_are_never_minted():
    meta = make_meta(standard_lengths(48))
    for kwargs in ({}, {"sequence_packing_args": SEQPACK}, {"dynamic_batching_args": DYNBATCH}):
        shards, _ = shard_meta_for_dp(meta, dp_world=3, batch_size=24, **kwargs)
        assert {s for sh in shards for s in sh.sample_ids} == set(meta.sample_ids)


def test_pad_target_minted_on_whole_meta_is_carried_and_metrics_dropped():
    meta = make_meta([1208, 1320, 944, 1080, 100, 200, 300, 400])
    meta.extra_info[ROLLOUT_METRICS] = {"reward_mean": 0.5}
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=64)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 1344
    shards, _ = shard_meta_for_dp(meta, dp_world=4)
    assert [sh.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for sh in shards] == [1344] * 4
    assert all(ROLLOUT_METRICS not in sh.extra_info for sh in shards)
    assert ROLLOUT_METRICS in meta.extra_info  # the parent is untouched


def test_seqpack_microbatch_metadata():
    meta = make_meta(standard_lengths(256), extra={GLOBAL_FORWARD_PAD_SEQLEN: 2048})
    shards, unsorted = shard_meta_for_dp(
        meta, dp_world=4, batch_size=128, sequence_packing_args=SEQPACK
    )
    check_invariants(
        meta, shards, unsorted, dp_world=4, batch_size=128, mode="seqpack", args=SEQPACK
    )
    # well packed: total packed tokens close to a full bin each
    mbl = [x for sh in shards for gb in sh.extra_info[MICRO_BATCH_LENGTHS] for x in gb]
    assert sum(mbl) / (len(mbl) * 4096) > 0.9
    # token-balanced: per-rank packed tokens within one bin of each other
    loads = [sum(map(sum, sh.extra_info[MICRO_BATCH_LENGTHS])) for sh in shards]
    assert max(loads) - min(loads) <= 4096


def test_seqpack_raised_bin_count_is_rebalanced_not_halved():
    # ~5 bins of 16384 tokens for 64 rows; 4 ranks need 8: re-packed into 8 even bins
    meta = make_meta(standard_lengths(64))
    args = {**SEQPACK, "max_tokens_per_microbatch": 16384}
    shards, unsorted = shard_meta_for_dp(meta, dp_world=4, sequence_packing_args=args)
    check_invariants(meta, shards, unsorted, dp_world=4, batch_size=64, mode="seqpack", args=args)
    mbl = [x for sh in shards for x in sh.extra_info[MICRO_BATCH_LENGTHS][0]]
    assert len(mbl) == 8 and max(mbl) - min(mbl) <= 2048  # within one row, not half-empty bins


def test_seqpack_largest_first_order():
    meta = make_meta(standard_lengths(64))
    args = {**SEQPACK, "microbatch_order": "largest_first"}
    shards, _ = shard_meta_for_dp(meta, dp_world=2, sequence_packing_args=args)
    for sh in shards:
        lengths = sh.extra_info[MICRO_BATCH_LENGTHS][0]
        assert lengths == sorted(lengths, reverse=True)


def test_dynbatch_microbatch_metadata():
    meta = make_meta(standard_lengths(128))
    shards, unsorted = shard_meta_for_dp(
        meta, dp_world=4, batch_size=64, dynamic_batching_args=DYNBATCH
    )
    check_invariants(
        meta, shards, unsorted, dp_world=4, batch_size=64, mode="dynbatch", args=DYNBATCH
    )


def test_microbatch_counts_equalized_when_one_bin_would_do():
    # 8 tiny rows fit one bin, but 4 ranks need one (non-empty) microbatch each
    meta = make_meta([10] * 8)
    shards, _ = shard_meta_for_dp(meta, dp_world=4, sequence_packing_args=SEQPACK)
    assert [len(sh.extra_info[MICRO_BATCH_INDICES][0]) for sh in shards] == [1, 1, 1, 1]
    assert sorted(sh.size for sh in shards) == [2, 2, 2, 2]


def test_stale_plan_is_replaced_or_removed():
    meta = make_meta(standard_lengths(16))
    packed, _ = shard_meta_for_dp(meta, dp_world=2, sequence_packing_args=SEQPACK)
    again, _ = shard_meta_for_dp(packed[0], dp_world=1)  # no packing: plan must not leak
    assert MICRO_BATCH_INDICES not in again[0].extra_info
    assert ELEM_COUNTS_PER_GB not in again[0].extra_info


def test_shards_pickle():
    meta = make_meta(standard_lengths(16), extra={GLOBAL_FORWARD_PAD_SEQLEN: 2048})
    shards, _ = shard_meta_for_dp(meta, dp_world=2, dynamic_batching_args=DYNBATCH)
    assert pickle.loads(pickle.dumps(shards)) == shards


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("meta", "kwargs", "match"),
    [
        (make_meta([]), {"dp_world": 1}, "meta is empty"),
        (
            KVBatchMeta("p", None, ["a", "b"]),
            {"dp_world": 1},
            "sequence_lengths is missing",
        ),
        (make_meta([3, 4]), {"dp_world": 0}, "dp_world must be a positive int"),
        (make_meta([3, 4]), {"dp_world": 1, "batch_size": 0}, "batch_size must be a positive int"),
        (
            make_meta([3, 4, 5]),
            {"dp_world": 1, "batch_size": 2},
            "batch_size=2 must divide meta.size=3",
        ),
        (
            make_meta([3, 4, 5, 6]),
            {"dp_world": 4, "batch_size": 2},
            "batch_size=2 must be a multiple of dp_world=4",
        ),
        (make_meta([3, 4, 5]), {"dp_world": 2}, "meta.size=3 must be a multiple of dp_world=2"),
        (
            make_meta([3, 4]),
            {"dp_world": 1, "sequence_packing_args": SEQPACK, "dynamic_batching_args": DYNBATCH},
            "at most one",
        ),
        (
            make_meta([3, 5000]),
            {"dp_world": 1, "sequence_packing_args": SEQPACK},
            "row 1 has 5000 tokens",
        ),
        (
            make_meta([3, 9000]),
            {"dp_world": 1, "dynamic_batching_args": DYNBATCH},
            "more than max_tokens_per_microbatch=8192",
        ),
        (
            make_meta([3, 4]),
            {"dp_world": 1, "dynamic_batching_args": {**DYNBATCH, "max_tokens_per_microbatch": 0}},
            r"dynamic_batching_args\['max_tokens_per_microbatch'\]",
        ),
        (make_meta([3, -4]), {"dp_world": 1}, "meta.sequence_lengths must be non-negative"),
    ],
)
def test_errors(meta, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shard_meta_for_dp(meta, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp_world": 2.0}, "dp_world must be a positive int, got float"),
        ({"dp_world": "2"}, "dp_world must be a positive int, got str"),
        ({"dp_world": True}, "dp_world must be a positive int, got bool"),
        ({"dp_world": 1, "batch_size": "2"}, "batch_size must be a positive int, got str"),
        (
            {"dp_world": 1, "sequence_packing_args": {**SEQPACK, "max_tokens_per_microbatch": "8"}},
            r"sequence_packing_args\['max_tokens_per_microbatch'\] must be a positive int, got str",
        ),
        ({"dp_world": 1, "dynamic_batching_args": [1]}, "dynamic_batching_args must be a dict"),
    ],
)
def test_wrong_argument_types_are_type_errors_naming_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        shard_meta_for_dp(make_meta([3, 4]), **kwargs)


def test_duplicate_sample_ids_are_refused():
    """A duplicated key would go to two ranks, and both would write it back."""
    meta = KVBatchMeta("p", None, ["a", "b", "a", "c"], sequence_lengths=[1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"sample_ids must be unique.*\['a'\]"):
        shard_meta_for_dp(meta, dp_world=2)


def test_tags_misaligned_after_construction_are_a_value_error():
    meta = make_meta([3, 4])
    meta.tags.append({})  # mutated after construction
    with pytest.raises(ValueError, match="meta.tags has 3 entries for 2 sample_ids"):
        shard_meta_for_dp(meta, dp_world=1)


def test_non_integer_lengths_are_a_type_error():
    meta = make_meta([3, 4])
    meta.sequence_lengths[1] = 4.5  # mutated after construction
    with pytest.raises(TypeError, match="meta.sequence_lengths must hold ints"):
        shard_meta_for_dp(meta, dp_world=1)


def test_meta_must_be_a_kvbatchmeta():
    with pytest.raises(TypeError, match="meta must be a KVBatchMeta"):
        shard_meta_for_dp("not a meta", dp_world=1)


def test_misaligned_sequence_lengths():
    meta = make_meta([3, 4])
    meta.sequence_lengths.append(5)  # mutated after construction
    with pytest.raises(ValueError, match="has 3 entries for 2 sample_ids"):
        shard_meta_for_dp(meta, dp_world=1)


# ---------------------------------------------------------------------------- properties
@st.composite
def sharding_cases(draw):
    dp_world = draw(st.integers(1, 6))
    per_rank = draw(st.integers(1, 12))
    n_gb = draw(st.integers(1, 3))
    batch_size = dp_world * per_rank
    n = batch_size * n_gb
    lengths = draw(st.lists(st.integers(0, 700), min_size=n, max_size=n))
    mode = draw(st.sampled_from([None, "seqpack", "dynbatch"]))
    budget = max(lengths) + draw(st.integers(0, 3000))
    if mode == "seqpack":
        multiple = draw(st.sampled_from([1, 8, 64]))
        args = {
            "sequence_length_pad_multiple": multiple,
            "max_tokens_per_microbatch": round_up(max(budget, 1), multiple),
            "microbatch_order": draw(st.sampled_from(["packer", "largest_first"])),
        }
    elif mode == "dynbatch":
        rnd = draw(st.sampled_from([1, 16, 64]))
        args = {
            "sequence_length_round": rnd,
            "max_tokens_per_microbatch": round_up(max(budget, 1), rnd),
        }
    else:
        args = None
    pass_batch = draw(st.booleans()) or n_gb > 1
    return lengths, dp_world, batch_size if pass_batch else None, n, mode, args


@settings(max_examples=150, deadline=None)
@given(case=sharding_cases(), with_tags=st.booleans())
def test_sharding_properties(case, with_tags):
    lengths, dp_world, batch_size, n, mode, args = case
    meta = make_meta(
        lengths, tags=with_tags, extra={ROLLOUT_METRICS: {"x": 1}, "pad_to_multiple": 8}
    )
    stamp_global_forward_pad_seqlen(meta)
    kwargs = {}
    if mode == "seqpack":
        kwargs["sequence_packing_args"] = args
    elif mode == "dynbatch":
        kwargs["dynamic_batching_args"] = args
    shards, unsorted = shard_meta_for_dp(meta, dp_world=dp_world, batch_size=batch_size, **kwargs)
    check_invariants(
        meta, shards, unsorted, dp_world=dp_world, batch_size=batch_size or n, mode=mode, args=args
    )
    target = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)  # unset when every length is 0
    assert all(sh.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN) == target for sh in shards)
    if mode is None:  # balanced: rank loads differ by at most the longest row of a global batch
        loads = [sum(sh.sequence_lengths) for sh in shards]
        assert max(loads) - min(loads) <= max(lengths) * (n // (batch_size or n))

"""Fuzzing metas and ``shard_meta_for_dp`` (issue #8): bad input is one documented exception.

A meta's constructor raises ``TypeError`` for a wrong type and ``ValueError`` for misaligned
tags or lengths; ``shard_meta_for_dp`` raises ``TypeError`` / ``ValueError`` naming the argument,
and never an ``IndexError``, a torch error, or a shard set that loses or repeats a key. Every
failure Hypothesis found is kept as an ``@example``.
"""

from __future__ import annotations

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from tq_plugin.data_plane import KVBatchMeta
from tq_plugin.data_plane.sharding import shard_meta_for_dp

IDS = st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), max_size=8)
LENGTH = st.one_of(st.integers(-2, 300), st.sampled_from([1.5, True, "3", None, 2**70]))


@st.composite
def meta_kwargs(draw):
    ids = draw(IDS)
    n = len(ids)
    size = st.integers(max(0, n - 1), n + 1)
    lengths = draw(st.one_of(st.none(), st.lists(LENGTH, min_size=draw(size), max_size=n + 1)))
    tags = draw(st.one_of(st.none(), st.lists(st.just({}), min_size=draw(size), max_size=n + 1)))
    return {
        "partition_id": "p",
        "task_name": None,
        "sample_ids": ids,
        "sequence_lengths": lengths,
        "tags": tags,
    }


def _aligned(kw) -> bool:
    n = len(kw["sample_ids"])
    return all(v is None or len(v) == n for v in (kw["sequence_lengths"], kw["tags"]))


@settings(max_examples=400, deadline=None)
@given(kw=meta_kwargs())
@example(
    kw={
        "partition_id": "p",
        "task_name": None,
        "sample_ids": ["a", "b"],
        "sequence_lengths": [3],
        "tags": None,
    }
)
@example(
    kw={
        "partition_id": "p",
        "task_name": None,
        "sample_ids": ["a"],
        "sequence_lengths": [1.5],
        "tags": None,
    }
)
def test_fuzz_meta_construction(kw):
    try:
        meta = KVBatchMeta(**kw)
    except TypeError:
        event("refused: TypeError")
        assert any(type(x) is not int for x in kw["sequence_lengths"] or ())
        return
    except ValueError:
        event("refused: ValueError")
        assert not _aligned(kw)
        return
    event("accepted")
    assert _aligned(kw) and meta.size == len(kw["sample_ids"])
    assert all(type(x) is int for x in meta.sequence_lengths or ())


@st.composite
def shard_cases(draw):
    """A valid sharding call, with (about half the time) one fault mixed in."""
    dp_world = draw(st.integers(1, 4))
    per_gb = dp_world * draw(st.integers(1, 3))
    n = per_gb * draw(st.integers(1, 3))
    ids = [f"s{i}" for i in range(n)]
    lengths = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    kwargs = {"dp_world": dp_world, "batch_size": draw(st.sampled_from([None, per_gb]))}
    mode = draw(st.sampled_from(["none", "seqpack", "dynbatch"]))
    budget = 320 + draw(st.integers(0, 900))  # round_up(300, 64) fits
    algorithm = draw(st.sampled_from(["first_fit_decreasing", "modified_first_fit_decreasing"]))
    if mode == "seqpack":
        kwargs["sequence_packing_args"] = {
            "max_tokens_per_microbatch": budget,
            "algorithm": algorithm,
        }
    elif mode == "dynbatch":
        kwargs["dynamic_batching_args"] = {
            "max_tokens_per_microbatch": budget,
            "sequence_length_round": 64,
        }
    fault = draw(
        st.sampled_from(
            ["none"] * 6
            + [
                "dup",
                "negative",
                "float",
                "misaligned_lengths",
                "misaligned_tags",
                "no_lengths",
                "empty",
                "world_str",
                "world_float",
                "world_zero",
                "batch_str",
                "batch_uneven",
                "both_modes",
                "budget_str",
                "budget_small",
                "algorithm",
            ]
        )
    )
    if fault == "dup" and n > 1:
        ids[-1] = ids[0]
    elif fault == "negative":
        lengths[0] = -1
    elif fault == "empty":
        ids, lengths = [], []
    meta = KVBatchMeta(
        "p", None, ids, sequence_lengths=lengths, tags=[{"i": i} for i in range(len(ids))]
    )
    if fault == "float":
        meta.sequence_lengths[0] = 2.5
    elif fault == "misaligned_lengths":
        meta.sequence_lengths.append(5)
    elif fault == "misaligned_tags":
        meta.tags.append({})
    elif fault == "no_lengths":
        meta.sequence_lengths = None
    elif fault == "world_str":
        kwargs["dp_world"] = str(dp_world)
    elif fault == "world_float":
        kwargs["dp_world"] = float(dp_world)
    elif fault == "world_zero":
        kwargs["dp_world"] = 0
    elif fault == "batch_str":
        kwargs["batch_size"] = str(per_gb)
    elif fault == "batch_uneven":
        kwargs["batch_size"] = n + 1
    elif fault == "both_modes":
        kwargs["sequence_packing_args"] = {"max_tokens_per_microbatch": budget}
        kwargs["dynamic_batching_args"] = {"max_tokens_per_microbatch": budget}
    elif fault in ("budget_str", "budget_small", "algorithm"):
        args = kwargs.setdefault("sequence_packing_args", {"max_tokens_per_microbatch": budget})
        args.pop("algorithm", None)
        if fault == "budget_str":
            args["max_tokens_per_microbatch"] = str(budget)
        elif fault == "budget_small":
            args["max_tokens_per_microbatch"] = 1 if max(lengths, default=0) > 1 else 0
        else:
            args["algorithm"] = "best_fit"
    return meta, kwargs, fault


@settings(max_examples=500, deadline=None)
@given(case=shard_cases())
@example(
    case=(KVBatchMeta("p", None, ["s0", "s0"], sequence_lengths=[1, 2]), {"dp_world": 2}, "dup")
)
@example(
    case=(KVBatchMeta("p", None, ["s0"], sequence_lengths=[3]), {"dp_world": "1"}, "world_str")
)
def test_fuzz_shard_meta_for_dp(case):
    meta, kwargs, fault = case
    try:
        shards, unsorted = shard_meta_for_dp(meta, **kwargs)
    except (TypeError, ValueError) as exc:
        event(f"refused: {type(exc).__name__}")
        assert fault != "none", exc
        assert (
            "shard_meta_for_dp" in str(exc)
            or "args" in str(exc)
            or "sequence_lengths" in str(exc)
            or "row" in str(exc)
        ), exc
        return
    event("accepted")
    assert fault in ("none", "budget_small") or (fault == "dup" and meta.size == 1), fault
    ids = [s for shard in shards for s in shard.sample_ids]
    assert sorted(ids) == sorted(meta.sample_ids) and len(set(ids)) == len(ids)
    assert len(shards) == kwargs["dp_world"]
    order = ids if unsorted is None else [ids[i] for i in unsorted]
    assert order == meta.sample_ids


@pytest.mark.parametrize("bad", [[0, 1.5], ["0"]])
def test_subset_never_truncates_an_index(bad):
    meta = KVBatchMeta("p", None, ["a", "b"], sequence_lengths=[1, 2])
    with pytest.raises(TypeError, match="indices must be ints"):
        meta.subset(bad)

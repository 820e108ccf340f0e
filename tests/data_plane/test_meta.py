"""KVBatchMeta: construction rules, row selection, fields and tags (reference §3, §14.1)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from tq_plugin.data_plane import KVBatchMeta


def _meta(n: int = 4, **kw) -> KVBatchMeta:
    ids = [chr(ord("a") + i) for i in range(n)]
    return KVBatchMeta(
        partition_id="train",
        task_name="prev_lp",
        sample_ids=ids,
        sequence_lengths=kw.pop("sequence_lengths", [10 * (i + 1) for i in range(n)]),
        tags=kw.pop("tags", [{"row": i} for i in range(n)]),
        **kw,
    )


def test_schema_is_exactly_the_seven_fields():
    names = {f.name for f in dataclasses.fields(KVBatchMeta)}
    assert names == {
        "partition_id",
        "task_name",
        "sample_ids",
        "fields",
        "sequence_lengths",
        "extra_info",
        "tags",
    }


def test_defaults_and_size():
    m = KVBatchMeta("p", None, sample_ids=["x", "y"])
    assert m.size == 2 and m.fields is None and m.sequence_lengths is None and m.tags is None
    assert m.extra_info == {}


def test_partition_id_is_required():
    with pytest.raises(TypeError):
        KVBatchMeta(task_name=None, sample_ids=[])  # type: ignore[call-arg]


def test_extra_info_default_is_unique_per_instance():
    a, b = KVBatchMeta("p", None, []), KVBatchMeta("p", None, [])
    a.extra_info["k"] = 1
    assert b.extra_info == {}


def test_duplicate_ids_are_allowed_and_counted():
    assert KVBatchMeta("p", None, ["a", "a"]).size == 2


def test_empty_meta_is_valid_and_pickles():
    m = KVBatchMeta("p", None, [])
    assert m.size == 0 and pickle.loads(pickle.dumps(m)) == m


def test_pickle_round_trip_keeps_every_field():
    m = _meta(fields=["input_ids"], extra_info={"global_forward_pad_seqlen": 64})
    assert pickle.loads(pickle.dumps(m)) == m


def test_tags_must_align_one_to_one():
    with pytest.raises(ValueError, match="align 1:1"):
        KVBatchMeta("p", None, ["a", "b"], tags=[{}])


def test_sequence_lengths_must_align():
    with pytest.raises(ValueError, match="sequence_lengths"):
        KVBatchMeta("p", None, ["a", "b"], sequence_lengths=[3])


def test_subset_takes_rows_in_order_with_lengths_and_tags():
    m = _meta().subset([2, 0, 2])
    assert m.sample_ids == ["c", "a", "c"]
    assert m.sequence_lengths == [30, 10, 30]
    assert [t["row"] for t in m.tags] == [2, 0, 2]
    assert m.partition_id == "train" and m.task_name == "prev_lp"


def test_subset_out_of_range_raises():
    with pytest.raises(IndexError):
        _meta().subset([4])


def test_slice_is_contiguous_and_strict():
    assert _meta().slice(1, 3).sample_ids == ["b", "c"]
    with pytest.raises(IndexError):
        _meta().slice(2, 9)


def test_slice_then_concat_round_trips():
    m = _meta()
    assert m.slice(0, 2).concat(m.slice(2, 4)) == m


def test_concat_rejects_partition_mismatch():
    other = KVBatchMeta("val", None, ["z"])
    with pytest.raises(ValueError, match="partition_ids must match"):
        _meta().concat(other)


def test_concat_unions_fields_and_drops_partial_lengths_and_tags():
    a = _meta(2, fields=["input_ids"])
    b = KVBatchMeta("train", None, ["z"], fields=["advantages", "input_ids"])
    c = a.concat(b)
    assert c.sample_ids == ["a", "b", "z"]
    assert c.fields == ["input_ids", "advantages"]
    assert c.sequence_lengths is None and c.tags is None


def test_drop_is_the_complement_of_subset():
    m = _meta()
    assert m.drop([1, 3]).sample_ids == ["a", "c"]
    assert m.drop([2, 0, 0]).sample_ids == ["b", "d"]
    assert m.drop(range(4)) is None
    assert KVBatchMeta("p", None, []).drop([]) is None


def test_drop_nothing_returns_an_equal_new_object():
    m = _meta()
    d = m.drop([])
    assert d == m and d is not m


def test_with_fields_appends_dedupes_and_copies():
    m = _meta(fields=["input_ids", "advantages"])
    n = m.with_fields(["advantages", "logprobs"])
    assert n.fields == ["input_ids", "advantages", "logprobs"]
    assert _meta().with_fields(["x"]).fields == ["x"]
    n.tags[0]["row"] = 99
    n.extra_info["k"] = 1
    assert m.tags[0]["row"] == 0 and "k" not in m.extra_info


def test_stamp_tags_in_place_and_all_or_nothing():
    m = KVBatchMeta("p", None, ["a", "b"])
    m.stamp_tags({"std": [0.1, 0.2], "baseline": [1, 2]})
    assert m.tags == [{"std": 0.1, "baseline": 1}, {"std": 0.2, "baseline": 2}]
    with pytest.raises(ValueError, match="'bad' has 1 values, expected 2"):
        m.stamp_tags({"ok": [1, 2], "bad": [1]})
    assert "ok" not in m.tags[0]


def test_per_row_extra_info_follows_rows():
    m = _meta(2, extra_info={"packed_attention_segment_lengths": [[10], [20]]})
    assert m.subset([1]).extra_info["packed_attention_segment_lengths"] == [[20]]
    assert m.concat(m).extra_info["packed_attention_segment_lengths"] == [[10], [20], [10], [20]]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"partition_id": 3}, "partition_id must be a str"),
        ({"task_name": 1}, "task_name must be a str or None"),
        ({"sample_ids": "ab"}, "sample_ids must be a list"),
        ({"sample_ids": ["a", 2]}, "sample_ids must hold strings"),
        ({"fields": "input_ids"}, "fields must be a list"),
        ({"sequence_lengths": [1.0, 2.0]}, "sequence_lengths must hold Python ints"),
        ({"sequence_lengths": [True, 2]}, "sequence_lengths must hold Python ints"),
        ({"sequence_lengths": 2}, "sequence_lengths must be a list"),
        ({"extra_info": [("k", 1)]}, "extra_info must be a dict"),
        ({"tags": [{}, "x"]}, "tags must be a list of dicts"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(kwargs, match):
    base = {"partition_id": "p", "task_name": None, "sample_ids": ["a", "b"]}
    with pytest.raises(TypeError, match=match):
        KVBatchMeta(**{**base, **kwargs})


def test_tuples_are_taken_as_lists():
    m = KVBatchMeta("p", None, ("a", "b"), sequence_lengths=(1, 2))
    assert m.sample_ids == ["a", "b"] and m.sequence_lengths == [1, 2]


def test_drop_out_of_range_is_an_index_error_not_a_wrap_around():
    """Regression: drop([7]) on 4 rows used to drop row 3 (7 % 4)."""
    with pytest.raises(IndexError, match="index 7 out of range for size 4"):
        _meta().drop([7])
    assert _meta().drop([-1]).sample_ids == ["a", "b", "c"]


@pytest.mark.parametrize("bad", [[1.5], ["1"], [None]])
def test_non_integer_indices_are_type_errors(bad):
    """Regression: subset([1.5]) used to take row 1 (int(1.5))."""
    for select in (_meta().subset, _meta().drop):
        with pytest.raises(TypeError, match="indices must be ints"):
            select(bad)
    with pytest.raises(TypeError, match="start and stop must be ints"):
        _meta().slice(0, 1.5)


def test_concat_and_stamp_tags_type_errors():
    with pytest.raises(TypeError, match="expected KVBatchMeta, got list"):
        _meta().concat(["x"])
    m = _meta(2)
    with pytest.raises(TypeError, match="must map a str to a sequence"):
        m.stamp_tags({"std": 0.5})
    with pytest.raises(TypeError, match="scalars must be a dict"):
        m.stamp_tags([("std", [1, 2])])
    assert m.tags == [{"row": 0}, {"row": 1}]

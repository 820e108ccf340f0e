"""The DataPlaneClient contract, run over every backend (reference §4, §9, §14.2, §14.8).

Where the reference is silent or lossy, the contract is stricter: a bad put raises a clear error
and writes nothing, and a read returns exactly the requested rows or raises ``KeyError``.
"""

from __future__ import annotations

import inspect
import threading
import warnings

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from tq_plugin.data_plane import (
    DataPlaneClient,
    DataPlaneClosedError,
    DataPlaneCorruptionError,
    call_dp,
)
from tq_plugin.data_plane.client import accepts_put_mode

from .conftest import ragged, rows_of

IDS = ["a", "b", "c"]


@pytest.fixture
def train(client):
    client.register_partition("train", [])
    return client


def _put_basic(c, ids=IDS, seed=0):
    lens = [3, 5, 2][: len(ids)]
    fields = {
        "input_ids": ragged(lens, torch.int64, seed=seed),
        "logprobs": ragged(lens, torch.float32, seed=seed),
        "reward": torch.arange(len(ids), dtype=torch.float32),
    }
    c.put_samples(partition_id="train", sample_ids=ids, fields=fields)
    return fields


def test_backend_satisfies_the_protocol(client):
    assert isinstance(client, DataPlaneClient)


# ---------------------------------------------------------------- the calling convention
def test_row_methods_take_partition_then_rows_by_keyword_only(client):
    for name in ("put_samples", "get_samples", "get_tags", "clear_samples"):
        params = list(inspect.signature(getattr(client, name)).parameters.values())
        assert [p.name for p in params[:2]] == ["partition_id", "sample_ids"], name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params
                   if p.kind is not inspect.Parameter.VAR_KEYWORD), name
    assert inspect.signature(client.clear_samples).parameters["sample_ids"].default is None
    assert accepts_put_mode(client)


def test_the_keyword_form_round_trips_in_any_keyword_order(train):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        meta = train.put_samples(fields={"r": torch.tensor([1.0, 2.0])}, sample_ids=["a", "b"],
                                 partition_id="train", tags=[{"u": 1}, {"u": 2}], mode="insert")
        assert (meta.partition_id, list(meta.sample_ids)) == ("train", ["a", "b"])
        got = train.get_samples(select_fields=["r"], sample_ids=["b"], partition_id="train")
        assert got["r"].tolist() == [2.0]
        assert train.get_tags(sample_ids=["a"], partition_id="train") == [{"u": 1}]
        train.clear_samples(sample_ids=["a"], partition_id="train")
        assert train.list_sample_ids("train") == ["b"]
        train.clear_samples(partition_id="train")  # no sample_ids: the whole partition
    assert "train" not in train.list_partitions()


def test_a_positional_call_in_the_new_order_is_refused(train):
    with pytest.raises(TypeError, match="by keyword"):
        train.put_samples("train", ["a"], {"r": torch.zeros(1)})
    with pytest.raises(TypeError, match="by keyword"):
        train.get_samples("train", ["a"], ["r"])
    assert train.list_sample_ids("train") == []


def test_put_get_round_trip_byte_exact_in_request_order(train):
    fields = _put_basic(train)
    td = train.get_samples(
        partition_id="train",
        sample_ids=["c", "a"],
        select_fields=["input_ids", "logprobs", "reward"],
    )
    assert td.batch_size == torch.Size([2])
    assert td["input_ids"].layout == torch.jagged
    src = rows_of(fields["input_ids"])
    got = rows_of(td["input_ids"])
    assert torch.equal(got[0], src[2]) and torch.equal(got[1], src[0])
    assert torch.equal(rows_of(td["logprobs"])[1], rows_of(fields["logprobs"])[0])
    assert torch.equal(td["reward"], torch.tensor([2.0, 0.0]))


def test_dense_fields_come_back_dense_and_dtypes_are_kept(train):
    img = torch.randn(3, 4, 5).to(torch.bfloat16)
    train.put_samples(
        partition_id="train",
        sample_ids=IDS,
        fields=TensorDict({"img": img, "n": torch.tensor([1, 2, 3])}, [3]),
    )
    td = train.get_samples(partition_id="train", sample_ids=IDS, select_fields=["img", "n"])
    assert not td["img"].is_nested and td["img"].dtype == torch.bfloat16
    assert torch.equal(td["img"], img) and td["n"].dtype == torch.int64


def test_jagged_with_trailing_dims_round_trips(train):
    nt = ragged([2, 7, 1], torch.float16, 3, 4)
    train.put_samples(partition_id="train", sample_ids=IDS, fields={"patches": nt})
    got = train.get_samples(
        partition_id="train", sample_ids=["b"], select_fields=["patches"]
    )["patches"]
    assert torch.equal(got[0], nt[1]) and got[0].shape == (7, 3, 4)


def test_declared_jagged_field_accepts_dense_rows_of_different_widths(client):
    client.register_partition("s", ["tok"], jagged_fields=["tok"])
    client.put_samples(
        partition_id="s", sample_ids=["x"], fields={"tok": torch.tensor([[1, 2, 3]])}
    )
    client.put_samples(partition_id="s", sample_ids=["y"], fields={"tok": torch.tensor([[4]])})
    got = client.get_samples(partition_id="s", sample_ids=["y", "x"], select_fields=["tok"])["tok"]
    assert [r.tolist() for r in got.unbind()] == [[4], [1, 2, 3]]


def test_writes_are_copies_and_later_writes_never_change_a_read(train):
    fields = _put_basic(train)
    fields["reward"].add_(100)
    fields["input_ids"].values().add_(1)
    td = train.get_samples(
        partition_id="train", sample_ids=IDS, select_fields=["reward", "input_ids"]
    )
    assert td["reward"].tolist() == [0.0, 1.0, 2.0]
    before = [r.clone() for r in td["input_ids"].unbind()]
    train.put_samples(
        partition_id="train", sample_ids=IDS, fields={"input_ids": ragged([1, 1, 1], seed=9)}
    )  # overwrite
    train.put_samples(
        partition_id="train", sample_ids=["z"], fields={"input_ids": ragged([4], seed=8)}
    )  # append
    assert all(torch.equal(a, b) for a, b in zip(td["input_ids"].unbind(), before))


def test_a_read_changed_in_place_never_silently_changes_the_store(train):
    """Reads may share the store's memory (read-only by contract): changing one in place is
    either isolated (a copying backend) or detected on the next read, never silent."""
    _put_basic(train)
    original = train.get_samples(
        partition_id="train", sample_ids=IDS, select_fields=["input_ids"]
    )["input_ids"].values().clone()
    td = train.get_samples(
        partition_id="train", sample_ids=IDS, select_fields=["reward", "input_ids"]
    )
    td["reward"].add_(7)  # dense reads are copies on every backend
    assert train.get_samples(
        partition_id="train", sample_ids=IDS, select_fields=["reward"]
    )["reward"].tolist() == [0.0, 1.0, 2.0]
    td["input_ids"].values().zero_()
    try:
        again = train.get_samples(
            partition_id="train", sample_ids=IDS, select_fields=["input_ids"]
        )["input_ids"].values()
    except DataPlaneCorruptionError as e:
        assert "'input_ids'" in str(e) and "clone()" in str(e)
        train.clear_samples(
            partition_id="train", sample_ids=IDS
        )  # clearing the rows clears the alarm
        _put_basic(train)
        assert torch.equal(train.get_samples(
            partition_id="train", sample_ids=IDS, select_fields=["input_ids"]
        )["input_ids"].values(), original)
    else:
        assert torch.equal(again, original)


def test_write_back_adds_columns_and_overwrites_under_the_same_keys(train):
    _put_basic(train)
    train.put_samples(
        partition_id="train", sample_ids=["b"], fields={"reward": torch.tensor([9.0])}
    )
    train.put_samples(
        partition_id="train",
        sample_ids=IDS,
        fields={"advantages": ragged([3, 5, 2], torch.float32, seed=3)},
    )
    td = train.get_samples(
        partition_id="train", sample_ids=IDS, select_fields=["reward", "advantages"]
    )
    assert td["reward"].tolist() == [0.0, 9.0, 2.0]
    assert [r.shape[0] for r in td["advantages"].unbind()] == [3, 5, 2]


def test_put_returns_a_meta_for_the_written_rows(train):
    meta = train.put_samples(
        partition_id="train",
        sample_ids=["a", "b"],
        fields={"input_lengths": torch.tensor([3, 5]), "reward": torch.zeros(2)},
        tags=[{"u": 1}, {"u": 2}],
    )
    assert meta.sample_ids == ["a", "b"] and meta.partition_id == "train"
    assert meta.fields == ["input_lengths", "reward"]
    assert meta.sequence_lengths == [3, 5] and meta.tags == [{"u": 1}, {"u": 2}]


def test_list_sample_ids_is_sorted_and_empty_for_unknown(train):
    train.put_samples(partition_id="train", sample_ids=["b", "a"], fields={"r": torch.zeros(2)})
    assert train.list_sample_ids("train") == ["a", "b"]
    assert train.list_sample_ids("nope") == []


def test_empty_get_returns_batch_zero(train):
    _put_basic(train)
    td = train.get_samples(
        partition_id="train", sample_ids=[], select_fields=["reward", "input_ids"]
    )
    assert td.batch_size == torch.Size([0])


def test_call_dp_reaches_a_local_client(train):
    _put_basic(train)
    td = call_dp(train, "get_samples", sample_ids=["a"], partition_id="train", select_fields=["reward"])
    assert td["reward"].tolist() == [0.0]


# ---------------------------------------------------------------- bad input: clear error, nothing written
def _assert_untouched(c, partition="train"):
    assert c.list_sample_ids(partition) == sorted(IDS)
    td = c.get_samples(partition_id=partition, sample_ids=IDS, select_fields=["reward"])
    assert td["reward"].tolist() == [0.0, 1.0, 2.0]


def test_dtype_change_against_live_rows_is_rejected_atomically(train):
    _put_basic(train)
    bad = {"reward": torch.zeros(1), "logprobs": ragged([4], torch.float64)}
    with pytest.raises(TypeError, match=r"'logprobs' dtype mismatch.*float32.*float64"):
        train.put_samples(partition_id="train", sample_ids=["d"], fields=bad)
    with pytest.raises(TypeError, match=r"'logprobs' dtype mismatch"):
        train.put_samples(
            partition_id="train",
            sample_ids=["a"],
            fields={"reward": torch.ones(1), "logprobs": ragged([4], torch.float64)},
        )
    _assert_untouched(train)


def test_rank_change_against_live_rows_is_rejected(train):
    _put_basic(train)
    with pytest.raises(TypeError, match=r"'reward' shape mismatch"):
        train.put_samples(
            partition_id="train", sample_ids=["d"], fields={"reward": torch.zeros(1, 2)}
        )
    with pytest.raises(TypeError, match=r"'input_ids' .*stored|'input_ids' shape mismatch|jagged"):
        train.put_samples(
            partition_id="train",
            sample_ids=["d"],
            fields={"input_ids": ragged([2], torch.int64, 2)},
        )
    _assert_untouched(train)


def test_nested_put_into_a_dense_column_is_rejected(train):
    _put_basic(train)
    with pytest.raises(TypeError, match="'reward' is stored dense"):
        train.put_samples(
            partition_id="train", sample_ids=["d"], fields={"reward": ragged([2], torch.float32)}
        )


def test_a_column_may_change_dtype_once_its_rows_are_cleared(train):
    _put_basic(train)
    train.clear_samples(partition_id="train", sample_ids=IDS)
    train.put_samples(
        partition_id="train",
        sample_ids=["z"],
        fields={"reward": torch.zeros(1, dtype=torch.float64)},
    )
    assert train.get_samples(
        partition_id="train", sample_ids=["z"], select_fields=["reward"]
    )["reward"].dtype == torch.float64


def test_unknown_ids_on_get_are_named(train):
    _put_basic(train)
    with pytest.raises(KeyError, match=r"2 unknown sample_ids.*'x'.*'y'"):
        train.get_samples(
            partition_id="train", sample_ids=["a", "x", "y"], select_fields=["reward"]
        )


def test_unwritten_select_field_names_field_and_rows(train):
    _put_basic(train)
    train.put_samples(partition_id="train", sample_ids=["a"], fields={"advantages": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"'advantages' not written for 2 requested rows.*'b'.*'c'"):
        train.get_samples(partition_id="train", sample_ids=IDS, select_fields=["advantages"])
    with pytest.raises(KeyError, match="'values' was never written"):
        train.get_samples(partition_id="train", sample_ids=IDS, select_fields=["values"])


@pytest.mark.parametrize("op", ["put", "get"])
def test_duplicate_ids_are_rejected(train, op):
    _put_basic(train)
    with pytest.raises(ValueError, match=r"duplicate sample_ids.*'a'"):
        if op == "put":
            train.put_samples(
                partition_id="train", sample_ids=["a", "a"], fields={"reward": torch.zeros(2)}
            )
        else:
            train.get_samples(
                partition_id="train", sample_ids=["a", "b", "a"], select_fields=["reward"]
            )
    _assert_untouched(train)


def test_field_batch_size_must_match_ids(train):
    _put_basic(train)
    with pytest.raises(ValueError, match=r"'reward' has 2 rows for 1 sample_ids"):
        train.put_samples(partition_id="train", sample_ids=["d"], fields={"reward": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"'input_ids' has 1 rows for 2 sample_ids"):
        train.put_samples(
            partition_id="train",
            sample_ids=["d", "e"],
            fields={"input_ids": ragged([3], torch.int64)},
        )
    with pytest.raises(ValueError, match=r"batch_size"):
        train.put_samples(
            partition_id="train",
            sample_ids=["d", "e"],
            fields=TensorDict({"r": torch.zeros(3)}, [3]),
        )
    _assert_untouched(train)


def test_zero_dim_and_non_tensor_leaves_are_rejected(train):
    _put_basic(train)
    with pytest.raises(ValueError, match="0-d"):
        train.put_samples(
            partition_id="train", sample_ids=["d"], fields={"reward": torch.tensor(1.0)}
        )
    with pytest.raises(TypeError, match="non-tensor"):
        train.put_samples(partition_id="train", sample_ids=["d"], fields={"names": ["x"]})
    td = TensorDict({"reward": torch.zeros(1)}, [1])
    td["note"] = NonTensorData("hello", batch_size=[1])
    with pytest.raises(TypeError, match="non-tensor"):
        train.put_samples(partition_id="train", sample_ids=["d"], fields=td)
    _assert_untouched(train)


def test_tag_count_must_match_ids(train):
    with pytest.raises(ValueError, match="2 tags for 1 sample_ids"):
        train.put_samples(
            partition_id="train", sample_ids=["d"], fields={"r": torch.zeros(1)}, tags=[{}, {}]
        )


def test_undeclared_fields_and_unknown_partitions_are_rejected(client):
    client.register_partition("p", ["a"])
    with pytest.raises(ValueError, match="'b' is not declared"):
        client.put_samples(
            partition_id="p", sample_ids=["x"], fields={"a": torch.zeros(1), "b": torch.zeros(1)}
        )
    assert client.list_sample_ids("p") == []
    with pytest.raises(KeyError, match="unknown partition 'q'"):
        client.put_samples(partition_id="q", sample_ids=["x"], fields={"a": torch.zeros(1)})


def test_operations_after_close_raise_and_close_is_idempotent(train):
    _put_basic(train)
    train.close()
    train.close()
    with pytest.raises(DataPlaneClosedError, match="closed"):
        train.get_samples(partition_id="train", sample_ids=["a"], select_fields=["reward"])
    with pytest.raises(DataPlaneClosedError):
        train.put_samples(partition_id="train", sample_ids=["a"], fields={"reward": torch.zeros(1)})
    with pytest.raises(DataPlaneClosedError):
        train.register_partition("x", [])


# ---------------------------------------------------------------- clears and reclamation
def test_clear_is_idempotent_and_none_drops_the_partition(train):
    _put_basic(train)
    train.clear_samples(partition_id="train", sample_ids=["a", "zz"])
    train.clear_samples(partition_id="train", sample_ids=["a"])
    assert train.list_sample_ids("train") == ["b", "c"]
    with pytest.raises(KeyError):
        train.get_samples(partition_id="train", sample_ids=["a"], select_fields=["reward"])
    train.clear_samples(partition_id="train", sample_ids=None)
    with pytest.warns(RuntimeWarning, match="found nothing to clear"):
        train.clear_samples(partition_id="train", sample_ids=None)
    with pytest.raises(KeyError, match="unknown partition"):
        train.get_samples(partition_id="train", sample_ids=["b"], select_fields=["reward"])
    train.register_partition("train", [])
    assert train.list_sample_ids("train") == []


def test_cleared_rows_are_reclaimed_over_a_long_run(client):
    client.register_partition("train", [])
    lens = [300] * 64
    peak = []
    for step in range(30):
        ids = [f"s{step}_{i}" for i in range(64)]
        client.put_samples(
            partition_id="train",
            sample_ids=ids,
            fields={"x": ragged(lens, torch.float32, seed=step)},
        )
        client.put_samples(
            partition_id="train",
            sample_ids=ids[:32],
            fields={"x": ragged(lens[:32], torch.float32, seed=step)},
        )
        client.clear_samples(partition_id="train", sample_ids=ids[:48])
        peak.append(client.stats()["bytes_held"])
        client.clear_samples(partition_id="train", sample_ids=ids)
    stats = client.stats()
    assert stats["rows"] == 0 and stats["live_bytes"] == 0
    one_step = 64 * 300 * 4
    assert max(peak) <= 4 * one_step


def test_stats_reports_rows_and_bytes(train):
    _put_basic(train)
    s = train.stats()
    assert s["rows"] == 3
    assert s["live_bytes"] == 10 * 8 + 10 * 4 + 3 * 4
    assert s["peak_bytes_held"] >= s["bytes_held"] >= s["live_bytes"]


def test_concurrent_puts_and_reads_never_see_partial_rows(client):
    client.register_partition("train", [], jagged_fields=["tok"])
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(40):
                sid = f"w{w}_{i}"
                n = 1 + (i % 7)
                client.put_samples(
                    partition_id="train", sample_ids=[sid], fields={"tok": torch.full((1, n), w, dtype=torch.int64), "n": torch.tensor([n])}
                )
                td = client.get_samples(
                    partition_id="train", sample_ids=[sid], select_fields=["tok", "n"]
                )
                row = td["tok"][0]
                assert int(td["n"][0]) == n and torch.equal(row, torch.full((n,), w))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ids = client.list_sample_ids("train")
    assert len(ids) == 320
    td = client.get_samples(partition_id="train", sample_ids=ids, select_fields=["n"])
    assert int(td["n"].sum()) == 8 * sum(1 + (i % 7) for i in range(40))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16])  # numpy-backed, and not
def test_scattered_reads_of_many_rows_after_overwrites_are_exact(client, dtype):
    client.register_partition("train", [])
    lens = [1 + (i * 37) % 50 for i in range(300)]
    ids = [f"r{i}" for i in range(300)]
    col = ragged(lens, dtype, 2)
    client.put_samples(partition_id="train", sample_ids=ids, fields={"x": col})
    # overwrite every third row, so storage order no longer follows id order
    redo = ids[::3]
    redo_col = ragged(lens[::3], dtype, 2, seed=9)
    client.put_samples(partition_id="train", sample_ids=redo, fields={"x": redo_col})
    expect = dict(zip(ids, col.unbind()))
    expect.update(zip(redo, redo_col.unbind()))
    order = torch.randperm(300, generator=torch.Generator().manual_seed(0)).tolist()
    got = client.get_samples(
        partition_id="train", sample_ids=[ids[i] for i in order], select_fields=["x"]
    )["x"].unbind()
    for i, row in zip(order, got):
        assert torch.equal(row, expect[ids[i]])


def test_a_rejected_register_leaves_the_schema_as_it_was(client):
    client.register_partition("p", [])
    client.put_samples(partition_id="p", sample_ids=["a"], fields={"dense": torch.zeros(1, 3)})
    with pytest.raises(TypeError, match="'dense' already holds dense rows"):
        client.register_partition("p", ["dense", "other"], jagged_fields=["dense"])
    # the schema stayed open: any field is still writable
    client.put_samples(partition_id="p", sample_ids=["b"], fields={"anything": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"jagged_fields \['tok'\] are not among the declared"):
        client.register_partition("q", ["ids"], jagged_fields=["tok"])
    assert "q" not in client.list_partitions()


def test_closing_an_open_schema_keeps_its_existing_fields_writable(client):
    client.register_partition("p", [])
    client.put_samples(partition_id="p", sample_ids=["a"], fields={"old": torch.zeros(1)})
    client.register_partition("p", ["new"])
    client.put_samples(
        partition_id="p", sample_ids=["a"], fields={"old": torch.ones(1), "new": torch.ones(1)}
    )
    with pytest.raises(ValueError, match="'stray' is not declared"):
        client.put_samples(partition_id="p", sample_ids=["a"], fields={"stray": torch.ones(1)})


def test_tags_merge_per_row_and_read_back(train):
    train.put_samples(
        partition_id="train",
        sample_ids=["a", "b"],
        fields={"r": torch.zeros(2)},
        tags=[{"u": 1}, {"u": 2}],
    )
    train.put_samples(partition_id="train", sample_ids=["a"], tags=[{"std": 0.5}])
    assert train.get_tags(
        partition_id="train", sample_ids=["b", "a"]
    ) == [{"u": 2}, {"u": 1, "std": 0.5}]
    train.clear_samples(partition_id="train", sample_ids=["a"])
    with pytest.raises(KeyError, match="'a'"):
        train.get_tags(partition_id="train", sample_ids=["a"])

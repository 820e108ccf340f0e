"""Regression tests for what probing the embedded store found (reliability issue).

Each test names the finding it pins. The rule throughout: bad input raises one documented
exception naming the field or argument, and the store is exactly as it was before the call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_plugin.data_plane import (
    INPUT_IDS,
    INPUT_LENGTHS,
    CapacityError,
    LocalDataPlane,
    nested_from_lengths,
)
from tq_plugin.data_plane.backends import _columns


def snapshot(dp: LocalDataPlane, pid: str = "p") -> dict:
    """Everything a caller can observe of a partition: ids, every field of every row, tags."""
    ids = dp.list_sample_ids(pid)
    part = dp._partitions[pid]
    out: dict = {"ids": ids, "tags": dp.get_tags(partition_id=pid, sample_ids=ids) if ids else []}
    for name, col in sorted(part.columns.items()):
        if not col.live_rows:
            continue
        have = [s for s in ids if col.has(np.array([part.slot_of[s]]))[0]]
        td = dp.get_samples(partition_id=pid, sample_ids=have, select_fields=[name])
        value = td[name]
        rows = list(value.unbind()) if value.is_nested else list(value)
        out[name] = (col.spec, have, [r.clone() for r in rows])
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert a["ids"] == b["ids"] and a["tags"] == b["tags"]
    for k in a.keys() - {"ids", "tags"}:
        sa, ha, ra = a[k]
        sb, hb, rb = b[k]
        assert sa == sb and ha == hb, k
        assert all(torch.equal(x, y) for x, y in zip(ra, rb, strict=True)), k


@pytest.fixture
def dp() -> LocalDataPlane:
    d = LocalDataPlane()
    d.register_partition("p", [])
    d.put_samples(partition_id="p", sample_ids=["a", "b"], fields={
        "tok": nested_from_lengths(torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([2, 4])),
        "r": torch.tensor([1.0, 2.0]),
    }, tags=[{"k": 1}, {"k": 2}])
    return d


# ---------------------------------------------------------------- 1. corrupt jagged offsets
@pytest.mark.parametrize("offsets", [[0, 2, 9], [0, 3, 2], [-1, 2, 5], [1, 0, 5]])
def test_jagged_offsets_outside_or_decreasing_are_refused(dp, offsets):
    before = snapshot(dp)
    bad = torch.nested.nested_tensor_from_jagged(torch.arange(5), torch.tensor(offsets))
    with pytest.raises(ValueError, match="'tok' has invalid jagged offsets"):
        dp.put_samples(
            partition_id="p", sample_ids=["c", "d"], fields={"tok": bad, "r": torch.zeros(2)}
        )
    assert_same(before, snapshot(dp))
    # the next put's bytes are never readable through another row
    dp.put_samples(partition_id="p", sample_ids=["c"], fields={"tok": nested_from_lengths(torch.tensor([8, 9, 10]), torch.tensor([3])),
                                "r": torch.zeros(1)})
    assert dp.get_samples(
        partition_id="p", sample_ids=["c"], select_fields=["tok"]
    )["tok"][0].tolist() == [8, 9, 10]


def test_negative_lengths_of_a_narrowed_view_are_refused(dp):
    values = torch.arange(10)
    bad = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 4, 8]), lengths=torch.tensor([3, -2]))
    before = snapshot(dp)
    with pytest.raises(ValueError, match="'tok' has invalid jagged offsets"):
        dp.put_samples(partition_id="p", sample_ids=["c", "d"], fields={"tok": bad})
    assert_same(before, snapshot(dp))


def test_offsets_that_skip_leading_or_trailing_values_keep_exactly_the_rows(dp):
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(10), torch.tensor([2, 4, 7]))
    dp.put_samples(partition_id="p", sample_ids=["c", "d"], fields={"tok": nt})
    rows = dp.get_samples(
        partition_id="p", sample_ids=["c", "d"], select_fields=["tok"]
    )["tok"].unbind()
    assert [r.tolist() for r in rows] == [[2, 3], [4, 5, 6]]


# ---------------------------------------------------------------- 3. atomic puts
@pytest.mark.parametrize("make", [
    lambda: torch.tensor([1.0, 2.0]).to_sparse(),
    lambda: torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, torch.qint8),
    lambda: torch.empty(2, device="meta"),
])
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_an_unstorable_second_field_leaves_the_first_unwritten(dp, make):
    before = snapshot(dp)
    with pytest.raises((TypeError, ValueError), match="field 'r'"):
        dp.put_samples(partition_id="p", sample_ids=["a", "b"], fields={
            "tok": nested_from_lengths(torch.tensor([0, 0, 0]), torch.tensor([1, 2])),
            "r": make(),
        })
    assert_same(before, snapshot(dp))


def test_an_allocation_failure_part_way_writes_nothing(dp, monkeypatch):
    before = snapshot(dp)
    calls = {"n": 0}
    real = _columns._grown

    def failing(buf, need):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("injected")
        return real(buf, need)

    monkeypatch.setattr(_columns, "_grown", failing)
    big = 64
    with pytest.raises(MemoryError):
        dp.put_samples(partition_id="p", sample_ids=[f"n{i}" for i in range(big)], fields={
            "tok": nested_from_lengths(torch.arange(big * 3), torch.full((big,), 3)),
            "r": torch.zeros(big),
        })
    assert calls["n"] == 2
    assert_same(before, snapshot(dp))  # no new ids listed without data
    monkeypatch.setattr(_columns, "_grown", real)
    dp.put_samples(partition_id="p", sample_ids=["n0"], fields={"tok": nested_from_lengths(torch.arange(3), torch.tensor([3])),
                                 "r": torch.zeros(1)})
    assert dp.list_sample_ids("p") == ["a", "b", "n0"]


# ---------------------------------------------------------------- 9. clear errors
def test_a_string_is_never_taken_as_a_sequence_of_ids(dp):
    dp.put_samples(partition_id="p", sample_ids=["ab"], fields={"r": torch.zeros(1)})
    before = snapshot(dp)
    with pytest.raises(TypeError, match="sample_ids must be a list of strings"):
        dp.clear_samples(partition_id="p", sample_ids="ab")
    with pytest.raises(TypeError, match="sample_ids must be a list of strings"):
        dp.put_samples(partition_id="p", sample_ids="ab", fields={"r": torch.zeros(2)})
    with pytest.raises(TypeError, match="select_fields must be a list of strings"):
        dp.get_samples(partition_id="p", sample_ids=["a"], select_fields="r")
    with pytest.raises(TypeError, match="fields must be a list of strings"):
        dp.register_partition("q", "abc")
    assert_same(before, snapshot(dp))
    assert "q" not in dp.list_partitions()


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"num_samples": "3"}, TypeError, "num_samples must be a positive int"),
    ({"num_samples": True}, TypeError, "num_samples must be a positive int"),
    ({"num_samples": 0}, ValueError, "num_samples must be > 0"),
    ({"grpo_group_size": 2.0}, TypeError, "grpo_group_size must be a positive int"),
    ({"num_samples": 6, "grpo_group_size": 4}, ValueError, "not a multiple of grpo_group_size"),
    ({"consumer_tasks": "train"}, TypeError, "consumer_tasks must be a list"),
    ({"enums": {"x": "ab"}}, TypeError, r"enums\['x'\] must be a list"),
])
def test_register_partition_arguments_get_clear_errors(kwargs, exc, match):
    dp = LocalDataPlane()
    with pytest.raises(exc, match=match):
        dp.register_partition("q", ["x"], **kwargs)
    assert dp.list_partitions() == []


def test_num_samples_is_a_row_limit():
    dp = LocalDataPlane()
    dp.register_partition("q", ["x"], num_samples=2)
    dp.put_samples(partition_id="q", sample_ids=["a", "b"], fields={"x": torch.zeros(2)})
    with pytest.raises(CapacityError, match="num_samples=2"):
        dp.put_samples(partition_id="q", sample_ids=["c"], fields={"x": torch.zeros(1)})
    dp.put_samples(
        partition_id="q", sample_ids=["a"], fields={"x": torch.ones(1)}
    )  # overwrites are not new rows
    dp.clear_samples(partition_id="q", sample_ids=["a"])
    dp.put_samples(partition_id="q", sample_ids=["c"], fields={"x": torch.zeros(1)})
    assert dp.list_sample_ids("q") == ["b", "c"]


def test_tags_are_copied_in_and_out(dp):
    nested = {"k": [1, 2]}
    dp.put_samples(partition_id="p", sample_ids=["c"], fields={"r": torch.zeros(1)}, tags=[nested])
    nested["k"].append(3)
    nested["new"] = 1
    got = dp.get_tags(partition_id="p", sample_ids=["c"])[0]
    assert got == {"k": [1, 2]}
    got["k"].append(4)
    assert dp.get_tags(partition_id="p", sample_ids=["c"])[0] == {"k": [1, 2]}


@pytest.mark.parametrize(("tags", "match"), [
    ("ab", "tags must be a list"),
    ([{"k": 1}], "got 1 tags for 2"),
    ([{"k": 1}, 5], r"tags\[1\] must be a mapping"),
    ([{1: 1}, {}], r"tags\[0\] keys must be strings"),
])
def test_malformed_tags_write_nothing(dp, tags, match):
    before = snapshot(dp)
    with pytest.raises((TypeError, ValueError), match=match):
        dp.put_samples(
            partition_id="p", sample_ids=["c", "d"], fields={"r": torch.zeros(2)}, tags=tags
        )
    assert_same(before, snapshot(dp))


# ---------------------------------------------------------------- put modes (first_write / write-back)
def test_insert_refuses_held_ids_and_update_refuses_new_ones(dp):
    before = snapshot(dp)
    with pytest.raises(ValueError, match=r"mode='insert'.*'a'"):
        dp.put_samples(
            partition_id="p", sample_ids=["z", "a"], fields={"r": torch.zeros(2)}, mode="insert"
        )
    with pytest.raises(KeyError, match=r"mode='update'.*'typo'"):
        dp.put_samples(
            partition_id="p", sample_ids=["a", "typo"], fields={"r": torch.zeros(2)}, mode="update"
        )
    with pytest.raises(ValueError, match="mode must be one of"):
        dp.put_samples(
            partition_id="p", sample_ids=["a"], fields={"r": torch.zeros(1)}, mode="append"
        )
    assert_same(before, snapshot(dp))
    dp.put_samples(
        partition_id="p", sample_ids=["a"], fields={"r": torch.tensor([9.0])}, mode="update"
    )
    assert dp.get_samples(
        partition_id="p", sample_ids=["a"], select_fields=["r"]
    )["r"].tolist() == [9.0]


def test_per_token_write_back_must_match_the_stored_input_lengths():
    dp = LocalDataPlane()
    dp.register_partition("t", [])
    lengths = torch.tensor([5, 9, 3])
    dp.put_samples(partition_id="t", sample_ids=["x", "y", "z"], fields={
        INPUT_IDS: nested_from_lengths(torch.arange(17), lengths),
        INPUT_LENGTHS: lengths,
    })
    with pytest.raises(ValueError, match=r"'advantages' is per-token.*\('x', 1, 5\)"):
        dp.put_samples(partition_id="t", sample_ids=["x", "y", "z"], fields={
            "advantages": nested_from_lengths(torch.zeros(3), torch.tensor([1, 1, 1]))})
    assert dp.get_samples(
        partition_id="t", sample_ids=["x"], select_fields=[INPUT_IDS]
    )[INPUT_IDS][0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError):
        dp.get_samples(partition_id="t", sample_ids=["x"], select_fields=["advantages"])
    with pytest.raises(ValueError, match="'input_ids' is per-token"):  # inconsistent in one put
        dp.put_samples(partition_id="t", sample_ids=["w"], fields={INPUT_IDS: nested_from_lengths(torch.arange(2), torch.tensor([2])),
                                    INPUT_LENGTHS: torch.tensor([3])})


# ---------------------------------------------------------------- variable rows (distributed issue §1)
def test_a_dense_field_becomes_jagged_when_a_row_of_another_length_joins():
    dp = LocalDataPlane()
    dp.register_partition("s", ["tok", "n"])
    dp.put_samples(
        partition_id="s",
        sample_ids=["a"],
        fields={"tok": torch.tensor([[1, 2, 3, 4, 5]]), "n": torch.tensor([5])},
    )
    assert not dp.get_samples(
        partition_id="s", sample_ids=["a"], select_fields=["tok"]
    )["tok"].is_nested
    dp.put_samples(
        partition_id="s",
        sample_ids=["b"],
        fields={"tok": torch.tensor([[7, 8, 9, 10, 11, 12, 13]]), "n": torch.tensor([7])},
    )
    dp.put_samples(partition_id="s", sample_ids=["c"], fields={"tok": nested_from_lengths(torch.tensor([1]), torch.tensor([1])),
                                "n": torch.tensor([1])})
    out = dp.get_samples(partition_id="s", sample_ids=["a", "b", "c"], select_fields=["tok"])["tok"]
    assert out.is_nested
    assert [r.tolist() for r in out.unbind()] == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [1]]


@pytest.mark.parametrize(("value", "match"), [
    (torch.zeros(1, 5, dtype=torch.int32), "dtype mismatch"),
    (torch.zeros(1, 5, 2, dtype=torch.int64), "shape mismatch"),   # rank change
    (torch.zeros(1, dtype=torch.int64), "shape mismatch"),         # rank change
])
def test_dtype_rank_and_trailing_changes_are_still_refused(value, match):
    dp = LocalDataPlane()
    dp.register_partition("s", [])
    dp.put_samples(
        partition_id="s", sample_ids=["a"], fields={"tok": torch.ones(1, 5, dtype=torch.int64)}
    )
    with pytest.raises(TypeError, match=f"'tok' {match}"):
        dp.put_samples(partition_id="s", sample_ids=["b"], fields={"tok": value})
    dp.put_samples(partition_id="s", sample_ids=["m"], fields={"img": torch.ones(1, 4, 3)})
    with pytest.raises(TypeError, match="'img' shape mismatch"):
        dp.put_samples(
            partition_id="s", sample_ids=["n"], fields={"img": torch.ones(1, 4, 2)}
        )  # trailing dim change
    assert dp.list_sample_ids("s") == ["a", "m"]


# ---------------------------------------------------------------- 10. memory goes back
def test_clearing_every_row_returns_the_buffers():
    dp = LocalDataPlane()
    dp.register_partition("m", [])
    n = 512
    ids = [f"r{i}" for i in range(n)]
    dp.put_samples(partition_id="m", sample_ids=ids, fields={"tok": nested_from_lengths(torch.arange(n * 300), torch.full((n,), 300)),
                              "r": torch.zeros(n, 64)})
    peak = dp.stats()["bytes_held"]
    dp.clear_samples(
        partition_id="m", sample_ids=ids[: n - 8]
    )  # most rows gone: compaction hands back the garbage
    partial = dp.stats()["bytes_held"]
    assert partial < 0.6 * peak
    dp.clear_samples(partition_id="m", sample_ids=ids)
    stats = dp.stats()
    assert stats["rows"] == 0 and stats["live_bytes"] == 0
    assert stats["bytes_held"] <= 0.1 * peak


def test_capacity_bytes_refuses_a_put_that_would_pass_it_and_writes_nothing():
    dp = LocalDataPlane(capacity_bytes=10_000)
    dp.register_partition("c", [])
    dp.put_samples(
        partition_id="c", sample_ids=["a"], fields={"x": torch.zeros(1, 1000, dtype=torch.float32)}
    )  # 4,000 bytes
    with pytest.raises(CapacityError, match="capacity_bytes=10000"):
        dp.put_samples(
            partition_id="c",
            sample_ids=["b", "c"],
            fields={"x": torch.zeros(2, 1000, dtype=torch.float32)},
        )
    assert dp.list_sample_ids("c") == ["a"]
    dp.clear_samples(partition_id="c", sample_ids=["a"])
    dp.put_samples(
        partition_id="c",
        sample_ids=["b", "c"],
        fields={"x": torch.zeros(2, 1000, dtype=torch.float32)},
    )
    with pytest.raises(TypeError, match="capacity_bytes must be an int"):
        LocalDataPlane(capacity_bytes="1GB")
    assert LocalDataPlane().capacity_bytes > 0


# ---------------------------------------------------------------- performance issue §1
def test_ppo_write_back_compacts_a_bounded_number_of_times():
    """3 epochs of 8-row write-backs over 4,096 rows compacted 523 times before the fix."""
    dp = LocalDataPlane()
    dp.register_partition("w", [])
    n = 4096
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 64, (n,), generator=g)
    ids = [f"s{i}" for i in range(n)]
    dp.put_samples(
        partition_id="w",
        sample_ids=ids,
        fields={"adv": nested_from_lengths(torch.zeros(int(lengths.sum())), lengths)},
    )
    for _ in range(3):
        for start in range(0, n, 8):
            part = lengths[start : start + 8]
            dp.put_samples(
                partition_id="w",
                sample_ids=ids[start : start + 8],
                fields={"adv": nested_from_lengths(torch.ones(int(part.sum())), part)},
            )
    # every overwrite leaves garbage equal to what it writes: one compaction per doubling
    assert dp.compactions() <= 6
    out = dp.get_samples(partition_id="w", sample_ids=ids[:3], select_fields=["adv"])["adv"]
    assert [len(r) for r in out.unbind()] == lengths[:3].tolist()


# ---------------------------------------------------------------- every dtype torch can copy
_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
           torch.uint64, torch.bfloat16, torch.complex64, torch.bool, torch.float16]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_dense_and_jagged_rows_of_every_copyable_dtype_round_trip(dtype):
    """A dense float8/uint16/32/64 put used to fail in index_copy_ after its ids were created."""
    dp = LocalDataPlane()
    dp.register_partition("d", [])
    base = torch.arange(12).reshape(3, 4) % 2
    dense = base.to(torch.float32).to(dtype) if dtype.is_floating_point else base.to(dtype)
    dp.put_samples(
        partition_id="d",
        sample_ids=["a", "b", "c"],
        fields={"x": dense, "j": nested_from_lengths(dense.reshape(-1), torch.tensor([4, 4, 4]))},
    )
    dp.put_samples(
        partition_id="d", sample_ids=["c", "a"], fields={"x": dense[:2]}
    )  # a scattered multi-row overwrite
    got = dp.get_samples(partition_id="d", sample_ids=["a", "b", "c"], select_fields=["x", "j"])
    want = dense[[1, 1, 0]]
    assert got["x"].dtype == dtype
    assert torch.equal(got["x"].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got["j"].values().view(torch.uint8), dense.reshape(-1).view(torch.uint8))


def test_a_dtype_torch_cannot_copy_is_refused_before_anything_is_written():
    dp = LocalDataPlane()
    dp.register_partition("d", [])
    try:
        odd = torch.zeros(2, dtype=torch.uint4)
    except (RuntimeError, TypeError):
        pytest.skip("this torch cannot build a uint4 tensor")
    with pytest.raises(TypeError, match="'x' has dtype torch.uint4"):
        dp.put_samples(
            partition_id="d", sample_ids=["a", "b"], fields={"ok": torch.zeros(2), "x": odd}
        )
    assert dp.list_sample_ids("d") == []


# ---------------------------------------------------------------- one-row write buffer
def _row(i: int) -> dict:
    return {"tok": torch.tensor([[i, i + 1, i + 2]]), "n": torch.tensor([i]), "f": torch.tensor([[0.5 * i]])}


@pytest.fixture
def staged() -> LocalDataPlane:
    d = LocalDataPlane()
    d.register_partition("b", [], consumer_tasks=["t"])
    for i in range(5):  # the first row validates the layout; the rest are buffered
        d.put_samples(partition_id="b", sample_ids=[f"r{i}"], fields=_row(i), tags=[{"i": i}])
    return d


def test_buffered_one_row_puts_are_readable_claimable_and_counted_at_once(staged):
    assert staged._partitions["b"].buffered  # the fast path was taken
    got = staged.get_samples(
        partition_id="b", sample_ids=["r4", "r0"], select_fields=["tok", "n", "f"]
    )
    assert got["tok"].tolist() == [[4, 5, 6], [0, 1, 2]] and got["n"].tolist() == [4, 0]
    staged.put_samples(partition_id="b", sample_ids=["r5"], fields=_row(5))
    meta = staged.claim_meta("b", "t", ["tok"], batch_size=10, blocking=False)
    assert meta.sample_ids == [f"r{i}" for i in range(6)]
    assert staged.stats()["rows"] == 6 and staged.get_tags(
        partition_id="b", sample_ids=["r3"]
    ) == [{"i": 3}]


def test_a_buffered_row_is_a_copy_of_the_callers_tensors(staged):
    row = _row(7)
    staged.put_samples(partition_id="b", sample_ids=["r7"], fields=row)
    row["tok"].fill_(-1)
    row["n"].fill_(-1)
    assert staged.get_samples(
        partition_id="b", sample_ids=["r7"], select_fields=["tok", "n"]
    )["tok"].tolist() == [[7, 8, 9]]


def test_an_overwrite_after_buffered_puts_lands_last(staged):
    staged.put_samples(partition_id="b", sample_ids=["r9"], fields=_row(9))
    staged.put_samples(
        partition_id="b", sample_ids=["r9"], fields=_row(1)
    )  # an existing id: the full path, after a flush
    assert staged.get_samples(
        partition_id="b", sample_ids=["r9"], select_fields=["n"]
    )["n"].tolist() == [1]


def test_bad_input_on_a_known_layout_is_still_refused_whole(staged):
    sparse = {**_row(8), "f": torch.tensor([[0.5]]).to_sparse()}
    with pytest.raises(TypeError, match="'f' has layout"):
        staged.put_samples(partition_id="b", sample_ids=["r8"], fields=sparse)
    wide = {**_row(8), "n": torch.tensor([8], dtype=torch.int32)}
    with pytest.raises(TypeError, match="'n' dtype mismatch"):
        staged.put_samples(partition_id="b", sample_ids=["r8"], fields=wide)
    assert "r8" not in staged.list_sample_ids("b")


def test_buffered_puts_respect_num_samples_and_capacity():
    d = LocalDataPlane(capacity_bytes=10**6)
    d.register_partition("b", [], num_samples=3)
    for i in range(3):
        d.put_samples(partition_id="b", sample_ids=[f"r{i}"], fields=_row(i))
    with pytest.raises(CapacityError, match="num_samples=3"):
        d.put_samples(partition_id="b", sample_ids=["r3"], fields=_row(3))
    assert d.list_sample_ids("b") == ["r0", "r1", "r2"]


def test_a_flush_that_runs_out_of_memory_keeps_the_acknowledged_rows(staged, monkeypatch):
    for i in range(5, 40):
        staged.put_samples(partition_id="b", sample_ids=[f"r{i}"], fields=_row(i))
    real = _columns._grown
    monkeypatch.setattr(_columns, "_grown", lambda buf, need: (_ for _ in ()).throw(MemoryError("injected")))
    with pytest.raises(MemoryError):
        staged.get_samples(partition_id="b", sample_ids=["r0"], select_fields=["n"])
    monkeypatch.setattr(_columns, "_grown", real)
    got = staged.get_samples(
        partition_id="b", sample_ids=[f"r{i}" for i in range(40)], select_fields=["n", "tok"]
    )
    assert got["n"].tolist() == list(range(40))
    assert [r.tolist() for r in got["tok"]][39] == [39, 40, 41]


def test_rows_whose_jagged_lengths_vary_are_buffered_and_read_back_exactly():
    d = LocalDataPlane()
    d.register_partition("v", [], jagged_fields=["tok"])
    rows = {f"r{i}": torch.arange(i + 1) * 3 for i in range(10)}  # lengths 1..10
    for sid, tok in rows.items():
        d.put_samples(partition_id="v", sample_ids=[sid], fields={"tok": tok[None], "n": torch.tensor([len(tok)]),
                                  "m": torch.ones(1, 3)})
    assert len(d._partitions["v"].buffered) == 9  # only the first row took the full path
    got = d.get_samples(partition_id="v", sample_ids=list(rows), select_fields=["tok", "n"])
    assert [r.tolist() for r in got["tok"].unbind()] == [t.tolist() for t in rows.values()]
    assert got["n"].tolist() == list(range(1, 11))
    # a dense field of another width does not fit the plan: full path, the column turns jagged
    d.put_samples(partition_id="v", sample_ids=["w"], fields={"tok": torch.tensor([[7]]), "n": torch.tensor([1]),
                               "m": torch.ones(1, 2)})
    got = d.get_samples(partition_id="v", sample_ids=["r0", "w"], select_fields=["m"])["m"]
    assert got.is_nested and [len(r) for r in got.unbind()] == [3, 2]


def test_freed_large_buffers_are_reused_only_once_no_read_holds_them_and_close_returns_them():
    from tq_plugin.data_plane.backends._columns import POOL

    d = LocalDataPlane()
    d.register_partition("m", [])
    ids = [f"r{i}" for i in range(64)]
    values = torch.arange(64 * 8192, dtype=torch.float32)
    d.put_samples(
        partition_id="m",
        sample_ids=ids,
        fields={"x": nested_from_lengths(values, torch.full((64,), 8192))},
    )  # 2 MiB
    view = d.get_samples(
        partition_id="m", sample_ids=ids, select_fields=["x"]
    )["x"].values()  # a view of the store's buffer
    d.clear_samples(partition_id="m", sample_ids=ids)
    assert d.stats()["bytes_cached"] >= values.nbytes
    d.put_samples(
        partition_id="m",
        sample_ids=ids,
        fields={"x": nested_from_lengths(torch.zeros_like(values), torch.full((64,), 8192))},
    )
    assert torch.equal(view, values)  # the held buffer was not handed out again
    d.close()
    assert POOL.nbytes == 0

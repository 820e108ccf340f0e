"""Column I/O under bad input (issue #8 items 1, 2, 9; issue #12 §6).

Every rejected call raises one documented exception type naming the offending field, and leaves
the whole store exactly as it was (every partition's schema, ids, tags and claims, every field's
kind, dtype, shape and bytes). The regression tests pin the
cases reported in the issues; the Hypothesis tests fuzz first_write / write_columns /
read_columns and keep each failure they found as an ``@example``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tq_plugin.data_plane import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    KVBatchMeta,
    LocalDataPlane,
    first_write,
    nested_from_lengths,
    read_columns,
    stamp_global_forward_pad_seqlen,
    write_columns,
)
from tq_plugin.data_plane.checkpoint import PartitionSnapshot

from .conftest import ragged

DOCUMENTED = (TypeError, ValueError, KeyError)


def snapshot(client: LocalDataPlane) -> list:
    """The whole store, as its checkpoint copies it: every partition's schema, live ids in
    first-put order, tags and claims, and every field's kind, dtype, shape and bytes."""
    return [PartitionSnapshot(p.entry, {k: t.clone() for k, t in p.tensors.items()})
            for p in client.snapshot_partitions()]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(before: list, after: list) -> None:
    assert [p.entry for p in after] == [p.entry for p in before]
    for b, a in zip(before, after, strict=True):
        assert a.tensors.keys() == b.tensors.keys(), b.entry["partition_id"]
        for key, x in b.tensors.items():
            y = a.tensors[key]
            assert (y.dtype, y.shape) == (x.dtype, x.shape), (b.entry["partition_id"], key)
            assert torch.equal(_bytes(y), _bytes(x)), (b.entry["partition_id"], key)


def rollout(lens: list[int], **extra) -> dict:
    return {
        "input_ids": ragged(lens, torch.int64),
        "input_lengths": torch.tensor(lens),
        "sample_mask": torch.ones(len(lens)),
        **extra,
    }


@pytest.fixture
def store():
    """``train`` (rows a, b, c) beside ``eval`` (the same ids), which no call here names."""
    client = LocalDataPlane()
    for partition in ("eval", "train"):
        client.register_partition(partition, [])
        meta = first_write(
            rollout([5, 9, 3]), sample_ids=["a", "b", "c"], client=client, partition_id=partition
        )
    yield client, meta  # train's
    client.close()


def rejected(exc_type, match, client, call):
    """Run ``call``; it must raise ``exc_type`` matching ``match`` and change nothing."""
    before = snapshot(client)
    with pytest.raises(exc_type, match=match):
        call()
    assert_same(before, snapshot(client))


# ---------------------------------------------------------------------------- issue #8 item 1
def test_negative_input_lengths_are_refused_before_the_put(store):
    """Regression: [-2, 3] was accepted; the next row then read [5, 6, 8] instead of [8, 9, 10]."""
    client, _ = store
    batch = {
        "input_ids": torch.arange(5, 11).reshape(2, 3),
        "input_lengths": torch.tensor([-2, 3]),
        "sample_mask": torch.ones(2),
    }
    rejected(
        ValueError,
        r"'input_lengths' must be non-negative: rows \[0\] have lengths \[-2\]",
        client,
        lambda: first_write(batch, sample_ids=["x", "y"], client=client, partition_id="train"),
    )


@pytest.mark.parametrize(
    ("lengths", "exc", "match"),
    [
        (torch.tensor([2.0, 3.0]), TypeError, "'input_lengths' must have an integer dtype"),
        (torch.tensor([True, True]), TypeError, "'input_lengths' must have an integer dtype"),
        (torch.tensor([[2, 3]]), ValueError, r"'input_lengths' must have shape \[2\]"),
        (torch.tensor([2, 3, 1]), ValueError, r"'input_lengths' must have shape \[2\]"),
        ([2, 3], TypeError, "'input_lengths' must be a dense"),
    ],
)
def test_bad_input_lengths_name_the_field(store, lengths, exc, match):
    client, _ = store
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "sample_mask": torch.ones(2)}
    batch["input_lengths"] = (
        lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths).float()
    )
    if isinstance(lengths, list):
        batch["input_lengths"] = nested_from_lengths(torch.arange(5), torch.tensor(lengths))
    rejected(
        exc,
        match,
        client,
        lambda: first_write(batch, sample_ids=["x", "y"], client=client, partition_id="train"),
    )


def test_write_columns_refuses_negative_meta_lengths(store):
    """Regression: sequence_lengths=[-1, 2, 3] stored offsets [0, -1, 1, 4]."""
    client, meta = store
    bad = KVBatchMeta("train", None, meta.sample_ids, sequence_lengths=[-1, 2, 3])
    rejected(
        ValueError,
        r"'meta.sequence_lengths' must be non-negative: rows \[0\]",
        client,
        lambda: write_columns(client, bad, {"advantages": torch.zeros(3, 9)}),
    )


# ---------------------------------------------------------------------------- issue #8 item 2
def test_write_columns_refuses_lengths_that_disagree_with_the_stored_rows(store):
    """Regression: meta lengths [1, 1, 1] against stored [5, 9, 3] were accepted."""
    client, meta = store
    stale = KVBatchMeta("train", None, meta.sample_ids, sequence_lengths=[1, 1, 1])
    rejected(
        ValueError,
        # the store checks inside its put (LocalDataPlane); a client that does not gets the read
        r"(sequence_lengths disagree with the stored 'input_lengths' for sample_ids 'a', 'b', 'c': "
        r"meta says \[1, 1, 1\], the store holds \[5, 9, 3\])|('advantages' is per-token.*"
        r"\('a', 1, 5\), \('b', 1, 9\), \('c', 1, 3\))",
        client,
        lambda: write_columns(client, stale, {"advantages": torch.zeros(3, 9)}),
    )


@pytest.mark.parametrize("fields", [{"score": torch.ones(2)}, {"advantages": torch.zeros(2, 9)}])
def test_write_columns_to_a_typod_id_mints_nothing(store, fields):
    """Regression: a write naming an id never written silently minted a new row."""
    client, _ = store
    typo = KVBatchMeta("train", None, ["a", "bb"], sequence_lengths=[5, 9])
    rejected(KeyError, "'bb'", client, lambda: write_columns(client, typo, fields))


def test_write_columns_without_meta_lengths_cuts_to_the_stored_lengths(store):
    client, meta = store
    bare = KVBatchMeta("train", None, meta.sample_ids)
    write_columns(client, bare, {"advantages": torch.arange(27.0).reshape(3, 9)})
    got = client.get_samples(
        partition_id="train", sample_ids=meta.sample_ids, select_fields=["advantages"]
    )["advantages"]
    assert got.is_nested and [len(r) for r in got.unbind()] == [5, 9, 3]


def test_write_columns_rejects_non_meta_and_non_mapping(store):
    client, meta = store
    rejected(
        TypeError,
        "meta must be a KVBatchMeta",
        client,
        lambda: write_columns(client, {"sample_ids": ["a"]}, {"score": torch.ones(1)}),
    )
    rejected(
        TypeError,
        "fields must be a dict or TensorDict",
        client,
        lambda: write_columns(client, meta, [("score", torch.ones(3))]),
    )


def test_strided_nested_column_is_a_type_error(store):
    client, meta = store
    strided = torch.nested.nested_tensor([torch.zeros(5), torch.zeros(9), torch.zeros(3)])
    rejected(
        TypeError,
        "'advantages': nested tensors must be torch.jagged",
        client,
        lambda: write_columns(client, meta, {"advantages": strided}),
    )


# ---------------------------------------------------------------------------- issue #12 §6
def test_first_write_over_existing_ids_is_refused_unless_overwrite(store):
    """Regression: a second first_write silently replaced the rows under an older meta."""
    client, old = store
    again = rollout([2, 2, 2])
    rejected(
        ValueError,
        "'a'",
        client,
        lambda: first_write(again, sample_ids=["a", "b", "c"], client=client, partition_id="train"),
    )
    # one new id among existing ones: still nothing written
    rejected(
        ValueError,
        "'a'",
        client,
        lambda: first_write(
            again, sample_ids=["new", "a", "b"], client=client, partition_id="train"
        ),
    )
    meta = first_write(
        again, sample_ids=["a", "b", "c"], client=client, partition_id="train", overwrite=True
    )
    assert meta.sequence_lengths == [2, 2, 2]
    # the old meta is now stale, and write_columns says so instead of misaligning the rows
    with pytest.raises(ValueError, match=r"(meta says \[5, 9, 3\], the store holds \[2, 2, 2\])|('advantages' is per-token.*\('a', 5, 2\))"):
        write_columns(client, old, {"advantages": torch.zeros(3, 9)})


def test_first_write_refuses_duplicate_ids_in_one_batch(store):
    client, _ = store
    rejected(
        ValueError,
        "duplicate sample_ids 'x'",
        client,
        lambda: first_write(
            rollout([1, 2]), sample_ids=["x", "x"], client=client, partition_id="train"
        ),
    )


# ---------------------------------------------------------------------------- issue #8 item 9
def test_huge_pad_target_is_a_clear_error_not_an_allocator_error(store):
    client, meta = store
    meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = 2**40
    with pytest.raises(
        ValueError,
        match=r"padding field 'input_ids' to shape \[3, 1099511627776\].*global_forward_pad_seqlen",
    ):
        read_columns(client, meta, ["input_ids"])
    meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = 2**62
    with pytest.raises(ValueError, match="global_forward_pad_seqlen"):
        read_columns(client, meta, ["input_ids"])


@pytest.mark.parametrize(
    ("target", "exc", "match"),
    [
        ("12", TypeError, "must be an int, got str"),
        (12.0, TypeError, "must be an int, got float"),
        (True, TypeError, "must be an int, got bool"),
        (-1, ValueError, "must be >= 0"),
    ],
)
def test_pad_target_must_be_a_non_negative_int(store, target, exc, match):
    client, meta = store
    meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target
    with pytest.raises(exc, match=rf"extra_info\['global_forward_pad_seqlen'\] {match}"):
        read_columns(client, meta, ["input_ids"])


def test_select_fields_must_be_a_list_not_a_string(store):
    client, meta = store
    with pytest.raises(TypeError, match="select_fields must be a list of field names, got str"):
        read_columns(client, meta, "input_ids")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"pad_to_multiple": "4"}, TypeError, "pad_to_multiple must be an int, got str"),
        ({"pad_to_multiple": 0}, ValueError, "pad_to_multiple must be >= 1"),
        ({"sample_ids": "xy"}, TypeError, "sample_ids must be a list of str, got str"),
        ({"sample_ids": ["x", 2]}, TypeError, "sample_ids must be strings"),
        ({"tags": [{}, 3]}, TypeError, "each tag must be a dict"),
        ({"tags": 3}, TypeError, "tags must be a list of dicts, got int"),
        ({"extra_info": [1]}, TypeError, "extra_info must be a dict"),
        ({"partition_id": 7}, TypeError, "partition_id and task_name must be str"),
    ],
)
def test_first_write_argument_types(store, kwargs, exc, match):
    """Regression: pad_to_multiple="4" raised only after the put had landed."""
    client, _ = store
    call = {"sample_ids": ["x", "y"], "client": client, "partition_id": "train", **kwargs}
    rejected(exc, match, client, lambda: first_write(rollout([1, 2]), **call))


def test_stamp_checks_types_before_stamping():
    meta = KVBatchMeta("p", None, ["a"], sequence_lengths=[10])
    with pytest.raises(TypeError, match="sequence_length_round must be an int, got str"):
        stamp_global_forward_pad_seqlen(meta, sequence_length_round="8")
    meta.sequence_lengths[0] = -3
    with pytest.raises(ValueError, match="'meta.sequence_lengths' must be non-negative"):
        stamp_global_forward_pad_seqlen(meta)
    assert GLOBAL_FORWARD_PAD_SEQLEN not in meta.extra_info


# ---------------------------------------------------------------------------- accepted edge cases
def test_nan_inf_and_empty_rows_round_trip_bit_exact(store):
    client, _ = store
    lens = [0, 3, 0]
    lp = torch.tensor([float("nan"), float("-inf"), float("inf")])
    batch = rollout(
        lens,
        generation_logprobs=nested_from_lengths(lp, torch.tensor(lens)),
        score=torch.tensor([float("nan"), 1.0, float("-inf")]),
    )
    meta = first_write(batch, sample_ids=["e0", "e1", "e2"], client=client, partition_id="train")
    out = read_columns(client, meta, ["generation_logprobs", "score", "input_ids"])
    assert out["input_ids"].shape == (3, 3)
    torch.testing.assert_close(out["generation_logprobs"][1], lp, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out["score"], batch["score"], rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------- fuzzing
@st.composite
def first_write_cases(draw):
    """A valid first write with, half the time, one or more faults mixed in."""
    n = draw(st.integers(0, 4))
    lens = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    if n and draw(st.integers(0, 4)) == 0:
        lens[draw(st.integers(0, n - 1))] = draw(st.integers(-3, -1))
    dtype = draw(st.sampled_from([torch.int64] * 4 + [torch.int32, torch.float32, torch.bool]))
    layout = draw(st.sampled_from(["jagged", "padded", "absent"]))
    width = max([0, *lens]) + draw(st.sampled_from([0, 1, 2, -1]))
    ids = [f"n{i}" for i in range(n)]
    fault = draw(st.sampled_from(["none"] * 4 + ["short", "long", "dup", "existing"]))
    if fault == "short":
        ids = ids[:-1]
    elif fault == "long":
        ids.append("n9")
    elif fault == "dup" and n > 1:
        ids[-1] = ids[0]
    elif fault == "existing" and n:
        ids[draw(st.integers(0, n - 1))] = draw(st.sampled_from(["a", "b"]))
    special = draw(
        st.lists(
            st.sampled_from([0.0, float("nan"), float("inf"), float("-inf"), 1.5]),
            min_size=n,
            max_size=n,
        )
    )
    pad = draw(st.sampled_from([1, 1, 4, 0, "4"]))
    overwrite = draw(st.booleans())
    return lens, dtype, layout, width, ids, special, pad, overwrite


def _build(lens, dtype, layout, width):
    n = len(lens)
    batch = {
        "input_lengths": torch.tensor(lens, dtype=torch.int64).to(dtype),
        "sample_mask": torch.ones(n),
    }
    safe = torch.tensor([max(0, x) for x in lens], dtype=torch.int64)
    if layout == "jagged":
        batch["input_ids"] = nested_from_lengths(torch.arange(int(safe.sum())), safe)
    elif layout == "padded":
        batch["input_ids"] = torch.arange(n * max(width, 0)).reshape(n, max(width, 0))
    return batch


def _must_refuse(lens, dtype, layout, width, ids, pad, overwrite, existing) -> bool:
    n = len(lens)
    return (
        n == 0
        or len(ids) != n
        or len(set(ids)) != n
        # int32 lengths: the partition already holds int64 ones, and a field keeps one dtype
        or dtype in (torch.float32, torch.bool, torch.int32)
        or min(lens, default=0) < 0
        or (layout == "padded" and max(width, 0) < max(lens, default=0))
        or not isinstance(pad, int)
        or pad < 1
        or (not overwrite and bool(set(ids) & existing))
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=first_write_cases())
@example(case=([-2, 3], torch.int64, "padded", 3, ["n0", "n1"], [0.0, 0.0], 1, False))  # issue #8
@example(case=([2, 3], torch.int64, "jagged", 3, ["a", "n1"], [0.0, 0.0], 1, False))  # issue #12
@example(case=([0, 0], torch.int64, "padded", 0, ["n0", "n1"], [float("nan")] * 2, 1, False))
@example(case=([0], torch.int32, "padded", 0, ["n0"], [0.0], 1, False))  # dtype is the store's rule
@example(case=([4], torch.int64, "absent", 4, ["b"], [0.0], 1, False))  # equal to a held row: still not a retry
def test_fuzz_first_write(case):
    lens, dtype, layout, width, ids, special, pad, overwrite = case
    client = LocalDataPlane()
    client.register_partition("train", [])
    first_write(rollout([2, 4]), sample_ids=["a", "b"], client=client, partition_id="train")
    existing = {"a", "b"}
    batch = _build(lens, dtype, layout, width)
    batch["score"] = torch.tensor(special, dtype=torch.float32)
    before = snapshot(client)
    try:
        meta = first_write(
            batch,
            sample_ids=ids,
            client=client,
            partition_id="train",
            pad_to_multiple=pad,
            overwrite=overwrite,
        )
    except DOCUMENTED as exc:
        event(f"refused: {type(exc).__name__}")
        assert_same(before, snapshot(client))
        client.close()
        assert _must_refuse(lens, dtype, layout, width, ids, pad, overwrite, existing), exc
        return
    event("accepted")
    assert not _must_refuse(lens, dtype, layout, width, ids, pad, overwrite, existing)
    assert meta.sequence_lengths == lens
    out = read_columns(client, meta, ["score", "input_lengths"], layout="jagged")
    torch.testing.assert_close(out["score"], batch["score"], rtol=0, atol=0, equal_nan=True)
    if layout != "absent":
        got = client.get_samples(
            partition_id="train", sample_ids=ids, select_fields=["input_ids"]
        )["input_ids"]
        assert got.offsets().diff().tolist() == lens
    client.close()


@st.composite
def write_back_cases(draw):
    ids = draw(st.lists(st.sampled_from(["a", "b", "c", "zz"]), min_size=0, max_size=4))
    lengths = draw(
        st.one_of(st.none(), st.lists(st.integers(-2, 10), min_size=len(ids), max_size=len(ids)))
    )
    field = draw(st.sampled_from(["advantages", "score"]))
    form = draw(st.sampled_from(["padded", "jagged", "dense1d"]))
    width = draw(st.integers(0, 11))
    value = draw(st.sampled_from([0.0, float("nan"), float("inf")]))
    dtype = draw(st.sampled_from([torch.float32] * 3 + [torch.float16, torch.int64, torch.bool]))
    return ids, lengths, field, form, width, value, dtype


@settings(max_examples=300, deadline=None)
@given(case=write_back_cases())
@example(case=(["a", "b", "c"], [1, 1, 1], "advantages", "padded", 9, 0.0, torch.float32))  # #8.2
@example(case=(["a", "b", "c"], [-1, 2, 3], "advantages", "padded", 9, 0.0, torch.float32))  # #8.1
@example(case=(["a", "zz"], [5, 9], "score", "dense1d", 0, 0.0, torch.float32))  # typo'd id
def test_fuzz_write_columns(case):
    """The partition already holds float32 ``score`` (so another dtype there is refused)."""
    ids, lengths, field, form, width, value, dtype = case
    stored = {"a": 5, "b": 9, "c": 3}
    client = LocalDataPlane()
    client.register_partition("train", [])
    batch = rollout(list(stored.values()), score=torch.zeros(3))
    first_write(batch, sample_ids=list(stored), client=client, partition_id="train")
    n = len(ids)
    if not dtype.is_floating_point:
        value = 1
    if form == "padded":
        tensor = torch.full((n, width), value, dtype=dtype)
    elif form == "jagged":
        rows = torch.tensor([stored.get(s, 1) for s in ids], dtype=torch.int64)
        tensor = nested_from_lengths(torch.full((int(rows.sum()),), value, dtype=dtype), rows)
    else:
        tensor = torch.full((n,), value, dtype=dtype)
    meta = KVBatchMeta("train", None, ids, sequence_lengths=lengths)
    before = snapshot(client)
    try:
        write_columns(client, meta, {field: tensor})
    except DOCUMENTED as exc:
        event(f"refused: {type(exc).__name__}")
        assert_same(before, snapshot(client))
        client.close()
        return
    event("accepted")
    # accepted: every id existed, the meta's lengths (if any) matched the store, and a
    # per-token column landed jagged at the stored lengths
    assert n == 0 or set(ids) <= set(stored) and len(set(ids)) == n
    if lengths is not None and field == "advantages":
        assert lengths == [stored[s] for s in ids]
    if n and field == "advantages" and form != "dense1d":
        got = client.get_samples(partition_id="train", sample_ids=ids, select_fields=[field])[field]
        assert got.offsets().diff().tolist() == [stored[s] for s in ids]
    client.close()


@settings(max_examples=150, deadline=None)
@given(
    # small targets, and ones no machine holds (a target in between would really allocate)
    target=st.one_of(
        st.integers(-3, 64), st.integers(2**45, 2**63 - 1), st.sampled_from(["8", 8.0, True, None])
    ),
    fields=st.lists(
        st.sampled_from(["input_ids", "score", "input_lengths", "missing"]),
        min_size=1,
        max_size=3,
        unique=True,
    ),
)
@example(target=2**40, fields=["input_ids"])
def test_fuzz_read_columns(target, fields):
    client = LocalDataPlane()
    client.register_partition("train", [])
    batch = rollout([5, 0, 3], score=torch.tensor([1.0, float("nan"), 2.0]))
    meta = first_write(batch, sample_ids=["a", "b", "c"], client=client, partition_id="train")
    if target is not None:
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target
    try:
        out = read_columns(client, meta, fields)
    except DOCUMENTED as exc:
        event(f"refused: {type(exc).__name__}")
        assert "missing" in fields or GLOBAL_FORWARD_PAD_SEQLEN in str(exc), exc
        client.close()
        return
    event("accepted")
    if "input_ids" in fields:
        assert out["input_ids"].shape == (3, max(5, target or 0))
    client.close()


# ---------------------------------------------------------------------------- issue #9 §4
class ContractClient:
    """A client written to the reference contract: ``fields`` is a TensorDict (it calls
    ``.select``) and ``put_samples`` takes no ``mode``."""

    def __init__(self) -> None:
        self.inner = LocalDataPlane()
        self.puts = 0

    def register_partition(self, partition_id, fields, num_samples=None, consumer_tasks=None,
                           grpo_group_size=None, enums=None):
        self.inner.register_partition(partition_id, fields, num_samples, consumer_tasks)

    def put_samples(self, sample_ids, partition_id, fields=None, tags=None):
        self.puts += 1
        fields = fields.select(*fields.keys())  # fails on a plain dict
        return self.inner.put_samples(
            partition_id=partition_id, sample_ids=sample_ids, fields=fields, tags=tags
        )

    def get_samples(self, sample_ids, partition_id, select_fields):
        return self.inner.get_samples(
            partition_id=partition_id, sample_ids=sample_ids, select_fields=select_fields
        )

    def list_sample_ids(self, partition_id):
        return self.inner.list_sample_ids(partition_id)


def test_column_io_works_with_a_reference_contract_client():
    client = ContractClient()
    client.register_partition("train", [])
    meta = first_write(rollout([5, 9, 3]), sample_ids=["a", "b", "c"], client=client, partition_id="train")
    write_columns(client, meta, {"advantages": torch.ones(3, 9)})
    out = read_columns(client, meta, ["advantages"], layout="jagged")
    assert [len(r) for r in out["advantages"].unbind()] == [5, 9, 3]
    puts = client.puts
    with pytest.raises(ValueError, match=r"already exist.*'a'"):  # insert, checked by listing
        first_write(rollout([2, 2, 2]), sample_ids=["a", "x", "y"], client=client, partition_id="train")
    with pytest.raises(KeyError, match="'typo'"):  # update, checked by listing
        write_columns(client, KVBatchMeta("train", None, ["a", "typo"]), {"score": torch.ones(2)})
    assert client.puts == puts and client.list_sample_ids("train") == ["a", "b", "c"]

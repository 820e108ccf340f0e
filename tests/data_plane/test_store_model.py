"""Stateful property test: random sequences of puts, overwrites, clears and reads against a
plain dict-of-rows model. It drives the column buffers through growth, garbage, compaction,
slot reuse, schema resets and dense-to-jagged promotion, and every read must match the model
byte for byte (NaN and inf included). Bad puts (every way a payload can be malformed) must raise
one documented exception naming the offending field or argument, and leave the model intact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")

IDS = [f"s{i}" for i in range(12)]
DTYPES = {"tok": torch.int64, "lp": torch.float32, "img": torch.bfloat16, "r": torch.float64,
          "var": torch.int32}
SPECIALS = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bit patterns, so NaN rows compare equal to themselves."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _bad_payload(kind: str, n: int) -> tuple[dict, str]:
    """A payload whose field 'bad' (after a valid field) is malformed; and the error's anchor."""
    good = {"r": torch.zeros(n, dtype=torch.float64)}
    if kind == "rows":
        return {**good, "bad": torch.zeros(n + 1)}, "'bad' has"
    if kind == "offsets":
        return {**good, "bad": torch.nested.nested_tensor_from_jagged(
            torch.arange(3), torch.tensor([0, *([5] * n)]))}, "'bad' has invalid jagged offsets"
    if kind == "decreasing":
        return {**good, "bad": torch.nested.nested_tensor_from_jagged(
            torch.arange(9), torch.tensor([0, *([-1] * n)]))}, "'bad' has invalid jagged offsets"
    if kind == "sparse":
        return {**good, "bad": torch.zeros(n, 2).to_sparse()}, "'bad'"
    if kind == "leaf":
        return {**good, "bad": [0] * n}, "'bad'"
    if kind == "meta":
        return {**good, "bad": torch.empty(n, device="meta")}, "'bad'"
    if kind == "scalar":
        return {**good, "bad": torch.tensor(1.0)}, "'bad'"
    if kind == "jagged_1d":
        return {**good, "tok": torch.zeros(n, dtype=torch.int64)}, "'tok' is jagged"
    if kind == "strided_nested":
        return {**good, "bad": torch.nested.nested_tensor([torch.zeros(2)] * n)}, "'bad'"
    raise AssertionError(kind)


def _jagged(lengths: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-1000, 1000, (sum(lengths),), generator=g).to(dtype)
    return nested_from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dp = LocalDataPlane()
        self.dp.register_partition("p", [], jagged_fields=["tok", "lp"])
        self.model: dict[str, dict[str, torch.Tensor]] = {}
        self.seed = 0

    @rule(
        ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=6, unique=True),
        fields=st.sets(st.sampled_from(sorted(DTYPES)), min_size=1),
        data=st.data(),
    )
    def put(self, ids, fields, data):
        payload = {}
        for name in sorted(fields):
            self.seed += 1
            g = torch.Generator().manual_seed(self.seed)
            if name == "img":  # dense, fixed row shape, a dtype numpy lacks
                payload[name] = torch.randn(len(ids), 2, 3, generator=g).to(torch.bfloat16)
            elif name == "r":  # dense per-row scalar, with NaN/inf mixed in
                value = torch.randn(len(ids), generator=g, dtype=torch.float64)
                value[:: 2] = SPECIALS[: value[::2].shape[0]].to(torch.float64) if len(ids) <= 8 else 0.0
                payload[name] = value
            elif name == "var":  # dense, but rows of another width turn it jagged
                width = data.draw(st.sampled_from([3, 5]))
                payload[name] = torch.randint(0, 9, (len(ids), width), generator=g, dtype=torch.int32)
            else:
                lengths = data.draw(st.lists(st.integers(0, 30), min_size=len(ids), max_size=len(ids)))
                payload[name] = _jagged(lengths, DTYPES[name], self.seed)
        self.dp.put_samples(ids, "p", payload)
        for name, col in payload.items():
            rows = col.unbind() if col.is_nested else list(col)
            for sid, row in zip(ids, rows):
                self.model.setdefault(sid, {})[name] = row.clone()

    @rule(
        ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=6, unique=True),
        kind=st.sampled_from(["rows", "offsets", "decreasing", "sparse", "leaf", "meta", "scalar",
                              "jagged_1d", "strided_nested", "dup_ids", "str_ids", "int_ids",
                              "tags", "update_unknown"]),
    )
    def bad_put(self, ids, kind):
        n = len(ids)
        args: dict = {"sample_ids": ids, "partition_id": "p"}
        if kind == "dup_ids":
            args.update(sample_ids=[*ids, ids[0]], fields={"r": torch.zeros(n + 1, dtype=torch.float64)})
            anchor = "duplicate sample_ids"
        elif kind == "str_ids":
            args.update(sample_ids="s1", fields={"r": torch.zeros(2, dtype=torch.float64)})
            anchor = "sample_ids must be a list"
        elif kind == "int_ids":
            args.update(sample_ids=[*ids[:-1], 7], fields={"r": torch.zeros(n, dtype=torch.float64)})
            anchor = "sample_ids must be strings"
        elif kind == "tags":
            args.update(fields={"r": torch.zeros(n, dtype=torch.float64)}, tags=[{}] * (n + 1))
            anchor = "tags"
        elif kind == "update_unknown":
            unknown = [s for s in IDS if s not in self.model]
            if not unknown:
                return
            args.update(sample_ids=[unknown[0]], fields={"r": torch.zeros(1, dtype=torch.float64)},
                        mode="update")
            anchor = repr(unknown[0])
        else:
            payload, anchor = _bad_payload(kind, n)
            args.update(fields=payload)
        with pytest.raises((TypeError, ValueError, KeyError)) as info:
            self.dp.put_samples(**args)
        assert anchor in str(info.value), (kind, str(info.value))
        self.everything_matches()

    def everything_matches(self):
        for field in DTYPES:
            holders = sorted(s for s, row in self.model.items() if field in row)
            if holders:
                got = self.dp.get_samples(holders, "p", [field])[field]
                rows = got.unbind() if got.is_nested else list(got)
                for sid, row in zip(holders, rows, strict=True):
                    assert torch.equal(_bits(row), _bits(self.model[sid][field])), (sid, field)

    @rule(ids=st.lists(st.sampled_from(IDS), max_size=6, unique=True))
    def clear(self, ids):
        self.dp.clear_samples(ids, "p")
        for sid in ids:
            self.model.pop(sid, None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def read(self, data):
        field = data.draw(st.sampled_from(sorted(DTYPES)))
        holders = sorted(s for s, row in self.model.items() if field in row)
        if not holders:
            return
        ids = data.draw(st.permutations(holders))
        got = self.dp.get_samples(ids, "p", [field])[field]
        rows = got.unbind() if got.is_nested else list(got)
        assert len(rows) == len(ids)
        for sid, row in zip(ids, rows):
            want = self.model[sid][field]
            assert row.dtype == want.dtype and torch.equal(_bits(row), _bits(want)), (sid, field)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def read_rows_lacking_a_field_fails_whole(self, data):
        field = data.draw(st.sampled_from(sorted(DTYPES)))
        lacking = sorted(s for s, row in self.model.items() if field not in row)
        if not lacking:
            return
        with pytest.raises(KeyError):
            self.dp.get_samples(lacking, "p", [field])

    @invariant()
    def ids_and_accounting_match(self):
        assert self.dp.list_sample_ids("p") == sorted(self.model)
        stats = self.dp.stats()
        assert stats["rows"] == len(self.model)
        expect = 0
        for row in self.model.values():
            for t in row.values():
                expect += t.numel() * t.element_size()
        assert stats["live_bytes"] == expect

    def teardown(self) -> None:
        self.dp.close()


TestStoreMatchesModel = StoreMachine.TestCase
TestStoreMatchesModel.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)

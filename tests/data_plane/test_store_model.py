"""Stateful property test: random sequences of puts, overwrites, clears and reads against a
plain dict-of-rows model. It drives the column buffers through growth, garbage, compaction,
slot reuse and schema resets, and every read must match the model byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths

IDS = [f"s{i}" for i in range(12)]
DTYPES = {"tok": torch.int64, "lp": torch.float32, "img": torch.bfloat16, "r": torch.float64}


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
            elif name == "r":  # dense per-row scalar
                payload[name] = torch.randn(len(ids), generator=g, dtype=torch.float64)
            else:
                lengths = data.draw(st.lists(st.integers(0, 30), min_size=len(ids), max_size=len(ids)))
                payload[name] = _jagged(lengths, DTYPES[name], self.seed)
        self.dp.put_samples(ids, "p", payload)
        for name, col in payload.items():
            rows = col.unbind() if col.is_nested else list(col)
            for sid, row in zip(ids, rows):
                self.model.setdefault(sid, {})[name] = row.clone()

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
            assert row.dtype == want.dtype and torch.equal(row, want), (sid, field)

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

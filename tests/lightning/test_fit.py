"""Tiny Policy/Value fits on CPU: the tensors each step receives, per packing mode and layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tq_plugin.data_plane import (
    ADVANTAGES,
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    RETURNS,
    TOKEN_MASK,
    KVBatchMeta,
    LocalDataPlane,
)
from tq_plugin.lightning import (
    CU_SEQLENS,
    MICROBATCH_INFO,
    POSITION_IDS,
    DataPlaneCallback,
    MetaDataModule,
)
from tq_plugin.lightning.demo import (
    POLICY_FIELDS,
    VALUE_FIELDS,
    DemoPolicy,
    DemoValue,
    SyntheticRollouts,
    partition_spec,
)
from tq_plugin.lightning.module import MICRO_BATCH_LENGTH

ROWS, STEPS, BUDGET, ROUND = 6, 2, 40, 8


def rows_of(source: SyntheticRollouts, step: int) -> dict[str, dict[str, list]]:
    """The step's rows as plain lists, keyed by sample id: the hand-built expectation's input."""
    batch = source.batch(step)
    out: dict[str, dict[str, list]] = {}
    for i, sid in enumerate(source.sample_ids(step)):
        out[sid] = {name: batch[name][i].tolist() for name in (INPUT_IDS, ADVANTAGES, RETURNS, TOKEN_MASK)}
    return out


def close(got: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype))


def padded(row: list, width: int) -> list:
    return row + [0] * (width - len(row))


CASES = [
    ("none", "padded", 1),
    ("dynamic_batching", "padded", ROUND),
    ("sequence_packing", "packed", 1),
    ("sequence_packing", "padded", 1),
]


@pytest.mark.parametrize("role", ["policy", "value"])
@pytest.mark.parametrize("mode, layout, rounding", CASES)
def test_steps_receive_the_hand_built_tensors(
    make_trainer: Any, role: str, mode: str, layout: str, rounding: int
) -> None:
    cls, fields, column = (DemoPolicy, POLICY_FIELDS, ADVANTAGES) if role == "policy" else (
        DemoValue, VALUE_FIELDS, RETURNS)
    model = cls(packing=mode, layout=layout, record=True, train_mb_tokens=BUDGET,
                sequence_length_round=ROUND, micro_batch_size=2)
    source = SyntheticRollouts(rows=ROWS, min_len=3, max_len=12, seed=7)
    cb = DataPlaneCallback(role=role, partitions=[partition_spec()])
    make_trainer(callbacks=[cb]).fit(
        model, datamodule=MetaDataModule(source, num_steps=STEPS, fields=fields, role=role))

    seen: dict[int, list[str]] = {s: [] for s in range(STEPS)}
    for meta, batch in model.received:
        step = meta.extra_info[MICROBATCH_INFO]["step"]
        rows = rows_of(source, step)
        seen[step] += meta.sample_ids
        mine = [rows[s] for s in meta.sample_ids]
        if layout == "packed":
            lengths = [len(r[INPUT_IDS]) for r in mine]
            assert batch[INPUT_IDS].tolist() == [[t for r in mine for t in r[INPUT_IDS]]]
            close(batch[column], [[t for r in mine for t in r[column]]])
            assert batch[CU_SEQLENS].tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
            assert batch[POSITION_IDS].tolist() == [[j for n in lengths for j in range(n)]]
            assert sum(lengths) <= BUDGET
        else:
            longest = max(len(r[INPUT_IDS]) for r in rows.values())
            width = -(-longest // rounding) * rounding
            assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == width
            assert batch[INPUT_IDS].tolist() == [padded(r[INPUT_IDS], width) for r in mine]
            close(batch[column], [padded(r[column], width) for r in mine])
            assert batch[TOKEN_MASK].tolist() == [padded(r[TOKEN_MASK], width) for r in mine]
            if mode == "dynamic_batching":
                planned = meta.extra_info[MICRO_BATCH_LENGTH]  # the budget holds at planned width
                assert planned % ROUND == 0 and planned * meta.size <= BUDGET
            if mode == "none":
                assert meta.size == 2
    for step in range(STEPS):
        assert sorted(seen[step]) == sorted(source.sample_ids(step))
    assert cb.resume_cursor() == (STEPS, 0)


class StepOnce:
    """Writes each step once and hands every consumer the same (caller's) meta."""

    def __init__(self, source: SyntheticRollouts) -> None:
        self.source = source
        self.metas: dict[int, KVBatchMeta] = {}

    def __call__(self, step: int, client: Any) -> KVBatchMeta:
        if step not in self.metas:
            self.metas[step] = self.source(step, client)
        return self.metas[step]


def test_ppo_epochs_policy_and_value_keep_their_own_pad_targets(make_trainer: Any) -> None:
    shared = LocalDataPlane()
    source = StepOnce(SyntheticRollouts(rows=ROWS, min_len=3, max_len=13, seed=3))
    policy = DemoPolicy(packing="dynamic_batching", sequence_length_round=16,
                        train_mb_tokens=64, record=True)
    value = DemoValue(record=True, micro_batch_size=3)
    make_trainer(callbacks=[DataPlaneCallback(shared, role="policy", partitions=[partition_spec()],
                                              clear_rows=False)]).fit(
        policy, datamodule=MetaDataModule(source, num_steps=1, fields=POLICY_FIELDS,
                                          role="policy", epochs_per_step=2))
    caller = source.metas[0]
    policy.read_from_dataplane(caller, select_fields=[ADVANTAGES])  # a driver read stamps it
    assert caller.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 16
    make_trainer(callbacks=[DataPlaneCallback(shared, role="value")]).fit(
        value, datamodule=MetaDataModule(source, num_steps=1, fields=VALUE_FIELDS,
                                         role="value", epochs_per_step=2))
    longest = max(caller.sequence_lengths)
    assert longest < 16
    epochs = lambda model: {m.extra_info[MICROBATCH_INFO]["epoch"] for m, _ in model.received}
    assert epochs(policy) == epochs(value) == {0, 1}
    assert {b[INPUT_IDS].shape[1] for _, b in policy.received} == {16}
    assert {b[INPUT_IDS].shape[1] for _, b in value.received} == {longest}
    assert caller.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 16  # untouched by the value model
    assert shared.list_sample_ids("train") == []  # the last consumer cleared the step

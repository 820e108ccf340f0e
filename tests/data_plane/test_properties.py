"""Property tests: random jagged batches survive put/get/subset/concat byte-exact, and padded
reads equal manual padding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_plugin.data_plane import (
    LocalDataPlane,
    first_write,
    nested_from_lengths,
    read_columns,
    stamp_global_forward_pad_seqlen,
)

DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.uint8, torch.bool]


def _column(lengths: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 255, (sum(lengths),), generator=g)
    if dtype == torch.bool:
        values = values % 2 == 0
    else:
        values = values.to(dtype)
    return nested_from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=24),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    order=st.randoms(use_true_random=False),
)
def test_random_jagged_batches_round_trip_byte_exact(lengths, dtype, seed, order):
    dp = LocalDataPlane()
    dp.register_partition("train", [])
    n = len(lengths)
    ids = [f"r{i}" for i in range(n)]
    col = _column(lengths, dtype, seed)
    meta = first_write(
        {"x": col, "input_lengths": torch.tensor(lengths), "sample_mask": torch.ones(n)},
        sample_ids=ids, client=dp, partition_id="train",
    )
    rows = col.unbind()
    perm = list(range(n))
    order.shuffle(perm)
    half = n // 2
    parts = [meta.subset(perm[:half]), meta.subset(perm[half:])]
    joined = parts[0].concat(parts[1])
    got = dp.get_samples(
        partition_id="train", sample_ids=joined.sample_ids, select_fields=["x"]
    )["x"].unbind()
    for i, row in zip(perm, got):
        assert row.dtype == dtype and torch.equal(row, rows[i])
    # a partial clear keeps the survivors byte-exact through compaction
    dp.clear_samples(partition_id="train", sample_ids=[ids[i] for i in perm[:half]])
    survivors = dp.get_samples(
        partition_id="train", sample_ids=[ids[i] for i in perm[half:]], select_fields=["x"]
    )["x"].unbind()
    for i, row in zip(perm[half:], survivors):
        assert torch.equal(row, rows[i])


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=16),
    round_to=st.sampled_from([1, 8, 64]),
    pad_value=st.integers(-5, 5),
    seed=st.integers(0, 2**16),
)
def test_padded_reads_equal_manual_padding(lengths, round_to, pad_value, seed):
    dp = LocalDataPlane()
    dp.register_partition("train", [])
    n = len(lengths)
    col = _column(lengths, torch.int64, seed)
    meta = first_write(
        {"input_ids": col, "input_lengths": torch.tensor(lengths), "sample_mask": torch.ones(n)},
        sample_ids=[f"r{i}" for i in range(n)], client=dp, partition_id="train",
    )
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=round_to)
    target = meta.extra_info["global_forward_pad_seqlen"]
    assert target % round_to == 0 and target >= max(lengths)
    out = read_columns(dp, meta.slice(0, max(1, n // 2)), ["input_ids"], pad_value_dict={"input_ids": pad_value})
    padded = out["input_ids"]
    assert padded.shape[1] == target
    for i, row in enumerate(col.unbind()[: padded.shape[0]]):
        expect = torch.full((target,), pad_value, dtype=torch.int64)
        expect[: row.shape[0]] = row
        assert torch.equal(padded[i], expect)

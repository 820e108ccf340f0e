"""Padded and packed microbatch layouts against hand-built tensors."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tq_plugin.data_plane import (
    ADVANTAGES,
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    INPUT_LENGTHS,
    SAMPLE_MASK,
    KVBatchMeta,
    LocalDataPlane,
    first_write,
    nested_from_lengths,
)
from tq_plugin.lightning import CU_SEQLENS, POSITION_IDS, SEGMENT_IDS, MetaBatchMixin, PackedIndex
from tq_plugin.lightning.layout import packed_batch, padded_batch
from tq_plugin.lightning.module import PACK_PAD_MULTIPLE

LENGTHS = [3, 5, 2]
# Row i holds tokens 10*i + 1 .. 10*i + len_i, so every token names its row and position.
ROWS = [[10 * i + j + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]


def wire() -> TensorDict:
    lens = torch.tensor(LENGTHS)
    flat = torch.tensor([t for row in ROWS for t in row])
    return TensorDict(
        {INPUT_IDS: nested_from_lengths(flat, lens),
         ADVANTAGES: nested_from_lengths(flat.float() / 10, lens),
         SAMPLE_MASK: torch.tensor([1.0, 0.0, 1.0])},
        batch_size=[3],
    )


def test_padded_rows_are_padded_to_the_target() -> None:
    td = padded_batch(wire(), pad_to=8, pad_values={INPUT_IDS: -1})
    assert td[INPUT_IDS].tolist() == [
        [1, 2, 3, -1, -1, -1, -1, -1],
        [11, 12, 13, 14, 15, -1, -1, -1],
        [21, 22, -1, -1, -1, -1, -1, -1],
    ]
    assert td[ADVANTAGES].shape == (3, 8) and td[ADVANTAGES][1, 4] == pytest.approx(1.5)
    assert td[SAMPLE_MASK].tolist() == [1.0, 0.0, 1.0]


def test_packed_row_concatenates_sequences_with_boundaries() -> None:
    td = packed_batch(wire(), PackedIndex(torch.tensor(LENGTHS)))
    assert td[INPUT_IDS].tolist() == [[1, 2, 3, 11, 12, 13, 14, 15, 21, 22]]
    assert td[CU_SEQLENS].tolist() == [0, 3, 8, 10] and td[CU_SEQLENS].dtype == torch.int32
    assert td[POSITION_IDS].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert td[SEGMENT_IDS].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 2, 2]]
    assert td[SAMPLE_MASK].tolist() == [1.0, 0.0, 1.0]


def test_packed_slots_pad_each_sequence_to_the_multiple() -> None:
    index = PackedIndex(torch.tensor(LENGTHS), pad_multiple=4)
    td = packed_batch(wire(), index, pad_values={INPUT_IDS: 0})
    assert td[INPUT_IDS].tolist() == [[1, 2, 3, 0, 11, 12, 13, 14, 15, 0, 0, 0, 21, 22, 0, 0]]
    assert td[CU_SEQLENS].tolist() == [0, 4, 12, 16]
    assert td[POSITION_IDS].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    rows = index.unpack(td[INPUT_IDS])
    assert [r.tolist() for r in rows.unbind()] == ROWS


def test_unpack_rejects_a_wrong_token_count() -> None:
    with pytest.raises(ValueError, match="10 tokens"):
        PackedIndex(torch.tensor(LENGTHS)).unpack(torch.zeros(1, 9))


def test_dense_per_token_columns_are_packed_too() -> None:
    td = wire()
    td[ADVANTAGES] = torch.tensor([[1.0, 1, 1, 9, 9], [2, 2, 2, 2, 2], [3, 3, 9, 9, 9]])
    packed = packed_batch(td, PackedIndex(torch.tensor(LENGTHS)))
    assert packed[ADVANTAGES].tolist() == [[1.0, 1, 1, 2, 2, 2, 2, 2, 3, 3]]


class Host(MetaBatchMixin):
    pass


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_materialize_reads_the_meta_and_records_token_counts(layout: str) -> None:
    client = LocalDataPlane()
    client.register_partition("train", fields=[])
    src = wire()
    meta = first_write(
        {INPUT_IDS: src[INPUT_IDS], ADVANTAGES: src[ADVANTAGES], SAMPLE_MASK: src[SAMPLE_MASK],
         INPUT_LENGTHS: torch.tensor(LENGTHS)},
        sample_ids=["a", "b", "c"], client=client, partition_id="train",
    )
    mb = meta.subset([2, 0])
    mb.fields = [INPUT_IDS, SAMPLE_MASK]
    mb.extra_info = {GLOBAL_FORWARD_PAD_SEQLEN: 6, PACK_PAD_MULTIPLE: 1}
    host = Host()
    host.dp_client = client
    host.dp_layout = layout
    td = host.dp_materialize(mb)
    assert host.dp_meta is mb
    if layout == "padded":
        assert td[INPUT_IDS].tolist() == [[21, 22, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0]]
        assert host.dp_batch_stats["padded_tokens"] == 12
        assert host.dp_rows(td[INPUT_IDS]) is td[INPUT_IDS]
    else:
        assert td[INPUT_IDS].tolist() == [[21, 22, 1, 2, 3]]
        assert host.dp_batch_stats["padded_tokens"] == 5
        assert [r.tolist() for r in host.dp_rows(td[INPUT_IDS]).unbind()] == [[21, 22], [1, 2, 3]]
    assert host.dp_batch_stats["real_tokens"] == 5
    assert td[SAMPLE_MASK].tolist() == [1.0, 1.0]


def test_materialize_without_a_client_says_what_to_add() -> None:
    with pytest.raises(RuntimeError, match="DataPlaneCallback"):
        Host().dp_materialize(KVBatchMeta("train", None, ["a"], fields=[INPUT_IDS], sequence_lengths=[1]))

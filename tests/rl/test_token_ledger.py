"""The trainer's per-token staleness check (``recipe.inflight_updates``): a ledger over the bound
masks its stale tokens (a row left empty is masked whole), counted; a ledger that contradicts
itself fails the step naming the row. In-process, through the step source's own check over a
store."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tq_plugin.data_plane import (
    INPUT_LENGTHS,
    SAMPLE_MASK,
    TOKEN_MASK,
    LocalDataPlane,
    first_write,
    read_columns,
    stamp_global_forward_pad_seqlen,
    write_columns,
)
from tq_plugin.data_plane.jagged import nested_from_lengths
from tq_plugin.rl.topology.disaggregated import Disaggregated
from tq_plugin.rl.topology.staleness import LedgerError, check_token_ledger
from tq_plugin.staging import TOKEN_VERSIONS_FIELD

IDS = ["s0-p0-g0", "s0-p0-g1", "s0-p1-g0"]
# Rows: 2 prompt tokens then generated ones (-1: prompt; versions along the generation).
ROWS = [[-1, -1, 3, 3, 4, 5], [-1, -1, 2, 2, 3], [-1, -1, 2, 2]]


def _tensors(rows):
    width = max(len(r) for r in rows)
    versions = torch.full((len(rows), width), -1, dtype=torch.int64)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        versions[i, : len(r)] = torch.tensor(r)
        mask[i, 2: len(r)] = 1.0
    return versions, mask, torch.ones(len(rows))


def test_tokens_over_the_bound_leave_the_loss_and_an_emptied_row_is_masked() -> None:
    versions, mask, sample = _tensors(ROWS)
    check = check_token_ledger(versions, mask, sample, trainer_version=5, max_staleness=2,
                               sample_ids=IDS)
    # staleness: row 0 [2, 2, 1, 0], row 1 [3, 3, 2], row 2 [3, 3]
    assert check.token_mask[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert check.token_mask[1].tolist() == [0, 0, 0, 0, 1, 0]
    assert check.token_mask[2].tolist() == [0, 0, 0, 0, 0, 0]
    assert check.sample_mask.tolist() == [1, 1, 0]
    assert check.figures == {"token_staleness_max": 3, "token_staleness_mean": round(19 / 9, 4),
                             "multi_version_fraction": round(2 / 3, 4),
                             "tokens_masked_stale": 4, "rows_masked_stale": 1}


def test_within_the_bound_nothing_changes() -> None:
    versions, mask, sample = _tensors(ROWS)
    check = check_token_ledger(versions, mask, sample, trainer_version=5, max_staleness=3,
                               sample_ids=IDS)
    assert torch.equal(check.token_mask, mask) and torch.equal(check.sample_mask, sample)
    assert check.figures["tokens_masked_stale"] == check.figures["rows_masked_stale"] == 0


@pytest.mark.parametrize(("rows", "rule", "row"), [
    ([[-1, -1, 3, 3, 6], *ROWS[1:]], "newer than the trainer's \\(5\\)", IDS[0]),
    ([ROWS[0], [-1, -1, 3, 2, 3], ROWS[2]], "versions decrease along the sequence", IDS[1]),
    ([*ROWS[:2], [-1, -1, 2, -1]], "a generated token has no version", IDS[2]),
])
def test_a_contradictory_ledger_fails_naming_the_row(rows, rule, row) -> None:
    versions, mask, sample = _tensors(rows)
    with pytest.raises(LedgerError, match=rf"{rule}, in row '{row}'"):
        check_token_ledger(versions, mask, sample, trainer_version=5, max_staleness=1,
                           sample_ids=IDS)


def test_a_placeholder_row_is_not_read() -> None:
    versions, mask, sample = _tensors([*ROWS[:2], [-1, -1, 9, 1]])
    sample[2] = 0.0  # a placeholder: its tokens are no one's
    check = check_token_ledger(versions, mask, sample, trainer_version=5, max_staleness=3,
                               sample_ids=IDS)
    assert check.figures["token_staleness_max"] == 3 and check.sample_mask[2] == 0


class _Module:
    """What the step source's check uses of the RL module: its data-plane reads and writes."""

    def __init__(self, client) -> None:
        self.client = client

    def read_from_dataplane(self, meta, *, select_fields, pad_value_dict=None):
        stamp_global_forward_pad_seqlen(meta)
        return read_columns(self.client, meta, list(select_fields), pad_value_dict=pad_value_dict)

    def write_to_dataplane(self, meta, fields):
        write_columns(self.client, meta, fields)


def _step(rows):
    client = LocalDataPlane()
    client.register_partition(partition_id="train", fields=[])  # as the recipe's (open)
    versions, mask, sample = _tensors(rows)
    lengths = torch.tensor([len(r) for r in rows])
    keep = torch.arange(versions.shape[1])[None, :] < lengths[:, None]
    meta = first_write({TOKEN_VERSIONS_FIELD: nested_from_lengths(versions[keep], lengths),
                        TOKEN_MASK: nested_from_lengths(mask[keep], lengths),
                        SAMPLE_MASK: sample, INPUT_LENGTHS: lengths}, sample_ids=IDS, client=client, partition_id="train")
    source = Disaggregated.__new__(Disaggregated)
    source.module, source.rc = _Module(client), types.SimpleNamespace(max_staleness=2)
    return source, client, dataclasses.replace(meta, extra_info={})


def test_the_step_source_masks_a_bound_breaking_ledger_in_the_store() -> None:
    source, client, meta = _step(ROWS)
    figures = source.check_ledger(meta, 5, {"staleness_max": 3, "staleness_mean": 3.0})
    assert figures["tokens_masked_stale"] == 4 and figures["rows_masked_stale"] == 1
    td = read_columns(client, meta, [TOKEN_MASK, SAMPLE_MASK])
    assert td[SAMPLE_MASK].tolist() == [1, 1, 0]
    assert td[TOKEN_MASK][1].tolist()[:5] == [0, 0, 0, 0, 1]


def test_the_step_source_fails_the_step_on_a_contradictory_ledger() -> None:
    source, _, meta = _step([ROWS[0], [-1, -1, 3, 2, 3], ROWS[2]])
    with pytest.raises(LedgerError, match=f"in row '{IDS[1]}'"):
        source.check_ledger(meta, 5, {"staleness_max": 3, "staleness_mean": 3.0})


def test_the_fresh_tokens_gap_reads_only_the_trainers_own_version() -> None:
    """``ledger_gap``: |generation - prev| over the live action tokens generated by the
    trainer's version (row 0's last token, row 1's last: version 5 at trainer version 5); the
    stale tokens' larger gaps, prompt positions and a placeholder row are not read."""
    from tq_plugin.data_plane import GENERATION_LOGPROBS, PREV_LOGPROBS
    from tq_plugin.rl.training.step_record import ledger_gap

    versions, mask, sample = _tensors([[-1, -1, 3, 4, 5], [-1, -1, 4, 5, 5], [-1, -1, 5, 5, 5]])
    mask[1, 4] = 0.0  # row 1's last token is not an action token (a mask-0 position)
    sample[2] = 0.0  # a placeholder
    prev = torch.zeros(3, 5)
    gen = torch.tensor([[9.0, 9.0, 1.0, 1.0, -0.25],
                        [9.0, 9.0, 1.0, 0.5, 7.0],
                        [3.0, 3.0, 3.0, 3.0, 3.0]])
    td = {TOKEN_MASK: mask, SAMPLE_MASK: sample, GENERATION_LOGPROBS: gen, PREV_LOGPROBS: prev}
    assert ledger_gap(td, versions, 5) == {"fresh_tokens": 2, "fresh_logprob_gap": 0.5,
                                           "fresh_logprob_gap_mean": 0.375}
    assert ledger_gap(td, versions, 6) == {"fresh_tokens": 0, "fresh_logprob_gap": 0.0,
                                           "fresh_logprob_gap_mean": 0.0}

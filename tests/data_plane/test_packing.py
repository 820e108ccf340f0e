"""Packing planners: sequence packing (first-fit-decreasing) and dynamic batching."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_plugin.data_plane.column_io import round_up
from tq_plugin.data_plane.microbatches import (
    balanced_equal_count,
    micro_batch_lengths,
    pack_into_count,
    padded_token_fraction,
    plan_microbatches,
    split_to_count,
)
from tq_plugin.data_plane.packing import (
    plan_dynamic_batches,
    plan_sequence_packing,
)
from tq_plugin.data_plane.packing_args import (
    as_lengths,
    validate_dynamic_batching_args,
    validate_sequence_packing_args,
)


def _flat(mbs):
    return sorted(i for mb in mbs for i in mb)


# ---------------------------------------------------------------------------- sequence packing
def test_ffd_packs_known_example():
    # longest first: 7 opens bin0, 6 opens bin1, 5 bin2, 3 -> bin0 (7+3), 2 -> bin1 (6+2), 2 -> bin1
    bins = plan_sequence_packing([2, 7, 3, 6, 5, 2], max_tokens_per_microbatch=10)
    assert bins == [[1, 2], [3, 0, 5], [4]]


def test_ffd_is_first_fit_not_best_fit():
    # 6 opens bin0 (room 4), 5 opens bin1 (room 5), 4 -> bin0 (first fit), 4 -> bin1
    assert plan_sequence_packing([6, 5, 4, 4], max_tokens_per_microbatch=10) == [[0, 2], [1, 3]]


def test_pad_multiple_is_the_cost():
    # rounded to 8: 5->8, 5->8, 3->8: two per bin of 16
    bins = plan_sequence_packing(
        [5, 5, 3], max_tokens_per_microbatch=16, sequence_length_pad_multiple=8
    )
    assert bins == [[0, 1], [2]]
    assert micro_batch_lengths([5, 5, 3], bins, mode="packed", multiple=8) == [16, 8]


def test_sequence_longer_than_capacity_raises_never_truncates():
    with pytest.raises(ValueError, match="row 1 has 11 tokens.*never truncated"):
        plan_sequence_packing([3, 11], max_tokens_per_microbatch=10)
    with pytest.raises(ValueError, match="after rounding"):
        plan_sequence_packing([9], max_tokens_per_microbatch=10, sequence_length_pad_multiple=8)


def test_empty_and_zero_lengths():
    assert plan_sequence_packing([], max_tokens_per_microbatch=4) == []
    assert plan_dynamic_batches([], max_tokens_per_microbatch=4) == []
    assert _flat(plan_sequence_packing([0, 0, 4], max_tokens_per_microbatch=4)) == [0, 1, 2]
    assert _flat(plan_dynamic_batches([0, 0], max_tokens_per_microbatch=4)) == [0, 1]


def test_ffd_waste_on_standard_distribution_is_small():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 2001, (1024,), generator=g)
    bins = plan_sequence_packing(lengths, max_tokens_per_microbatch=4096)
    assert padded_token_fraction(lengths, bins, mode="packed", pad_to=4096) <= 0.02


@st.composite
def planner_inputs(draw, *, headroom: int):
    """``(lengths, multiple, rounded lengths, budget)`` with every row fitting the budget."""
    lengths = draw(st.lists(st.integers(0, 300), max_size=80))
    multiple = draw(st.sampled_from([1, 8, 64]))
    rounded = [round_up(x, multiple) for x in lengths]
    budget = max(rounded, default=1) + draw(st.integers(0, headroom)) or 1
    return lengths, multiple, rounded, budget


@settings(max_examples=60, deadline=None)
@given(case=planner_inputs(headroom=400))
def test_ffd_properties(case):
    lengths, multiple, costs, cap = case
    bins = plan_sequence_packing(
        lengths, max_tokens_per_microbatch=cap, sequence_length_pad_multiple=multiple
    )
    assert _flat(bins) == list(range(len(lengths)))
    assert all(bins)
    loads = [sum(costs[i] for i in b) for b in bins]
    assert all(load <= cap for load in loads)
    # replay in placement order (length descending, ties by index): each row went to the first
    # bin that had room at that moment
    bin_of = {row: b for b, rows in enumerate(bins) for row in rows}
    room = [cap] * len(bins)
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        b = bin_of[row]
        assert all(room[e] < costs[row] for e in range(b))
        room[b] -= costs[row]
    assert micro_batch_lengths(lengths, bins, mode="packed", multiple=multiple) == loads


# ---------------------------------------------------------------------------- modified FFD
MFFD = "modified_first_fit_decreasing"


def test_mffd_fills_a_long_rows_gap_with_a_pair_of_short_rows():
    """Plain FFD gives the 60-row's gap of 40 to the 30-row (next by length) and leaves 10 idle;
    MFFD's small-pair step puts 18 + 20 there (38 of 40), a different, tighter plan."""
    lengths = [60, 30, 20, 18]
    assert plan_sequence_packing(lengths, max_tokens_per_microbatch=100) == [[0, 1], [2, 3]]
    mffd = plan_sequence_packing(lengths, max_tokens_per_microbatch=100, algorithm=MFFD)
    assert mffd == [[0, 3, 2], [1]]


def test_mffd_can_use_fewer_bins_than_ffd():
    lengths = [24, 90, 16, 85, 29, 18, 11, 35, 58, 61, 45, 84, 2, 19]
    ffd = plan_sequence_packing(lengths, max_tokens_per_microbatch=100)
    mffd = plan_sequence_packing(lengths, max_tokens_per_microbatch=100, algorithm=MFFD)
    assert len(ffd) == 7 and len(mffd) == 6


def test_mffd_gives_a_long_row_the_longest_medium_row_that_fits():
    # 55 leaves 45: of the medium rows (34..50) 45 is the longest that fits, not 50 nor 34
    lengths = [55, 50, 45, 34]
    mffd = plan_sequence_packing(lengths, max_tokens_per_microbatch=100, algorithm=MFFD)
    assert mffd[0] == [0, 2]


def test_plan_microbatches_runs_the_named_algorithm():
    lengths = [60, 30, 20, 18]
    args = {"max_tokens_per_microbatch": 100}
    mbs, _ = plan_microbatches(lengths, sequence_packing_args={**args, "algorithm": MFFD})
    assert mbs == [[0, 3, 2], [1]]
    mbs, _ = plan_microbatches(lengths, sequence_packing_args=args)
    assert mbs == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="not supported"):
        plan_sequence_packing(lengths, max_tokens_per_microbatch=100, algorithm="best_fit")


@settings(max_examples=150, deadline=None)
@given(case=planner_inputs(headroom=400))
def test_mffd_properties(case):
    """Every row packed exactly once, no empty bin, every bin within the budget, and the long
    rows (over half the budget) each lead their own bin, in length order."""
    lengths, multiple, costs, cap = case
    bins = plan_sequence_packing(
        lengths, max_tokens_per_microbatch=cap, sequence_length_pad_multiple=multiple,
        algorithm=MFFD,
    )
    assert sorted(_flat(bins)) == list(range(len(lengths)))
    assert all(bins)
    assert all(sum(costs[i] for i in b) <= cap for b in bins)
    large = sorted((r for r in range(len(lengths)) if 2 * costs[r] > cap), key=lambda r: (-lengths[r], r))
    assert [b[0] for b in bins[: len(large)]] == large
    assert all(2 * costs[i] <= cap for b in bins for i in b[1:])


# ---------------------------------------------------------------------------- dynamic batching
def test_dynamic_batches_known_example():
    # sorted desc: 9(r1),8(r3),4(r0),4(r4),2(r2); rounded to 4: 12,8,4,4,4; budget 16
    mbs = plan_dynamic_batches(
        [4, 9, 2, 8, 4], max_tokens_per_microbatch=16, sequence_length_round=4
    )
    assert mbs == [[1], [3, 0], [4, 2]]
    assert micro_batch_lengths([4, 9, 2, 8, 4], mbs, mode="padded", multiple=4) == [12, 8, 4]


def test_dynamic_batch_row_over_budget_raises():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=64"):
        plan_dynamic_batches([10, 65], max_tokens_per_microbatch=64)
    with pytest.raises(ValueError, match="sequence_length_round=64"):
        plan_dynamic_batches([65], max_tokens_per_microbatch=100, sequence_length_round=64)


@settings(max_examples=60, deadline=None)
@given(case=planner_inputs(headroom=2000))
def test_dynamic_batches_properties(case):
    lengths, multiple, rounded, budget = case
    mbs = plan_dynamic_batches(
        lengths, max_tokens_per_microbatch=budget, sequence_length_round=multiple
    )
    assert _flat(mbs) == list(range(len(lengths)))
    mbl = micro_batch_lengths(lengths, mbs, mode="padded", multiple=multiple)
    for mb, length in zip(mbs, mbl):
        assert mb and len(mb) * length <= budget
        assert length == max(rounded[i] for i in mb)
    # greedy: the next microbatch's first row would not have fit
    for mb in mbs[:-1]:
        assert (len(mb) + 1) * max(rounded[i] for i in mb) > budget


# ---------------------------------------------------------------------------- helpers
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=60),
    extra=st.integers(0, 20),
    packed=st.booleans(),
)
def test_split_to_count_keeps_rows_and_budget(lengths, extra, packed):
    budget = 400
    if packed:
        mbs = plan_sequence_packing(lengths, max_tokens_per_microbatch=budget)
    else:
        mbs = plan_dynamic_batches(lengths, max_tokens_per_microbatch=budget)
    count = min(len(lengths), len(mbs) + extra)
    mode = "packed" if packed else "padded"
    out = split_to_count(lengths, mbs, count=count, mode=mode)
    assert len(out) == count and all(out)
    assert _flat(out) == list(range(len(lengths)))
    for mb, length in zip(out, micro_batch_lengths(lengths, out, mode=mode)):
        assert (length if packed else length * len(mb)) <= budget


def test_pack_into_count_balances_or_declines():
    lengths = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0]
    bins = pack_into_count(lengths, count=3, max_tokens_per_microbatch=16)
    assert _flat(bins) == list(range(len(lengths))) and all(bins)
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert loads == [14, 15, 16]  # greedy LPT: within one row of each other
    assert pack_into_count(lengths, count=3, max_tokens_per_microbatch=14) is None  # 16 > 14
    assert pack_into_count([5, 5], count=3, max_tokens_per_microbatch=10) is None  # too few rows
    zeros = pack_into_count([0, 0, 0, 0], count=4, max_tokens_per_microbatch=1)
    assert sorted(map(len, zeros)) == [1, 1, 1, 1]  # zero-length rows still spread out


def test_split_to_count_errors():
    with pytest.raises(ValueError, match="cannot fill count=3"):
        split_to_count([5, 5], [[0, 1]], count=3, mode="packed")
    with pytest.raises(ValueError, match="already exceed count=1"):
        split_to_count([5, 5], [[0], [1]], count=1, mode="packed")


def test_padded_token_fraction_values():
    lengths = [2, 4, 6, 8]
    assert padded_token_fraction(lengths, [[0, 1, 2, 3]], mode="packed") == 0.0
    assert padded_token_fraction(lengths, [[0, 1, 2, 3]], mode="packed", pad_to=40) == 0.5
    # rectangle 4 x 8 = 32, real 20
    assert padded_token_fraction(lengths, [[0, 1, 2, 3]], mode="padded") == pytest.approx(12 / 32)
    # two rectangles: 2 x 4 + 2 x 8 = 24
    assert padded_token_fraction(lengths, [[0, 1], [2, 3]], mode="padded") == pytest.approx(4 / 24)
    assert padded_token_fraction(lengths, [[0, 1, 2, 3]], mode="padded", pad_to=10) == 0.5
    assert padded_token_fraction([], [], mode="packed") == 0.0
    with pytest.raises(ValueError, match="pad_to=5"):
        padded_token_fraction(lengths, [[3]], mode="padded", pad_to=5)


def test_plan_microbatches_count_multiple_and_order():
    lengths = [100, 90, 80, 30, 20, 10]
    args = {"max_tokens_per_microbatch": 1000, "sequence_length_pad_multiple": 1}
    mbs, mbl = plan_microbatches(lengths, sequence_packing_args=args, count_multiple=4)
    assert len(mbs) == 4 and _flat(mbs) == list(range(6))
    assert sum(mbl) == sum(lengths)
    _, mbl2 = plan_microbatches(
        lengths,
        sequence_packing_args={**args, "microbatch_order": "largest_first"},
        count_multiple=4,
    )
    assert mbl2 == sorted(mbl, reverse=True)
    dmbs, dmbl = plan_microbatches(
        lengths, dynamic_batching_args={"max_tokens_per_microbatch": 200}, count_multiple=1
    )
    # 100 leads 200 // 100 = 2 rows, 80 leads 2 rows, 20 leads the rest
    assert dmbs == [[0, 1], [2, 3], [4, 5]] and dmbl == [100, 80, 20]
    with pytest.raises(ValueError, match="exactly one"):
        plan_microbatches(lengths)


def test_balanced_equal_count():
    groups = balanced_equal_count([10, 1, 9, 2, 8, 3], 2)
    assert sorted(len(g) for g in groups) == [3, 3]
    assert sorted(i for g in groups for i in g) == list(range(6))
    loads = [sum([10, 1, 9, 2, 8, 3][i] for i in g) for g in groups]
    assert sorted(loads) == [15, 18]  # {10, 3, 2} / {9, 8, 1}: no 3-3 split is closer
    with pytest.raises(ValueError, match="equal groups"):
        balanced_equal_count([1, 2, 3], 2)


# ---------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({}, r"\['max_tokens_per_microbatch'\] is required"),
        ({"max_tokens_per_microbatch": 0}, "must be a positive int"),
        ({"max_tokens_per_microbatch": 8, "sequence_length_pad_multiple": 0}, "pad_multiple"),
        ({"max_tokens_per_microbatch": 8, "algorithm": "best_fit"}, "not supported"),
        ({"max_tokens_per_microbatch": 8, "microbatch_order": "random"}, "microbatch_order"),
        ({"max_tokens_per_microbatch": 8, "max_token_per_microbatch": 8}, "unknown key"),
    ],
)
def test_sequence_packing_args_errors(args, match):
    with pytest.raises(ValueError, match=match):
        validate_sequence_packing_args(args)


def test_sequence_packing_args_defaults_and_reference_names():
    out = validate_sequence_packing_args(
        {
            "algorithm": "modified_first_fit_decreasing",
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": 64,
            "max_tokens_per_microbatch": 8192,
        }
    )
    assert out["microbatch_order"] == "packer" and out["sequence_length_pad_multiple"] == 64


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"sequence_length_round": 64}, "is required"),
        ({"max_tokens_per_microbatch": 8, "sequence_length_round": -1}, "sequence_length_round"),
        ({"max_tokens_per_microbatch": 8, "algorithm": "x"}, "unknown key"),
    ],
)
def test_dynamic_batching_args_errors(args, match):
    with pytest.raises(ValueError, match=match):
        validate_dynamic_batching_args(args)


def test_packing_args_must_be_a_dict():
    with pytest.raises(TypeError, match="must be a dict"):
        validate_dynamic_batching_args("not a dict")


@pytest.mark.parametrize(
    ("lengths", "match"),
    [([3, -1], "row 1 has length -1"), (torch.ones(2, 2, dtype=torch.int64), "1-D"), ([2**70], "int64")],
)
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        as_lengths(lengths)


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([1.5, 2.0], "must hold ints"),
        ([[1, 2]], "must hold ints"),
        (["3"], "must hold ints"),
        ([None], "must hold ints"),
        ([True, 2], "must hold ints"),
        (torch.tensor([1.0]), "must hold ints"),
        ("12", "sequence of ints"),
    ],
)
def test_non_integer_lengths_are_type_errors(lengths, match):
    with pytest.raises(TypeError, match=match):
        as_lengths(lengths)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"max_tokens_per_microbatch": True}, "positive int, got bool"),
        ({"max_tokens_per_microbatch": "8"}, "positive int, got str"),
        ({"max_tokens_per_microbatch": 8, "sequence_length_round": 2.0}, "got float"),
    ],
)
def test_dynamic_batching_args_type_errors(args, match):
    with pytest.raises(TypeError, match=match):
        validate_dynamic_batching_args(args)

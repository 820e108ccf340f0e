"""Under DDP the rl/* figures logged through self.log are reduced over ranks the way metrics.csv
is (``ranks.merge_rank_steps``), not rank 0's own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tq_plugin.rl.training import ranks
from tq_plugin.rl.training.metrics import StepRecord, rl_metrics
from tq_plugin.rl.training.ranks import reduce_over_ranks

RANK0 = {"loss": 0.8, "value_loss": 0.2, "clipped_tokens": 3.0, "action_tokens": 40.0,
         "kl_sum": 0.4, "entropy_sum": 50.0, "real_tokens": 60.0, "padded_tokens": 80.0,
         "seconds": 0.5}
RANK1 = {"loss": 1.4, "value_loss": 0.6, "clipped_tokens": 9.0, "action_tokens": 20.0,
         "kl_sum": 1.0, "entropy_sum": 30.0, "real_tokens": 30.0, "padded_tokens": 40.0,
         "seconds": 1.5}


class TwoRanks:
    """Plays rank 0 of two; rank 1 contributes ``other``."""

    root_device = torch.device("cpu")

    def __init__(self, other: dict[str, float]) -> None:
        self.other = other

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        other = torch.tensor([self.other[k] for k in sorted(self.other)], dtype=tensor.dtype)
        return tensor + other if reduce_op == "sum" else torch.maximum(tensor, other)


def step_record(sums: dict[str, float]) -> StepRecord:
    record = StepRecord(step=0, reward=0.0, reward_first_turn=0.0, reward_last_turn=0.0,
                   rollout_s=0.0, prepare_s=0.0, failed_calls=0)
    record.add(sums, last_in_global_batch=True)
    return record


def test_logged_figures_are_the_csv_figures_reduced_over_ranks() -> None:
    host = SimpleNamespace(trainer=SimpleNamespace(world_size=2, strategy=TwoRanks(RANK1)))
    logged = rl_metrics(reduce_over_ranks(host.trainer, dict(RANK0)), 1)
    merged = ranks.merge_rank_steps([[step_record(RANK0)], [step_record(RANK1)]])[0]
    for key in ("loss", "value_loss", "clipfrac", "approx_kl", "entropy", "tokens_per_s"):
        assert logged[key] == pytest.approx(getattr(merged, key)), key
    assert logged != rl_metrics(RANK0, 1)  # rank 0's own figures are not what is logged


def test_one_rank_logs_its_own_sums() -> None:
    host = SimpleNamespace(trainer=SimpleNamespace(world_size=1, strategy=None))
    assert reduce_over_ranks(host.trainer, dict(RANK0)) == RANK0


def test_the_csv_importance_ratio_is_over_every_ranks_tokens_its_max_the_largest() -> None:
    a = step_record({**RANK0, "is_ratio_sum": 40.0, "is_ratio_max": 1.5, "is_masked_tokens": 2.0})
    b = step_record({**RANK1, "is_ratio_sum": 22.0, "is_ratio_max": 1.2, "is_masked_tokens": 1.0})
    row = ranks.merge_rank_steps([[a], [b]])[0].row()
    assert row["is_ratio_mean"] == pytest.approx(62.0 / 60.0, rel=1e-5)
    assert row["is_ratio_max"] == 1.5
    assert row["is_masked_fraction"] == pytest.approx(3.0 / 60.0, rel=1e-5)
    assert a.row()["is_ratio_mean"] == 1.0  # one rank's own: 40 / 40

"""Per-step planning: pad target agreement, sharding, microbatch cuts, role isolation."""

from __future__ import annotations

from typing import Any

import pytest

from tq_plugin.data_plane import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS, KVBatchMeta
from tq_plugin.lightning import MICROBATCH_INFO, STEP_SAMPLE_IDS, TQDriverMixin, plan_step
from tq_plugin.lightning.demo import packing_setup
from tq_plugin.lightning.plan import _equalize

LENGTHS = [5, 17, 3, 9, 12, 7, 30, 2]


class Host(TQDriverMixin):
    def __init__(self, mode: str = "none", **kwargs: Any) -> None:
        self.cfg, attrs = packing_setup(mode, **kwargs)
        self.configure_packing(**attrs)
        self.dp_client = None


def step_meta(lengths: list[int] = LENGTHS, prefix: str = "k") -> KVBatchMeta:
    return KVBatchMeta("train", "rollout", [f"{prefix}{i}" for i in range(len(lengths))],
                       fields=["input_ids", "advantages"], sequence_lengths=list(lengths))


def plan(host: Host, meta: KVBatchMeta, **kwargs: Any) -> list[KVBatchMeta]:
    opts: dict[str, Any] = {"host": host, "fields": [INPUT_IDS], "task_name": "train", "step": 3}
    opts.update(kwargs)
    return plan_step(meta, **opts)


@pytest.mark.parametrize(
    "mode, kwargs",
    [("none", {"micro_batch_size": None}), ("sequence_packing", {"train_mb_tokens": 32}),
     ("dynamic_batching", {"train_mb_tokens": 48, "sequence_length_round": 8})],
)
def test_shared_rows_every_rank_pads_to_one_target_and_runs_the_same_count(
    mode: str, kwargs: dict[str, Any]
) -> None:
    micro = kwargs.pop("micro_batch_size", 2)
    host = Host(mode, **kwargs)
    meta = step_meta()
    per_rank = [plan(host, meta, world_size=2, rank=r, micro_batch_size=micro) for r in range(2)]
    targets = {mb.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for mbs in per_rank for mb in mbs}
    expected = 32 if mode == "dynamic_batching" else 30
    assert targets == {expected}
    assert len(per_rank[0]) == len(per_rank[1])
    ids = [s for mbs in per_rank for mb in mbs for s in mb.sample_ids]
    assert sorted(ids) == sorted(meta.sample_ids)
    assert GLOBAL_FORWARD_PAD_SEQLEN not in meta.extra_info  # the caller's meta is untouched
    for mbs in per_rank:
        assert all(mb.fields == [INPUT_IDS] and mb.task_name == "train" for mb in mbs)
        infos = [mb.extra_info[MICROBATCH_INFO] for mb in mbs]
        assert [i["last_in_step"] for i in infos] == [False] * (len(mbs) - 1) + [True]
        assert [i["index_in_step"] for i in infos] == list(range(len(mbs)))
        assert {i["step"] for i in infos} == {3}
        assert sorted(mbs[-1].extra_info[STEP_SAMPLE_IDS]) == sorted(s for mb in mbs for s in mb.sample_ids)
        if mode == "sequence_packing":
            assert all(sum(mb.sequence_lengths) <= 32 for mb in mbs)


def test_no_packing_cuts_each_global_batch_by_micro_batch_size() -> None:
    mbs = plan(Host(), step_meta(), global_batch_size=4, micro_batch_size=2)
    assert [mb.size for mb in mbs] == [2, 2, 2, 2]
    infos = [mb.extra_info[MICROBATCH_INFO] for mb in mbs]
    assert [(i["global_batch"], i["index"], i["last_in_global_batch"]) for i in infos] == [
        (0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True)]
    assert [s for mb in mbs[:2] for s in mb.sample_ids] == ["k0", "k1", "k2", "k3"]


def test_local_rows_agree_on_target_and_counts_through_reduce_max() -> None:
    host = Host("sequence_packing", train_mb_tokens=32)
    metas = [step_meta([5, 17, 3, 9], "a"), step_meta([30, 2, 31, 29, 28, 27], "b")]
    own = [plan(host, m, rows="local", world_size=1) for m in metas]
    # A two-rank all-reduce, played out in one process: the calls pair up in order.
    calls: list[list[list[int]]] = [[], []]
    for r, m in enumerate(metas):
        def record(values: list[int], r: int = r) -> list[int]:
            calls[r].append(values)
            return values
        plan(host, m, rows="local", world_size=2, rank=r, reduce_max=record)
    maxima = [[max(a, b) for a, b in zip(x, y)] for x, y in zip(*calls)]
    agreed = []
    for r, m in enumerate(metas):
        answers = iter(maxima)
        agreed.append(plan(host, m, rows="local", world_size=2, rank=r,
                           reduce_max=lambda values, answers=answers: next(answers)))
    assert len(own[0]) != len(own[1])
    assert len(agreed[0]) == len(agreed[1])
    for r, m in enumerate(metas):
        assert {mb.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for mb in agreed[r]} == {31}
        assert sorted(s for mb in agreed[r] for s in mb.sample_ids) == sorted(m.sample_ids)
        assert all(sum(mb.sequence_lengths) <= 32 for mb in agreed[r])


def test_local_rows_under_ddp_need_a_reduce() -> None:
    with pytest.raises(ValueError, match="reduce_max"):
        plan(Host(), step_meta(), rows="local", world_size=2, rank=0)


def test_equalize_splits_the_largest_then_adds_empty_microbatches() -> None:
    assert _equalize([[0, 4], [4, 5]], 3) == [[0, 2], [2, 4], [4, 5]]
    assert _equalize([[0, 1]], 3) == [[0, 1], [1, 1], [1, 1]]


def test_policy_and_value_get_independent_targets_across_epochs() -> None:
    policy = Host("dynamic_batching", train_mb_tokens=64, sequence_length_round=16)
    value = Host("none")
    meta = step_meta()
    meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = 4096  # stamped earlier by some driver read
    for epoch in range(2):
        p = plan(policy, meta, epoch=epoch, num_epochs=2)
        v = plan(value, meta, epoch=epoch, num_epochs=2)
        assert {mb.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for mb in p} == {32}
        assert {mb.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for mb in v} == {30}
        assert v[-1].extra_info[MICROBATCH_INFO]["last_in_step"] is (epoch == 1)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 4096


@pytest.mark.parametrize(
    "mode, kwargs",
    [("none", {}), ("sequence_packing", {"train_mb_tokens": 32}),
     ("dynamic_batching", {"train_mb_tokens": 48, "sequence_length_round": 8})],
)
@pytest.mark.parametrize("world_size", [1, 2])
def test_loss_tokens_are_the_global_batch_per_rank_in_every_mode(
    mode: str, kwargs: dict[str, Any], world_size: int
) -> None:
    """Global batches of 4 rows: every microbatch carries its global batch's real tokens (over
    all ranks) and the per-rank normalizer, whatever the mode cut the rows into."""
    host = Host(mode, **kwargs)
    meta = step_meta()
    for rank in range(world_size):
        mbs = plan(host, meta, world_size=world_size, rank=rank, global_batch_size=4,
                   micro_batch_size=1)
        by_gb: dict[int, set] = {}
        for mb in mbs:
            info = mb.extra_info[MICROBATCH_INFO]
            by_gb.setdefault(info["global_batch"], set()).add(
                (info["global_batch_tokens"], info["loss_tokens"]))
        assert all(len(v) == 1 for v in by_gb.values()), by_gb  # one value per global batch
        totals = [next(iter(by_gb[g]))[0] for g in sorted(by_gb)]
        assert sum(totals) == sum(LENGTHS)
        assert all(next(iter(by_gb[g]))[1] == t / world_size for g, t in zip(sorted(by_gb), totals))

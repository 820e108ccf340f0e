"""MetaDataModule row placement, driven by a stand-in trainer (no processes needed)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tq_plugin.data_plane import GLOBAL_FORWARD_PAD_SEQLEN, KVBatchMeta, LocalDataPlane
from tq_plugin.lightning import MICROBATCH_INFO, DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec


class Strategy:
    """Plays rank ``rank`` of a 2-rank job whose rank 0 produced ``step_meta``."""

    root_device = torch.device("cpu")

    def __init__(self, step_meta: KVBatchMeta | None) -> None:
        self.step_meta = step_meta
        self.broadcasts = 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.broadcasts += 1
        return pickle.loads(pickle.dumps(self.step_meta))  # what crosses the wire

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        raise AssertionError("shared rows never all-reduce")


def stand_in(rank: int, step_meta: KVBatchMeta | None, client: Any) -> tuple[Any, DataPlaneCallback]:
    model = DemoPolicy()
    cb = DataPlaneCallback(client)
    model.dp_client = client
    trainer = SimpleNamespace(callbacks=[cb], lightning_module=model, world_size=2,
                              global_rank=rank, strategy=Strategy(step_meta))
    return trainer, cb


def test_shared_rows_rank0_produces_and_every_rank_takes_its_shard() -> None:
    client = LocalDataPlane()  # stands in for a backend every rank reaches
    client.register_partition(**partition_spec())
    source = SyntheticRollouts(rows=6, min_len=2, max_len=30, seed=4)
    step_meta = source(0, client)
    shards = []
    for rank in range(2):
        trainer, _ = stand_in(rank, step_meta, client)
        calls: list[int] = []
        dm = MetaDataModule(lambda s, c, calls=calls: calls.append(s) or step_meta, num_steps=1,
                            fields=POLICY_FIELDS, rows="shared")
        dm.trainer = trainer
        mbs = list(dm.iter_microbatches())
        assert calls == ([0] if rank == 0 else [])
        assert trainer.strategy.broadcasts == 1
        shards.append(mbs)
    assert len(shards[0]) == len(shards[1])
    assert {mb.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for mbs in shards for mb in mbs} == {
        max(step_meta.sequence_lengths)}
    ids = [s for mbs in shards for mb in mbs for s in mb.sample_ids]
    assert sorted(ids) == sorted(step_meta.sample_ids)


def test_auto_placement_is_local_for_the_embedded_backend() -> None:
    dm = MetaDataModule(lambda s, c: None, num_steps=1, fields=POLICY_FIELDS)  # type: ignore[arg-type, return-value]
    from tq_plugin.lightning import MeteredClient

    assert dm._row_placement(MeteredClient(LocalDataPlane())) == "local"
    assert dm._row_placement(object()) == "shared"


def test_resume_cursor_skips_done_microbatches_of_the_current_step() -> None:
    client = LocalDataPlane()
    client.register_partition(**partition_spec())
    source = SyntheticRollouts(rows=4)
    trainer, cb = stand_in(0, None, client)
    trainer.world_size = 1
    cb.completed_steps, cb.microbatches_done = 1, 1
    dm = MetaDataModule(source, num_steps=3, fields=POLICY_FIELDS, micro_batch_size=2)
    dm.trainer = trainer
    got = [(mb.extra_info[MICROBATCH_INFO]["step"], mb.extra_info[MICROBATCH_INFO]["index_in_step"])
           for mb in dm.iter_microbatches()]
    assert got == [(1, 1), (2, 0), (2, 1)]
    assert source.calls == [1, 2]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rows"):
        MetaDataModule(SyntheticRollouts(), num_steps=1, fields=POLICY_FIELDS, rows="everywhere")
    with pytest.raises(ValueError, match="fields"):
        MetaDataModule(SyntheticRollouts(), num_steps=1, fields=[])
    dm = MetaDataModule(SyntheticRollouts(), num_steps=1, fields=POLICY_FIELDS)
    with pytest.raises(RuntimeError, match="outside a Trainer"):
        next(dm.iter_microbatches())

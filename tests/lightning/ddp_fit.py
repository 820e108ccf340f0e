"""Two-rank CPU DDP fit with the embedded backend (run as a script by test_ddp.py).

Each rank writes its own rows (rank 0: 7 rows, rank 1: 3 rows, different lengths) into its own
LocalDataPlane; the ranks must agree on the pad target and on the microbatch count through the
strategy's all-reduce. Each rank dumps what its training steps received as JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer

from tq_plugin.data_plane import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS, KVBatchMeta
from tq_plugin.lightning import MICROBATCH_INFO, DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec


class RankRollouts(SyntheticRollouts):
    def __call__(self, step: int, client: Any) -> KVBatchMeta:
        rank = torch.distributed.get_rank()
        self.rows = 7 if rank == 0 else 3
        self.max_len = 24 if (rank + step) % 2 else 12
        return super().__call__(step, client)


def main(out: Path) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    model = DemoPolicy(packing="dynamic_batching", train_mb_tokens=48, sequence_length_round=4,
                       record=True)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, default_root_dir=str(out),
                      callbacks=[DataPlaneCallback(partitions=[partition_spec()])])
    dm = MetaDataModule(RankRollouts(min_len=3), num_steps=2, fields=POLICY_FIELDS)
    trainer.fit(model, datamodule=dm)
    records = [
        {"step": m.extra_info[MICROBATCH_INFO]["step"], "ids": m.sample_ids,
         "lengths": m.sequence_lengths, "target": m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN],
         "width": int(b[INPUT_IDS].shape[1])}
        for m, b in model.received
    ]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

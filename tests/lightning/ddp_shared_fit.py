"""Two-rank CPU DDP fit over one store both ranks share (a RayDataPlane), run by test_ddp.py.

Rank 0 writes each step's rows once; the meta is broadcast, sharded by length over the two ranks,
and each rank reads only its shard from the shared store. Each rank dumps what its training steps
received as JSON. argv: output dir, Ray GCS address, store name.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

from lightning.pytorch import Trainer

from tq_plugin.data_plane import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS, RayDataPlane
from tq_plugin.lightning import MICROBATCH_INFO, DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec


def main(out: Path, address: str, store: str) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    def attach() -> RayDataPlane:
        return RayDataPlane(store, actor_name="tq_plugin_ddp_test",
                            ray_init={"address": address, "_node_ip_address": "127.0.0.2",
                                      "log_to_driver": False})

    model = DemoPolicy(packing="none", micro_batch_size=2, record=True)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, default_root_dir=str(out),
                      callbacks=[DataPlaneCallback(attach, partitions=[partition_spec()])])
    dm = MetaDataModule(SyntheticRollouts(rows=8, min_len=3, max_len=30), num_steps=2,
                        fields=POLICY_FIELDS)
    trainer.fit(model, datamodule=dm)
    records = [
        {"step": m.extra_info[MICROBATCH_INFO]["step"], "ids": m.sample_ids,
         "lengths": m.sequence_lengths, "target": m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN],
         "width": int(b[INPUT_IDS].shape[1])}
        for m, b in model.received
    ]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])

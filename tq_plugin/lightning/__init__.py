"""Lightning integration: the driver mixin, the data-plane callback, a meta-driven DataModule.

A user's module adopts it in a few lines::

    class MyPolicy(TQDriverMixin, MetaBatchMixin, LightningModule):
        def __init__(self):
            super().__init__()
            self.cfg = {"sequence_packing": {"train_mb_tokens": 4096, "logprob_mb_tokens": 8192}}
            self.configure_packing(use_sequence_packing=True,
                                   sequence_packing_args={"algorithm": "first_fit_decreasing"})
            self.dp_layout = "packed"

        def training_step(self, batch, batch_idx):  # a TensorDict read from the microbatch meta
            ...
            return {"loss": loss, "write_back": {"prev_logprobs": logprobs.detach()}}

    callback = DataPlaneCallback(role="policy", partitions=[{"partition_id": "train", "fields": []}])
    Trainer(callbacks=[callback]).fit(
        MyPolicy(), datamodule=MetaDataModule(rollout, num_steps=100, fields=DP_TRAIN_FIELDS))

``rollout(step, client)`` writes a step's rows (``first_write``) and returns its ``KVBatchMeta``;
``tq_plugin.lightning.demo`` has complete, runnable Policy/Value examples.
"""

from tq_plugin.lightning.callback import DataPlaneCallback, build_client
from tq_plugin.lightning.datamodule import MetaDataModule, StepSource, max_over_ranks
from tq_plugin.lightning.driver import PackingConfigError, TQDriverMixin
from tq_plugin.lightning.layout import (
    CU_SEQLENS,
    LAYOUTS,
    POSITION_IDS,
    SEGMENT_IDS,
    PackedIndex,
    packed_batch,
    padded_batch,
)
from tq_plugin.lightning.metered import DataPlaneCounters, MeteredClient
from tq_plugin.lightning.module import MICROBATCH_INFO, STEP_SAMPLE_IDS, MetaBatchMixin
from tq_plugin.lightning.plan import plan_step

__all__ = [
    "CU_SEQLENS",
    "LAYOUTS",
    "MICROBATCH_INFO",
    "POSITION_IDS",
    "SEGMENT_IDS",
    "STEP_SAMPLE_IDS",
    "DataPlaneCallback",
    "DataPlaneCounters",
    "MetaBatchMixin",
    "MetaDataModule",
    "MeteredClient",
    "PackedIndex",
    "PackingConfigError",
    "StepSource",
    "TQDriverMixin",
    "build_client",
    "max_over_ranks",
    "packed_batch",
    "padded_batch",
    "plan_step",
]

"""Lightning integration: the driver mixin, the data-plane callback, a meta-driven DataModule.

A user's module adopts it in a few lines::

    class MyPolicy(TQDriverMixin, MetaBatchMixin, LightningModule):
        def __init__(self):
            super().__init__()
            self.cfg, attrs = packing_setup("sequence_packing", train_mb_tokens=4096)
            self.configure_packing(**attrs)
            self.dp_layout = "packed"

    trainer = Trainer(callbacks=[DataPlaneCallback(role="policy", partitions=[...])])
    trainer.fit(MyPolicy(), datamodule=MetaDataModule(source, num_steps=..., fields=[...]))
"""

from tq_plugin.lightning.callback import DataPlaneCallback, build_client
from tq_plugin.lightning.datamodule import MetaDataModule, StepSource
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
    "packed_batch",
    "padded_batch",
    "plan_step",
]

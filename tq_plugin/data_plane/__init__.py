"""The data plane: a keyed columnar store, its metadata receipt and the helpers above it.

Layering is one-way: column I/O, packing and sharding talk to a backend only through the
``DataPlaneClient`` methods (``call_dp``); only an adapter imports Ray or transferqueue.
"""

from tq_plugin.data_plane import schema as _schema
from tq_plugin.data_plane.backends.local import LocalDataPlane
from tq_plugin.data_plane.backends.ray_actor import RayDataPlane  # imports Ray only when built
from tq_plugin.data_plane.client import (
    CapacityError,
    DataPlaneClient,
    DataPlaneClosedError,
    call_dp,
)
from tq_plugin.data_plane.column_io import (
    first_write,
    jaggedize,
    materialize,
    nested_from_lengths,
    payload_bytes,
    read_columns,
    round_up,
    stamp_global_forward_pad_seqlen,
    write_columns,
)
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.packing import (
    micro_batch_lengths,
    padded_token_fraction,
    plan_dynamic_batches,
    plan_microbatches,
    plan_sequence_packing,
)
from tq_plugin.data_plane.schema import *  # the field-name constants are API
from tq_plugin.data_plane.sharding import shard_meta_for_dp

__all__ = [  # noqa: PLE0604
    "CapacityError",
    "DataPlaneClient",
    "DataPlaneClosedError",
    "KVBatchMeta",
    "LocalDataPlane",
    "RayDataPlane",
    "call_dp",
    "first_write",
    "jaggedize",
    "materialize",
    "micro_batch_lengths",
    "nested_from_lengths",
    "padded_token_fraction",
    "payload_bytes",
    "plan_dynamic_batches",
    "plan_microbatches",
    "plan_sequence_packing",
    "read_columns",
    "round_up",
    "shard_meta_for_dp",
    "stamp_global_forward_pad_seqlen",
    "write_columns",
    *[n for n in dir(_schema) if n.isupper()],  # every schema constant
]

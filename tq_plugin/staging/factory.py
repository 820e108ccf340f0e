"""Build a token sink from its YAML form (the ``tq/staging`` config group's ``_target_``).

The YAML names the pixel dtype as a string and the data-plane client arrives at call time
(``instantiate(cfg.tq.staging)(client)``), so the group targets this function, not the class.
"""

from __future__ import annotations

from typing import Any

import torch

from tq_plugin.staging.sink import TQTokenSink
from tq_plugin.staging.store import register_staging_partition


def build_token_sink(
    dp_client: Any,
    *,
    staging_partition: str,
    capture_media: bool = False,
    media_pixel_dtype: str | None = None,
) -> TQTokenSink:
    """Register ``staging_partition`` on ``dp_client`` and return its ``TQTokenSink``.

    ``media_pixel_dtype`` is a torch dtype name in YAML (``float32``); the sink takes the dtype.
    """
    dtype = None
    if media_pixel_dtype is not None:
        dtype = getattr(torch, media_pixel_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tq.staging.media_pixel_dtype: unknown torch dtype {media_pixel_dtype!r}")
    register_staging_partition(dp_client, staging_partition, capture_media=capture_media)
    return TQTokenSink(
        dp_client,
        staging_partition=staging_partition,
        capture_media=capture_media,
        media_pixel_dtype=dtype,
    )

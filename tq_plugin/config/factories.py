"""``_target_`` factories for components whose YAML form differs from their constructor.

Importing this module stays torch-free (it is named by the torch-free schemas); the heavy
imports happen inside the factories, when Hydra instantiates a component.
"""

from __future__ import annotations

from typing import Any


def token_sink(
    dp_client: Any,
    *,
    staging_partition: str,
    capture_media: bool = False,
    media_pixel_dtype: str | None = None,
) -> Any:
    """Register ``staging_partition`` on ``dp_client`` and return its ``TQTokenSink``.

    ``media_pixel_dtype`` is a torch dtype name in YAML (``float32``); the sink takes the dtype.
    """
    import torch

    from tq_plugin.staging import TQTokenSink, register_staging_partition

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

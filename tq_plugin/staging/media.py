"""Media columns of a staging row: the pixels an engine ran on, staged in the token row's put.

A media-enabled staging partition carries three tensor columns beside the token columns,
plus two flags and a checksum over the row's metadata JSON. Every row of such a partition
carries every column: text calls and stills get sentinels, which keep the column's dtype
and per-row rank (a store keeps one dtype per field across live rows), and the flags tell
readers which columns hold real data.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

MEDIA_PRESENT_FIELD = "media_present"
MEDIA_HAS_FRAMES_FIELD = "media_has_frames"
MEDIA_IMGS_FIELD = "media_imgs"
MEDIA_IMGS_SIZES_FIELD = "media_imgs_sizes"
MEDIA_NUM_FRAMES_FIELD = "media_num_frames"
MEDIA_METADATA_DIGEST_FIELD = "media_metadata_digest"
MEDIA_PATCH_SIZE_FIELD = "media_patch_size"

MEDIA_TENSOR_COLUMNS: dict[str, str] = {
    "imgs": MEDIA_IMGS_FIELD,
    "imgs_sizes": MEDIA_IMGS_SIZES_FIELD,
    "num_frames": MEDIA_NUM_FRAMES_FIELD,
}
MEDIA_FLAG_FIELDS = [MEDIA_PRESENT_FIELD, MEDIA_HAS_FRAMES_FIELD]
MEDIA_METADATA_FIELDS = [*MEDIA_FLAG_FIELDS, MEDIA_METADATA_DIGEST_FIELD]
MEDIA_READ_FIELDS = [*MEDIA_TENSOR_COLUMNS.values(), MEDIA_PATCH_SIZE_FIELD]
MEDIA_STAGING_FIELDS = [*MEDIA_METADATA_FIELDS, *MEDIA_READ_FIELDS]

_MEDIA_REQUIRED = ("imgs", "imgs_sizes")
_MEDIA_PIXEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MEDIA_INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


class MediaMetadataIntegrityError(ValueError):
    """Stored media metadata does not match its framework-owned checksum."""


@dataclass(frozen=True)
class StagedMediaTensors:
    """One staged call's validated media bundle, in the engine's native shapes.

    ``imgs`` is ``[1, total_patches, 3*P*P]`` packed patches, ``imgs_sizes`` ``[N, 2]``
    per-frame ``[height, width]``, ``num_frames`` ``[N_videos]`` frame counts partitioning
    ``imgs_sizes`` (None for still images).
    """

    imgs: torch.Tensor
    imgs_sizes: torch.Tensor
    num_frames: torch.Tensor | None = None

    @property
    def patch_size(self) -> int:
        return math.isqrt(self.imgs.shape[-1] // 3)


def _check_int32_positive(tensor: torch.Tensor, name: str) -> None:
    if tensor.numel() and (int(tensor.min()) <= 0 or int(tensor.max()) > _INT32_MAX):
        raise ValueError(f"media attachment {name!r} values must be positive and fit in int32")


def _check_imgs(imgs: torch.Tensor) -> int:
    if imgs.dtype not in _MEDIA_PIXEL_DTYPES:
        raise ValueError(
            f"media attachment 'imgs' must be float16, bfloat16 or float32, got {imgs.dtype}"
        )
    if imgs.dim() != 3 or imgs.shape[0] != 1 or imgs.shape[1] == 0:
        raise ValueError(
            "media attachment 'imgs' must be [1, total_patches > 0, 3*P*P], "
            f"got {tuple(imgs.shape)}"
        )
    features = imgs.shape[2]
    patch = math.isqrt(features // 3) if features % 3 == 0 else 0
    if features == 0 or patch == 0 or 3 * patch * patch != features:
        raise ValueError(
            f"media attachment 'imgs' feature dim {features} is not 3*P*P for an integer "
            "patch size P"
        )
    return patch


def _check_index(tensor: torch.Tensor, name: str, ndim: int) -> None:
    if tensor.dtype not in _MEDIA_INDEX_DTYPES:
        raise ValueError(f"media attachment {name!r} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != ndim or tensor.shape[0] == 0 or (ndim == 2 and tensor.shape[1] != 2):
        shape = "[N > 0, 2]" if ndim == 2 else "[N_videos > 0]"
        raise ValueError(f"media attachment {name!r} must be {shape}, got {tuple(tensor.shape)}")
    _check_int32_positive(tensor, name)


def validate_media_tensors(attachments: Mapping[str, Any] | None) -> StagedMediaTensors | None:
    """Check a media bundle against the capture contract; dtypes are preserved, never cast.

    Shared by the sink (before any write) and the source (after every read), so malformed
    geometry is rejected at both ends instead of surfacing as a reshape error in a learner.
    ``None`` (no attachments) returns None. Raises TypeError / ValueError naming the rule.
    """
    if attachments is None:
        return None
    if not isinstance(attachments, Mapping):
        raise TypeError(f"media attachments must be a mapping, got {type(attachments).__name__}")
    if not attachments:
        raise ValueError("media attachments must not be empty")
    unknown = sorted(set(attachments) - set(MEDIA_TENSOR_COLUMNS))
    if unknown:
        raise ValueError(f"unsupported media attachments: {unknown}")
    for name in _MEDIA_REQUIRED:
        if attachments.get(name) is None:
            raise ValueError(f"media attachments require {name!r}")
    for name, value in attachments.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"media attachment {name!r} must be a torch.Tensor, got {type(value).__name__}"
            )
    imgs, sizes, frames = (
        attachments["imgs"],
        attachments["imgs_sizes"],
        attachments.get("num_frames"),
    )
    patch = _check_imgs(imgs)
    _check_index(sizes, "imgs_sizes", 2)
    if bool((sizes % patch != 0).any()):
        raise ValueError(
            f"media attachment 'imgs_sizes' entries must be multiples of the patch size {patch}"
        )
    described = int((sizes[:, 0].to(torch.int64) * sizes[:, 1].to(torch.int64)).sum()) // (
        patch * patch
    )
    if described != imgs.shape[1]:
        raise ValueError(
            f"media attachment 'imgs_sizes' describe {described} patches but 'imgs' holds "
            f"{imgs.shape[1]}"
        )
    if frames is not None:
        _check_index(frames, "num_frames", 1)
        if int(frames.to(torch.int64).sum()) != sizes.shape[0]:
            raise ValueError(
                f"media attachment 'num_frames' sums to {int(frames.sum())} and does not partition "
                f"the {sizes.shape[0]} imgs_sizes rows"
            )
    return StagedMediaTensors(imgs=imgs, imgs_sizes=sizes, num_frames=frames)


def _media_sentinels(pixel_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Placeholders for absent media, one per tensor column, in that column's dtype and rank.

    Rows cannot be empty and a column keeps one dtype and per-row rank across its live rows,
    so a sentinel never introduces a second dtype or rank; the flags keep sentinels out of
    real media reads.
    """
    return {
        MEDIA_IMGS_FIELD: torch.zeros((1, 1), dtype=pixel_dtype),
        MEDIA_IMGS_SIZES_FIELD: torch.zeros((1, 1, 2), dtype=torch.int32),
        MEDIA_NUM_FRAMES_FIELD: torch.zeros((1, 1), dtype=torch.int32),
        MEDIA_PATCH_SIZE_FIELD: torch.zeros((1,), dtype=torch.int32),
    }


def metadata_checksum(metadata_json: bytes) -> torch.Tensor:
    """SHA-256 of the row's exact metadata JSON bytes, as a ``[1, 32]`` uint8 row."""
    digest = hashlib.sha256(metadata_json).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8).reshape(1, 32)


def _media_columns(
    media: StagedMediaTensors | None, sentinels: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One row's media columns: native tensors with the row dim prepended, or sentinels.

    ``imgs`` is stored flat (``[1, total_patches * F]``) with its patch size beside it, so
    every row of the column has rank 1 whatever the model's patch size: a store that pins a
    column's per-row shape accepts sentinels and real rows alike, and the reader restores
    ``[1, total_patches, F]``. Geometry is written as int32 (validated to fit), so real rows
    and sentinels share one dtype per column.
    """
    columns = dict(sentinels)
    flags = {MEDIA_PRESENT_FIELD: media is not None, MEDIA_HAS_FRAMES_FIELD: False}
    if media is not None:
        columns[MEDIA_IMGS_FIELD] = media.imgs.detach().cpu().reshape(1, -1)
        columns[MEDIA_IMGS_SIZES_FIELD] = (
            media.imgs_sizes.detach().cpu().to(torch.int32).unsqueeze(0)
        )
        columns[MEDIA_PATCH_SIZE_FIELD] = torch.tensor([media.patch_size], dtype=torch.int32)
        if media.num_frames is not None:
            frames = media.num_frames.detach().cpu().to(torch.int32)
            columns[MEDIA_NUM_FRAMES_FIELD] = frames.unsqueeze(0)
            flags[MEDIA_HAS_FRAMES_FIELD] = True
    for name, flag in flags.items():
        columns[name] = torch.tensor([flag])
    return columns


def media_from_row(
    imgs: torch.Tensor,
    imgs_sizes: torch.Tensor,
    num_frames: torch.Tensor | None,
    patch_size: int,
) -> StagedMediaTensors:
    """Restore one stored row's bundle to engine shapes and re-validate it (after every read)."""
    features = 3 * patch_size * patch_size
    if patch_size <= 0 or imgs.dim() != 1 or imgs.numel() % features:
        raise ValueError(
            f"stored media row holds {imgs.numel()} pixel values, not a whole number of "
            f"patches of size {patch_size}"
        )
    bundle = {"imgs": imgs.reshape(1, -1, features), "imgs_sizes": imgs_sizes}
    if num_frames is not None:
        bundle["num_frames"] = num_frames
    media = validate_media_tensors(bundle)
    assert media is not None
    return media

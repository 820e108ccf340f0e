"""Media bundles: the capture contract's geometry rules, dtype preservation and sentinels."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.staging import (
    MEDIA_IMGS_FIELD,
    MEDIA_IMGS_SIZES_FIELD,
    MEDIA_NUM_FRAMES_FIELD,
    MEDIA_STAGING_FIELDS,
    MEDIA_TENSOR_COLUMNS,
    MediaMetadataIntegrityError,
    StagedMediaTensors,
    validate_media_tensors,
)
from tq_plugin.staging.media import _media_sentinels


def _still(**changes):
    bundle = {
        "imgs": torch.zeros(1, 4, 12, dtype=torch.bfloat16),
        "imgs_sizes": torch.tensor([[4, 4]], dtype=torch.int32),
    }
    bundle.update(changes)
    return {k: v for k, v in bundle.items() if v is not _DROP}


_DROP = object()

MALFORMED = {
    "empty mapping": ({}, ValueError, "must not be empty"),
    "missing imgs_sizes": (_still(imgs_sizes=_DROP), ValueError, "require 'imgs_sizes'"),
    "extra key": (_still(extra=torch.zeros(1)), ValueError, "unsupported media attachments"),
    "imgs as list": (_still(imgs=[[0.0]]), TypeError, "must be a torch.Tensor"),
    "zero patches": (
        _still(imgs=torch.zeros(1, 0, 12, dtype=torch.bfloat16)),
        ValueError,
        "total_patches > 0",
    ),
    "int64 imgs": (
        _still(imgs=torch.zeros(1, 4, 12, dtype=torch.int64)),
        ValueError,
        "float16, bfloat16",
    ),
    "2-D imgs": (
        _still(imgs=torch.zeros(4, 12, dtype=torch.bfloat16)),
        ValueError,
        r"\[1, total_patches",
    ),
    "feature dim 11": (
        _still(imgs=torch.zeros(1, 4, 11, dtype=torch.bfloat16)),
        ValueError,
        "3\\*P\\*P",
    ),
    "float sizes": (_still(imgs_sizes=torch.tensor([[4.0, 4.0]])), ValueError, "int32 or int64"),
    "sizes off the patch grid": (
        _still(imgs_sizes=torch.tensor([[3, 4]])),
        ValueError,
        "multiples of the patch",
    ),
    "patch total mismatch": (
        _still(imgs_sizes=torch.tensor([[4, 8]])),
        ValueError,
        "describe 8 patches",
    ),
    "zero sizes": (
        _still(imgs_sizes=torch.tensor([[0, 4]])),
        ValueError,
        "positive and fit in int32",
    ),
    "frames not partitioning": (
        _still(num_frames=torch.tensor([2])),
        ValueError,
        "does not partition",
    ),
    "2-D frames": (_still(num_frames=torch.tensor([[1]])), ValueError, r"\[N_videos > 0\]"),
    "float frames": (_still(num_frames=torch.tensor([1.0])), ValueError, "int32 or int64"),
    "frames beyond int32": (_still(num_frames=torch.tensor([2**31])), ValueError, "fit in int32"),
    "non-mapping": ([1, 2], TypeError, "must be a mapping"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_media_is_rejected_with_its_rule(case: str) -> None:
    bundle, error, match = MALFORMED[case]
    with pytest.raises(error, match=match):
        validate_media_tensors(bundle)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_validate_media_tensors_preserves_dtypes(dtype: torch.dtype) -> None:
    assert validate_media_tensors(None) is None
    media = validate_media_tensors(_still(imgs=torch.zeros(1, 4, 12, dtype=dtype)))
    assert isinstance(media, StagedMediaTensors)
    assert (
        media.imgs.dtype == dtype
        and media.imgs_sizes.dtype == torch.int32
        and media.patch_size == 2
    )
    wide = validate_media_tensors(_still(imgs_sizes=torch.tensor([[4, 4]], dtype=torch.int64)))
    assert wide is not None and wide.imgs_sizes.dtype == torch.int64 and wide.num_frames is None


def test_video_frames_partition_the_sizes() -> None:
    bundle = _still(
        imgs=torch.zeros(1, 12, 12),
        imgs_sizes=torch.tensor([[4, 4]] * 3),
        num_frames=torch.tensor([1, 2]),
    )
    media = validate_media_tensors(bundle)
    assert media is not None and media.num_frames.tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sentinels_keep_each_columns_dtype_and_rank(dtype: torch.dtype) -> None:
    sentinels = _media_sentinels(dtype)
    assert sentinels[MEDIA_IMGS_FIELD].dtype == dtype
    assert sentinels[MEDIA_IMGS_SIZES_FIELD].dtype == torch.int32
    assert sentinels[MEDIA_IMGS_SIZES_FIELD].shape == (1, 1, 2)
    assert sentinels[MEDIA_NUM_FRAMES_FIELD].dtype == torch.int32
    assert sentinels[MEDIA_NUM_FRAMES_FIELD].dim() == 2
    assert set(MEDIA_TENSOR_COLUMNS.values()) <= set(sentinels) <= set(MEDIA_STAGING_FIELDS)


def test_metadata_integrity_error_is_a_value_error() -> None:
    assert issubclass(MediaMetadataIntegrityError, ValueError)

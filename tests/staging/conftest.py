"""Fixtures shared by the staging tests: a recording / fault-injecting client and chain builders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import (
    StagedCallBaseSnapshot,
    StagedCallRecord,
    TQTokenSink,
    TQTokenSource,
    make_staged_chain,
    register_staging_partition,
)

# Test modules repeat these two names (tests never import each other, conftest included).
TEXT_PARTITION = "rollout_staging"
MEDIA_PARTITION = "media_staging"


class RecordingClient:
    """A data-plane client wrapper that records every call and can inject faults.

    ``fail_put`` raises on put (``midway=True`` first lands half the fields, as a backend
    that writes field by field would); ``fail_clear`` raises on clear.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_put: Exception | None = None
        self.midway = False
        self.fail_clear: Exception | None = None

    def _record(self, name: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((name, kwargs))

    def register_partition(self, **kwargs: Any) -> Any:
        return self.inner.register_partition(**kwargs)

    def put_samples(self, **kwargs: Any) -> Any:
        self._record("put_samples", kwargs)
        if self.fail_put is not None:
            if self.midway:
                names = list(kwargs["fields"].keys())
                half = kwargs["fields"].select(*names[: len(names) // 2])
                self.inner.put_samples(**{**kwargs, "fields": half})
            raise self.fail_put
        return self.inner.put_samples(**kwargs)

    def get_samples(self, **kwargs: Any) -> Any:
        self._record("get_samples", kwargs)
        return self.inner.get_samples(**kwargs)

    def clear_samples(self, **kwargs: Any) -> Any:
        self._record("clear_samples", kwargs)
        if self.fail_clear is not None:
            raise self.fail_clear
        return self.inner.clear_samples(**kwargs)

    def list_sample_ids(self, **kwargs: Any) -> Any:
        return self.inner.list_sample_ids(**kwargs)

    def get_tags(self, **kwargs: Any) -> Any:
        self._record("get_tags", kwargs)
        return self.inner.get_tags(**kwargs)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for method, kwargs in self.calls if method == name]


@pytest.fixture
def client() -> RecordingClient:
    """A recording client over a local data plane with a text and a media staging partition."""
    inner = LocalDataPlane()
    register_staging_partition(inner, TEXT_PARTITION)
    register_staging_partition(inner, MEDIA_PARTITION, capture_media=True)
    return RecordingClient(inner)


@pytest.fixture
def text_sink(client: RecordingClient) -> TQTokenSink:
    return TQTokenSink(client, staging_partition=TEXT_PARTITION)


@pytest.fixture
def text_source(client: RecordingClient) -> TQTokenSource:
    return TQTokenSource(
        client, staging_partition=TEXT_PARTITION, snapshot_cls=StagedCallBaseSnapshot
    )


@pytest.fixture
def media_sink(client: RecordingClient) -> TQTokenSink:
    return TQTokenSink(
        client,
        staging_partition=MEDIA_PARTITION,
        capture_media=True,
        media_pixel_dtype=torch.bfloat16,
    )


@pytest.fixture
def media_source(client: RecordingClient) -> TQTokenSource:
    return TQTokenSource(
        client,
        staging_partition=MEDIA_PARTITION,
        capture_media=True,
        snapshot_cls=StagedCallBaseSnapshot,
    )


@pytest.fixture
def chain() -> Callable[..., list[StagedCallRecord]]:
    return make_staged_chain


def still_image(
    patch: int = 2, frames: int = 1, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A valid still-image bundle: ``frames`` images of 2x2 patches each."""
    features = 3 * patch * patch
    return {
        "imgs": torch.randn(1, 4 * frames, features).to(dtype),
        "imgs_sizes": torch.tensor([[2 * patch, 2 * patch]] * frames, dtype=torch.int32),
    }


def video(
    patch: int = 2, frames: int = 2, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    bundle = still_image(patch, frames, dtype)
    bundle["num_frames"] = torch.tensor([frames], dtype=torch.int32)
    return bundle


@pytest.fixture
def media() -> Any:
    class Media:
        still = staticmethod(still_image)
        video = staticmethod(video)

    return Media

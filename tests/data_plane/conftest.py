"""Shared fixtures for the data-plane tests: one conformance body runs over every backend."""

from __future__ import annotations

import uuid

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths


def _make(kind: str, request):
    if kind == "local":
        return LocalDataPlane()
    request.getfixturevalue("ray_session")
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    return RayDataPlane(f"conformance-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")


@pytest.fixture(params=["local", pytest.param("ray", marks=pytest.mark.slow)])
def client(request):
    c = _make(request.param, request)
    yield c
    c.close()


def ragged(lengths: list[int], dtype=torch.int64, *trailing: int, seed: int = 0) -> torch.Tensor:
    """A jagged nested tensor with the given row lengths and deterministic contents."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    if dtype.is_floating_point:
        values = torch.randn((total, *trailing), generator=g).to(dtype)
    else:
        values = torch.randint(0, 50_000, (total, *trailing), generator=g).to(dtype)
    return nested_from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def rows_of(nt: torch.Tensor) -> list[torch.Tensor]:
    return list(nt.unbind())

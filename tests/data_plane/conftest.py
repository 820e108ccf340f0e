"""Shared fixtures for the data-plane tests: one conformance body runs over every backend."""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths

HAVE_TQ = importlib.util.find_spec("transfer_queue") is not None  # the tq extra

# Conformance cases a backend cannot meet, and why (the test is skipped with this reason).
UNSUPPORTED: dict[str, dict[str, str]] = {
    "transferqueue": {
        "test_cleared_rows_are_reclaimed_over_a_long_run": "TransferQueue reports no byte accounting (stats() has rows only)",
        "test_stats_reports_rows_and_bytes": "TransferQueue reports no byte accounting (stats() has rows only)",
    },
}


def _make(kind: str, request):
    if kind == "local":
        return LocalDataPlane()
    if kind == "transferqueue":
        request.getfixturevalue("tq_session")
        from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

        return TransferQueueDataPlane(f"conformance-{uuid.uuid4().hex[:8]}")
    request.getfixturevalue("ray_session")
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    if kind == "ray_sharded":
        return sharded_ray_store(f"conformance-{uuid.uuid4().hex[:8]}")
    return RayDataPlane(f"conformance-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")


def sharded_ray_store(store: str, units: int = 2):
    """``RayDataPlane`` over ``units`` storage units, every block of two or more elements staged
    on a unit (``min_bytes=0``), so the suite's small rows take the sharded path too."""
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    client = RayDataPlane(store, actor_name="tq_plugin_tests", num_storage_units=units)
    client.storage_units.min_bytes = 0
    return client


_DISTRIBUTED = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(params=["local", pytest.param("ray", marks=_DISTRIBUTED),
                        pytest.param("ray_sharded", marks=_DISTRIBUTED),
                        pytest.param("transferqueue", marks=_DISTRIBUTED)])
def client(request):
    reason = UNSUPPORTED.get(request.param, {}).get(request.node.originalname)
    if reason:
        pytest.skip(f"{request.param}: {reason}")
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


# ---------------------------------------------------------------- multi-process helpers
# Source run by subprocesses (which cannot import this conftest): a deterministic batch and a
# digest of exactly the bytes a backend hands back.
BATCH_SOURCE = '''
import hashlib, torch

def batch(seed, rows=64):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 300, (rows,), generator=g)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    total = int(offsets[-1])
    return [f"s{seed}_{i}" for i in range(rows)], {
        "input_ids": torch.nested.nested_tensor_from_jagged(
            torch.randint(0, 150000, (total,), generator=g), offsets),
        "logprobs": torch.nested.nested_tensor_from_jagged(torch.randn(total, generator=g), offsets),
        "reward": torch.randn(rows, generator=g),
        "img": torch.randint(0, 255, (rows, 3, 4), generator=g).to(torch.uint8),
    }

def digest(td):
    h = hashlib.sha256()
    for name in sorted(td.keys()):
        t = td[name]
        parts = [t.values(), t.offsets().diff()] if t.is_nested else [t]
        for p in parts:
            h.update(name.encode() + str(p.dtype).encode() + str(tuple(p.shape)).encode())
            h.update(p.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
'''


def run_python(code: str, *args: str, timeout: float = 240) -> str:
    """Run ``code`` in a fresh interpreter (``BATCH_SOURCE`` defined first); its stdout's last line."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", BATCH_SOURCE + "\n" + code, *args],
        check=False, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"},
    )
    if proc.returncode:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]

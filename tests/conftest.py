"""Fixtures shared by every test tier."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_RAY = importlib.util.find_spec("ray") is not None
HAVE_TQ = importlib.util.find_spec("transfer_queue") is not None
# Ray on loopback only: a 2-core box, no dashboard, and never the machine's routable address.
# 4 logical CPUs: TransferQueue's controller and storage unit take one each and must not starve
# the tests' own actors (which ask for none).
RAY_INIT = {"num_cpus": 4, "_node_ip_address": "127.0.0.2", "include_dashboard": False,
            "log_to_driver": False}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session (starting Ray costs seconds)."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install 'tq_plugin[ray]')")
    import ray

    ray.init(**RAY_INIT)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tq_session(ray_session):
    """TransferQueue on the session's loopback Ray: started once (1 storage unit), stopped at the end."""
    if not HAVE_TQ:
        pytest.skip("transferqueue is not installed (pip install 'tq_plugin[tq]')")
    from tq_plugin.data_plane.backends.transferqueue import (
        ensure_transfer_queue,
        shutdown_transfer_queue,
    )

    ensure_transfer_queue(num_storage_units=1, init_timeout_s=120)
    yield ray_session
    shutdown_transfer_queue()

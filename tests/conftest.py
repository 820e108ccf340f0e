"""Fixtures shared by every test tier."""

from __future__ import annotations

import importlib.util
import os
import secrets

import pytest

HAVE_RAY = importlib.util.find_spec("ray") is not None
HAVE_TQ = importlib.util.find_spec("transfer_queue") is not None
# Every Ray the tests start (here, in subprocesses, in Hydra apps) asks for a token, this
# session's own: no test reads or writes the user's ~/.ray/auth_token.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# Ray on loopback only (127.0.0.1: every port binds there), with token authentication: a
# 2-core box, no dashboard. 4 logical CPUs: TransferQueue's controller and storage unit take one
# each and must not starve the tests' own actors (which ask for none).
RAY_INIT = {"num_cpus": 4, "_node_ip_address": "127.0.0.1", "include_dashboard": False,
            "log_to_driver": False}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session (starting Ray costs seconds), started the
    way the backends start it (``start_ray_on_loopback``)."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install 'tq_plugin[ray]')")
    import ray

    from tq_plugin.data_plane.backends.ray_actor import start_ray_on_loopback

    start_ray_on_loopback(None, None, RAY_INIT)
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

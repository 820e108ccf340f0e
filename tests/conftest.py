"""Fixtures shared by every test tier."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
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


# pytest-xdist (`make test`: two workers). The scheduler below hands each worker whole units:
# every test that uses TransferQueue (its start-up alone takes tens of seconds on 2 cores) is one
# unit, so only one worker starts it; the tests that convert the real model are another; every
# other file is a unit of its own, so a module-scoped fixture is built once, except
# tests/docs/test_examples.py, whose unit is a page (a page's blocks run in order in one folder;
# pages share nothing, and each block is its own subprocess). Each worker that meets a Ray test
# starts its own loopback Ray (``ray_session``). (xdist's own ``--dist loadgroup`` cannot group
# here: pytest 9 ignores the node ids it rewrites.)
_BY_PAGE = "tests/docs/test_examples.py"


@functools.cache
def _file_text(path: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except OSError:
        return ""


def xdist_unit(nodeid: str, root: pathlib.Path) -> str:
    """The unit of work a test belongs to (tests of one unit run on one worker, in order)."""
    path = nodeid.split("::")[0]
    text = _file_text(str(root / path))
    if "tq_session" in text or "transferqueue" in nodeid.partition("[")[2]:
        return "transferqueue"
    if "smollm2_dir" in text:
        return "smollm2"
    if path == _BY_PAGE:  # ...::test_example_runs[docs/page.md:LINE] -> the page
        return nodeid.rpartition(":")[0] if nodeid.endswith("]") else path
    return path


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config: pytest.Config, log):
        from xdist.scheduler import LoadScopeScheduling

        class UnitScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_unit(nodeid, config.rootpath)

        return UnitScheduling(config, log)

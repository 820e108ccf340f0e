"""A killed run leaves no process of its own behind (issue 37).

A driver that started Ray itself (``RayDataPlane`` with ``tq/backend=ray``'s ``ray_init``, as
``tq-train`` builds it) is SIGKILLed. Ray's GCS and raylet die with it, but the raylet's
dashboard and runtime-env agents used to wait out a 60 s timeout on the dead GCS (measured: 61.8
s). ``start_ray_on_loopback`` now starts a watchdog (``backends/_ray_reaper.py``) that ends them:
every process the driver started must be gone within 30 s. The processes are found by the
pids recorded while the driver lived (with their start times), never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")
REAPER = os.path.join(os.path.dirname(__file__), "..", "..", "tq_plugin", "data_plane", "backends",
                      "_ray_reaper.py")

DRIVER = r'''
import sys
from tq_plugin.config.schema import RayBackendConfig
from tq_plugin.data_plane import RayDataPlane

dp = RayDataPlane("run", ray_init=RayBackendConfig().ray_init)
print("ready", flush=True)
sys.stdin.read()  # until killed
'''


def _record(root: int) -> dict[int, tuple[float, str]]:
    out = {}
    for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        try:
            out[p.pid] = (p.create_time(), " ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    return out


def _alive(procs: dict[int, tuple[float, str]]) -> dict[int, str]:
    """The recorded processes still running (same pid and start time, not a zombie)."""
    out = {}
    for pid, (created, what) in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out[pid] = what
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_driver_leaves_no_ray_process_after_30_s() -> None:
    pytest.importorskip("ray")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    procs: dict[int, tuple[float, str]] = {}
    try:
        assert driver.stdout.readline().strip() == "ready"
        me = psutil.Process(driver.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the raylet's agents are up
            for p in me.children(recursive=True):
                try:
                    procs.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:120]))
                except psutil.NoSuchProcess:
                    pass
            names = " ".join(what for _, what in procs.values())
            if "DashboardAgent" in names and "RuntimeEnvAgent" in names and "_ray_reaper" in names:
                break
            time.sleep(0.2)
        names = " ".join(what for _, what in procs.values())
        # the processes that outlived a killed run before are among the recorded ones
        assert "DashboardAgent" in names and "RuntimeEnvAgent" in names, names
        assert "raylet" in names and "gcs_server" in names and "_ray_reaper" in names, names
        killed = time.monotonic()
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        left = _alive(procs)
        while left and time.monotonic() - killed < 30:
            time.sleep(0.25)
            left = _alive(procs)
        gone_s = time.monotonic() - killed
        print(f"{len(procs)} processes of the killed run, all gone {gone_s:.1f} s after the kill")
        assert not left, f"alive 30 s after the driver's SIGKILL: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        for pid in _alive(procs):  # never leave ours behind, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_watchdog_ends_the_tree_it_was_given_once_the_driver_is_gone() -> None:
    """Fast, without Ray: a driver holds the pipe's write end; its child (a root) has a child
    of its own, orphaned once the root goes first; the driver's SIGKILL ends both, and an
    unrelated child of the same driver (not a root) is left alone."""
    read_end, write_end = os.pipe()
    driver = subprocess.Popen(
        [sys.executable, "-c", ("import subprocess, sys, time\n"
         "root = subprocess.Popen(['sh', '-c', 'sleep 300 & wait'])\n"
         "other = subprocess.Popen(['sleep', '300'])\n"
         "print(root.pid, other.pid, flush=True)\n"
         "time.sleep(300)\n")],
        stdout=subprocess.PIPE, text=True, pass_fds=(write_end,))
    os.close(write_end)
    root, other = map(int, driver.stdout.readline().split())
    time.sleep(0.3)  # the root's own child is up
    tree = _record(root)
    assert len(tree) == 2, tree
    reaper = subprocess.Popen([sys.executable, "-I", REAPER, str(driver.pid), str(root)],
                              stdin=read_end)
    os.close(read_end)
    unrelated = _record(other)
    try:
        time.sleep(0.8)  # it read the tree at least once
        assert len(_alive(tree)) == 2 and reaper.poll() is None
        driver.kill()
        driver.wait(10)
        reaper.wait(20)
        assert not _alive(tree)
        assert _alive(unrelated), "the watchdog killed a process it was not given"
    finally:
        for pid in [*_alive(tree), *_alive(unrelated)]:
            os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
        if reaper.poll() is None:
            reaper.kill()


def test_the_watchdog_leaves_once_its_tree_is_gone_while_the_driver_lives() -> None:
    """Ray shut down by the driver (its processes gone, the driver alive): the watchdog exits
    instead of watching nothing for the rest of the driver's life."""
    read_end, write_end = os.pipe()
    root = subprocess.Popen(["sleep", "300"])
    reaper = subprocess.Popen([sys.executable, "-I", REAPER, str(os.getpid()), str(root.pid)],
                              stdin=read_end)
    os.close(read_end)
    try:
        time.sleep(0.8)
        assert reaper.poll() is None  # watching
        root.kill()
        root.wait(10)
        assert reaper.wait(20) == 0
    finally:
        os.close(write_end)
        if root.poll() is None:
            root.kill()
        if reaper.poll() is None:
            reaper.kill()

"""Worker launchers (``tq_plugin.data_plane.processes``): where a process sharing a store runs.

Every launcher keeps one contract, checked here for both: ``target(*args, stop=...)`` runs in a
new process; ``exitcode`` is None while it runs, 0 after a clean return, non-zero after a
raise, -9 after a SIGKILL of its pid; ``stop()`` ends a target that polls its signal (a clean
0), forces one that does not, and may be called again. A worker never outlives the process that
started it: a spawned worker sees its parent gone, a Ray actor dies with its driver.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.data_plane.processes import SpawnLauncher, launcher_for

# The targets live in a module of their own on sys.path (a spawned child imports its target by
# name; Ray actors get them by value), not in this test module.
TARGETS = '''
import os
import time


def record(path, text, *, stop):
    with open(path, "w") as f:
        f.write(f"{text} pid={os.getpid()} stop={stop.is_set()}")


def fail(*, stop):
    raise ValueError("launcher test: the target failed on purpose")


def loop(*, stop):
    while not stop.is_set():
        time.sleep(0.02)


def ignore_stop(*, stop):
    while True:
        time.sleep(0.05)
'''
TARGETS_MODULE = "tq_launcher_test_targets"
# Killed by SIGKILL: the signal, negated (multiprocessing's convention; a dead Ray actor reads so).
KILLED = -signal.SIGKILL
FORCED = {"spawn": -signal.SIGTERM, "ray": KILLED}  # what stop() forcing a worker leaves


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    where = tmp_path_factory.mktemp("targets")
    (where / f"{TARGETS_MODULE}.py").write_text(TARGETS)
    sys.path.insert(0, str(where))  # spawned children inherit the parent's sys.path
    try:
        yield importlib.import_module(TARGETS_MODULE)
    finally:
        sys.path.remove(str(where))
        sys.modules.pop(TARGETS_MODULE, None)


@pytest.fixture(params=["spawn", "ray"])
def launcher(request, targets):
    if request.param == "spawn":
        yield "spawn", SpawnLauncher()
        return
    ray = request.getfixturevalue("ray_session")
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane
    from tq_plugin.data_plane.backends.ray_workers import RayActorLauncher

    ray.cloudpickle.register_pickle_by_value(targets)
    client = RayDataPlane(f"launch-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")
    try:
        chosen = launcher_for(client)
        assert isinstance(chosen, RayActorLauncher) and chosen.namespace == client.namespace
        yield "ray", chosen
    finally:
        client.close()
        ray.cloudpickle.unregister_pickle_by_value(targets)


def _wait_exit(handle, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while handle.exitcode is None:
        assert time.monotonic() < deadline, f"{handle} did not exit"
        time.sleep(0.05)
    return handle.exitcode


def _gone(pid: int) -> bool:
    import psutil  # a Ray dependency

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# ---------------------------------------------------------------- choosing a launcher
def test_launcher_for_prefers_the_backends_own_launcher():
    class ActorBackend:
        def worker_launcher(self, **options):
            return ("own", options)

    assert launcher_for(ActorBackend(), num_cpus=1) == ("own", {"num_cpus": 1})
    assert isinstance(launcher_for(LocalDataPlane()), SpawnLauncher)
    with pytest.raises(TypeError, match="LocalDataPlane has no worker_launcher; options"):
        launcher_for(LocalDataPlane(), num_cpus=1)


# ---------------------------------------------------------------- the contract, per launcher
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_clean_return_reads_0_and_the_target_gets_its_args(launcher, targets, tmp_path):
    _, chosen = launcher
    out = tmp_path / "out.txt"
    handle = chosen.start(targets.record, (str(out), "hello"), name="w-record")
    assert handle.name == "w-record" and handle.pid > 0 and handle.pid != os.getpid()
    assert _wait_exit(handle) == 0 and not handle.is_alive()
    assert out.read_text() == f"hello pid={handle.pid} stop=False"
    handle.stop(5.0)
    assert handle.exitcode == 0  # stopping a finished worker keeps its clean exit


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_raise_reads_non_zero_and_its_traceback_reaches_stderr(launcher, targets, capfd):
    _, chosen = launcher
    handle = chosen.start(targets.fail, (), name="w-fail")
    assert _wait_exit(handle) not in (0, None)
    assert "launcher test: the target failed on purpose" in capfd.readouterr().err
    handle.stop(5.0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_of_the_pid_reads_minus_9(launcher, targets):
    _, chosen = launcher
    handle = chosen.start(targets.loop, (), name="w-killed")
    assert handle.is_alive() and handle.exitcode is None
    os.kill(handle.pid, signal.SIGKILL)
    assert _wait_exit(handle) == KILLED
    handle.stop(1.0)
    assert handle.exitcode == KILLED


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stop_ends_a_looping_target_cleanly_and_is_idempotent(launcher, targets):
    _, chosen = launcher
    handles = [chosen.start(targets.loop, (), name=f"w-loop-{k}") for k in range(2)]
    pids = [h.pid for h in handles]
    time.sleep(0.5)
    assert all(h.is_alive() for h in handles)
    handles[0].stop(30.0)
    assert handles[0].exitcode == 0  # it returned on its signal: not forced
    assert handles[1].is_alive()  # one handle's stop reaches its own worker only
    for h in handles:
        h.request_stop()
    handles[1].stop(30.0)
    handles[0].stop(30.0)  # again: nothing left to do
    assert [h.exitcode for h in handles] == [0, 0]
    assert all(_wait_gone(pid, 30.0) for pid in pids)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stop_forces_a_target_that_ignores_its_signal(launcher, targets):
    kind, chosen = launcher
    handle = chosen.start(targets.ignore_stop, (), name="w-deaf")
    pid = handle.pid
    handle.stop(0.5)
    assert handle.exitcode == FORCED[kind] and not handle.is_alive()
    assert _wait_gone(pid, 30.0)
    handle.stop(0.5)
    assert handle.exitcode == FORCED[kind]


# ---------------------------------------------------------------- the starter dies
DRIVER = """
import importlib, sys, time
sys.path.insert(0, sys.argv[2])
targets = importlib.import_module(sys.argv[3])
if sys.argv[1] == "spawn":
    from tq_plugin.data_plane.processes import SpawnLauncher as Launcher
else:
    import ray
    from tq_plugin.data_plane.backends.ray_cluster import start_ray_on_loopback
    from tq_plugin.data_plane.backends.ray_workers import RayActorLauncher as Launcher
    start_ray_on_loopback(sys.argv[1], None, {"log_to_driver": False})
    ray.cloudpickle.register_pickle_by_value(targets)
handle = Launcher().start(targets.loop, (), name="orphan-candidate")
print(handle.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["spawn", "ray"])
def test_a_worker_does_not_outlive_a_killed_starter(kind, targets, request, tmp_path):
    """SIGKILL the process that started a looping worker: the worker goes too (a spawned one
    sees its parent gone and returns; Ray kills a dead driver's non-detached actors)."""
    where = str(Path(targets.__file__).parent)
    arg = kind
    if kind == "ray":
        arg = request.getfixturevalue("ray_session").get_runtime_context().gcs_address
    err = tmp_path / "driver.err"
    with open(err, "w") as err_file:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, arg, where, TARGETS_MODULE],
                                  stdout=subprocess.PIPE, stderr=err_file, text=True,
                                  # read now: ray.init sets the cluster's auth mode in os.environ
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
    pid = None
    try:
        line = driver.stdout.readline()  # the worker is up and has a pid
        assert line.strip().isdigit(), f"the driver failed:\n{err.read_text()[-3000:]}"
        pid = int(line)
        assert not _gone(pid)
        driver.kill()
        driver.wait(10)
        assert _wait_gone(pid, 60.0), f"{kind} worker {pid} outlived its killed starter"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)  # only the worker this test's driver started

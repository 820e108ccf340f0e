"""Where a process that shares a store runs: the worker launchers.

A process that works on a shared store (a rollout worker of ``recipe.topology=disaggregated``)
is started by the store's backend, because the backend knows where its other processes live:
on Ray (``RayDataPlane``, ``TransferQueueDataPlane``) a worker is a Ray actor, which the Ray
cluster schedules, reports and fate-shares with the driver that created it; elsewhere it is a
``multiprocessing`` spawn process. ``launcher_for(client)`` picks: the client's own
``worker_launcher()`` when it has one, else ``SpawnLauncher``. This module imports no Ray (only
the backend adapters may, ``tests/test_architecture.py``); the Ray launcher lives in
``backends/ray_workers.py``.

Every launcher runs ``target(*args, stop=<StopSignal>)`` and hands back a ``WorkerHandle``.
The target polls ``stop.is_set()`` and returns when it is set; its return is a clean exit
(``exitcode`` 0), an exception a failure (non-zero, the traceback on stderr), a process killed
by signal ``N`` reads ``-N``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StopSignal(Protocol):
    """What a worker polls: set once its launcher asks it to stop."""

    def is_set(self) -> bool: ...


@runtime_checkable
class WorkerHandle(Protocol):
    """One started worker, as its starter sees it."""

    name: str

    @property
    def pid(self) -> int: ...

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 a clean return; non-zero when it raised or died (``-N``:
        killed by signal ``N``, where that is knowable)."""
        ...

    def is_alive(self) -> bool: ...

    def request_stop(self) -> None:
        """Set its stop signal and return at once (stop many workers, then wait for each)."""
        ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask it to stop, wait up to ``timeout_s``, then force it (terminate, kill). Idempotent."""
        ...


class ProcessLauncher(Protocol):
    def start(self, target: Callable[..., Any], args: Sequence[Any], *, name: str) -> WorkerHandle:
        """Run ``target(*args, stop=<StopSignal>)`` in a new worker; its handle."""
        ...


# ---------------------------------------------------------------- multiprocessing spawn
class _SpawnStop:
    """The stop signal of a spawned worker: its event is set, or its parent is gone (a worker
    whose starter died exits on its own instead of generating for nobody)."""

    def __init__(self, event: Any, parent_pid: int) -> None:
        self._event, self._parent_pid = event, parent_pid

    def is_set(self) -> bool:
        return self._event.is_set() or os.getppid() != self._parent_pid


def _run_spawned(target: Callable[..., Any], args: Sequence[Any], stop: _SpawnStop) -> None:
    target(*args, stop=stop)


class SpawnHandle:
    """A ``multiprocessing`` spawn process started by ``SpawnLauncher``."""

    def __init__(self, process: Any, event: Any) -> None:
        self._process, self._event = process, event
        self.name = process.name

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def request_stop(self) -> None:
        self._event.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.request_stop()
        proc = self._process
        proc.join(max(0.0, timeout_s))
        for force in (proc.terminate, proc.kill):
            if proc.is_alive():
                force()
                proc.join(2.0)

    def __repr__(self) -> str:
        return f"SpawnHandle(name={self.name!r}, pid={self._process.pid}, exitcode={self.exitcode})"


class SpawnLauncher:
    """Daemon ``multiprocessing`` processes ("spawn": a fresh interpreter, nothing inherited
    but the pickled target and arguments). A daemon dies with its starter's normal exit; one
    whose starter was killed sees its stop signal set (the parent check) and returns."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")

    def start(self, target: Callable[..., Any], args: Sequence[Any], *, name: str) -> SpawnHandle:
        event = self._ctx.Event()
        stop = _SpawnStop(event, os.getpid())
        proc = self._ctx.Process(target=_run_spawned, args=(target, tuple(args), stop),
                                 name=name, daemon=True)
        proc.start()
        return SpawnHandle(proc, event)


def launcher_for(client: Any, **options: Any) -> ProcessLauncher:
    """Where workers sharing ``client``'s store run: ``client.worker_launcher(**options)`` when
    the backend has one (Ray actors on the Ray backends), else spawn processes."""
    own = getattr(client, "worker_launcher", None)
    if own is not None:
        return own(**options)
    if options:
        raise TypeError(f"launcher_for: {type(client).__name__} has no worker_launcher; "
                        f"options {sorted(options)} apply to none")
    return SpawnLauncher()


__all__ = ["ProcessLauncher", "SpawnHandle", "SpawnLauncher", "StopSignal", "WorkerHandle",
           "launcher_for"]

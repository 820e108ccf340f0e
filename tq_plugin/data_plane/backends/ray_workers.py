"""``RayActorLauncher``: workers that share a Ray-hosted store run as Ray actors.

``RayDataPlane.worker_launcher()`` and ``TransferQueueDataPlane.worker_launcher()`` return one
(``tq_plugin.data_plane.processes.launcher_for`` picks it). Each worker is one threaded actor
(``max_concurrency=2``: ``run`` loops in one thread, ``stop`` and ``pid`` reach it through the
other) whose ``run(target, args)`` calls ``target(*args, stop=<threading.Event>)``. The actor is
not detached: Ray kills it when the driver that created it dies, so a killed trainer leaves no
worker behind. It asks for ``num_cpus`` (default 0: a worker shares the node's CPUs with the
trainer instead of waiting for a free slot).

A handle reads the worker's state from the ``run`` call's result without blocking: 0 when it
returned, 1 when it raised (the remote traceback is printed to this process's stderr once),
-9 when the actor died (killed, or its process gone: Ray does not report the signal).
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import ray

# A worker that died: Ray reports death, not the signal; SIGKILL is what kills an actor.
DIED = -9
RAISED = 1


class _WorkerHost:
    """The actor: one worker's process."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def run(self, target: Callable[..., Any], args: Sequence[Any]) -> None:
        target(*args, stop=self._stop)

    def stop(self) -> None:
        self._stop.set()


class RayActorHandle:
    """A worker actor started by ``RayActorLauncher``."""

    def __init__(self, actor: Any, name: str, run: Callable[..., Any], args: Sequence[Any],
                 pid_timeout_s: float) -> None:
        self._actor, self.name = actor, name
        self._pid_ref = actor.pid.remote()
        self._run_ref = actor.run.remote(run, tuple(args))
        self._pid: int | None = None
        self._pid_timeout_s = pid_timeout_s
        self._exitcode: int | None = None
        self._killed = False

    @property
    def pid(self) -> int:
        """The actor's process id (asked once at start, waited for on first use)."""
        if self._pid is None:
            self._pid = int(ray.get(self._pid_ref, timeout=self._pid_timeout_s))
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return self._poll(timeout_s=0.0)

    def _poll(self, timeout_s: float) -> int | None:
        """The exit code once ``run`` has ended, waiting up to ``timeout_s`` for it."""
        if self._exitcode is None:
            ready, _ = ray.wait([self._run_ref], timeout=timeout_s)
            if ready:
                self._exitcode = self._outcome()
        return self._exitcode

    def _outcome(self) -> int:
        try:
            ray.get(self._run_ref)
        except ray.exceptions.RayTaskError as e:  # the target raised; e has the remote traceback
            print(f"[tq_plugin] worker {self.name} raised:\n{e}", file=sys.stderr, flush=True)
            return RAISED
        except ray.exceptions.RayError:  # the actor died (RayActorError) or its result is lost
            return DIED
        return 0

    def is_alive(self) -> bool:
        return self.exitcode is None

    def request_stop(self) -> None:
        if self.exitcode is None:
            self._actor.stop.remote()  # a dead actor's call fails in its own ref, unread

    def stop(self, timeout_s: float = 10.0) -> None:
        """Set its stop event, wait up to ``timeout_s`` for ``run`` to return, then
        ``ray.kill`` the actor (it holds a process even when idle). Idempotent."""
        if self._killed:
            return
        self.request_stop()
        self._poll(timeout_s=max(0.0, timeout_s))  # before the kill: a clean return stays 0
        self._killed = True
        ray.kill(self._actor)
        self._poll(timeout_s=10.0)  # killed while running: wait for Ray to say so

    def __repr__(self) -> str:
        return f"RayActorHandle(name={self.name!r}, exitcode={self._exitcode})"


class RayActorLauncher:
    """Starts each worker as a non-detached Ray actor of this driver (see the module docstring).

    ``namespace``: the Ray namespace the actors are named in (each gets a unique name, so they
    show up in ``ray list actors``); ``pid_timeout_s``: how long a handle waits for its actor
    to start when its ``pid`` is first read.
    """

    def __init__(self, num_cpus: float = 0.0, namespace: str | None = None,
                 pid_timeout_s: float = 120.0) -> None:
        if not num_cpus >= 0:
            raise ValueError(f"RayActorLauncher num_cpus: must be >= 0, got {num_cpus!r}")
        self.num_cpus, self.namespace, self.pid_timeout_s = float(num_cpus), namespace, pid_timeout_s

    def start(self, target: Callable[..., Any], args: Sequence[Any], *, name: str) -> RayActorHandle:
        if not ray.is_initialized():
            raise RuntimeError("RayActorLauncher.start: Ray is not running in this process "
                               "(open the Ray-backed store first)")
        actor = (ray.remote(_WorkerHost)
                 .options(name=f"{name}-{uuid.uuid4().hex[:8]}", namespace=self.namespace,
                          num_cpus=self.num_cpus, max_concurrency=2, max_restarts=0,
                          lifetime="non_detached")
                 .remote())
        return RayActorHandle(actor, name, target, args, self.pid_timeout_s)


__all__ = ["RayActorHandle", "RayActorLauncher"]

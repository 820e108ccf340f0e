"""The watchdog that ends the Ray processes a driver started once that driver is gone.

Run as a script (``python -I _ray_reaper.py DRIVER_PID ROOT_PID...``) by
``ray_cluster.start_ray_on_loopback`` right after it started a local Ray: standard library
only, so it starts in milliseconds and holds no torch or Ray. Its standard input is a pipe
whose write end only the driver holds: end of file means the driver has exited, however it
went (a SIGKILL included).

Why: Ray ties its head processes (GCS, raylet) to the driver that started them (the kernel
kills them when the driver dies), but the raylet's own children, the dashboard and runtime-env
agents, notice the raylet's death only by polling, then try to report it to the GCS, which is
gone too, and wait out a 60 s timeout: a SIGKILLed run left them alive for about a minute.

Until the driver exits the watchdog records, every ``INTERVAL_S``, every process descending
from the roots it was given (the processes Ray started, found by the driver), each with its
start time so a recycled process id is never taken for one of them. Once the driver is gone it
SIGKILLs every recorded process still alive with the same start time, and their children, a
few rounds until none is left, then exits. It also exits once every recorded process has gone
while the driver lives (``ray.shutdown``): nothing is left to watch. Nothing else is touched:
no name matching, no process group.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

INTERVAL_S = 0.5  # how often the tree is re-read while the driver lives
SETTLE_S = 5.0  # rounds of killing after the driver's exit, at most this long


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of a live process (``/proc/PID/stat``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) "
    if fields[0] in (b"Z", b"X"):  # a zombie: dead already, only its parent's wait is due
        return None
    return int(fields[1]), int(fields[19])


def children() -> dict[int, list[tuple[int, int]]]:
    """Every live process by parent: ``{ppid: [(pid, start time)]}`` (``OSError`` without a
    Linux ``/proc``)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out.setdefault(st[0], []).append((int(name), st[1]))
    return out


def _grow(known: dict[int, int], roots: list[tuple[int, int]]) -> None:
    """Add ``roots`` (those still the same process) and every live descendant to ``known``."""
    kids = children()
    todo = [pid for pid, start in roots if _stat(pid) is not None and _stat(pid)[1] == start]
    for pid, start in roots:
        known.setdefault(pid, start)
    while todo:
        pid = todo.pop()
        for child, start in kids.get(pid, []):
            if child != os.getpid() and known.get(child) != start:
                known[child] = start
                todo.append(child)


def _alive(known: dict[int, int]) -> list[int]:
    """The recorded processes that are still the ones recorded."""
    return [pid for pid, start in known.items() if (st := _stat(pid)) is not None and st[1] == start]


def _kill_all(known: dict[int, int]) -> int:
    """SIGKILL every recorded process that is still the one recorded; how many were alive."""
    alive = _alive(known)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(alive)


def main(argv: list[str]) -> None:
    driver = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's Ctrl-C is not ours to die of
    roots = []
    for arg in argv[1:]:
        st = _stat(int(arg))
        if st is not None:
            roots.append((int(arg), st[1]))
    known: dict[int, int] = {}
    while True:
        _grow(known, roots)
        if not _alive(known):
            return  # all of them gone while the driver lives (ray.shutdown): nothing to watch
        ready, _, _ = select.select([0], [], [], INTERVAL_S)
        if ready and not os.read(0, 4096):
            break  # end of file: the driver is gone
        if _stat(driver) is None:
            break
    # the driver is gone: its Ray processes go too (children they start meanwhile included)
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        _grow(known, [(pid, start) for pid, start in known.items()])
        if not _kill_all(known):
            break
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1:])

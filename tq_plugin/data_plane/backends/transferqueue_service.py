"""TransferQueue's service on Ray (its controller and storage units): start, attach, stop.

The TransferQueue adapter (``transferqueue``) reaches the service through these functions and
puts every call under ``with_deadline``. Ray itself is started (on loopback, 127.0.0.1, with
token authentication) or attached by ``ray_cluster.start_ray_on_loopback``, the start-up the Ray
store uses too.

Safety: TransferQueue's ZMQ sockets are unauthenticated and unpickle what they receive. They
bind to the address of the Ray node their actor runs on, so a cluster with any node off
loopback is refused unless ``allow_non_loopback=True``, and then a warning says why.

Start-up never hangs: TransferQueue 0.1.11 waits forever when Ray lacks the CPUs its actors ask
for, so the CPUs are checked first, and every blocking call runs under a deadline.
``transfer_queue`` is imported only when a function here runs (``tq_plugin[tq]``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tq_plugin.data_plane.backends.ray_cluster import (
    LOOPBACK_NODE_IP,
    import_ray,
    nodes_off_loopback,
    start_ray_on_loopback,
)

log = logging.getLogger(__name__)

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tq-deadline")
_STATE: dict[str, Any] = {"started_here": False}
_STATE_LOCK = threading.Lock()


def import_transfer_queue() -> Any:
    """The ``transfer_queue`` module, or an ``ImportError`` that names the extra to install."""
    # TransferQueue reads its thread knobs at import; on a small box its default of 8 threads
    # logs a warning on every call.
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))
    os.environ.setdefault("TQ_LOGGING_LEVEL", "WARNING")
    try:
        import transfer_queue
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "TransferQueueDataPlane needs TransferQueue: pip install 'tq_plugin[tq]'"
        ) from e
    return transfer_queue


def with_deadline(what: str, timeout_s: float, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """``fn(**kwargs)``, or ``TimeoutError`` naming ``what`` after ``timeout_s`` seconds."""
    future = _POOL.submit(fn, **kwargs)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"TransferQueue {what} did not answer within {timeout_s}s") from None


def check_nodes_on_loopback(allow_non_loopback: bool) -> None:
    """Every node TransferQueue's actors may land on must be on loopback (or it is allowed)."""
    off = nodes_off_loopback()
    if not off:
        return
    ip = ", ".join(off)
    why = (
        f"TransferQueue binds its ZMQ sockets to its Ray node's address ({ip} is not loopback); "
        "those sockets are unauthenticated and unpickle what they receive, so anyone who can "
        "reach them can run code in the storage processes"
    )
    if not allow_non_loopback:
        raise RuntimeError(
            f"{why}. Start Ray on loopback ({LOOPBACK_NODE_IP}, the default when this adapter "
            "starts it), or set tq.backend.allow_non_loopback=true on a trusted network."
        )
    log.warning("%s (allowed by allow_non_loopback=True: keep this network trusted).", why)


def ensure_transfer_queue(*, num_storage_units: int = 1, init_timeout_s: float = 60.0,
                          address: str | None = None, ray_init: Mapping[str, Any] | None = None,
                          allow_non_loopback: bool = False,
                          allow_unauthenticated: bool = False) -> None:
    """Start TransferQueue (and Ray, on loopback) or attach to the running one; never hangs."""
    tq = import_transfer_queue()
    with _STATE_LOCK:
        start_ray_on_loopback(address, None, ray_init, allow_unauthenticated=allow_unauthenticated)
        ray = import_ray()
        check_nodes_on_loopback(allow_non_loopback)
        try:
            ray.get_actor("TransferQueueController", namespace="transfer_queue")
            running = True
        except ValueError:
            running = False
        if running:
            with_deadline("attach (tq.init)", init_timeout_s, tq.init)
            return
        if isinstance(num_storage_units, bool) or not isinstance(num_storage_units, int) or num_storage_units < 1:
            raise ValueError(f"tq.backend.num_storage_units must be an int >= 1, got {num_storage_units!r}")
        need = 1 + num_storage_units
        have = ray.available_resources().get("CPU", 0.0)
        if have < need:
            raise RuntimeError(
                f"TransferQueue needs {need} Ray CPUs (1 controller + {num_storage_units} storage "
                f"units, one each) but Ray has {have:g} available; start Ray with more num_cpus "
                "or lower tq.backend.num_storage_units (0.1.11 would otherwise wait forever)"
            )
        from omegaconf import OmegaConf

        conf = OmegaConf.create({
            # Polling: a starved claim returns empty at once instead of stalling the controller.
            "controller": {"polling_mode": True},
            "backend": {"storage_backend": "SimpleStorage",
                        "SimpleStorage": {"num_data_storage_units": num_storage_units}},
        })
        try:
            with_deadline("start-up (tq.init)", init_timeout_s, tq.init, conf=conf)
        except TimeoutError:
            with_deadline("clean-up after a failed start", 30.0, tq.close)
            raise
        _STATE["started_here"] = True


def shutdown_transfer_queue(timeout_s: float = 60.0) -> None:
    """Stop TransferQueue if this process started it (its actors would die with it anyway)."""
    with _STATE_LOCK:
        if _STATE["started_here"]:
            with_deadline("shutdown (tq.close)", timeout_s, import_transfer_queue().close)
            _STATE["started_here"] = False

"""Ray start-up and authentication for the backends that run on Ray.

``RayDataPlane`` (``ray_actor``) and the TransferQueue adapter (``transferqueue_service``) both
start Ray, or attach to a running cluster, through ``start_ray_on_loopback``:

* without an address Ray starts on ``127.0.0.1`` with token authentication and no dashboard,
  so everything it (and the stores) open listens on loopback only;
* attaching sends this host's token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
  ``~/.ray/auth_token``);
* either way a cluster that answers a caller sending no token is refused
  (``UnauthenticatedClusterError``) unless ``allow_unauthenticated``;
* a Ray started here is watched (``_ray_reaper``): once this process is gone, however it went
  (a SIGKILL included), the processes that start made are ended within a second, instead of
  Ray's agents outliving a killed run by a minute.

``nodes_off_loopback`` lists the cluster's node addresses that are not loopback (the
TransferQueue adapter refuses them: its sockets are unauthenticated). Ray is imported only when
a function here runs, so the base install never needs it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

# A local Ray's node address: with it (and ``_loopback_kept``) every Ray server binds loopback.
LOOPBACK_NODE_IP = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# A read-only GCS call every Ray version with token authentication serves (its first, at attach).
_GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"

_VERIFIED: set[str] = set()  # GCS addresses seen refusing a caller without the token


class UnauthenticatedClusterError(RuntimeError):
    """The Ray cluster runs (or would run) without token authentication, and that was not allowed."""


def import_ray() -> Any:
    """The ``ray`` module, or an ``ImportError`` that names the extra to install."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the Ray backends need Ray: pip install 'tq_plugin[ray]'; or use LocalDataPlane"
        ) from e
    return ray


def _token_available() -> bool:
    """Whether this host holds a Ray token where Ray looks for one."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or (
        os.path.isfile(path) if path else os.path.isfile(os.path.expanduser("~/.ray/auth_token")))


def _authenticating(allow_unauthenticated: bool, attaching: bool) -> None:
    """Before ``ray.init``: token authentication on for this process and every one Ray starts.

    Ray reads ``RAY_AUTH_MODE`` from the environment (its processes inherit it), and the token
    from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``
    (generated on a first local start). ``RAY_AUTH_MODE=disabled`` is refused unless allowed.
    """
    mode = os.environ.get(AUTH_MODE_ENV, "").lower()
    if not mode and attaching and allow_unauthenticated and not _token_available():
        return  # no token to send: the cluster must be one that does not ask for it
    if mode and mode != "token":
        if not allow_unauthenticated:
            raise UnauthenticatedClusterError(
                f"{AUTH_MODE_ENV}={os.environ[AUTH_MODE_ENV]} turns off Ray's token "
                "authentication, so anyone who can reach the cluster's ports can run code in it; "
                f"unset it (or set {AUTH_MODE_ENV}=token), or set "
                "tq.backend.allow_unauthenticated=true on a network only the job's hosts reach"
            )
        log.warning("Ray runs without token authentication (%s=%s, allowed by "
                    "allow_unauthenticated=True)", AUTH_MODE_ENV, os.environ[AUTH_MODE_ENV])
        return
    os.environ[AUTH_MODE_ENV] = "token"
    # Ray caches its config at import (maybe before the variable was set): re-read it.
    from ray._raylet import Config

    Config.initialize("")


def cluster_answers_without_token(gcs_address: str, timeout_s: float = 10.0) -> bool:
    """True when the GCS at ``gcs_address`` serves a caller that sends no token.

    One read-only call (``GetClusterId``) on a plain channel that carries no token: a cluster
    with token authentication answers ``UNAUTHENTICATED``. Any other failure (TLS, a refused
    connection) also means it did not answer.
    """
    import grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            channel.unary_unary(_GCS_PROBE)(b"", timeout=timeout_s)
        except grpc.RpcError:
            return False
    return True


def _refuse_unauthenticated(allow_unauthenticated: bool) -> None:
    """Stop unless the cluster this process runs in refuses callers without the token."""
    gcs = str(import_ray().get_runtime_context().gcs_address)
    if gcs in _VERIFIED or not cluster_answers_without_token(gcs):
        _VERIFIED.add(gcs)
        return
    why = (f"the Ray cluster at {gcs} answers callers that send no token (it runs without "
           "token authentication): anyone who can reach its ports can run code in it")
    if not allow_unauthenticated:
        raise UnauthenticatedClusterError(
            f"{why}. Start it with {AUTH_MODE_ENV}=token on every node (Ray >= 2.52), or set "
            "tq.backend.allow_unauthenticated=true on a network only the job's hosts reach."
        )
    log.warning("%s (allowed by allow_unauthenticated=True).", why)
    _VERIFIED.add(gcs)


@contextlib.contextmanager
def _loopback_kept(node_ip: str | None) -> Iterator[None]:
    """Keep a ``127.0.0.1`` node address on loopback during ``ray.init``.

    On Linux Ray replaces ``127.0.0.1`` (as node address or in a GCS address) with the
    machine's routable one, and its gRPC servers bind every interface unless the node address
    is ``127.0.0.1``. Ray's single-machine mode (its default on macOS and Windows) skips the
    replacement; this turns it on for the call, and for the processes the call starts.
    """
    if node_ip not in ("127.0.0.1", "localhost"):
        yield
        return
    from ray._private import ray_constants

    before_env = os.environ.get(_SINGLE_MACHINE_ENV)
    before = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
        if before_env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = before_env


def start_ray_on_loopback(address: str | None, namespace: str | None,
                          ray_init: Mapping[str, Any] | None, *,
                          allow_unauthenticated: bool = False) -> None:
    """Start Ray (or attach to ``address``) unless this process already runs it; then make
    sure the cluster authenticates.

    Without an address Ray starts a local instance on ``127.0.0.1`` with token authentication
    and no dashboard: everything it and the stores open listens on loopback only. Attaching
    sends this host's token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``). Either way a cluster that answers callers without the token is
    refused (``UnauthenticatedClusterError``) unless ``allow_unauthenticated``.
    """
    ray = import_ray()
    if ray.is_initialized():
        _refuse_unauthenticated(allow_unauthenticated)
        return
    opts = dict(ray_init or {})
    in_opts = opts.pop("address", None)
    address = address or in_opts
    _authenticating(allow_unauthenticated, attaching=bool(address and address != "local"))
    if address and address != "local":
        # Attaching to a running cluster: its resources are set; Ray refuses them from a
        # driver that joins (num_cpus, num_gpus, resources, object_store_memory...).
        for key in ("num_cpus", "num_gpus", "resources", "object_store_memory",
                    "include_dashboard", "dashboard_host", "_node_ip_address"):
            opts.pop(key, None)
        host = address.rsplit(":", 1)[0]
        if host.startswith("127."):
            # A cluster on loopback: join it there too (Ray would pick the routable address).
            opts["_node_ip_address"] = host
        with _loopback_kept(host):
            ray.init(address=address, namespace=namespace, **opts)
    else:
        opts.setdefault("_node_ip_address", LOOPBACK_NODE_IP)
        opts.setdefault("include_dashboard", False)
        before = _own_children()
        with _loopback_kept(opts["_node_ip_address"]):
            ray.init(address="local", namespace=namespace, **opts)
        _reap_on_exit(before)
    try:
        _refuse_unauthenticated(allow_unauthenticated)
    except UnauthenticatedClusterError:
        ray.shutdown()
        raise


# The watchdogs this process started, each with the pipe end it holds open for its life.
_REAPERS: list[tuple[Any, int]] = []


def _own_children() -> set[int] | None:
    """This process's children (Linux ``/proc``), or None where they cannot be listed."""
    from tq_plugin.data_plane.backends._ray_reaper import children

    try:
        return {pid for pid, _ in children().get(os.getpid(), [])}
    except OSError:
        return None


def _reap_on_exit(before: set[int] | None) -> None:
    """Start the watchdog (``_ray_reaper``) that ends the processes the ``ray.init`` just made
    (they are this process's new children, and their descendants) once this process is gone.

    Ray kills its GCS and raylet with their driver, but the raylet's agents notice only by
    polling and then wait 60 s on the dead GCS: a SIGKILLed run left them alive a minute. The
    watchdog reads a pipe whose write end only this process holds (end of file: the driver
    exited, however), in its own session (a Ctrl-C to the run's process group is not its)."""
    after = _own_children()
    if before is None or after is None:
        log.warning("cannot list this process's children: the Ray processes it started are "
                    "not watched, and a killed run may leave Ray's agents alive for a minute")
        return
    roots = sorted(after - before)
    if not roots:
        return
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", os.path.join(os.path.dirname(__file__), "_ray_reaper.py"),
             str(os.getpid()), *map(str, roots)],
            stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True)
    except OSError as e:
        os.close(write_end)
        log.warning("could not start the Ray process watchdog (%s): a killed run may leave "
                    "Ray's agents alive for a minute", e)
        return
    finally:
        os.close(read_end)
    _REAPERS.append((proc, write_end))  # the write end stays open for this process's life
    log.debug("Ray processes %s watched by pid %d", roots, proc.pid)


def gcs_address() -> str:
    """The GCS address of the cluster this process runs in (what other processes attach with)."""
    return str(import_ray().get_runtime_context().gcs_address)


def nodes_off_loopback() -> list[str]:
    """The addresses (this process's node and every live node) that are not loopback, sorted."""
    ray = import_ray()
    ips = {ray.util.get_node_ip_address()}
    ips.update(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive"))
    return sorted(ip for ip in ips if not ipaddress.ip_address(ip.strip("[]")).is_loopback)

"""What a run listens on: every listening socket of the processes the distributed backends start
(local Ray, the store actor, TransferQueue's controller and storage unit, a worker actor) is on
loopback, or refuses a caller without Ray's token; and a caller without the token is refused.

The processes are this test process's tree (the session's Ray was started from here, so its GCS,
raylet, agents and actors are all descendants). SECURITY.md lists what this measures.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
psutil = pytest.importorskip("psutil")

# Read-only calls of the Ray services a run hosts; a server without the method answers
# UNIMPLEMENTED, and the next one is tried.
_GRPC_PROBES = ("/ray.rpc.NodeInfoGcsService/GetClusterId",
                "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
                "/ray.rpc.NodeManagerService/GetSystemConfig",
                "/ray.rpc.ReporterService/HealthCheck")


def _listening() -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of this process tree."""
    me = psutil.Process()
    out = set()
    for proc in [me, *me.children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="inet"), proc.name()
        except psutil.Error:  # exited meanwhile
            continue
        out.update((c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN)
    return sorted(out, key=lambda r: r[1])


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _answers_without_token(host: str, port: int) -> bool:
    """True when the server at host:port serves a request that carries no token: an HTTP GET
    that is not 401/403, a ZMQ greeting (ZMQ has no token), or a gRPC call that is not
    UNAUTHENTICATED."""
    import grpc

    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: probe\r\n\r\n")
            head = s.recv(64)
    except OSError:
        head = b""
    if head.startswith(b"HTTP/1."):
        return int(head.split()[1]) not in (401, 403)
    if head.startswith(b"\xff"):  # ZMTP signature: TransferQueue's sockets
        return True
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        for path in _GRPC_PROBES:
            try:
                channel.unary_unary(path)(b"", timeout=3)
                return True
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                return err.code() not in (grpc.StatusCode.UNAUTHENTICATED,
                                          grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.DEADLINE_EXCEEDED)
    return False


def _routable_ip() -> str | None:
    """This machine's address on its default route (how another host would reach it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            return s.getsockname()[0]
        except OSError:
            return None


def _loop(stop: threading.Event) -> None:
    stop.wait(120)


def test_every_socket_a_run_opens_is_on_loopback_or_asks_for_the_token(tq_session):
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane
    from tq_plugin.data_plane.backends.ray_workers import RayActorLauncher
    from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

    stores = [RayDataPlane("exposure", actor_name="tq_plugin_tests"),
              TransferQueueDataPlane("exposure")]
    for store in stores:
        store.register_partition("p", [])
    worker = RayActorLauncher().start(_loop, (), name="exposure-worker")
    try:
        assert worker.pid > 0  # the worker's process is up and listening
        sockets = _listening()
        names = {name for _, _, name in sockets}
        assert {"gcs_server", "raylet"} <= names, sockets  # the tree holds the whole session
        assert any("TransferQueueController" in n for n in names), sockets
        routable = _routable_ip()
        exposed = []
        for ip, port, name in sockets:
            if _is_loopback(ip):
                continue
            host = routable if ip in ("0.0.0.0", "::") else ip
            if host is None or _answers_without_token(host, port):
                exposed.append((ip, port, name))
        assert not exposed, f"listening off loopback and answering without the token: {exposed}"
    finally:
        worker.stop(5.0)
        for store in stores:
            store.close()


def test_the_probe_sees_what_answers_without_the_token(ray_session):
    """The probe is not blind: the GCS refuses it, a plain HTTP server answers it."""
    import http.server

    gcs = ray_session.get_runtime_context().gcs_address
    host, port = gcs.rsplit(":", 1)
    assert not _answers_without_token(host, int(port))
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        assert _answers_without_token("127.0.0.1", server.server_address[1])
    finally:
        server.server_close()


ATTACH = """
import sys, ray
try:
    ray.init(address=sys.argv[1], _node_ip_address="127.0.0.1", log_to_driver=False)
except Exception as err:
    print(type(err).__name__)
else:
    print("attached")
"""


def test_a_driver_with_the_wrong_token_is_refused(ray_session):
    from tq_plugin.data_plane.backends.ray_cluster import cluster_answers_without_token

    gcs = ray_session.get_runtime_context().gcs_address
    assert not cluster_answers_without_token(gcs)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64,
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", ATTACH, gcs], capture_output=True, text=True,
                         timeout=120, env=env, check=False)
    assert "attached" not in out.stdout, out.stdout + out.stderr[-2000:]
    assert "Auth" in out.stdout + out.stderr, out.stdout + out.stderr[-2000:]


UNAUTHENTICATED = """
import json, sys
from tq_plugin.data_plane.backends.ray_cluster import (
    UnauthenticatedClusterError, cluster_answers_without_token, start_ray_on_loopback)
ray_init = {"num_cpus": 1, "log_to_driver": False}
try:
    start_ray_on_loopback(None, None, ray_init)
    refused_start = False
except UnauthenticatedClusterError:
    refused_start = True
start_ray_on_loopback(None, None, ray_init, allow_unauthenticated=True)
import ray
from tq_plugin.data_plane.backends import ray_cluster
gcs = ray.get_runtime_context().gcs_address
answers = cluster_answers_without_token(gcs)
ray_cluster._VERIFIED.clear()
try:
    ray_cluster._refuse_unauthenticated(False)
    refused_attach = False
except UnauthenticatedClusterError:
    refused_attach = True
ray.shutdown()
print(json.dumps([refused_start, answers, refused_attach]))
"""


def test_a_cluster_without_token_authentication_is_refused_unless_allowed():
    """RAY_AUTH_MODE=disabled: the backends refuse to start such a cluster, and one started
    anyway (allowed) answers callers without a token, which the attach check refuses."""
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_AUTH_TOKEN", None)
    out = subprocess.run([sys.executable, "-c", UNAUTHENTICATED], capture_output=True, text=True,
                         timeout=240, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[true, true, true]"

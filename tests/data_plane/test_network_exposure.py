"""What a run listens on: every listening socket of the processes the distributed backends start
(local Ray, the store actor, TransferQueue's controller and storage unit, a worker actor) binds
127.0.0.1, as SECURITY.md says; a caller without Ray's token, or with a wrong one, is refused;
TransferQueue refuses a Ray node off loopback.

The processes are this test process's tree (the session's Ray was started from here, so its GCS,
raylet, agents and actors are all descendants). SECURITY.md lists what this measures. The checks
that need no Ray (the probe, the node check over a stand-in ``ray``) run in the fast tier.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

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


def _binds_127_0_0_1(ip: str) -> bool:
    """The address is 127.0.0.1 (also as the IPv4-mapped ``::ffff:127.0.0.1`` a dual-stack
    socket reports)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(addr, "ipv4_mapped", None) or addr) == ipaddress.ip_address("127.0.0.1")


def _answers_without_token(host: str, port: int) -> bool:
    """True when the server at host:port serves a request that carries no token: an HTTP GET
    that is not 401/403, a ZMQ greeting (ZMQ has no token), or a gRPC call that is not
    UNAUTHENTICATED."""
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
    import grpc

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


def _loop(stop: threading.Event) -> None:
    stop.wait(120)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_socket_a_run_opens_binds_127_0_0_1(tq_session):
    """SECURITY.md: every port of the run binds 127.0.0.1, whether or not it asks for the token
    (a socket on another address of this tree fails the test, whoever opened it)."""
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
        elsewhere = [s for s in sockets if not _binds_127_0_0_1(s[0])]
        assert not elsewhere, f"listening on another address than 127.0.0.1: {elsewhere}"
    finally:
        worker.stop(5.0)
        for store in stores:
            store.close()


def test_only_127_0_0_1_passes_the_audit():
    assert _binds_127_0_0_1("127.0.0.1") and _binds_127_0_0_1("::ffff:127.0.0.1")
    for other in ("0.0.0.0", "::", "127.0.0.2", "::1", "10.1.2.3", "::ffff:10.1.2.3", "fe80::1%eth0"):
        assert not _binds_127_0_0_1(other), other


def _serve_once(reply: bytes) -> tuple[int, threading.Thread]:
    """A server on 127.0.0.1 that answers one connection with ``reply``; its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


@pytest.mark.parametrize(("reply", "answers"), [
    (b"HTTP/1.0 200 OK\r\n\r\nmetrics", True),
    (b"HTTP/1.0 401 Unauthorized\r\n\r\n", False),
    (b"HTTP/1.1 403 Forbidden\r\n\r\n", False),
    (b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", True),  # a ZMTP greeting: ZMQ asks for nothing
])
def test_the_probe_tells_what_answers_without_the_token(reply, answers):
    port, thread = _serve_once(reply)
    assert _answers_without_token("127.0.0.1", port) is answers
    thread.join()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gcs_refuses_the_probe(ray_session):
    gcs = ray_session.get_runtime_context().gcs_address
    host, port = gcs.rsplit(":", 1)
    assert not _answers_without_token(host, int(port))


def _fake_ray(node_ip: str, nodes: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(util=SimpleNamespace(get_node_ip_address=lambda: node_ip),
                           nodes=lambda: nodes)


@pytest.mark.parametrize(("node_ip", "nodes", "off"), [
    ("127.0.0.1", [{"NodeManagerAddress": "127.0.0.1", "Alive": True}], []),
    ("::1", [{"NodeManagerAddress": "[::1]", "Alive": True}], []),
    ("10.1.2.3", [{"NodeManagerAddress": "127.0.0.1", "Alive": True}], ["10.1.2.3"]),
    # this process on loopback, another live node of the cluster is not: ray.nodes() names it
    ("127.0.0.1", [{"NodeManagerAddress": "127.0.0.1", "Alive": True},
                   {"NodeManagerAddress": "10.9.8.7", "Alive": True},
                   {"NodeManagerAddress": "10.0.0.5", "Alive": False}], ["10.9.8.7"]),
])
def test_transferqueue_refuses_a_node_off_loopback_unless_allowed(monkeypatch, caplog, node_ip,
                                                                   nodes, off):
    from tq_plugin.data_plane.backends import ray_cluster
    from tq_plugin.data_plane.backends import transferqueue_service as mod

    monkeypatch.setattr(ray_cluster, "import_ray", lambda: _fake_ray(node_ip, nodes))
    assert ray_cluster.nodes_off_loopback() == off
    if not off:
        mod.check_nodes_on_loopback(False)
        return
    with pytest.raises(RuntimeError, match=rf"{off[0]}.*not loopback.*unauthenticated.*"
                                           r"allow_non_loopback"):
        mod.check_nodes_on_loopback(False)
    with caplog.at_level(logging.WARNING, logger=mod.__name__):
        mod.check_nodes_on_loopback(True)
    assert "unpickle" in caplog.text and off[0] in caplog.text


ATTACH = """
import sys, ray
try:
    ray.init(address=sys.argv[1], _node_ip_address="127.0.0.1", log_to_driver=False)
except Exception as err:
    print(type(err).__name__)
else:
    print("attached")
"""


def _gcs_call(gcs: str, token: str) -> object:
    """A read-only GCS call carrying ``token`` as Ray sends it; the gRPC status code."""
    import grpc

    with grpc.insecure_channel(gcs) as channel:
        try:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(
                b"", timeout=10, metadata=[("authorization", f"Bearer {token}")])
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_driver_with_the_wrong_token_is_refused(ray_session):
    """The GCS answers a call with a wrong token UNAUTHENTICATED and the same call with the
    session's token; a driver attaching with the wrong token is refused, with the right one it
    attaches (so the token alone makes the difference)."""
    import grpc

    from tq_plugin.data_plane.backends.ray_cluster import cluster_answers_without_token

    gcs = ray_session.get_runtime_context().gcs_address
    assert not cluster_answers_without_token(gcs)
    wrong, right = "0" * 64, os.environ["RAY_AUTH_TOKEN"]
    assert wrong != right
    assert _gcs_call(gcs, wrong) == grpc.StatusCode.UNAUTHENTICATED
    assert _gcs_call(gcs, right) == grpc.StatusCode.OK
    drivers = {}
    for token in (wrong, right):
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONWARNINGS": "ignore"}
        drivers[token] = subprocess.Popen([sys.executable, "-c", ATTACH, gcs], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
    outs = {token: p.communicate(timeout=120) for token, p in drivers.items()}
    # ray.init reports the refused handshake as a ConnectionError ("Failed to connect")
    assert outs[wrong][0].strip().splitlines()[-1:] == ["ConnectionError"], outs[wrong]
    assert outs[right][0].strip().splitlines()[-1:] == ["attached"], outs[right]


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


@pytest.mark.slow
@pytest.mark.timeout(300)
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

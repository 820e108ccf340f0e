"""Every distributed backend across two Ray nodes (``ray.cluster_utils.Cluster`` on 127.0.0.2 and
127.0.0.3): a writer task pinned to one node, a reader task pinned to the other, byte-exact.

The cluster runs in a subprocess with its own driver: this pytest process already runs the
session's single-node Ray, and one process joins one cluster.
"""

from __future__ import annotations

import json

import pytest

from .conftest import HAVE_TQ, run_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TWO_NODES = """
import json, sys
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

kind = sys.argv[1]
small = {"object_store_memory": 128 << 20}
cluster = Cluster(initialize_head=True, head_node_args={
    "node_ip_address": "127.0.0.2", "num_cpus": 2, "include_dashboard": False, **small})
cluster.add_node(node_ip_address="127.0.0.3", num_cpus=2, **small)
ray.init(address=cluster.address, _node_ip_address="127.0.0.2", log_to_driver=False)
cluster.wait_for_nodes()
node_of = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
if kind == "ray":
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane
    client = RayDataPlane("two-node")
else:
    from tq_plugin.data_plane.backends.transferqueue import (
        TransferQueueDataPlane, shutdown_transfer_queue)
    client = TransferQueueDataPlane("two-node", num_storage_units=2, init_timeout_s=300)
client.register_partition("train", [])

@ray.remote(num_cpus=0)
def write(client, seed):
    ids, fields = batch(seed)
    client.put_samples(ids, "train", fields)
    return ray.util.get_node_ip_address(), digest(fields)

@ray.remote(num_cpus=0)
def read(client, seed):
    ids, fields = batch(seed)
    return ray.util.get_node_ip_address(), digest(client.get_samples(ids, "train", sorted(fields)))

def on(ip):
    return NodeAffinitySchedulingStrategy(node_of[ip], soft=False)

wrote = ray.get(write.options(scheduling_strategy=on("127.0.0.2")).remote(client, 5), timeout=300)
got = ray.get(read.options(scheduling_strategy=on("127.0.0.3")).remote(client, 5), timeout=300)
back = ray.get(write.options(scheduling_strategy=on("127.0.0.3")).remote(client, 6), timeout=300)
again = ray.get(read.options(scheduling_strategy=on("127.0.0.2")).remote(client, 6), timeout=300)
client.close()
if kind != "ray":
    shutdown_transfer_queue()
ray.shutdown()
cluster.shutdown()
print(json.dumps({"wrote": wrote, "read": got, "wrote_b": back, "read_b": again}))
"""


@pytest.mark.parametrize("kind", ["ray", "transferqueue"])
def test_a_row_written_on_one_node_reads_back_byte_exact_on_the_other(kind):
    pytest.importorskip("ray")
    if kind == "transferqueue" and not HAVE_TQ:
        pytest.skip("transferqueue is not installed (pip install 'tq_plugin[tq]')")
    out = json.loads(run_python(TWO_NODES, kind, timeout=540))
    assert out["wrote"][0] == "127.0.0.2" and out["read"][0] == "127.0.0.3"
    assert out["read"][1] == out["wrote"][1]
    assert out["wrote_b"][0] == "127.0.0.3" and out["read_b"][0] == "127.0.0.2"
    assert out["read_b"][1] == out["wrote_b"][1]

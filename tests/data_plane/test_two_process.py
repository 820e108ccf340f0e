"""Every distributed backend, across processes: one process writes and exits, another attaches
(from a pickled client) and reads the rows back byte-exact."""

from __future__ import annotations

import pickle
import uuid

import pytest

from .conftest import run_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WRITE = """
import pickle, sys
client = pickle.load(open(sys.argv[1], "rb"))
ids, fields = batch(int(sys.argv[2]))
client.put_samples(ids, "train", fields)
print(digest(client.get_samples(ids, "train", sorted(fields))))
"""

READ = """
import pickle, sys
client = pickle.load(open(sys.argv[1], "rb"))
ids, fields = batch(int(sys.argv[2]))
print(digest(client.get_samples(ids, "train", sorted(fields))))
"""


def _owner(kind: str, request):
    if kind == "ray":
        request.getfixturevalue("ray_session")
        from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

        return RayDataPlane(f"two-proc-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")
    request.getfixturevalue("tq_session")
    from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

    return TransferQueueDataPlane(f"two-proc-{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("kind", ["ray", "transferqueue"])
def test_a_row_written_by_one_process_reads_back_byte_exact_in_another(kind, request, tmp_path):
    owner = _owner(kind, request)
    try:
        owner.register_partition("train", [])
        path = tmp_path / "client.pkl"
        path.write_bytes(pickle.dumps(owner))
        written = run_python(WRITE, str(path), "7")  # the writer exits before the read
        read = run_python(READ, str(path), "7")
        assert read == written
        assert len(owner.list_sample_ids("train")) == 64
    finally:
        owner.close()

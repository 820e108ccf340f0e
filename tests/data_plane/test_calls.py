"""The data-plane calling convention (``tq_plugin.data_plane.calls``): the old positional order
still works for one release, with a ``DeprecationWarning`` at the caller's line naming the
keyword call, and gives the same result as the keyword call; the keyword form itself runs over
every backend in ``test_backend_conformance.py``."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane, uniform_call
from tq_plugin.data_plane.calls import OLD_ORDER, as_keywords, partition_of
from tq_plugin.data_plane.client import bind_keywords
from tq_plugin.lightning.metered import MeteredClient
from tq_plugin.rl.topology.exchange import SplitClient


def _fields(n: int = 2) -> dict[str, torch.Tensor]:
    return {"r": torch.arange(n, dtype=torch.float32), "tok": torch.arange(3 * n).reshape(n, 3)}


def _deprecations(record) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, DeprecationWarning)]


def test_the_old_order_maps_with_one_warning_at_the_caller_and_the_same_result(client):
    client.register_partition("p", [])
    with pytest.warns(DeprecationWarning) as record:
        meta = client.put_samples(["a", "b"], "p", _fields(), [{"u": 1}, {"u": 2}])
    (w,) = _deprecations(record)
    assert w.filename == __file__  # stacklevel: the line that made the call
    assert "put_samples(partition_id=..., sample_ids=..., fields=..., tags=...)" in str(w.message)
    assert meta.partition_id == "p" and list(meta.sample_ids) == ["a", "b"]

    new = client.get_samples(partition_id="p", sample_ids=["b", "a"], select_fields=["r", "tok"])
    with pytest.warns(DeprecationWarning, match=r"get_samples\(partition_id=\.\.\., "
                                                r"sample_ids=\.\.\., select_fields=\.\.\.\)"):
        old = client.get_samples(["b", "a"], "p", ["r", "tok"])
    assert torch.equal(old["r"], new["r"]) and torch.equal(old["tok"], new["tok"])

    with pytest.warns(DeprecationWarning, match=r"get_tags\(partition_id="):
        assert client.get_tags(["a"], "p") == client.get_tags(partition_id="p", sample_ids=["a"])

    with pytest.warns(DeprecationWarning, match=r"clear_samples\(partition_id="):
        client.clear_samples(["a"], "p")
    assert client.list_sample_ids("p") == ["b"]
    with pytest.warns(DeprecationWarning):
        client.clear_samples(None, "p")  # None: the whole partition, as before
    assert client.list_sample_ids("p") == []


def test_positions_and_keywords_mix_as_the_old_signature_took_them():
    dp = LocalDataPlane()
    dp.register_partition("p", [])
    with pytest.warns(DeprecationWarning):
        dp.put_samples(["a"], "p", fields={"r": torch.ones(1)}, mode="insert")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="insert"):
        dp.put_samples(["a"], partition_id="p", fields={"r": torch.ones(1)}, mode="insert")
    assert dp.get_samples(partition_id="p", sample_ids=["a"], select_fields=["r"])["r"].tolist() == [1.0]


def test_keyword_calls_warn_nothing():
    dp = LocalDataPlane()
    dp.register_partition("p", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.put_samples(partition_id="p", sample_ids=["a"], fields={"r": torch.ones(1)})
        dp.get_samples(partition_id="p", sample_ids=["a"], select_fields=["r"])
        dp.get_tags(partition_id="p", sample_ids=["a"])
        dp.clear_samples(partition_id="p", sample_ids=["a"])


@pytest.mark.parametrize("call, match", [
    (lambda dp: dp.put_samples("p", ["a"], {"r": torch.ones(1)}), "by keyword"),  # new order
    (lambda dp: dp.clear_samples("p"), "by keyword"),
    (lambda dp: dp.get_samples(["a"], "p", ["r"], ["r"]), "at most 3 positional"),
    (lambda dp: dp.put_samples(["a"], "p", partition_id="q"), "multiple values for argument"),
])
def test_calls_that_cannot_be_mapped_are_refused_before_anything_is_written(call, match):
    dp = LocalDataPlane()
    dp.register_partition("p", [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=match):
            call(dp)
    assert dp.list_sample_ids("p") == []


def test_the_wrapper_keeps_the_keyword_only_signature_and_the_docstring():
    for name in OLD_ORDER:
        method = getattr(LocalDataPlane, name)
        params = list(inspect.signature(method).parameters.values())[1:]
        assert [p.name for p in params[:2]] == ["partition_id", "sample_ids"], name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), name
        assert method.__doc__ and method.__name__ == name
    with pytest.raises(TypeError, match="not a row method"):
        uniform_call(LocalDataPlane.list_sample_ids)


def test_helpers_read_both_orders():
    assert partition_of("put_samples", (["a"], "p"), {}) == "p"
    assert partition_of("get_tags", (), {"partition_id": "q", "sample_ids": ["a"]}) == "q"
    assert partition_of("claim_meta", ("t", "task"), {}) == "t"
    assert as_keywords("clear_samples", (), {"partition_id": "p"}) == {"partition_id": "p"}
    with pytest.warns(DeprecationWarning) as record:
        kw = bind_keywords("get_samples", (["a"], "p", ["r"]), {}, stacklevel=1)
    assert kw == {"partition_id": "p", "sample_ids": ["a"], "select_fields": ["r"]}
    assert _deprecations(record)[0].filename == __file__


def test_wrappers_map_the_old_order_once_and_warn_at_their_caller():
    shared, local = LocalDataPlane(), LocalDataPlane()
    split = SplitClient(shared, local, {"shared"})
    for c in (shared, local):
        c.register_partition("shared", [])
        c.register_partition("mine", [])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        split.put_samples(["a"], "shared", {"r": torch.ones(1)})
        split.put_samples(["b"], "mine", {"r": torch.ones(1)})
    assert [w.filename for w in _deprecations(record)] == [__file__, __file__]
    split.put_samples(partition_id="mine", sample_ids=["c"], fields={"r": torch.ones(1)})
    assert shared.list_sample_ids("shared") == ["a"] and shared.list_sample_ids("mine") == []
    assert local.list_sample_ids("mine") == ["b", "c"]

    metered = MeteredClient(shared)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        metered.put_samples(["d", "e"], "shared", {"r": torch.ones(2)})
        got = metered.get_samples(["e"], "shared", ["r"])
        metered.clear_samples(["a"], "shared")
    assert [w.filename for w in _deprecations(record)] == [__file__] * 3
    assert got["r"].tolist() == [1.0]
    c = metered.counters
    assert (c.rows_written, c.rows_read, c.rows_cleared) == (2, 1, 1)
    metered.clear_samples(partition_id="shared")  # sample_ids defaults to None: all of it
    assert shared.list_sample_ids("shared") == []


def test_nothing_to_clear_is_reported_at_the_caller():
    dp = LocalDataPlane()
    with pytest.warns(RuntimeWarning, match="found nothing to clear") as record:
        dp.clear_samples(partition_id="nowhere")
    assert record[0].filename == __file__

"""Task-mediated reads on the embedded backend: claim_meta, get_data, consumption status
(reference §4 (A), §14.2)."""

from __future__ import annotations

import threading

import pytest
import torch

from tq_plugin.data_plane import DataPlaneClosedError, LocalDataPlane


@pytest.fixture
def dp():
    c = LocalDataPlane()
    c.register_partition("train", [], consumer_tasks=["prev_lp", "train"])
    yield c
    c.close()


def _put(dp, ids, **cols):
    n = len(ids)
    fields = {"input_lengths": torch.arange(1, n + 1), **{k: v for k, v in cols.items()}}
    dp.put_samples(
        partition_id="train", sample_ids=ids, fields=fields, tags=[{"i": i} for i in range(n)]
    )


def test_claim_advances_the_task_cursor_and_consumption(dp):
    _put(dp, ["a", "b", "c"])
    m = dp.claim_meta("train", "prev_lp", ["input_lengths"], 2)
    assert m.sample_ids == ["a", "b"] and m.task_name == "prev_lp"
    assert m.fields == ["input_lengths"] and m.sequence_lengths == [1, 2]
    assert m.tags == [{"i": 0}, {"i": 1}]
    assert not dp.check_consumption_status("train", ["prev_lp"])
    assert dp.claim_meta("train", "prev_lp", ["input_lengths"], 5).sample_ids == ["c"]
    assert dp.check_consumption_status("train", ["prev_lp"])
    assert not dp.check_consumption_status("train", ["prev_lp", "train"])
    assert dp.claim_meta("train", "prev_lp", ["input_lengths"], 5, blocking=False).size == 0
    assert dp.claim_meta("train", "train", ["input_lengths"], 5).sample_ids == ["a", "b", "c"]


def test_claim_skips_rows_whose_required_fields_are_not_written(dp):
    _put(dp, ["a", "b"])
    dp.put_samples(partition_id="train", sample_ids=["b"], fields={"advantages": torch.zeros(1)})
    m = dp.claim_meta("train", "train", ["input_lengths", "advantages"], 4, blocking=False)
    assert m.sample_ids == ["b"]


def test_claim_of_an_unregistered_task_names_it(dp):
    with pytest.raises(KeyError, match="unknown consumer task 'prevlp'"):
        dp.claim_meta("train", "prevlp", ["input_lengths"], 1)


def test_blocking_claim_waits_for_a_producer_and_times_out(dp):
    threading.Timer(0.05, lambda: _put(dp, ["late"])).start()
    m = dp.claim_meta("train", "train", ["input_lengths"], 1, timeout_s=10)
    assert m.sample_ids == ["late"]
    with pytest.raises(TimeoutError, match="within 0.05s"):
        dp.claim_meta("train", "train", ["input_lengths"], 1, timeout_s=0.05)


def test_close_wakes_a_blocked_claim(dp):
    """The claim's wait ends by close's notify, not by its own timeout (``wait`` returns True
    only when notified)."""
    waiting, woken, raised = threading.Event(), [], []
    wait = dp._produced.wait

    def logged_wait(timeout=None):
        waiting.set()
        woken.append(wait(timeout))
        return woken[-1]

    def claim():
        try:
            dp.claim_meta("train", "train", ["input_lengths"], 1, timeout_s=30)
        except Exception as exc:  # noqa: BLE001 - the test asserts which one
            raised.append(exc)

    dp._produced.wait = logged_wait
    claimer = threading.Thread(target=claim)
    claimer.start()
    assert waiting.wait(30)
    dp.close()  # takes the store's lock, which the claim holds until it waits
    claimer.join()
    assert woken == [True]
    assert len(raised) == 1 and isinstance(raised[0], DataPlaneClosedError), raised


def test_get_data_requires_a_field_selection(dp):
    _put(dp, ["a"])
    m = dp.claim_meta("train", "train", ["input_lengths"], 1)
    assert dp.get_data(m)["input_lengths"].tolist() == [1]
    m.fields = None
    with pytest.raises(ValueError, match="no fetch-all"):
        dp.get_data(m)


def test_cleared_rows_leave_the_consumption_accounting(dp):
    _put(dp, ["a", "b"])
    dp.claim_meta("train", "train", ["input_lengths"], 1)
    dp.clear_samples(partition_id="train", sample_ids=["b"])
    assert dp.check_consumption_status("train", ["train"])
    _put(dp, ["b"])
    assert dp.claim_meta("train", "train", ["input_lengths"], 2).sample_ids == ["b"]

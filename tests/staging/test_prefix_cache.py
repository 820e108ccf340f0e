"""ChainPrefixCache and resolve_admission_prefix: suffix-only fetches, FIFO eviction."""

from __future__ import annotations

import threading

import pytest

from tq_plugin.staging import CaptureAdmission, ChainPrefixCache, resolve_admission_prefix


class _CountingSource:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.calls: list[list[str]] = []
        self.block = block

    def fetch_prefix_token_ids(self, keys: list[str]) -> list[int]:
        self.calls.append(list(keys))
        if self.block is not None:
            self.block.wait(timeout=10)
        return [int(k[1:]) for k in keys]


def test_chain_prefix_cache_fetches_only_uncached_suffix() -> None:
    source = _CountingSource()
    cache = ChainPrefixCache(source)
    assert cache.fetch(["k1", "k2"]) == [1, 2]
    assert cache.fetch(["k1", "k2", "k3"]) == [1, 2, 3]
    assert cache.fetch(["k1", "k2", "k3"]) == [1, 2, 3]
    assert source.calls == [["k1", "k2"], ["k3"]]


def test_chain_prefix_cache_returns_copies() -> None:
    cache = ChainPrefixCache(_CountingSource())
    first = cache.fetch(["k1"])
    first.append(99)
    assert cache.fetch(["k1"]) == [1]


def test_chain_prefix_cache_requires_an_installed_source() -> None:
    with pytest.raises(RuntimeError, match="setup_token_capture"):
        ChainPrefixCache().fetch(["k1"])


def test_install_replaces_the_source_and_drops_the_cache() -> None:
    old, new = _CountingSource(), _CountingSource()
    cache = ChainPrefixCache(old)
    cache.fetch(["k1"])
    cache.install(new)
    assert len(cache) == 0
    cache.fetch(["k1"])
    assert new.calls == [["k1"]]


def test_chain_prefix_cache_evicts_oldest_insertion_past_256_entries() -> None:
    source = _CountingSource()
    cache = ChainPrefixCache(source)
    for i in range(257):
        cache.fetch([f"k{i}"])
    cache.fetch(["k1"])  # a hit: no fetch, and FIFO means it does not refresh k1
    assert source.calls[-1] == ["k256"]
    cache.fetch(["k0"])
    assert source.calls[-1] == ["k0"]


def test_suffix_fetches_run_outside_the_lock() -> None:
    gate = threading.Event()
    slow = _CountingSource(block=gate)
    cache = ChainPrefixCache(slow)
    worker = threading.Thread(target=cache.fetch, args=(["k1"],))
    worker.start()
    while not slow.calls:
        threading.Event().wait(0.001)
    cache.install(_CountingSource())  # would deadlock if the fetch held the lock
    gate.set()
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_resolve_admission_prefix_dispatches_on_admission_shape() -> None:
    source = _CountingSource()
    cache = ChainPrefixCache(source)
    text = CaptureAdmission(rollout_id="r", model_call_id="c", mode="text")
    inline = CaptureAdmission(
        rollout_id="r",
        model_call_id="c",
        parent_call_id="p",
        prev_len=2,
        mode="token_in",
        required_prefix_token_ids=[7, 8],
        parent_chain_hash="a" * 64,
    )
    chained = inline.model_copy(
        update={"staging_chain": ["k3", "k4"], "required_prefix_token_ids": []}
    )
    assert resolve_admission_prefix(text, cache) == []
    assert resolve_admission_prefix(inline, cache) == [7, 8]
    assert resolve_admission_prefix(chained, cache) == [3, 4]
    assert source.calls == [["k3", "k4"]]

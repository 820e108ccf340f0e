"""Worker-local resolution of a call's admitted prefix from its ``staging_chain``.

A child call's prefix is its ancestors' deltas concatenated root-first. Chains of one
rollout share prefixes, so the cache keeps each resolved chain under its last key and a
later chain fetches only the suffix past its longest cached key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

CHAIN_CACHE_ENTRIES = 256


class ChainPrefixCache:
    """Worker-local FIFO cache (256 entries) of resolved ``staging_chain`` prefixes.

    Lookups and inserts hold a lock; the suffix fetch runs outside it, so concurrent
    resolutions overlap. Eviction drops the oldest insertion: hits do not refresh an entry.
    """

    def __init__(self, source: Any | None = None) -> None:
        self._lock = threading.Lock()
        self._source = source
        self._entries: OrderedDict[str, list[int]] = OrderedDict()

    def install(self, source: Any) -> None:
        """Attach (or replace) the token source and drop cached chains."""
        with self._lock:
            self._source = source
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, staging_chain: list[str]) -> list[int]:
        """The prefix token ids of ``staging_chain``, fetching only the uncached suffix."""
        chain = list(staging_chain)
        with self._lock:
            cached_at, cached = -1, []
            for position, key in enumerate(chain):
                hit = self._entries.get(key)
                if hit is not None:
                    cached_at, cached = position, hit
            missing = chain[cached_at + 1 :]
            if not missing:
                return list(cached)
            source = self._source
        if source is None:
            raise RuntimeError("staging source not initialized; call setup_token_capture() first")
        fetched = source.fetch_prefix_token_ids(missing)
        ids = [*cached, *fetched]
        with self._lock:
            self._entries[chain[-1]] = ids
            while len(self._entries) > CHAIN_CACHE_ENTRIES:
                self._entries.popitem(last=False)
        return list(ids)


def resolve_admission_prefix(admission: Any, chain_prefix: ChainPrefixCache) -> list[int]:
    """Resolve a ``CaptureAdmission`` (ours or Gym's) to the flat prefix the prompt starts with.

    Text roots have no prefix; a non-empty ``staging_chain`` is resolved through the cache;
    otherwise the inline ``required_prefix_token_ids``. Always a list of Python ints.
    """
    if admission.mode == "text":
        return []
    if admission.staging_chain:
        return chain_prefix.fetch(list(admission.staging_chain))
    return list(admission.required_prefix_token_ids)

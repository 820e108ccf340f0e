"""Fault injection: randomized schedules of failing data-plane calls, and what must still hold.

A test-only client wrapper fails on command: before a put (nothing written), on a store
rejection, part-way through a put (half the fields land, as a backend writing field by field
would leave them), after a put (the write landed, the caller sees an error), on a get (a raise,
or a short result), on a clear (before or after it applied) and on ``get_tags``. Each schedule
draws a fault rate and a fault budget from its seed; after the budget the client is healthy,
so every retry loop ends (no hang), and a loop that needs more than ``MAX_ATTEMPTS`` fails.

Must hold, with the figures printed (``pytest -s`` or ``-rA``):

* every acknowledged ``stage`` is fetchable and verifies (digest recomputed over the bytes read);
* no rejected write leaves rows or field keys (checked after each rejected attempt whose own
  clean-up calls were not faulted; the others must be settled by the retry, checked at the end);
* a retried operation (stage, fetch, ``finalize_group`` with and without ``clear_staged``,
  ``first_write``/``write_columns``/``read_columns``, the Lightning callback's write-back and
  clear) converges to the fault-free result.

The schedules run on ``LocalDataPlane`` (1,000 of each); the slow
:func:`test_the_schedules_hold_over_ray_data_plane` runs the first ``RAY_SCHEDULES`` of each
again over ``RayDataPlane`` (a store of its own per schedule in the tests' Ray actor).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from tq_plugin.data_plane import (
    INPUT_IDS,
    INPUT_LENGTHS,
    SAMPLE_MASK,
    KVBatchMeta,
    LocalDataPlane,
    first_write,
    read_columns,
    write_columns,
)
from tq_plugin.data_plane.client import accepts_put_mode
from tq_plugin.lightning import MICROBATCH_INFO, STEP_SAMPLE_IDS, DataPlaneCallback
from tq_plugin.staging import (
    STATUS_TAG,
    RolloutReassembler,
    StagedCallBaseSnapshot,
    TQTokenSink,
    TQTokenSource,
    make_rollout_receipt,
    make_staged_chain,
    register_staging_partition,
)
from tq_plugin.staging.reassembler import REASSEMBLED_FIELDS, REASSEMBLED_MEDIA_FIELDS

SCHEDULES = 1000
RAY_SCHEDULES = 40
# The store a schedule runs on (a factory): LocalDataPlane, or RayDataPlane in the Ray test.
STORE: Callable[[], Any] = LocalDataPlane
MAX_ATTEMPTS = 20  # a schedule injects at most 6 faults, so 7 attempts always suffice
STAGING, TRAIN = "rollout_staging", "train"

_KINDS = {
    "put_samples": ("before", "reject", "midway", "after"),
    "get_samples": ("raise", "short"),
    "clear_samples": ("before", "after"),
    "get_tags": ("raise", "short"),
}


@pytest.fixture(autouse=True)
def _quiet_staging_logs():
    """Thousands of injected faults are logged by the sink and reassembler; keep them out."""
    logger = logging.getLogger("tq_plugin.staging")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


class InjectedFault(ConnectionError):
    """What the wrapper raises for a transport fault (a ``ConnectionError``, so an ``OSError``)."""


class FaultyClient:
    """Wraps a data-plane client; each call may fail, as its schedule's random draws say."""

    def __init__(self, inner: Any, rng: random.Random, rate: float, budget: int) -> None:
        self.inner, self.rng, self.rate, self.budget = inner, rng, rate, budget
        self.injected: Counter[tuple[str, str]] = Counter()
        self.log: list[tuple[str, str]] = []

    def _fault(self, op: str) -> str | None:
        if self.budget <= 0 or self.rng.random() >= self.rate:
            return None
        self.budget -= 1
        kind = self.rng.choice(_KINDS[op])
        self.injected[(op, kind)] += 1
        self.log.append((op, kind))
        return kind

    def register_partition(self, **kwargs: Any) -> Any:
        return self.inner.register_partition(**kwargs)

    def list_sample_ids(self, **kwargs: Any) -> Any:
        return self.inner.list_sample_ids(**kwargs)

    def _put(self, kwargs: dict[str, Any]) -> Any:
        kind = self._fault("put_samples")
        if kind == "before":
            raise InjectedFault("injected: the put was lost before reaching the store")
        if kind == "reject":
            raise ValueError("injected: the store rejected the put")
        if kind == "midway":
            fields = kwargs["fields"]
            names = list(fields.keys())
            half = names[: len(names) // 2]
            if half:
                part = (
                    fields.select(*half)
                    if isinstance(fields, TensorDictBase)
                    else {name: fields[name] for name in half}
                )
                self.inner.put_samples(**{**kwargs, "fields": part})
            raise InjectedFault("injected: the put stopped part-way")
        out = self.inner.put_samples(**kwargs)
        if kind == "after":
            raise TimeoutError("injected: the put landed, its reply was lost")
        return out

    def put_samples(self, sample_ids, partition_id, fields=None, tags=None):
        return self._put(
            {"sample_ids": sample_ids, "partition_id": partition_id, "fields": fields, "tags": tags}
        )

    def get_samples(self, **kwargs: Any) -> Any:
        kind = self._fault("get_samples")
        if kind == "raise":
            raise TimeoutError("injected: the read timed out")
        out = self.inner.get_samples(**kwargs)
        return out[: max(0, out.batch_size[0] - 1)] if kind == "short" else out

    def get_tags(self, **kwargs: Any) -> Any:
        kind = self._fault("get_tags")
        if kind == "raise":
            raise InjectedFault("injected: get_tags failed")
        out = self.inner.get_tags(**kwargs)
        return out[:-1] if kind == "short" else out

    def clear_samples(self, **kwargs: Any) -> Any:
        kind = self._fault("clear_samples")
        if kind == "before":
            raise InjectedFault("injected: the clear was lost")
        out = self.inner.clear_samples(**kwargs)
        if kind == "after":
            raise InjectedFault("injected: the clear applied, its reply was lost")
        return out


class FaultyModeClient(FaultyClient):
    """The wrapper for a store whose ``put_samples`` takes ``mode`` (insert / update / upsert)."""

    def put_samples(self, sample_ids, partition_id, fields=None, tags=None, mode="upsert"):
        return self._put(
            {
                "sample_ids": sample_ids,
                "partition_id": partition_id,
                "fields": fields,
                "tags": tags,
                "mode": mode,
            }
        )


def faulty(inner: Any, rng: random.Random) -> FaultyClient:
    # the sink's and column I/O's own test (RayDataPlane's put forwards **options)
    cls = FaultyModeClient if accepts_put_mode(inner) else FaultyClient
    return cls(inner, rng, rate=rng.choice((0.1, 0.25, 0.4)), budget=rng.randint(1, 6))


def until_done(fn: Callable[[], Any], figures: Counter[str], what: str) -> Any:
    """Retry ``fn`` until it returns; more than ``MAX_ATTEMPTS`` tries is a failure (a hang)."""
    for attempt in range(MAX_ATTEMPTS):
        try:
            out = fn()
        except Exception:  # noqa: BLE001 - an injected fault: retry
            figures[f"{what} retries"] += 1
            continue
        if attempt:
            figures[f"{what} retried to convergence"] += 1
        return out
    raise AssertionError(f"{what} did not converge in {MAX_ATTEMPTS} attempts")


# ------------------------------------------------------------------ token staging
def _pool() -> list[list[Any]]:
    """Staged rollouts of 1-3 calls, and for each call an impostor: same key, other bytes."""
    rollouts = []
    for i in range(16):
        turns = [
            ([1 + i, 2][: 1 + i % 2], [3 + i], [-0.5]),
            ([4], [5, 6 + i], [-0.25, -0.125]),
        ][: 1 + i % 2]
        rollouts.append(make_staged_chain(f"r{i}", turns, weight_versions=[i % 4] * len(turns)))
    return rollouts


POOL = _pool()
IMPOSTORS = {
    records[0].staging_key: make_staged_chain(records[0].rollout_id, [([99], [98], [-2.0])])[0]
    for records in POOL
}


def _still(index: int) -> dict[str, torch.Tensor]:
    """A deterministic still image (2x2 patches of 2x2 pixels) for rollout ``index``."""
    pixels = torch.randn(1, 4, 12, generator=torch.Generator().manual_seed(index))
    return {
        "imgs": pixels.to(torch.bfloat16),
        "imgs_sizes": torch.tensor([[4, 4]], dtype=torch.int32),
    }


def _setup(client: Any, store: LocalDataPlane, media: bool) -> tuple[TQTokenSink, Any]:
    register_staging_partition(store, STAGING, capture_media=media)
    store.register_partition(
        partition_id=TRAIN, fields=[*REASSEMBLED_FIELDS, *REASSEMBLED_MEDIA_FIELDS]
    )
    sink = TQTokenSink(
        client,
        staging_partition=STAGING,
        capture_media=media,
        media_pixel_dtype=torch.bfloat16 if media else None,
    )
    return sink, (lambda i, n: _still(i) if media and n == 0 else None)


REFERENCE: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}


def _fault_free(picked: list[int], missing: set[str], media: bool) -> tuple[Any, dict[str, Any]]:
    """The same scenario on a healthy store: its meta and training rows (cached)."""
    key = (tuple(picked), frozenset(missing), media)
    if key not in REFERENCE:
        store = STORE()
        sink, attach = _setup(store, store, media)
        for i in picked:
            for n, rec in enumerate(POOL[i]):
                if not (rec.rollout_id in missing and n == len(POOL[i]) - 1):
                    assert sink.stage(rec, **_kw(attach(i, n))).ok
        reassembler = RolloutReassembler(store, staging_partition=STAGING, capture_media=media)
        meta = reassembler.finalize_group(
            [make_rollout_receipt(POOL[i], reward=float(i)) for i in picked], partition_id=TRAIN
        )
        REFERENCE[key] = (meta, _rows(store, meta))
    return REFERENCE[key]


def _kw(attachments: Any) -> dict[str, Any]:
    return {} if attachments is None else {"attachments": attachments}


def _rows(store: LocalDataPlane, meta: Any) -> dict[str, Any]:
    td = store.get_samples(
        sample_ids=meta.sample_ids, partition_id=TRAIN, select_fields=list(meta.fields)
    )
    return {name: _split(td[name]) for name in meta.fields}


def _split(column: torch.Tensor) -> list[torch.Tensor]:
    """A column's rows (a jagged column split by its offsets, not indexed row by row)."""
    if not column.is_nested:
        return list(column.unbind(0))
    bounds, values = column.offsets().tolist(), column.values()
    return [values[a:b] for a, b in itertools.pairwise(bounds)]


def _stage(sink, store, rec, acked, figures, kw, *, must_fail=False) -> None:
    """Stage ``rec`` until acknowledged (or, for an impostor, check every attempt is refused)."""
    client = sink.store.dp_client
    for _ in range(MAX_ATTEMPTS):
        mark = len(client.log)
        result = sink.stage(rec, **kw)
        faults = client.log[mark:]
        if any(op == "put_samples" for op, _ in faults):
            figures["stage calls hit by a put fault"] += 1
        if result.ok:
            assert not must_fail, "an impostor overwrote an acknowledged call"
            acked[result.staging_key] = rec
            if faults:
                figures["acknowledged despite a fault (read-back found the row)"] += 1
            return
        figures["rejected stage attempts"] += 1
        live = set(store.list_sample_ids(partition_id=STAGING))
        cleanup_faulted = any(op in ("get_samples", "clear_samples") for op, _ in faults)
        if cleanup_faulted:
            figures["rejected attempts with faulted clean-up (left to the retry)"] += 1
        else:
            assert live <= set(acked), f"a rejected write left rows: {sorted(live - set(acked))}"
            figures["rejected attempts checked: no rows or field keys left"] += 1
        if acked:  # every acknowledged row is still there, unchanged (verified in full later)
            held = store.get_samples(
                sample_ids=list(acked), partition_id=STAGING, select_fields=["digest_bytes"]
            )["digest_bytes"]
            assert [bytes(row.tolist()).hex() for row in held] == [a.digest for a in acked.values()]
        if must_fail:
            return
    raise AssertionError(f"stage of {rec.staging_key} did not converge")


def _staging_schedule(seed: int, figures: Counter[str], injected: Counter) -> None:
    rng = random.Random(seed)
    store = STORE()
    client = faulty(store, rng)
    media = rng.random() < 0.25
    sink, attach = _setup(client, store, media)
    picked = rng.sample(range(len(POOL)), rng.randint(1, 2))
    acked: dict[str, Any] = {}
    missing: set[str] = set()
    for index in picked:
        records = POOL[index]
        for n, rec in enumerate(records):
            if n and n == len(records) - 1 and rng.random() < 0.1:
                missing.add(rec.rollout_id)  # never staged: a real fetch_failed placeholder
                continue
            kw = _kw(attach(index, n))
            _stage(sink, store, rec, acked, figures, kw)
            if rng.random() < 0.3:
                _stage(sink, store, rec, acked, figures, kw)  # an idempotent re-stage
                figures["idempotent re-stages"] += 1
            if n == 0 and rng.random() < 0.3:
                impostor = IMPOSTORS[rec.staging_key]
                _stage(sink, store, impostor, acked, figures, kw, must_fail=True)
                figures["impostor re-stages refused"] += 1
    assert set(store.list_sample_ids(partition_id=STAGING)) == set(acked), "stray staged rows"

    source = TQTokenSource(
        client, staging_partition=STAGING, capture_media=media, snapshot_cls=StagedCallBaseSnapshot
    )
    keys = list(acked)
    rng.shuffle(keys)
    got = until_done(lambda: source.fetch(keys), figures, "fetch")
    assert [s.digest for s in got] == [acked[k].digest for k in keys]
    figures["acknowledged calls fetched and verified"] += len(keys)

    clear = rng.random() < 0.5
    receipts = [make_rollout_receipt(POOL[i], reward=float(i)) for i in picked]
    reassembler = RolloutReassembler(
        client, staging_partition=STAGING, capture_media=media, clear_staged=clear
    )
    meta = until_done(
        lambda: reassembler.finalize_group(receipts, partition_id=TRAIN), figures, "finalize_group"
    )
    injected.update(client.injected)
    want_meta, want_rows = _fault_free(picked, missing, media)
    assert [t[STATUS_TAG] for t in meta.tags] == [t[STATUS_TAG] for t in want_meta.tags]
    assert (meta.sample_ids, meta.fields, meta.sequence_lengths) == (
        want_meta.sample_ids,
        want_meta.fields,
        want_meta.sequence_lengths,
    )
    for name, rows in _rows(store, meta).items():
        for row, want in zip(rows, want_rows[name]):
            assert row.dtype == want.dtype and torch.equal(row, want), (seed, name)
    figures["finalize_group runs equal to the fault-free run (meta and every column)"] += 1
    figures["finalize_group runs on a media partition"] += media
    figures["rollouts finalized"] += len(picked)
    left = set(store.list_sample_ids(partition_id=STAGING))
    if clear:
        assert left == set(), f"clear_staged left {sorted(left)}"
        figures["finalize_group runs with clear_staged (staging emptied)"] += 1
    else:
        assert left == set(acked)


def _report(title: str, figures: Counter[str], injected: Counter[tuple[str, str]]) -> None:
    print(f"\n== {title}")
    for name, value in sorted(figures.items()):
        print(f"  {name}: {value}")
    print(
        "  faults injected: "
        + ", ".join(f"{op}/{kind}={n}" for (op, kind), n in sorted(injected.items()))
    )


@pytest.mark.timeout(300)
def test_token_staging_under_randomized_faults() -> None:
    figures: Counter[str] = Counter()
    injected: Counter[tuple[str, str]] = Counter()
    try:
        for seed in range(SCHEDULES):
            _staging_schedule(seed, figures, injected)
            figures["schedules run"] += 1
    finally:
        _report("token staging: sink, source, reassembler", figures, injected)
    assert figures["schedules run"] == SCHEDULES
    assert figures["acknowledged calls fetched and verified"] > SCHEDULES
    assert figures["rejected stage attempts"] > 0 and figures["finalize_group retries"] > 0


VIOLATION = "VIOLATION: "


def _run_suite(title: str, schedule: Callable[..., None]) -> None:
    """Run every schedule, counting a violated invariant by kind (not stopping), then report."""
    figures: Counter[str] = Counter()
    injected: Counter = Counter()
    for seed in range(SCHEDULES):
        try:
            schedule(seed, figures, injected)
        except AssertionError as exc:
            kind = str(exc).split(":", 1)[-1].strip().split("\n")[0][:90]
            figures[f"{VIOLATION}{kind}"] += 1
        figures["schedules run"] += 1
    _report(title, figures, injected)
    bad = {k: v for k, v in figures.items() if k.startswith(VIOLATION)}
    assert not bad, f"invariants violated: {bad}"


# ------------------------------------------------------------------ column I/O
def _batch(rng: random.Random, n: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    lengths = [rng.randint(1, 6) for _ in range(n)]
    width = max(lengths)
    ids = torch.zeros(n, width, dtype=torch.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.arange(1, length + 1) * (row + 1)
    return {
        INPUT_IDS: ids,
        INPUT_LENGTHS: torch.tensor(lengths),
        SAMPLE_MASK: torch.ones(n),
    }, lengths


def _column_io_schedule(seed: int, figures: Counter[str], injected: Counter) -> None:
    rng = random.Random(seed)
    store = STORE()
    store.register_partition(partition_id=TRAIN, fields=[])  # an open schema
    client = faulty(store, rng)
    n = rng.randint(1, 4)
    batch, lengths = _batch(rng, n)
    ids = [f"s{seed}-{i}" for i in range(n)]
    meta = until_done(
        lambda: first_write(batch, sample_ids=ids, client=client, partition_id=TRAIN),
        figures,
        "first_write",
    )
    assert meta.sample_ids == ids and meta.sequence_lengths == lengths
    advantages = torch.arange(n * max(lengths), dtype=torch.float32).reshape(n, -1)
    until_done(
        lambda: write_columns(client, meta, {"advantages": advantages}), figures, "write_columns"
    )
    got = until_done(
        lambda: read_columns(client, meta, [INPUT_IDS, "advantages"]), figures, "read_columns"
    )
    want = read_columns(store, meta, [INPUT_IDS, "advantages"])
    injected.update(client.injected)
    assert tuple(got.batch_size) == tuple(want.batch_size), (
        f"seed {seed}: read_columns returned fewer rows than requested (a short read passed "
        "silently)"
    )
    assert torch.equal(got[INPUT_IDS], want[INPUT_IDS])
    assert torch.equal(got["advantages"], want["advantages"])
    figures["column I/O schedules matching the fault-free read"] += 1


@pytest.mark.timeout(300)
def test_column_io_under_randomized_faults() -> None:
    _run_suite("column I/O: first_write, write_columns, read_columns", _column_io_schedule)


# ------------------------------------------------------------------ the Lightning callback
def _callback_schedule(seed: int, figures: Counter[str], injected: Counter) -> None:
    rng = random.Random(seed)
    store = STORE()
    store.register_partition(partition_id=TRAIN, fields=[])  # an open schema
    n = 4
    batch, lengths = _batch(rng, n)
    ids = [f"s{seed}-{i}" for i in range(n)]
    first_write(batch, sample_ids=ids, client=store, partition_id=TRAIN)
    client = faulty(store, rng)
    clear_rows = rng.random() < 0.5
    callback = DataPlaneCallback(client, log_metrics=False, clear_rows=clear_rows)
    host = SimpleNamespace()
    callback.setup(None, host, "fit")  # type: ignore[arg-type]
    want = {}
    for j, rows in enumerate((ids[:2], ids[2:])):
        info = {"step": 0, "index_in_step": j, "last_in_step": j == 1}
        meta = KVBatchMeta(
            partition_id=TRAIN,
            task_name="train",
            sample_ids=rows,
            sequence_lengths=[lengths[ids.index(r)] for r in rows],
            extra_info={MICROBATCH_INFO: info, STEP_SAMPLE_IDS: ids},
        )
        values = torch.full((2, max(lengths)), float(j + 1))
        want.update(zip(rows, values))
        outputs = {"write_back": {"advantages": values}}
        # A retried hook gets a fresh meta object, as after a resumed fit.
        until_done(
            lambda meta=meta, outputs=outputs, j=j: callback.on_train_batch_end(
                None,
                host,
                outputs,
                dataclasses.replace(meta),
                j,  # type: ignore[arg-type]
            ),
            figures,
            "callback hook",
        )
    injected.update(client.injected)
    assert callback.resume_cursor() == (1, 0)
    live = store.list_sample_ids(partition_id=TRAIN)
    if clear_rows:
        assert live == [], f"seed {seed}: the step's rows were never cleared after a clear fault"
        figures["callback schedules: step rows cleared"] += 1
    else:
        td = store.get_samples(sample_ids=ids, partition_id=TRAIN, select_fields=["advantages"])
        for row, sid in enumerate(ids):
            assert td["advantages"][row].tolist() == want[sid][: lengths[row]].tolist()
        figures["callback schedules: write-backs landed once"] += 1


@pytest.mark.timeout(300)
def test_lightning_callback_under_randomized_faults() -> None:
    _run_suite("Lightning DataPlaneCallback: write-back and step clear", _callback_schedule)


# ------------------------------------------------------------------ the same over Ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_schedules_hold_over_ray_data_plane(ray_session) -> None:
    """The first RAY_SCHEDULES schedules of each suite over RayDataPlane: every call crosses
    to the store actor, so a fault the wrapper injects lands between the client and a real
    remote store; the invariants are the ones checked over the embedded store."""
    import uuid

    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    opened: list[Any] = []

    def ray_store() -> Any:
        opened.append(RayDataPlane(f"faults-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests"))
        return opened[-1]

    suites = {"token staging": _staging_schedule, "column I/O": _column_io_schedule,
              "Lightning DataPlaneCallback": _callback_schedule}
    global STORE
    saved, STORE = STORE, ray_store
    REFERENCE.clear()  # the fault-free results, computed again on the Ray store
    try:
        for title, schedule in suites.items():
            figures: Counter[str] = Counter()
            injected: Counter = Counter()
            for seed in range(RAY_SCHEDULES):
                try:
                    schedule(seed, figures, injected)
                finally:
                    while opened:
                        opened.pop().close()
                figures["schedules run"] += 1
            _report(f"{title} over RayDataPlane", figures, injected)
            assert figures["schedules run"] == RAY_SCHEDULES and sum(injected.values()) > 0
    finally:
        STORE = saved
        REFERENCE.clear()

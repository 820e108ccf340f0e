"""Stateful model-based test of the store, one body over every backend.

Hypothesis drives random sequences of register (by name, by schema, open), put (every mode,
one row and many, dense, padded and nested values, lengths that turn a dense field jagged, other
dtypes, ranks and trailing dims, malformed payloads), write-back, get (in order, shuffled,
subsets), claim, clear (ids, all) and save/load against a plain dict model of rows. The model
predicts whether every call is accepted; after every rule the store must equal the model byte
for byte, and every refused call must have changed nothing. It guards the promise that what was
acknowledged is never lost (a put of another dtype into a field that had turned jagged used to
be accepted and drop the field from every earlier row).

Schema resets differ by backend, and the model says so: the embedded store (and the Ray actor
around it) forgets a field's dtype and shape when the field's last row is cleared; the
TransferQueue adapter keeps one schema per partition until the partition is empty.

Profiles: ``make test`` runs the ``ci`` profile; ``benchmarks/reliability.py`` runs the
``long`` one and records how many examples and rules it exercised.
"""

from __future__ import annotations

import collections
import os
import tempfile
import uuid
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tq_plugin.data_plane import KVBatchMeta, LocalDataPlane, nested_from_lengths
from tq_plugin.data_plane.column_io import write_columns

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")

IDS = [f"s{i}" for i in range(8)]
FIELDS = ["tok", "lp", "img", "r"]
DTYPES = [torch.int64, torch.int32, torch.float32, torch.bfloat16]
TASK = "train"
ERRORS = (TypeError, ValueError, KeyError)

# Examples per backend and rules per example. The distributed backends pay a round trip per call,
# so they run fewer; the long profile is for benchmarks/reliability.py.
PROFILES = {
    "ci": {"local": (150, 30), "ray": (30, 20), "ray_sharded": (10, 20), "transferqueue": (15, 16)},
    "long": {"local": (2000, 50), "ray": (200, 30), "ray_sharded": (100, 30),
             "transferqueue": (60, 25)},
}
# Which rules ran, per backend (the long profile reports them).
RULES_RUN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
EXAMPLES: collections.Counter = collections.Counter()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaN rows compare equal to themselves (an empty row may come back with
    stride 0, which ``view`` refuses; it has no bits)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


@dataclass(frozen=True)
class Spec:
    """What a column holds, as the contract states it (mirrors ColumnSpec, kept separate so the
    model never shares code with what it checks)."""

    jagged: bool
    dtype: torch.dtype
    shape: tuple[int, ...]  # dense: the row shape; jagged: the element shape


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        out = torch.randn(shape, generator=g).to(dtype)
        if out.numel() >= 2:
            out.view(-1)[0] = float("nan")
            out.view(-1)[-1] = -0.0
        return out
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


# Each field's usual dtype and form; a put strays from them a third of the time, so most puts
# land (and build state) while every dtype, rank and trailing-dim change still comes up.
USUAL = {"tok": (torch.int64, "nested"), "lp": (torch.float32, "padded"),
         "img": (torch.bfloat16, "fixed"), "r": (torch.int32, "scalar")}
FORMS = ["nested", "padded", "scalar", "fixed"]


@st.composite
def field_values(draw, name: str, n: int, seed: int):
    """``(tensor, rows, spec)``: one field's put value, its per-row tensors and what it is."""
    dtype, form = USUAL[name]
    if draw(st.integers(0, 2)) == 0:
        dtype, form = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(FORMS))
    trailing = draw(st.sampled_from([(), (), (), (2,)]))
    if form == "scalar":  # dense, one value per row
        value = _values((n, *trailing), dtype, seed)
        return value, list(value), Spec(False, dtype, trailing)
    if form in ("padded", "fixed"):  # dense [N, L, *t]: every row the same length
        length = draw(st.sampled_from([0, 3, 5]) if form == "padded" else st.just(4))
        value = _values((n, length, *trailing), dtype, seed)
        return value, list(value), Spec(False, dtype, (length, *trailing))
    lengths = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    flat = _values((sum(lengths), *trailing), dtype, seed)
    value = nested_from_lengths(flat, torch.tensor(lengths, dtype=torch.int64))
    return value, list(value.unbind()), Spec(True, dtype, trailing)


def _bad_payload(kind: str, n: int) -> tuple[dict, str]:
    """A payload whose field 'bad' (after a valid one) is malformed; and the error's anchor."""
    good = {"ok": torch.zeros(n, dtype=torch.float64)}  # a field no other rule writes
    if kind == "rows":
        return {**good, "bad": torch.zeros(n + 1)}, "'bad' has"
    if kind == "offsets":
        return {**good, "bad": torch.nested.nested_tensor_from_jagged(
            torch.arange(3), torch.tensor([0, *([5] * n)]))}, "'bad' has invalid jagged offsets"
    if kind == "decreasing":
        return {**good, "bad": torch.nested.nested_tensor_from_jagged(
            torch.arange(9), torch.tensor([0, *([-1] * n)]))}, "'bad' has invalid jagged offsets"
    if kind == "sparse":
        return {**good, "bad": torch.zeros(n, 2).to_sparse()}, "'bad'"
    if kind == "leaf":
        return {**good, "bad": [0] * n}, "'bad'"
    if kind == "meta":
        return {**good, "bad": torch.empty(n, device="meta")}, "'bad'"
    if kind == "scalar":
        return {**good, "bad": torch.tensor(1.0)}, "'bad'"
    if kind == "strided_nested":
        return {**good, "bad": torch.nested.nested_tensor([torch.zeros(2)] * n)}, "'bad'"
    raise AssertionError(kind)


BAD_KINDS = ["rows", "offsets", "decreasing", "sparse", "leaf", "meta", "scalar",
             "strided_nested", "dup_ids", "str_ids", "int_ids", "tags", "reregister"]


class StoreMachine(RuleBasedStateMachine):
    """The store against a dict model. Subclasses set ``backend`` and ``make_client``."""

    backend = "local"
    # Where a field's dtype/shape is forgotten: when the field's last row goes ("field"), or
    # only when the partition holds no rows at all ("partition").
    schema_resets = "field"

    def __init__(self) -> None:
        super().__init__()
        self.dp = self.make_client()
        self.pid = f"p{uuid.uuid4().hex[:8]}"
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.specs: dict[str, Spec] = {}
        self.declared: set[str] = set()
        self.jagged: set[str] = set()
        self.claimed: set[str] = set()
        self.seed = 0
        EXAMPLES[self.backend] += 1

    def make_client(self):
        return LocalDataPlane()

    def load_client(self, path: str):
        return LocalDataPlane.load(path)

    def _count(self, name: str) -> None:
        RULES_RUN[self.backend][name] += 1

    # ------------------------------------------------------------------ the model's rules
    def _live(self, name: str) -> bool:
        if self.schema_resets == "partition":
            return bool(self.rows) and name in self.specs
        return any(name in row for row in self.rows.values())

    def _predict_field(self, name: str, spec: Spec) -> tuple[Spec | None, type | None]:
        """``(spec after the put, None)`` if a put of ``spec`` into ``name`` is accepted, else
        ``(None, the exception type)``, by the contract's rules."""
        if self.declared and name not in self.declared:
            return None, ValueError
        held = self.specs.get(name) if self._live(name) else None
        jagged_target = held.jagged if held is not None else name in self.jagged
        if not spec.jagged and jagged_target:
            if len(spec.shape) < 1:
                return None, ValueError  # a jagged field needs [N, L, ...]
            spec = Spec(True, spec.dtype, spec.shape[1:])
        if held is None or spec == held:
            return spec, None
        promotable = (not held.jagged and held.dtype == spec.dtype and len(held.shape) >= 1
                      and (spec.jagged and held.shape[1:] == spec.shape
                           or not spec.jagged and len(spec.shape) == len(held.shape)
                           and spec.shape[1:] == held.shape[1:]))
        if promotable:
            return Spec(True, spec.dtype, held.shape[1:]), None
        return None, TypeError

    def everything_matches(self) -> None:
        assert self.dp.list_sample_ids(self.pid) == sorted(self.rows)
        for name in FIELDS:
            holders = sorted(s for s, row in self.rows.items() if name in row)
            if holders:
                self._check_read(holders, name)

    def _check_read(self, ids: list[str], name: str) -> None:
        got = self.dp.get_samples(partition_id=self.pid, sample_ids=ids, select_fields=[name])[name]
        rows = got.unbind() if got.is_nested else list(got)
        assert len(rows) == len(ids)
        for sid, row in zip(ids, rows, strict=True):
            want = self.rows[sid][name]
            assert row.dtype == want.dtype, (sid, name, row.dtype, want.dtype)
            assert tuple(row.shape) == tuple(want.shape), (sid, name, row.shape, want.shape)
            assert torch.equal(_bits(row), _bits(want)), (sid, name)

    # ------------------------------------------------------------------ rules
    @initialize(how=st.sampled_from(["open", "named", "schema"]))
    def register(self, how):
        self._count(f"register_{how}")
        names = [] if how == "open" else [*FIELDS, "bad", "ok"]
        jagged = ["tok"] if how == "schema" else []
        self.dp.register_partition(self.pid, names, consumer_tasks=[TASK], jagged_fields=jagged)
        self.declared, self.jagged = set(names), set(jagged)

    @rule(ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=5, unique=True),
          names=st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True),
          mode=st.sampled_from(["upsert", "upsert", "insert", "update"]),
          data=st.data())
    def put(self, ids, names, mode, data):
        self._put(ids, names, mode, data)

    @rule(ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=2, unique=True),
          names=st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True),
          data=st.data())
    def put_upsert(self, ids, names, data):
        """A second put rule, so puts (the state builders) are drawn as often as the rest."""
        self._put(ids, names, "upsert", data)

    def _put(self, ids, names, mode, data):
        payload, rows, after, refused = {}, {}, {}, []
        for name in names:
            self.seed += 1
            value, per_row, spec = data.draw(field_values(name, len(ids), self.seed))
            payload[name], rows[name] = value, per_row
            new_spec, error = self._predict_field(name, spec)
            if error is None:
                after[name] = new_spec
            else:
                refused.append((name, error))
        held = [s for s in ids if s in self.rows]
        if not refused and mode == "insert" and held:
            refused.append((None, ValueError))
        if not refused and mode == "update" and len(held) != len(ids):
            refused.append((None, KeyError))
        if refused:
            self._count(f"put_refused_{refused[0][1].__name__}")
            with pytest.raises(ERRORS) as info:
                self.dp.put_samples(
                    partition_id=self.pid, sample_ids=ids, fields=payload, mode=mode
                )
            named = [repr(n) for n, _ in refused if n is not None]
            if named:
                assert any(n in str(info.value) for n in named), (refused, str(info.value))
            self.everything_matches()
            return
        self._count(f"put_{mode}_{len(ids) == 1 and 'one' or 'many'}")
        self.dp.put_samples(partition_id=self.pid, sample_ids=ids, fields=payload, mode=mode)
        self.specs.update(after)
        for name, per_row in rows.items():
            for sid, row in zip(ids, per_row):
                self.rows.setdefault(sid, {})[name] = row.clone()

    @rule(ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=5, unique=True),
          kind=st.sampled_from(BAD_KINDS))
    def bad_put(self, ids, kind):
        self._count("bad_put")
        n = len(ids)
        args: dict = {"sample_ids": ids, "partition_id": self.pid}
        if kind == "reregister":  # not refused, but idempotent: it must change nothing
            self.dp.register_partition(self.pid, sorted(self.declared),
                                       jagged_fields=sorted(self.jagged))
            self.everything_matches()
            return
        if kind == "dup_ids":
            args.update(sample_ids=[*ids, ids[0]], fields={"ok": torch.zeros(n + 1, dtype=torch.float64)})
            anchor = "duplicate sample_ids"
        elif kind == "str_ids":
            args.update(sample_ids="s1", fields={"ok": torch.zeros(2, dtype=torch.float64)})
            anchor = "sample_ids must be a list"
        elif kind == "int_ids":
            args.update(sample_ids=[*ids[:-1], 7], fields={"ok": torch.zeros(n, dtype=torch.float64)})
            anchor = "sample_ids must be strings"
        elif kind == "tags":
            args.update(fields={"ok": torch.zeros(n, dtype=torch.float64)}, tags=[{}] * (n + 1))
            anchor = "tags"
        else:
            args["fields"], anchor = _bad_payload(kind, n)
        with pytest.raises(ERRORS) as info:
            self.dp.put_samples(**args)
        assert anchor in str(info.value), (kind, str(info.value))
        self.everything_matches()

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def write_back(self, data):
        """``write_columns``: an update of existing rows through a receipt (never mints a row)."""
        name = data.draw(st.sampled_from(FIELDS))
        holders = sorted(s for s, row in self.rows.items() if name in row)
        if not holders:
            return
        ids = data.draw(st.lists(st.sampled_from(holders), min_size=1, unique=True))
        spec = self.specs[name]
        self.seed += 1
        if spec.jagged:
            lengths = [self.rows[s][name].shape[0] for s in ids]
            flat = _values((sum(lengths), *spec.shape), spec.dtype, self.seed)
            value = nested_from_lengths(flat, torch.tensor(lengths, dtype=torch.int64))
            per_row = list(value.unbind())
        else:
            value = _values((len(ids), *spec.shape), spec.dtype, self.seed)
            per_row = list(value)
        self._count("write_back")
        write_columns(self.dp, KVBatchMeta(partition_id=self.pid, task_name=None, sample_ids=ids),
                      {name: value})
        for sid, row in zip(ids, per_row):
            self.rows[sid][name] = row.clone()

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def read(self, data):
        names = data.draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True))
        holders = sorted(s for s, row in self.rows.items() if all(n in row for n in names))
        if not holders:
            return
        ids = data.draw(st.lists(st.sampled_from(holders), min_size=1, unique=True))
        ids = data.draw(st.permutations(ids))
        self._count("read")
        got = self.dp.get_samples(partition_id=self.pid, sample_ids=ids, select_fields=names)
        assert sorted(got.keys()) == sorted(names)
        for name in names:
            self._check_read(ids, name)

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def read_of_a_missing_field_or_id_fails_whole(self, data):
        name = data.draw(st.sampled_from(FIELDS))
        lacking = sorted(s for s, row in self.rows.items() if name not in row)
        unknown = [s for s in IDS if s not in self.rows]
        ids = lacking + unknown[:1]
        if not ids:
            return
        self._count("read_refused")
        with pytest.raises(KeyError):
            self.dp.get_samples(partition_id=self.pid, sample_ids=ids, select_fields=[name])

    @rule(names=st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True))
    def claim(self, names):
        """One row at a time (TransferQueue hands out full batches only): an eligible row comes
        back exactly when one exists, and no row is handed to the task twice."""
        eligible = {s for s, row in self.rows.items() if all(n in row for n in names)} - self.claimed
        self._count("claim")
        meta = self.dp.claim_meta(self.pid, TASK, names, 1, blocking=bool(eligible),
                                  timeout_s=10.0)
        got = set(meta.sample_ids)
        assert got <= eligible, (got, eligible)
        assert len(got) == (1 if eligible else 0), (got, eligible)
        self.claimed |= got

    @rule(ids=st.one_of(st.none(), st.lists(st.sampled_from(IDS), max_size=5, unique=True)))
    def clear(self, ids):
        self._count("clear_all" if ids is None else "clear_ids")
        self.dp.clear_samples(partition_id=self.pid, sample_ids=ids)
        if ids is None:
            self.rows.clear()
            self.claimed.clear()
            self.specs.clear()
            # A cleared partition is gone; the next call registers it again, as a user would.
            self.dp.register_partition(self.pid, sorted(self.declared), consumer_tasks=[TASK],
                                       jagged_fields=sorted(self.jagged))
            return
        for sid in ids:
            self.rows.pop(sid, None)
            self.claimed.discard(sid)
        if self.schema_resets == "partition" and not self.rows:
            self.specs.clear()

    @precondition(lambda self: bool(self.rows) and hasattr(self.dp, "save"))
    @rule()
    def save_and_load(self):
        self._count("save_load")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt")
            self.dp.save(path)
            loaded = self.load_client(path)
        self.dp.close()
        self.dp = loaded
        self.everything_matches()

    @invariant()
    def store_equals_model(self):
        if self.backend == "local":  # a round trip per field: the distributed backends check
            self.everything_matches()  # after refused calls and at teardown instead
            stats = self.dp.stats()
            assert stats["rows"] == len(self.rows)
            assert stats["live_bytes"] == sum(t.numel() * t.element_size()
                                              for row in self.rows.values() for t in row.values())
        else:
            assert self.dp.list_sample_ids(self.pid) == sorted(self.rows)

    def teardown(self) -> None:
        try:
            self.everything_matches()
        finally:
            self.dp.clear_samples(partition_id=self.pid, sample_ids=None)
            self.dp.close()


def _settings(backend: str) -> settings:
    profile = os.environ.get("TQ_STATE_MACHINE_PROFILE", "ci")
    examples, steps = PROFILES[profile][backend]
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=list(HealthCheck), derandomize=profile == "ci")


def machine_for(backend: str, request=None) -> type[StoreMachine]:
    """The machine class for ``backend`` (its client made the conformance suite's way)."""
    if backend == "local":
        return StoreMachine
    if request is not None:
        request.getfixturevalue("tq_session" if backend == "transferqueue" else "ray_session")

    class Distributed(StoreMachine):
        schema_resets = "partition" if backend == "transferqueue" else "field"

        def make_client(self):
            if backend == "transferqueue":
                from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

                return TransferQueueDataPlane(f"sm-{uuid.uuid4().hex[:8]}")
            from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

            if backend == "ray_sharded":  # two storage units, every block staged on one
                return _on_units(RayDataPlane(f"sm-{uuid.uuid4().hex[:8]}",
                                              actor_name="tq_plugin_tests", num_storage_units=2))
            return RayDataPlane(f"sm-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")

        def load_client(self, path: str):
            units = {"num_storage_units": 2} if backend == "ray_sharded" else {}
            return _on_units(type(self.dp).load(path, store=f"sm-{uuid.uuid4().hex[:8]}",
                                                actor_name="tq_plugin_tests", **units))

    Distributed.backend = backend
    Distributed.__name__ = f"StoreMachine_{backend}"
    return Distributed


def _on_units(client):
    """A sharded Ray client stages even the machine's small blocks on its storage units."""
    if getattr(client, "storage_units", None) is not None:
        client.storage_units.min_bytes = 0
    return client


_DISTRIBUTED = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=_DISTRIBUTED),
                                     pytest.param("ray_sharded", marks=_DISTRIBUTED),
                                     pytest.param("transferqueue", marks=_DISTRIBUTED)])
def test_store_equals_a_dict_model(backend, request):
    RULES_RUN[backend].clear()
    EXAMPLES[backend] = 0
    run_state_machine_as_test(machine_for(backend, request), settings=_settings(backend))
    ran = RULES_RUN[backend]
    # The figures benchmarks/reliability.py records (pytest shows them with -s).
    print(f"state machine [{backend}]: {EXAMPLES[backend]} examples, {sum(ran.values())} rules: "
          + ", ".join(f"{k} {v}" for k, v in sorted(ran.items())))
    assert ran["put_upsert_many"] and ran["put_refused_TypeError"] and ran["save_load"] + (
        backend == "transferqueue") and ran["claim"], dict(ran)


@pytest.mark.parametrize("dense, bad", [
    (torch.ones(1, 4), "float32"),
    (torch.ones(1, 4, 2, dtype=torch.int64), "shape"),
])
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=_DISTRIBUTED),
                                     pytest.param("transferqueue", marks=_DISTRIBUTED)])
def test_a_put_of_another_dtype_into_a_field_turned_jagged_is_refused(backend, dense, bad, request):
    """The reported case: a registered field turns jagged, then a dense put of another dtype
    (or trailing shape) arrives. It is refused naming the field, and earlier rows stay whole."""
    dp = machine_for(backend, request)().make_client()
    pid = f"p{uuid.uuid4().hex[:6]}"
    try:
        dp.register_partition(pid, ["input_ids"])
        dp.put_samples(sample_ids=["a"], partition_id=pid, fields={"input_ids": torch.arange(5).reshape(1, 5)})
        dp.put_samples(sample_ids=["b"], partition_id=pid, fields={"input_ids": torch.arange(7).reshape(1, 7)})
        with pytest.raises(TypeError, match=rf"'input_ids'.*{bad}"):
            dp.put_samples(sample_ids=["d"], partition_id=pid, fields={"input_ids": dense})
        got = dp.get_samples(sample_ids=["a", "b"], partition_id=pid, select_fields=["input_ids"])
        rows = got["input_ids"].unbind()
        assert torch.equal(rows[0], torch.arange(5)) and torch.equal(rows[1], torch.arange(7))
        assert dp.list_sample_ids(pid) == ["a", "b"]
    finally:
        dp.clear_samples(partition_id=pid, sample_ids=None)
        dp.close()

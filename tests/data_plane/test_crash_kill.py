"""Kill anywhere (issue 37): a journaled store SIGKILLed at random points of real work, many
times over one journal, loses nothing it acknowledged and holds nothing twice.

The harness keeps **one journal** through every kill point. A long-lived parent (it imported
torch and tq_plugin once) forks a worker per point; the worker opens
``LocalDataPlane(journal_dir=D, journal_sync="always")`` (recovering what the last one left),
then runs the next calls of a fixed plan: puts of row batches (dense, jagged, bf16, tags),
token staging through ``TQTokenSink``, finalization through ``RolloutReassembler`` (verify,
write the row, clear the staged calls), clears, claims, ``save`` checkpoints and journal
compactions (explicit, and automatic every few dozen records). After each call returns the
worker reports it through a pipe: that is its acknowledgement. The parent SIGKILLs the worker
at a random moment (some points while the worker is still recovering the journal), reopens
the journal and checks it against a model of the acknowledged calls:

* every acknowledged put present byte-exact with its tags; every staged call fetched and
  verified against its digest by ``TQTokenSource`` (a complete rollout by
  ``verify_and_linearize``); every finalized row equal to what a store that never crashed
  holds; acknowledged clears, claims and checkpoints hold;
* the one call in flight either landed whole or left nothing (no put, finalization or
  checkpoint half there); the next worker issues it again when it did not land (a
  finalization that wrote its row but not the clear is retried, and the reassembler's
  retry-safety only clears);
* nothing twice: no id listed twice, no row beyond the model's.

``tq/backend=ray`` runs the same plan and checks through ``RayDataPlane`` with the store
actor's process SIGKILLed, one Ray session throughout, the store reopened from the journal in a
new actor each time (the client cannot list claims without making one, so they are checked
once, at the end: claiming every row left hands out none an acknowledged claim took).

Run by hand: ``python tests/data_plane/test_crash_kill.py local DIR POINTS SEED``.
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

CALLS = 3  # calls per rollout
MAX_LIVE_PUTS = 10  # the plan clears the oldest put past this (verification stays bounded)
MAX_LIVE_FINALS = 6
COMPACT_RECORDS = 40  # automatic compaction: kills land inside it too


# --------------------------------------------------------------------------- the work
@functools.cache
def rows(seed: int, i: int) -> tuple[list[str], dict[str, torch.Tensor], list[dict]]:
    """Put i's ids, fields and tags (a pure function of seed and i; cached: read only)."""
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(1, 9))
    lengths = rng.integers(0, 40, n)
    ids = [f"p{i}/{k}" for k in range(n)]
    fields = {
        "obs": torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float32)),
        "tokens": torch.nested.nested_tensor_from_jagged(
            torch.from_numpy(rng.integers(0, 50_000, int(lengths.sum()))),
            torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))),
        "reward": torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16),
    }
    return ids, fields, [{"put": i, "row": k} for k in range(n)]


@functools.cache
def chain(seed: int, r: int) -> list[Any]:
    """Rollout r's staged calls (a pure function of seed and r)."""
    from tq_plugin.staging import make_staged_chain

    rng = np.random.default_rng([seed, 10_000 + r])
    turns = [(rng.integers(0, 150_000, 8).tolist(), rng.integers(0, 150_000, 24).tolist(),
              (-rng.random(24)).astype(np.float32).tolist()) for _ in range(CALLS)]
    return make_staged_chain(f"r{r}", turns, weight_versions=list(range(CALLS)))


def make_plan(seed: int, n: int) -> list[tuple]:
    """The calls every worker runs, in order (a pure function of seed): each is issued until it
    lands once, so the plan can assume every earlier call happened."""
    rng = np.random.default_rng(seed)
    ops: list[tuple] = [("reg", "rows"), ("reg", "final"), ("reg", "staging")]
    next_put, next_r = 0, 0
    live: list[int] = []
    open_r: dict[int, int] = {}
    ready: list[int] = []
    finals: list[int] = []
    while len(ops) < n:
        x = rng.random()
        if len(live) > MAX_LIVE_PUTS:
            ops.append(("clear", live.pop(0)))
        elif len(finals) > MAX_LIVE_FINALS:
            ops.append(("clearf", finals.pop(0)))
        elif ready and x < 0.12:
            r = ready.pop(0)
            finals.append(r)
            ops.append(("final", r))
        elif x < 0.42:
            ops.append(("put", next_put))
            live.append(next_put)
            next_put += 1
        elif x < 0.74:
            if not open_r or (len(open_r) < 3 and rng.random() < 0.3):
                open_r[next_r] = 0
                next_r += 1
            r = list(open_r)[int(rng.integers(len(open_r)))]
            c = open_r[r]
            ops.append(("stage", r, c))
            if c + 1 == CALLS:
                del open_r[r]
                ready.append(r)
            else:
                open_r[r] = c + 1
        elif x < 0.84 and live:
            ops.append(("clear", live.pop(int(rng.integers(len(live))))))
        elif x < 0.93:
            ops.append(("claim",))
        elif x < 0.965:
            ops.append(("save",))
        else:
            ops.append(("compact",))
    return ops


class Worker:
    """Runs plan calls against a store; ``ack(j, payload)`` after each one returns."""

    def __init__(self, dp: Any, seed: int, ckpt: str) -> None:
        from tq_plugin.staging import RolloutReassembler, TQTokenSink

        self.dp, self.seed, self.ckpt = dp, seed, ckpt
        self.sink = TQTokenSink(dp, staging_partition="staging")
        self.reassembler = RolloutReassembler(dp, staging_partition="staging", clear_staged=True)

    def run(self, op: tuple) -> str:
        from tq_plugin.staging import make_rollout_receipt, register_staging_partition

        dp, kind = self.dp, op[0]
        if kind == "reg":
            if op[1] == "staging":
                register_staging_partition(dp, "staging")
            else:
                dp.register_partition(op[1], [], consumer_tasks=["train"])
        elif kind == "put":
            ids, fields, tags = rows(self.seed, op[1])
            dp.put_samples(partition_id="rows", sample_ids=ids, fields=fields, tags=tags)
        elif kind == "stage":
            if not self.sink.stage(chain(self.seed, op[1])[op[2]]).ok:
                raise RuntimeError(f"stage {op} failed")
        elif kind == "final":
            receipt = make_rollout_receipt(chain(self.seed, op[1]))
            self.reassembler.finalize_group([receipt], partition_id="final", sample_ids=[f"f{op[1]}"])
        elif kind == "clear":
            dp.clear_samples(partition_id="rows", sample_ids=rows(self.seed, op[1])[0])
        elif kind == "clearf":
            dp.clear_samples(partition_id="final", sample_ids=[f"f{op[1]}"])
        elif kind == "claim":
            return " ".join(dp.claim_meta("rows", "train", ["obs"], 3, blocking=False).sample_ids)
        elif kind == "save":
            dp.save(self.ckpt)
        elif kind == "compact":
            if hasattr(dp, "compact_journal"):
                dp.compact_journal()
        else:  # pragma: no cover - the plan makes only the kinds above
            raise AssertionError(op)
        return ""


# --------------------------------------------------------------------------- the model
@dataclass
class Model:
    """The store as the acknowledged calls left it."""

    seed: int
    plan: list[tuple]
    parts: set[str] = field(default_factory=set)
    live: set[int] = field(default_factory=set)  # puts
    staged: dict[int, int] = field(default_factory=dict)  # rollout -> calls staged
    finals: set[int] = field(default_factory=set)
    claimed: set[str] = field(default_factory=set)
    saved: dict[str, list[str]] | None = None  # the last acknowledged checkpoint's ids
    next_op: int = 0
    sites: dict[str, int] = field(default_factory=dict)  # what each kill interrupted
    acked: dict[str, int] = field(default_factory=dict)  # acknowledged calls by kind
    landed_unacked: int = 0
    _final_ref: dict[int, tuple] = field(default_factory=dict)

    def apply(self, op: tuple, payload: str) -> None:
        kind = op[0]
        self.acked[kind] = self.acked.get(kind, 0) + 1
        if kind == "reg":
            self.parts.add(op[1])
        elif kind == "put":
            self.live.add(op[1])
        elif kind == "stage":
            self.staged[op[1]] = op[2] + 1
        elif kind == "final":
            self.finals.add(op[1])
            self.staged.pop(op[1], None)
        elif kind == "clear":
            self.live.discard(op[1])
            self.claimed -= set(rows(self.seed, op[1])[0])
        elif kind == "clearf":
            self.finals.discard(op[1])
        elif kind == "claim":
            self.claimed.update(payload.split())
        elif kind == "save":
            self.saved = self.view()

    def view(self) -> dict[str, list[str]]:
        """Each partition's ids as the model has them, sorted."""
        out = {p: [] for p in self.parts}
        if "rows" in out:
            out["rows"] = sorted(s for i in self.live for s in rows(self.seed, i)[0])
        if "final" in out:
            out["final"] = sorted(f"f{r}" for r in self.finals)
        if "staging" in out:
            out["staging"] = sorted(f"r{r}/c{c}" for r, n in self.staged.items() for c in range(n))
        return out

    def final_reference(self, r: int) -> tuple:
        """What a store that never crashed holds for rollout r's finalized row."""
        if r not in self._final_ref:
            from tq_plugin.data_plane import LocalDataPlane
            from tq_plugin.staging import make_rollout_receipt
            from tq_plugin.staging.reassembler import FINALIZED_FIELDS_TAG

            ref = LocalDataPlane()
            try:
                ref.register_partition("final", [], consumer_tasks=["train"])
                w = Worker(ref, self.seed, "")
                w.run(("reg", "staging"))
                for c in range(CALLS):
                    w.run(("stage", r, c))
                w.reassembler.finalize_group([make_rollout_receipt(chain(self.seed, r))],
                                             partition_id="final", sample_ids=[f"f{r}"])
                tags = ref.get_tags(partition_id="final", sample_ids=[f"f{r}"])
                names = sorted(tags[0][FINALIZED_FIELDS_TAG].split(","))
                got = ref.get_samples(partition_id="final", sample_ids=[f"f{r}"], select_fields=names)
                self._final_ref[r] = ({n: _plain(got[n]) for n in names}, tags)
            finally:
                ref.close()
        return self._final_ref[r]


def _plain(t: torch.Tensor) -> tuple:
    """A tensor as (dtype, values, offsets) for an exact comparison, dense or jagged."""
    if t.is_nested:
        return (t.dtype, t.values().clone(), t.offsets().clone())
    return (t.dtype, t.clone(), None)


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1]) and (
        a[2] is None if b[2] is None else (a[2] is not None and torch.equal(a[2], b[2])))


def _consumed(dp: Any) -> set[str] | None:
    """The rows task ``train`` claimed (read-only), where the client can tell."""
    if not hasattr(dp, "snapshot_partitions"):
        return None
    for snap in dp.snapshot_partitions():
        if snap.entry["partition_id"] == "rows":
            return set(snap.entry["consumed"].get("train", []))
    return set()


def check_recovered(model: Model, dp: Any, inflight: int | None, ckpt: str) -> None:
    """Check the recovered store ``dp`` against the model; settle the call in flight (landed
    whole: applied; left nothing: issued again) and set ``model.next_op``."""
    from tq_plugin.data_plane import LocalDataPlane
    from tq_plugin.data_plane.checkpoint import CheckpointError
    from tq_plugin.staging import (
        StagedCallBaseSnapshot,
        TQTokenSource,
        make_rollout_receipt,
        verify_and_linearize,
    )

    op = model.plan[inflight] if inflight is not None else ("none",)
    kind = op[0]
    parts = set(dp.list_partitions())
    held = {p: dp.list_sample_ids(p) for p in parts}
    for p, ids in held.items():
        assert len(set(ids)) == len(ids), f"partition {p} lists an id twice"
    held_sets = {p: set(ids) for p, ids in held.items()}
    landed = False
    if kind == "reg":
        landed = op[1] in parts
    elif kind == "put":
        ids = set(rows(model.seed, op[1])[0])
        have = held_sets.get("rows", set()) & ids
        assert have in (set(), ids), f"put {op[1]} (in flight) is half-present: {sorted(have)}"
        landed = have == ids
    elif kind == "stage":
        landed = f"r{op[1]}/c{op[2]}" in held_sets.get("staging", set())
    elif kind == "final":
        row = f"f{op[1]}" in held_sets.get("final", set())
        keys = {f"r{op[1]}/c{c}" for c in range(CALLS)}
        left = held_sets.get("staging", set()) & keys
        assert left in (set(), keys), f"finalize {op[1]}: its clear is half-done {sorted(left)}"
        assert row or left, f"finalize {op[1]} cleared its staged calls without writing its row"
        if row:
            model.finals.add(op[1])  # written; its clear is redone when it did not land
        landed = row and not left
    elif kind == "clear":
        ids = set(rows(model.seed, op[1])[0])
        have = held_sets.get("rows", set()) & ids
        assert have in (set(), ids), f"clear {op[1]} (in flight) is half-done"
        landed = not have
    elif kind == "clearf":
        landed = f"f{op[1]}" not in held_sets.get("final", set())
    elif kind == "claim":
        consumed = _consumed(dp)
        live_ids = held_sets.get("rows", set())
        extra = (consumed & live_ids) - model.claimed if consumed is not None else set()
        assert len(extra) <= 3, f"the claim in flight handed out {len(extra)} rows"
        model.claimed |= extra
        landed = True  # claiming again only claims more rows, which the model then sees
    elif kind in ("save", "compact"):
        landed = kind == "compact"
    if landed:
        model.landed_unacked += 1
        model.apply(op, "")
        model.acked[kind] -= 1  # landed, never acknowledged
    # the store equals the model
    want = model.view()
    assert parts == set(want), f"partitions {sorted(parts)} != {sorted(want)}"
    for p, ids in want.items():
        if held_sets[p] != set(ids):
            missing = sorted(set(ids) - held_sets[p])[:5]
            extra = sorted(held_sets[p] - set(ids))[:5]
            raise AssertionError(f"partition {p}: acknowledged ids missing {missing}, "
                                 f"unacknowledged ids present {extra}")
    for i in sorted(model.live):
        ids, fields, tags = rows(model.seed, i)
        got = dp.get_samples(partition_id="rows", sample_ids=ids, select_fields=list(fields))
        for name, value in fields.items():
            assert _same(_plain(got[name]), _plain(value)), f"put {i}: field {name} differs"
        assert dp.get_tags(partition_id="rows", sample_ids=ids) == tags, f"put {i}: tags differ"
    if want.get("staging"):
        source = TQTokenSource(dp, staging_partition="staging", snapshot_cls=StagedCallBaseSnapshot)
        staged = sorted(model.staged.items())
        records = [rec for r, n in staged for rec in chain(model.seed, r)[:n]]
        snaps = iter(source.fetch([rec.staging_key for rec in records]))  # digest-checked
        for r, n in staged:
            mine = chain(model.seed, r)[:n]
            got = [next(snaps) for _ in mine]
            assert [s.model_dump() for s in got] == [
                rec.model_dump(exclude={"extras"}) for rec in mine], f"rollout {r} differs"
            if n == CALLS:
                verify_and_linearize(make_rollout_receipt(mine), got)
    for r in sorted(model.finals):
        ref_fields, ref_tags = model.final_reference(r)
        got = dp.get_samples(partition_id="final", sample_ids=[f"f{r}"], select_fields=list(ref_fields))
        for name, value in ref_fields.items():
            assert _same(_plain(got[name]), value), f"finalized row f{r}: {name} differs"
        assert dp.get_tags(partition_id="final", sample_ids=[f"f{r}"]) == ref_tags
    consumed = _consumed(dp)
    if consumed is not None:
        live_ids = held_sets.get("rows", set())
        assert model.claimed & live_ids <= consumed, "an acknowledged claim was lost"
        assert consumed & live_ids <= model.claimed, "rows claimed that no claim handed out"
    if kind == "save" or (inflight is not None and model.saved is not None
                          and model.plan[inflight - 1][0] == "save"):
        try:  # atomic: the old checkpoint or the new, whole (a kill between the swap's two
            # renames leaves the old one aside, which load finds)
            loaded = LocalDataPlane.load(ckpt)
        except CheckpointError as e:
            if "no checkpoint directory" not in str(e):
                raise
            got_view = None  # no checkpoint yet
        else:
            try:
                got_view = {p: sorted(loaded.list_sample_ids(p)) for p in loaded.list_partitions()}
            finally:
                loaded.close()
        if kind == "save":
            landed = got_view == model.view()
            if landed:
                model.saved = got_view
            else:
                assert got_view == model.saved, "a checkpoint cut by the kill is neither old nor new"
        else:
            assert got_view == model.saved, "the acknowledged checkpoint does not hold its rows"
    if inflight is not None:
        model.next_op = inflight + (1 if landed else 0)
        model.sites[kind] = model.sites.get(kind, 0) + 1


# --------------------------------------------------------------------------- local store
def _child(root: str, model: Model, start: int, fd: int) -> None:
    from tq_plugin.data_plane import LocalDataPlane

    os.write(fd, b"fork\n")
    dp = LocalDataPlane(journal_dir=root, journal_sync="always",
                        journal_compact_records=COMPACT_RECORDS)
    worker = Worker(dp, model.seed, root + ".ckpt")
    os.write(fd, b"open\n")
    for j in range(start, len(model.plan)):
        payload = worker.run(model.plan[j])
        os.write(fd, f"{j} {payload}\n".encode())


def _read_until(fd: int, buf: bytearray, until: float, want: bytes | None = None) -> None:
    while True:
        left = until - time.monotonic()
        if left <= 0 or (want is not None and want in buf):
            return
        ready, _, _ = select.select([fd], [], [], min(left, 0.05))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            buf += chunk


def run_local(base: str, points: int, seed: int) -> dict[str, Any]:
    """``points`` kill points over one journal under ``base``; returns the model's counts."""
    from tq_plugin.data_plane import LocalDataPlane

    torch.set_num_threads(1)
    root, ckpt = os.path.join(base, "journal"), os.path.join(base, "journal.ckpt")
    model = Model(seed=seed, plan=make_plan(seed, 40 * points + 200))
    rng = np.random.default_rng([seed, 1])
    open_s: list[float] = []
    work_s = check_s = 0.0
    for k in range(points):
        start = model.next_op
        r, w = os.pipe()
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the worker: it runs until it is killed
            try:
                os.close(r)
                _child(root, model, start, w)
            except BaseException:  # noqa: BLE001 - printed; the parent sees the worker end
                import traceback

                traceback.print_exc()
            finally:
                os._exit(3)
        os.close(w)
        buf = bytearray()
        if rng.random() < 0.15:  # during recovery, or as the worker starts
            _read_until(r, buf, time.monotonic() + float(rng.uniform(0.0, 0.05)))
        else:  # during work: a random moment after the journal is open
            _read_until(r, buf, time.monotonic() + 120, want=b"open\n")
            opened = time.monotonic()
            _read_until(r, buf, opened + float(rng.uniform(0.0, 0.07)))
            if b"open\n" in buf:
                open_s.append(opened - began)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        _read_until(r, buf, time.monotonic() + 30)  # the rest, to EOF
        os.close(r)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"kill point {k}: the worker ended by itself (status {status})")
        lines = buf.decode().splitlines()
        opened_ok = "open" in lines
        acks = [ln.split(" ", 1) for ln in lines if ln not in ("fork", "open")]
        for n, (j, payload) in enumerate(acks):
            assert int(j) == start + n, f"kill point {k}: acknowledgement {j} out of order"
            model.apply(model.plan[int(j)], payload)
        inflight = start + len(acks) if opened_ok else None
        if not opened_ok:
            model.sites["recovery"] = model.sites.get("recovery", 0) + 1
        t_check = time.monotonic()
        work_s += t_check - began
        dp = LocalDataPlane(journal_dir=root)
        try:
            check_recovered(model, dp, inflight, ckpt)
        except AssertionError as e:
            raise AssertionError(f"kill point {k} (seed {seed}, call {inflight}: "
                                 f"{model.plan[inflight] if inflight is not None else 'recovery'}): {e}") from e
        finally:
            dp.close()
            check_s += time.monotonic() - t_check
    return {"points": points, "calls": model.next_op, "acked": model.acked,
            "landed_unacknowledged": model.landed_unacked, "kill_sites": model.sites,
            "open_s_median": round(float(np.median(open_s)), 4) if open_s else None,
            "worker_s": round(work_s, 2), "check_s": round(check_s, 2)}


def test_kill_points_in_process(tmp_path) -> None:
    """Fast tier: a few kill points, forked from this process."""
    got = run_local(str(tmp_path), 4, 3)
    assert got["calls"] > 3, got


def test_the_checker_catches_a_lost_acknowledgement(tmp_path) -> None:
    """The checks fail on an acknowledged put that is not in the store, and on a put that is
    there without an acknowledgement (so the kill tests can fail)."""
    from tq_plugin.data_plane import LocalDataPlane

    plan = [("reg", "rows"), ("reg", "final"), ("reg", "staging"), ("put", 0), ("put", 1)]
    dp = LocalDataPlane(journal_dir=str(tmp_path / "j"))
    try:
        worker = Worker(dp, 5, "")
        model = Model(seed=5, plan=plan)
        for j in range(4):
            worker.run(plan[j])
            model.apply(plan[j], "")
        check_recovered(model, dp, 4, "")  # put 1 in flight, not landed
        assert model.next_op == 4
        lost = Model(seed=5, plan=plan)
        for j in range(5):
            lost.apply(plan[j], "")  # put 1 acknowledged, never written
        with pytest.raises(AssertionError, match="acknowledged ids missing"):
            check_recovered(lost, dp, None, "")
        worker.run(plan[4])
        model.apply(plan[4], "")
        dp.clear_samples(partition_id="rows", sample_ids=rows(5, 0)[0][:1])  # half a put gone
        with pytest.raises(AssertionError, match="acknowledged ids missing"):
            check_recovered(model, dp, None, "")
    finally:
        dp.close()


def test_a_save_killed_between_its_renames_reads_as_the_old_checkpoint(tmp_path) -> None:
    """A kill between a save's two renames leaves the old checkpoint aside (``.old-*``) and no
    new one: the check takes it as the old checkpoint, whole, and the save as not landed."""
    from tq_plugin.data_plane import LocalDataPlane

    plan = [("reg", "rows"), ("reg", "final"), ("reg", "staging"), ("put", 0), ("save",),
            ("put", 1), ("save",)]
    ckpt = str(tmp_path / "ckpt")
    dp = LocalDataPlane(journal_dir=str(tmp_path / "j"))
    try:
        worker, model = Worker(dp, 5, ckpt), Model(seed=5, plan=plan)
        for j in range(6):
            worker.run(plan[j])
            model.apply(plan[j], "")
        os.rename(ckpt, ckpt + ".old-0123")  # the second save's first rename, then the kill
        check_recovered(model, dp, 6, ckpt)
        assert model.next_op == 6  # issued again
        model.saved = {**model.saved, "rows": []}  # had the check read nothing, it would fail
        with pytest.raises(AssertionError, match="neither old nor new"):
            check_recovered(model, dp, 6, ckpt)
    finally:
        dp.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_200_kill_points_on_one_local_journal(tmp_path) -> None:
    """Slow tier: 200 kill points over one journal, in a helper process (imports once, forks
    a worker per point)."""
    points, seed = int(os.environ.get("TQ_CRASH_POINTS", "200")), 11
    out = subprocess.run([sys.executable, __file__, "local", str(tmp_path), str(points), str(seed)],
                         check=False, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, (out.stdout[-2000:] + out.stderr[-4000:])
    got = json.loads(out.stdout.splitlines()[-1])
    print("local kill points:", got)
    assert got["points"] == points
    sites = got["kill_sites"]
    # the kills landed on real work, of many kinds (and on recovery itself)
    assert sum(sites.values()) == points and len(sites) >= 5, sites
    assert got["acked"]["put"] > points and got["acked"]["stage"] > points, got


# --------------------------------------------------------------------------- Ray store
def run_ray(ray: Any, base: str, points: int, seed: int) -> dict[str, Any]:
    """``points`` kill points of the Ray store actor's process over one journal: each round
    opens the store in a new actor (recovering the journal), checks it, runs the plan from a
    driver thread and SIGKILLs the actor's process at a random moment."""
    from tq_plugin.data_plane import RayDataPlane
    from tq_plugin.data_plane.backends.ray_actor import DEFAULT_NAMESPACE, _StoreHost

    def host(k: int) -> Any:
        """Store actor k, started ahead: a Ray worker pays the torch import (seconds), which
        overlaps the rounds before it; RayDataPlane then finds it by name."""
        return (ray.remote(_StoreHost)
                .options(name=f"{name}_{k}", namespace=DEFAULT_NAMESPACE, num_cpus=0,
                         max_concurrency=16, get_if_exists=True).remote())

    root, ckpt = os.path.join(base, "journal"), os.path.join(base, "journal.ckpt")
    model = Model(seed=seed, plan=make_plan(seed, 60 * points + 200))
    rng = np.random.default_rng([seed, 2])
    inflight: int | None = None
    name = f"tq_crash_{os.getpid()}_{seed}"
    open_s: list[float] = []
    ahead = [host(0), host(1)]
    for k in range(points + 1):
        if k + 2 <= points:
            ahead.append(host(k + 2))
        if k == 1:  # Ray keeps a dead actor's name for the job's life: a new host, a new name
            with pytest.raises(ray.exceptions.RayActorError):
                RayDataPlane("crash", actor_name=f"{name}_0", journal_dir=root)
        began = time.monotonic()
        dp = RayDataPlane("crash", actor_name=f"{name}_{k}", journal_dir=root, journal_sync="always")
        open_s.append(time.monotonic() - began)
        assert dp._actor._actor_id == ahead[k]._actor_id
        if k:
            try:
                check_recovered(model, dp, inflight, ckpt)
            except Exception as e:
                raise AssertionError(f"Ray kill point {k - 1} (seed {seed}, call {inflight}: "
                                     f"{model.plan[inflight]}): {type(e).__name__}: {e}") from e
        if k == points:  # the last check done: acknowledged claims are never handed out again
            again = set(dp.claim_meta("rows", "train", ["obs"], 10_000, blocking=False).sample_ids)
            assert not again & model.claimed, "a claimed row was handed out again"
            dp.close()
            break
        pid = ray.get(dp._actor.pid.remote())
        start = model.next_op
        acks: list[tuple[int, str]] = []
        ended: list[BaseException] = []

        def work(dp: Any = dp, start: int = start, acks: list = acks, ended: list = ended) -> None:
            worker = Worker(dp, seed, ckpt)
            try:
                for j in range(start, len(model.plan)):
                    acks.append((j, worker.run(model.plan[j])))
            except BaseException as e:  # noqa: BLE001 - the actor's death, as the caller sees it
                ended.append(e)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        time.sleep(float(rng.uniform(0.0, 0.4)))
        os.kill(pid, signal.SIGKILL)
        thread.join(300)  # generous: Ray reports the death late on a loaded box
        assert not thread.is_alive(), f"point {k}: a call to the killed store actor never returned"
        assert ended, f"point {k}: the worker ran out of plan"
        # the call in flight failed because the actor died (the sink reports a failed stage)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dp._actor.pid.remote(), timeout=300)
        dp._closed = True  # its actor is gone; nothing to drop
        for j, payload in acks:
            model.apply(model.plan[j], payload)
        inflight = start + len(acks)
    return {"points": points, "calls": model.next_op, "acked": model.acked,
            "landed_unacknowledged": model.landed_unacked, "kill_sites": model.sites,
            "reopen_s_median": round(float(np.median(open_s)), 3)}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ray_store_actor_killed_at_random_moments(ray_session, tmp_path) -> None:
    """tq/backend=ray: the store actor's process SIGKILLed at 20 random points of the same
    work (one Ray session; the store reopened from its journal in a new actor each time)."""
    points = int(os.environ.get("TQ_CRASH_RAY_POINTS", "20"))
    got = run_ray(ray_session, str(tmp_path), points, 13)
    print("ray kill points:", got)
    assert sum(got["kill_sites"].values()) == points, got
    if points >= 10:  # the kills landed on real work, of several kinds
        assert len(got["kill_sites"]) >= 3, got
        assert got["acked"]["put"] > points // 2 and got["acked"]["stage"] > points // 2, got


if __name__ == "__main__":
    mode, base, npoints, nseed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    began = time.monotonic()
    result = run_local(base, npoints, nseed) if mode == "local" else {}
    result["wall_s"] = round(time.monotonic() - began, 2)
    print(json.dumps(result))

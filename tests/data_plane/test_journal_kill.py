"""SIGKILL at random moments (issue 37): a journaled store loses nothing it acknowledged.

One helper process imports torch and tq_plugin once, then for each kill point forks a child
that opens ``LocalDataPlane(journal_dir=D, journal_sync="always")`` and works on it: puts of
row batches (dense and jagged fields, tags), token staging through ``TQTokenSink``, clears and
claims, compacting every few dozen records. After each call returns the child appends a line
to its acknowledgement file. The helper SIGKILLs it at a random moment (inside a put, an fsync,
a compaction's snapshot...). Then this process opens ``LocalDataPlane(journal_dir=D)`` and
checks: every acknowledged row present byte-exact, every acknowledged staged call verified by
``TQTokenSource`` (and each rollout whose calls were all acknowledged by
``verify_and_linearize``), every acknowledged claim still claimed, every acknowledged clear
gone; a row or call that was never acknowledged is either the one call in flight, whole, or
absent; nothing is there twice.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

HELPER = r'''
import os, signal, sys, time
import numpy as np
import torch
from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import TQTokenSink, make_staged_chain, register_staging_partition

CALLS = 3


def rows(seed, i):
    """Put i's ids and fields (a pure function of seed and i)."""
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
    tags = [{"put": i, "row": k} for k in range(n)]
    return ids, fields, tags


def chain(seed, r):
    """Rollout r's staged calls (a pure function of seed and r)."""
    rng = np.random.default_rng([seed, 10_000 + r])
    turns = [(rng.integers(0, 150_000, 8).tolist(), rng.integers(0, 150_000, 24).tolist(),
              (-rng.random(24)).astype(np.float32).tolist()) for _ in range(CALLS)]
    return make_staged_chain(f"r{r}", turns, weight_versions=list(range(CALLS)))


def work(root, seed):
    torch.set_num_threads(1)
    fd = os.open(root + ".acks", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    ack = lambda line: os.write(fd, (line + "\n").encode())
    dp = LocalDataPlane(journal_dir=root, journal_sync="always", journal_compact_records=40)
    dp.register_partition("rows", [], consumer_tasks=["train"])
    ack("reg")
    register_staging_partition(dp, "staging")
    sink = TQTokenSink(dp, staging_partition="staging")
    ack("staging")
    for op in plan(seed):
        kind, i = op
        if kind == "put":
            ids, fields, tags = rows(seed, i)
            dp.put_samples(partition_id="rows", sample_ids=ids, fields=fields, tags=tags)
            ack(f"put {i}")
        elif kind == "stage":
            for c, record in enumerate(chain(seed, i)):
                if not sink.stage(record).ok:
                    raise SystemExit("stage failed")
                ack(f"stage {i} {c}")
        elif kind == "clear":
            dp.clear_samples(partition_id="rows", sample_ids=rows(seed, i)[0])
            ack(f"clear {i}")
        else:
            meta = dp.claim_meta("rows", "train", ["obs"], 3, blocking=False)
            ack("claim " + " ".join(meta.sample_ids))


def plan(seed):
    """The child's calls, in order (a pure function of seed): (kind, put or rollout index)."""
    rng = np.random.default_rng(seed)
    puts, rollouts = 0, 0
    while True:
        op = rng.random()
        if op < 0.45:
            yield "put", puts
            puts += 1
        elif op < 0.8:
            yield "stage", rollouts
            rollouts += 1
        elif op < 0.9 and puts:
            yield "clear", int(rng.integers(0, puts))
        else:
            yield "claim", None


if __name__ == "__main__":
    base, points, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = np.random.default_rng(seed)
    for k in range(points):
        root = os.path.join(base, f"k{k}")
        delay = float(rng.uniform(0.0, 0.8))
        pid = os.fork()
        if pid == 0:
            try:
                work(root, seed * 1000 + k)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(3)
        deadline = time.monotonic() + 120  # the kill falls on work, however loaded the box
        while time.monotonic() < deadline:
            try:
                with open(root + ".acks") as f:
                    if f.read().count("\n") >= 2:
                        break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print(root, delay, status, flush=True)
'''


def _helpers() -> dict:
    ns: dict = {"__name__": "journal_kill_helper"}
    exec(compile(HELPER, "journal_kill_helper", "exec"), ns)  # noqa: S102 - our own text above
    return ns


def _check_point(root: str, seed: int, helpers: dict) -> dict[str, int]:
    from tq_plugin.data_plane import LocalDataPlane
    from tq_plugin.staging import (
        StagedCallBaseSnapshot,
        TQTokenSource,
        make_rollout_receipt,
        verify_and_linearize,
    )

    with open(root + ".acks") as f:
        acks = f.read().splitlines()
    assert acks[:2] == ["reg", "staging"], acks[:3]  # the child got to work before the kill
    acked_puts: set[int] = set()
    cleared: set[int] = set()
    claimed: set[str] = set()
    staged: dict[int, int] = {}
    done = 0  # calls of the plan finished (a stage op: all of its calls acknowledged)
    for line in acks[2:]:
        kind, *rest = line.split()
        if kind == "put":
            acked_puts.add(int(rest[0]))
        elif kind == "clear":
            cleared.add(int(rest[0]))
        elif kind == "claim":
            claimed.update(rest)
        else:
            r, c = int(rest[0]), int(rest[1])
            staged[r] = c + 1
            if c + 1 < helpers["CALLS"]:
                continue
        done += 1
    in_flight = next(itertools.islice(helpers["plan"](seed), done, None))
    maybe_gone = {in_flight[1]} if in_flight[0] == "clear" else set()
    dp = LocalDataPlane(journal_dir=root)
    try:
        held = set(dp.list_sample_ids("rows"))
        by_put: dict[int, set[str]] = {}
        for sid in held:
            by_put.setdefault(int(sid[1:].split("/")[0]), set()).add(sid)
        next_put = in_flight[1] if in_flight[0] == "put" else -1
        for i, present in by_put.items():
            ids, fields, tags = helpers["rows"](seed, i)
            assert i in acked_puts or i == next_put, f"put {i} was never acknowledged nor in flight"
            assert present == set(ids), f"put {i} is half-present: {sorted(present)} of {ids}"
            got = dp.get_samples(partition_id="rows", sample_ids=ids, select_fields=list(fields))
            for name, want in fields.items():
                have = got[name]
                if want.is_nested:
                    assert torch.equal(have.values(), want.values()) and torch.equal(
                        have.offsets(), want.offsets()), (i, name)
                else:
                    assert have.dtype == want.dtype and torch.equal(have, want), (i, name)
            assert dp.get_tags(partition_id="rows", sample_ids=ids) == tags
        for i in acked_puts - cleared - maybe_gone:
            assert i in by_put, f"acknowledged put {i} is missing"
        # an acknowledged clear leaves nothing of the put (the clear in flight may have landed)
        for i in cleared:
            assert i not in by_put, f"put {i} was cleared, yet it is there"
        # acknowledged claims hold: the task is never handed those rows again
        again = dp.claim_meta("rows", "train", ["obs"], 10_000, blocking=False).sample_ids
        assert not (set(again) & claimed), "a claimed row was handed out again"
        # staged calls: every acknowledged one verified; at most the one in flight beyond them
        source = TQTokenSource(dp, staging_partition="staging", snapshot_cls=StagedCallBaseSnapshot)
        keys = set(dp.list_sample_ids("staging"))
        last = max(staged, default=-1)
        expected = {f"r{r}/c{c}" for r, n in staged.items() for c in range(n)}
        assert expected <= keys, f"acknowledged calls missing: {sorted(expected - keys)[:5]}"
        extra = keys - expected
        assert len(extra) <= 1, f"unacknowledged calls present: {sorted(extra)}"
        if extra:  # only the call in flight
            r = in_flight[1]
            assert in_flight[0] == "stage" and extra == {f"r{r}/c{staged.get(r, 0)}"}, extra
        for r in range(last + 2):
            records = helpers["chain"](seed, r)
            mine = [rec for rec in records if rec.staging_key in keys]
            if not mine:
                continue
            snaps = source.fetch([rec.staging_key for rec in mine])
            assert [s.model_dump() for s in snaps] == [
                rec.model_dump(exclude={"extras"}) for rec in mine]
            if len(mine) == len(records):
                verify_and_linearize(make_rollout_receipt(records), snaps)
        return {"puts": len(acked_puts), "calls": len(expected), "claims": len(claimed),
                "records": dp.journal.recovered_records, "torn": int(dp.journal.dropped_tail_bytes > 0)}
    finally:
        dp.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_at_random_moments_loses_nothing_acknowledged(tmp_path) -> None:
    points, seed = 24, 7
    helper = tmp_path / "helper.py"
    helper.write_text(HELPER)
    out = subprocess.run([sys.executable, str(helper), str(tmp_path), str(points), str(seed)],
                         check=False, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == points
    helpers = _helpers()
    totals = {"puts": 0, "calls": 0, "claims": 0, "records": 0, "torn": 0}
    for k, line in enumerate(lines):
        root, _, status = line.split()
        assert int(status) == 9, (
            f"kill point {k}: the child ended with status {status}, not SIGKILL: {out.stderr[-3000:]}")
        got = _check_point(root, seed * 1000 + k, helpers)
        for key in totals:
            totals[key] += got[key]
    # the kills landed on real work, in many places
    assert totals["puts"] > points and totals["calls"] > points, totals
    print("kill points", points, totals)


def test_the_kill_checker_catches_a_lost_acknowledgement(tmp_path) -> None:
    """The checker fails when an acknowledged put is missing (so the slow test can fail)."""
    from tq_plugin.data_plane import LocalDataPlane
    from tq_plugin.staging import register_staging_partition

    helpers = _helpers()
    root = str(tmp_path / "k")
    dp = LocalDataPlane(journal_dir=root, journal_sync="off")
    dp.register_partition("rows", [], consumer_tasks=["train"])
    register_staging_partition(dp, "staging")
    ids, fields, tags = helpers["rows"](5, 0)
    dp.put_samples(partition_id="rows", sample_ids=ids, fields=fields, tags=tags)
    dp.close()
    with open(root + ".acks", "w") as f:
        f.write("reg\nstaging\nput 0\n")
    assert _check_point(root, 5, helpers)["puts"] == 1
    with open(root + ".acks", "a") as f:
        f.write("put 1\n")  # acknowledged, never journaled
    with pytest.raises(AssertionError, match="acknowledged put 1 is missing"):
        _check_point(root, 5, helpers)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_ray_store_actor_killed_by_pid_recovers_from_its_journal(ray_session, tmp_path) -> None:
    """tq/backend=ray with a journal: the store actor's process SIGKILLed, a client opening the
    same store on the same journal_dir gets every acknowledged row, claim and staged call back."""
    import os
    import signal
    import time

    from tq_plugin.data_plane import RayDataPlane
    from tq_plugin.staging import (
        StagedCallBaseSnapshot,
        TQTokenSink,
        TQTokenSource,
        make_rollout_receipt,
        register_staging_partition,
        verify_and_linearize,
    )

    helpers = _helpers()
    name = "tq_plugin_journal_kill_test"
    dp = RayDataPlane("journaled", actor_name=name, journal_dir=tmp_path / "j", journal_sync="always")
    dp.register_partition("rows", [], consumer_tasks=["train"])
    register_staging_partition(dp, "staging")
    sink = TQTokenSink(dp, staging_partition="staging")
    puts = [helpers["rows"](11, i) for i in range(6)]
    for ids, fields, tags in puts:
        dp.put_samples(partition_id="rows", sample_ids=ids, fields=fields, tags=tags)
    chains = [helpers["chain"](11, r) for r in range(4)]
    for records in chains:
        assert all(sink.stage(record).ok for record in records)
    claimed = dp.claim_meta("rows", "train", ["obs"], 5, blocking=False).sample_ids
    dp.clear_samples(partition_id="rows", sample_ids=puts[2][0])
    pid = ray_session.get(dp._actor.pid.remote())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the handle reports the actor dead once Ray saw it go
        try:
            ray_session.get(dp._actor.pid.remote(), timeout=5)
        except ray_session.exceptions.RayActorError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the killed store actor was never reported dead")
    dp._closed = True  # its actor is gone; nothing to drop
    # the dead actor's name stays bound for the job's life: the store comes back in a new host
    with pytest.raises(ray_session.exceptions.RayActorError):
        RayDataPlane("journaled", actor_name=name, journal_dir=tmp_path / "j")
    again = RayDataPlane("journaled", actor_name=name + "_2", journal_dir=tmp_path / "j")
    try:
        assert ray_session.get(again._actor.pid.remote()) != pid
        for k, (ids, fields, tags) in enumerate(puts):
            if k == 2:
                assert not set(ids) & set(again.list_sample_ids("rows"))
                continue
            got = again.get_samples(partition_id="rows", sample_ids=ids, select_fields=list(fields))
            for field, want in fields.items():
                have = got[field]
                if want.is_nested:
                    assert torch.equal(have.values(), want.values())
                    assert torch.equal(have.offsets(), want.offsets())
                else:
                    assert have.dtype == want.dtype and torch.equal(have, want)
            assert again.get_tags(partition_id="rows", sample_ids=ids) == tags
        left = again.claim_meta("rows", "train", ["obs"], 1000, blocking=False).sample_ids
        assert not set(left) & set(claimed) and left
        source = TQTokenSource(again, staging_partition="staging", snapshot_cls=StagedCallBaseSnapshot)
        for records in chains:
            snaps = source.fetch([r.staging_key for r in records])
            verify_and_linearize(make_rollout_receipt(records), snaps)
    finally:
        again.close()

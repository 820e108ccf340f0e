"""Two-process CPU DDP (gloo) with the embedded backend: one global pad target, rank-local rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ddp_fit.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_ranks_keep_their_rows_and_agree_on_target_and_counts(tmp_path: Path) -> None:
    launcher_vars = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Same number of steps on both ranks (else DDP would have hung), in the same step order.
    assert [m["step"] for m in ranks[0]] == [m["step"] for m in ranks[1]]
    for step in (0, 1):
        per_rank = [[m for m in recs if m["step"] == step] for recs in ranks]
        own_max = [max(n for m in recs for n in m["lengths"]) for recs in per_rank]
        target = -(-max(own_max) // 4) * 4  # the dynamic-batching round is 4
        # The ranks' own maxima differ, so one rank pads beyond its longest row: a real agreement.
        assert -(-min(own_max) // 4) * 4 < target
        for r, recs in enumerate(per_rank):
            assert {m["width"] for m in recs} == {target}
            assert {m["target"] for m in recs} == {target}
            ids = [s for m in recs for s in m["ids"]]
            assert sorted(ids) == sorted(f"s{step}_r{r}_{i}" for i in range(7 if r == 0 else 3))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_ranks_read_length_balanced_shards_of_one_shared_store(
    tmp_path: Path, ray_session
) -> None:
    """With a store all ranks share, rank 0 writes a step once; each rank reads its shard."""
    from tq_plugin.data_plane import RayDataPlane

    owner = RayDataPlane("ddp-shared", actor_name="tq_plugin_ddp_test")
    try:
        address = ray_session.get_runtime_context().gcs_address
        launcher_vars = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
        proc = subprocess.run(
            [sys.executable, str(SCRIPT.with_name("ddp_shared_fit.py")), str(tmp_path), address,
             "ddp-shared"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        leftover = owner.list_sample_ids("train")
    finally:
        owner.close()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for step in (0, 1):
        per_rank = [[m for m in recs if m["step"] == step] for recs in ranks]
        ids = [[s for m in recs for s in m["ids"]] for recs in per_rank]
        # Disjoint, covering, equal row counts: rank 0 wrote 8 rows once, each rank read 4.
        assert len(ids[0]) == len(ids[1]) == 4 and not set(ids[0]) & set(ids[1])
        lengths = [n for recs in per_rank for m in recs for n in m["lengths"]]
        target = max(lengths)  # no rounding configured
        for recs in per_rank:
            assert {m["target"] for m in recs} == {target}
            assert {m["width"] for m in recs} == {target}
        tokens = [sum(n for m in recs for n in m["lengths"]) for recs in per_rank]
        assert max(tokens) - min(tokens) <= max(lengths)  # length-balanced split
    assert leftover == []  # each rank cleared its own shard after the step

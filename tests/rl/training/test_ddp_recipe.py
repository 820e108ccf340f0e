"""The recipes over several DDP ranks, on SIGTERM, and resumed from a checkpoint.

The subprocess runs (slow tier) are few: each pays seconds of imports per process.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli
from tq_plugin.data_plane import LocalDataPlane, first_write
from tq_plugin.rl.recipe import RLRecipe
from tq_plugin.rl.training import ranks

FAST = ["recipe.prompts_per_step=4", "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false"]
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "GLOBAL_RANK")


@pytest.fixture(autouse=True)
def _clean_hydra():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def compose_ppo(*overrides: str):
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        return compose("ppo", overrides=[*FAST, *overrides])


def with_fast(*overrides: str) -> list[str]:
    """FAST with ``overrides`` on top (Hydra refuses one key given twice)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [o for o in FAST if o.split("=", 1)[0] not in keys] + list(overrides)


def in_process(out: Path, *overrides: str) -> dict:
    """One run of the real entry point in this process; its result.json."""
    GlobalHydra.instance().clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["tq-train", f"hydra.run.dir={out}", *with_fast(*overrides)])
        cli.main(config_name="ppo")
    return json.loads((out / "result.json").read_text())


def subprocess_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "tq_plugin.cli", "--config-name", "ppo",
            f"hydra.run.dir={out}", *with_fast(*overrides)]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}


def rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------- fast: start-up checks
def test_trainer_keys_are_config_keys():
    """strategy, devices, num_nodes and precision are keys of the trainer group (no ``+``)."""
    cfg = compose_ppo("trainer.strategy=ddp_spawn", "trainer.devices=3", "trainer.num_nodes=1",
                      "trainer.precision=bf16-mixed")
    assert (cfg.trainer.strategy, cfg.trainer.devices, cfg.trainer.precision) == \
        ("ddp_spawn", 3, "bf16-mixed")
    preset = compose_ppo("trainer=ddp_cpu").trainer
    assert (preset.accelerator, preset.strategy, preset.devices) == ("cpu", "ddp", 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 4 prompts x 4 samples = 16 rows do not split over 3 ranks.
        (["trainer=ddp_cpu", "trainer.devices=3"], "must divide evenly over 3 DDP ranks"),
        (["trainer=ddp_cpu", "tq/backend=ray", "trainer.devices=3"],
         "must divide evenly over 3 DDP ranks"),  # refused before Ray starts
    ],
    ids=["uneven-global-batch", "uneven-global-batch-on-ray"],
)
def test_a_run_the_recipe_cannot_honour_fails_at_start(tmp_path, overrides, message):
    recipe = RLRecipe(compose_ppo(*overrides), tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        recipe.setup()
    assert not (tmp_path / "out").exists()  # nothing written, no process or store started


class _SharedBackend:
    """A shared backend class whose ``start_cluster`` records what it was asked."""

    shared = True
    started: ClassVar[list[dict]] = []

    @classmethod
    def start_cluster(cls, **options):
        cls.started.append(options)
        return "127.0.0.2:6390"


def _backend_node(**options):
    from omegaconf import OmegaConf

    return OmegaConf.create({"_target_": "fake.SharedBackend", "store": "s", **options})


@pytest.fixture
def shared_backend(monkeypatch):
    _SharedBackend.started = []
    monkeypatch.setattr(ranks, "get_class", lambda path: _SharedBackend if path ==
                        "fake.SharedBackend" else LocalDataPlane)
    monkeypatch.delenv(ranks.CLUSTER_ADDRESS_ENV, raising=False)
    return _SharedBackend


def test_the_launching_process_starts_the_ranks_cluster_and_exports_it_for_the_fit(shared_backend):
    node = _backend_node(address=None, ray_init={"num_cpus": 2})
    started = ranks.share_store_across_ranks(node)
    assert started == node.address == "127.0.0.2:6390"
    assert shared_backend.started == [{"store": "s", "address": None, "ray_init": {"num_cpus": 2}}]
    with ranks.exported_address(started):
        assert os.environ[ranks.CLUSTER_ADDRESS_ENV] == started
        # A rank Lightning launches finds it there and attaches; it starts nothing.
        rank_node = _backend_node(address=None)
        assert ranks.share_store_across_ranks(rank_node) is None
        assert rank_node.address == started and len(shared_backend.started) == 1
    assert ranks.CLUSTER_ADDRESS_ENV not in os.environ  # only for the fit


def test_a_named_cluster_or_an_embedded_store_is_left_as_configured(shared_backend):
    named = _backend_node(address="127.0.0.2:7000")
    assert ranks.share_store_across_ranks(named) is None and named.address == "127.0.0.2:7000"
    from omegaconf import OmegaConf

    local = OmegaConf.create({"_target_": "tq_plugin.data_plane.LocalDataPlane"})
    assert ranks.share_store_across_ranks(local) is None and "address" not in local
    assert shared_backend.started == []


def test_rank_zero_fails_when_a_launched_rank_failed():
    ok = subprocess.Popen([sys.executable, "-c", "pass"])
    bad = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    spawned = SimpleNamespace(pid=1, exitcode=0)  # ddp_spawn's: joined by its launcher already
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(
        procs=[ok, spawned, bad])))
    with pytest.raises(RuntimeError, match=r"DDP rank 2 \(pid \d+\) exited with status 3"):
        ranks.wait_for_launched_ranks(trainer, timeout_s=60)


class _Strategy(SimpleNamespace):
    """Rank ``global_rank`` of two; ``other`` is what the other rank contributes to a reduce."""

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "max"
        return torch.maximum(tensor, self.other(tensor))


def _step(client: LocalDataPlane, lengths: list[int]):
    client.register_partition("train", fields=[])
    rows = {"sample_mask": torch.ones(len(lengths)), "input_lengths": torch.tensor(lengths)}
    return first_write(rows, sample_ids=[f"row{i}" for i in range(len(lengths))], client=client,
                       partition_id="train")


def test_replica_shard_keeps_this_ranks_balanced_half_and_clears_the_rest():
    client = LocalDataPlane()
    meta = _step(client, [9, 1, 8, 2, 7, 3, 6, 4])
    strategy = _Strategy(world_size=2, global_rank=1, root_device=torch.device("cpu"),
                         other=lambda t: t)
    mine = ranks.replica_shard(meta, client, strategy=strategy, global_batch=4)
    assert mine.size == 4
    assert client.list_sample_ids("train") == mine.sample_ids  # the other half is gone
    halves = [mine.sequence_lengths[:2], mine.sequence_lengths[2:]]  # one per global batch
    assert [sum(h) for h in halves] == [10, 10]  # each global batch split by tokens, evenly


def test_replica_shard_refuses_ranks_that_generated_different_steps():
    client = LocalDataPlane()
    meta = _step(client, [5, 6, 7, 8])
    strategy = _Strategy(world_size=2, global_rank=0, root_device=torch.device("cpu"),
                         other=lambda t: t + 1)
    with pytest.raises(RuntimeError, match="generated different rollouts"):
        ranks.replica_shard(meta, client, strategy=strategy, global_batch=4)
    assert len(client.list_sample_ids("train")) == 4  # nothing cleared


# ----------------------------------------------------------------------- slow: real ranks
@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("one_process")
    in_process(out, "recipe.num_steps=2")
    return rows(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "steps"), [("ddp", 2), ("ddp_spawn", 1)])
def test_two_ranks_train_the_one_process_update(tmp_path, one_process, strategy, steps):
    """Same seed: 2 ranks run exactly num_steps, on the one-process global batch, and their
    first update's loss (reduced over ranks) equals the one-process loss; rank 0 writes."""
    proc = subprocess.run(
        subprocess_cmd(tmp_path, "trainer=ddp_cpu", f"trainer.strategy={strategy}",
                       f"recipe.num_steps={steps}"),
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=280, check=False)
    assert_one_process_update(proc, tmp_path, one_process[:steps])


def assert_one_process_update(proc: subprocess.CompletedProcess, out: Path,
                              one_process: list[dict]) -> None:
    """Both ranks ran every step; rank 0's artifacts hold the one-process figures."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = len(one_process)
    for rank in (0, 1):
        assert f"rank {rank}/2: {steps} RL steps, {steps} optimizer steps" in proc.stdout
    got = rows(out)
    assert [int(r["step"]) for r in got] == list(range(steps))
    assert json.loads((out / "result.json").read_text())["steps"] == steps
    for ddp, ref in zip(got, one_process, strict=True):
        assert int(ddp["train_tokens"]) == int(ref["train_tokens"])  # the same global batch
        assert float(ddp["reward"]) == float(ref["reward"])  # the same rollouts
    first, ref = float(got[0]["loss"]), float(one_process[0]["loss"])
    assert first == pytest.approx(ref, rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "strategy"), [("ray", "ddp"), ("transferqueue", "ddp"),
                                                    ("ray", "ddp_spawn")])
def test_two_ranks_share_the_store_rank_zero_starts(tmp_path, one_process, backend, strategy,
                                                   run_process_tree):
    """The done-when command, ``tq-train trainer=ddp_cpu tq/backend=<shared>`` with no cluster:
    rank 0's process starts Ray (and TransferQueue) before the ranks exist, rank 1 attaches to
    it, rank 0 generates each step once into the store, every rank trains on its shard, the
    update is the one-process update, and no process of the run outlives it."""
    proc, started, left = run_process_tree(
        subprocess_cmd(tmp_path, "trainer=ddp_cpu", f"trainer.strategy={strategy}",
                       "recipe.num_steps=2", f"tq/backend={backend}",
                       "++tq.backend.ray_init.log_to_driver=false"),
        cwd=tmp_path, env=clean_env())
    assert_one_process_update(proc, tmp_path, one_process)
    assert len(started) > 2  # rank 1 and Ray's own processes
    assert not left, [" ".join(p.cmdline())[:120] for p in left]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_attach_to_a_named_cluster(tmp_path, one_process, ray_session):
    """``tq.backend.address`` names a running cluster: every rank attaches to it."""
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.run(
        subprocess_cmd(tmp_path, "trainer=ddp_cpu", "recipe.num_steps=2", "tq/backend=ray",
                       f"tq.backend.address={address}", "tq.backend.store=ddp_recipe_named",
                       # Ray refuses num_cpus when attaching to a running cluster.
                       "tq.backend.ray_init.num_cpus=null", "++tq.backend.ray_init.log_to_driver=false"),
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=280, check=False)
    assert_one_process_update(proc, tmp_path, one_process)


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before logging {text!r}")
        time.sleep(0.2)
    pytest.fail(f"no {text!r} in {path} within {timeout} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_checkpoints_and_exits_non_zero_and_ckpt_path_resumes(tmp_path):
    out = tmp_path / "stopped"
    # Two PPO epochs: the signal may land inside a step or at its end; both must resume.
    proc = subprocess.Popen(subprocess_cmd(out, "recipe.num_steps=200", "recipe.ppo_epochs=2"),
                            cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        _wait_for(out / "tq-train.log", "RL step 1/", proc, timeout=150)  # step 0 done
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    ckpt = out / "checkpoints" / "sigterm.ckpt"
    assert ckpt.is_file()
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "interrupted"
    done = torch.load(ckpt, weights_only=False)["callbacks"]
    completed = next(v["completed_steps"] for k, v in done.items() if "DataPlaneCallback" in k)
    assert [int(r["step"]) for r in rows(out)] == list(range(completed))

    resumed = tmp_path / "resumed"
    target = completed + 2
    summary = in_process(resumed, f"ckpt_path={ckpt}", f"recipe.num_steps={target}",
                         "recipe.ppo_epochs=2")
    assert summary["status"] == "ok" and summary["steps"] == target
    assert [int(r["step"]) for r in rows(resumed)] == list(range(target))
    # The finished steps' figures came back from the checkpoint unchanged.
    assert rows(resumed)[:completed] == rows(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_disaggregated_with_two_trainer_ranks(tmp_path, run_process_tree):
    """The done-when's ``recipe=grpo tq/backend=ray recipe.topology=disaggregated
    recipe.rollout_workers=2 recipe.max_staleness=1`` with a 2-rank DDP trainer: rank 0 runs the
    workers and prepares each step, both ranks train every step on their shards, one result,
    one row per step within the staleness bound, and no process of the run outlives it."""
    steps = 3
    cmd = [sys.executable, "-m", "tq_plugin.cli", "--config-name", "grpo", f"hydra.run.dir={tmp_path}",
           *FAST, "trainer=ddp_cpu", "tq/backend=ray", "recipe.topology=disaggregated",
           "recipe.rollout_workers=2", "recipe.max_staleness=1", f"recipe.num_steps={steps}",
           "++tq.backend.ray_init.log_to_driver=false"]
    proc, started, left = run_process_tree(cmd, cwd=tmp_path, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: {steps} RL steps, {steps} optimizer steps" in proc.stdout
    assert " raised:" not in proc.stderr and "died with" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == steps
    assert result["topology"] == "disaggregated" and result["workers_lost"] == 0
    got = rows(tmp_path)
    assert [int(r["step"]) for r in got] == list(range(steps))
    assert all(0 <= int(r["staleness_max"]) <= 1 and int(r["workers_alive"]) == 2 for r in got)
    # Each step's global batch is prompts_per_step * group_size rows, trained once over 2 ranks.
    assert all(int(r["train_tokens"]) > 0 for r in got)
    assert len(started) > 3  # rank 1, two worker actors, Ray's processes
    assert not left, [" ".join(p.cmdline())[:120] for p in left]

"""FSDP2 through Lightning's ModelParallelStrategy (trainer=fsdp_cpu): the bucketed gather of full
weights, the refused combinations, and 2-rank runs against the one-process and the DDP update.

The subprocess runs (slow tier) are few: each pays seconds of imports per process.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin import cli
from tq_plugin.config import ConfigError
from tq_plugin.rl.models import fsdp as sharding
from tq_plugin.rl.recipe import RLRecipe

FAST = ["recipe.prompts_per_step=4", "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false",
        "model=hf_causal_lm"]
pytestmark = pytest.mark.usefixtures("fresh_hydra")


def compose_grpo(*overrides: str):
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        return compose("grpo", overrides=[*FAST, *overrides])


def cmd(config: str, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "tq_plugin.cli", "--config-name", config,
            f"hydra.run.dir={out}", *FAST, *overrides]


@pytest.fixture
def run(launcher_free_env):
    """``run(config, out, *overrides)``: the entry point in a subprocess, to a clean exit."""

    def run(config: str, out: Path, *overrides: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd(config, out, *overrides), cwd=out.parent, env=launcher_free_env,
                              capture_output=True, text=True, timeout=280, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    return run


def in_process(config: str, out: Path, *overrides: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["tq-train", f"hydra.run.dir={out}", *FAST, *overrides])
        cli.main(config_name=config)
    GlobalHydra.instance().clear()


def rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------- fast: bucketed gather
class _Shard:
    """A stand-in DTensor: ``full_tensor()`` materializes the full value and counts it live."""

    live: list[int]

    def __init__(self, full: torch.Tensor, live: list[int]) -> None:
        self.full, self.live = full, live

    def numel(self) -> int:
        return self.full.numel()

    def element_size(self) -> int:
        return self.full.element_size()

    def detach(self) -> _Shard:
        return self

    def full_tensor(self) -> torch.Tensor:
        self.live.append(self.full.numel() * self.full.element_size())
        return self.full.clone()


def test_full_tensors_come_in_order_a_bounded_bucket_at_a_time(monkeypatch):
    monkeypatch.setattr(sharding, "_dtensor_cls", lambda: _Shard)
    gathered: list[int] = []
    fulls = [torch.full((n,), float(i)) for i, n in enumerate([10, 10, 10, 40, 5, 5])]  # float32
    named = [(f"p{i}", _Shard(t, gathered)) for i, t in enumerate(fulls)]
    named.insert(2, ("plain", torch.ones(3)))  # not sharded: passes through
    bucket = 100  # bytes: 25 floats
    held_at_once, seen, done = [], [], 0
    for name, tensor in sharding.iter_full_tensors(named, bucket_bytes=bucket):
        # Full bytes gathered and not yet consumed (the consumer drops each after its turn).
        held_at_once.append(sum(gathered) - done)
        done += tensor.numel() * 4 if name != "plain" else 0
        seen.append((name, tensor))
    assert [n for n, _ in seen] == ["p0", "p1", "plain", "p2", "p3", "p4", "p5"]
    for (name, tensor), ref in zip([s for s in seen if s[0] != "plain"], fulls, strict=True):
        assert torch.equal(tensor, ref), name
    # No bucket held more than its bound, except the one tensor larger than a bucket (160 B).
    assert max(held_at_once) <= 160
    assert [h for h in held_at_once if h > bucket] == [160]


def test_full_state_dict_keeps_tensors_on_rank_zero_only(monkeypatch):
    model = torch.nn.Linear(3, 2)
    state = sharding.full_state_dict(model, rank=0, bucket_bytes=8)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert sharding.full_state_dict(model, rank=1) is None
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(sharding.iter_full_tensors([], bucket_bytes=0))


def test_hf_model_shards_per_decoder_layer_and_the_tiny_model_whole():
    pytest.importorskip("transformers")
    from tq_plugin.rl.models.hf import HFCausalLM

    policy = HFCausalLM(16, n_layers=3)
    assert len(policy.sharding_units()) == 3
    assert all(type(u).__name__ == "LlamaDecoderLayer" for u in policy.sharding_units())
    assert len(HFCausalLM(16, n_layers=2, value_head=True).sharding_units()) == 2
    gpt2 = HFCausalLM(16, model_type="gpt2", n_layers=2)
    assert [type(u).__name__ for u in gpt2.sharding_units()] == ["GPT2Block", "GPT2Block"]


# ----------------------------------------------------------------------- fast: refused at start
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tq/backend=ray"], "tq.backend=RayDataPlane with a sharded trainer"),
        (["recipe.topology=disaggregated", "tq/backend=local"],
         "recipe.topology=disaggregated needs a store shared across processes"),
        (["trainer.strategy.tensor_parallel_size=2"], "trainer.strategy.tensor_parallel_size=2"),
        (["trainer.devices=3"], "must divide evenly over 3 DDP ranks"),
    ],
    ids=["shared-store", "disaggregated", "tensor-parallel", "uneven-global-batch"],
)
def test_a_sharded_run_the_recipe_cannot_honour_fails_at_start(tmp_path, overrides, message):
    recipe = RLRecipe(compose_grpo("trainer=fsdp_cpu", *overrides), tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        recipe.setup()
    assert not (tmp_path / "out").exists()  # nothing written, no process or store started


def _stand_in(strategy: str, accelerator: str, world: int, **attrs):
    from types import SimpleNamespace

    return SimpleNamespace(strategy=type(strategy, (), {"launcher": None, **attrs})(),
                           accelerator=type(accelerator, (), {})(), world_size=world)


def test_sharded_gpus_are_accepted_and_lightnings_fsdp1_refused_by_key():
    from types import SimpleNamespace

    from tq_plugin.rl.training import ranks

    local = SimpleNamespace(_target_="tq_plugin.data_plane.LocalDataPlane")
    mp = {"_tensor_parallel_size": 1, "_data_parallel_size": 4}
    ranks.check_parallel_run(_stand_in("ModelParallelStrategy", "CUDAAccelerator", 4, **mp),
                             backend=local, global_batch=8, save_artifacts=True)
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp is Lightning's FSDP1"):
        ranks.check_parallel_run(_stand_in("FSDPStrategy", "CUDAAccelerator", 2), backend=local,
                                 global_batch=8, save_artifacts=True)
    with pytest.raises(ConfigError, match="trainer.strategy.data_parallel_size=2 must equal"):
        ranks.check_parallel_run(
            _stand_in("ModelParallelStrategy", "CUDAAccelerator", 4, _tensor_parallel_size=1,
                      _data_parallel_size=2), backend=local, global_batch=8, save_artifacts=True)


def test_a_ranks_shard_pass_pads_to_the_busiest_ranks_forward_count():
    """Sharded disaggregated passes: each rank passes its own rows, then as many throwaway
    forwards as the busiest rank has more (every FSDP forward is a collective); the rows'
    logprobs are those of an unpadded pass, and an empty shard only joins the forwards."""
    from tq_plugin.config import PackingConfig, RecipeConfig
    from tq_plugin.data_plane import PREV_LOGPROBS, LocalDataPlane
    from tq_plugin.lightning.demo import SyntheticRollouts, partition_spec
    from tq_plugin.rl.models.tiny import TinyTransformer
    from tq_plugin.rl.training.module import RLModule

    torch.manual_seed(0)
    policy = TinyTransformer(16, d_model=8, n_heads=2, n_layers=1, max_seq_len=64)
    calls: list[int] = []
    policy.register_forward_pre_hook(lambda mod, args: calls.append(args[0].numel()))
    module = RLModule(policy=policy, value=None, recipe=RecipeConfig(algorithm="grpo"),
                      packing=PackingConfig())
    client = LocalDataPlane()
    client.register_partition(**partition_spec())
    module.dp_client = client
    meta = SyntheticRollouts(rows=3, vocab_size=16, max_len=10)(0, client)
    module.forward_pass(meta, role="policy", step=0)
    plain, own = module.read_from_dataplane(meta, select_fields=[PREV_LOGPROBS]), len(calls)
    calls.clear()
    module.forward_pass(meta, role="policy", step=0, pair_with=lambda n: n + 2)
    assert len(calls) == own + 2 and calls[own:] == [1, 1]  # two one-token forwards
    again = module.read_from_dataplane(meta, select_fields=[PREV_LOGPROBS])
    assert torch.equal(again[PREV_LOGPROBS], plain[PREV_LOGPROBS])
    calls.clear()
    module.forward_pass(meta.subset([]), role="policy", step=0, pair_with=lambda n: 3)
    assert calls == [1, 1, 1]


def test_each_ranks_peak_memory_is_a_metrics_column():
    from tq_plugin.rl.training import ranks
    from tq_plugin.rl.training.metrics import StepRecord

    def step(peak: float) -> StepRecord:
        record = StepRecord(0, 0.5, 0.5, 0.5, 0.1, 0.1, 0)
        record.add({"real_tokens": 4, "padded_tokens": 4, "seconds": 0.1, "peak_mem_mb": peak},
                   last_in_global_batch=True)
        return record

    assert step(12.0).row()["peak_mem_mb_rank0"] == 12.0
    (merged,) = ranks.merge_rank_steps([[step(10.0)], [step(30.0)]])
    row = merged.row()
    assert (row["peak_mem_mb_rank0"], row["peak_mem_mb_rank1"]) == (10.0, 30.0)


def test_the_presets_build_model_parallel_strategies():
    for preset, accelerator in (("fsdp_cpu", "cpu"), ("fsdp", "gpu")):
        node = compose_grpo(f"trainer={preset}").trainer
        assert node.strategy._target_.endswith("ModelParallelStrategy")
        assert (node.accelerator, node.strategy.data_parallel_size,
                node.strategy.tensor_parallel_size) == (accelerator, 2, 1)
        GlobalHydra.instance().clear()


# ----------------------------------------------------------------------- slow: real DTensors
_GATHER_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from tq_plugin.rl.models.weights import save_full_weights
from torch.distributed.device_mesh import init_device_mesh
from tq_plugin.rl.models import fsdp as sharding
from tq_plugin.rl.models.hf import HFCausalLM

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = HFCausalLM(32, n_layers=3, d_model=32)
ref = {k: v.clone() for k, v in model.state_dict().items()}
ids = torch.randint(0, 32, (4, 9))
whole = HFCausalLM(32, n_layers=3, d_model=32)
whole.load_state_dict(ref)
sharding.shard_model(model, init_device_mesh("cpu", (2,)))
assert sharding.is_sharded(model)
# The sharded forward, loss and clipped norm are the one-process ones.
for m in (model, whole):
    m(ids).float().logsumexp(-1).mean().backward()
# Lightning's norm clip (RLModule.configure_gradient_clipping) on shards: the global norm.
from lightning.pytorch.plugins.precision import Precision
opt = torch.optim.SGD(model.parameters(), lr=1.0)
ref_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e-3)
assert ref_norm > 1e-2  # the clip scales every gradient
Precision().clip_grad_by_norm(opt, 1e-3)
for (n, p), q in zip(model.named_parameters(), whole.parameters()):
    assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-7), n
state = sharding.full_state_dict(model, rank=rank, bucket_bytes=4096)
if rank == 0:
    assert state.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(state[k], v), k
else:
    assert state is None
names = [n for n, _ in sharding.iter_full_tensors(model.named_parameters(), bucket_bytes=1)]
assert names == [n for n, _ in model.named_parameters()]
path = save_full_weights(model, sys.argv[1], role="policy", rank=rank)
# The disaggregated workers' weights: the flat row every rank gathers and rank 0 publishes. A
# whole model loaded from it (as a worker loads it) is the sharded one: same logits, same
# greedy continuation.
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from tq_plugin.rl.topology.exchange import weights_snapshot
flat = weights_snapshot(model, keep=rank == 0)
assert (flat is None) == (rank != 0)
with torch.no_grad():
    sharded_logits = model(ids)
    sharded_greedy = sharded_logits.argmax(-1)
if rank == 0:
    assert flat.shape == (1, sum(p.numel() for p in whole.parameters()))
    assert torch.equal(flat[0], parameters_to_vector(whole.parameters()).float())
    worker = HFCausalLM(32, n_layers=3, d_model=32)
    vector_to_parameters(flat[0], worker.parameters())
    with torch.no_grad():
        assert torch.allclose(worker(ids), sharded_logits, atol=1e-5)
        assert torch.equal(worker(ids).argmax(-1), sharded_greedy)
dist.barrier()
print("ok", rank, path)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sharded_weights_gather_clip_and_save_as_the_whole_model(tmp_path):
    """Two gloo ranks shard an hf_causal_lm per layer: gradients (clipped by Lightning's norm
    clip), the gathered state dict, the saved file and the flat weights row the disaggregated
    workers load are the unsharded model's (a worker's model loaded from the row gives the
    sharded model's logits and greedy tokens)."""
    pytest.importorskip("transformers")
    script = tmp_path / "gather.py"
    script.write_text(_GATHER_SCRIPT)
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path / "p.safetensors")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    from tq_plugin.rl.models.hf import HFCausalLM
    from tq_plugin.rl.models.weights import load_weights

    torch.manual_seed(0)
    ref = HFCausalLM(32, n_layers=3, d_model=32)
    loaded = load_weights(HFCausalLM(32, n_layers=3, d_model=32), tmp_path / "p.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(),
                                                  loaded.state_dict().values(), strict=True))


# ----------------------------------------------------------------------- slow: the recipes
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_trains_the_one_process_and_the_ddp_update(tmp_path, run):
    """Same seed and global batch: under trainer=fsdp_cpu (hf_causal_lm sharded per layer) the
    first update's loss equals the one-process and the DDP loss, and so do the second step's
    rollouts (which the first update's weights generate); each rank's peak memory is a column;
    the gathered final weights, the policy's and the value model's, match the one-process ones.
    PPO only: GRPO's policy under FSDP is the same code without the value model, and its
    sharded runs are checked against unsharded figures by the resume and engine tests below
    (each recipe run here is a 2-rank subprocess: the slow tier's time is bounded)."""
    config, steps = "ppo", 2
    one, ddp, fsdp = tmp_path / "one", tmp_path / "ddp", tmp_path / "fsdp"
    in_process(config, one, f"recipe.num_steps={steps}")
    run(config, ddp, "trainer=ddp_cpu", f"recipe.num_steps={steps}")
    proc = run(config, fsdp, "trainer=fsdp_cpu", f"recipe.num_steps={steps}")
    for rank in (0, 1):
        assert f"rank {rank}/2: {steps} RL steps, {steps} optimizer steps" in proc.stdout
    assert json.loads((fsdp / "result.json").read_text())["steps"] == steps
    ref, ddp_rows, got = rows(one), rows(ddp), rows(fsdp)
    assert [int(r["step"]) for r in got] == list(range(steps))
    for f, d, r in zip(got, ddp_rows, ref, strict=True):
        assert int(f["train_tokens"]) == int(d["train_tokens"]) == int(r["train_tokens"])
        assert float(f["reward"]) == pytest.approx(float(r["reward"]), abs=1e-5)
        assert float(f["reward"]) == pytest.approx(float(d["reward"]), abs=1e-5)
        assert float(f["peak_mem_mb_rank0"]) > 0 and float(f["peak_mem_mb_rank1"]) > 0
    first = float(got[0]["loss"])
    assert first == pytest.approx(float(ref[0]["loss"]), rel=1e-4, abs=1e-6)
    assert first == pytest.approx(float(ddp_rows[0]["loss"]), rel=1e-4, abs=1e-6)
    from safetensors.torch import load_file

    names = ["policy.safetensors"] + (["value.safetensors"] if config == "ppo" else [])
    for name in names:
        a, b = load_file(str(one / name)), load_file(str(fsdp / name))
        assert a.keys() == b.keys()
        for key in a:
            # Adam divides by sqrt(v): a coordinate whose gradient is float noise (summed in
            # another order over 2 ranks) moves by up to lr either way, so a lone coordinate may
            # differ by more than the rest; a wrong update would move them all (by ~lr = 3e-3).
            gap = (a[key] - b[key]).abs()
            assert float(gap.mean()) < 1e-7 and float(gap.max()) < 1e-4, (name, key)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ckpt_path_resumes_an_fsdp_run_from_its_sharded_checkpoint(tmp_path, run):
    """A ModelCheckpoint under trainer=fsdp_cpu writes a sharded checkpoint (a folder, one file
    per rank, plus Lightning's and the store's state); ckpt_path resumes it to num_steps and the
    resumed steps are the uninterrupted run's. (recipe.checkpoint_every's sharded last.ckpt is
    resumed by test_ckpt_path_resumes_a_disaggregated_fsdp_run.)"""
    first, resumed, straight = tmp_path / "first", tmp_path / "resumed", tmp_path / "straight"
    run("grpo", first, "trainer=fsdp_cpu", "recipe.num_steps=3",
        "trainer.enable_checkpointing=true",
        "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        "+callbacks.ckpt.every_n_train_steps=2", "+callbacks.ckpt.save_top_k=-1",
        f"+callbacks.ckpt.dirpath={first / 'ckpts'}")
    ckpt = first / "ckpts" / "epoch=0-step=2.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    run("grpo", resumed, "trainer=fsdp_cpu", "recipe.num_steps=4", f"ckpt_path='{ckpt}'")
    run("grpo", straight, "trainer=fsdp_cpu", "recipe.num_steps=4")
    summary = json.loads((resumed / "result.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 4
    got, ref = rows(resumed), rows(straight)
    assert [int(r["step"]) for r in got] == list(range(4))
    for r, s in zip(got[2:], ref[2:], strict=True):  # trained after the resume
        assert (r["reward"], r["loss"], r["train_tokens"]) == (s["reward"], s["loss"],
                                                                s["train_tokens"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_trains_the_disaggregated_topology(tmp_path, run_process_tree, launcher_free_env):
    """The done-when's ``trainer=fsdp_cpu recipe.topology=disaggregated tq/backend=ray
    recipe.rollout_workers=1``: rank 0 claims the workers' rows, both ranks join every no-grad
    pass and every gather of the weights the workers load, one result, every step within the
    staleness bound, each rank's peak memory, the gathered final weights, and no process left.
    Step 0's rows were generated by the worker from the first gathered publish: their
    generation logprobs are the trainer's (the sync holds under FSDP). PPO: the value model is
    sharded, gathered and written too (GRPO's disaggregated FSDP run is the resume test's)."""
    config, steps = "ppo", 3
    out = tmp_path / "run"
    command = cmd(config, out, "trainer=fsdp_cpu", "tq/backend=ray",
                  "recipe.topology=disaggregated", "recipe.rollout_workers=1",
                  f"recipe.num_steps={steps}", "++tq.backend.ray_init.log_to_driver=false")
    proc, started, left = run_process_tree(command, cwd=tmp_path, env=launcher_free_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: {steps} RL steps" in proc.stdout
    assert " raised:" not in proc.stderr and "died with" not in proc.stderr, proc.stderr[-3000:]
    assert "returned a view tensor" not in proc.stderr  # the value head's output is its own
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == steps
    assert result["topology"] == "disaggregated" and result["workers_lost"] == 0
    got = rows(out)
    assert [int(r["step"]) for r in got] == list(range(steps))
    assert all(0 <= int(r["staleness_max"]) <= 1 and int(r["workers_alive"]) == 1 for r in got)
    assert all(float(r["peak_mem_mb_rank0"]) > 0 and float(r["peak_mem_mb_rank1"]) > 0
               for r in got)
    assert int(got[0]["staleness_max"]) == 0 and float(got[0]["logprob_gap"]) < 1e-4
    names = ["policy.safetensors"] + (["value.safetensors"] if config == "ppo" else [])
    assert all((out / n).is_file() for n in names)
    assert len(started) > 2  # rank 1, the worker actor, Ray's processes
    assert not left, [" ".join(p.cmdline())[:120] for p in left]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_hf_engine_under_ddp_and_fsdp_generates_the_one_process_rollouts(tmp_path, run):
    """engine=hf with 2 ranks (each rank replays the step with an engine of its own, started
    from the checkpoint rank 0 writes; under FSDP from the gathered shards, and synced before
    each step from the streamed bucketed gather): with the same seed every step's rollouts
    (rewards), loss and engine/trainer logprob gap are the one-process engine=hf run's, so the
    engines served the trained weights at every step."""
    steps = 3
    one = tmp_path / "one"
    in_process("grpo", one, "engine=hf", f"recipe.num_steps={steps}")
    ref = rows(one)
    for trainer in ("ddp_cpu", "fsdp_cpu"):
        out = tmp_path / trainer
        run("grpo", out, "engine=hf", f"trainer={trainer}", f"recipe.num_steps={steps}")
        result = json.loads((out / "result.json").read_text())
        assert result["engine"] == "hf" and result["weight_syncs"] == steps - 1, trainer
        for g, r in zip(rows(out), ref, strict=True):
            assert float(g["reward"]) == pytest.approx(float(r["reward"]), abs=1e-5), trainer
            assert float(g["loss"]) == pytest.approx(float(r["loss"]), rel=1e-4, abs=1e-6)
            assert float(g["logprob_gap"]) < 1e-4, trainer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ckpt_path_resumes_a_disaggregated_fsdp_run(tmp_path, run):
    """A disaggregated GRPO run under trainer=fsdp_cpu writes recipe.checkpoint_every's sharded
    checkpoint at step 2; ckpt_path resumes it to 5 steps with new workers, and every prompt
    group of steps 0..4 trains exactly once, within the staleness bound."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    common = ("trainer=fsdp_cpu", "tq/backend=ray", "recipe.topology=disaggregated",
              "recipe.rollout_workers=1", "++tq.backend.ray_init.log_to_driver=false")
    run("grpo", first, *common, "recipe.num_steps=3", "recipe.checkpoint_every=2")
    ckpt = first / "checkpoints" / "last.ckpt"
    assert ckpt.resolve().name == "rl-step-000002.ckpt"  # a link to the newest step's folder
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2
    run("grpo", resumed, *common, "recipe.num_steps=5", f"ckpt_path='{ckpt}'")
    summary = json.loads((resumed / "result.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 5
    assert [int(r["step"]) for r in rows(resumed)] == list(range(5))
    lines = (resumed / "prompt_groups.jsonl").read_text().splitlines()
    groups = [json.loads(line) for line in lines]
    per_step = 4  # FAST: recipe.prompts_per_step=4
    assert [g["prompt_groups"] for g in groups] == [
        list(range(s * per_step, (s + 1) * per_step)) for s in range(5)]
    assert all(g["staleness_max"] <= 1 for g in groups)

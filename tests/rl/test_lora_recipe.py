"""``model.lora`` through the recipe (issue 35's done-when): ``tq-train ... model.lora.r=8
engine=hf`` trains the adapter alone, the run dir's ``adapter/`` loads with
``PeftModel.from_pretrained`` onto the untouched base, the engine's logprobs stay the trainer's
after every adapter-only sync, and a run continued from its checkpoint gets back the adapter
and its optimizer state (the continued steps are those of one straight run)."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

pytest.importorskip("datasets")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import transformers
from safetensors.torch import load_file

from tq_plugin import cli
from tq_plugin.rl.tasks.tiny_text import make_tiny_model

FAST = ["recipe.ppo_epochs=1", "recipe.prompts_per_step=4", "trainer.enable_progress_bar=false"]
pytestmark = pytest.mark.usefixtures("fresh_hydra")  # tests/rl/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_text")
    model = make_tiny_model(out, train_rows=64, eval_rows=8)
    return model, [f"task.path={out / 'train.jsonl'}",
                   "task.reward._target_=tq_plugin.rl.tasks.rewards.token_match"]


def entry(monkeypatch, out, *overrides) -> dict:
    monkeypatch.setattr(sys, "argv", ["grpo", f"hydra.run.dir={out}", *FAST, *overrides])
    GlobalHydra.instance().clear()
    cli.main(config_name="grpo")
    return json.loads((out / "result.json").read_text())


def rows(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(240)
def test_tq_train_with_lora_r_8_leaves_a_peft_adapter_that_loads_onto_the_untouched_base(
        monkeypatch, tmp_path, tiny):
    model_dir, task = tiny
    before = load_file(str(model_dir / "model.safetensors"))
    summary = entry(monkeypatch, tmp_path, "task=prompts", *task, "model=hf_causal_lm",
                    f"model.pretrained_path={model_dir}", "model.lora.r=8", "engine=hf",
                    "recipe.num_steps=3", "recipe.beta=0.04")
    assert summary["status"] == "ok" and summary["engine"] == "hf"
    assert summary["weight_syncs"] == 2
    # Every sync moved the adapter alone, and the engine then scored as the trainer does.
    gaps = [float(r["gen_logprob_abs_diff"]) for r in rows(tmp_path)]
    assert len(gaps) == 3 and max(gaps) < 1e-4 and summary["max_logprob_gap"] < 1e-4
    assert [float(r["kl_ref"]) for r in rows(tmp_path)][-1] > 0  # the base, adapter disabled

    adapter = tmp_path / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(base, str(adapter))
    lora = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert summary["trainable_parameters"] == sum(p.numel() for p in lora.values())
    # LoRA's B starts at zero: trained, it is not.
    assert any(p.abs().sum() > 0 for n, p in lora.items() if ".lora_B." in n)
    # The base is untouched: the checkpoint on disk, and the run's frozen base weights.
    assert all(torch.equal(v, load_file(str(model_dir / "model.safetensors"))[k])
               for k, v in before.items())
    trained = load_file(str(tmp_path / "policy.safetensors"))
    frozen = {k[len("backbone."):].replace(".base_layer.", "."): v for k, v in trained.items()
              if k.startswith("backbone.") and ".lora_" not in k}
    assert all(torch.equal(frozen[k], v) for k, v in before.items() if k in frozen)
    assert sum(k in frozen for k in before) >= len(before) - 1  # a tied head is stored once
    # The merged hf_policy/ is the base with the adapter folded in (float32).
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_policy"),
                                                               local_files_only=True)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    assert torch.allclose(merged(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-5)


def _policy(run_dir):
    return load_file(str(run_dir / "policy.safetensors"))


@pytest.mark.timeout(240)
def test_a_lora_run_continued_from_its_checkpoint_restores_the_adapter_and_its_optimizer(
        monkeypatch, tmp_path):
    lora = ["model=hf_causal_lm", "model.lora.r=4", "engine=hf"]
    entry(monkeypatch, tmp_path / "first", *lora, "recipe.num_steps=2",
          "recipe.checkpoint_every=2")
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    adapters = [k for k in state["state_dict"] if ".lora_" in k]
    assert adapters
    # Adam's state for the adapter tensors alone: the frozen base has none.
    assert len(state["optimizer_states"][0]["state"]) == len(adapters)

    more = entry(monkeypatch, tmp_path / "more", *lora, "recipe.num_steps=4", f"ckpt_path={ckpt}")
    straight = entry(monkeypatch, tmp_path / "straight", *lora, "recipe.num_steps=4")
    assert more["steps"] == 4
    assert [r["reward"] for r in rows(tmp_path / "more")] == \
        [r["reward"] for r in rows(tmp_path / "straight")]
    a, b = _policy(tmp_path / "more"), _policy(tmp_path / "straight")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a if ".lora_" in k)
    assert more["trainable_parameters"] == straight["trainable_parameters"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_vllm_serves_the_lora_policy_through_its_lora_support(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    summary = entry(monkeypatch, tmp_path, "model=hf_causal_lm", "model.lora.r=8", "engine=vllm",
                    "recipe.num_steps=3", "recipe.beta=0.04")
    assert summary["engine"] == "vllm" and summary["weight_syncs"] == 2
    gaps = [float(r["gen_logprob_abs_diff"]) for r in rows(tmp_path)]
    assert len(gaps) == 3 and max(gaps) < 1e-4
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "engine_init" / "adapter" / "adapter_config.json").is_file()


def _composed(*overrides):
    from hydra import compose, initialize_config_module

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        return compose("grpo", overrides=[*FAST, *overrides])


@pytest.mark.timeout(120)
def test_what_lora_cannot_run_is_refused_naming_the_key(tmp_path):
    from tq_plugin.config import ConfigError
    from tq_plugin.rl.recipe import RLRecipe
    from tq_plugin.rl.topology.disaggregated import check_disaggregated

    lora = ["model=hf_causal_lm", "model.lora.r=4"]
    for engine in ("native", "hf"):
        cfg = _composed(*lora, f"engine={engine}", "recipe.topology=disaggregated",
                        "tq/backend=ray")
        with pytest.raises(ConfigError, match=r"^model\.lora with recipe\.topology=disaggregated "
                                              r"needs model\.pretrained_path"):
            check_disaggregated(cfg)
    check_disaggregated(_composed(*lora, "recipe.topology=disaggregated", "tq/backend=ray",
                                  f"model.pretrained_path={tmp_path}"))
    recipe = RLRecipe(_composed(*lora, "recipe.beta=0.1", "recipe.reference_path=x.safetensors"),
                      tmp_path)
    with pytest.raises(ConfigError, match=r"^recipe\.reference_path: x\.safetensors cannot be"):
        recipe.setup()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer", ["ddp_cpu", "fsdp_cpu"])
def test_two_ranks_train_the_one_process_lora_update(tmp_path, trainer):
    """trainer=ddp_cpu / fsdp_cpu with model.lora.r: the frozen base has no gradients (DDP
    all-reduces, FSDP2 reduce-scatters the adapters' alone); the ranks' steps are the
    one-process steps (rewards, reference KL, losses), and the adapter the ranks gather and
    save loads onto the base into the merged hf_policy/ they write."""
    import os
    import subprocess

    def run(out, *extra):
        cmd = [sys.executable, "-m", "tq_plugin.cli", "--config-name", "grpo",
               f"hydra.run.dir={out}", *FAST, "model=hf_causal_lm", "model.lora.r=8",
               "engine=hf", "recipe.num_steps=3", "recipe.beta=0.04", *extra]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=280, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return rows(out)

    one = run(tmp_path / "one")
    two = run(tmp_path / "two", f"trainer={trainer}", "trainer.devices=2")
    assert [r["reward"] for r in two] == [r["reward"] for r in one]
    for a, b in zip(two, one, strict=True):
        assert float(a["kl_ref"]) == pytest.approx(float(b["kl_ref"]), rel=1e-3, abs=1e-7)
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-3, abs=1e-6)
    # The adapter's full tensors (gathered from the ranks' shards) and the merged model agree:
    # merged = base + B @ A * alpha / r (alpha 8, r 8), and it moved off the base.
    run_dir = tmp_path / "two"
    base = load_file(str(run_dir / "engine_init" / "model.safetensors"))
    merged = load_file(str(run_dir / "hf_policy" / "model.safetensors"))
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    targets = [k[:-len(".weight")] for k in base if k.endswith(("q_proj.weight", "v_proj.weight"))]
    assert len(targets) == 4 and len(adapter) == 8
    for t in targets:
        a = adapter[f"base_model.model.{t}.lora_A.weight"]
        b = adapter[f"base_model.model.{t}.lora_B.weight"]
        assert a.shape == (8, 64) and b.shape == (64, 8)  # whole, not one rank's shard
        expected = base[f"{t}.weight"] + b @ a
        assert torch.allclose(merged[f"{t}.weight"], expected, atol=1e-6)
        assert not torch.allclose(merged[f"{t}.weight"], base[f"{t}.weight"], atol=1e-4)
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        str(run_dir / "engine_init"), local_files_only=True), str(run_dir / "adapter"))
    assert sum(p.numel() for n, p in loaded.named_parameters() if ".lora_" in n) == 4096

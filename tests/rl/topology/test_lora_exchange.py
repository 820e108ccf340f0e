"""A LoRA policy's weights cross the disaggregated exchange as its adapters alone: the trainer
publishes the adapters' flat row (not the frozen base), a worker loads it into its own policy
over the same base and pushes it to its engine, which then scores as the trainer does; a worker
without a checkpoint for its base is refused before anything starts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.rl.models.hf import HFCausalLM
from tq_plugin.rl.models.lora import trainable_parameters
from tq_plugin.rl.models.weights import write_engine_checkpoint
from tq_plugin.rl.topology.exchange import (
    WEIGHTS,
    WEIGHTS_PARTITION,
    WeightPublisher,
    newest_weights,
    weights_id,
    weights_snapshot,
)
from tq_plugin.rl.topology.worker import _Weights
from tq_plugin.rollout.engines.hf import HFEngine
from tq_plugin.rollout.engines.native import NativeEngine

LORA = {"r": 4, "alpha": 8.0}


def policy(seed: int = 0) -> HFCausalLM:
    """Built twice from one seed: the same frozen base, as one checkpoint gives every process."""
    torch.manual_seed(seed)
    return HFCausalLM(48, d_model=64, n_heads=2, n_layers=2, max_seq_len=32, lora=LORA).eval()


@pytest.mark.parametrize("engine_name", ["native", "hf"])
def test_the_adapters_alone_cross_the_store_and_the_workers_engine_follows(tmp_path,
                                                                           engine_name):
    trainer, worker = policy(), policy()
    with torch.no_grad():
        for p in trainer.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    client = LocalDataPlane()
    client.register_partition(WEIGHTS_PARTITION, [])
    WeightPublisher(client, keep=2).publish(trainer, 1)
    row = client.get_samples(partition_id=WEIGHTS_PARTITION, sample_ids=[weights_id(0, 1)],
                             select_fields=[WEIGHTS])[WEIGHTS]
    assert row.shape[-1] == trainable_parameters(trainer) < sum(p.numel() for p in
                                                                 trainer.parameters()) // 10
    if engine_name == "hf":
        engine = HFEngine(write_engine_checkpoint(worker, tmp_path / "engine_init"))
        served = lambda x: engine.model(input_ids=x).logits
    else:
        engine, served = NativeEngine(worker), worker
    held = _Weights(client, worker, engine)
    assert held.load_newest(newest_weights(client)) == 1 and engine.weight_version == 1
    x = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(served(x), trainer(x), atol=1e-5)
        assert torch.allclose(worker(x), trainer(x), atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_disaggregated_lora_run_sends_its_workers_the_adapters_alone(tmp_path, ray_session):
    """recipe.topology=disaggregated tq/backend=ray with model.lora.r=8 and engine=hf on the
    tiny checkpoint: every publish is the adapters' row, the workers' engines score as the
    trainer does (the IS ratio's gap is the staleness, not a wrong base), the adapter is saved."""
    import csv
    import json

    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from tq_plugin.rl.recipe import RLRecipe
    from tq_plugin.rl.tasks.tiny_text import make_tiny_model

    data = tmp_path / "data"
    model = make_tiny_model(data, train_rows=64, eval_rows=8)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=[
            "recipe.prompts_per_step=4", "recipe.ppo_epochs=1", "trainer.enable_progress_bar=false",
            "tq/backend=ray", "recipe.topology=disaggregated", "recipe.max_staleness=1",
            "tq.backend.ray_init.num_cpus=null", "task=prompts", f"task.path={data / 'train.jsonl'}",
            "task.reward._target_=tq_plugin.rl.tasks.rewards.token_match", "model=hf_causal_lm",
            f"model.pretrained_path={model}", "model.lora.r=8", "engine=hf",
            "recipe.rollout_workers=2", "recipe.num_steps=3"])
    GlobalHydra.instance().clear()
    run = tmp_path / "run"
    recipe = RLRecipe(cfg, run)
    try:
        recipe.setup()
        recipe.train()
    finally:  # the workers stop with the run, whatever happened
        recipe.source.stop()
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 3 and result["workers_lost"] == 0
    # What the trainer published after every optimizer step: the adapters' row alone.
    assert recipe.source.publisher.count >= 3
    assert weights_snapshot(recipe.module.policy).shape[-1] == result["trainable_parameters"] \
        == trainable_parameters(recipe.module.policy)
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    # Rows generated on the published adapters over the worker's own copy of the base: a wrong
    # base would put the gap near the logprobs' own size (~1), staleness keeps it small.
    assert max(float(r["gen_logprob_abs_diff"]) for r in rows[:1]) < 1e-4
    assert (run / "adapter" / "adapter_model.safetensors").is_file()

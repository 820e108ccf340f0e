"""``model.lora``: PEFT adapters on the HF policy. Only the adapters train (the optimizer holds
state for them alone), switching them off gives the base (the reference of ``recipe.beta``),
the base is written under the checkpoint's own names (a merged copy in float32), the ``hf`` and
``native`` engines take the adapter alone at a sync and then score as the trainer does, and the
config's rules are one line naming the key. ``lora: null`` / ``r: null`` builds today's model."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tq_plugin.config import ConfigError, validate_config
from tq_plugin.config.schema import HFCausalLMConfig, LoraConfig
from tq_plugin.rl.models.hf import HFCausalLM
from tq_plugin.rl.models.lora import (
    adapter_disabled,
    base_state_dict,
    peft_model_of,
    save_adapter,
    trainable_parameters,
)
from tq_plugin.rl.models.weights import engine_weights, hf_backbone, write_engine_checkpoint
from tq_plugin.rl.training.optim import build_optimizer
from tq_plugin.rollout.engine import ADAPTER_DIR
from tq_plugin.rollout.engines.hf import HFEngine
from tq_plugin.rollout.engines.native import NativeEngine

VOCAB = 48
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": None}


def policy(lora=None, seed: int = 0, **kw) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM(VOCAB, d_model=64, n_heads=2, n_layers=2, max_seq_len=32, lora=lora, **kw)


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


def nudge(model: torch.nn.Module, seed: int = 3) -> None:
    """Move every adapter tensor (as training would): LoRA's B starts at zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_no_lora_builds_todays_model_bit_for_bit():
    plain, off = policy(), policy(lora={"r": None, "alpha": 8.0})
    assert peft_model_of(off) is None
    assert plain.state_dict().keys() == off.state_dict().keys()
    assert all(torch.equal(v, off.state_dict()[k]) for k, v in plain.state_dict().items())
    assert all(p.requires_grad for p in off.parameters())


def test_only_the_adapters_train_and_the_optimizer_holds_state_for_them_alone():
    model = policy(LORA)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # q_proj and v_proj (PEFT's llama default) of 2 layers: A [4, 64] and B [64, 4] each.
    assert trainable_parameters(model) == 2 * 2 * (4 * 64 + 64 * 4)
    rc = type("RC", (), {"optimizer": "adamw", "weight_decay": 0.01})()
    opt = build_optimizer(rc, [(model, 1e-3)])
    model(ids()).float().logsumexp(-1).mean().backward()
    opt.step()
    held = {id(p) for p in opt.state}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_the_value_model_gets_its_own_adapter_and_a_trained_head():
    value = policy(LORA, value_head=True)
    trained = {n for n, p in value.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trained
    assert all(".lora_" in n for n in trained - {"head.weight", "head.bias"})


def test_the_adapter_disabled_is_the_base_model():
    base, model = policy(), policy(LORA)
    x = ids()
    assert torch.equal(base(x), model(x))  # B starts at zero: the initial policy is the base
    nudge(model)
    assert not torch.allclose(base(x), model(x))
    with adapter_disabled(model):
        assert torch.allclose(base(x), model(x), atol=1e-6)
    assert not torch.allclose(base(x), model(x))


def test_the_base_and_the_merged_weights_are_written_under_the_checkpoints_names():
    base, model = policy(), policy(LORA)
    nudge(model)
    plain = hf_backbone(base).state_dict()
    frozen = base_state_dict(hf_backbone(model))
    assert frozen.keys() == plain.keys()
    assert all(torch.equal(v, frozen[k]) for k, v in plain.items())
    merged = base_state_dict(hf_backbone(model), merged=True)
    reference = copy.deepcopy(model).peft_model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    assert all(torch.allclose(v, reference[k], atol=1e-7) for k, v in merged.items())


def test_the_peft_directory_loads_onto_the_untouched_base(tmp_path):
    model = policy(LORA)
    nudge(model)
    save_adapter(model, tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {
        "adapter_config.json", "adapter_model.safetensors"}
    loaded = peft.PeftModel.from_pretrained(hf_backbone(policy()), str(tmp_path / "adapter"))
    x = ids()
    assert torch.allclose(loaded(input_ids=x).logits, hf_backbone(model)(input_ids=x).logits,
                          atol=1e-6)


@pytest.mark.parametrize("engine_name", ["hf", "native"])
def test_a_sync_moves_the_adapter_alone_and_the_engine_then_scores_as_the_trainer(
        tmp_path, engine_name):
    model = policy(LORA)
    if engine_name == "hf":
        ckpt = write_engine_checkpoint(model, tmp_path / "engine_init")
        assert (ckpt / ADAPTER_DIR / "adapter_config.json").is_file()
        engine = HFEngine(ckpt)
        served = engine.model
    else:  # a disaggregated worker's native engine: its own policy over the same base
        served = policy(LORA)
        engine = NativeEngine(served)
    nudge(model)
    weights = list(engine_weights(model, engine_name))
    assert weights and all(".lora_" in n for n, _ in weights)
    assert sum(t.numel() for _, t in weights) == trainable_parameters(model)
    engine.update_weights(weights, version=1)
    x = ids()
    theirs = served(input_ids=x).logits if engine_name == "hf" else served(x)
    assert torch.allclose(theirs, model(x), atol=1e-5)
    # The frozen base is not the sync's to move: naming a base tensor is refused.
    base_name = next(n for n, p in (hf_backbone(model) if engine_name == "hf" else model)
                     .named_parameters() if not p.requires_grad)
    with pytest.raises(ValueError, match="must name every parameter"):
        engine.update_weights([*weights, (base_name, torch.zeros(1))], version=2)


def test_the_config_rules_name_the_key():
    with pytest.raises(ConfigError, match=r"^model\.lora\.r: must be > 0, got 0"):
        LoraConfig(r=0)
    with pytest.raises(ConfigError, match=r"^model\.lora\.alpha: must be > 0"):
        LoraConfig(r=8, alpha=0)
    with pytest.raises(ConfigError, match=r"^model\.lora\.dropout: must be in \[0, 1\)"):
        LoraConfig(r=8, dropout=1.0)
    with pytest.raises(ConfigError, match=r"^model\.lora\.target_modules: must be null"):
        LoraConfig(r=8, target_modules=[])
    assert HFCausalLMConfig(lora={"r": 8}).lora == LoraConfig(r=8)
    assert not LoraConfig().enabled and LoraConfig(r=8).enabled


def test_a_target_no_module_matches_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^model\.lora\.target_modules: "):
        policy({"r": 4, "target_modules": ["no_such_proj"]})


def test_the_composed_group_takes_model_lora_r_on_the_command_line():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo", overrides=["model=hf_causal_lm", "model.lora.r=8",
                                         "model.lora.target_modules=[q_proj,k_proj]"])
        off = compose("grpo", overrides=["model=hf_causal_lm"])
        with pytest.raises(Exception, match="lora"):
            compose("grpo", overrides=["model=hf_causal_lm", "model.lora.rank=8"])
    GlobalHydra.instance().clear()
    assert validate_config(cfg)["model"].lora == LoraConfig(r=8, target_modules=["q_proj", "k_proj"])
    assert validate_config(off)["model"].lora == LoraConfig()


def _scored(model: torch.nn.Module, prompt: list[int], completion) -> torch.Tensor:
    """The trainer's logprobs of an engine's sampled tokens (temperature 1, no restriction)."""
    x = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).float(), -1)[0, len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_serves_each_synced_adapter_as_a_new_lora_version(tmp_path):
    pytest.importorskip("vllm")
    from tq_plugin.rollout.engine import SamplingParams
    from tq_plugin.rollout.engines.vllm import VLLMEngine

    model = policy(LORA).eval()
    engine = VLLMEngine(write_engine_checkpoint(model, tmp_path / "engine_init"),
                        max_model_len=32, kv_cache_memory_bytes=64 << 20, max_loras=2)
    try:
        prompt, params = [1, 5, 9, 13], SamplingParams(max_new_tokens=6)
        seen = []
        for version in range(4):
            if version:
                nudge(model, seed=version)
                engine.update_weights(engine_weights(model, "vllm"), version=version)
            (done,) = engine.generate([prompt], params, seeds=[7])
            gap = (torch.tensor(done.logprobs) - _scored(model, prompt, done)).abs().max()
            assert gap < 1e-4, (version, float(gap))
            seen.append(engine.lora_request.lora_int_id)
        with adapter_disabled(model):  # the adapters moved the logprobs: the sync is seen
            assert (torch.tensor(done.logprobs) - _scored(model, prompt, done)).abs().max() > 1e-3
        assert len(set(seen)) == 4  # a new adapter id per weight version
        assert len(engine.adapters.dirs) == 2  # max_loras versions kept on disk
        with pytest.raises(ValueError, match="must name every adapter tensor"):
            engine.update_weights(list(engine_weights(model, "vllm"))[1:], version=9)
    finally:
        engine.close()


def test_the_adapters_stay_float32_over_a_bf16_base():
    model = policy(LORA, dtype="bfloat16")
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}

"""``model=hf_causal_lm``: a transformers causal LM as policy and value (the ``hf`` extra).

Nothing is downloaded: models are built from a config, or from a ``save_pretrained`` directory
the test writes itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from safetensors import safe_open

from tq_plugin.lightning.layout import PackedIndex
from tq_plugin.rl.models.hf import HFCausalLM, packed_slots
from tq_plugin.rl.models.protocol import check_models
from tq_plugin.rl.models.weights import POLICY_WEIGHTS, VALUE_WEIGHTS, load_weights

V = 19
LENGTHS = [7, 3, 5, 1]


def _packed_vs_alone(model: HFCausalLM, pad_multiple: int, **packed_kwargs):
    """(packed outputs of the real tokens, each sequence's outputs run alone, concatenated)."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (n,), generator=gen) for n in LENGTHS]
    index = PackedIndex(torch.tensor(LENGTHS), pad_multiple)
    row = index.pack(torch.cat(seqs))
    kwargs = {"position_ids": index.position_ids[None], "segment_ids": index.segment_ids[None]}
    kwargs.update(packed_kwargs)
    with torch.no_grad():
        packed = model(row, **{k: v for k, v in kwargs.items() if v is not None})
        alone = torch.cat([model(s[None])[0] for s in seqs])
    return packed[0][index.real], alone


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("value_head", [False, True], ids=["policy", "value"])
def test_a_packed_row_equals_each_sequence_alone(attn, pad_multiple, value_head):
    torch.manual_seed(0)
    model = HFCausalLM(V, attn_implementation=attn, value_head=value_head).eval()
    packed, alone = _packed_vs_alone(model, pad_multiple)
    assert packed.shape == alone.shape
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_head", [False, True], ids=["policy", "value"])
def test_a_packed_rows_outputs_are_tensors_of_their_own(value_head):
    """Not views: an FSDP2 root module's returned view loses its pre-backward hook to an
    in-place op (torch warns on every forward; the disaggregated FSDP test asserts it does not)."""
    model = HFCausalLM(V, value_head=value_head)
    index = PackedIndex(torch.tensor(LENGTHS))
    out = model(index.pack(torch.randint(0, V, (sum(LENGTHS),))),
                position_ids=index.position_ids[None], segment_ids=index.segment_ids[None])
    assert out.shape[:2] == (1, sum(LENGTHS)) and not out._is_view()


def test_cu_seqlens_stands_for_segment_ids():
    torch.manual_seed(0)
    model = HFCausalLM(V).eval()
    index = PackedIndex(torch.tensor(LENGTHS))
    packed, alone = _packed_vs_alone(model, 1, segment_ids=None, cu_seqlens=index.cu_seqlens)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    # The comparison is sensitive: the same row as one plain causal sequence differs.
    packed, alone = _packed_vs_alone(model, 1, segment_ids=None, position_ids=None)
    assert (packed - alone).abs().max() > 1e-2


def test_the_block_mask_alone_keeps_sequences_apart():
    """Positions that never restart give transformers no packing hint; llama's rotary positions
    are relative, so the sequences still compute what they do alone iff the mask separates them."""
    torch.manual_seed(0)
    model = HFCausalLM(V).eval()
    index = PackedIndex(torch.tensor(LENGTHS))
    packed, alone = _packed_vs_alone(model, 1, position_ids=torch.arange(index.total)[None])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_packed_slots_place_each_sequence_on_its_own_row():
    """Token t of a packed row goes to (its sequence's row, its offset) of the padded block,
    whatever the segment ids are called."""
    slot, segments, longest = packed_slots(torch.tensor([[5, 5, 2, 2, 2, 9]]))
    assert (segments, longest) == (3, 3)
    assert slot.tolist() == [0, 1, 3, 4, 5, 6]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_policy_and_value_follow_the_interface(model_type):
    policy = HFCausalLM(V, model_type=model_type, output_token_ids=[1, 2, 9])
    value = HFCausalLM(V, model_type=model_type, value_head=True)
    check_models(policy, value, vocab_size=V, layout="packed")
    # The value model is the policy's backbone class without the LM head, plus a value head.
    assert type(value.backbone) is type(policy.backbone.base_model)
    assert value.head.out_features == 1
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert value(ids).shape == (1, 5)
    logits = policy(ids)
    assert logits.shape == (1, 5, V) and logits[..., [0, 3]].max() < -1e3  # restricted outputs
    # Dropout follows model.dropout (0 here) even where the transformers config defaults to 0.1.
    policy.train()
    torch.testing.assert_close(policy(ids), logits)


def test_built_from_the_shipped_config_group():
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("ppo", overrides=["model=hf_causal_lm", "model.n_layers=1"])
    GlobalHydra.instance().clear()
    model = instantiate(cfg.model, vocab_size=V, value_head=True)
    assert isinstance(model, HFCausalLM)
    assert model.backbone.config.num_hidden_layers == 1
    assert model.backbone.config.max_position_embeddings == 64  # the group's default size


@pytest.fixture
def pretrained(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=48)
    torch.manual_seed(1)
    lm = transformers.LlamaForCausalLM(cfg)
    lm.save_pretrained(tmp_path / "lm")
    return tmp_path / "lm", lm


def test_pretrained_path_loads_policy_and_value_backbone(pretrained):
    path, lm = pretrained
    policy = HFCausalLM(V, pretrained_path=str(path), max_seq_len=48)
    value = HFCausalLM(V, pretrained_path=str(path), max_seq_len=48, value_head=True)
    for name, tensor in lm.state_dict().items():
        torch.testing.assert_close(policy.backbone.state_dict()[name], tensor)
        if name.startswith("model."):
            torch.testing.assert_close(value.backbone.state_dict()[name[len("model."):]], tensor)
    check_models(policy, value, vocab_size=V, layout="packed")
    assert policy(torch.tensor([[1, 2, 3]])).shape == (1, 3, 24)  # the checkpoint's vocabulary


def test_bad_model_settings_are_refused_naming_the_key(pretrained, tmp_path):
    path, lm = pretrained
    with pytest.raises(ValueError, match=r"checkpoint's vocab_size \(24\) is smaller than the "
                                         r"task's \(30\)"):
        HFCausalLM(30, pretrained_path=str(path), max_seq_len=48)
    with pytest.raises(ValueError, match=r"model.max_seq_len=64 exceeds .* \(48\)"):
        HFCausalLM(V, pretrained_path=str(path), max_seq_len=64)
    with pytest.raises(FileNotFoundError, match="model.pretrained_path: .* holds no config.json"):
        HFCausalLM(V, pretrained_path=str(tmp_path / "missing"))
    # Pickled weights are never loaded: a directory with only pytorch_model.bin is refused.
    torch.save(dict(lm.state_dict()), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        HFCausalLM(V, pretrained_path=str(path), max_seq_len=48)
    with pytest.raises(ValueError, match="model.attn_implementation: must be one of"):
        HFCausalLM(V, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="model.model_type: transformers has no model type"):
        HFCausalLM(V, model_type="no_such_model")


def test_media_patches_replace_the_placeholder_embeddings():
    torch.manual_seed(0)
    model = HFCausalLM(V, image_token_id=6, patch_dim=12).eval()
    ids = torch.tensor([[1, 6, 15, 3]])
    a, b = torch.zeros(1, 12), torch.ones(1, 12)
    out_a, out_b = model(ids, image_patches=a), model(ids, image_patches=b)
    torch.testing.assert_close(out_a[0, 0], out_b[0, 0])  # before the image: causal, unchanged
    assert not torch.allclose(out_a[0, 1:], out_b[0, 1:])
    with pytest.raises(ValueError, match="holds 2 patches but the batch has 1"):
        model(ids, image_patches=torch.zeros(2, 12))


FAST = ["model=hf_causal_lm", "recipe.num_steps=2", "recipe.ppo_epochs=2",
        "recipe.prompts_per_step=4", "trainer.enable_progress_bar=false"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("config_name", "packing"), [("ppo", "sequence_packing"),
                                                      ("grpo", "dynamic_batching")],
                         ids=["ppo-packed", "grpo-padded"])
def test_recipe_trains_the_hf_model_and_saves_its_weights(tmp_path, config_name, packing):
    from tq_plugin.rl.recipe import RLRecipe

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose(config_name, overrides=[*FAST, f"tq/packing={packing}"])
    GlobalHydra.instance().clear()
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    assert isinstance(recipe.module.policy, HFCausalLM)
    recipe.train()
    summary = recipe.cleanup()
    assert summary["status"] == "ok" and summary["steps"] == 2
    # The engine's sampled logprobs and the HF policy's recomputation agree in the training
    # layout: packed rows see only their own sequence.
    assert summary["max_logprob_gap"] < 1e-4

    common = {"vocab_size": recipe.task.vocab_size, "image_token_id": 6, "patch_dim": None}
    roles = [("policy", POLICY_WEIGHTS, recipe.module.policy, {})]
    if config_name == "ppo":
        roles.append(("value", VALUE_WEIGHTS, recipe.module.value, {"value_head": True}))
    else:
        assert not (tmp_path / VALUE_WEIGHTS).exists()
    for role, name, trained, extra in roles:
        with safe_open(str(tmp_path / name), framework="pt") as f:
            assert f.metadata()["role"] == role
        fresh = instantiate(cfg.model, **common, **extra)
        assert not torch.equal(fresh.backbone.get_input_embeddings().weight,
                               trained.backbone.get_input_embeddings().weight)
        load_weights(fresh, tmp_path / name)
        for key, tensor in trained.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], tensor), key


def test_the_config_group_takes_a_pretrained_path(pretrained, tmp_path):
    from tq_plugin.config import ConfigError, validate_config
    from tq_plugin.rl.recipe import RLRecipe

    path, lm = pretrained
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("ppo", overrides=[*FAST, f"model.pretrained_path={path}",
                                        "model.max_seq_len=48"])
        bad = compose("ppo", overrides=[*FAST, "model.attn_implementation=flash_attention_2"])
    GlobalHydra.instance().clear()
    with pytest.raises(ConfigError, match="model.attn_implementation: must be one of"):
        validate_config(bad)
    recipe = RLRecipe(cfg, tmp_path / "run")
    recipe.setup()
    for name, tensor in lm.state_dict().items():
        torch.testing.assert_close(recipe.module.policy.backbone.state_dict()[name], tensor)

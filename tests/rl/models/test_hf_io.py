"""Hugging Face checkpoints in and out (issue 25 sections 3 and 4).

In: with ``model.pretrained_path`` the sizes the config leaves unset come from the checkpoint
(``max_seq_len`` among them), a size that contradicts it is a ``ConfigError`` naming the key,
a Hub id gets the command that downloads it. Out: the trained policy is a ``save_pretrained``
directory (config, safetensors, tokenizer, generation config) that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load offline; the slow test runs the recipe end to end (also under
``trainer.precision=bf16-mixed model.gradient_checkpointing=true``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

transformers = pytest.importorskip("transformers")

from tq_plugin.config import ConfigError, validate_config
from tq_plugin.rl.models.hf import HFCausalLM, resolve_sizes
from tq_plugin.rl.models.weights import write_hf_checkpoint
from tq_plugin.rl.tasks.tiny_text import build_model, train_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A qwen2 checkpoint (96 wide, 3 heads of 32, 1 layer, 80 positions) with its tokenizer."""
    out = tmp_path_factory.mktemp("ckpt")
    tok = train_tokenizer(["reverse: a b c", "c b a", " Correct.", " Try again."])
    lm = build_model(tok, d_model=96, n_layers=1, n_heads=3, max_positions=80)
    lm.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out, tok


def _compose(*overrides):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
            return compose("grpo", overrides=["model=hf_causal_lm", *overrides])
    finally:
        GlobalHydra.instance().clear()


def test_unset_sizes_come_from_the_checkpoint(checkpoint):
    path, _ = checkpoint
    sizes = resolve_sizes(str(path), d_model=None, n_layers=None, n_heads=None, head_dim=None,
                          max_seq_len=None)
    assert sizes == {"d_model": 96, "n_layers": 1, "n_heads": 3, "head_dim": 32,
                     "max_seq_len": 80}
    # A size the user set that agrees is kept; max_seq_len may cap the checkpoint's.
    assert resolve_sizes(str(path), d_model=96, max_seq_len=48)["max_seq_len"] == 48
    # Without a checkpoint: the group's defaults.
    assert resolve_sizes(None, d_model=None, max_seq_len=None)["max_seq_len"] == 64


@pytest.mark.parametrize(("key", "value", "rule"), [
    ("d_model", 64, r"model.d_model=64 contradicts the checkpoint's hidden_size=96"),
    ("n_heads", 4, r"model.n_heads=4 contradicts the checkpoint's num_attention_heads=3"),
    ("max_seq_len", 128, (r"model.max_seq_len=128 exceeds the checkpoint's "
                         r"max_position_embeddings \(80\)")),
])
def test_a_size_that_contradicts_the_checkpoint_is_a_config_error(checkpoint, key, value, rule):
    path, _ = checkpoint
    with pytest.raises(ConfigError, match=rule):
        resolve_sizes(str(path), **{key: value})
    with pytest.raises(ConfigError, match=rule):
        HFCausalLM(40, pretrained_path=str(path), **{key: value})


def test_the_recipe_takes_the_checkpoints_max_seq_len(checkpoint, tmp_path):
    from tq_plugin.rl.recipe import RLRecipe

    path, _ = checkpoint
    cfg = _compose(f"model.pretrained_path={path}", "task=prompts",
                   f"task.path={tmp_path / 'none.jsonl'}")
    assert cfg.model.max_seq_len is None  # the user gave none
    recipe = RLRecipe(cfg, tmp_path / "run")
    assert (recipe.cfg.model.max_seq_len, recipe.cfg.model.d_model) == (80, 96)
    plain = RLRecipe(_compose(), tmp_path / "plain")
    assert (plain.cfg.model.max_seq_len, plain.cfg.model.n_heads) == (64, 2)


def test_a_hub_id_gets_one_message_and_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    cfg = _compose("model.pretrained_path=Qwen/Qwen2.5-0.5B")
    with pytest.raises(ConfigError, match=r"model.pretrained_path: 'Qwen/Qwen2.5-0.5B' is not a "
                                          r"local directory.*huggingface-cli download "
                                          r"Qwen/Qwen2.5-0.5B --local-dir <dir>"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match="huggingface-cli download"):
        HFCausalLM(40, pretrained_path="Qwen/Qwen2.5-0.5B")
    # A missing local path is named as such, not taken for a Hub id.
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        HFCausalLM(40, pretrained_path=str(tmp_path / "missing"))


def test_eos_and_pad_come_from_the_tokenizer_else_the_generation_config(checkpoint, tmp_path):
    from tq_plugin.rl.tasks.prompts import special_ids

    path, tok = checkpoint
    assert special_ids(tok, path) == (tok.eos_token_id, tok.pad_token_id)
    bare = train_tokenizer(["reverse: a b c"])
    bare.eos_token, bare.pad_token = None, None  # a tokenizer that names neither
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [5, 6], "pad_token_id": 4}))
    assert special_ids(bare, tmp_path) == (5, 4)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert special_ids(bare, tmp_path) == (5, 5)  # pad falls back to EOS
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(ConfigError, match="task.tokenizer: neither the tokenizer .* names an "
                                          "eos token"):
        special_ids(bare, tmp_path)


def test_the_policy_is_written_as_a_directory_transformers_loads(checkpoint, tmp_path):
    path, tok = checkpoint
    policy = HFCausalLM(len(tok), pretrained_path=str(path))
    with torch.no_grad():
        policy.backbone.get_input_embeddings().weight.add_(0.5)  # "trained"
    out = write_hf_checkpoint(policy, tmp_path / "hf_policy", tokenizer=tok)
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    for name, tensor in policy.backbone.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, msg=name)
    again = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert again("reverse: a b").input_ids == tok("reverse: a b").input_ids
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (tok.eos_token_id, tok.pad_token_id)
    # Written again over the old one (a periodic checkpoint, a resumed run): replaced whole.
    write_hf_checkpoint(policy, out)
    assert not (out / "tokenizer.json").exists() and not list(tmp_path.glob(".*tmp"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("extra", [[], ["trainer.precision=bf16-mixed",
                                         "model.gradient_checkpointing=true"]],
                         ids=["fp32", "bf16-mixed+checkpointing"])
def test_the_recipe_leaves_the_trained_policy_as_an_hf_directory(tmp_path, extra):
    from tq_plugin.rl.recipe import RLRecipe
    from tq_plugin.rl.tasks.tiny_text import make_tiny_model

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    model_dir = make_tiny_model(tmp_path / "data", train_rows=32, eval_rows=4)
    cfg = _compose("task=prompts", f"task.path={tmp_path / 'data' / 'train.jsonl'}",
                   "task.reward._target_=tq_plugin.rl.tasks.rewards.token_match",
                   f"model.pretrained_path={model_dir}", "engine=hf", "recipe.num_steps=2",
                   "recipe.ppo_epochs=1", "recipe.prompts_per_step=4", "recipe.save_hf_every=1",
                   "trainer.enable_progress_bar=false", *extra)
    run = tmp_path / "run"
    recipe = RLRecipe(cfg, run)
    recipe.setup()
    recipe.train()
    summary = recipe.cleanup()
    assert summary["status"] == "ok" and summary["steps"] == 2
    hf = run / "hf_policy"
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True)
    start = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    assert transformers.AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    moved = [n for n, t in trained.state_dict().items()
             if not torch.equal(t, start.state_dict()[n])]
    assert moved, "the written policy holds the untrained weights"
    for name, tensor in recipe.module.policy.backbone.state_dict().items():
        assert torch.equal(trained.state_dict()[name], tensor), name
    assert sorted(p.name for p in (run / "checkpoints").glob("hf-step-*")) == [
        "hf-step-000001", "hf-step-000002"]

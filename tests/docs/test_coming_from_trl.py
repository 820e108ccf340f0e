"""``recipe=trl_defaults`` holds TRL 1.16 ``GRPOConfig``'s defaults, and the "Coming from TRL"
page, ``tq_plugin.cli.TRL_NAMES`` (the "did you mean recipe.lr (TRL's learning_rate)" table)
and the composed configs agree (fast tier: composes only)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from tq_plugin import cli
from tq_plugin.config import validate_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "coming-from-trl.md"

# TRL 1.16 GRPOConfig's defaults a preset can hold: name -> (recipe key, the value here, the
# value GRPOConfig's field holds). Where TRL spells the value otherwise, both are given:
# ``adamw_torch_fused`` is AdamW; ``steps_per_generation`` None is gradient_accumulation_steps
# (1); ``min_p`` None is off (0.0); per_device_train_batch_size 8 completions are one prompt of
# num_generations 8.
TRL_DEFAULTS = {
    "learning_rate": ("lr", 1e-6, 1e-6),
    "lr_scheduler_type": ("lr_scheduler", "linear", "linear"),
    "warmup_steps": ("warmup_steps", 0, 0),
    "weight_decay": ("weight_decay", 0.0, 0.0),
    "optim": ("optimizer", "adamw", "adamw_torch_fused"),
    "max_grad_norm": ("max_grad_norm", 1.0, 1.0),
    "num_iterations": ("ppo_epochs", 1, 1),
    "steps_per_generation": ("minibatches", 1, None),
    "per_device_train_batch_size": ("prompts_per_step", 1, 8),
    "num_generations": ("group_size", 8, 8),
    "max_completion_length": ("max_new_tokens", 512, 512),
    "temperature": ("temperature", 1.0, 1.0),
    "top_p": ("top_p", 1.0, 1.0),
    "top_k": ("top_k", 0, 0),
    "min_p": ("min_p", 0.0, None),
    "repetition_penalty": ("repetition_penalty", 1.0, 1.0),
    "loss_type": ("loss_type", "dapo", "dapo"),
    "epsilon": ("clip_eps", 0.2, 0.2),
    "epsilon_high": ("clip_eps_high", None, None),
    "importance_sampling_level": ("importance_sampling_level", "token", "token"),
    "scale_rewards": ("scale_rewards", "group", "group"),
    "mask_truncated_completions": ("mask_truncated_completions", False, False),
    "entropy_coef": ("entropy_coef", 0.0, 0.0),
    "beta": ("beta", 0.0, 0.0),
}


@pytest.fixture(scope="module")
def composed():
    """``--config-name train`` with ``recipe=grpo`` and ``recipe=trl_defaults``, composed."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfgs = {name: compose("train", overrides=[f"recipe={name}"])
                for name in ("grpo", "trl_defaults")}
    GlobalHydra.instance().clear()
    return cfgs


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b))
    return a == b


# ------------------------------------------------------------------------ the preset
def test_trl_defaults_holds_trls_defaults(composed):
    recipe = validate_config(composed["trl_defaults"])["recipe"]
    assert recipe.algorithm == "grpo"
    for trl_name, (key, value, _) in TRL_DEFAULTS.items():
        assert _same(getattr(recipe, key), value), (trl_name, key, getattr(recipe, key), value)


def test_the_table_is_trls(composed):
    trl = pytest.importorskip("trl", reason="the trl extra is not installed")
    fields = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    for trl_name, (_, _, trl_value) in TRL_DEFAULTS.items():
        assert trl_name in fields, trl_name
        assert _same(fields[trl_name], trl_value), (trl_name, fields[trl_name], trl_value)


# ------------------------------------------------------------------------- the page
def _literal(cell: str) -> object:
    text = cell.strip().strip("`")
    if text in ("None", "null"):  # Python's and YAML's; TRL's report_to "none" is a string
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _rows() -> dict[str, list[str]]:
    """The field tables' rows by TRL name: [name, TRL default, key here, grpo, trl_defaults,
    note]."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 6 and cells[0] != "`GRPOConfig`":  # a row, not a header
            rows[cells[0].strip("`")] = cells
    return rows


def _first_key(cell: str) -> str | None:
    found = re.search(r"`([\w.<>]+)", cell)
    return found.group(1) if found else None


def test_the_page_names_every_trl_name_the_cli_maps():
    rows = _rows()
    for trl_name, target in cli.TRL_NAMES.items():
        key = re.match(r"[\w.<>]+", target).group(0)
        assert trl_name in rows, f"docs/coming-from-trl.md has no row for {trl_name}"
        assert _first_key(rows[trl_name][2]) == key, (trl_name, rows[trl_name][2], key)


def test_a_recipe_key_spelt_otherwise_is_in_the_cli_table():
    for trl_name, cells in _rows().items():
        key = _first_key(cells[2])
        if key and key.startswith("recipe.") and key != f"recipe.{trl_name}":
            assert cli.TRL_NAMES.get(trl_name, "").split(" ")[0] == key, (trl_name, key)


def test_the_pages_defaults_are_the_configs(composed):
    checked = 0
    for trl_name, cells in _rows().items():
        key = _first_key(cells[2])
        if not key or not key.startswith("recipe."):
            continue
        for column, config in ((3, "grpo"), (4, "trl_defaults")):
            value = OmegaConf.select(composed[config], key, default="<absent>")
            assert value != "<absent>", f"{key} (the row of {trl_name}) is not a key"
            assert _same(value, _literal(cells[column])), (trl_name, config, value, cells[column])
            checked += 1
    assert checked >= 40


def test_the_pages_trl_column_is_trls():
    trl = pytest.importorskip("trl", reason="the trl extra is not installed")
    fields = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    rows = _rows()
    assert len(rows) >= 30
    for trl_name, cells in rows.items():
        assert trl_name in fields, f"{trl_name}: not a GRPOConfig field"
        assert _same(fields[trl_name], _literal(cells[1])), (trl_name, fields[trl_name], cells[1])


# ---------------------------------------------------------------------- the CLI table
def test_every_cli_target_exists(composed):
    for trl_name, target in cli.TRL_NAMES.items():
        key = re.match(r"[\w.<>]+", target).group(0)
        if key.startswith("recipe."):
            value = OmegaConf.select(composed["grpo"], key, default="<absent>")
            assert value != "<absent>", (trl_name, key)
        elif "=" in target and not key.startswith(("trainer.", "logger")):
            group, option = target.split("=")
            assert (ROOT / "conf" / group / f"{option}.yaml").is_file(), (trl_name, target)


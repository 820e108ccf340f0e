"""Every shipped model preset (``conf/model/*.yaml``) builds attention that projects ``d_model``
to ``d_model`` (``n_heads`` heads of ``d_model / n_heads``), policy and value alike (issue 20)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from torch import nn

import tq_plugin

PRESETS = sorted(p.stem for p in (Path(tq_plugin.__file__).parent / "conf" / "model").glob("*.yaml"))
V = 16


def _attention_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The attention projections of either model family, by their role: q, k, v, out."""
    out = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv", "proj"):
            out[name] = mod
    return out


def _compose(preset: str, *overrides: str):
    if preset == "hf_causal_lm":
        pytest.importorskip("transformers")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
            return compose("ppo", overrides=[f"model={preset}", *overrides])
    finally:
        GlobalHydra.instance().clear()


def _size(cfg, key: str) -> int:
    """``model.<key>``, or the HF group's default where the config leaves it null."""
    value = cfg.model[key]
    if value is None:
        from tq_plugin.rl.models.hf import DEFAULT_SIZES

        value = DEFAULT_SIZES[key]
    return value


def _check(model: nn.Module, d: int, heads: int, head_dim: int) -> None:
    projections = _attention_linears(model)
    assert projections, "no attention projection found"
    inner = heads * head_dim
    for name, lin in projections.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "qkv":
            assert (lin.in_features, lin.out_features) == (d, 3 * inner), name
        elif leaf in ("o_proj", "proj"):
            assert (lin.in_features, lin.out_features) == (inner, d), name
        else:
            assert (lin.in_features, lin.out_features) == (d, inner), name


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("value_head", [False, True])
def test_each_preset_projects_hidden_size_to_hidden_size(preset, value_head):
    cfg = _compose(preset)
    d, heads = _size(cfg, "d_model"), _size(cfg, "n_heads")
    model = instantiate(cfg.model, vocab_size=V, value_head=value_head)
    _check(model, d, heads, d // heads)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model(ids).shape == ((1, 4) if value_head else (1, 4, V))


def test_a_set_head_dim_is_kept():
    cfg = _compose("hf_causal_lm", "model.head_dim=8")
    _check(instantiate(cfg.model, vocab_size=V), _size(cfg, "d_model"), _size(cfg, "n_heads"), 8)


def test_hf_head_dim_follows_a_resized_model():
    cfg = _compose("hf_causal_lm", "model.d_model=96", "model.n_heads=6")
    model = instantiate(cfg.model, vocab_size=V)
    assert model.backbone.config.head_dim == 16
    _check(model, 96, 6, 16)

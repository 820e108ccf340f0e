"""The model interface the recipes need (``tq_plugin.rl.models.protocol``): a model that breaks it
is refused at start-up with an error naming the rule, before any rollout or write."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from torch import nn

from tq_plugin.rl.models.protocol import (
    ModelInterfaceError,
    TokenModel,
    check_model,
    check_models,
    output_bias,
    scatter_patches,
)
from tq_plugin.rl.models.tiny import TinyTransformer

V = 19


class ShiftedLM(TinyTransformer):
    """The issue's ``mymodel.MyLM``: drops the last position (logits for t+1 only)."""

    def forward(self, input_ids, **kwargs):
        return super().forward(input_ids, **kwargs)[:, :-1]


class PaddedOnlyLM(TinyTransformer):
    """Takes no packed-layout inputs."""

    def forward(self, input_ids):
        return super().forward(input_ids)


class CrossSegmentLM(TinyTransformer):
    """Takes ``segment_ids`` but ignores them: a packed sequence attends to the ones before it."""

    def forward(self, input_ids, *, position_ids=None, segment_ids=None, image_patches=None):
        return super().forward(input_ids, position_ids=position_ids)


class BidirectionalLM(TinyTransformer):
    """Every position sees the whole row: generation on a right-padded buffer would break."""

    def forward(self, input_ids, **kwargs):
        out = super().forward(input_ids, **kwargs)
        return out + out.mean(dim=1, keepdim=True)


class WideLM(TinyTransformer):
    """Embeds the task's whole vocabulary but predicts only its first ``vocab_size`` tokens."""

    def __init__(self, vocab_size):
        super().__init__(V)
        self.head = nn.Linear(self.head.in_features, vocab_size)
        self.register_buffer("out_bias", torch.zeros(vocab_size), persistent=False)


class Values3D(TinyTransformer):
    def forward(self, input_ids, **kwargs):
        return super().forward(input_ids, **kwargs).unsqueeze(-1)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_tiny_transformer_follows_the_interface(layout):
    policy, value = TinyTransformer(V, output_token_ids=[1, 2, 9]), TinyTransformer(V, value_head=True)
    assert isinstance(policy, TokenModel)
    policy.train()
    check_models(policy, value, vocab_size=V, layout=layout, media=False)
    assert policy.training and value.training  # the check restores the mode it found


def test_a_model_that_drops_a_position_is_refused_naming_the_shape():
    with pytest.raises(ModelInterfaceError, match=r"ShiftedLM.*one output per input token.*"
                                                  r"got \(2, 4, 19\)"):
        check_model(ShiftedLM(V), role="policy", vocab_size=V, layout="padded")


def test_packed_layout_needs_the_packed_keywords():
    check_model(PaddedOnlyLM(V), role="policy", vocab_size=V, layout="padded")
    with pytest.raises(ModelInterfaceError, match=r"packed layout passes \['position_ids', "
                                                  r"'segment_ids'\]"):
        check_model(PaddedOnlyLM(V), role="policy", vocab_size=V, layout="packed")


def test_attention_across_packed_sequences_is_refused():
    check_model(CrossSegmentLM(V), role="policy", vocab_size=V, layout="padded")
    with pytest.raises(ModelInterfaceError, match="packed row must equal its sequences run alone"):
        check_model(CrossSegmentLM(V), role="policy", vocab_size=V, layout="packed")


def test_a_non_causal_model_is_refused():
    with pytest.raises(ModelInterfaceError, match="must be causal"):
        check_model(BidirectionalLM(V), role="policy", vocab_size=V, layout="padded")


def test_output_shapes_per_role():
    with pytest.raises(ModelInterfaceError, match=r"values \[2, 5\].*got \(2, 5, 1\)"):
        check_model(Values3D(V, value_head=True), role="value", vocab_size=V, layout="padded")
    with pytest.raises(ModelInterfaceError, match=r"V >= vocab_size \(19\).*got \(2, 5, 12\)"):
        check_model(WideLM(12), role="policy", vocab_size=V, layout="padded")
    with pytest.raises(ModelInterfaceError, match=r"fails on the padded probe.*vocab_size 25.*"
                                                  r"IndexError"):
        check_model(TinyTransformer(V), role="policy", vocab_size=25, layout="padded")
    with pytest.raises(ModelInterfaceError, match=r"logits"):  # a value model as the policy
        check_model(TinyTransformer(V, value_head=True), role="policy", vocab_size=V,
                    layout="padded")


def test_media_needs_image_patches_and_a_module():
    with pytest.raises(ModelInterfaceError, match="image_patches"):
        check_model(PaddedOnlyLM(V), role="policy", vocab_size=V, layout="padded", media=True)
    with pytest.raises(ModelInterfaceError, match="torch.nn.Module"):
        check_model(lambda ids: ids, role="policy", vocab_size=V, layout="padded")


def test_output_bias_and_patch_scatter():
    bias = output_bias(5, [1, 3])
    assert bias.tolist() == [-1e4, 0.0, -1e4, 0.0, -1e4]
    assert output_bias(3, None).tolist() == [0.0, 0.0, 0.0]
    ids = torch.tensor([[4, 6, 1, 6]])
    out = scatter_patches(torch.zeros(1, 4, 2), ids, 6, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert out[0].tolist() == [[0, 0], [1, 2], [0, 0], [3, 4]]
    with pytest.raises(ValueError, match="holds 1 patches but the batch has 2"):
        scatter_patches(torch.zeros(1, 4, 2), ids, 6, torch.ones(1, 2))


@pytest.fixture
def bad_model_module(monkeypatch):
    """``model._target_=tq_test_models.ShiftedLM``: an importable home for the broken model."""
    mod = types.ModuleType("tq_test_models")
    mod.ShiftedLM = ShiftedLM
    monkeypatch.setitem(sys.modules, "tq_test_models", mod)
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def test_the_recipe_refuses_a_broken_model_at_setup(bad_model_module, tmp_path):
    from tq_plugin.rl.recipe import RLRecipe

    with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
        cfg = compose("ppo", overrides=["model._target_=tq_test_models.ShiftedLM",
                                        "recipe.num_steps=1", "recipe.prompts_per_step=4"])
    recipe = RLRecipe(cfg, tmp_path)
    with pytest.raises(ModelInterfaceError, match=r"ShiftedLM as the policy model.*one output per "
                                                  r"input token"):
        recipe.setup()
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


def test_a_module_stays_a_module():
    # check_model runs forward under no_grad: it must not leave gradients or change weights.
    model = TinyTransformer(V)
    before = [p.detach().clone() for p in model.parameters()]
    check_model(model, role="policy", vocab_size=V, layout="packed")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert isinstance(model, nn.Module)

"""``recipe.is_correction``: each mode's weights against a hand computation, the policy loss
they scale, the figures logged per optimizer step, and the config keys (issue 17 §4)."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from torch import nn

from tq_plugin.config import ConfigError, PackingConfig, RecipeConfig, validate_config
from tq_plugin.data_plane import (
    ADVANTAGES,
    GENERATION_LOGPROBS,
    INPUT_IDS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    SAMPLE_MASK,
    TOKEN_MASK,
)
from tq_plugin.lightning.layout import POSITION_IDS, SEGMENT_IDS
from tq_plugin.rl.algorithms.losses import is_correction_weights
from tq_plugin.rl.training.metrics import add_is_stats, is_metrics
from tq_plugin.rl.training.module import RLModule

LN = math.log
# Ratios pi_old / pi_gen per action token; position 0 is a prompt token, None a prompt or pad
# token whose (huge) ratio must count nowhere.
#   row 0: 1.5, 0.25, 3, 1      geometric mean (1.125)^(1/4) = 1.0299: inside [0.5, 2]
#   row 1: 0.8, 1.25            geometric mean 1
#   row 2: 3, 4                 geometric mean sqrt(12) = 3.46: above 2
#   row 3: 0.3, 0.5             geometric mean sqrt(0.15) = 0.387: below 0.5
RATIOS = [[None, 1.5, 0.25, 3.0, 1.0], [None, 0.8, 1.25, None, None],
          [None, 3.0, 4.0, None, None], [None, 0.3, 0.5, None, None]]
EXPECTED = {  # mode -> weights (1 off the mask), cap 2, band [0.5, 2]
    "none": [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]],
    "token_tis": [[1, 1.5, 0.25, 2, 1], [1, 0.8, 1.25, 1, 1], [1, 2, 2, 1, 1], [1, 0.3, 0.5, 1, 1]],
    # AReaL's decoupled objective: the behaviour policy only in the capped weight pi_prox/pi_behav
    "decoupled": [[1, 1.5, 0.25, 2, 1], [1, 0.8, 1.25, 1, 1], [1, 2, 2, 1, 1], [1, 0.3, 0.5, 1, 1]],
    "icepop": [[1, 1.5, 0, 0, 1], [1, 0.8, 1.25, 1, 1], [1, 0, 0, 1, 1], [1, 0, 0.5, 1, 1]],
    "seq_mask_tis": [[1, 1.5, 0.25, 2, 1], [1, 0.8, 1.25, 1, 1], [1, 0, 0, 1, 1], [1, 0, 0, 1, 1]],
}
MASKED = {"none": 0, "token_tis": 0, "decoupled": 0, "icepop": 5, "seq_mask_tis": 4}


def _columns():
    mask = torch.tensor([[0 if r is None else 1 for r in row] for row in RATIOS])
    gen = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    ratio = torch.tensor([[1e4 if r is None else r for r in row] for row in RATIOS])
    prev = gen + ratio.log()  # pi_old / pi_gen = ratio
    return prev, gen, mask


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_each_mode_weights_and_masks_as_computed_by_hand(mode):
    prev, gen, mask = _columns()
    w, masked = is_correction_weights(prev, gen, mask, mode=mode, cap=2.0, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor(EXPECTED[mode], dtype=torch.float32))
    assert int(masked.sum()) == MASKED[mode]
    assert not masked[mask == 0].any()


def test_sequence_mask_follows_packed_segments():
    # The same four sequences back to back in one packed row: the same weights.
    prev, gen, mask = _columns()
    lengths = [5, 3, 3, 3]
    pack = [torch.cat([t[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
            for t in (prev, gen, mask)]
    segments = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)).unsqueeze(0)
    w, _ = is_correction_weights(*pack, mode="seq_mask_tis", cap=2.0, low=0.5, high=2.0,
                                 sequence_ids=segments)
    expected = [x for i, n in enumerate(lengths) for x in EXPECTED["seq_mask_tis"][i][:n]]
    torch.testing.assert_close(w[0], torch.tensor(expected, dtype=torch.float32))


class Uniform(nn.Module):
    """Zero logits over 4 tokens: every token's logprob is -ln 4."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.bias.expand(*input_ids.shape, 4)


def _train_one(mode: str, *, correct_is: bool | None, topology: str = "colocated",
               packed: bool = False) -> RLModule:
    """One microbatch with ratio 1 against prev_logprobs (so each token's policy term is
    -A w), advantages 1, 2, 3, ... over the action tokens."""
    prev_, gen_, mask = _columns()
    gen = torch.full((4, 5), -LN(4.0)) - (prev_ - gen_)  # prev = -ln 4, the policy's logprob
    prev = torch.full((4, 5), -LN(4.0))
    adv = torch.arange(20, dtype=torch.float32).view(4, 5) + 1
    rc = RecipeConfig(algorithm="grpo", topology=topology, rollout_workers=1,
                      is_correction={"mode": mode, "cap": 2.0, "min": 0.5, "max": 2.0})
    m = RLModule(policy=Uniform(), value=None, recipe=rc, packing=PackingConfig(),
                 correct_is=correct_is)
    m.loss_norm = float(mask.sum())
    ids = torch.zeros(4, 5, dtype=torch.int64)
    td = {INPUT_IDS: ids, INPUT_LENGTHS: torch.full((4,), 5), TOKEN_MASK: mask,
          SAMPLE_MASK: torch.ones(4), PREV_LOGPROBS: prev, GENERATION_LOGPROBS: gen,
          ADVANTAGES: adv}
    if packed:  # the four rows as four segments of one packed row (segments of 5 tokens)
        td = {k: (v.reshape(1, -1) if v.dim() == 2 else v) for k, v in td.items()}
        td[SEGMENT_IDS] = torch.arange(4).repeat_interleave(5).unsqueeze(0)
        td[POSITION_IDS] = torch.arange(5).repeat(4).unsqueeze(0)
    m._last_loss = float(m.training_step(td, 0)["loss"].detach())
    m._adv, m._mask = adv, mask
    return m


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_the_policy_loss_is_scaled_by_the_modes_weights(mode, packed):
    m = _train_one(mode, correct_is=True, packed=packed)
    w = torch.tensor(EXPECTED[mode])
    expected = -(w * m._adv * m._mask).sum() / m._mask.sum()
    assert m._last_loss == pytest.approx(float(expected), rel=1e-5)
    assert m._mb_stats["is_masked_tokens"] == MASKED[mode]


def test_the_correction_applies_where_the_step_source_is_off_policy():
    """The module weights tokens only when asked (``correct_is``); the recipe asks where the
    step source's rows may come from older weights (``StepSource.off_policy``: the
    disaggregated one) or the engine is not the trained module."""
    from tq_plugin.rl.topology.colocated import Colocated
    from tq_plugin.rl.topology.disaggregated import Disaggregated

    mask = _columns()[2] > 0
    plain = -(torch.arange(20.0).view(4, 5) + 1)[mask].sum() / mask.sum()  # every weight 1
    assert _train_one("icepop", correct_is=False)._last_loss == pytest.approx(float(plain))
    assert _train_one("icepop", correct_is=True)._last_loss != pytest.approx(float(plain))
    assert Disaggregated.off_policy and not Colocated.off_policy


def test_mismatch_figures_per_optimizer_step():
    m = _train_one("icepop", correct_is=True)
    ratios = [r for row in RATIOS for r in row if r is not None]
    acc = {"action_tokens": m._mb_stats["action_tokens"]}
    add_is_stats(acc, m._mb_stats)
    add_is_stats(acc, {**m._mb_stats, "is_ratio_max": 0.5})  # a second microbatch: max kept
    acc["action_tokens"] *= 2
    figures = is_metrics(acc)
    assert figures["is_ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert figures["is_ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert figures["is_masked_fraction"] == pytest.approx(5 / 10)
    assert figures["gen_logprob_abs_diff"] == pytest.approx(
        sum(abs(LN(r)) for r in ratios) / len(ratios), rel=1e-5)


# ---------------------------------------------------------------- config
@pytest.fixture
def compose_recipe():
    GlobalHydra.instance().clear()

    def run(name: str, *overrides: str):
        with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
            return validate_config(compose(name, overrides=list(overrides)))["recipe"]

    yield run
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_recipes_default_to_token_tis_with_the_old_cap_key(compose_recipe, name):
    rc = compose_recipe(name)
    assert rc.is_correction.mode == "token_tis" and rc.is_cap == 2.0
    assert compose_recipe(name, "recipe.is_truncation=1.5").is_cap == 1.5  # the key before
    rc = compose_recipe(name, "recipe.is_correction.mode=icepop", "recipe.is_correction.cap=3",
                        "recipe.is_truncation=2.0")
    assert rc.is_correction.mode == "icepop" and rc.is_cap == 3.0


@pytest.mark.parametrize(("override", "match"), [
    ("recipe.is_correction.mode=tis", "recipe.is_correction.mode: must be one of"),
    ("recipe.is_correction.cap=0.5", "recipe.is_correction.cap: must be >= 1.0"),
    ("recipe.is_correction.min=0", r"recipe.is_correction.min: must be in \(0, 1\]"),
    ("recipe.is_correction.min=1.5", r"recipe.is_correction.min: must be in \(0, 1\]"),
    ("recipe.is_correction.max=0.9", "recipe.is_correction.max: must be >= 1.0"),
])
def test_bad_settings_are_refused_naming_the_key(compose_recipe, override, match):
    with pytest.raises(ConfigError, match=match):
        compose_recipe("grpo", override)


def test_unknown_keys_are_refused():
    with pytest.raises(ConfigError, match=r"recipe.is_correction: unknown key\(s\) \['capp'\]"):
        RecipeConfig(is_correction={"capp": 2.0})

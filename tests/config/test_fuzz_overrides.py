"""Hypothesis over Hydra overrides of the typed groups (reliability issue: fuzz every entry point).

Each drawn set of overrides must end in exactly one of two documented ways, or succeed:

* Hydra refuses it at compose (``ConfigCompositionException``: a wrong type or an unknown key,
  the message naming the key), or
* ``validate_config`` refuses it (``ConfigError``, a ``ValueError``: a cross-field or range rule,
  naming the dotted key), or
* it validates, and then the typed sections hold exactly what was asked for.

Never a raw ``TypeError`` / ``AttributeError`` from inside the schema code.
"""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tq_plugin.config import ConfigError, validate_config
from tq_plugin.config.schema import SCHEMAS

# The sections every train config holds, and the keys a user may set in each.
SECTIONS = {group.replace("/", "."): schema for group, schema in SCHEMAS.items()
            if group != "tq/backend"}  # the backend's keys start processes; covered elsewhere
KEYS = sorted(
    (section, f.name)
    for section, schema in SECTIONS.items()
    for f in dataclasses.fields(schema)
    if not f.name.startswith("_") and f.type in ("int", "float", "bool", "str", "int | None",
                                                 "float | None", "str | None")
)
VALUES = st.one_of(
    st.integers(-3, 5),
    st.sampled_from([0, 1, 7, 64, 2048, 10**9]),
    st.sampled_from([0.0, 0.5, -1.5, 1e9]),
    st.sampled_from(["lots", "padded", "packed", "none", "first_fit_decreasing", "largest_first",
                     "float32", "bfloat16", "ppo", "grpo", "null", "true", "false", "''"]),
    st.booleans(),
)


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@st.composite
def override_sets(draw):
    picks = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    out = [f"{section}.{key}={_render(draw(VALUES))}" for section, key in picks]
    if draw(st.booleans()):
        out.insert(0, f"tq/packing={draw(st.sampled_from(['none', 'sequence_packing', 'dynamic_batching']))}")
    if draw(st.booleans()):
        out.insert(0, f"recipe={draw(st.sampled_from(['ppo', 'grpo']))}")
    return out


def _compose(overrides: list[str]):
    """Compose as a run does (HydraConfig set: validate_config sees the overrides)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
        HydraConfig().set_config(cfg)
        return cfg
    finally:
        GlobalHydra.instance().clear()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=override_sets())
@example(overrides=["tq.packing.train_mb_tokens=lots"])  # a wrong type: Hydra names the key
@example(overrides=["tq.packing.train_mb_tokens=0"])  # a range rule: validate_config names it
@example(overrides=["tq.packing.use_dynamic_batches=true"])  # both packing modes
@example(overrides=["recipe.save_artifacts=-1"])  # found: OmegaConf made -1 a silent True
@example(overrides=["tq.packing.name=true"])  # found: a bare true became the text 'True'
def test_every_override_set_is_refused_naming_a_key_or_lands_typed(overrides):
    keys = [o.split("=", 1)[0] for o in overrides]
    try:
        cfg = _compose(overrides)
    except ConfigCompositionException as err:
        event("refused at compose")
        text = f"{err} {err.__cause__}"
        assert any(k in text or k.rsplit(".", 1)[-1] in text for k in keys), text
        return
    try:
        typed = validate_config(cfg)
    except ConfigError as err:
        event("refused by validate_config")
        # names the key it refuses (one of those set, or the key a cross-field rule is about)
        assert any(s in str(err) for s in SECTIONS), str(err)
        return
    event("valid")
    for override in overrides:
        key, raw = override.split("=", 1)
        if "/" in key or "." not in key:
            continue
        section, name = key.rsplit(".", 1)
        value = getattr(typed[section], name)
        assert _render(value) == raw or str(value) == raw or (raw == "null" and value is None) \
            or (raw == "''" and value == "") or float(value) == float(raw), (key, value, raw)


@pytest.mark.parametrize("bad", ["tq/packng=none", "+tq/packng=none"])
def test_a_misspelled_group_is_named(bad):
    try:
        cfg = _compose([bad])
    except ConfigCompositionException as err:
        assert "packng" in f"{err} {err.__cause__}"
        return
    with pytest.raises(ConfigError, match="tq/packng"):
        validate_config(cfg)

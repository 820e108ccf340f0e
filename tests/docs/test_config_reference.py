"""The configuration reference is generated from the schemas and the YAML, and leaves nothing out
(``docs/hooks/config_reference.py``, run by the documentation build)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from tq_plugin import cli
from tq_plugin.config.schema import EXTRA_SCHEMAS, SCHEMAS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ref():
    path = ROOT / "docs" / "hooks" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("tq_docs_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(ref) -> str:
    return ref.render()


def test_every_key_has_a_doc_line_and_no_fallback_is_stale(ref):
    assert ref.missing_docs() == [], ("document these keys with a comment above their schema "
                                      "field (tq_plugin/config/schema.py)")
    assert ref.stale_key_docs() == [], "KEY_DOCS names keys that no longer exist"


def test_every_group_and_option_is_listed(page):
    for group in cli.config_groups("train"):
        assert f"\n## {group.name}\n" in page, group.name
        for option in group.options:
            assert f"| `{option}`" in page, (group.name, option)


def _fields(schema: type, prefix: str):
    for f in dataclasses.fields(schema):
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if nested is not None and dataclasses.is_dataclass(nested):
            yield from _fields(nested, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}"


def test_every_schema_field_is_a_row(page):
    for group, schema in [*SCHEMAS.items(),
                          ("tq/backend", EXTRA_SCHEMAS["backend_ray"]),
                          ("tq/backend", EXTRA_SCHEMAS["backend_transferqueue"]),
                          ("model", EXTRA_SCHEMAS["model_hf_causal_lm"]),
                          ("task", EXTRA_SCHEMAS["task_prompts"])]:
        for key in _fields(schema, group.replace("/", ".")):
            assert f"| `{key}` |" in page, key


def test_values_come_from_the_options(page):
    # recipe: GRPO's preset learning rate, PPO's; packing: the layout differs per option.
    row = next(line for line in page.splitlines() if line.startswith("| `recipe.lr` |"))
    assert "`0.0007`" in row and "`0.003`" in row
    row = next(line for line in page.splitlines() if line.startswith("| `tq.packing.layout` |"))
    assert row.count("`padded`") == 2 and row.count("`packed`") == 1

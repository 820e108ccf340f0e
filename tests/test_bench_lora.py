"""bench_lora's learning comparison: which finished arm it reuses, and the figures it prints."""

from __future__ import annotations

import pytest

from benchmarks.bench_lora import LEARN, LORA, _differences, learning_markdown


def test_a_saved_config_differs_only_where_a_value_it_holds_changed():
    saved = {"recipe": {"lr": 2e-5, "num_steps": 12}, "model": {"lora": {"r": None}}}
    # a key added since (a default) is no difference; a changed value is, named by its path
    assert _differences(saved, {"recipe": {"lr": 2e-5, "num_steps": 12, "new_key": 1},
                                "model": {"lora": {"r": None, "alpha": 8.0}}}) == []
    assert _differences(saved, {"recipe": {"lr": 1e-5, "num_steps": 12},
                                "model": {"lora": {"r": None}}}) == [
        "recipe.lr: 2e-05 then, 1e-05 now"]


def _arm(start: float, end: float, trainable: int | None = None) -> dict:
    return {"curve": [(0, start), (11, end)], "final": {"accuracy": end}, "wall_s": 100.0,
            "trainable_parameters": trainable}


def test_the_learning_section_prints_its_key_figures_and_the_ratio_to_full_fine_tuning():
    markdown, figures = learning_markdown({
        "full fine-tuning": _arm(0.25, 0.65, 134_515_008),
        "LoRA": _arm(0.25, 0.55, 2_442_240),
        "TRL GRPOTrainer + peft_config": _arm(0.25, 0.45)})
    assert figures == {"full_gain": "+0.400", "lora_gain": "+0.300", "trl_lora_gain": "+0.200",
                       "lora_of_full": "75%"}
    assert all(v in markdown for v in figures.values())
    assert "| LoRA | 2,442,240 | 0.250 | 0.550 | +0.300 | 100 |" in markdown
    # the adapters it names are the ones the probes measure
    assert f"model.lora.target_modules={LORA['target_modules']}" in LEARN


@pytest.mark.parametrize("full_end", [0.25, 0.2])
def test_no_ratio_is_printed_when_full_fine_tuning_gained_nothing(full_end):
    markdown, figures = learning_markdown({
        "full fine-tuning": _arm(0.25, full_end), "LoRA": _arm(0.25, 0.3),
        "TRL GRPOTrainer + peft_config": _arm(0.25, 0.3)})
    assert "lora_of_full" not in figures and "the ratio is undefined" in markdown

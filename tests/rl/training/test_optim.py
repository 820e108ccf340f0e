"""recipe.optimizer / weight_decay / lr_scheduler / warmup / max_grad_norm: each does what it says
(transformers' schedules as the reference), and a run writes every step's lr to metrics.csv."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from tq_plugin.config import ConfigError, RecipeConfig
from tq_plugin.rl.training.optim import (
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    warmup_steps,
)


def _rc(**kw) -> SimpleNamespace:
    base = {"optimizer": "adamw", "weight_decay": 0.0, "lr_scheduler": "constant",
            "warmup_steps": 0, "warmup_ratio": 0.0}
    return SimpleNamespace(**(base | kw))


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedule_matches_transformers(schedule, warmup):
    transformers = pytest.importorskip("transformers")
    total, lr = 17, 1e-3
    names = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
    p = torch.nn.Parameter(torch.zeros(2))
    ref_opt = torch.optim.SGD([p], lr=lr)
    ref = transformers.get_scheduler(names[schedule], ref_opt, num_warmup_steps=warmup,
                                     num_training_steps=total)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    ours = build_scheduler(_rc(lr_scheduler=schedule, warmup_steps=warmup), ours_opt, total)
    for _ in range(total):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"],
                                                               abs=1e-12)
        ref_opt.step(), ours_opt.step()
        ref.step(), ours.step()


def test_warmup_ratio_rounds_up_and_multiplier_edges():
    assert warmup_steps(_rc(warmup_ratio=0.1), 25) == 3
    assert warmup_steps(_rc(warmup_steps=4, warmup_ratio=0.0), 25) == 4
    assert lr_multiplier(0, schedule="linear", total=10, warmup=2) == 0.0
    assert lr_multiplier(1, schedule="cosine", total=10, warmup=2) == 0.5
    assert lr_multiplier(2, schedule="cosine", total=10, warmup=2) == 1.0
    assert lr_multiplier(6, schedule="cosine", total=10, warmup=2) == pytest.approx(0.5)
    assert lr_multiplier(9, schedule="linear", total=10, warmup=0) == pytest.approx(0.1)


def test_weight_decay_spares_biases_and_norms_and_adamw_at_zero_is_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(_rc(weight_decay=0.1), [(model, 1e-2)])
    assert isinstance(opt, torch.optim.AdamW)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    assert sum(len(g["params"]) for g in opt.param_groups) == 4

    def one_step(kind: str) -> list[torch.Tensor]:
        torch.manual_seed(1)
        m = torch.nn.Linear(4, 3)
        o = build_optimizer(_rc(optimizer=kind), [(m, 1e-2)])
        m(torch.randn(5, 4)).square().sum().backward()
        o.step()
        return [p.detach().clone() for p in m.parameters()]

    for a, b in zip(one_step("adamw"), one_step("adam"), strict=True):
        assert torch.equal(a, b)
    assert isinstance(build_optimizer(_rc(optimizer="sgd"), [(model, 1e-2)]), torch.optim.SGD)


@pytest.mark.parametrize(("key", "value", "rule"), [
    ("lr_scheduler", "step", "must be one of"),
    ("optimizer", "lion", "must be one of"),
    ("warmup_ratio", 1.5, "[0, 1)"),
    ("max_grad_norm", 0.0, "> 0"),
    ("weight_decay", -0.1, ">= 0"),
])
def test_bad_optimiser_keys_name_the_key(key, value, rule):
    with pytest.raises(ConfigError, match=rf"recipe\.{key}: .*{re.escape(rule)}"):
        RecipeConfig(**{key: value})
    with pytest.raises(ConfigError, match="not both"):
        RecipeConfig(warmup_steps=2, warmup_ratio=0.1)


def _run(train_in_process, tmp_path, *overrides: str) -> list[dict]:
    return train_in_process(tmp_path, "grpo", "recipe.num_steps=6", "recipe.ppo_epochs=1",
                            "recipe.prompts_per_step=4", *overrides)


@pytest.mark.slow
def test_run_writes_the_scheduled_lr_and_the_clipped_norm(train_in_process, tmp_path):
    rows = _run(train_in_process, tmp_path, "recipe.lr=1e-3", "recipe.lr_scheduler=cosine",
                "recipe.warmup_steps=2", "recipe.weight_decay=0.01", "recipe.max_grad_norm=0.5")
    lrs = [float(r["lr"]) for r in rows]
    expected = [1e-3 * lr_multiplier(k, schedule="cosine", total=6, warmup=2) for k in range(6)]
    assert lrs == pytest.approx(expected, rel=1e-5, abs=1e-12)
    assert all(float(r["grad_norm"]) > 0 for r in rows)
    resolved = json.loads((tmp_path / "result.json").read_text())
    assert resolved["steps"] == 6


def test_clip_bounds_the_norm_and_reports_it_before():
    from tq_plugin.rl.training.module import RLModule

    model = torch.nn.Linear(8, 8)
    model(torch.randn(4, 8)).sum().mul(100).backward()
    before = float(torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in model.parameters()])))
    assert before > 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fake = SimpleNamespace(rc=SimpleNamespace(max_grad_norm=0.5), _grad_norm=None)
    RLModule.configure_gradient_clipping(fake, opt)
    after = float(torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in model.parameters()])))
    assert fake._grad_norm == pytest.approx(before, rel=1e-5)
    assert after == pytest.approx(0.5, rel=1e-4)


def test_trainer_gradient_clip_val_is_refused_in_one_line(train_in_process, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(train_in_process, tmp_path, "+trainer.gradient_clip_val=0.5")
    err = capsys.readouterr().err
    assert "trainer.gradient_clip_val: the RL module clips its gradients itself; set " \
           "recipe.max_grad_norm instead" in err
    assert "Traceback" not in err and not (tmp_path / "metrics.csv").exists()

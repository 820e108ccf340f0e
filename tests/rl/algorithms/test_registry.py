"""The registries of policy losses and advantage estimators: the built-in names and their
aggregations, a user's loss and estimator selected by name, the one-line errors for an unknown
name and for a module ``recipe.imports`` cannot import."""

from __future__ import annotations

import sys

import pytest
import torch

from tq_plugin.config import ConfigError, RecipeConfig
from tq_plugin.rl.algorithms.advantages import compute_advantages
from tq_plugin.rl.algorithms.losses import (
    aggregate_loss,
    loss_normalizer,
    policy_objective,
    sequence_token_counts,
)
from tq_plugin.rl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    advantage_estimator_name,
    check_registered,
    import_user_modules,
    register_advantage_estimator,
    register_policy_loss,
    registered_losses,
)

BUILTIN_LOSSES = {"grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
                  "dapo": "token_mean", "cispo": "token_mean", "bnpo": "microbatch_token_mean"}


def _builtin(fn) -> bool:
    return fn.__module__.startswith("tq_plugin.")


@pytest.fixture
def scratch_registries():
    """The built-in names only during the test (a documentation example run in this process may
    have registered its own), the registries as they were after it."""
    losses, estimators = dict(POLICY_LOSSES), dict(ADVANTAGE_ESTIMATORS)
    for name in [n for n, entry in POLICY_LOSSES.items() if not _builtin(entry.fn)]:
        del POLICY_LOSSES[name]
    for name in [n for n, fn in ADVANTAGE_ESTIMATORS.items() if not _builtin(fn)]:
        del ADVANTAGE_ESTIMATORS[name]
    yield
    POLICY_LOSSES.clear()
    POLICY_LOSSES.update(losses)
    ADVANTAGE_ESTIMATORS.clear()
    ADVANTAGE_ESTIMATORS.update(estimators)


def test_the_builtin_names_and_their_aggregations():
    assert {n: POLICY_LOSSES[n].aggregation for n in BUILTIN_LOSSES} == BUILTIN_LOSSES
    assert {"gae", "grpo"} <= set(ADVANTAGE_ESTIMATORS)


# The name-keyed aggregation the registry replaced, verbatim: the pin that every built-in name
# aggregates exactly as before.
def _old_normalizer(loss_type, *, action_tokens, sequences, minibatches, max_completion_tokens):
    per_batch_sequences = sequences / minibatches
    if loss_type == "grpo":
        return max(1.0, per_batch_sequences)
    if loss_type == "dr_grpo":
        return max(1.0, per_batch_sequences * max_completion_tokens)
    return float(max(1, action_tokens // minibatches))


def _old_aggregate(loss_type, terms, mask, *, norm, microbatches=1, sequence_ids=None):
    m = (mask > 0).to(terms.dtype)
    if loss_type == "grpo":
        counts = sequence_token_counts(mask, sequence_ids).clamp(min=1.0)
        return (terms * m / counts).sum() / norm
    if loss_type == "bnpo":
        return (terms * m).sum() / m.sum().clamp(min=1.0) / max(1, microbatches)
    return (terms * m).sum() / norm


@pytest.mark.parametrize("loss_type", sorted(BUILTIN_LOSSES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_builtin_loss_aggregates_as_before(loss_type, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(6, 10, generator=gen) > 0.3).float()
    terms = torch.randn(6, 10, generator=gen)
    segments = torch.arange(3).repeat_interleave(20).view(6, 10)  # packed: 3 sequences
    totals = {"action_tokens": int(mask.sum()), "sequences": 6, "minibatches": 2,
              "max_completion_tokens": 7}
    norm = loss_normalizer(loss_type, **totals)
    assert norm == _old_normalizer(loss_type, **totals)
    for ids in (None, segments):
        new = aggregate_loss(loss_type, terms, mask, norm=norm, microbatches=3, sequence_ids=ids)
        old = _old_aggregate(loss_type, terms, mask, norm=norm, microbatches=3, sequence_ids=ids)
        assert torch.equal(new, old)


def test_a_users_loss_is_selected_by_name_and_aggregated_as_it_declared(scratch_registries):
    @register_policy_loss("reinforce_seq", aggregation="seq_mean_token_mean")
    def reinforce(logprobs, old_logprobs, advantages, mask, **_):
        zeros = torch.zeros_like(mask, dtype=torch.bool)
        return -advantages * logprobs, {"ratio": torch.ones_like(logprobs),
                                        "log_ratio": torch.zeros_like(logprobs),
                                        "clipped": zeros, "clip_low": zeros, "clip_high": zeros}

    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lp = torch.full((2, 2), -0.5, requires_grad=True)
    adv = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    norm = loss_normalizer("reinforce_seq", action_tokens=3, sequences=2, minibatches=1,
                           max_completion_tokens=2)
    loss, _ = policy_objective("reinforce_seq", lp, lp.detach(), adv, mask, norm=norm)
    # each sequence's token mean (1.0 and 0.5), then the mean over the 2 sequences
    assert float(loss) == pytest.approx((2 * 0.5 + 0.5) / 2)
    loss.backward()
    assert lp.grad is not None
    check_registered(RecipeConfig(algorithm="grpo", loss_type="reinforce_seq"))
    assert "reinforce_seq" in registered_losses()


def test_a_users_estimator_is_selected_by_name(scratch_registries):
    @register_advantage_estimator("reward_to_all")
    def reward_to_all(*, mask, total_reward, **_):
        return total_reward.unsqueeze(1) * mask, None

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, returns = compute_advantages("reward_to_all", mask=mask, total_reward=torch.tensor([3.0]))
    assert returns is None and adv.tolist() == [[3.0, 3.0, 0.0]]
    rc = RecipeConfig(algorithm="grpo", advantage_estimator="reward_to_all")
    check_registered(rc)
    assert advantage_estimator_name(rc) == "reward_to_all"


def test_the_estimator_in_force_defaults_to_the_algorithms():
    assert advantage_estimator_name(RecipeConfig(algorithm="ppo")) == "gae"
    assert advantage_estimator_name(RecipeConfig(algorithm="grpo")) == "grpo"
    assert advantage_estimator_name(RecipeConfig(algorithm="ppo", advantage_estimator="grpo")) \
        == "grpo"


def test_an_unknown_name_is_one_line_listing_the_registered(scratch_registries):
    register_policy_loss("my_loss", aggregation="token_mean")(lambda *a, **k: None)
    with pytest.raises(ConfigError) as err:
        check_registered(RecipeConfig(algorithm="grpo", loss_type="dapoo"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("recipe.loss_type: unknown loss 'dapoo' (did you mean 'dapo'?); "
                              "registered: bnpo, cispo, dapo, dr_grpo, grpo, my_loss;")
    with pytest.raises(ConfigError, match=r"^recipe.advantage_estimator: unknown advantage "
                                          r"estimator 'vtrace'; registered: gae, grpo;"):
        check_registered(RecipeConfig(algorithm="grpo", advantage_estimator="vtrace"))


def test_the_schema_takes_any_name_and_refuses_a_non_name():
    RecipeConfig(algorithm="grpo", loss_type="not_registered_yet")  # checked after the imports
    with pytest.raises(ConfigError, match="recipe.loss_type: must be a registered name"):
        RecipeConfig(algorithm="grpo", loss_type="")
    with pytest.raises(ConfigError, match="recipe.imports: must be a list of module names"):
        RecipeConfig(algorithm="grpo", imports="mypkg.losses")


def test_a_name_taken_by_another_function_is_refused_the_same_one_is_not(scratch_registries):
    def mine(*a, **k):
        return None

    register_policy_loss("twice", aggregation="token_mean")(mine)
    register_policy_loss("twice", aggregation="token_mean")(mine)  # a module re-imported
    with pytest.raises(ValueError, match="'grpo' is already"):
        register_policy_loss("grpo", aggregation="token_mean")(mine)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        register_policy_loss("x", aggregation="sum")
    with pytest.raises(ValueError, match="'gae' is already"):
        register_advantage_estimator("gae")(mine)


def test_an_unknown_name_at_the_call_names_the_registered(scratch_registries):
    with pytest.raises(ValueError, match=r"estimator must be one of \['gae', 'grpo'"):
        compute_advantages("vtrace", mask=torch.ones(1, 1), total_reward=torch.ones(1))
    with pytest.raises(ValueError, match="loss_type must be one of"):
        aggregate_loss("gspo", torch.ones(1, 1), torch.ones(1, 1), norm=1.0)


def test_import_user_modules_registers_a_users_module_from_the_working_directory(
        tmp_path, monkeypatch, scratch_registries):
    (tmp_path / "tq_test_user_losses.py").write_text(
        "from tq_plugin.rl.algorithms.registry import register_policy_loss\n"
        "@register_policy_loss('from_user_module', aggregation='token_mean')\n"
        "def loss(logprobs, old_logprobs, advantages, mask, **_):\n"
        "    return -advantages * logprobs, {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        import_user_modules(["tq_test_user_losses"])
        assert "from_user_module" in POLICY_LOSSES
        check_registered(RecipeConfig(algorithm="grpo", loss_type="from_user_module"))
    finally:
        sys.modules.pop("tq_test_user_losses", None)


def test_import_user_modules_errors_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "tq_test_broken.py").write_text("raise RuntimeError('bad\\nthings')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        import_user_modules(["tq_test_no_such_module"])
    assert str(err.value) == ("recipe.imports: cannot import 'tq_test_no_such_module' "
                              "(ModuleNotFoundError: No module named 'tq_test_no_such_module')")
    with pytest.raises(ConfigError) as err:
        import_user_modules(["tq_test_broken"])
    assert str(err.value) == "recipe.imports: cannot import 'tq_test_broken' (RuntimeError: bad)"
    with pytest.raises(ConfigError, match="entries must be module names"):
        import_user_modules([""])
